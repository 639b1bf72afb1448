"""``window`` — recency (sliding window; StreamingLLM when combined with ``n_sink``).

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv 2309.17453): keep the
first ``n_sink`` tokens and the most recent ones. The score is the token's absolute position, so the newest tokens
win; sinks are protected by the ``evict`` stage, not by the score. Needs no attention, same tokens for every head.
"""

from __future__ import annotations

import torch

from . import Scorer, register_scorer


@register_scorer
class WindowScorer(Scorer):
    name = "window"
    position_only = True

    def scores(self, layer, tier_index, tier, stats) -> torch.Tensor:
        return tier.positions.to(torch.float32)
