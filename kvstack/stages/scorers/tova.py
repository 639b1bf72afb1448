"""``tova`` — Token Omission Via Attention: keep what the CURRENT query attends to.

Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104): at every step evict the token with the lowest
attention weight from the newest query, averaged over heads (here: each GQA group reduced with ``group_reduce``,
then the KV heads averaged unless ``head_wise``). The weights are the stack attention's by-product.
"""

from __future__ import annotations

import torch

from kvstack.stack.stats import StatsRequest

from . import Scorer, aligned, register_scorer


@register_scorer
class TovaScorer(Scorer):
    name = "tova"

    def request(self, layer, query_length):
        return StatsRequest(mass_windows=(1,))

    def scores(self, layer, tier_index, tier, stats) -> torch.Tensor:
        per_tier = [None if p is None else self.to_kv_heads(layer, stats.mass(i, 1)) for i, p in enumerate(stats.key_positions)]
        return aligned(stats, layer, tier_index, per_tier)
