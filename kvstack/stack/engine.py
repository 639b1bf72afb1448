"""The attention engine of one layer: every tier, one softmax, bounded extra memory, statistics block by block.

For the ``Q`` queries of a forward (``G`` query heads per KV head; row ``(g, q)`` of KV head ``h`` is query head
``h * G + g``) and every exact tier, logits ``l = s q.k`` (softcapped when the model asks) are masked where a stored
position is empty (-1), in the future of the query or outside the sliding window; the low-rank state adds its
log-denominator and value readout. Everything merges under ONE normaliser with the online-softmax primitive
(``kvstack/kernels/online_softmax.py``), so the result is exactly the softmax over the union of tokens plus the
state's term.

Three paths, chosen once per forward by :func:`attend`:

* **fast** — the layer holds only the prompt's own full-precision tokens (first forward, no padding, no softcap,
  the prompt inside the sliding window): the output is ``torch.nn.functional.scaled_dot_product_attention`` with
  ``is_causal`` (FlashAttention / memory-efficient kernels on CUDA, the fused CPU kernel here), in the model dtype
  exactly as transformers' ``sdpa`` runs it. Statistics that read only the last ``w`` queries (SnapKV and OBCache
  windows, TOVA) come from a tiled pass over those queries alone; statistics of every query (H2O) take the tiled
  path, which computes the output on the way.
* **fused** — on CUDA (or ``KVSTACK_KERNELS=triton``) decode steps over the full tier, one packed quantized tier and
  the low-rank state run the Triton kernel ``kvstack/kernels/tiered_attention.py``, per-key masses reduced in it.
* **tiled** — everything else: queries in blocks, each tier's keys in blocks (``ExactTier.attention_block``: only
  one block is ever dequantized), merged online. Key blocks entirely in the future of a query block, or outside its
  window, are skipped. Extra memory is one tile of ``TILE_ELEMENTS`` logits (and its temporaries), whatever the
  numbers of queries and keys.

Statistics (``StatsRequest``) are accumulated per key block in a second pass over the query blocks they read, with
the final log-sum-exp of each query row: per-key attention mass over the last ``w`` queries (or all), and OBCache's
saliency (which also needs the final output of the row). Logits of a stats block are kept from the first pass when
they fit in ``TILE_ELEMENTS``, else recomputed (flash-attention style).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from kvstack.kernels.dispatch import use_triton
from kvstack.kernels.online_softmax import SoftmaxPartial, finish, log_term_partial, logits_partial, merge
from kvstack.kernels.tiered_attention import FullTierData, QuantTierData, mass_selector, tiered_attention

from .errors import CacheUsageError
from .stats import AttentionStats, StatsRequest

#: logits per tile: bounds the engine's extra memory (32 MiB in float32, a few tiles with temporaries)
TILE_ELEMENTS = 1 << 23
#: nominal keys per block for long query blocks (decode steps take a whole tier in one block when it fits a tile)
KEY_BLOCK = 1024
#: the fused kernel is a decode kernel: longer query blocks (prefill) take the tiled path
FUSED_MAX_QUERIES = 16


@dataclass(frozen=True)
class Geometry:
    """What one forward of one layer looks like to the engine."""

    batch: int
    kv_heads: int
    group: int
    num_queries: int
    scaling: float
    softcap: float | None
    window: int | None
    compute: torch.dtype


def attend(layer, query: torch.Tensor, request: StatsRequest, *, padded: bool, scaling: float,
           softcap: float | None, sliding_window: int | None) -> tuple[torch.Tensor, AttentionStats]:
    """Attention of ``query`` [B, Hq, Q, D] (post-RoPE, at positions ``seen - Q .. seen - 1``) over every tier of
    ``layer``: returns (output [B, Hq, Q, Dv] in the query's dtype, the statistics ``request`` asked for)."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = layer.shape_heads()
    if q_heads % kv_heads:
        raise CacheUsageError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    geo = Geometry(
        batch, kv_heads, q_heads // kv_heads, q_len, scaling, softcap or None, sliding_window or None,
        torch.float64 if query.dtype == torch.float64 else torch.float32,
    )
    q_pos = torch.arange(layer.seen - q_len, layer.seen, device=query.device)
    stats = AttentionStats(query_positions=q_pos, num_queries=q_len)
    stats.key_positions = [t.positions if t.num_tokens else None for t in layer.tiers]
    q5 = rearrange(query, "b (h g) q d -> b h g q d", g=geo.group)  # query head h*G+g reads KV head h (repeat_kv)

    if layer.state is not None:  # sees every query of the forward once, whatever the path
        layer.state.prepare(q5.reshape(batch, kv_heads, geo.group * q_len, head_dim).to(geo.compute), scaling)
    rows = request.rows_needed(q_len)
    if rows < q_len and _fast_path_applies(layer, geo, padded):  # statistics of every query: tiled does both
        out = _sdpa(layer, query, geo)
        if rows:  # statistics of the newest queries only: a tiled pass over those rows
            _tiled(layer, q5[:, :, :, q_len - rows :].to(geo.compute), q_pos[q_len - rows :], geo, request, stats)
    else:
        out = _fused(layer, q5, q_pos, geo, request, stats)
        if out is None:
            out = _tiled(layer, q5.to(geo.compute), q_pos, geo, request, stats).reshape(batch, q_heads, q_len, -1)
    out = out.to(query.dtype)
    if request.keep_query:
        stats.query, stats.output = query, out
    return out, stats


# ----------------------------------------------------------------------------------------------- fast path
def _fast_path_applies(layer, geo: Geometry, padded: bool) -> bool:
    """Only the prompt's own tokens, contiguous from position 0, no padding: a plain causal mask is exact."""
    if padded or geo.softcap or layer.seen != geo.num_queries or layer.full.num_tokens != geo.num_queries:
        return False
    if geo.window is not None and geo.num_queries > geo.window:
        return False
    # the first forward: no other tier holds tokens yet and the state has folded nothing
    return not any(t.num_tokens for t in layer.tiers if t is not layer.full)


def _sdpa(layer, query: torch.Tensor, geo: Geometry) -> torch.Tensor:
    keys, values = layer.full.keys, layer.full.values
    return F.scaled_dot_product_attention(
        query, keys.to(query.dtype), values.to(query.dtype), is_causal=True, scale=geo.scaling,
        enable_gqa=geo.group > 1,
    )


# ---------------------------------------------------------------------------------------------- fused path
def _fused(layer, q5, q_pos, geo: Geometry, request: StatsRequest, stats: AttentionStats):
    """The Triton decode kernel over the full tier, at most one packed quantized tier and the state, or None when
    the layer or the request is outside what it covers."""
    if geo.num_queries > FUSED_MAX_QUERIES or request.saliency or not use_triton(q5):
        return None
    full, quant, slot = None, None, {}  # slot: tier index -> "full" | "quant"
    for i, tier in enumerate(layer.tiers):
        if not tier.num_tokens:
            continue
        data = tier.kernel_data()
        if isinstance(data, FullTierData) and full is None:
            full, slot[i] = data, "full"
        elif isinstance(data, QuantTierData) and quant is None:
            quant, slot[i] = data, "quant"
        else:
            return None
    b, h, g, q_len, d = q5.shape
    q = q5.to(geo.compute).reshape(b, h, g * q_len, d)
    state = None
    if layer.state is not None:
        state = layer.state.kernel_data(q, geo.scaling)
        if state is False:
            return None
    windows = tuple(request.mass_windows)
    rows = mass_selector(g, q_len, windows, device=q.device) if windows else None
    res = tiered_attention(
        q, q_pos.repeat(g).to(torch.int32), geo.scaling, full=full, quant=quant, state=state, softcap=geo.softcap,
        sliding_window=geo.window, mass_rows=rows,
    )
    for i, which in slot.items():
        mass = res.mass_full if which == "full" else res.mass_quant
        for j, window in enumerate(windows):
            stats.masses[(i, window)] = mass[:, :, j * g : (j + 1) * g].reshape(b, h * g, -1)
    return res.out.reshape(b, h * g, q_len, -1)


# ---------------------------------------------------------------------------------------------- tiled path
@dataclass
class _TierPlan:
    """One exact tier as the tiled pass reads it: its index, key block size and the position range of each block."""

    index: int
    tier: object
    block: int
    lo: list[int]  # smallest valid position per block (a huge value: block holds nothing)
    hi: list[int]  # largest valid position per block
    dense: list[bool]  # the block has no empty slot (then a block wholly in the past of the queries needs no mask)


def _block_sizes(geo: Geometry, rows: int, total_keys: int) -> tuple[int, int]:
    """(queries per block, keys per block) so that one tile of logits holds about TILE_ELEMENTS."""
    per_row = geo.batch * geo.kv_heads * geo.group
    q_block = max(1, min(rows, TILE_ELEMENTS // (per_row * KEY_BLOCK)))
    k_block = max(KEY_BLOCK, TILE_ELEMENTS // (per_row * q_block))
    return q_block, min(k_block, max(total_keys, 1))


def _plan_tiers(layer, k_block: int) -> list[_TierPlan]:
    plans = []
    for i, tier in enumerate(layer.tiers):
        t = tier.num_tokens
        if not t:
            continue
        align = tier.block_align
        block = max(align, (k_block // align) * align)
        n_blocks = -(-t // block)
        if n_blocks == 1:
            plans.append(_TierPlan(i, tier, block, [-1], [math.inf], [False]))  # one block: nothing to skip
            continue
        pos = F.pad(tier.positions, (0, n_blocks * block - t), value=-1)  # the tail slots count as empty
        valid = pos >= 0
        big = torch.iinfo(pos.dtype).max
        per_block = lambda x: x.transpose(0, 2).reshape(n_blocks, -1)  # noqa: E731  [n_blocks, block * Hp * B]
        lo = per_block(torch.where(valid, pos, torch.full_like(pos, big))).amin(-1)
        hi = per_block(torch.where(valid, pos, torch.full_like(pos, -1))).amax(-1)
        empty = per_block(~valid).any(-1)
        bounds = torch.stack([lo.to(torch.int64), hi.to(torch.int64), empty.to(torch.int64)]).tolist()  # one sync
        plans.append(_TierPlan(i, tier, block, bounds[0], bounds[1], [not e for e in bounds[2]]))
    return plans


def _visible(positions: torch.Tensor, row_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, Hp, 1, n] stored positions vs [M] query positions -> [B, Hp, M, n] visibility."""
    pos = positions[:, :, None, :]
    rows = row_pos[None, None, :, None]
    vis = (pos >= 0) & (pos <= rows)
    if window is not None:
        vis = vis & (pos > rows - window)
    return vis


def _block_logits(plan: _TierPlan, q_view, j: int, geo: Geometry, row_pos, lo_q: int, hi_q: int):
    """Masked logits [B, Hkv, M, n] of key block j for the (pre-scaled) queries ``q_view`` at positions
    ``lo_q..hi_q``, and the block's values."""
    start = j * plan.block
    keys, values = plan.tier.attention_block(start, min(start + plan.block, plan.tier.num_tokens), geo.compute)
    logits = torch.matmul(q_view, keys.transpose(-1, -2))
    if geo.softcap:
        logits = torch.tanh(logits / geo.softcap) * geo.softcap
    seen_by_all = plan.dense[j] and plan.hi[j] <= lo_q and (geo.window is None or plan.lo[j] > hi_q - geo.window)
    if not seen_by_all:  # most blocks of a long prefill lie wholly in the past of the query block: no mask
        vis = _visible(plan.tier.positions[..., start : start + keys.shape[-2]], row_pos, geo.window)
        logits.masked_fill_(~vis, -math.inf)
    return logits, values


def _tiled(layer, q5: torch.Tensor, q_pos: torch.Tensor, geo: Geometry, request: StatsRequest,
           stats: AttentionStats) -> torch.Tensor:
    """Attention of the queries ``q5`` [B, Hkv, G, n, D] (compute dtype, at positions ``q_pos`` [n], the newest
    queries of the forward) over every tier; fills the requested statistics. Returns [B, Hkv, G, n, Dv]."""
    b, h, g, n, _ = q5.shape
    total_keys = sum(t.num_tokens for t in layer.tiers)
    q_block, k_block = _block_sizes(geo, n, total_keys)
    plans = _plan_tiers(layer, k_block)
    acc = _StatsAccumulator(request, geo, plans, layer)
    out = None
    first = geo.num_queries - n  # index of q5's first query within the forward
    base = layer.seen - n  # absolute position of q5's first query
    for qs in range(0, n, q_block):
        qe = min(qs + q_block, n)
        rows = q5[:, :, :, qs:qe].reshape(b, h, g * (qe - qs), -1)
        row_pos = q_pos[qs:qe].repeat(g)
        lo_q, hi_q = base + qs, base + qe - 1
        wants_stats = acc.active(first + qs, first + qe)
        kept = [] if wants_stats and acc.fits(qe - qs, total_keys) else None
        partial = None
        scaled = rows * geo.scaling  # once per query block instead of once per logit
        views = {plan.index: plan.tier.attention_query(scaled) for plan in plans}
        per_tier: dict[int, SoftmaxPartial] = {}
        for plan, j in _blocks_to_read(plans, lo_q, hi_q, geo.window):
            logits, values = _block_logits(plan, views[plan.index], j, geo, row_pos, lo_q, hi_q)
            per_tier[plan.index] = merge(per_tier.get(plan.index), logits_partial(logits, values))
            if kept is not None:
                kept.append((plan, j * plan.block, logits, plan.tier.attention_output(values)))
        for index, part in per_tier.items():  # each tier's weighted values into the model's basis, once
            part.acc = layer.tiers[index].attention_output(part.acc)
            partial = merge(partial, part)
        if layer.state is not None:
            part = layer.state.readout(rows, geo.scaling)
            if part is not None:
                partial = merge(partial, log_term_partial(part[0].to(geo.compute), part[1].to(geo.compute)))
        if partial is None:  # nothing visible to any query of the block (e.g. every slot empty): zero output
            dv = layer.full.values.shape[-1]
            partial = SoftmaxPartial(rows.new_full(rows.shape[:-1], -math.inf), rows.new_zeros(rows.shape[:-1]),
                                     rows.new_zeros(*rows.shape[:-1], dv))
        block_out, lse = finish(partial)
        if out is None:
            out = block_out.new_empty(b, h, g, n, block_out.shape[-1])
        block_out = block_out.reshape(b, h, g, qe - qs, -1)
        out[:, :, :, qs:qe] = block_out
        if wants_stats:
            if kept is None:  # recompute the logits of this query block (they did not fit in a tile)
                kept = (
                    (plan, j * plan.block, logits, plan.tier.attention_output(values))
                    for plan, j in _blocks_to_read(plans, lo_q, hi_q, geo.window)
                    for logits, values in [_block_logits(plan, views[plan.index], j, geo, row_pos, lo_q, hi_q)]
                )
            acc.add(kept, lse, block_out, first + qs, first + qe)
    acc.store(stats)
    return out


def _blocks_to_read(plans: list[_TierPlan], lo_q: int, hi_q: int, window: int | None):
    """(plan, j) of every key block some query at positions lo_q..hi_q can see: blocks wholly in their future,
    before their window, or empty are skipped."""
    for plan in plans:
        for j in range(len(plan.lo)):
            if plan.lo[j] > hi_q or (window is not None and plan.hi[j] <= lo_q - window):
                continue
            yield plan, j


class _StatsAccumulator:
    """Per-key masses and saliency over the newest queries, summed block by block (second pass per query block)."""

    def __init__(self, request: StatsRequest, geo: Geometry, plans: list[_TierPlan], layer):
        self.geo = geo
        self.windows = list(request.mass_windows)
        self.saliency = list(request.saliency)
        q_len = geo.num_queries
        self.starts = {w: 0 if w is None else max(0, q_len - w) for w in {*self.windows, *(w for w, _ in self.saliency)}}
        device = layer.full.keys.device

        def zeros(plan):
            return torch.zeros(geo.batch, geo.kv_heads, geo.group, plan.tier.num_tokens, dtype=geo.compute,
                               device=device)

        self.masses = {(plan.index, w): zeros(plan) for plan in plans for w in self.windows}
        # saliency[(w, mode)][i]: per exact tier of the layer (None: empty tier), as AttentionStats holds it
        self.sal: dict[tuple[int | None, str], list[torch.Tensor | None]] = {}
        for key in self.saliency:
            self.sal[key] = [None] * len(layer.tiers)
            for plan in plans:
                self.sal[key][plan.index] = zeros(plan)

    def active(self, qs: int, qe: int) -> bool:
        """Whether queries qs..qe-1 (indices within the forward) fall in a requested window."""
        return any(qe > start for start in self.starts.values())

    def fits(self, queries: int, total_keys: int) -> bool:
        return self.geo.batch * self.geo.kv_heads * self.geo.group * queries * total_keys <= TILE_ELEMENTS

    def add(self, blocks, lse: torch.Tensor, out: torch.Tensor, qs: int, qe: int) -> None:
        """blocks: (plan, start, masked logits [B, Hkv, G*n, k], values [B, Hkv, k, Dv]) of queries qs..qe-1;
        lse [B, Hkv, G*n]; out [B, Hkv, G, n, Dv] (their final output)."""
        geo, n = self.geo, qe - qs
        b, h, g = geo.batch, geo.kv_heads, geo.group
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]
        q_index = torch.arange(qs, qe, device=out.device)
        in_window = {w: (q_index >= s).to(geo.compute) for w, s in self.starts.items()}
        for plan, start, logits, values in blocks:
            p = torch.exp(logits - lse).reshape(b, h, g, n, -1)  # masked logits give 0
            stop = start + p.shape[-1]
            for w in self.windows:
                self.masses[(plan.index, w)][..., start:stop] += torch.einsum("bhgqt,q->bhgt", p, in_window[w])
            if self.saliency:
                v_sq = (values * values).sum(-1)[:, :, None, None, :]  # [B, Hkv, 1, 1, k]
                dist = None
                for (w, mode) in self.saliency:
                    if mode == "value":
                        score = p * v_sq.sqrt()
                    else:
                        if dist is None:
                            o_sq = (out * out).sum(-1, keepdim=True)
                            cross = torch.einsum("bhgqd,bhtd->bhgqt", out, values)
                            dist = (v_sq + o_sq - 2 * cross).clamp_min(0).sqrt()  # ||v_i - o_q||
                        score = p * dist
                        if mode == "joint":
                            score = score / (1 - p).clamp_min(1e-6)
                    self.sal[(w, mode)][plan.index][..., start:stop] += torch.einsum(
                        "bhgqt,q->bhgt", score, in_window[w]
                    )

    def store(self, stats: AttentionStats) -> None:
        b, h, g = self.geo.batch, self.geo.kv_heads, self.geo.group
        for key, mass in self.masses.items():
            stats.masses[key] = mass.reshape(b, h * g, -1)
        for key, per_tier in self.sal.items():
            stats.saliency[key] = [None if x is None else x.reshape(b, h * g, -1) for x in per_tier]
