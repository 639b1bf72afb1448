"""A scorer defined outside kvstack/ (as a user's package would), with a parameter of its own: keep the tokens whose
values have the largest ``p``-norm (``p`` validated: a number in [1, 8])."""

from __future__ import annotations

from pydantic import Field

from kvstack import Scorer, ScorerParams, register_scorer, tier_keys_values


@register_scorer
class ValuePNormScorer(Scorer):
    name = "value_pnorm"
    head_wise = True

    class Params(ScorerParams):
        p: float = Field(default=2.0, ge=1.0, le=8.0, description="Order of the value norm.")

    def scores(self, layer, tier_index, tier, stats):
        _, values = tier_keys_values(tier)
        return values.float().norm(p=self.params.p, dim=-1)
