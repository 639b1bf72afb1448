"""KIVI-style asymmetric group quantization with bit-packed codes.

Reference: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache", arXiv:2402.02750. Keys are quantized per channel (groups run along the
token axis, because key outliers live in fixed channels); values are quantized
per token (groups run along the channel axis).

Math, for one group of values ``x`` and ``b`` bits (``L = 2**b - 1``)::

    mn = min(x), mx = max(x)
    s  = ceil_dtype((mx - mn) / L)         # stored "scale", rounded UP to the dtype
    q  = clamp(floor((x - mn) / s + 0.5), 0, L)
    x^ = q * s + mn                        # dequantized

All arithmetic is float32. Scale and zero point (``mn``) are stored in the input
dtype (fp32 / fp16 / bf16). The scale is rounded *up* to the storage dtype
*before* the codes are computed, so codes are chosen against the scale that
dequantization will actually use, and ``(mx - mn) / s <= L`` (no element needs
clamping), which gives ``|x - x^| <= s / 2`` up to float rounding. ``mn`` is an
element of the input, so it is stored exactly.

Rounding is ``floor(v + 0.5)`` in both the torch reference and the Triton kernel
(one rule, so the two give bit-identical codes for the same float32 inputs).

Edge cases:

* zero range (``mx == mn``): ``s = 0`` is stored, all codes are 0 and the group
  dequantizes to ``mn`` exactly (the division is guarded).
* a non-zero range whose scale underflows to 0: the scale becomes the smallest
  positive (subnormal) value of the dtype (rounding up does this for fp16/bf16; an
  explicit guard for fp32). Such groups quantize exactly, because their values
  are multiples of that number.
* NaN/Inf in the input: ``ValueError`` (a silent NaN cache is never produced).
* huge magnitudes: the range is computed in float32, so e.g. ``1e30`` (fp32) and
  ``6e4`` (fp16; ``mx - mn`` would overflow fp16 but not fp32) work. For fp16 the
  scale is at most ``2 * 65504 / 3 < 65504`` and is always representable. The only
  unrepresentable case is a group whose range exceeds the float32 maximum (values
  beyond about ``+-1.7e38``, reachable with fp32/bf16 inputs); that raises
  ``ValueError`` rather than storing an infinite scale. Because the scale is
  rounded up, ``L * s + mn`` may exceed the dtype's max (e.g. a fp16 group
  spanning +-65504); dequantization clamps to the finite range, so it never
  returns inf.

Layout of :class:`QuantizedGroups` for an input ``x`` of shape ``[B, H, T, D]``
with group size ``G`` and pack factor ``pf = 8 // b`` (``PACK_FACTOR``):

* ``axis="token"`` (keys, per-channel): a group is ``G`` consecutive tokens of one
  channel. Codes are packed along T: ``packed`` is ``[B, H, T // pf, D]`` uint8;
  ``scale``/``zero`` are ``[B, H, T // G, D]``.
* ``axis="channel"`` (values, per-token): a group is ``G`` consecutive channels of
  one token. Codes are packed along D: ``packed`` is ``[B, H, T, D // pf]``;
  ``scale``/``zero`` are ``[B, H, T, D // G]``.

Within a byte, code ``i`` (``i < pf``) of ``pf`` consecutive codes along the packed
axis occupies bits ``[i*b, (i+1)*b)``. ``G`` must be a multiple of ``pf`` so no
byte straddles two groups (whole groups can then be appended/sliced freely).

Bytes, with ``N = B*H*T*D`` and ``e`` the itemsize of the input dtype::

    nbytes = N * b / 8  +  2 * (N / G) * e

e.g. 2 bits, G = 32, fp16: ``N/4 + N/8 = 0.375 N`` bytes versus ``2 N`` for fp16,
i.e. 18.75% of the fp16 footprint.

``quantize`` dispatches to a fused Triton kernel (group min/max, scale, codes
and packing in one pass) for CUDA tensors or when ``KVSTACK_KERNELS=triton``, and
to the torch reference otherwise (see :mod:`kvstack.kernels.dispatch`).
Dequantization has only a torch implementation (it is a cheap elementwise op).

Options below 4 bits (torch only; the Triton kernel covers 2/4/8 bits, uniform
levels and scales in the input dtype, and ``quantize`` falls back to the torch
path for anything else):

* ``bits=3``: codes are packed 8 per 3 bytes (``PACK_UNIT[3] = (8, 3)``): the 8
  codes of a unit form a 24-bit little-endian integer, code ``i`` in bits
  ``[3i, 3i + 3)``. ``G`` must be a multiple of 8; the packed axis has
  ``3 n / 8`` bytes. (2/4/8 bits are the one-byte units of the layout above.)
* ``levels="nf"``: non-uniform levels ``c_0 = 0 < c_1 < ... < c_L = 1``
  (:func:`nf_levels`): the Lloyd-Max (minimum mean squared error) quantizer of a
  standard normal on ``[-a, a]`` with both ends pinned, ``a`` the expected
  maximum of ``G`` normal samples (Blom's formula), mapped to ``[0, 1]``. A
  group stores ``s = ceil(max - z)`` (the whole range, not a step) and ``z``;
  ``q = argmin_k |(x - z) / s - c_k|`` (ties to the lower level), ``x^ = z + c_q s``,
  so ``|x - x^| <= s * max_k (c_{k+1} - c_k) / 2``.
* ``scale_dtype``: scale and zero point stored in another floating format
  (``float16``, ``bfloat16``, ``float8_e4m3fn``; default the input dtype), and
  the bounds above hold with the stored ``s``. The zero point is the group
  minimum rounded DOWN to the format (``z <= mn``: the range widens by at most
  ``ulp(mn)``, ``|mn| / 128`` for bfloat16, ``|mn| / 8`` for float8 e4m3, ``2**-9``
  near zero). The scale ``s* = (mx - z) / span`` (``span = L``, or 1 for nf) is
  rounded to the NEARER of its two neighbours in the format, but never below
  ``s* span / (span + g / 2)`` (``g`` the last gap: 1 step, or ``1 - c_{L-1}``
  for nf), else up: a top element beyond the top level is then at most half that
  gap above it and takes the top code, so ``|x - x^| <= s * gap_max / 2`` still
  holds. (Round-to-nearest halves the mean widening of the step; for e4m3 at 3
  bits it cut SmolLM2's attention-output error from +16% to +6% over bfloat16
  scales. Zero points placed off the group minimum — e.g. levels allowed half a
  step inside the group — have a smaller mean squared error but a larger
  attention error: the group extremes, which attention weighs most, lose their
  exactness.) A group whose zero or scale is outside the format's finite range
  (``+-448`` for e4m3, ``+-65504`` for float16) raises ``ValueError``.
* ``clip`` (ratios ``a`` in ``(0, 1]``, e.g. ``(1.0, 0.9, 0.8, 0.7)``): each group is
  first clamped to the centred fraction ``a`` of its range, ``[c - a h, c + a h]``
  with ``c = (mx + mn) / 2``, ``h = (mx - mn) / 2``, for the ratio whose
  quantization of the clamped group has the least squared error against the group
  (ties to the earlier ratio), then quantized as above: a mean-squared-error clip
  search in the spirit of AWQ's (arXiv 2306.00978) over a fixed grid, one
  quantization per ratio. With ``1.0`` among the ratios no group's squared error
  exceeds the unclipped one; an element beyond the clamp has error up to
  ``(1 - a) h`` plus half a step. (For values: attention reads values as a
  weighted mean, so their squared error is what counts; a key group's extremes set
  attention logits, which clipping loses.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import functools
import math

import torch

from kvstack.kernels.dispatch import use_triton

try:  # Triton is optional (Linux only); the torch path never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = [
    "PACK_FACTOR",
    "PACK_UNIT",
    "BITS",
    "LEVELS",
    "SCALE_DTYPES",
    "nf_levels",
    "packed_length",
    "AXES",
    "SUPPORTED_DTYPES",
    "QuantizedGroups",
    "pack_codes",
    "unpack_codes",
    "quantize",
    "dequantize",
    "quantize_reference",
    "dequantize_reference",
    "quantize_triton",
]

PACK_FACTOR = {2: 4, 4: 2, 8: 1}  # codes per byte of the bit widths that divide 8 (what the Triton kernels read)
#: bits -> (codes, bytes) of one packing unit: no unit straddles two groups
PACK_UNIT = {2: (4, 1), 3: (8, 3), 4: (2, 1), 8: (1, 1)}
BITS = tuple(sorted(PACK_UNIT))
AXES = ("token", "channel")
LEVELS = ("uniform", "nf")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: formats scales and zero points may be stored in (``scale_dtype``)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def packed_length(n: int, bits: int) -> int:
    """Bytes of ``n`` codes along the packed axis (``n`` a multiple of the unit's code count)."""
    codes, nbytes = PACK_UNIT[bits]
    return n * nbytes // codes


@functools.lru_cache(maxsize=None)
def _nf_levels_cached(bits: int, group_elems: int) -> tuple[float, ...]:
    levels = (1 << bits) - 1
    n = max(int(group_elems), 2)
    a = float(torch.special.ndtri(torch.tensor((n - 0.375) / (n + 0.25), dtype=torch.float64)))
    y = torch.linspace(-a, a, levels + 1, dtype=torch.float64)
    inv_sqrt_2pi = 1.0 / math.sqrt(2.0 * math.pi)
    for _ in range(10_000):
        t = (y[:-1] + y[1:]) / 2  # cell boundaries between neighbouring levels
        lo, hi = t[:-1], t[1:]  # cells of the interior levels 1 .. L-1 (the ends stay pinned at -a, a)
        mass = torch.special.ndtr(hi) - torch.special.ndtr(lo)
        moment = (torch.exp(-lo * lo / 2) - torch.exp(-hi * hi / 2)) * inv_sqrt_2pi
        new = y.clone()
        new[1:-1] = moment / mass
        done = float((new - y).abs().max()) < 1e-13
        y = new
        if done:
            break
    c = ((y + a) / (2 * a)).clamp(0.0, 1.0)
    c[0], c[-1] = 0.0, 1.0
    return tuple(float(v) for v in c)


def nf_levels(bits: int, group_elems: int) -> torch.Tensor:
    """The ``levels="nf"`` codebook for groups of ``group_elems`` elements: float64 ``[2**bits]``, ascending,
    ``c[0] = 0``, ``c[-1] = 1`` (module docstring). Deterministic (closed-form Lloyd-Max iteration, no sampling)."""
    _check_bits(bits)
    return torch.tensor(_nf_levels_cached(bits, group_elems), dtype=torch.float64)


@functools.lru_cache(maxsize=None)
def _codebook(bits: int, group_elems: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels, midpoints between neighbouring levels) in float32 on ``device``."""
    c = nf_levels(bits, group_elems)
    return c.float().to(device), ((c[:-1] + c[1:]) / 2).float().to(device)

# Largest |x| for which mx - mn cannot overflow float32 (2 * 2**127 rounds to inf).
_RANGE_SAFE_ABS = 2.0**127


# --------------------------------------------------------------------------- #
# validation
# --------------------------------------------------------------------------- #
def _check_bits(bits) -> int:
    """Validate ``bits``; returns the codes per packing unit (what group sizes must be a multiple of)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in PACK_UNIT:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {list(BITS)}")
    return PACK_UNIT[bits][0]


def _unit_words(bits: int) -> str:
    codes, nbytes = PACK_UNIT[bits]
    return f"{codes} per byte" if nbytes == 1 else f"{codes} per {nbytes} bytes"


def _check_levels(levels, bits: int) -> None:
    if levels not in LEVELS:
        raise ValueError(f"levels={levels!r} is not supported; allowed: {list(LEVELS)}")
    if levels == "nf" and bits == 8:
        raise ValueError("levels='nf' is not supported with bits=8; allowed: bits 2, 3 or 4")


def _check_scale_dtype(scale_dtype) -> None:
    if scale_dtype is not None and scale_dtype not in SCALE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SCALE_DTYPES)
        raise ValueError(f"scale_dtype={scale_dtype!r} is not supported; allowed: None (the input dtype), {names}")


def _check_axis(axis) -> None:
    if axis not in AXES:
        raise ValueError(f"axis={axis!r} is not supported; allowed: {list(AXES)}")


def _check_quant_args(x: torch.Tensor, bits: int, group_size: int, axis: str) -> int:
    """Validate quantize() arguments; returns the pack factor."""
    pf = _check_bits(bits)
    _check_axis(axis)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must have shape [B, H, T, D]; got {x.dim()} dims, shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"x dtype {x.dtype} is not supported; allowed: float32, float16, bfloat16"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size={group_size!r} must be a positive int")
    if group_size % pf != 0:
        raise ValueError(
            f"group_size={group_size} is not a multiple of the pack factor {pf} for bits={bits} "
            f"(codes are packed {_unit_words(bits)} along the {axis} axis; groups may not share bytes)"
        )
    if axis == "token":
        n, what = x.shape[2], "token count"
    else:
        n, what = x.shape[3], "head_dim"
    if n % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide the {what} {n} "
            f"(axis={axis!r} groups span {group_size} consecutive "
            f"{'tokens' if axis == 'token' else 'channels'})"
        )
    return pf


def _check_finite(x: torch.Tensor) -> bool:
    """Raise on NaN/Inf. Returns True when values are large enough that a group
    range could overflow float32 (caller must then check the scale).

    One reduction + one host sync covers both checks in the common case.
    """
    amax = x.detach().abs().amax().float().item()
    if amax != amax or amax == float("inf"):
        bad = int((~torch.isfinite(x)).sum().item())
        raise ValueError(
            f"cannot quantize non-finite values: {bad} NaN/Inf found in input of shape "
            f"{tuple(x.shape)} (dtype {x.dtype})"
        )
    return amax >= _RANGE_SAFE_ABS


def _check_scale_finite(scale: torch.Tensor) -> None:
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(
            "cannot quantize: a group's range (max - min) overflows float32; values beyond "
            "about +-1.7e38 cannot be quantized"
        )


def _smallest_subnormal(dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype)
    return float(fi.tiny * fi.eps)  # 2**-24 fp16, 2**-133 bf16, 2**-149 fp32


# --------------------------------------------------------------------------- #
# bit packing
# --------------------------------------------------------------------------- #
def pack_codes(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack uint8 codes (< 2**bits) along ``dim``; ``n`` codes become ``packed_length(n, bits)`` bytes.

    2/4/8 bits: code ``i`` of each run of ``8 // bits`` consecutive codes goes to bits ``[i*bits, (i+1)*bits)``
    of the output byte. 3 bits: each run of 8 codes is a 24-bit little-endian integer in 3 bytes, code ``i`` in
    bits ``[3i, 3i + 3)``.
    """
    pf = _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("codes must have at least one dimension")
    dim = dim % codes.dim()
    n = codes.shape[dim]
    if n % pf != 0:
        raise ValueError(
            f"size {n} of codes along dim {dim} is not divisible by the pack factor {pf} "
            f"for bits={bits}"
        )
    if bits < 8 and codes.numel() and bool((codes >> bits).any()):
        raise ValueError(f"codes must be < 2**bits = {1 << bits} for bits={bits}")
    if pf == 1:
        return codes.clone()
    c = codes.movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], n // pf, pf)
    if bits == 3:
        word = c[..., 0].to(torch.int32)
        for i in range(1, pf):
            word = word | (c[..., i].to(torch.int32) << (3 * i))
        out = torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1).to(torch.uint8)
        out = out.reshape(*c.shape[:-2], packed_length(n, bits))
        return out.movedim(-1, dim).contiguous()
    out = c[..., 0].clone()
    for i in range(1, pf):
        out |= c[..., i] << (i * bits)
    return out.movedim(-1, dim).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_codes`; ``dim`` grows from bytes to codes."""
    pf = _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dimension")
    dim = dim % packed.dim()
    if pf == 1:
        return packed.clone()
    return _unpack_to_int(packed, bits, dim).to(torch.uint8)


def _unpack_to_int(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """:func:`unpack_codes` without the checks, in the integer dtype the unpacking computes in (uint8, or int32 for
    3 bits: an index for a codebook as it is). Contiguous in the input's layout: code ``i`` of a unit sits right after
    it along ``dim``, so the shifts broadcast on a new axis there and the two axes merge (no transposed copies)."""
    pre, m, post = packed.shape[:dim], packed.shape[dim], packed.shape[dim + 1 :]
    trailing = len(post)
    if bits == 3:
        if m % 3:
            raise ValueError(f"size {m} of packed 3-bit codes along dim {dim} is not a multiple of 3 bytes")
        p = packed.reshape(*pre, m // 3, 3, *post).to(torch.int32)
        word = p.select(dim + 1, 0) | (p.select(dim + 1, 1) << 8) | (p.select(dim + 1, 2) << 16)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device).view(8, *([1] * trailing))
        return ((word.unsqueeze(dim + 1) >> shifts) & 7).reshape(*pre, m // 3 * 8, *post)
    pf = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(pf, *([1] * trailing))
    c = (packed.unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)  # [..., n, pf, ...]
    return c.reshape(*pre, m * pf, *post)


# --------------------------------------------------------------------------- #
# container
# --------------------------------------------------------------------------- #
@dataclass
class QuantizedGroups:
    """One quantized block of a ``[B, H, T, D]`` tensor (layout: module docstring)."""

    packed: torch.Tensor  # uint8
    scale: torch.Tensor  # input dtype, or the scale_dtype it was quantized with
    zero: torch.Tensor  # same dtype as scale (group minimum, rounded down when scale_dtype differs)
    bits: int
    group_size: int
    axis: str  # "token" (keys, per-channel) or "channel" (values, per-token)
    shape: tuple[int, ...]  # original [B, H, T, D]
    levels: str = "uniform"  # "uniform" (min-max steps) or "nf" (nf_levels codebook)
    data_dtype: torch.dtype | None = None  # dtype of the quantized input (None: the scale's dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the data that was quantized (what :func:`dequantize` returns by default)."""
        return self.data_dtype or self.scale.dtype

    @property
    def plain(self) -> bool:
        """Uniform levels, 2/4/8 bits and scales in the data dtype: the layout the Triton kernels read."""
        return self.levels == "uniform" and self.bits in PACK_FACTOR and self.scale.dtype == self.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def num_tokens(self) -> int:
        return int(self.shape[2])

    @property
    def packed_dim(self) -> int:
        """Dimension of ``packed`` along which codes are packed."""
        return 2 if self.axis == "token" else 3

    def nbytes(self) -> int:
        """Bytes held: packed codes + scale + zero."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    def index_select(self, index: torch.Tensor) -> "QuantizedGroups":
        """Select along the batch dim (dim 0), e.g. to reorder beams."""
        index = index.to(self.device)
        return replace(
            self,
            packed=self.packed.index_select(0, index),
            scale=self.scale.index_select(0, index),
            zero=self.zero.index_select(0, index),
            shape=(int(index.numel()),) + tuple(self.shape[1:]),
        )

    def slice_tokens(self, start: int, stop: int) -> "QuantizedGroups":
        """Tokens ``[start, stop)``. For ``axis="token"`` both ends must sit on group
        boundaries (a group's scale covers all its tokens)."""
        T = self.num_tokens
        start, stop, _ = slice(start, stop).indices(T)
        stop = max(stop, start)
        if self.axis == "token":
            G = self.group_size
            if start % G or stop % G:
                raise ValueError(
                    f"slice_tokens({start}, {stop}) on axis='token' data must be aligned to "
                    f"group_size {G}"
                )
            packed = self.packed[:, :, packed_length(start, self.bits): packed_length(stop, self.bits)]
            scale = self.scale[:, :, start // G: stop // G]
            zero = self.zero[:, :, start // G: stop // G]
        else:
            packed = self.packed[:, :, start:stop]
            scale = self.scale[:, :, start:stop]
            zero = self.zero[:, :, start:stop]
        shape = tuple(self.shape[:2]) + (stop - start,) + tuple(self.shape[3:])
        return replace(self, packed=packed, scale=scale, zero=zero, shape=shape)

    @classmethod
    def cat_tokens(cls, items: Sequence["QuantizedGroups"]) -> "QuantizedGroups":
        """Concatenate blocks along the token axis (same bits/group/axis/B/H/D)."""
        if not items:
            raise ValueError("cat_tokens needs at least one block")
        first = items[0]
        for q in items[1:]:
            if (q.bits, q.group_size, q.axis, q.levels, q.dtype, q.scale.dtype) != (
                first.bits, first.group_size, first.axis, first.levels, first.dtype, first.scale.dtype
            ) or (
                tuple(q.shape[:2]) + tuple(q.shape[3:])
                != tuple(first.shape[:2]) + tuple(first.shape[3:])
            ):
                raise ValueError("cat_tokens: blocks differ in bits/group_size/axis/levels/dtypes or B/H/D")
        T = sum(q.num_tokens for q in items)
        return replace(
            first,
            packed=torch.cat([q.packed for q in items], dim=2),
            scale=torch.cat([q.scale for q in items], dim=2),
            zero=torch.cat([q.zero for q in items], dim=2),
            shape=tuple(first.shape[:2]) + (T,) + tuple(first.shape[3:]),
        )

    def to(self, device) -> "QuantizedGroups":
        return replace(
            self,
            packed=self.packed.to(device),
            scale=self.scale.to(device),
            zero=self.zero.to(device),
        )


# --------------------------------------------------------------------------- #
# torch reference
# --------------------------------------------------------------------------- #
def _grouped(t: torch.Tensor, group_size: int, axis: str) -> tuple[torch.Tensor, int]:
    """View [B,H,T,D] as groups; returns (view, reduction dim)."""
    B, H, T, D = t.shape
    if axis == "token":
        return t.reshape(B, H, T // group_size, group_size, D), 3
    return t.reshape(B, H, T, D // group_size, group_size), 4


def quantize_reference(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    axis: str,
    *,
    levels: str = "uniform",
    scale_dtype: torch.dtype | None = None,
    clip: Sequence[float] = (),
) -> QuantizedGroups:
    """Plain-torch quantization (see module docstring for math, layout and the options ``levels``,
    ``scale_dtype`` and ``clip``)."""
    _check_quant_args(x, bits, group_size, axis)
    _check_levels(levels, bits)
    _check_scale_dtype(scale_dtype)
    _check_clip(clip)
    maybe_overflow = _check_finite(x) if x.numel() else False
    if clip and x.numel():
        x = _clipped(x, bits, group_size, axis, maybe_overflow, levels, scale_dtype, clip)
    return _quantize_reference_unchecked(x, bits, group_size, axis, maybe_overflow, levels, scale_dtype)


def _check_clip(clip) -> None:
    if any(not (isinstance(a, (int, float)) and 0.0 < a <= 1.0) for a in clip):
        raise ValueError(f"clip={tuple(clip)!r} is not allowed: ratios in (0, 1] (fractions of a group's range)")


def _clipped(x, bits, group_size, axis, maybe_overflow, levels, scale_dtype, ratios) -> torch.Tensor:
    """``x`` with each group clamped to the centred fraction of its range, among ``ratios``, whose quantization has
    the least squared error (module docstring, ``clip``); in ``x``'s dtype, so a clamped bound is an element."""
    xf = x.detach().float()
    xg, red = _grouped(xf, group_size, axis)
    mn, mx = xg.amin(dim=red, keepdim=True), xg.amax(dim=red, keepdim=True)
    mid, half = (mx + mn) / 2, (mx - mn) / 2
    best = best_err = None
    for a in ratios:
        if a >= 1.0:  # the group as it is (mid +- half may round off its extremes)
            clamped = x
        else:
            clamped = torch.minimum(torch.maximum(xg, mid - a * half), mid + a * half).reshape(x.shape).to(x.dtype)
        q = _quantize_reference_unchecked(clamped, bits, group_size, axis, maybe_overflow, levels, scale_dtype)
        err = ((dequantize_reference(q, torch.float32) - xf) ** 2).reshape(xg.shape).sum(dim=red, keepdim=True)
        if best is None:
            best, best_err = clamped.reshape(xg.shape), err
        else:
            better = err < best_err
            best = torch.where(better, clamped.reshape(xg.shape), best)
            best_err = torch.where(better, err, best_err)
    return best.reshape(x.shape)


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {2: torch.int16, 1: torch.int8}[torch.empty((), dtype=dtype).element_size()]


def _round_scale_up(s32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest ``dtype`` value >= ``s32`` (non-negative), returned as float32.

    Rounding the scale up (not to nearest) keeps ``(mx - mn) / s <= L``, so the top
    of a group never needs clamping. With round-to-nearest, bf16's 8-bit mantissa
    could shrink the scale by 2**-8 and the clamped max of an 8-bit group would be
    off by ~255 * 2**-8 * s, i.e. a whole step instead of half of one. A value beyond
    the format's largest finite one (float16, float8) becomes inf or NaN: callers check.
    """
    if dtype == torch.float32:
        return s32
    itype = _int_view(dtype)
    r = s32.to(dtype)  # round to nearest even (float8: saturating)
    bump = (r.float() < s32).to(itype)
    return (r.view(itype) + bump).view(dtype).float()


def _round_scale_nearest_within(s32: torch.Tensor, dtype: torch.dtype, floor_ratio: float) -> torch.Tensor:
    """The ``dtype`` value nearest to ``s32`` (non-negative) among those >= ``floor_ratio * s32``, as float32: the
    lower neighbour when it is nearer and not below that floor, else the upper one (:func:`_round_scale_up`)."""
    up = _round_scale_up(s32, dtype)
    down = _round_down(s32, dtype)
    use_down = (down >= s32 * floor_ratio) & (s32 - down < up - s32)
    return torch.where(use_down, down, up)


def _round_down(v32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest ``dtype`` value <= ``v32`` (any sign), returned as float32 (inf/NaN beyond the finite range)."""
    if dtype == torch.float32:
        return v32
    itype = _int_view(dtype)
    r = v32.to(dtype)
    rf = r.float()
    over = rf > v32
    bits = r.view(itype)
    # sign-magnitude: one step down is one less magnitude above zero and one more below it (or at -0)
    stepped = torch.where(rf > 0, bits - 1, bits + 1).view(dtype).float()
    out = torch.where(over, stepped, rf)
    # +0 rounded from a tiny negative value: the step goes to the smallest negative subnormal
    return torch.where(over & (rf == 0), torch.full_like(out, -_smallest_subnormal(dtype)), out)


def _check_representable(z: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> None:
    if not bool(torch.isfinite(z).all() & torch.isfinite(s).all()):
        fmax = torch.finfo(dtype).max
        raise ValueError(
            f"cannot quantize: a group's minimum or scale is outside the finite range of the scale dtype "
            f"{str(dtype).removeprefix('torch.')} (+-{fmax:g}); use a wider scale_dtype (e.g. bfloat16 or the model "
            "dtype)"
        )


def _quantize_reference_unchecked(x, bits, group_size, axis, maybe_overflow, levels="uniform", scale_dtype=None):
    dtype = x.dtype
    sdt = scale_dtype or dtype
    top = (1 << bits) - 1
    xg, red = _grouped(x.detach().float(), group_size, axis)
    mn = xg.amin(dim=red, keepdim=True)
    mx = xg.amax(dim=red, keepdim=True)
    steps = float(top) if levels == "uniform" else 1.0  # nf stores the whole range, the codebook divides it
    # the zero point: the group minimum (exact in the input dtype), else rounded down to the scale format
    z = mn if sdt == dtype else _round_down(mn, sdt)
    rng = mx - z
    # Tensor/tensor division: torch may turn division by a Python scalar into a
    # multiply by the reciprocal (on CUDA), which would break bit-exactness.
    s = rng / torch.full_like(rng, steps)
    if sdt == dtype:
        s = _round_scale_up(s, sdt)
    else:  # the nearer neighbour when the top element stays within half its gap of the top level, else up
        last = 1.0 if levels == "uniform" else 1.0 - _nf_levels_cached(bits, group_size)[-2]
        s = _round_scale_nearest_within(s, sdt, steps / (steps + last / 2))
    s = torch.where((s == 0) & (rng > 0), torch.full_like(s, _smallest_subnormal(sdt)), s)
    if sdt != dtype and x.numel():
        _check_representable(z, s, sdt)
    if maybe_overflow:
        _check_scale_finite(s)
    pos = s > 0
    v = (xg - z) / torch.where(pos, s, torch.ones_like(s))
    if levels == "uniform":
        codes = torch.floor(v + 0.5).clamp_(0, top)
    else:
        _, mids = _codebook(bits, group_size, x.device)
        codes = torch.bucketize(v.clamp(0.0, 1.0), mids).float()
    codes = torch.where(pos, codes, torch.zeros_like(codes)).to(torch.uint8)
    codes = codes.reshape(x.shape)
    packed = pack_codes(codes, bits, dim=2 if axis == "token" else 3)
    return QuantizedGroups(
        packed=packed,
        scale=s.squeeze(red).to(sdt),
        zero=z.squeeze(red).to(sdt),
        bits=bits,
        group_size=group_size,
        axis=axis,
        shape=tuple(x.shape),
        levels=levels,
        data_dtype=None if sdt == dtype else dtype,
    )


def dequantize_reference(q: QuantizedGroups, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch dequantization: ``code * scale + zero`` (uniform) or ``level[code] * scale + zero`` (nf) in
    float32, then cast."""
    _check_bits(q.bits)
    _check_axis(q.axis)
    _check_levels(q.levels, q.bits)
    out_dtype = dtype or q.dtype
    codes = _unpack_to_int(q.packed, q.bits, q.packed_dim) if q.bits != 8 else q.packed
    if q.levels == "uniform":
        codes = codes.float()
    else:  # a flat index_select: several times faster than advanced indexing on the CPU
        levels = _codebook(q.bits, q.group_size, codes.device)[0]
        codes = levels.index_select(0, codes.int().reshape(-1)).view(codes.shape)
    cg, red = _grouped(codes, q.group_size, q.axis)
    s = q.scale.float().unsqueeze(red)
    z = q.zero.float().unsqueeze(red)
    out = torch.addcmul(z, cg, s)
    # The scale is rounded up, so the top code can land slightly above the group
    # max; for groups touching the dtype's max (e.g. +-65504 in fp16) that would
    # cast to inf. Clamping to the finite range only moves values toward the input
    # (float32 and bfloat16 share float32's range: nothing to clamp there).
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float64):
        fmax = torch.finfo(out_dtype).max
        out = out.clamp_(-fmax, fmax)
    return out.reshape(q.shape).to(out_dtype)


# --------------------------------------------------------------------------- #
# Triton kernel
# --------------------------------------------------------------------------- #
def _quant_pack_kernel_fn(
    x_ptr, packed_ptr, scale_ptr, zero_ptr,
    inner,  # groups per outer row
    n_iblocks,  # cdiv(inner, BLOCK_I)
    xs_o, xs_r, xs_i,  # x strides: outer row, position inside group, inner index
    ps_o, ps_k, ps_i,  # packed strides: outer row, byte inside group, inner index
    tiny,  # smallest positive value of the storage dtype (scale underflow guard)
    BITS: tl.constexpr, PF: tl.constexpr, KG: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_I: tl.constexpr,
    STORE_BF16: tl.constexpr, STORE_FP16: tl.constexpr,
):
    # The tensor is viewed as [outer, G, inner]; one program handles one row block
    # (BLOCK_I groups of one outer row). Group element r = k * PF + p lands in byte
    # k, bits [p*BITS, (p+1)*BITS); loading per p lets us OR codes without reshapes.
    # 1-D grid: CUDA caps grid dims 1/2 at 65535.
    pid = tl.program_id(0).to(tl.int64)
    o = pid // n_iblocks
    offs_k = tl.arange(0, BLOCK_K)
    offs_i = (pid % n_iblocks) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < inner
    mask = (offs_k < KG)[:, None] & mask_i[None, :]
    x_base = x_ptr + o * xs_o + offs_i[None, :] * xs_i
    LEVELS: tl.constexpr = (1 << BITS) - 1

    mn = tl.full([BLOCK_I], float("inf"), tl.float32)
    mx = tl.full([BLOCK_I], float("-inf"), tl.float32)
    for p in tl.static_range(PF):
        xv = tl.load(x_base + (offs_k * PF + p)[:, None] * xs_r, mask=mask, other=0.0).to(tl.float32)
        mn = tl.minimum(mn, tl.reduce(tl.where(mask, xv, float("inf")), 0, _MIN_COMBINE))
        mx = tl.maximum(mx, tl.reduce(tl.where(mask, xv, float("-inf")), 0, _MAX_COMBINE))
    mn = tl.where(mask_i, mn, 0.0)  # keep padding lanes finite
    mx = tl.where(mask_i, mx, 0.0)

    rng = mx - mn
    s32 = tl.div_rn(rng, tl.full([BLOCK_I], LEVELS, tl.float32))
    # Round the scale UP to the storage dtype (see _round_scale_up), by bit tricks.
    if STORE_BF16:
        # bf16 is the top half of fp32: ceil = add 0xFFFF and truncate. (Also avoids
        # the interpreter's fp32->bf16 cast, which truncates instead of rounding.)
        b = s32.to(tl.int32, bitcast=True)
        s = ((b + 0xFFFF) & -65536).to(tl.float32, bitcast=True)
    elif STORE_FP16:
        h = s32.to(tl.float16)  # round to nearest even
        hb = h.to(tl.int16, bitcast=True) + (h.to(tl.float32) < s32).to(tl.int16)
        s = hb.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        s = s32
    s = tl.where((s == 0.0) & (rng > 0.0), tiny, s)
    pos = s > 0.0
    safe = tl.where(pos, s, 1.0)

    sz_off = o * inner + offs_i
    tl.store(scale_ptr + sz_off, s.to(scale_ptr.dtype.element_ty), mask=mask_i)
    tl.store(zero_ptr + sz_off, mn.to(zero_ptr.dtype.element_ty), mask=mask_i)

    acc = tl.full([BLOCK_K, BLOCK_I], 0, tl.int32)
    for p in tl.static_range(PF):
        xv = tl.load(x_base + (offs_k * PF + p)[:, None] * xs_r, mask=mask, other=0.0).to(tl.float32)
        v = tl.div_rn(xv - mn[None, :], safe[None, :])
        c = tl.floor(v + 0.5)
        c = tl.minimum(tl.maximum(c, 0.0), LEVELS * 1.0)
        c = tl.where(pos[None, :], c, 0.0)
        acc = acc | (c.to(tl.int32) << (p * BITS))
    p_off = o * ps_o + offs_k[:, None] * ps_k + offs_i[None, :] * ps_i
    tl.store(packed_ptr + p_off, acc.to(tl.uint8), mask=mask)


# Only Triton *builtins* are used in the kernel (tl.reduce with the standard
# library's min/max combiners instead of tl.min/tl.max, tl.full instead of
# tl.zeros). The @jit helpers of triton.language.standard are decorated once, when
# triton is first imported; if that happened before TRITON_INTERPRET=1 was set
# (e.g. a conftest importing transformers), calling them from an interpreted
# kernel fails. The combiners are passed to tl.reduce, whose interpreter fast
# path recognises them by identity, so they work either way.
if tl is not None:
    _MIN_COMBINE = tl.standard._elementwise_min
    _MAX_COMBINE = tl.standard._elementwise_max

_KERNELS: dict = {}


def _get_kernel():
    # JIT lazily and per interpreter mode: triton.jit decides at decoration time
    # whether to build an interpreted function (TRITON_INTERPRET=1), so decorating
    # at import would freeze whatever the environment was when kvstack was imported.
    if triton is None:
        raise RuntimeError("the Triton quantize kernel needs the 'triton' package")
    interp = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False
    if interp not in _KERNELS:
        _KERNELS[interp] = triton.jit(_quant_pack_kernel_fn)
    return _KERNELS[interp]


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def quantize_triton(x: torch.Tensor, bits: int, group_size: int, axis: str) -> QuantizedGroups:
    """Fused Triton quantize-and-pack; same results as :func:`quantize_reference` (2/4/8 bits, uniform levels,
    scales in the input dtype)."""
    if bits not in PACK_FACTOR:
        raise ValueError(f"bits={bits!r} is not supported by the Triton kernel; allowed: {sorted(PACK_FACTOR)}")
    pf = _check_quant_args(x, bits, group_size, axis)
    maybe_overflow = _check_finite(x) if x.numel() else False
    x = x.detach().contiguous()
    B, H, T, D = x.shape
    G, KG = group_size, group_size // pf
    if axis == "token":
        outer, inner = B * H * (T // G), D
        x_strides, p_strides = (G * D, D, 1), (KG * D, D, 1)
        packed = torch.empty((B, H, T // pf, D), dtype=torch.uint8, device=x.device)
        scale = torch.empty((B, H, T // G, D), dtype=x.dtype, device=x.device)
    else:
        # Channel groups are contiguous runs of G elements, so all B*H*T*D/G groups
        # form one long "row" (no per-token programs: few, wide programs instead).
        outer, inner = 1, B * H * T * (D // G)
        x_strides, p_strides = (0, 1, G), (0, 1, KG)
        packed = torch.empty((B, H, T, D // pf), dtype=torch.uint8, device=x.device)
        scale = torch.empty((B, H, T, D // G), dtype=x.dtype, device=x.device)
    zero = torch.empty_like(scale)
    if outer > 0 and inner > 0:
        BLOCK_K = _next_pow2(KG)
        # Cap each loaded sub-tile at ~4096 elements.
        BLOCK_I = min(_next_pow2(inner), max(1, 4096 // BLOCK_K))
        n_iblocks = triton.cdiv(inner, BLOCK_I)
        _get_kernel()[(outer * n_iblocks,)](
            x, packed, scale, zero,
            inner, n_iblocks, *x_strides, *p_strides,
            _smallest_subnormal(x.dtype),
            BITS=bits, PF=pf, KG=KG, BLOCK_K=BLOCK_K, BLOCK_I=BLOCK_I,
            STORE_BF16=x.dtype == torch.bfloat16, STORE_FP16=x.dtype == torch.float16,
        )
    if maybe_overflow:
        _check_scale_finite(scale)
    return QuantizedGroups(packed, scale, zero, bits, group_size, axis, tuple(x.shape))


# --------------------------------------------------------------------------- #
# dispatchers
# --------------------------------------------------------------------------- #
def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    axis: str,
    *,
    levels: str = "uniform",
    scale_dtype: torch.dtype | None = None,
    clip: Sequence[float] = (),
) -> QuantizedGroups:
    """Quantize ``x`` ``[B, H, T, D]`` in groups of ``group_size`` along ``axis``.

    Uses the Triton kernel for CUDA tensors (or ``KVSTACK_KERNELS=triton``) when it covers the request (2/4/8
    bits, uniform levels, scales in the input dtype, no clip search), the torch reference otherwise. Raises
    ``ValueError`` for bad arguments and non-finite input (details in the module docstring).
    """
    plain = levels == "uniform" and bits in PACK_FACTOR and not clip and (
        scale_dtype is None or (isinstance(x, torch.Tensor) and scale_dtype == x.dtype)
    )
    if plain and isinstance(x, torch.Tensor) and use_triton(x):
        return quantize_triton(x, bits, group_size, axis)
    return quantize_reference(x, bits, group_size, axis, levels=levels, scale_dtype=scale_dtype, clip=clip)


def dequantize(q: QuantizedGroups, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Back to ``[B, H, T, D]`` in ``q``'s dtype (or ``dtype``). Torch only."""
    return dequantize_reference(q, dtype)
