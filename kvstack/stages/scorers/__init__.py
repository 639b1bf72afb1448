"""Token scorers for the ``evict`` stage: one file per policy, registered by name.

A scorer turns what a layer holds (and, when it asks, the attention of the current forward) into one score per stored
token — higher means keep. The ``evict`` stage owns everything else: budgets, protected sets (sinks, recent window),
granularity (tokens or blocks) and the physical selection, so a new policy is only its scoring rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:  # pragma: no cover
    from kvstack.stack.attention import AttentionStats, StatsRequest
    from kvstack.stack.cache import StackLayer
    from kvstack.stack.tiers import ExactTier

_SCORERS: dict[str, type["Scorer"]] = {}


class Scorer:
    """Base class. ``head_wise``: scores differ per KV head (each head keeps its own tokens)."""

    name: ClassVar[str] = ""
    head_wise: ClassVar[bool] = False

    def __init__(self, spec, shape) -> None:
        self.spec = spec
        self.shape = shape

    def request(self, layer: "StackLayer", query_length: int) -> "StatsRequest | None":
        """Attention statistics needed from the current forward (None: the scorer does not use attention)."""
        return None

    def observe(self, layer: "StackLayer", stats: "AttentionStats") -> None:
        """Called after every attention of the layer (accumulate running statistics here)."""

    def scores(self, layer: "StackLayer", tier_index: int, tier: "ExactTier") -> torch.Tensor:
        """[B, 1 or Hkv, T] scores of the tokens of one exact tier; higher = more important."""
        raise NotImplementedError


def register_scorer(cls: type[Scorer]) -> type[Scorer]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a name")
    _SCORERS[cls.name] = cls
    return cls


def scorer_names() -> list[str]:
    _load()
    return sorted(_SCORERS)


def get_scorer(name: str) -> type[Scorer]:
    _load()
    return _SCORERS[name]


def _load() -> None:
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__, prefix=__name__ + "."):
        importlib.import_module(info.name)
