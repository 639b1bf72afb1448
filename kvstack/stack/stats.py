"""What stages ask of a layer's attention, and what they get back.

A stage that scores tokens with attention (H2O, TOVA, SnapKV, OBCache) or reads the query (ThinK) returns a
:class:`StatsRequest` from ``attention_request``; the layer merges the requests of its stages, its attention engine
accumulates exactly what was asked (block by block: no ``queries x keys`` tensor is kept) and hands an
:class:`AttentionStats` to every stage's ``after_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from .errors import CacheUsageError

#: saliency modes (OBCache): ``value`` a_i ||v_i||, ``key`` a_i ||v_i - o||, ``joint`` a_i ||v_i - o|| / (1 - a_i)
SALIENCY_MODES = ("value", "key", "joint")


@dataclass(frozen=True)
class StatsRequest:
    """What a stage wants from the attention of the current forward.

    ``mass_windows``: for each entry w, the normalised attention weight every stored key received, summed over the
    last w queries of the forward (None: all of them), per query head.
    ``saliency``: (w, mode) pairs — OBCache's output-change saliency of every stored key over the last w queries
    (:data:`SALIENCY_MODES`; derivation in ``kvstack/stages/scorers/obcache.py``).
    ``keep_query``: hand the post-RoPE query (and the attention output) to the stage.
    """

    mass_windows: tuple[int | None, ...] = ()
    keep_query: bool = False
    saliency: tuple[tuple[int | None, str], ...] = ()

    @staticmethod
    def merge(requests: Iterable["StatsRequest | None"]) -> "StatsRequest":
        windows: dict[int | None, None] = {}
        saliency: dict[tuple[int | None, str], None] = {}
        keep_query = False
        for req in requests:
            if req is not None:
                windows.update(dict.fromkeys(req.mass_windows))
                saliency.update(dict.fromkeys(req.saliency))
                keep_query = keep_query or req.keep_query
        return StatsRequest(tuple(windows), keep_query, tuple(saliency))

    @property
    def empty(self) -> bool:
        return not (self.mass_windows or self.saliency or self.keep_query)

    def rows_needed(self, num_queries: int) -> int:
        """How many of the newest queries the statistics read (0: none)."""
        windows = [*self.mass_windows, *(w for w, _ in self.saliency)]
        if not windows:
            return 0
        return num_queries if None in windows else min(num_queries, max(windows))


@dataclass
class AttentionStats:
    """By-products of one layer's attention, for the stages' ``after_attention``.

    ``query_positions`` [Q]: absolute positions of the forward's queries. ``key_positions[i]``: the positions of
    exact tier i when attention ran (None: empty then); stages that run earlier in ``finish_forward`` may move
    tokens, so align by position (``kvstack.stages.scorers.aligned``). ``masses[(i, w)]`` [B, Hq, T_i] and
    ``saliency[(w, mode)][i]`` [B, Hq, T_i]: what was requested, per query head (head ``h * G + g`` reads KV head
    ``h``). ``query`` [B, Hq, Q, D] and ``output`` [B, Hq, Q, Dv] when ``keep_query`` was asked.
    """

    query_positions: torch.Tensor
    num_queries: int
    key_positions: list[torch.Tensor | None] = field(default_factory=list)
    masses: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)
    saliency: dict[tuple[int | None, str], list[torch.Tensor | None]] = field(default_factory=dict)
    query: torch.Tensor | None = None
    output: torch.Tensor | None = None

    def mass(self, tier_index: int, window: int | None = None) -> torch.Tensor:
        """[B, Hq, T_i]: weight each key of tier ``tier_index`` received, summed over the last ``window`` queries."""
        found = self.masses.get((tier_index, window))
        if found is None:
            raise CacheUsageError(
                f"attention mass of tier {tier_index} over window {window!r} was not computed: the stage must ask "
                "for it in attention_request (StatsRequest.mass_windows)"
            )
        return found
