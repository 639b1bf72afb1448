"""``obcache`` — output-aware saliency: how much the attention OUTPUT changes when a token is removed.

In the spirit of OBCache ("Optimal Brain Cache", arXiv 2510.07651: Optimal-Brain-Damage saliency of the attention
output instead of the attention weights). Our derivation, for one query with weights ``a_j = softmax(l)_j`` and output
``o = sum_j a_j v_j``:

* **joint** (key and value removed — what eviction does): the remaining weights renormalise to a_j / (1 - a_i), so
  ``o' = (o - a_i v_i) / (1 - a_i)`` and ``o' - o = a_i (o - v_i) / (1 - a_i)``:
  saliency ``a_i ||v_i - o|| / (1 - a_i)`` — exact, not an approximation.
* **key** (only the key perturbed, value kept): first order in the logit, ``d o / d l_i = a_i (v_i - o)``:
  saliency ``a_i ||v_i - o||`` (the joint form without the renormalisation factor; equal to it for small a_i).
* **value** (only the value removed, weight kept): ``o' - o = -a_i v_i``: saliency ``a_i ||v_i||``.

The score of a token sums the saliency over the last ``window`` queries of the forward (at decode: the current query),
each GQA group reduced with ``group_reduce``; ``saliency`` picks the form (default ``joint``). The saliency is
computed inside the stack's attention function from the weights and output it already has
(``StatsRequest.saliency``); the observation window is protected like SnapKV's.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from kvstack.stack.stats import StatsRequest

from . import Scorer, ScorerParams, aligned, register_scorer


@register_scorer
class OBCacheScorer(Scorer):
    name = "obcache"
    head_wise = True

    class Params(ScorerParams):
        window: int = Field(default=32, ge=1, description="Observation window: the last prompt queries whose output "
                            "change is summed (always kept).")
        saliency: Literal["joint", "key", "value"] = Field(
            default="joint", description="Which output change is measured: key and value removed, the key's logit "
            "perturbed, or the value removed (docs/eviction.md)."
        )

    def key(self) -> tuple[int, str]:
        return (self.params.window, self.params.saliency)

    def request(self, layer, query_length):
        return StatsRequest(saliency=(self.key(),))

    def scores(self, layer, tier_index, tier, stats) -> torch.Tensor:
        per_tier = [None if x is None else self.to_kv_heads(layer, x) for x in stats.saliency[self.key()]]
        return aligned(stats, layer, tier_index, per_tier)

    def protected_recent(self) -> int:
        return self.params.window
