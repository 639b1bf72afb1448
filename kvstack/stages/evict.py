"""``kind: evict`` — physically remove tokens from a layer, keeping the best-scored ones within a budget.

The policy (which tokens matter) is a scorer from ``kvstack/stages/scorers/``; this stage owns the rest:

* budget: ``tokens`` per layer and KV head, or a memory ``ratio`` of the full cache at the tokens seen (own
  ``budget`` or the stack's);
* protected sets: the first ``n_sink`` real tokens of each row (attention sinks) and the ``recent`` newest positions;
* selection: one top-k over every exact tier of the layer (tokens keep their tier), then ``StackLayer.retain`` —
  padding is never kept, and evicted tokens are folded into the layer's state tier when the stack has one;
* when: ``always`` (after every forward that leaves the layer over budget), ``prefill`` (only the first forward:
  compress the prompt), ``decode`` (only later forwards).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, field_validator

from kvstack.stack.base import Budget, Stage, StageSpec, spec_error
from kvstack.stack.memory import _itemsize, full_tier_bytes
from kvstack.stack.registry import register_stage

from .scorers import get_scorer, scorer_names


@register_stage
class EvictSpec(StageSpec):
    """Evict tokens by a scoring policy to a budget."""

    kind: Literal["evict"] = "evict"
    scorer: str = Field(default="window", description="Scoring policy (see `kvstack show` / docs/eviction.md).")
    budget: Budget | None = Field(default=None, description="Own budget; defaults to the stack's budget.")
    n_sink: int = Field(default=0, ge=0, description="First real tokens of each row that are never evicted.")
    recent: int = Field(default=0, ge=0, description="Newest positions that are never evicted.")
    phase: Literal["always", "prefill", "decode"] = Field(
        default="always", description="When to compress: after every forward, only the prompt, or only decode."
    )

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, value: str) -> str:
        names = scorer_names()
        if value not in names:
            raise ValueError(f"unknown scorer {value!r}; available scorers: {', '.join(names)}")
        return value

    def effective_budget(self, stack_budget: Budget | None) -> Budget:
        budget = self.budget or stack_budget
        if budget is None:
            raise spec_error("budget", None, "evict needs a budget: set `budget` on the stage or on the stack")
        return budget

    def validate_with(self, stack_budget: Budget | None) -> None:
        budget = self.effective_budget(stack_budget)
        protected = self.n_sink + self.recent
        if budget.tokens is not None and budget.tokens < protected:
            raise spec_error(
                "budget.tokens", budget.tokens, f"at least n_sink + recent = {self.n_sink} + {self.recent} = {protected}"
            )

    def validate_for(self, shape, stack_budget) -> None:
        self.validate_with(stack_budget)

    def plan_memory(self, plan, stack_budget) -> None:
        budget = self.effective_budget(stack_budget)
        head_wise = get_scorer(self.scorer).head_wise
        for layer in plan.layers:
            full = layer.tier("full")
            if head_wise and full is not None:
                full.bytes_for = full_tier_bytes(plan.shape, plan.dtype, positions_per_head=True)
            if budget.tokens is not None:
                cap = budget.tokens
            else:
                own = full.bytes_for(1) if full is not None else 1
                reference = plan.shape.num_kv_heads * (plan.shape.head_dim + plan.shape.value_dim) * _itemsize(plan.dtype)
                cap = max(ratio_tokens(budget.ratio, plan.seq_len, reference, own), self.n_sink + self.recent)
            excess = layer.tokens - cap
            for tier in reversed(layer.tiers):  # the oldest, lowest-precision tiers give way first
                if excess <= 0:
                    break
                cut = min(excess, tier.tokens)
                tier.tokens -= cut
                excess -= cut

    def build(self, shape, stack_budget) -> "EvictStage":
        return EvictStage(self, shape, stack_budget)


def ratio_tokens(ratio: float, seen: int, reference_bytes_per_token: float, own_bytes_per_token: float) -> int:
    """Tokens whose bytes stay within ``ratio`` of an uncompressed cache holding ``seen`` tokens."""
    return int(math.floor(ratio * seen * reference_bytes_per_token / own_bytes_per_token + 1e-9))


class EvictStage(Stage):
    spec: EvictSpec

    def __init__(self, spec: EvictSpec, shape, stack_budget) -> None:
        super().__init__(spec, shape, stack_budget)
        self.budget = spec.effective_budget(stack_budget)
        self.scorer = get_scorer(spec.scorer)(spec, shape)

    def attention_request(self, layer, query_length):
        return self.scorer.request(layer, query_length)

    def budget_tokens(self, layer) -> int:
        if self.budget.tokens is not None:
            return self.budget.tokens
        # priced as full-precision tokens: the conservative cost when tokens may sit in any tier
        reference = self.shape.num_kv_heads * (self.shape.head_dim + self.shape.value_dim) * _itemsize(self.shape.dtype)
        tokens = ratio_tokens(self.budget.ratio, layer.seen, reference, layer.full.bytes_per_token())
        return max(tokens, self.spec.n_sink + self.spec.recent)

    def after_attention(self, layer, stats) -> None:
        self.scorer.observe(layer, stats)
        first_forward = layer.seen == stats.num_queries
        if (self.spec.phase == "prefill" and not first_forward) or (self.spec.phase == "decode" and first_forward):
            return
        cap = self.budget_tokens(layer)
        if int(layer.kept_counts().max()) <= cap:
            return
        keep = self.select(layer, cap)
        for tier, tier_keep in zip([t for t in layer.tiers if t.num_tokens], keep):
            layer.retain(tier, tier_keep)

    def select(self, layer, cap: int) -> list[torch.Tensor]:
        """Keep masks, one per non-empty exact tier: the top-``cap`` tokens per (row, head) over all tiers."""
        tiers = [(i, t) for i, t in enumerate(layer.tiers) if t.num_tokens]
        scores = [self.scorer.scores(layer, i, t) for i, t in tiers]
        width = max(s.shape[1] for s in scores + [t.positions for _, t in tiers])
        score = torch.cat([s.expand(-1, width, -1) for s in scores], dim=-1).to(torch.float32)
        pos = torch.cat([t.positions.expand(-1, width, -1) for _, t in tiers], dim=-1)
        valid = pos >= 0
        protected = self.protected(pos, valid, layer.seen)
        score = torch.where(protected, torch.full_like(score, math.inf), score)
        score = torch.where(valid, score, torch.full_like(score, -math.inf))
        k = min(cap, score.shape[-1])
        top = score.topk(k, dim=-1).indices
        keep = torch.zeros_like(valid).scatter_(-1, top, True) & valid
        sizes = [t.num_tokens for _, t in tiers]
        return list(keep.split(sizes, dim=-1))

    def protected(self, pos: torch.Tensor, valid: torch.Tensor, seen: int) -> torch.Tensor:
        out = torch.zeros_like(valid)
        if self.spec.n_sink:
            # the n_sink smallest real positions of each row (left padding shifts where a row starts)
            big = torch.iinfo(pos.dtype).max
            ranked = torch.where(valid, pos, torch.full_like(pos, big)).sort(dim=-1).values
            kth = ranked[..., min(self.spec.n_sink, ranked.shape[-1]) - 1 : min(self.spec.n_sink, ranked.shape[-1])]
            out = out | (valid & (pos <= kth))
        if self.spec.recent:
            out = out | (valid & (pos >= seen - self.spec.recent))
        return out
