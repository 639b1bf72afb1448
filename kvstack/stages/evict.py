"""``kind: evict`` — physically remove tokens from a layer, keeping the best-scored ones within a budget.

The policy (which tokens matter) is a scorer from ``kvstack/stages/scorers/`` (``window``, ``key_norm``,
``value_key_ratio``, ``h2o``, ``tova``, ``snapkv``, ``obcache``, ``random``); this stage owns the rest (docs/eviction.md):

* budget (own ``budget`` or the stack's; a promise, docs/budgets.md): the bytes of ``tokens`` uncompressed tokens per
  layer, or a memory ``ratio`` of the full cache at the tokens seen. The kept count is worked out in bytes: what one
  kept token costs (keys, values, positions — per head when head-wise — and the scorer's records), after what the
  layer holds besides (the low-rank state) and the ``every`` slack; protected tokens yield when the budget is
  smaller than they are (short prompts under a ratio); ``schedule: pyramid`` gives early layers more and deep
  layers less, linearly, with the same average (PyramidKV, arXiv 2406.02069; ``pyramid_spread`` s: layer 0 gets (1 + s) x, the last (1 - s) x);
* protected sets: the first ``n_sink`` real tokens of each row (attention sinks), the ``recent`` newest positions and
  the scorer's own (SnapKV's observation ``window``);
* heads: ``head_wise`` (default: the scorer's) — each KV head keeps its own top-k, the same count per head so tensors
  stay rectangular; otherwise one selection for all heads (scores averaged over KV heads). Scores per query head are
  reduced over each GQA group with ``group_reduce`` (``mean`` or ``max``);
* granularity: ``token`` — one top-k over every exact tier of the layer (tokens keep their tier); ``block`` — tokens
  form blocks of ``block_size`` in position order and Algorithm 1 of PagedEviction (arXiv 2509.04377) runs: while
  the block count exceeds the budget in blocks (``budget // block_size``), the newest block is protected, every other
  block is scored by the ``aggregate`` (mean / min / max) of its tokens' scores, and the lowest-scored blocks leave;
* when: ``phase`` ``always`` (after every forward), ``prefill`` (forwards of the prompt: more than one query, or the
  first forward) or ``decode`` (the others); ``every: N`` lets the layer grow N - 1 tokens past the budget before it
  compresses back to it (one eviction per N decode steps; the slack is inside the budget: the cap is N - 1 tokens
  lower); ``layer_weights`` moves bytes between layers on top of the schedule (``{layer: w}``: w x an unlisted
  layer's share; the total stays the budget; with ``spill_unused`` a share beyond keeping every token seen goes to
  the other layers); ``chunk_size`` runs long prompts in pieces with a compression after
  each, so the peak holds at most budget + chunk_size tokens (+ N - 1).

Selection goes through ``StackLayer.retain``: padding is never kept nor counted, and evicted tokens are folded into
the layer's state tier when the stack has one.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
from pydantic import Field

from kvstack.stack.base import Budget, Stage, StageSpec, spec_error
from kvstack.stack.budget import LayerPromise, LayerWeights, reference_bytes_per_token
from kvstack.stack.memory import full_tier_bytes
from kvstack.stack.registry import register_stage

from .scorers import ScorerOptions, get_scorer, keep_order, protected_tokens, union_scores


@register_stage
class EvictSpec(ScorerOptions, LayerWeights, StageSpec):
    """Evict tokens by a scoring policy to a budget."""

    kind: Literal["evict"] = "evict"
    scorer: str = Field(default="window", description="Scoring policy (see `kvstack show` / docs/eviction.md).")
    budget: Budget | None = Field(default=None, description="Own budget; defaults to the stack's budget.")
    n_sink: int = Field(default=0, ge=0, description="First real tokens of each row that are never evicted.")
    recent: int = Field(default=0, ge=0, description="Newest positions that are never evicted.")
    phase: Literal["always", "prefill", "decode"] = Field(
        default="always", description="When to compress: after every forward, only the prompt, or only decode."
    )
    every: int = Field(
        default=1, ge=1, description="Compress once the layer holds budget + every - 1 tokens (slack: every - 1)."
    )
    chunk_size: int | None = Field(
        default=None, ge=1, description="Prefill long prompts in pieces of this many tokens, compressing after each."
    )
    granularity: Literal["token", "block"] = Field(default="token", description="Evict single tokens or whole blocks.")
    block_size: int = Field(default=16, ge=1, description="Tokens per block (granularity: block).")
    aggregate: Literal["mean", "min", "max"] = Field(
        default="mean", description="How a block's score aggregates its tokens' scores (granularity: block)."
    )
    schedule: Literal["uniform", "pyramid"] = Field(default="uniform", description="Per-layer budget schedule.")
    pyramid_spread: float = Field(
        default=0.5, ge=0.0, lt=1.0, description="pyramid: layer 0 keeps (1 + s) x budget, the last layer (1 - s) x."
    )

    def prefill_chunk(self) -> int | None:
        return self.chunk_size

    def keeps_budget(self) -> bool:
        return True

    def inactive_options(self) -> set[str]:
        inactive = super().inactive_options()
        if self.granularity == "token":
            inactive |= {"block_size", "aggregate"}
        if self.schedule == "uniform":
            inactive.add("pyramid_spread")
        return inactive

    def effective_budget(self, stack_budget: Budget | None) -> Budget:
        budget = self.budget or stack_budget
        if budget is None:
            raise spec_error("budget", None, "evict needs a budget: set `budget` on the stage or on the stack")
        return budget

    def validate_with(self, stack_budget: Budget | None) -> None:
        budget = self.effective_budget(stack_budget)
        protected = self.protected_count()
        if budget.tokens is not None and budget.tokens < protected:
            raise spec_error(
                "budget.tokens",
                budget.tokens,
                f"at least n_sink + max(recent, scorer window) = {self.n_sink} + "
                f"{protected - self.n_sink} = {protected}",
            )
        if self.granularity == "block" and budget.tokens is not None and budget.tokens < self.block_size:
            raise spec_error("budget.tokens", budget.tokens, f"at least one block (block_size = {self.block_size})")

    def validate_for(self, shape, stack_budget) -> None:
        self.validate_with(stack_budget)
        self.check_layer_weights(shape)

    # --------------------------------------------------------------------------------------------- budgets
    def token_cost(self, shape, dtype) -> int:
        """Bytes of one kept token per batch row: keys, values, positions (per head when head-wise), records."""
        scorer = get_scorer(self.scorer)(self, shape)
        return full_tier_bytes(shape, dtype, positions_per_head=self.is_head_wise)(1) + scorer.record_bytes_per_token(
            shape
        )

    def layer_scale(self, layer_idx: int, shape) -> float:
        """The schedule's share of layer ``layer_idx`` (pyramid: linear in depth), times its ``layer_weights``."""
        last = shape.num_layers - 1

        def scheduled(i: int) -> float:
            return 1 + self.pyramid_spread * (1 - 2 * i / last) if self.schedule == "pyramid" and last else 1.0

        return self.weighted_scale(layer_idx, shape, scheduled)

    def layer_need(self, layer_idx, shape, dtype, budget, reference) -> Callable[[int], int]:
        """``spill_unused``: every token seen kept, with the slack the ``every`` period adds (a low-rank state is not
        counted; a layer holding one keeps that much less)."""
        own = self.token_cost(shape, dtype)
        return lambda seen: (seen + self.every - 1) * own

    def layer_caps(self, shape, dtype, stack_budget, reference=None) -> list["LayerCap"]:
        """Per layer, the tokens per (row, KV head) it may keep after ``seen`` tokens with ``reserved`` bytes per row
        held besides its tokens: everything but those two is worked out here, once per cache and dtype.
        ``reference``: the shape the budget is against (default ``shape``)."""
        budget = self.effective_budget(stack_budget)
        ref = reference_bytes_per_token(reference or shape, dtype)
        own = self.token_cost(shape, dtype)
        block = self.block_size if self.granularity == "block" else None
        return [
            LayerCap(LayerPromise(budget, self.layer_share(i, shape, dtype, budget, reference), ref), own, block,
                     self.every - 1)
            for i in range(shape.num_layers)
        ]

    def layer_cap(self, shape, dtype, stack_budget, layer_idx: int, seen: int) -> int:
        """Tokens per (row, KV head) layer ``layer_idx`` may keep after ``seen`` tokens (nothing else held)."""
        return self.layer_caps(shape, dtype, stack_budget)[layer_idx](seen)

    def plan_memory(self, plan, stack_budget) -> None:
        scorer = get_scorer(self.scorer)(self, plan.shape)
        records = scorer.record_bytes_per_token(plan.shape)
        caps = self.layer_caps(plan.shape, plan.dtype, stack_budget)
        for idx, layer in enumerate(plan.layers):
            full = layer.tier("full")
            if full is not None and (self.is_head_wise or records):
                base = full_tier_bytes(plan.shape, plan.dtype, positions_per_head=self.is_head_wise)
                full.bytes_for = lambda n, base=base: base(n) + n * records
            prompt = plan.seq_len if plan.prefill_len is None else plan.prefill_len
            if self.phase == "decode" and plan.seq_len <= prompt:
                continue  # the prompt itself is never compressed
            if self.phase == "prefill":  # compressed once at the prompt, then every decode token stays
                cap = caps[idx](prompt) + plan.seq_len - prompt
            else:
                cap = caps[idx](plan.seq_len) + self.every - 1
            excess = layer.tokens - cap
            for tier in reversed(layer.tiers):  # the oldest, lowest-precision tiers give way first
                if excess <= 0:
                    break
                cut = min(excess, tier.tokens)
                tier.tokens -= cut
                excess -= cut

    def build(self, shape, stack_budget) -> "EvictStage":
        return EvictStage(self, shape, stack_budget)


class LayerCap:
    """The cap of one layer: the tokens whose bytes (``own`` per token and row) fit in the layer's ``limit`` less what
    the layer holds besides them, less the ``slack`` the ``every`` period adds; in whole blocks for block eviction.
    It may be below the protected count: the budget wins."""

    __slots__ = ("limit", "own", "block", "slack")

    def __init__(self, limit: LayerPromise, own: int, block: int | None, slack: int):
        self.limit, self.own, self.block, self.slack = limit, own, block, slack

    def __call__(self, seen: int, reserved: int = 0) -> int:
        cap = max(self.fitting(seen, reserved) - self.slack, 0)
        if self.block is not None:
            cap = cap // self.block * self.block
        return cap

    def fitting(self, seen: int, reserved: int = 0) -> int:
        """Tokens whose bytes fit the limit (no slack, no blocks)."""
        return max((self.limit.limit(seen) - reserved) // self.own, 0)

    def allowed(self, seen: int, reserved: int = 0) -> int:
        """The most tokens the layer may hold before it compresses: the cap plus the slack, within the limit."""
        return min(self(seen, reserved) + self.slack, self.fitting(seen, reserved))


class EvictStage(Stage):
    spec: EvictSpec

    def __init__(self, spec: EvictSpec, shape, stack_budget) -> None:
        super().__init__(spec, shape, stack_budget)
        self.scorer = get_scorer(spec.scorer)(spec, shape)
        self.recent = max(spec.recent, self.scorer.protected_recent())
        self._caps: dict[torch.dtype, list[LayerCap]] = {}

    def attention_request(self, layer, query_length):
        return self.scorer.request(layer, query_length)

    def budget_tokens(self, layer) -> tuple[int, int]:
        """(the cap a compression keeps, the most tokens the layer may hold before it compresses)."""
        dtype = layer.full.keys.dtype
        caps = self._caps.get(dtype)
        if caps is None:  # once per dtype held (a model cast after apply holds another dtype)
            caps = self._caps[dtype] = self.spec.layer_caps(self.shape, dtype, self.stack_budget, layer.reference)
        cap = caps[layer.layer_idx]
        reserved = layer.reserved_bytes()
        return cap(layer.seen, reserved), cap.allowed(layer.seen, reserved)

    def after_attention(self, layer, stats) -> None:
        self.scorer.observe(layer, stats)
        prefill = stats.num_queries > 1 or layer.seen == stats.num_queries
        if (self.spec.phase == "prefill" and not prefill) or (self.spec.phase == "decode" and prefill):
            return
        cap, allowed = self.budget_tokens(layer)
        if sum(t.num_tokens for t in layer.tiers) <= allowed:  # slots bound the kept tokens: no host sync
            return
        if allowed > cap and int(layer.kept_counts().max()) <= allowed:  # padding slots: count when it matters
            return
        self.keep_best(layer, cap, stats)

    def keep_best(self, layer, cap: int, stats) -> None:
        keep = self.select(layer, cap, stats)
        for tier, tier_keep in zip([t for t in layer.tiers if t.num_tokens], keep):
            layer.retain(tier, tier_keep)

    def keep_at_most(self, layer, stats, cap: int) -> None:
        step = self.spec.block_size if self.spec.granularity == "block" else 1
        self.keep_best(layer, cap // step * step, stats)

    def select(self, layer, cap: int, stats) -> list[torch.Tensor]:
        """Keep masks, one per non-empty exact tier: the best ``cap`` tokens per (row, head) over all tiers."""
        tiers, score, pos, valid = union_scores(self.scorer, self.spec.is_head_wise, layer, stats)
        if self.spec.granularity == "block":
            protected = protected_tokens(pos, valid, layer.seen, self.spec.n_sink, self.recent)
            keep = block_keep(score, pos, protected, self.spec.block_size, cap // self.spec.block_size, self.spec.aggregate)
        else:
            key = keep_order(score, pos, valid, layer.seen, self.spec.n_sink, self.recent)
            top = key.topk(min(cap, key.shape[-1]), dim=-1).indices
            keep = torch.zeros_like(valid).scatter_(-1, top, True) & valid
        return list(keep.split([t.num_tokens for _, t in tiers], dim=-1))


def block_keep(
    score: torch.Tensor,
    pos: torch.Tensor,
    protected: torch.Tensor,
    block_size: int,
    budget_blocks: int,
    aggregate: str = "mean",
) -> torch.Tensor:
    """Algorithm 1 (PagedEviction-style block eviction) for every (row, head) at once -> keep mask [B, H, T].

    The real tokens of a row (``pos >= 0``), in position order, form blocks of ``block_size`` (the last one may be
    partial: it is being filled). While there are more than ``budget_blocks`` blocks, the newest block is protected,
    every other block is scored by the ``aggregate`` of its tokens' scores, and the lowest-scored block leaves —
    evicting k blocks at once is the same as k rounds, because removing a whole block does not change the others.
    Blocks holding a ``protected`` token leave only after every unprotected block.
    """
    valid = pos >= 0
    b, h, t = pos.shape
    big = torch.iinfo(pos.dtype).max
    order = torch.where(valid, pos, torch.full_like(pos, big)).argsort(dim=-1, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(t, device=pos.device).expand(b, h, t))
    n_blocks_max = -(-t // block_size)
    block = torch.where(valid, rank // block_size, torch.full_like(rank, n_blocks_max))  # extra slot: padding
    slots = n_blocks_max + 1
    counts = torch.zeros(b, h, slots, device=pos.device).scatter_add_(-1, block, valid.float())
    filled = torch.where(valid, score.double(), torch.zeros_like(score, dtype=torch.float64))
    if aggregate == "mean":
        agg = torch.zeros(b, h, slots, dtype=torch.float64, device=pos.device).scatter_add_(-1, block, filled)
        agg = agg / counts.clamp_min(1)
    else:
        fill = math.inf if aggregate == "min" else -math.inf
        agg = torch.full((b, h, slots), fill, dtype=torch.float64, device=pos.device)
        agg = agg.scatter_reduce(-1, block, filled, reduce="amin" if aggregate == "min" else "amax", include_self=True)
    has_protected = torch.zeros(b, h, slots, device=pos.device).scatter_reduce(
        -1, block, (protected & valid).float(), reduce="amax", include_self=True
    )
    n_valid = valid.sum(-1, keepdim=True)
    n_blocks = (n_valid + block_size - 1) // block_size
    ids = torch.arange(slots, device=pos.device).expand(b, h, slots)
    agg = torch.where(has_protected > 0, torch.full_like(agg, torch.finfo(torch.float64).max), agg)
    # the newest block and nonexistent blocks are never candidates
    agg = torch.where(ids >= n_blocks - 1, torch.full_like(agg, math.inf), agg)
    n_evict = (n_blocks - budget_blocks).clamp_min(0)
    block_rank = torch.empty_like(ids).scatter_(-1, agg.argsort(dim=-1, stable=True), ids.contiguous())
    evicted = block_rank < n_evict
    return valid & ~evicted.gather(-1, block)
