"""``key_norm`` — keys with a LOW L2 norm are the important ones.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
(arXiv 2406.11430): score = -||k_i||_2 per KV head. Needs no attention weights (works with any attention kernel).
Head-wise by default (each KV head keeps its own lowest-norm keys).
"""

from __future__ import annotations

import torch

from . import Scorer, register_scorer, tier_keys_values


@register_scorer
class KeyNormScorer(Scorer):
    name = "key_norm"
    head_wise = True

    def scores(self, layer, tier_index, tier, stats) -> torch.Tensor:
        keys, _ = tier_keys_values(tier)
        return -keys.float().norm(dim=-1)
