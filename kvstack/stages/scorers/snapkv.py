"""``snapkv`` — attention of an observation window of the last prompt queries, pooled.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469): at prefill, sum the
attention the last ``window`` queries give each key (each GQA group reduced with ``group_reduce``; the paper averages
it), smooth it with a 1-D ``pooling`` (``max`` or ``avg``) of odd width ``kernel`` along the sequence so that
neighbours of a selected token come along, and keep the top scores per KV head; the observation window itself is
always kept. At decode (``phase: always``) the window is the single current query.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from kvstack.stack.stats import StatsRequest

from . import Scorer, ScorerParams, aligned, register_scorer


def pool(x: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    """[B, H, T] -> [B, H, T] smoothed along T with a centred window of ``kernel`` slots."""
    if kernel <= 1:
        return x
    b, h, t = x.shape
    flat = x.reshape(b * h, 1, t)
    if how == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return out.reshape(b, h, t)


@register_scorer
class SnapKVScorer(Scorer):
    name = "snapkv"
    head_wise = True

    class Params(ScorerParams):
        window: int = Field(default=32, ge=1, description="Observation window: the last prompt queries whose "
                            "attention is summed (always kept).")
        kernel: int = Field(default=7, ge=1, description="Pooling width along the sequence (odd).")
        pooling: Literal["max", "avg"] = Field(default="max", description="Pooling of the window's attention.")

        @field_validator("kernel")
        @classmethod
        def _odd(cls, kernel: int) -> int:
            if kernel % 2 == 0:
                raise ValueError("an odd width (the pooling window is centred on its token)")
            return kernel

    def request(self, layer, query_length):
        return StatsRequest(mass_windows=(self.params.window,))

    def scores(self, layer, tier_index, tier, stats) -> torch.Tensor:
        w = self.params.window
        per_tier = [None if p is None else self.to_kv_heads(layer, stats.mass(i, w)) for i, p in enumerate(stats.key_positions)]
        return pool(aligned(stats, layer, tier_index, per_tier), self.params.kernel, self.params.pooling)

    def protected_recent(self) -> int:
        return self.params.window
