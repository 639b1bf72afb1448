"""Options of the quantized tiers below 4 bits, shared by ``quantize`` and ``quantized_prune`` (docs/quantization.md).

Spec side: :class:`QuantOptions`, a mixin of pydantic fields and their checks —

* ``rotate`` (``none`` | ``hadamard`` | ``random``, ``rotate_seed``): keys and values are rotated along head_dim by
  an orthogonal ``R`` before quantization (QuaRot arXiv 2404.00456, TurboQuant arXiv 2504.19874). Attention reads
  ``(R q).(R k) = q.k`` — the tier rotates the query (``attention_query``), and the engine un-rotates the tier's
  weighted sum of the rotated values once (``attention_output``: ``sum_i p_i R^T v_i = R^T sum_i p_i v_i``).
* ``key_rope: pre`` — pre-RoPE key quantization (KVQuant arXiv 2401.18079): the post-RoPE keys the cache receives
  are rotated back by their stored positions, quantized, and RoPE is re-applied per block on dequantization.
* ``value_clip`` — each value group is clamped to the fraction of its range (1, 0.9, 0.8 or 0.7, centred) whose
  quantization has the least squared error (a clip search; keys are never clipped: their extremes set the logits).
* ``coding: transform`` — instead of KIVI's per-channel key groups, each token's keys (pre-RoPE) of all KV heads are
  coded as one vector in an orthonormal basis (``key_basis``: the layer's ``k_proj`` weight's, or calibrated), with
  bits allocated per component by variance and Lloyd-Max levels per component (``kvstack/stages/_transform_tier.py``,
  ``kvstack/kernels/transform_code.py``; KVTC, arXiv 2511.01815): no scale or zero point per key group. Values stay
  KIVI's (per token, with the options below) unless ``value_coding: transform``. It needs ``key_rope: pre``.
* ``value_coding: transform`` (with ``coding: transform``) — the values are transform-coded too: each token's values
  of all KV heads as one vector in the principal axes of the layer's values on calibration text (fitted with the
  keys' calibrated basis when the stack is applied), at ``bits`` (``quantized_prune``: a tier's ``value_bits``, which
  may be fractional) per element on average, with no scale or zero point. The KIVI value options (``rotate``,
  ``codebook``, ``value_clip``, ``value_group_size``) then have nothing to act on.
* ``codebook`` (``uniform`` | ``nf``: the quantization levels) and ``scale_dtype`` (``model`` | ``float16`` |
  ``bfloat16`` | ``float8_e4m3fn``): the levels and the format of scales/zero points
  (``kvstack/kernels/quant_pack.py``). (Named ``codebook``, not ``levels``: ``quantized_prune`` has a ``levels()``
  method, its precision levels, which a mixed-in field would shadow.)

Runtime side: :class:`TierCodec`, what one layer's quantized tier applies between the tokens it receives and the
tensors it quantizes (the *stored domain*), and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, Field

from kvstack.kernels.rope import apply_rope, rope_angles
from kvstack.kernels.rotation import fwht, is_power_of_two, random_orthogonal
from kvstack.kernels.transform_code import BLOCK
from kvstack.stack.base import spec_error
from kvstack.stack.errors import KVStackError

#: spec name -> storage format of scales and zero points (None: the model dtype)
SCALE_DTYPES: dict[str, torch.dtype | None] = {
    "model": None,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
#: model types whose attention applies RoPE as ``x * cos + rotate_half(x) * sin`` on the first rope_dim channels
#: (transformers' ``apply_rotary_pos_emb``), checked against each model's own rotary embedding in the tests
ROTATE_HALF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
#: RoPE types whose frequencies are fixed (do not depend on the sequence length): keys can be un-rotated later
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: ``value_clip``: the fractions of a value group's range searched (1.0 first: no group does worse than unclipped)
VALUE_CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7)
#: bytes of one element of a stored rotation matrix (``rotate: random``; float32 [D, D] per layer)
ROTATION_ITEMSIZE = 4


class QuantizationError(KVStackError, ValueError):
    """A tensor could not be quantized (NaN/Inf in the keys or values, or a range beyond float32)."""


def check_transform_shape(shape) -> None:
    if (shape.num_kv_heads * shape.head_dim) % BLOCK:
        raise spec_error(
            "coding", "transform",
            f"'kivi' for this model: num_kv_heads x head_dim = {shape.num_kv_heads * shape.head_dim} must be a "
            f"multiple of {BLOCK} (key components share a width in blocks of {BLOCK})",
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class QuantOptions(BaseModel):
    """Spec fields of the precision options of quantized tiers (``quantize``; ``quantized_prune`` when it mixes this
    in). Defaults are KIVI as before: no rotation, post-RoPE keys, uniform levels, scales in the model dtype."""

    coding: Literal["kivi", "transform"] = Field(
        default="kivi",
        description="How keys are stored. kivi: per-channel groups of group_size tokens, a scale and zero point each; "
        "transform: each token's pre-RoPE keys of all KV heads coded as one vector in an orthonormal basis "
        "(key_basis), key_bits per element on average allocated per component by variance, Lloyd-Max levels per "
        "component, no scales (key_scale: token adds one per token; needs key_rope: pre). Values: value_coding.",
    )
    value_coding: Literal["kivi", "transform"] = Field(
        default="kivi",
        description="How values are stored. kivi: per-token groups (value_group_size channels), a scale and zero point "
        "each; transform (needs coding: transform): each token's values of all KV heads coded as one vector in the "
        "principal axes of the layer's values on calibration text (fitted when the stack is applied, as key_basis: "
        "calibrated), bits allocated per component by variance, Lloyd-Max levels per component, no scales.",
    )
    key_basis: Literal["weights", "calibrated"] = Field(
        default="weights",
        description="coding: transform — the basis keys are coded in. weights: the left singular vectors of the "
        "layer's k_proj weight (nothing to fit); calibrated: the principal axes of the layer's pre-RoPE keys on "
        "calibration text (kvstack.apply(model, spec, calibration=...), else text sampled from the model itself), "
        "fitted once per model when the stack is applied.",
    )
    prompt_axes: int = Field(
        default=0, ge=0,
        description="coding: transform — adapt the key basis to this cache: each time the key coder is fitted, this "
        "many leading principal axes of the tier's own pre-RoPE keys lead the basis (the rest: key_basis's axes, "
        "reflected into their complement), held per quantized level and layer as that many Householder reflectors "
        "of num_kv_heads x head_dim numbers in the model dtype and counted. 0: key_basis alone.",
    )
    key_scale: Literal["none", "token"] = Field(
        default="none",
        description="coding: transform — none: no scale per token (the levels alone, as KVTC); token: each token's "
        "key vector is centred and divided by its root mean square before it is coded and multiplied back when read "
        "(gain-shape coding), the ratio stored per token in scale_dtype (1 byte in float8_e4m3fn).",
    )
    rotate: Literal["none", "hadamard", "random"] = Field(
        default="none",
        description="Rotate keys and values along head_dim by an orthogonal matrix before quantization (outliers "
        "spread over every channel): hadamard (normalised Walsh-Hadamard, power-of-two head_dim, nothing stored) or "
        "random (a seeded random orthogonal matrix, float32 [head_dim, head_dim] held per layer from its first "
        "quantized token on, and counted).",
    )
    rotate_seed: int = Field(
        default=0, ge=0, description="rotate: random — seed of layer 0's matrix (layer l uses rotate_seed + l)."
    )
    key_rope: Literal["post", "pre"] = Field(
        default="post",
        description="post: quantize keys as the cache receives them (after RoPE); pre: rotate them back by their "
        "positions, quantize the pre-RoPE keys and re-apply RoPE when reading (models with standard RoPE only).",
    )
    codebook: Literal["uniform", "nf"] = Field(
        default="uniform",
        description="Quantization levels of a group: uniform (min-max steps) or nf (normal-float: Lloyd-Max levels "
        "of a Gaussian between the group's min and max), same bytes; nf acts on levels of 2, 3 or 4 bits (an "
        "8-bit level stays uniform).",
    )
    value_clip: bool = Field(
        default=False,
        description="Clip each value group before quantizing it: of 1, 0.9, 0.8 and 0.7 of its range (centred), the "
        "one whose quantization has the least squared error (five quantizations when values are stored: four candidates, then the chosen one; "
        "the same bytes). Keys are not clipped: a key group's extremes set attention logits.",
    )
    scale_dtype: Literal["model", "float16", "bfloat16", "float8_e4m3fn"] = Field(
        default="model",
        description="Format of the per-group scales and zero points: model (the model dtype) or a smaller float "
        "format (zero rounded down, scale rounded up: the error bound holds with the stored scale).",
    )

    # ------------------------------------------------------------------------------------------ validation
    def quant_option_fields_inactive(self, bits: list[int]) -> set[str]:
        """Option fields that do not act (every one when no level is quantized; ``rotate_seed`` unless random)."""
        if all(b == 16 for b in bits):
            return {"coding", "value_coding", "key_basis", "key_scale", "prompt_axes", "rotate", "rotate_seed",
                    "key_rope", "codebook", "value_clip", "scale_dtype"}
        inactive = set() if self.rotate == "random" else {"rotate_seed"}
        if self.values_coded:
            inactive |= {"value_group_size"}
        return inactive if self.transform_coded else inactive | {"key_basis", "key_scale", "prompt_axes"}

    @property
    def transform_coded(self) -> bool:
        return self.coding == "transform"

    @property
    def values_coded(self) -> bool:
        """Whether the values are transform-coded (``value_coding: transform``)."""
        return self.value_coding == "transform"

    def calibrates(self, bits: list[int]) -> bool:
        """Whether applying the stack fits bases on calibration text (``key_basis: calibrated`` or
        ``value_coding: transform``)."""
        calibrated = self.key_basis == "calibrated" or self.values_coded
        return self.transform_coded and calibrated and any(b != 16 for b in bits)

    def check_quant_options(self, bits: list[int]) -> None:
        """Shape-independent checks (``bits``: the quantized widths the stage stores)."""
        if self.transform_coded and bits and self.key_rope != "pre":
            raise spec_error(
                "key_rope", self.key_rope,
                "'pre' with coding: transform (keys are coded before RoPE, in the k_proj weight's basis)",
            )
        if self.values_coded and bits:
            if not self.transform_coded:
                raise spec_error(
                    "value_coding", "transform", "'kivi' unless coding: transform (values are transform-coded with "
                    "transform-coded keys, in the same tier)",
                )
            kivi_only = {"rotate": (self.rotate, "none"), "codebook": (self.codebook, "uniform"),
                         "value_clip": (self.value_clip, False)}
            for name, (value, default) in kivi_only.items():
                if value != default:
                    raise spec_error(
                        name, value, f"{default!r} with value_coding: transform ({name} acts on KIVI values; "
                        "transform-coded values have their own basis and levels)",
                    )
        if self.codebook == "nf" and bits and all(b == 8 for b in bits):
            raise spec_error(
                "codebook", "nf", "uniform with bits=8 (normal-float levels are for bits 2, 3 or 4; an 8-bit level "
                "next to lower ones stays uniform)",
            )

    def prompt_axes_fields(self) -> dict[str, tuple[object, int]]:
        """Every field that asks for prompt axes: {name: (its value, the most axes it asks for)}. A stage with axes
        per layer adds its field, so one check holds them all to the model."""
        return {"prompt_axes": (self.prompt_axes, self.prompt_axes)}

    def check_quant_options_for(self, shape, bits: list[int]) -> None:
        """Checks against the model (only when some level is quantized)."""
        if all(b == 16 for b in bits):
            return
        if self.transform_coded:
            check_transform_shape(shape)
            components = shape.num_kv_heads * shape.head_dim
            for name, (value, most) in self.prompt_axes_fields().items():
                if most > components:
                    raise spec_error(
                        name, value,
                        f"0 to num_kv_heads x head_dim = {components} for this model (one axis per key component)",
                    )
        if self.values_coded and (shape.num_kv_heads * shape.value_dim) % BLOCK:
            raise spec_error(
                "value_coding", "transform",
                f"'kivi' for this model: num_kv_heads x value_dim = {shape.num_kv_heads * shape.value_dim} must be a "
                f"multiple of {BLOCK} (value components share a width in blocks of {BLOCK})",
            )
        if self.scale_dtype != "model":
            sdt = SCALE_DTYPES[self.scale_dtype]
            if _itemsize(sdt) >= _itemsize(shape.dtype):
                model_size = _itemsize(shape.dtype)
                smaller = [n for n, d in SCALE_DTYPES.items() if d is not None and _itemsize(d) < model_size]
                raise spec_error(
                    "scale_dtype", self.scale_dtype,
                    f"'model' or a format smaller than the model dtype {str(shape.dtype).removeprefix('torch.')}"
                    + (f" ({', '.join(smaller)})" if smaller else ""),
                )
        if self.rotate == "hadamard" and not is_power_of_two(shape.head_dim):
            raise spec_error(
                "rotate", "hadamard",
                f"a power-of-two head_dim for the Walsh-Hadamard transform (the model's head_dim={shape.head_dim}); "
                "use rotate: random",
            )
        if self.key_rope == "pre":
            for layer in range(shape.num_layers):
                rope_frequencies(shape, layer)  # raises with the reason

    def check_quant_options_in_stack(self, stages) -> None:
        if self.transform_coded:
            head_wise = [s for s in stages if getattr(s, "is_head_wise", False)]
            if head_wise:
                raise spec_error(
                    "coding", "transform",
                    f"'kivi' in a stack with a head-wise selection ({head_wise[0].kind} "
                    f"scorer={head_wise[0].scorer!r}): a token's keys of every KV head are coded together, so all "
                    "heads must keep the same tokens (set head_wise: false)",
                )
        if (self.rotate != "none" or self.key_rope == "pre") and any(s.kind == "channel_prune" for s in stages):
            field, value = ("rotate", self.rotate) if self.rotate != "none" else ("key_rope", self.key_rope)
            raise spec_error(
                field, value,
                "'none' / 'post' in a stack with channel_prune (key channels are pruned in the model's basis, which "
                "the rotation mixes)",
            )

    # ------------------------------------------------------------------------------------------ runtime
    def scale_torch_dtype(self) -> torch.dtype | None:
        return SCALE_DTYPES[self.scale_dtype]

    def fixed_bytes(self, shape) -> int:
        """Bytes per layer that do not depend on tokens or batch (the ``random`` rotation matrix, held once the layer
        quantizes a token)."""
        return shape.head_dim**2 * ROTATION_ITEMSIZE if self.rotate == "random" else 0

    def codec(self, shape, layer_idx: int) -> "TierCodec":
        seed = self.rotate_seed + layer_idx if self.rotate == "random" else None
        inv_freq = rope_frequencies(shape, layer_idx) if self.key_rope == "pre" else None
        return TierCodec(
            self.codebook, self.scale_torch_dtype(), self.rotate, None, inv_freq, seed, shape.head_dim,
            VALUE_CLIP_RATIOS if self.value_clip else (),
        )


# ---------------------------------------------------------------------------------------------- RoPE from config
def _text_config(config):
    get = getattr(config, "get_text_config", None)
    try:
        return get(decoder=True) if get is not None else config
    except Exception:  # noqa: BLE001 - configs with unusual sub-configs
        return config


def rope_frequencies(shape, layer_idx: int) -> torch.Tensor:
    """``inv_freq`` float32 [rope_dim / 2] of layer ``layer_idx``, computed from the model config as transformers
    does (``ROPE_INIT_FUNCTIONS`` for scaled types, ``1 / theta^(2i / rope_dim)`` for the default), or a
    :class:`SpecError` naming ``key_rope`` and why the model has no standard, static RoPE."""
    config = getattr(shape, "config", None)

    def refuse(why: str):
        return spec_error("key_rope", "pre", f"'post' for this model: {why}")

    if config is None:
        raise refuse("the shape carries no model config (build it with ModelShape.from_config / from_model)")
    if shape.model_type not in ROTATE_HALF_MODEL_TYPES:
        raise refuse(
            f"model_type={shape.model_type!r} is not one whose RoPE layout kvstack has checked "
            f"({', '.join(ROTATE_HALF_MODEL_TYPES)})"
        )
    text = _text_config(config)
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict):
        raise refuse("the config has no rope_parameters")
    layer_type = None
    layer_types = getattr(text, "layer_types", None)
    own = layer_types[layer_idx] if layer_types is not None else None
    if own is not None and isinstance(params.get(own), dict):  # per-layer-type RoPE (Gemma3)
        layer_type = own
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise refuse(
            f"rope_type={rope_type!r} (frequencies that change with the sequence length, or unknown); pre-RoPE keys "
            f"need one of {', '.join(STATIC_ROPE_TYPES)}"
        )
    head_dim = shape.head_dim
    if rope_type == "default":
        theta = params.get("rope_theta")
        if theta is None:
            raise refuse("rope_parameters has no rope_theta")
        partial = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None)) or 1.0
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](text, "cpu", layer_type=layer_type)
    inv_freq = inv_freq.float().cpu()
    rope_dim = 2 * inv_freq.shape[-1]
    if rope_dim > head_dim or (shape.rope_dim is not None and rope_dim != shape.rope_dim):
        raise refuse(f"the RoPE width {rope_dim} does not match head_dim={head_dim} / rope_dim={shape.rope_dim}")
    return inv_freq


# ---------------------------------------------------------------------------------------------- runtime codec
@dataclass
class TierCodec:
    """Between what a quantized tier receives (post-RoPE keys, values, in the model's basis) and what it quantizes.

    Stored keys: ``R unrope_p(k)`` (``key_rope: pre``) or ``R k``; stored values: ``R v`` (``R`` the rotation, the
    identity for ``rotate: none``). Attention keys: with pre-RoPE keys ``rope_p(R^T k_s)`` (the query is left as it
    is), else the stored ``R k`` read by the rotated query ``R q``; attention values: ``R^T v_s``.

    A ``random`` rotation is drawn (from ``rotation_seed``) on first use: a layer that never quantizes a token holds
    no matrix, so a budget smaller than the matrix (short prompts) can still be kept by holding nothing quantized."""

    levels: str = "uniform"
    scale_dtype: torch.dtype | None = None  # None: the model dtype
    rotate: str = "none"
    rotation: torch.Tensor | None = None  # float32 [D, D] (rotate: random), x -> x @ rotation
    inv_freq: torch.Tensor | None = None  # float32 [rope_dim / 2] (key_rope: pre)
    rotation_seed: int | None = None  # rotate: random, drawn on first use when ``rotation`` is None
    head_dim: int | None = None
    value_clip: tuple[float, ...] = ()  # ratios of the values' clip search (none: no clipping)

    @property
    def plain(self) -> bool:
        """KIVI as the fused kernel reads it: uniform codes, scales in the model dtype, keys as received
        (``value_clip`` changes which codes are stored, not how they are read)."""
        return self.levels == "uniform" and self.scale_dtype is None and not self.keys_transformed

    @property
    def keys_transformed(self) -> bool:
        return self.rotate != "none" or self.inv_freq is not None

    @property
    def values_transformed(self) -> bool:
        return self.rotate != "none"

    def fixed_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors the tier holds for the codec (counted in its memory)."""
        return {} if self.rotation is None else {"rotation": self.rotation}

    def release(self) -> None:
        """Drop the tensors of ``fixed_tensors`` while no token needs them (the rotation is drawn again, from the
        same seed, on next use)."""
        self.rotation = None

    # rotations ------------------------------------------------------------------------------------------
    def _matrix(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is None:
            self.rotation = random_orthogonal(self.head_dim, self.rotation_seed).float()
        if self.rotation.device != x.device:
            self.rotation = self.rotation.to(x.device)  # one copy, where the cache lives
        return self.rotation.to(x.dtype)

    def rotate_in(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotate == "hadamard":
            return fwht(x)
        if self.rotate == "random":
            return x @ self._matrix(x)
        return x

    def rotate_out(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotate == "hadamard":
            return fwht(x)  # H / sqrt(n) is its own inverse
        if self.rotate == "random":
            return x @ self._matrix(x).T
        return x

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
        # empty slots (-1) take position 0: they are masked, and the keys they repeat were stored with their own
        cos, sin = rope_angles(positions.clamp_min(0), self.inv_freq)  # [B, Hp, T, R]
        return apply_rope(x, cos, sin, inverse=inverse)

    # stored domain ---------------------------------------------------------------------------------------
    def store_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """keys [B, H, T, D] at positions [B, 1 | H, T] -> the keys to quantize (float32 when transformed)."""
        if not self.keys_transformed:
            return keys
        k = keys.float()
        if self.inv_freq is not None:
            k = self._rope(k, positions, inverse=True)
        return self.rotate_in(k)

    def store_values(self, values: torch.Tensor) -> torch.Tensor:
        return self.rotate_in(values.float()) if self.values_transformed else values

    def attention_query(self, query: torch.Tensor) -> torch.Tensor:
        """The query as the stored keys read it: rotated when the keys stay rotated (no pre-RoPE re-rotation)."""
        return self.rotate_in(query) if self.rotate != "none" and self.inv_freq is None else query

    def attention_keys(self, stored: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Dequantized stored keys -> keys for ``attention_query``'s query (same dtype)."""
        if self.inv_freq is None:
            return stored
        return self._rope(self.rotate_out(stored), positions, inverse=False)

    def keys(self, stored: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Dequantized stored keys -> post-RoPE keys in the model's basis (same dtype)."""
        k = self.rotate_out(stored)
        return self._rope(k, positions, inverse=False) if self.inv_freq is not None else k

    def values(self, stored: torch.Tensor) -> torch.Tensor:
        return self.rotate_out(stored)
