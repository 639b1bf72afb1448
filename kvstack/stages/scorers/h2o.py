"""``h2o`` — Heavy Hitters: accumulated attention mass, normalised by how many queries could attend.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023
(arXiv 2306.14048). Every forward adds the attention each stored key received from every query (each GQA group
reduced with ``group_reduce``) to a per-token, per-KV-head accumulator kept in ``tier.token_data["h2o"]`` — it moves
with its token through eviction and demotion and is counted in memory (4 bytes per token and KV head). Raw sums
favour old tokens (more queries saw them), so the score is the sum divided by the number of queries that could attend
to the token, ``seen - position``. Combine with ``recent`` (the paper keeps heavy hitters + a recent window).
"""

from __future__ import annotations

import torch

from kvstack.stack.stats import StatsRequest

from . import Scorer, aligned, register_scorer

RECORD = "h2o"


@register_scorer
class H2OScorer(Scorer):
    name = "h2o"
    head_wise = True

    def request(self, layer, query_length):
        return StatsRequest(mass_windows=(None,))

    def observe(self, layer, stats) -> None:
        per_tier = [None if p is None else self.to_kv_heads(layer, stats.mass(i)) for i, p in enumerate(stats.key_positions)]
        for i, tier in enumerate(layer.tiers):
            if not tier.num_tokens or all(x is None for x in per_tier):
                continue
            added = aligned(stats, layer, i, per_tier).float()
            old = tier.token_data.get(RECORD)
            tier.token_data[RECORD] = added if old is None else old + added

    def scores(self, layer, tier_index, tier, stats) -> torch.Tensor:
        acc = tier.token_data[RECORD]
        queries = (layer.seen - tier.positions).clamp_min(1).float()
        return acc / queries

    def record_bytes_per_token(self, shape) -> int:
        return 4 * shape.num_kv_heads
