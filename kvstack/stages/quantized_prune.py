"""``kind: quantized_prune`` — precision by importance: an eviction scorer ranks tokens, tiers give them bits.

Zhang et al., "More Tokens, Lower Precision: Towards the Optimal Token-Precision Trade-off in KV Cache Compression"
(arXiv 2412.12706): at equal memory, more tokens at lower precision can beat fewer tokens at 16 bit. Generalised
here to precision tiers by importance. Quantization is KIVI's (``kvstack/stages/quantize.py``, arXiv 2402.02750).

Two forms:

* ``tiers``: a list from most to least important, strictly decreasing ``bits`` (16 = the full-precision tier), each
  with a ``fraction`` of the kept tokens, the last one may be ``rest: true``. E.g. ``[{fraction: 0.2, bits: 16},
  {fraction: 0.3, bits: 4}, {rest: true, bits: 2}]``. Without a budget every token is kept (and fractions that do not
  sum to 1 without a ``rest`` entry evict the remainder); with a budget (own or the stack's) the kept count ``N``
  comes from the budget and the fractions split it.
* ``bits`` with a budget: tokens that eviction to that budget would keep stay in full precision, the tokens it would
  drop are demoted to ``bits`` instead (nothing is evicted).

Ratio budgets (``budget: {ratio: r}``) are met by choosing ``N``: with ``c_ref`` the bytes of one uncompressed token
(all KV heads, model dtype), ``c_i`` the amortised bytes per token of tier ``i`` (codes, scales and zero points per
token, positions and scorer records) and ``f_i`` its share of ``N``,

    N = floor(r * seen * c_ref / sum_i f_i c_i)

so lower bits buy proportionally more tokens. (For the ``bits`` form, ``N`` is the 16-bit count eviction would keep:
``floor(r * seen * c_ref / c_16)``.) Each quantized tier can exceed its amortised share by less than one key group
(``group_size`` slots), and the full tier by ``every - 1`` new tokens; ``plan_memory`` counts both.

Each forward of the prompt, and every ``every`` decode steps (default ``group_size``, so demotions move whole key
groups), the scorer ranks every token of the full tier and of this stage's quantized tiers (protected sinks and
recent tokens first), the ranks are cut into the tiers' counts and tokens move between tiers with
``StackLayer.demote`` (a promoted token keeps the error of its lowest precision so far) or leave with
``StackLayer.retain`` (folded into the low-rank state when the stack has one).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvstack.stack.base import Budget, Stage, StageSpec, spec_error
from kvstack.stack.memory import TierPlan, _itemsize, full_tier_bytes
from kvstack.stack.registry import register_stage

from .quantize import QuantizedTier, check_quant_params, check_quant_shape, quantized_slot_bytes, value_group_for
from .scorers import ScorerOptions, get_scorer, protected_tokens, union_scores

LEVEL_RECORD = "quantized_prune.level"  # transient per-token record: the tier a token is moving to


class PrecisionTier(BaseModel):
    """One precision level: a ``fraction`` of the kept tokens (or the ``rest``) stored at ``bits``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    bits: Literal[2, 4, 8, 16] = Field(description="Bits per element (16: the full-precision tier).")
    fraction: float | None = Field(default=None, gt=0.0, le=1.0, description="Share of the kept tokens.")
    rest: bool = Field(default=False, description="Every kept token the tiers above do not take (last tier only).")

    @model_validator(mode="after")
    def _one_size(self) -> "PrecisionTier":
        if (self.fraction is None) == (not self.rest):
            raise ValueError(f"a tier sets exactly one of 'fraction' or 'rest: true'; got {self.model_dump()}")
        return self


@register_stage
class QuantizedPruneSpec(StageSpec, ScorerOptions):
    """Rank tokens with an eviction scorer and store them at a precision that depends on their rank."""

    kind: Literal["quantized_prune"] = "quantized_prune"
    scorer: str = Field(default="h2o", description="Scoring policy that ranks tokens (see docs/eviction.md).")
    tiers: list[PrecisionTier] | None = Field(default=None, description="Precision tiers, most important first.")
    bits: Literal[2, 4, 8] | None = Field(
        default=None, description="Short form: tokens eviction to the budget would drop are stored at these bits."
    )
    budget: Budget | None = Field(default=None, description="Own budget; defaults to the stack's budget.")
    group_size: int = Field(default=32, ge=1, description="Tokens per key group of the quantized tiers.")
    value_group_size: int | Literal["head_dim"] | None = Field(
        default=None, description="Channels per value group (default group_size; head_dim: one group per token)."
    )
    every: int | None = Field(
        default=None, ge=1, description="Re-assign tiers every N decode steps (default group_size)."
    )
    n_sink: int = Field(default=0, ge=0, description="First real tokens of each row, always in the top tier.")
    recent: int = Field(default=0, ge=0, description="Newest positions, always in the top tier.")

    def inactive_options(self) -> set[str]:
        return self.scorer_inactive_options()

    # ------------------------------------------------------------------------------------ validation
    def effective_budget(self, stack_budget: Budget | None) -> Budget | None:
        return self.budget or stack_budget

    def levels(self) -> list[PrecisionTier]:
        """The tiers, the ``bits`` short form expanded (its 16-bit count comes from the budget)."""
        if self.tiers is not None:
            return list(self.tiers)
        return [PrecisionTier(bits=16, fraction=1.0), PrecisionTier(bits=self.bits, rest=True)]

    def validate_with(self, stack_budget) -> None:
        if (self.tiers is None) == (self.bits is None):
            raise spec_error("tiers", self.tiers, "exactly one of 'tiers' (a list) or 'bits' (the short form)")
        budget = self.effective_budget(stack_budget)
        if self.tiers is None and budget is None:
            raise spec_error("budget", None, "a budget (on the stage or the stack) for the short form 'bits'")
        if self.tiers is not None:
            if not self.tiers:
                raise spec_error("tiers", [], "at least one tier")
            bits = [t.bits for t in self.tiers]
            if any(a <= b for a, b in zip(bits, bits[1:])):
                raise spec_error("tiers.bits", bits, "strictly decreasing bits, most important tier first")
            if any(t.rest for t in self.tiers[:-1]):
                raise spec_error("tiers.rest", True, "only on the last tier")
            total = sum(t.fraction or 0.0 for t in self.tiers)
            if total > 1 + 1e-9:
                raise spec_error("tiers.fraction", total, "fractions summing to at most 1")
            if budget is not None and not self.tiers[-1].rest and abs(total - 1) > 1e-9:
                raise spec_error(
                    "tiers.fraction", total, "fractions summing to 1 (or a last tier with rest: true) with a budget"
                )
        value_group = self.value_group_size
        if isinstance(value_group, int) and value_group < 1:
            raise spec_error("value_group_size", value_group, "a positive int or 'head_dim'")
        for level in self.levels():
            if level.bits != 16:
                check_quant_params(level.bits, self.group_size, value_group, None)

    def validate_for(self, shape, stack_budget) -> None:
        self.validate_with(stack_budget)
        value_group = value_group_for(self.value_group_size, self.group_size, shape)
        for level in self.levels():
            if level.bits != 16:
                check_quant_shape(shape, level.bits, value_group)

    # --------------------------------------------------------------------------------------- sizing
    @property
    def period(self) -> int:
        return self.every or self.group_size

    def per_token_extra(self, shape) -> int:
        """Positions (per head when head-wise) and scorer records of one token."""
        pos = full_tier_bytes(shape, shape.dtype, positions_per_head=self.is_head_wise, key_dim=0, value_dim=0)(1)
        return pos + get_scorer(self.scorer)(self, shape).record_bytes_per_token(shape)

    def level_costs(self, shape, dtype) -> list[float]:
        """Amortised bytes of one token per batch row in each level."""
        e = _itemsize(dtype)
        h, dk, dv = shape.num_kv_heads, shape.head_dim, shape.value_dim
        vg = value_group_for(self.value_group_size, self.group_size, shape)
        extra = self.per_token_extra(shape)
        costs = []
        for level in self.levels():
            if level.bits == 16:
                costs.append(h * (dk + dv) * e + extra)
            else:
                b = level.bits
                costs.append(h * ((dk + dv) * b / 8 + 2 * e * (dk / self.group_size + dv / vg)) + extra)
        return costs

    def level_split(self, shape, dtype, stack_budget) -> "LevelSplit":
        """How the kept tokens split into levels, as a function of the tokens seen and held (worked out once)."""
        budget = self.effective_budget(stack_budget)
        ratio = None
        if budget is not None and budget.tokens is None:
            reference = shape.num_kv_heads * (shape.head_dim + shape.value_dim) * _itemsize(dtype)
            costs = self.level_costs(shape, dtype)
            if self.tiers is None:  # short form: what eviction would keep at 16 bits
                per_token = costs[0]
            else:
                per_token = sum(s * c for s, c in zip(self.shares(), costs))
            ratio = (budget.ratio, reference, per_token)
        cumulative, acc = [], 0.0
        for level in self.levels():
            acc += level.fraction or 0.0
            cumulative.append(None if level.rest else acc)
        return LevelSplit(
            budget is not None, None if budget is None else budget.tokens, ratio, self.protected_count(),
            None if self.tiers is None else cumulative,
        )

    def shares(self) -> list[float]:
        fractions = [t.fraction for t in self.levels() if not t.rest]
        return fractions + ([1.0 - sum(fractions)] if self.levels()[-1].rest else [])

    def level_counts(self, shape, dtype, stack_budget, seen: int, held: int) -> list[int]:
        """Tokens per level (per row and KV head); tokens beyond their sum are evicted."""
        bounds = self.level_split(shape, dtype, stack_budget).bounds(seen, torch.tensor([held]))[0].tolist()
        return [b - a for a, b in zip([0] + bounds[:-1], bounds)]

    def plan_memory(self, plan, stack_budget) -> None:
        shape = plan.shape
        extra = self.per_token_extra(shape)
        vg = value_group_for(self.value_group_size, self.group_size, shape)
        full_cost = full_tier_bytes(shape, plan.dtype, positions_per_head=self.is_head_wise)
        records = get_scorer(self.scorer)(self, shape).record_bytes_per_token(shape)
        for layer in plan.layers:
            full = layer.tier("full")
            counts = self.level_counts(shape, plan.dtype, stack_budget, plan.seq_len, full.tokens)
            full.bytes_for = lambda n, base=full_cost: base(n) + n * records
            for level, count in zip(self.levels(), counts):
                if level.bits == 16:
                    full.tokens = min(full.tokens, count + self.period - 1)
                else:
                    cost = quantized_slot_bytes(shape, plan.dtype, level.bits, self.group_size, vg, extra)
                    layer.tiers.append(TierPlan(f"quantized{level.bits}", count, cost))
            if all(level.bits != 16 for level in self.levels()):
                full.tokens = min(full.tokens, self.period - 1)

    def build(self, shape, stack_budget) -> "QuantizedPruneStage":
        return QuantizedPruneStage(self, shape, stack_budget)


class LevelSplit:
    """Level bounds of one stage: with ``N`` the kept count (the budget's ``tokens``, or the tokens whose amortised
    bytes stay within ``ratio = (r, reference bytes per token, mean bytes per kept token)`` of the full cache; at
    least the ``protected`` tokens, at most those held), level i takes ranks ``[bound_{i-1}, bound_i)`` with
    ``bound_i = floor(cumulative_i * N)`` (``None``: the rest, ``N``). The short form (``cumulative`` None) keeps
    ``N`` at 16 bits and demotes the rest of the held tokens."""

    def __init__(self, has_budget: bool, tokens, ratio, protected: int, cumulative):
        self.has_budget, self.tokens, self.ratio = has_budget, tokens, ratio
        self.protected, self.cumulative = protected, cumulative

    def bounds(self, seen: int, held: torch.Tensor) -> torch.Tensor:
        """held [...] tokens per (row, head) -> cumulative level bounds [..., L] (int64, no host sync)."""
        held = held.long()
        n = held
        if self.has_budget:
            cap = self.tokens
            if cap is None:
                r, reference, per_token = self.ratio
                cap = int(math.floor(r * seen * reference / per_token + 1e-9))
            n = held.clamp_max(max(cap, self.protected))
        if self.cumulative is None:
            return torch.stack([n, held], -1)
        columns = [n if c is None else torch.minimum(n, (n.double() * c + 1e-9).floor().long()) for c in self.cumulative]
        return torch.stack(columns, -1)


class QuantizedPruneStage(Stage):
    spec: QuantizedPruneSpec

    def __init__(self, spec, shape, stack_budget) -> None:
        super().__init__(spec, shape, stack_budget)
        self.scorer = get_scorer(spec.scorer)(spec, shape)
        self.recent = max(spec.recent, self.scorer.protected_recent())
        self.value_group = value_group_for(spec.value_group_size, spec.group_size, shape)
        self.key = f"quantized_prune:{id(self)}"
        self.split = spec.level_split(shape, shape.dtype, stack_budget)

    def init_layer(self, layer) -> None:
        tiers = []
        for level in self.spec.levels():
            if level.bits == 16:
                tiers.append(layer.full)
                continue
            tier = QuantizedTier(
                level.bits, self.spec.group_size, self.value_group, self.shape.dtype,
                label=f"layer {layer.layer_idx}, quantized_prune", name=f"quantized{level.bits}",
            )
            layer.tiers.append(tier)
            tiers.append(tier)
        layer.scratch[self.key] = tiers

    def attention_request(self, layer, query_length):
        return self.scorer.request(layer, query_length)

    def after_attention(self, layer, stats) -> None:
        self.scorer.observe(layer, stats)
        prompt = stats.num_queries > 1 or layer.seen == stats.num_queries
        if not prompt and layer.seen % self.spec.period:
            return
        levels: list = layer.scratch[self.key]
        own = list(dict.fromkeys(levels))  # full tier once even when no level is 16-bit
        if layer.full not in own:
            own.insert(0, layer.full)
        tiers = [(layer.tiers.index(t), t) for t in own if t.num_tokens]
        if not tiers:
            return
        target = self.assign(layer, tiers, stats)
        for (_, tier), level in zip(tiers, target):
            tier.token_data[LEVEL_RECORD] = level
        evicted = len(levels)
        for _, tier in tiers:
            level = tier.token_data[LEVEL_RECORD]
            if bool(((level == evicted) & tier.valid()).any()):
                layer.retain(tier, level < evicted)
            for index, dst in enumerate(levels):
                if dst is not tier and tier.num_tokens:
                    layer.demote(tier, tier.token_data[LEVEL_RECORD] == index, dst)
        for tier in own:
            tier.token_data.pop(LEVEL_RECORD, None)
        if layer.full.num_tokens:  # moves made per head leave empty slots in rows that received fewer tokens
            layer.retain(layer.full, layer.full.valid(), absorb=False)

    def assign(self, layer, tiers, stats) -> list[torch.Tensor]:
        """Target level of every slot of each tier ([B, W, T_i] int; ``len(levels)`` = evict)."""
        _, score, pos, valid = union_scores(self.scorer, self.spec.is_head_wise, layer, stats, tiers)
        protected = protected_tokens(pos, valid, layer.seen, self.spec.n_sink, self.recent)
        score = torch.where(protected, torch.full_like(score, math.inf), score)
        score = torch.where(valid, score, torch.full_like(score, -math.inf))
        order = score.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        bounds = self.split.bounds(layer.seen, valid.sum(-1))  # [B, W, L]
        level = (rank[..., None] >= bounds[..., None, :]).sum(-1)
        level = torch.where(valid, level, torch.full_like(level, bounds.shape[-1]))
        return list(level.split([t.num_tokens for _, t in tiers], dim=-1))

