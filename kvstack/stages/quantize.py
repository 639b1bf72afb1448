"""``kind: quantize`` — KIVI: bit-packed asymmetric 2/3/4/8-bit KV cache with a full-precision residual window.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024 (arXiv 2402.02750).
Min-max quantization per group (``kvstack/kernels/quant_pack.py``: ``s = (max - min) / (2^b - 1)``, codes packed
``8 / b`` per byte, scale and zero point stored in the model dtype). Keys are quantized per channel (a group spans
``group_size`` tokens of one channel: key outliers live in fixed channels), values per token (a group spans
``value_group_size`` channels of one token). Keys are quantized after RoPE (the cache receives post-RoPE keys).

Parameters: ``bits`` (2, 3, 4, 8; 16 = no quantization, the identity; 3 bits pack 8 codes in 3 bytes, so group
sizes are multiples of 8), ``group_size`` (tokens per key group), ``value_group_size`` (channels per value group;
default ``group_size``; ``head_dim``: one group per token and head), ``residual`` (newest tokens kept in full
precision, a multiple of ``group_size``), and the precision options of :class:`QuantOptions`
(``kvstack/stages/_quant_options.py``): ``rotate`` (Hadamard / random orthogonal rotation along head_dim),
``key_rope: pre`` (pre-RoPE keys), ``codebook: nf`` (normal-float levels) and ``scale_dtype`` (cheaper scales and
zero points).

Flow inside the stack: new tokens arrive in the full tier; after each attention the stage moves the oldest
full-precision tokens beyond ``residual`` into its :class:`QuantizedTier`, ``group_size`` at a time, so the full tier
holds between ``residual`` and ``residual + group_size - 1`` tokens. KIVI moves values token by token (FIFO); here a
token's key and value move together (one tier, one position per slot): values wait with their key for at most
``group_size - 1`` steps, which costs those values' full-precision bytes and no accuracy.

Attention dequantizes one key block at a time (``attention_block``: temporaries of that block; no dequantized copy
of the tier is kept), or the fused kernel dequantizes in registers.

Removing tokens from the quantized tier (an ``evict`` stage, a sliding window, beam selection): values are per token
and move exactly. A key group loses only the removed tokens' slots, which become holes (exact, no re-quantization);
a group with no token left is dropped. When the holes of a (row, head) reach ``group_size`` — one group's worth of
wasted bytes — the tokens of the groups with holes are dequantized and re-quantized together into as few groups as
possible (groups without holes keep their codes). That re-quantization adds at most half of the new group's scale
to those keys' error. Appends pad to whole groups and merge the same way. So after every append and selection each
(row, head) holds fewer than ``group_size`` empty slots, that is exactly ``ceil(kept / group_size)`` groups: holes
never cost a group of their own, and the tier's slots are ``group_size * ceil(kept / group_size)`` for the (row,
head) keeping the most (what the quantized-pruning levels charge). ``plan_memory`` charges one group more when an
earlier stage removes tokens: heads then split their tokens between this tier and the full one differently, and each
tier pads to its fullest head.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from kvstack.kernels.quant_pack import PACK_FACTOR, PACK_UNIT, QuantizedGroups, dequantize, packed_length, quantize
from kvstack.kernels.tiered_attention import QuantTierData
from kvstack.stack.base import Stage, StageSpec, spec_error
from kvstack.stack.errors import KVStackError
from kvstack.stack.memory import POSITION_BYTES, TierPlan, _itemsize
from kvstack.stack.registry import register_stage
from kvstack.stack.tiers import EMPTY, ExactTier, bytewise, gather_records, gather_tokens, take_channels, widen_channels

from ._quant_options import QuantizationError, QuantOptions, TierCodec
from ._transform_tier import calibrate_bases, coder_bytes, transform_tier, transform_token_bytes

__all__ = [
    "QuantOptions", "QuantizationError", "QuantizeSpec", "QuantizedTier", "TierCodec", "check_quant_params",
    "check_quant_shape", "quantized_slot_bytes", "quantized_token_bytes",
]

QUANT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _packing(bits: int) -> tuple[int, str]:
    """(codes per packing unit, how they are packed): group sizes must be multiples of the former."""
    codes, nbytes = PACK_UNIT[bits]
    return codes, f"{codes} codes per byte" if nbytes == 1 else f"{codes} codes packed in {nbytes} bytes"


def check_quant_params(bits: int, group_size: int | None, value_group, residual: int | None) -> None:
    """Shape-independent checks shared by ``quantize`` and ``quantized_prune`` (``None``: not checked; key groups
    pack the keys' bits, value groups the values')."""
    pf, how = _packing(bits)
    if group_size is not None and group_size % pf:
        raise spec_error("group_size", group_size, f"a multiple of {pf} for bits={bits} ({how})")
    if isinstance(value_group, int) and value_group % pf:
        raise spec_error("value_group_size", value_group, f"a multiple of {pf} for bits={bits} ({how})")
    if residual is not None and residual % group_size:
        raise spec_error(
            "residual", residual, f"a multiple of group_size={group_size} (keys leave the residual a group at a time)"
        )


def check_quant_shape(shape, bits: int, value_group) -> None:
    if shape.dtype not in QUANT_DTYPES:
        raise spec_error(
            "bits", bits, f"16 for a {shape.dtype} model (quantization supports float32, float16 and bfloat16 models)"
        )
    vg = shape.value_dim if value_group == "head_dim" else value_group
    if shape.value_dim % vg:
        raise spec_error(
            "value_group_size", vg, f"a divisor of the model's head_dim={shape.value_dim} (value groups span channels)"
        )
    pf, how = _packing(bits)
    if vg % pf:
        raise spec_error("value_group_size", vg, f"a multiple of {pf} for bits={bits} ({how})")


def quantized_slot_bytes(
    shape,
    dtype,
    bits: int,
    group_size: int,
    value_group: int,
    extra_per_slot: int,
    key_dim: int | None = None,
    *,
    scale_dtype: torch.dtype | None = None,
    key_bits: int | None = None,
):
    """Cost of ``n`` tokens in a quantized tier per batch row (all KV heads): ``group_size * ceil(n / group_size)``
    slots of codes + per-group scale and zero (keys) + per-token scale and zero (values) + ``extra_per_slot``
    (positions and per-token records). ``key_dim``: key channels stored (default all); ``scale_dtype``: the format
    of scales and zero points (default ``dtype``); ``key_bits``: the keys' bits (default ``bits``). Constant
    per-layer tensors (``QuantOptions.fixed_bytes``) are not included."""
    e = _itemsize(scale_dtype or dtype)
    h, dk, dv = shape.num_kv_heads, shape.head_dim if key_dim is None else key_dim, shape.value_dim
    kb = bits if key_bits is None else key_bits

    def cost(n: int) -> int:
        slots = group_size * math.ceil(n / group_size)
        keys = slots * dk * kb // 8 + 2 * e * (slots // group_size) * dk
        values = slots * dv * bits // 8 + 2 * e * slots * (dv // value_group)
        return h * (keys + values) + slots * extra_per_slot

    return cost


def quantized_token_bytes(
    shape, dtype, bits: int, group_size: int, value_group: int, extra_per_token: float = 0.0, *,
    scale_dtype: torch.dtype | None = None, key_dim: int | None = None, key_bits: int | None = None,
) -> float:
    """Amortised bytes of one token in a quantized tier per batch row (all KV heads): codes, its share of the key
    groups' scale and zero, its values' scales and zeros, and ``extra_per_token`` (positions, records)."""
    e = _itemsize(scale_dtype or dtype)
    h, dk, dv = shape.num_kv_heads, shape.head_dim if key_dim is None else key_dim, shape.value_dim
    kb = bits if key_bits is None else key_bits
    return h * ((dk * kb + dv * bits) / 8 + 2 * e * (dk / group_size + dv / value_group)) + extra_per_token


class QuantizedTier(ExactTier):
    """Tokens with bit-packed keys (per-channel groups of ``group_size`` slots) and values (per-token groups).

    Tensors (batch first): ``key_codes`` uint8 [B, Hkv, T / pf, Dk], ``key_scale`` / ``key_zero`` [B, Hkv, T / G, Dk],
    ``value_codes`` uint8 [B, Hkv, T, Dv / pf], ``value_scale`` / ``value_zero`` [B, Hkv, T, Dv / Gv] (model dtype),
    ``positions`` [B, 1 | Hkv, T] and ``token_data``. ``T`` is always a multiple of ``G``; empty slots (holes)
    have position -1.

    Key channel pruning (``kind: channel_prune`` with this tier in the layer): ``key_index`` [B, Hkv, Dk'] lists the
    key channels kept; ``Dk`` above is then ``Dk'``. Keys are grouped per channel, so dropping channels drops whole
    columns of codes, scales and zero points: exact, nothing is re-quantized.

    ``codec`` (:class:`TierCodec`): the precision options. 3-bit codes pack 8 per 3 bytes (``T / pf`` above is then
    ``3 T / 8``); scales and zero points are in ``codec.scale_dtype`` when set; with a rotation or pre-RoPE keys
    the codes hold the transformed keys/values (quantized from float32), the tier rotates the query in
    ``attention_query``, re-applies RoPE / un-rotates keys in ``attention_block``, values' weighted sum in
    ``attention_output`` and both in ``gather``, and a ``random``
    rotation's matrix is held (and counted) with the tier. Such tiers leave the fused kernel (``kernel_data`` None).
    Tiers of one layer may share a codec (``quantized_prune``'s levels): one of them holds and counts its tensors,
    the others pass ``holds_codec_tensors=False``. ``key_bits`` (default ``bits``) stores the keys at other bits
    than the values (``quantized_prune``'s ``key_bits`` and ``layer_key_bits``).
    """

    _tensor_names = (
        "key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero", "positions", "key_index"
    )

    def __init__(
        self, bits: int, group_size: int, value_group: int, dtype: torch.dtype, label: str, name: str,
        codec: TierCodec | None = None, holds_codec_tensors: bool = True, key_bits: int | None = None,
    ):
        self.name = name
        self.bits = bits  # the values'
        self.key_bits = bits if key_bits is None else key_bits
        self.group_size = group_size
        self.value_group = value_group
        self.dtype = dtype
        self.label = label
        self.codec = codec or TierCodec()
        # normal-float levels exist for 2-4 bits; an 8-bit level sharing a codec with lower ones stays uniform
        self.levels = self.codec.levels if bits <= 4 else "uniform"
        self.key_levels = self.codec.levels if self.key_bits <= 4 else "uniform"
        self.holds_codec_tensors = holds_codec_tensors
        self.token_data = {}
        self.head_dim: int | None = None  # full key width, once key channels are pruned
        for n in self._tensor_names:
            setattr(self, n, None)

    # ----------------------------------------------------------------------------------- packed views
    def _data_dtype(self, axis: str) -> torch.dtype:
        """What the codes were quantized from: float32 for transformed keys/values, else the model dtype."""
        transformed = self.codec.keys_transformed if axis == "token" else self.codec.values_transformed
        return torch.float32 if transformed else self.dtype

    def key_groups(self) -> QuantizedGroups:
        b, h, _, d = self.key_codes.shape
        shape = (b, h, self.num_tokens, d)
        q = (self.key_codes, self.key_scale, self.key_zero)
        return QuantizedGroups(
            *q, self.key_bits, self.group_size, "token", shape, self.key_levels, self._data_dtype("token")
        )

    def value_groups(self) -> QuantizedGroups:
        b, h, t, packed = self.value_codes.shape
        codes, nbytes = PACK_UNIT[self.bits]
        shape = (b, h, t, packed * codes // nbytes)
        return QuantizedGroups(
            self.value_codes, self.value_scale, self.value_zero, self.bits, self.value_group, "channel", shape,
            self.levels, self._data_dtype("channel"),
        )

    def _quantize(self, x: torch.Tensor, group: int, axis: str, what: str) -> QuantizedGroups:
        data = self._data_dtype(axis)
        scale_dtype = self.codec.scale_dtype or (self.dtype if data != self.dtype else None)
        bits, levels = (self.key_bits, self.key_levels) if axis == "token" else (self.bits, self.levels)
        try:
            return quantize(
                x.to(data).contiguous(), bits, group, axis, levels=levels, scale_dtype=scale_dtype,
                clip=self.codec.value_clip if axis == "channel" else (),
            )
        except ValueError as err:
            raise QuantizationError(f"{self.label}: cannot quantize {what} to {bits} bits: {err}") from None

    def memory_bytes(self) -> int:
        held = sum(t.nbytes for t in self.codec.fixed_tensors().values()) if self.holds_codec_tensors else 0
        return super().memory_bytes() + held

    def release(self) -> None:
        """Called when this tier and its stage's other levels hold no token: the codec's tensors go."""
        if self.holds_codec_tensors:
            self.codec.release()

    # ------------------------------------------------------------------------------- attention side
    @property
    def block_align(self) -> int:
        return self.group_size

    def attention_query(self, query):
        return take_channels(self.codec.attention_query(query), self.key_index)

    def attention_block(self, start, stop, dtype):
        # temporaries of one key block: whole key groups, so codes, scales and zero points slice exactly
        keys = dequantize(self.key_groups().slice_tokens(start, stop), dtype)
        values = dequantize(self.value_groups().slice_tokens(start, stop), dtype)
        if self.codec.keys_transformed:
            keys = self.codec.attention_keys(keys, self.positions[..., start:stop])
        return keys, values  # rotated values stay rotated: attention_output un-rotates their weighted sum

    def attention_output(self, x):
        return self.codec.values(x)

    def kernel_data(self):
        if self.key_index is not None:  # the fused kernel reads every key channel
            return None
        if not self.codec.plain or {self.bits, self.key_bits} - set(PACK_FACTOR):  # uniform 2/4/8-bit codes, model scales
            return None
        return QuantTierData(self.key_groups(), self.value_groups(), self.positions)

    def gather(self, index):
        keys, values = dequantize(self.key_groups()), dequantize(self.value_groups())
        if self.codec.keys_transformed:
            keys = self.codec.keys(keys, self.positions).to(self.dtype)
        if self.codec.values_transformed:
            values = self.codec.values(values).to(self.dtype)
        keys = widen_channels(gather_tokens(keys, index), self.key_index, self.head_dim)
        return keys, gather_tokens(values, index)

    def keep_key_channels(self, index, head_dim) -> bool:
        if self.codec.keys_transformed:  # channels of the model's basis are mixed in the stored keys
            return False
        if self.key_index is not None:
            raise KVStackError(f"{self.label}: key channels are already pruned")
        if self.key_codes is not None:  # per-channel groups: whole columns of codes, scales and zeros go
            self.key_codes = take_channels(self.key_codes, index).contiguous()
            self.key_scale = bytewise(take_channels, self.key_scale, index).contiguous()
            self.key_zero = bytewise(take_channels, self.key_zero, index).contiguous()
        self.key_index, self.head_dim = index, head_dim
        return True

    def bytes_per_token(self) -> float:
        h, dk = self.key_codes.shape[1], self.key_codes.shape[-1]
        codes_per_unit, unit_bytes = PACK_UNIT[self.bits]
        dv = self.value_codes.shape[-1] * codes_per_unit // unit_bytes
        e = self.key_scale.element_size()
        codes = h * (dk * self.key_bits + dv * self.bits) / 8
        scales = h * 2 * e * (dk / self.group_size + dv / self.value_group)
        records = sum(v.shape[1] * v.element_size() for v in self.token_data.values())
        return codes + scales + self.positions.shape[1] * self.positions.element_size() + records

    # ---------------------------------------------------------------------------------- storage side
    def append(self, keys, values, positions, records=None) -> None:
        records = dict(records or {})
        # into the stored domain first (pre-RoPE keys need each token's own position), then real tokens first in every
        # (row, head), so they fill whole groups; empty slots repeat a real token's key and value so they never
        # widen a group's range
        keys = self.codec.store_keys(keys, positions)
        values = self.codec.store_values(values)
        valid = positions >= 0
        order = (~valid).to(torch.int8).argsort(dim=-1, stable=True)
        last = (valid.sum(-1, keepdim=True) - 1).clamp_min(0)
        source = torch.where(valid.gather(-1, order), order, order.gather(-1, last))
        keys, values = gather_tokens(keys, source), gather_tokens(values, source)
        positions = positions.gather(-1, order)
        records = {k: gather_records(v, order) for k, v in records.items()}
        keys = take_channels(keys, self.key_index)
        n = keys.shape[-2]
        pad = (-n) % self.group_size
        if pad:
            keys = torch.cat([keys, keys[..., -1:, :].expand(-1, -1, pad, -1)], dim=-2)
            values = torch.cat([values, values[..., -1:, :].expand(-1, -1, pad, -1)], dim=-2)
            positions = torch.cat([positions, positions.new_full((*positions.shape[:-1], pad), EMPTY)], dim=-1)
            records = {k: torch.cat([v, v.new_zeros(*v.shape[:-1], pad)], dim=-1) for k, v in records.items()}
        qk = self._quantize(keys, self.group_size, "token", "keys")
        qv = self._quantize(values, self.value_group, "channel", "values")
        if self.positions is None:
            self.key_codes, self.key_scale, self.key_zero = qk.packed, qk.scale, qk.zero
            self.value_codes, self.value_scale, self.value_zero = qv.packed, qv.scale, qv.zero
            self.positions = positions.to(torch.int32)
        else:
            if positions.shape[1] != self.positions.shape[1]:
                hp = max(positions.shape[1], self.positions.shape[1])
                positions, self.positions = positions.expand(-1, hp, -1), self.positions.expand(-1, hp, -1)
            qk = QuantizedGroups.cat_tokens([self.key_groups(), qk])
            qv = QuantizedGroups.cat_tokens([self.value_groups(), qv])
            self.key_codes, self.key_scale, self.key_zero = qk.packed, qk.scale, qk.zero
            self.value_codes, self.value_scale, self.value_zero = qv.packed, qv.scale, qv.zero
            self.positions = torch.cat([self.positions, positions.to(self.positions.dtype)], dim=-1)
        self._append_token_data(n + pad, records)
        if self._wasteful(self.valid()):
            self._reorganize(self.valid())

    def select(self, index, slot_valid) -> None:
        b, hi, _ = index.shape
        keep = torch.zeros(b, hi, self.num_tokens, dtype=torch.bool, device=index.device)
        keep.scatter_(-1, index, slot_valid)
        self._reorganize(keep)

    def _holes(self, keep: torch.Tensor) -> tuple[int, int]:
        """(largest number of empty slots in the groups that still hold a token, most such groups) over (row, head)."""
        if not keep.numel():
            return 0, 0
        g = self.group_size
        nonempty = (keep.reshape(*keep.shape[:-1], -1, g).sum(-1) > 0).sum(-1)
        return int((nonempty * g - keep.sum(-1)).max()), int(nonempty.max())

    def _wasteful(self, keep: torch.Tensor) -> bool:
        """True when dropping empty groups or merging the groups with holes would free at least one group."""
        holes, groups = self._holes(keep)
        return holes >= self.group_size or groups * self.group_size < self.num_tokens

    def _reorganize(self, keep: torch.Tensor) -> None:
        """Keep the slots ``keep`` [B, 1 | Hkv, T]: whole groups move exactly, emptied groups leave, and once the
        holes reach a group, the groups with holes are merged and re-quantized (module docstring)."""
        g, t = self.group_size, self.num_tokens
        width = max(keep.shape[1], self.positions.shape[1])
        keep = (keep & self.valid()).expand(-1, width, -1)
        b = keep.shape[0]
        per_group = keep.reshape(b, width, -1, g).sum(-1)  # [B, W, T/G]
        merge = self._holes(keep)[0] >= g
        whole = per_group == g if merge else per_group > 0
        whole_slot = whole.repeat_interleave(g, dim=-1)
        merged = keep & ~whole_slot
        slot = torch.arange(t, device=keep.device).expand(b, width, t)
        # whole groups first (in order), then the merged tokens, then what leaves
        order = torch.where(whole_slot, slot, torch.where(merged, slot + t, slot + 2 * t)).argsort(dim=-1)
        n_whole = whole.sum(-1, keepdim=True) * g  # [B, W, 1]
        n_merged = merged.sum(-1, keepdim=True)
        groups = whole.sum(-1, keepdim=True) + (n_merged + g - 1) // g
        t_new = int(groups.max()) * g if groups.numel() else 0
        src = order[..., :t_new]
        j = torch.arange(t_new, device=keep.device)
        in_whole = j < n_whole
        in_merged = (j >= n_whole) & (j < n_whole + n_merged)
        new_valid = (in_whole & keep.gather(-1, src)) | in_merged

        # keys: whole groups copy their codes; merged tokens are dequantized and re-quantized together
        group_src = src[..., ::g] // g  # [B, W, T_new / G]
        qk = self.key_groups()
        h, d = qk.packed.shape[1], qk.packed.shape[-1]
        per = packed_length(g, self.key_bits)  # bytes of one key group along the token axis
        gs = group_src.expand(-1, h, -1)
        codes = qk.packed.reshape(b, h, -1, per, d).gather(2, gs[..., None, None].expand(-1, -1, -1, per, d))
        codes = codes.reshape(b, h, -1, d)
        scale = bytewise(torch.gather, qk.scale, 2, gs[..., None].expand(-1, -1, -1, d))
        zero = bytewise(torch.gather, qk.zero, 2, gs[..., None].expand(-1, -1, -1, d))
        if merge and bool(n_merged.any()):
            last = src.gather(-1, (n_whole + n_merged - 1).clamp(0, max(t_new - 1, 0)))
            key_src = torch.where(in_merged | in_whole, src, last)  # holes repeat a merged key (no wider range)
            # groups quantize independently: only the groups past the fewest whole ones of any row are re-quantized
            # (a decode step's merge touches a few groups, not the tier)
            first = int(whole.sum(-1).min())
            requant = self._quantize(gather_tokens(dequantize(qk), key_src[..., first * g :]), g, "token", "keys")
            copied = torch.arange(first, t_new // g, device=keep.device) < whole.sum(-1, keepdim=True)
            copied = copied.expand(-1, h, -1)
            codes = torch.cat([codes[:, :, : first * per], torch.where(
                copied.repeat_interleave(per, dim=-1)[..., None], codes[:, :, first * per :], requant.packed)], dim=2)
            scale = torch.cat([scale[:, :, :first], torch.where(copied[..., None], scale[:, :, first:], requant.scale)],
                              dim=2)
            zero = torch.cat([zero[:, :, :first], torch.where(copied[..., None], zero[:, :, first:], requant.zero)],
                             dim=2)
        self.key_codes, self.key_scale, self.key_zero = codes.contiguous(), scale.contiguous(), zero.contiguous()

        self.value_codes = gather_tokens(self.value_codes, src)
        self.value_scale = bytewise(gather_tokens, self.value_scale, src)
        self.value_zero = bytewise(gather_tokens, self.value_zero, src)
        kept_pos = self.positions.expand(-1, width, -1).gather(-1, src)
        self.positions = torch.where(new_valid, kept_pos, torch.full_like(kept_pos, EMPTY))
        self.token_data = {k: gather_records(v, src) for k, v in self.token_data.items()}


def value_group_for(value_group, group_size: int, shape) -> int:
    if value_group is None:
        return group_size
    return shape.value_dim if value_group == "head_dim" else value_group


@register_stage
class QuantizeSpec(StageSpec, QuantOptions):
    """KIVI: quantize all but the newest ``residual`` tokens to ``bits`` with real bit-packing."""

    kind: Literal["quantize"] = "quantize"
    bits: Literal[2, 3, 4, 8, 16] = Field(
        default=2,
        description="Bits per key/value element (16: no quantization; 3: 8 codes in 3 bytes, group sizes multiples "
        "of 8).",
    )
    group_size: int = Field(default=32, ge=1, description="Tokens per key group (keys are grouped per channel).")
    value_group_size: int | Literal["head_dim"] | None = Field(
        default=None,
        description="Channels per value group (values are grouped per token); default group_size; head_dim: one "
        "group per token and head.",
    )
    residual: int = Field(
        default=32, ge=0, description="Newest tokens kept in full precision (a multiple of group_size)."
    )

    def inactive_options(self) -> set[str]:
        return self.quant_option_fields_inactive([self.bits])

    @property
    def value_bits(self) -> int | None:
        """The values' bits when transform-coded (``bits``); None: KIVI values."""
        return self.bits if self.values_coded else None

    @property
    def modifies_model(self) -> bool:  # type: ignore[override]
        return self.calibrates([self.bits])

    def prepare_model(self, model, calibration=None):
        return calibrate_bases(model, calibration, "quantize key_basis=calibrated")

    def validate_with(self, stack_budget) -> None:
        if isinstance(self.value_group_size, int) and self.value_group_size < 1:
            raise spec_error("value_group_size", self.value_group_size, "a positive int or 'head_dim'")
        if self.bits != 16:
            if self.transform_coded:  # no key groups: group_size only sets how many tokens leave the residual at once
                check_quant_params(self.bits, None, self.value_group_size, None)
                check_quant_params(8, self.group_size, None, self.residual)
            else:
                check_quant_params(self.bits, self.group_size, self.value_group_size, self.residual)
            self.check_quant_options([self.bits])

    def validate_in_stack(self, position, stages) -> None:
        if self.bits != 16:
            self.check_quant_options_in_stack(stages)

    def validate_for(self, shape, stack_budget) -> None:
        self.validate_with(stack_budget)
        if self.bits != 16:
            check_quant_shape(shape, self.bits, value_group_for(self.value_group_size, self.group_size, shape))
            self.check_quant_options_for(shape, [self.bits])

    def plan_memory(self, plan, stack_budget) -> None:
        if self.bits == 16:
            return
        shape, g, r = plan.shape, self.group_size, self.residual
        sdt = self.scale_torch_dtype()
        kv_bytes = shape.num_kv_heads * (shape.head_dim + shape.value_dim) * _itemsize(plan.dtype)
        for layer, window in zip(plan.layers, shape.layer_windows):
            full = layer.tier("full")
            extra = full.bytes_for(1) - kv_bytes  # positions and per-token records move with the tokens
            vg = value_group_for(self.value_group_size, g, shape)

            def cost_without(dropped: int, extra=extra, vg=vg):
                return quantized_slot_bytes(
                    shape, plan.dtype, self.bits, g, vg, extra, shape.head_dim - dropped, scale_dtype=sdt
                )

            cost = cost_without(0)
            if self.transform_coded:  # every part per token: no key groups, no holes
                scale_bytes = _itemsize(sdt or plan.dtype)
                per_token = round(transform_token_bytes(shape, self.bits, self.bits, vg, scale_bytes, extra,
                                                         self.key_scale, self.value_bits))
                cost = lambda n, c=per_token: n * c  # noqa: E731
            held = plan.seq_len if window is None else min(plan.seq_len, window - 1)
            if full.tokens == held and len(layer.tiers) == 1:
                residual = kivi_residual(plan.seq_len, plan.prefill_len, r, g, window)
            else:  # an earlier stage removes tokens: any split with at most r + g - 1 full-precision tokens. Heads
                # split their tokens differently (each tier pads to its fullest head: one head's residual with
                # another's quantized count), which one more key group's slots covers
                c = full.tokens
                if not self.transform_coded:
                    cost = lambda n, exact=cost: exact(n + g - 1) if n else 0  # noqa: E731
                residual = max(range(min(c, r + g - 1) + 1), key=lambda x: full.bytes_for(x) + cost(c - x))
            quantized = full.tokens - residual
            full.tokens = residual
            # a tier with transformed keys keeps every key channel (keep_key_channels refuses)
            narrowable = None if self.rotate != "none" or self.key_rope == "pre" else cost_without
            layer.tiers.append(TierPlan("quantized", quantized, cost, narrowable))
            if quantized:  # a random rotation's matrix, or the transform coders, exist from the first quantized token
                layer.fixed_bytes += self.fixed_bytes(shape) + (
                    coder_bytes(shape, self.bits, plan.dtype, self.key_scale, self.value_bits, self.prompt_axes)
                    if self.transform_coded
                    else 0
                )

    def build(self, shape, stack_budget) -> "QuantizeStage | None":
        return None if self.bits == 16 else QuantizeStage(self, shape, stack_budget)


def kivi_residual(seen: int, prefill: int, residual: int, group: int, window: int | None) -> int:
    """Full-precision tokens after ``seen`` tokens, ``prefill`` of them in the first forward and one per forward after,
    on a layer with an optional sliding window (which drops tokens before the flush)."""
    held = seen if window is None else min(seen, window - 1)
    first = prefill if window is None else min(prefill, window - 1)
    x = first - group * (max(first - residual, 0) // group) + (seen - prefill)
    if x >= residual + group and held >= residual + group:
        return residual + (x - residual) % group
    return min(x, held)


class QuantizeStage(Stage):
    spec: QuantizeSpec

    def __init__(self, spec, shape, stack_budget) -> None:
        super().__init__(spec, shape, stack_budget)
        self.value_group = value_group_for(spec.value_group_size, spec.group_size, shape)
        self.key = f"quantize:{id(self)}"

    def init_layer(self, layer) -> None:
        label = f"layer {layer.layer_idx}, quantize"
        codec = self.spec.codec(self.shape, layer.layer_idx)
        if self.spec.transform_coded:
            tier = transform_tier(self.shape, layer.layer_idx, self.spec.bits, self.spec.bits, self.value_group, label,
                                  "quantized", codec, basis=self.spec.key_basis, key_scale=self.spec.key_scale,
                                  value_bits=self.spec.value_bits, prompt_axes=self.spec.prompt_axes)
        else:
            tier = QuantizedTier(
                self.spec.bits, self.spec.group_size, self.value_group, self.shape.dtype, label=label,
                name="quantized", codec=codec,
            )
        layer.tiers.append(tier)
        layer.scratch[self.key] = tier

    def after_attention(self, layer, stats) -> None:
        full = layer.full
        g = self.spec.group_size
        if full.num_tokens < self.spec.residual + g:  # not a whole group past the residual yet: no host sync
            return
        pos = full.positions
        valid = pos >= 0
        flush = ((valid.sum(-1, keepdim=True) - self.spec.residual).clamp_min(0) // g) * g
        if not bool((flush > 0).any()):
            return
        # oldest first by position (the full tier need not be in position order once other stages move tokens)
        big = torch.iinfo(pos.dtype).max
        order = torch.where(valid, pos, torch.full_like(pos, big)).argsort(dim=-1)
        slots = torch.arange(pos.shape[-1], device=pos.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, slots)
        layer.demote(full, valid & (rank < flush), layer.scratch[self.key])
