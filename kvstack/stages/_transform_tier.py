"""The tier of ``coding: transform`` (``quantize``, ``quantized_prune``; docs/quantization.md): transform-coded keys,
KIVI or transform-coded values.

Keys: each token's keys of all KV heads of a layer form one vector ``k`` [Hkv * Dk], un-rotated to pre-RoPE by its
position and expressed in an orthonormal basis ``U`` [C, C] (C = Hkv * Dk) that decorrelates the heads and puts most
of the energy in a few components. A :class:`ComponentCode` fitted on the tier's first tokens spends
``key_bits * C`` bits per token over those components by their variance, each component with its own Lloyd-Max
levels (transform coding as in KVTC, arXiv 2511.01815; the allocation and the levels adapt to each cache). No scale or
zero point per token or group by default; with ``key_scale: token`` each token's component vector is centred by the
coder's mean and divided by its root mean square (relative to the tier's, stored per token in the stage's scale
format) before it is coded, and multiplied back when read — gain-shape coding (Sabin & Gray, IEEE Trans. ASSP 1984;
the norm kept apart as in QJL, arXiv 2406.03482), so that the levels are fitted to the keys' directions and a token
far quieter than the others is not lost in the levels' steps. ``key_bits`` is an average, so it may be fractional (a
multiple of 1/4 whose total, ``key_bits * C``, is whole bytes: :func:`key_code_bits`). The basis (``key_basis``):

* ``weights`` — the left singular vectors of the layer's ``k_proj`` weight
  (:func:`kvstack.kernels.transform_code.weight_basis`): nothing to fit, but blind to how anisotropic the layer's
  inputs are;
* ``calibrated`` — the principal axes of the layer's pre-RoPE keys on calibration text (KVTC's PCA), fitted once when
  the stack is applied (:func:`calibrate_bases`): on the text given to ``kvstack.apply(..., calibration=...)``,
  else on :data:`SAMPLED_SEQUENCES` x :data:`SAMPLED_TOKENS` tokens the model samples itself from its BOS token (seed
  :data:`SAMPLED_SEED`), so no data is needed (the same text on one machine; another machine's bf16 rounding samples
  another). Fitted on 2,048 tokens, it cuts the attention error of 1- to 4-bit keys by 1.7x to 3x against
  ``weights`` on SmolLM2 (docs/quantization.md, ``kvstack.bench.key_basis``).

With ``prompt_axes: r`` the cache adapts that basis to its own keys: each time the key coder is fitted, the ``r``
leading principal axes of the tier's pre-RoPE keys replace the basis's leading axes, stored as ``r`` Householder
reflectors [C, r] in the model dtype (:func:`own_axes_reflectors`; the basis read is ``U Q``, formed when the tier is
read or written and not kept). A fixed basis misses how one long prompt's keys lean: on SmolLM2, 16 axes cut the
attention error of 2- to 4-bit keys by 16-26% against the calibrated basis alone (docs/quantization.md, "The prompt's
own axes"), for ``r x C`` numbers where a basis of the prompt's own would cost ``C x C``.

Values (``value_coding``): ``kivi`` — per token, as ``kind: quantize`` stores them (``value_group_size`` channels per
group, the stage's ``rotate`` / ``codebook`` / ``scale_dtype`` / ``value_clip``; ``kvstack/kernels/quant_pack.py``);
``transform`` — as the keys, without RoPE: each token's values of all KV heads form one vector [Hkv * Dv] coded by a
second :class:`ComponentCode` at ``value_bits`` per element on average, in the principal axes of the layer's values on
the calibration text (:func:`value_basis`, fitted in the same pass as the calibrated key basis), with no scale, zero
point or key scale. A needle lives in a few tokens' values as much as in their keys, so an eighth of the cache needs
values below KIVI's 2 bits plus scales (docs/quantization.md, "Transform-coded values").

What the tier holds (counted): ``key_codes`` uint8 [B, 1, T, bytes], with ``key_scale: token`` ``key_scale``
[B, 1, T, 1] (1 byte in float8, else the model dtype's size) and per layer the coder's ``key_mean`` (float32 [C]) and
``key_rms`` (float32 [1]), with ``prompt_axes`` the reflectors ``axes`` [C, r] in the model dtype, ``value_codes`` /
``value_scale`` / ``value_zero`` [B, Hkv, T, ...] (transform-coded: ``value_codes`` uint8 [B, 1, T, bytes] alone),
``positions`` int32 [B, 1, T], per-token records, and per layer each coder's ``order`` (int16 [C]), ``offsets``
(int32 [C]), ``center`` (float32 [C]) and ``levels`` (a fixed number, :func:`coder_levels`: float16 in 16-bit models,
float32 in float32 ones), plus a ``random`` rotation's matrix (``quantized_prune`` releases the coders, reflectors
and matrix when its levels of the layer empty: :meth:`TransformCodedTier.release`). The bases are the model's, not the cache's: float32 [C, C] per layer each, computed once per model (from its weights, or
when the stack is applied) and shared by every cache of the model like the weights, so they are not counted
(SmolLM2: 30 x 192 x 192 x 4 bytes = 4.4 MB per basis, against 270 MB of bf16 weights). Every part is per token:
removing tokens moves codes, nothing is re-coded, no slot is wasted.

All heads hold the same tokens (positions [B, 1, T]): a head-wise selection is refused. The coders are fitted on the
valid tokens of every batch row together, and re-fitted — every held key (and coded value) re-coded — each time the
tier has doubled since the last fit, until it was fitted on :data:`FIT_TOKENS` tokens.
"""

from __future__ import annotations

import hashlib
import math
import weakref

import torch

from kvstack.kernels.quant_pack import QuantizedGroups, dequantize, quantize
from kvstack.kernels.rope import apply_rope, rope_angles
from kvstack.kernels.transform_code import (
    ComponentCode, fit_token_scale, own_axes_reflectors, reflector_product, scale_tokens, uniform_levels, weight_basis,
)
from kvstack.stack.errors import KVStackError, SpecError
from kvstack.stack.memory import POSITION_BYTES
from kvstack.stack.shape import ModelShape, caching_attention_modules
from kvstack.stack.tiers import ExactTier, bytewise, gather_tokens, select_positions

from ._calibration import calibration_sequences, sampled_sequences
from ._quant_options import QuantizationError, rope_frequencies

#: a coder has this many times the levels of every component at the average width (the allocation's limit)
LEVELS_FACTOR = 1.5
#: the key coder is re-fitted while it was fitted on fewer tokens than this and the tier has doubled since
FIT_TOKENS = 1024
#: float16 levels hold the coders of 16-bit models; beyond this magnitude they are refused (a clear error, not an inf)
FLOAT16_LIMIT = 65000.0
#: key_basis: calibrated without calibration text: sequences x tokens sampled from the model (seeded)
SAMPLED_SEQUENCES, SAMPLED_TOKENS, SAMPLED_SEED = 4, 512, 0
#: leading positions of every calibration sequence left out of the basis: attention-sink keys, far from the others
#: (the tiers keep a stack's sinks at full precision)
CALIBRATION_SKIP = 4


def coder_levels(components: int, bits: int) -> int:
    """Levels one coder holds (a fixed count, so its bytes do not depend on the data)."""
    return math.ceil(LEVELS_FACTOR * uniform_levels(components, bits))


def key_code_bits(shape, key_bits: float, dim: int | None = None) -> int | None:
    """Bits of one token's key code, ``key_bits x C`` (C = Hkv x Dk, or Hkv x ``dim``: the values' with
    ``shape.value_dim``); None unless a whole multiple of 8 (the codes are packed in whole bytes per width block)."""
    total = key_bits * shape.num_kv_heads * (shape.head_dim if dim is None else dim)
    return int(total) if float(total).is_integer() and int(total) % 8 == 0 else None


def levels_dtype(model_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if model_dtype == torch.float32 else torch.float16


def coder_bytes(shape, key_bits: float, dtype: torch.dtype, key_scale: str = "none",
                value_bits: float | None = None, prompt_axes: int = 0) -> int:
    """Bytes per layer of one level's coders: the key coder's order int16, offsets int32, centre float32 per component
    and its levels; with ``key_scale: token`` also its mean (float32 per component) and mean RMS (one float32); with
    transform-coded values (``value_bits``) the value coder's, alike; with ``prompt_axes`` the reflectors, C numbers
    each in ``dtype``."""
    item = torch.empty((), dtype=levels_dtype(dtype)).element_size()

    def one(c: int, bits: float) -> int:
        return c * (2 + 4 + 4) + coder_levels(c, bits) * item

    c = shape.num_kv_heads * shape.head_dim
    scaled = (c + 1) * 4 if key_scale == "token" else 0
    values = 0 if value_bits is None else one(shape.num_kv_heads * shape.value_dim, value_bits)
    axes = prompt_axes * c * torch.empty((), dtype=dtype).element_size()
    return one(c, key_bits) + scaled + values + axes


# ---------------------------------------------------------------------------------------------- bases
_BASES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
#: model -> its caching attention modules (walking the model once per cache, not once per layer)
_MODULES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def key_projection(module, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The key projection's weight [Hkv * D, hidden] of an attention module: its ``k_proj``, or the key rows of a
    fused ``qkv_proj`` (Phi-3: queries, then keys, then values)."""
    if hasattr(module, "k_proj"):
        return module.k_proj.weight
    fused = getattr(module, "qkv_proj", None)
    if fused is not None:
        rows = kv_heads * head_dim
        q = fused.weight.shape[0] - 2 * rows
        return fused.weight[q : q + rows]
    raise SpecError(
        f"coding='transform' is not allowed for {type(module).__name__}: it takes its key basis from the key "
        "projection (k_proj or a fused qkv_proj); use coding: kivi"
    )


#: attention module -> its calibrated bases {"keys": basis, "values": basis} (set by calibrate_bases, removed with the
#: stack)
_CALIBRATED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
#: model -> (what its last bases were fitted from, those bases {layer: {"keys", "values"}}): applying a calibrated
#: stack again to unchanged weights with the same calibration reuses them instead of sampling and running the model
#: again
_FITTED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _attention_module(model, layer_idx: int):
    modules = _MODULES.get(model)
    if modules is None or layer_idx not in modules:
        modules = _MODULES[model] = caching_attention_modules(model)
    return modules[layer_idx]


def key_basis(shape, layer_idx: int, source: str = "weights") -> torch.Tensor:
    """The keys' basis float32 [C, C] of layer ``layer_idx`` of the model the shape was read from: ``weights`` (from
    its key projection, computed once per weight version and kept with the attention module) or ``calibrated`` (set
    when the stack was applied, :func:`calibrate_bases`)."""
    module = _module_of(shape, layer_idx)
    if source == "calibrated":
        return _calibrated(module, "keys", "key_basis='calibrated'")
    weight = key_projection(module, shape.num_kv_heads, shape.head_dim)
    version = (weight.data_ptr(), weight._version, tuple(weight.shape))
    cached = _BASES.get(module)
    if cached is None or cached[0] != version:
        cached = (version, weight_basis(weight))
        _BASES[module] = cached
    return cached[1]


def value_basis(shape, layer_idx: int) -> torch.Tensor:
    """The values' calibrated basis float32 [C, C] (C = Hkv x Dv) of layer ``layer_idx``: the principal axes of its
    value vectors, fitted with the keys' when the stack was applied (:func:`calibrate_bases`)."""
    return _calibrated(_module_of(shape, layer_idx), "values", "value_coding='transform'")


def _module_of(shape, layer_idx: int):
    model = shape.model() if callable(getattr(shape, "model", None)) else None
    if model is None:
        raise SpecError(
            "coding='transform' needs the model's weights or calibrated bases: build the cache from a model "
            "(kvstack.apply(model, spec), then model.generate or kvstack.cache_for(model)), not from a config"
        )
    return _attention_module(model, layer_idx)


def _calibrated(module, kind: str, what: str) -> torch.Tensor:
    bases = _CALIBRATED.get(module)
    if bases is None:
        raise SpecError(
            f"{what} needs the basis fitted when the stack is applied: build the cache from a model prepared by "
            "kvstack.apply(model, spec) (the stack on this model has no calibrated basis)"
        )
    return bases[kind]


def pre_rope_vectors(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys [B, H, n, D] at positions [B, 1, n] -> each token's pre-RoPE keys of all heads [B, n, H * D]
    float32 (what the basis acts on)."""
    cos, sin = rope_angles(positions.clamp_min(0), inv_freq.to(keys.device))
    k = apply_rope(keys.float(), cos, sin, inverse=True)
    b, _, n, _ = k.shape
    return k.transpose(1, 2).reshape(b, n, -1)


@torch.no_grad()
def calibrate_bases(model, calibration=None, stage: str = "key_basis=calibrated"):
    """Fit every caching layer's calibrated key and value bases: the eigenvectors (by decreasing eigenvalue) of the
    covariance of its pre-RoPE key vectors, and of its value vectors, over ``calibration`` (token ids, as
    ``kvstack.apply`` takes them; None: sequences the model samples itself), each sequence's first
    :data:`CALIBRATION_SKIP` positions left out. Runs the model as it is (its own attention and the cache it makes for
    itself). The last fit is kept with the model (weakly) and reused while its parameters, layers and calibration are
    the same (:func:`_fit_source`), so applying a calibrated stack again costs nothing. Returns the undo (the layers
    forget their bases)."""
    seqs = None if calibration is None else calibration_sequences(calibration, stage)
    modules = caching_attention_modules(model)
    source = _fit_source(model, modules, seqs)
    fitted = _FITTED.get(model)
    if fitted is not None and fitted[0] == source:
        bases = fitted[1]
    else:
        if seqs is None:
            seqs = sampled_sequences(model, SAMPLED_SEQUENCES, SAMPLED_TOKENS, SAMPLED_SEED, stage)
        bases = _fit_bases(model, modules, seqs, stage)
        _FITTED[model] = (source, bases)
    for layer_idx, layer_bases in bases.items():
        _CALIBRATED[modules[layer_idx]] = layer_bases

    def undo() -> None:
        for layer_idx in bases:
            _CALIBRATED.pop(modules[layer_idx], None)

    return undo


def _fit_source(model, modules, seqs) -> tuple:
    """What a fit depends on: every parameter as it is now (storage and in-place version: surgery or training
    changes it), the caching layers, and the calibration (its token ids; None: the seeded sample)."""
    weights = tuple((p.data_ptr(), p._version, p.dtype, tuple(p.shape)) for p in model.parameters())
    if seqs is None:
        text = ("sampled", SAMPLED_SEQUENCES, SAMPLED_TOKENS, SAMPLED_SEED)
    else:
        text = tuple(hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest() + str(tuple(ids.shape)) for ids in seqs)
    return weights, tuple((i, id(m)) for i, m in modules.items()), text


def _fit_bases(model, modules, seqs, stage: str) -> dict[int, dict[str, torch.Tensor]]:
    """Per caching layer, ``{"keys": basis, "values": basis}``: the principal axes of its pre-RoPE key vectors and of
    its value vectors (all KV heads of a token as one vector) over ``seqs``, one model pass for both."""
    from kvstack.stack.apply import output_cache

    shape = ModelShape.from_model(model)
    inv_freq = {layer_idx: rope_frequencies(shape, layer_idx) for layer_idx in modules}
    device = next(model.parameters()).device
    moments: dict[tuple[int, str], list] = {}
    for ids in seqs:
        cache = output_cache(model(ids.to(device), use_cache=True))
        for layer_idx in modules:
            layer = cache.layers[layer_idx]
            keys = layer.keys  # [1, Hkv, n, D]; a sliding window holds the newest n
            n = keys.shape[-2]
            positions = torch.arange(ids.shape[-1] - n, ids.shape[-1], device=keys.device)[None, None]
            kept = positions[0, 0] >= CALIBRATION_SKIP
            vectors = {
                "keys": pre_rope_vectors(keys, positions, inv_freq[layer_idx])[0],
                "values": layer.values[0].float().transpose(0, 1).reshape(n, -1),
            }
            for kind, y in vectors.items():
                y = y[kept].double()
                m = moments.setdefault((layer_idx, kind), [0, 0.0, 0.0])
                m[0], m[1], m[2] = m[0] + y.shape[0], m[1] + y.sum(0), m[2] + y.T @ y
    bases: dict[int, dict[str, torch.Tensor]] = {}
    for (layer_idx, kind), (count, total, square) in moments.items():
        if count < 2:
            raise SpecError(
                f"{stage}: calibration holds {count} key(s) past the first {CALIBRATION_SKIP} positions of its "
                "sequences; give longer calibration sequences"
            )
        mean = total / count
        covariance = (square - count * torch.outer(mean, mean)) / (count - 1)
        bases.setdefault(layer_idx, {})[kind] = torch.linalg.eigh(covariance)[1].flip(-1).float().contiguous()
    return bases


# ---------------------------------------------------------------------------------------------- the tier
class TransformCodedTier(ExactTier):
    """Tokens with transform-coded keys and KIVI or transform-coded values (module docstring). ``codec``: the stage's
    :class:`TierCodec` (its ``inv_freq`` un-rotates keys; its rotation, levels, scale format and clip act on KIVI
    values); ``value_group``: channels per KIVI value group; ``value_bits`` with a ``value_basis``: the values are
    transform-coded at that average width instead (``value_coding: transform``); ``prompt_axes``: the tier's own key
    axes that lead the basis (module docstring)."""

    _tensor_names = ("key_codes", "key_scale", "value_codes", "value_scale", "value_zero", "positions")

    def __init__(self, key_bits: float, bits: int, value_group: int, dtype: torch.dtype, label: str, name: str,
                 basis: torch.Tensor, codec, holds_codec_tensors: bool = True, token_scale: bool = False,
                 value_bits: float | None = None, value_basis: torch.Tensor | None = None, prompt_axes: int = 0):
        self.name, self.label = name, label
        self.prompt_axes = prompt_axes
        self.token_scale = token_scale
        self.key_bits, self.bits, self.value_group, self.dtype = key_bits, bits, value_group, dtype
        self.basis, self.codec = basis, codec
        self.value_bits, self.value_basis = value_bits, value_basis
        self.values_coded = value_basis is not None
        self.levels = codec.levels if bits <= 4 else "uniform"  # an 8-bit level stays uniform
        self.holds_codec_tensors = holds_codec_tensors
        self.heads: int | None = None
        self.token_data = {}
        self._empty()

    def _empty(self) -> None:
        """No token, no coder: what the first token fits."""
        self.key_code: ComponentCode | None = None
        self.value_code: ComponentCode | None = None
        self.axes: torch.Tensor | None = None  # [C, prompt_axes] reflectors in the model dtype, from the first fit
        self.key_mean: torch.Tensor | None = None  # [C] float32, token_scale only
        self.key_rms: torch.Tensor | None = None  # [1] float32, token_scale only
        self.fitted_on = 0
        for n in self._tensor_names:
            setattr(self, n, None)

    def memory_bytes(self) -> int:
        coders = [c for c in (self.key_code, self.value_code) if c is not None]
        coder = sum(t.nbytes for c in coders for t in c.tensors().values())
        coder += sum(t.nbytes for t in (self.key_mean, self.key_rms, self.axes) if t is not None)
        rotation = sum(t.nbytes for t in self.codec.fixed_tensors().values()) if self.holds_codec_tensors else 0
        return super().memory_bytes() + coder + rotation

    def release(self) -> None:
        """Called when this tier and its stage's other levels hold no token: the coders, the prompt axes and the
        codec's tensors go (the next token fits them afresh)."""
        self._empty()
        if self.holds_codec_tensors:
            self.codec.release()

    # ------------------------------------------------------------------------------------- coders
    def _on(self, name: str, device) -> torch.Tensor:
        """The basis ``name`` (``basis``, ``value_basis``), moved once to where the cache lives."""
        basis = getattr(self, name)
        if basis.device != device:
            basis = basis.to(device)
            setattr(self, name, basis)
        return basis

    def _fit_code(self, samples: torch.Tensor, bits: float, what: str) -> ComponentCode:
        """A coder of ``bits`` per component on average fitted on ``samples`` [N, C], its levels in the model's
        levels dtype."""
        c = samples.shape[-1]
        code = ComponentCode.fit(samples, round(bits * c), coder_levels(c, bits))  # a multiple of 8: checked
        if self.dtype != torch.float32:
            if bool((code.levels.abs() > FLOAT16_LIMIT).any()):
                raise QuantizationError(
                    f"{self.label}: a {what} component's levels exceed float16's range ({what} beyond "
                    f"+-{FLOAT16_LIMIT:g} from their mean); use a float32 model or coding: kivi"
                )
            code.levels = code.levels.to(levels_dtype(self.dtype))
        return code

    def _fit(self, x: torch.Tensor, v: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
        """Fit the prompt axes (``prompt_axes``) and the key coder on the pre-RoPE key vectors ``x`` [B, n, C] (and
        the value coder on ``v``) of the ``valid`` [B, n] tokens; returns the key components [B, n, C]."""
        valid = valid.reshape(-1)
        if self.prompt_axes:
            basis = self._on("basis", x.device)
            self.axes = own_axes_reflectors(x.reshape(-1, x.shape[-1])[valid] @ basis, self.prompt_axes).to(self.dtype)
        y = x @ self._key_basis(x.device)
        samples = y.reshape(-1, y.shape[-1])[valid]
        if self.token_scale:
            self.key_mean, self.key_rms = fit_token_scale(samples)
            samples = self._normalise(samples[None])[0][0]
        self.key_code = self._fit_code(samples, self.key_bits, "key")
        if v is not None:
            self.value_code = self._fit_code(v.reshape(-1, v.shape[-1])[valid], self.value_bits, "value")
        self.fitted_on = int(valid.sum())
        return y

    # ------------------------------------------------------------------------------------- keys
    def _key_basis(self, device) -> torch.Tensor:
        """The basis the keys are coded in: the stage's, with ``prompt_axes`` times the reflectors' product (formed
        on each read or write, a C x C product of r reflections, not kept: the cache holds the reflectors only)."""
        basis = self._on("basis", device)
        return basis if self.axes is None else basis @ reflector_product(self.axes)

    def _pre_rope(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys [B, H, n, D] at positions [B, 1, n] -> pre-RoPE vectors [B, n, C] float32."""
        return pre_rope_vectors(keys, positions, self.codec.inv_freq)

    def _scale_dtype(self) -> torch.dtype:
        return self.codec.scale_dtype or self.dtype

    def _normalise(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Components [B, n, C] -> (what the coder codes, the stored per-token scale [B, 1, n, 1] or None). With
        ``token_scale`` each vector is centred by ``key_mean`` and divided by its root mean square as stored (its
        ratio to ``key_rms``, rounded to the scale format: dividing by the rounded value keeps decoding exact)."""
        if not self.token_scale:
            return y, None
        z, stored = scale_tokens(y, self.key_mean, self.key_rms, self._scale_dtype())
        return z, stored[:, None, :, None]

    def _keys(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Slots ``start:stop`` -> post-RoPE keys [B, H, n, D], the basis product and RoPE in ``dtype`` (float32 or
        float64: the attention engine's compute dtype)."""
        basis = self._key_basis(self.key_codes.device)
        k = self.key_code.reconstruct(self.key_codes[:, 0, start:stop], basis, dtype)
        if self.token_scale:  # x = (mean + s * rms * z) U^T
            scale = self.key_scale[:, 0, start:stop, 0].to(dtype) * self.key_rms.to(dtype)
            k = k * scale[..., None] + (self.key_mean.to(dtype) @ basis.T.to(dtype))
        k = self._per_head(k)
        cos, sin = rope_angles(self.positions[..., start:stop].clamp_min(0), self.codec.inv_freq.to(k.device))
        return apply_rope(k, cos, sin)

    def _per_head(self, x: torch.Tensor) -> torch.Tensor:
        """Vectors of all heads [B, n, H * D] -> [B, H, n, D]."""
        b, n, _ = x.shape
        return x.reshape(b, n, self.heads, -1).transpose(1, 2)

    # ------------------------------------------------------------------------------------- values
    def _value_components(self, values: torch.Tensor) -> torch.Tensor:
        """Values [B, H, n, Dv] -> components [B, n, C] float32 in the value basis (transform-coded values)."""
        b, _, n, _ = values.shape
        return values.float().transpose(1, 2).reshape(b, n, -1) @ self._on("value_basis", values.device)

    def _values(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots ``start:stop`` -> values [B, H, n, Dv] in ``dtype`` (in the basis ``attention_output`` maps back)."""
        if self.values_coded:
            basis = self._on("value_basis", self.value_codes.device)
            return self._per_head(self.value_code.reconstruct(self.value_codes[:, 0, start:stop], basis, dtype))
        return dequantize(self._value_groups().slice_tokens(start, stop), dtype)

    def _value_groups(self) -> QuantizedGroups:
        b, h, t, _ = self.value_codes.shape
        data = torch.float32 if self.codec.values_transformed else self.dtype
        return QuantizedGroups(
            self.value_codes, self.value_scale, self.value_zero, self.bits, self.value_group, "channel",
            (b, h, t, self._value_dim), self.levels, data,
        )

    def _quantize_values(self, values: torch.Tensor) -> QuantizedGroups:
        stored = self.codec.store_values(values)
        data = torch.float32 if self.codec.values_transformed else self.dtype
        scale_dtype = self.codec.scale_dtype or (self.dtype if data != self.dtype else None)
        try:
            return quantize(stored.to(data).contiguous(), self.bits, self.value_group, "channel", levels=self.levels,
                            scale_dtype=scale_dtype, clip=self.codec.value_clip)
        except ValueError as err:
            raise QuantizationError(f"{self.label}: cannot quantize values to {self.bits} bits: {err}") from None

    # ------------------------------------------------------------------------------- attention side
    def attention_block(self, start, stop, dtype):
        return self._keys(start, stop, dtype), self._values(start, stop, dtype)  # rotated KIVI values: see below

    def attention_output(self, x):
        return self.codec.values(x)  # un-rotates the sum of rotated KIVI values (coded values are not rotated)

    def gather(self, index):
        compute = torch.promote_types(self.dtype, torch.float32)
        keys = self._keys(0, self.num_tokens, compute).to(self.dtype)
        values = self._values(0, self.num_tokens, compute)
        if self.codec.values_transformed:
            values = self.codec.values(values)
        return gather_tokens(keys, index), gather_tokens(values.to(self.dtype), index)

    def bytes_per_token(self) -> float:
        records = sum(v.shape[1] * v.element_size() for v in self.token_data.values())
        values = self.value_codes.shape[1] * self.value_codes.shape[-1]
        if self.value_scale is not None:
            values += self.value_scale.shape[1] * self.value_scale.shape[-1] * 2 * self.value_scale.element_size()
        scale = 0 if self.key_scale is None else self.key_scale.element_size()
        return self.key_codes.shape[-1] + scale + values + POSITION_BYTES + records

    # ---------------------------------------------------------------------------------- storage side
    def _shared(self, index: torch.Tensor) -> torch.Tensor:
        """A per-head [B, H, n] index or positions that must be the same for every head -> its [B, 1, n] form."""
        if index.shape[1] == 1:
            return index
        if not bool((index == index[:, :1]).all()):
            raise KVStackError(
                f"{self.label}: coding='transform' codes the keys of all KV heads of a token together, so every head "
                "must hold the same tokens; a head-wise selection reached it (use a scorer with head_wise: false)"
            )
        return index[:, :1]

    def append(self, keys, values, positions, records=None) -> None:
        positions = self._shared(positions).to(torch.int32)
        for what, x in (("keys", keys), ("values", values)):
            if not bool(torch.isfinite(x).all()):
                raise QuantizationError(f"{self.label}: cannot code {what} with NaN or Inf")
        self.heads, self._value_dim, self.dtype = keys.shape[1], values.shape[-1], keys.dtype
        x = self._pre_rope(keys, positions)
        v = self._value_components(values) if self.values_coded else None
        valid = positions[:, 0] >= 0  # [B, n]
        if self.positions is None:
            self.positions = positions
            self._store(self._fit(x, v, valid), v, values)
        elif self.fitted_on < FIT_TOKENS and int(self.valid().sum() + valid.sum()) >= 2 * max(self.fitted_on, 1):
            # re-fit on the held tokens (as decoded) and the new ones, and re-code every held key (and coded value)
            x = torch.cat([self._pre_rope(self._keys(0, self.num_tokens), self.positions), x], 1)
            if v is not None:
                held = self._values(0, self.num_tokens, torch.float32)
                v = torch.cat([self._value_components(held), v], 1)
            self.positions = torch.cat([self.positions, positions], -1)
            self._store(self._fit(x, v, self.valid()[:, 0]), v, values, refit=True)
        else:
            self.positions = torch.cat([self.positions, positions], -1)
            self._store(x @ self._key_basis(x.device), v, values, append=True)
        self._append_token_data(keys.shape[-2], records)

    def _store(self, y: torch.Tensor, v: torch.Tensor | None, values: torch.Tensor, append: bool = False,
               refit: bool = False) -> None:
        """Code key components [B, n, C] with the fitted coder, and the new ``values`` [B, H, n, Dv] (components
        ``v``, all held ones with ``refit``, when transform-coded; else KIVI's groups of the new ones): the tier's
        codes (``append``, and KIVI values after a ``refit``: after the held ones)."""
        z, scale = self._normalise(y)
        codes = self.key_code.encode(z)[:, None]
        if append:
            codes = torch.cat([self.key_codes, codes], 2)
            scale = None if scale is None else torch.cat([self.key_scale, scale], 2)
        self.key_codes, self.key_scale = codes, scale
        if v is not None:
            coded = self.value_code.encode(v)[:, None]
            self.value_codes = torch.cat([self.value_codes, coded], 2) if append else coded
            return
        qv = self._quantize_values(values)
        if append or refit:
            qv = QuantizedGroups.cat_tokens([self._value_groups(), qv])
        self.value_codes, self.value_scale, self.value_zero = qv.packed, qv.scale, qv.zero

    def select(self, index, slot_valid) -> None:
        index = self._shared(index)
        self.key_codes = gather_tokens(self.key_codes, index)
        self.value_codes = gather_tokens(self.value_codes, index)
        for name in ("key_scale", "value_scale", "value_zero"):
            if getattr(self, name) is not None:
                setattr(self, name, bytewise(gather_tokens, getattr(self, name), index))
        self.positions = select_positions(self.positions, index, slot_valid[:, :1])
        self._select_token_data(index)


def transform_tier(shape, layer_idx: int, key_bits: float, bits: int, value_group: int, label: str, name: str, codec,
                   holds_codec_tensors: bool = True, basis: str = "weights", key_scale: str = "none",
                   value_bits: float | None = None, prompt_axes: int = 0) -> TransformCodedTier:
    """The tier of one transform-coded level of layer ``layer_idx`` (``codec``: the stage's, with pre-RoPE keys;
    ``basis``, ``key_scale``, ``prompt_axes``: the stage's ``key_basis``, ``key_scale`` and ``prompt_axes``;
    ``value_bits``: transform-coded values at that width in the calibrated value basis, None: KIVI values at
    ``bits``)."""
    values = None if value_bits is None else value_basis(shape, layer_idx)
    return TransformCodedTier(key_bits, bits, value_group, shape.dtype, label, name, key_basis(shape, layer_idx, basis),
                              codec, holds_codec_tensors, token_scale=key_scale == "token", value_bits=value_bits,
                              value_basis=values, prompt_axes=prompt_axes)


def transform_token_bytes(shape, key_bits: float, bits: int, value_group: int, scale_bytes: int,
                          extra_per_token: float = 0.0, key_scale: str = "none",
                          value_bits: float | None = None) -> float:
    """Bytes of one token per batch row: its key codes (and with ``key_scale: token`` its key scale, in the scale
    format), its values' codes (KIVI's with their scales and zero points; transform-coded at ``value_bits``: the codes
    alone), and ``extra_per_token`` (positions, records)."""
    h = shape.num_kv_heads
    if value_bits is None:
        values = h * (shape.value_dim * bits / 8 + 2 * scale_bytes * shape.value_dim / value_group)
    else:
        values = h * shape.value_dim * value_bits / 8
    keys = h * shape.head_dim * key_bits / 8 + (scale_bytes if key_scale == "token" else 0)
    return keys + values + extra_per_token


__all__ = [
    "CALIBRATION_SKIP", "FIT_TOKENS", "LEVELS_FACTOR", "SAMPLED_SEED", "SAMPLED_SEQUENCES", "SAMPLED_TOKENS",
    "TransformCodedTier", "calibrate_bases", "coder_bytes", "coder_levels", "key_basis", "key_code_bits",
    "key_projection", "pre_rope_vectors", "value_basis", "transform_tier", "transform_token_bytes",
]
