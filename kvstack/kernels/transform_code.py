"""Transform coding of key/value vectors: an orthogonal basis, bits per component by variance, Lloyd-Max levels.

Classical transform coding (Huang & Schultheiss 1963; for KV caches, KVTC, Staniszewski & Łańcucki, arXiv
2511.01815): vectors ``x`` [C] are expressed in an orthonormal basis ``U`` [C, C] where their components are close to
uncorrelated, ``y = x U``; a bit budget of ``total_bits`` per vector is spread over the components by their variance
(high-variance components get more bits, components with little variance none); each component is coded with its own
scalar Lloyd-Max quantizer (a 1-D k-means fitted on the data, started from the Gaussian's optimal levels). Decoding
reads each component's level and returns ``x^ = y^ U^T``. There is no scale or zero point per vector or group: the
levels are per component, fitted once, so a vector costs exactly ``total_bits / 8`` bytes. Optionally
(:func:`scale_tokens`, gain-shape coding) each vector is centred and divided by its own root mean square first, which
is then stored beside its code.

This file holds the coder given ``y`` (the basis and where it comes from are the caller's):

* :func:`allocate_widths` — greedy bit allocation. Components are ordered by decreasing variance and share a width in
  blocks of :data:`BLOCK` = 8 (so 8 codes of ``w`` bits fill ``w`` bytes); each step gives one more bit to the block
  whose expected squared error falls most, ``var_b (D(w) - D(w + 1))`` with ``D`` the Gaussian Lloyd-Max distortion
  (:func:`gaussian_lloyd`), under ``max_bits`` per component and ``max_levels`` levels in all. The widths come out
  non-increasing along the order.
* :class:`ComponentCode` — the fitted coder: ``order`` (coded component ``j`` is basis component ``order[j]``), the
  block widths, ``center`` [C] float32 (each component's mean, in coded order) and ``levels`` [max_levels] (every
  component's levels relative to its centre, sorted, component after component; a width-0 component has the one
  level 0, its mean). ``encode`` picks the nearest level of every component and packs the codes; ``decode`` unpacks
  them and looks the levels up; ``reconstruct`` returns ``x^ = y^ U^T`` directly.
* :func:`own_axes_reflectors` / :func:`reflector_product` — a basis adapted to the data at a small price: the
  Householder reflectors [C, r] of an orthogonal ``Q`` whose first ``r`` columns are the samples' ``r`` leading
  principal axes, so that ``U Q`` leads with them and keeps ``U``'s other axes, reflected into their complement.
  Storing the reflectors costs ``r C`` numbers where a basis of its own costs ``C^2``; ``Q`` is exactly orthogonal
  whatever precision they are stored in (each ``tau`` is recomputed from its rounded reflector).

Packing: blocks in coded order, block ``b`` of width ``w`` is ``w`` bytes: its 8 codes form an ``8 w``-bit little-endian
integer, code ``i`` in bits ``[w i, w (i + 1))``. Width 0 takes no bytes.

Pure torch (no Triton kernel: the codes are read once per key block by the attention engine, as the other
reduced-precision tiers on the torch path).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import torch

#: components per width block: 8 codes of w bits are exactly w bytes
BLOCK = 8
#: widest code of one component
MAX_BITS = 8
#: Lloyd iterations of the per-component levels (each is one assignment and one mean per level)
LLOYD_ITERS = 12


@functools.lru_cache(maxsize=None)
def gaussian_lloyd(bits: int) -> tuple[tuple[float, ...], float]:
    """(levels, mean squared error) of the Lloyd-Max quantizer of a standard normal with ``2**bits`` levels
    (``bits = 0``: the one level 0, error 1), computed by Lloyd's iteration on a fine grid of the density."""
    if bits == 0:
        return (0.0,), 1.0
    x = torch.linspace(-9.0, 9.0, 180_001, dtype=torch.float64)
    p = torch.exp(-x * x / 2)
    zero = torch.zeros(1, dtype=torch.float64)
    mass_below, moment_below = torch.cat([zero, p.cumsum(0)]), torch.cat([zero, (p * x).cumsum(0)])
    n = 2**bits
    c = torch.linspace(-2.0, 2.0, n, dtype=torch.float64) * min(1.0, 0.4 * bits)
    ends = torch.tensor([x.numel()])
    for _ in range(500):
        # cell i holds the grid points between thresholds i - 1 and i: sums over it are differences of prefix sums
        hi = torch.cat([torch.searchsorted(x, (c[1:] + c[:-1]) / 2, right=True), ends])
        lo = torch.cat([ends.new_zeros(1), hi[:-1]])
        c = (moment_below[hi] - moment_below[lo]) / (mass_below[hi] - mass_below[lo])
        c = (c - c.flip(0)) / 2  # the density is symmetric: so are its levels
    idx = torch.bucketize(x, (c[1:] + c[:-1]) / 2)
    mse = float((p * (x - c[idx]) ** 2).sum() / p.sum())
    return tuple(float(v) for v in c), mse


def _distortion(bits: int) -> float:
    return gaussian_lloyd(bits)[1]


def uniform_levels(num_components: int, bits: int) -> int:
    """Levels of ``num_components`` components at ``bits`` each: the reference ``max_levels`` is a multiple of it."""
    return num_components * 2**bits


def allocate_widths(
    variance: torch.Tensor, total_bits: int, max_bits: int = MAX_BITS, max_levels: int | None = None
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """variance [C] (C a multiple of :data:`BLOCK`) -> (order [C] int64: components by decreasing variance, widths per
    block of ``BLOCK`` ordered components, non-increasing). Every bit of ``total_bits`` (a multiple of ``BLOCK``) is
    spent whenever ``max_levels`` allows the uniform allocation: when the level limit stops the greedy allocation
    first, it is run again with a lower ``max_bits`` (at ``total_bits / C`` it is the uniform one)."""
    c = variance.numel()
    if c % BLOCK:
        raise ValueError(f"transform coding needs a multiple of {BLOCK} components, got {c}")
    if total_bits < 0 or total_bits > c * max_bits or total_bits % BLOCK:
        raise ValueError(f"total_bits={total_bits} is not in [0, {c * max_bits}] or not a multiple of {BLOCK}")
    var = variance.double().clamp_min(0)
    order = torch.argsort(var, descending=True, stable=True)
    block_var = var[order].reshape(-1, BLOCK).sum(-1).tolist()
    floor = -(-total_bits // c)
    for cap in range(max_bits, floor - 1, -1):
        widths, left = _greedy(block_var, total_bits, cap, max_levels)
        if not left:
            break
    # block variances are non-increasing and so are the gains at equal width: the widths are too (up to ties)
    return order, tuple(sorted(widths, reverse=True))


def _greedy(block_var: list[float], total_bits: int, max_bits: int, max_levels: int | None) -> tuple[list[int], int]:
    """Widths per block and the bits left unspent: each step gives one bit to every component of the block whose
    expected squared error falls most."""
    widths = [0] * len(block_var)
    levels = len(block_var) * BLOCK  # one level per component at width 0
    budget = total_bits
    heap = [(-(v * (_distortion(0) - _distortion(1))), b) for b, v in enumerate(block_var)]
    heapq.heapify(heap)
    while heap and budget >= BLOCK:
        _, b = heapq.heappop(heap)
        w = widths[b]
        grown = levels + BLOCK * (2 ** (w + 1) - 2**w)
        if w >= max_bits or (max_levels is not None and grown > max_levels):
            continue  # this block is full; the others may still take bits
        widths[b], levels, budget = w + 1, grown, budget - BLOCK
        if w + 1 < max_bits:
            heapq.heappush(heap, (-(block_var[b] * (_distortion(w + 1) - _distortion(w + 2))), b))
    return widths, budget


def _width_runs(widths: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """(width, first component, component count, first byte) of each run of equal widths > 0."""
    runs, comp, byte = [], 0, 0
    for w in sorted(set(widths), reverse=True):
        n = widths.count(w)
        if w:
            runs.append((w, comp, n * BLOCK, byte))
        comp += n * BLOCK
        byte += n * w
    return runs


def _pack(codes: torch.Tensor, w: int) -> torch.Tensor:
    """codes [..., n] (n multiple of 8, values < 2**w) -> uint8 [..., n // 8 * w]."""
    if w == 8:
        return codes.to(torch.uint8)
    shape = codes.shape[:-1]
    c = codes.to(torch.int64).reshape(*shape, -1, BLOCK)
    shifts = torch.arange(BLOCK, device=codes.device, dtype=torch.int64) * w
    word = (c << shifts).sum(-1, keepdim=True)  # at most 56 bits
    out = (word >> (torch.arange(w, device=codes.device, dtype=torch.int64) * 8)) & 0xFF
    return out.to(torch.uint8).reshape(*shape, -1)


def _unpack(packed: torch.Tensor, w: int) -> torch.Tensor:
    """uint8 [..., m * w] -> codes [..., m * 8]: int32 up to 4 bits (a block's word fits 32 bits; the shifts and masks
    below read the right bits even where the word wraps negative), int64 above."""
    if w == 8:
        return packed.to(torch.int64)
    dtype = torch.int32 if w <= 4 else torch.int64
    shape = packed.shape[:-1]
    b = packed.to(dtype).reshape(*shape, -1, w)
    word = (b << (torch.arange(w, device=packed.device, dtype=dtype) * 8)).sum(-1, keepdim=True, dtype=dtype)
    codes = (word >> (torch.arange(BLOCK, device=packed.device, dtype=dtype) * w)) & (2**w - 1)
    return codes.reshape(*shape, -1)


def lloyd_levels(y: torch.Tensor, init: torch.Tensor, iters: int = LLOYD_ITERS) -> torch.Tensor:
    """1-D k-means of each row of ``y`` [n, N] from sorted ``init`` [n, L]: sorted levels [n, L] (a level no sample
    is nearest keeps its place)."""
    c = init.clone()
    ones = torch.ones_like(y)
    for _ in range(iters):
        idx = torch.searchsorted((c[:, 1:] + c[:, :-1]).contiguous() / 2, y)
        count = torch.zeros_like(c).scatter_add_(1, idx, ones)
        total = torch.zeros_like(c).scatter_add_(1, idx, y)
        c = torch.where(count > 0, total / count.clamp_min(1), c).sort(dim=1).values
    return c


@dataclass
class ComponentCode:
    """A fitted coder of ``C``-component vectors (module docstring): ``order`` [C] int16 (coded component ``j`` is
    basis component ``order[j]``), ``widths`` per block, ``offsets`` [C] int32 (where each coded component's levels
    start), ``center`` [C] float32 and ``levels`` [L] (relative to the centres), ``L`` fixed at fit."""

    order: torch.Tensor
    widths: tuple[int, ...]
    offsets: torch.Tensor
    center: torch.Tensor
    levels: torch.Tensor

    @property
    def num_components(self) -> int:
        return self.order.numel()

    @property
    def nbytes_per_vector(self) -> int:
        return sum(self.widths)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the coder holds (counted with the tier that uses it)."""
        return {"order": self.order, "offsets": self.offsets, "center": self.center, "levels": self.levels}

    def to(self, device) -> "ComponentCode":
        return ComponentCode(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in (
            self.order, self.widths, self.offsets, self.center, self.levels)))

    @classmethod
    def fit(
        cls, y: torch.Tensor, total_bits: int, max_levels: int, max_bits: int = MAX_BITS, iters: int = LLOYD_ITERS,
    ) -> "ComponentCode":
        """Fit on samples ``y`` [N, C] (float32): allocation by the samples' variance, levels by Lloyd's iteration
        from the Gaussian's levels at each component's mean and standard deviation. ``levels`` holds exactly
        ``max_levels`` entries (unused ones zero), so the coder's bytes do not depend on the data."""
        y = y.float()
        n, c = y.shape
        center = y.mean(0) if n else y.new_zeros(c)
        deviation = y - center
        var = deviation.pow(2).mean(0) if n > 1 else y.new_zeros(c)
        order, widths = allocate_widths(var, total_bits, max_bits, max_levels)
        centred = deviation[:, order].T.contiguous()  # [C, N] in coded order
        std = var[order].sqrt()
        if c > torch.iinfo(torch.int16).max:
            raise ValueError(f"transform coding holds at most {torch.iinfo(torch.int16).max} components, got {c}")
        sizes = torch.tensor([2**w for w in widths for _ in range(BLOCK)], dtype=torch.int64, device=y.device)
        offsets = torch.cumsum(sizes, 0) - sizes
        if int(sizes.sum()) > max_levels:
            raise ValueError(f"the allocation needs {int(sizes.sum())} levels, more than max_levels={max_levels}")
        levels = torch.zeros(max_levels, dtype=torch.float32, device=y.device)
        for w, first, count, _ in _width_runs(widths):
            rows = slice(first, first + count)
            base = torch.tensor(gaussian_lloyd(w)[0], dtype=torch.float32, device=y.device)
            init = std[rows, None] * base[None, :]
            fitted = lloyd_levels(centred[rows], init, iters) if n else init
            index = offsets[rows, None] + torch.arange(2**w, device=y.device)[None, :]
            levels[index.reshape(-1)] = fitted.reshape(-1)
        return cls(order.to(y.device, torch.int16), widths, offsets.to(torch.int32), center[order].contiguous(), levels)

    def _table(self, first: int, count: int, w: int) -> torch.Tensor:
        index = self.offsets[first : first + count, None].long() + torch.arange(2**w, device=self.levels.device)
        return self.levels.float()[index]  # [count, 2**w]

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        """y [..., C] (basis order) -> uint8 codes [..., nbytes_per_vector]."""
        lead = y.shape[:-1]
        coded = (y.float().reshape(-1, self.num_components)[:, self.order.long()] - self.center).T.contiguous()
        parts = []
        for w, first, count, _ in _width_runs(self.widths):
            table = self._table(first, count, w)
            idx = torch.searchsorted((table[:, 1:] + table[:, :-1]).contiguous() / 2, coded[first : first + count])
            parts.append(_pack(idx.T, w))
        m = coded.shape[1]
        out = torch.cat(parts, -1) if parts else torch.empty(m, 0, dtype=torch.uint8, device=y.device)
        return out.reshape(*lead, -1)

    def decode_coded(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 codes [..., nbytes_per_vector] -> y^ [..., C] in coded order (component ``j`` is basis component
        ``order[j]``): one lookup per component in a table of the levels plus their centres, rounded to ``dtype``."""
        lead = codes.shape[:-1]
        flat = codes.reshape(-1, codes.shape[-1])
        c, total = self.num_components, self.levels.numel()
        sizes = torch.diff(self.offsets, append=self.offsets.new_tensor([total]))
        table = (self.levels.float() + torch.repeat_interleave(self.center, sizes, output_size=total)).to(dtype)
        y = flat.new_empty(flat.shape[0], c, dtype=dtype)
        coded = 0
        for w, first, count, byte in _width_runs(self.widths):
            idx = _unpack(flat[:, byte : byte + count // BLOCK * w], w)  # [M, count]
            idx += self.offsets[first : first + count].to(idx.dtype)
            y[:, first : first + count] = table.index_select(0, idx.reshape(-1)).view(-1, count)
            coded = first + count
        y[:, coded:] = self.center[coded:].to(dtype)  # width 0: the mean (widths are non-increasing along the order)
        return y.reshape(*lead, c)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes [..., nbytes_per_vector] -> y^ [..., C] float32 (basis order)."""
        return self.decode_coded(codes)[..., torch.argsort(self.order.long())]

    def reconstruct(self, codes: torch.Tensor, basis: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 codes [..., nbytes_per_vector] -> x^ = y^ U^T [..., C] in ``dtype`` for the basis ``U`` [C, C] the
        vectors were coded in. The permutation acts on U's C columns instead of every vector's components; the product
        runs in ``dtype``."""
        return self.decode_coded(codes, dtype) @ basis[:, self.order.long()].T.to(dtype)


def fit_token_scale(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``y`` [N, C] -> (their mean [C], the mean of their centred root mean squares [1]) float32: what
    :func:`scale_tokens` centres by and measures each vector's scale against."""
    y = y.float()
    if not y.shape[0]:
        return y.new_zeros(y.shape[-1]), y.new_ones(1)
    mean = y.mean(0)
    rms = (y - mean).pow(2).mean(-1).sqrt().mean()
    # one sample (or identical ones) has no spread to measure against: then scales are relative to 1
    rms = torch.where(rms > torch.finfo(torch.float32).tiny, rms, torch.ones_like(rms))
    return mean, rms.reshape(1)


def scale_tokens(
    y: torch.Tensor, mean: torch.Tensor, rms: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gain-shape split of vectors ``y`` [..., C]: (``(y - mean) / (s rms)`` float32 [..., C], the stored scale
    ``s`` [...] in ``dtype``), ``s`` each vector's centred root mean square over ``rms``, rounded to ``dtype`` (within
    its normal range: float8 has no inf). Dividing by the rounded ``s`` keeps ``mean + s rms z`` the vector's exact
    decomposition, so the only error is the coder's on ``z``."""
    centred = y.float() - mean
    info = torch.finfo(dtype)
    stored = (centred.pow(2).mean(-1).sqrt() / rms).clamp(info.smallest_normal, info.max).to(dtype)
    # a vector equal to the mean has the smallest scale; its product with rms may underflow, and 0 / 0 is no code
    divisor = (stored.float() * rms).clamp_min(torch.finfo(torch.float32).tiny)
    return centred / divisor[..., None], stored


def transform_reference(x: torch.Tensor, basis: torch.Tensor, code: ComponentCode) -> torch.Tensor:
    """Plain float64 round trip of ``x`` [..., C] through ``basis`` and ``code`` (nearest level by brute force), the
    reference the tests compare ``encode``/``decode`` against."""
    order = code.order.long()
    y = (x.double() @ basis.double()).reshape(-1, code.num_components)[:, order] - code.center.double()
    out = torch.empty_like(y)
    for j in range(code.num_components):
        w, start = code.widths[j // BLOCK], int(code.offsets[j])
        table = code.levels.double()[start : start + 2**w]
        out[:, j] = table[(y[:, j, None] - table[None, :]).abs().argmin(-1)]  # ties: the lower level
    y_hat = (out + code.center.double())[:, torch.argsort(order)]
    return (y_hat @ basis.double().T).reshape(x.shape)


def own_axes_reflectors(y: torch.Tensor, count: int) -> torch.Tensor:
    """Samples ``y`` [N, C] (components in a basis ``U``) -> Householder reflectors float32 [C, count] (unit diagonal,
    zeros above it) whose product :func:`reflector_product` ``Q`` has the samples' ``count`` leading principal axes
    (by decreasing variance, up to sign) as its first columns: ``U Q`` is ``U`` with those axes leading."""
    y = y.double()
    centred = y - y.mean(0) if y.shape[0] else y
    axes = torch.linalg.eigh(centred.T @ centred)[1].flip(-1)[:, :count]
    packed, _ = torch.geqrf(axes)  # axes = H_1 ... H_count [R; 0], the reflectors below R's diagonal
    return (torch.tril(packed, -1) + torch.eye(*packed.shape, dtype=packed.dtype, device=y.device)).float()


def reflector_product(reflectors: torch.Tensor) -> torch.Tensor:
    """Reflectors [C, r] (unit diagonal, zeros above it, any float dtype) -> ``Q = H_1 ... H_r`` float32 [C, C] with
    ``H_i = I - tau_i v_i v_i^T``, ``tau_i = 2 / |v_i|^2``: an exact reflection for the stored (rounded) ``v_i``, so
    ``Q`` is orthogonal to float32 precision."""
    v = reflectors.float()
    c, r = v.shape
    padded = torch.zeros(c, c, dtype=v.dtype, device=v.device)
    padded[:, :r] = v
    return torch.linalg.householder_product(padded, 2 / v.pow(2).sum(0))


def weight_basis(weight: torch.Tensor) -> torch.Tensor:
    """The left singular vectors of a projection's weight [C, hidden] (float32 [C, C], orthonormal columns, by
    decreasing singular value): the directions its outputs span, most energetic first. For keys ``k = x W^T`` of
    inputs ``x`` with uncorrelated channels these are the principal axes of ``k``; with real inputs they are a
    data-free stand-in that decorrelates the outputs of different heads. Padded with an orthonormal complement when
    ``C > hidden``."""
    w = weight.detach().double()
    u, _, _ = torch.linalg.svd(w, full_matrices=True)
    return u.float().contiguous()


__all__ = [
    "BLOCK", "ComponentCode", "MAX_BITS", "allocate_widths", "fit_token_scale", "gaussian_lloyd", "lloyd_levels",
    "own_axes_reflectors", "reflector_product", "scale_tokens", "transform_reference", "uniform_levels",
    "weight_basis",
]
