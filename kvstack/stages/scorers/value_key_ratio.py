"""``value_key_ratio`` — PagedEviction's token importance ||v_i||_2 / ||k_i||_2.

Chitty-Venkata et al., "PagedEviction: Structured Block-wise KV Cache Pruning for Efficient Large Language Model
Inference" (arXiv 2509.04377): a large value and a small key (small key = attention spread evenly, see key_norm)
mark a token worth keeping. Needs no attention weights. Usually run with ``granularity: block`` (preset
``paged-eviction``) so whole pages leave together; shared across KV heads by default so a block is one page.
"""

from __future__ import annotations

import torch

from . import Scorer, register_scorer, tier_keys_values


@register_scorer
class ValueKeyRatioScorer(Scorer):
    name = "value_key_ratio"

    def scores(self, layer, tier_index, tier, stats) -> torch.Tensor:
        keys, values = tier_keys_values(tier)
        return values.float().norm(dim=-1) / keys.float().norm(dim=-1).clamp_min(1e-6)
