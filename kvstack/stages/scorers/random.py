"""``random`` — a seeded random score: the baseline every policy has to beat.

Scores are drawn from a generator seeded by (``seed``, layer index, tokens seen), so a run is reproducible and
independent of the global RNG. Same tokens for every head.
"""

from __future__ import annotations

import torch
from pydantic import Field

from . import Scorer, ScorerParams, register_scorer


@register_scorer
class RandomScorer(Scorer):
    name = "random"

    class Params(ScorerParams):
        seed: int = Field(default=0, description="Seed of the scores (mixed with the layer and the tokens seen).")

    def scores(self, layer, tier_index, tier, stats) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((self.params.seed, layer.layer_idx, layer.seen, tier_index)) % 2**63)
        b, _, t = tier.positions.shape
        return torch.rand(b, 1, t, generator=gen).to(tier.positions.device)
