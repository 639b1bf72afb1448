"""Token scorers for the ``evict`` stage: one file per policy, registered by name.

A scorer turns what a layer holds (and, when it asks, the attention of the current forward) into one score per stored
token — higher means keep. The ``evict`` stage owns everything else: budgets, protected sets (sinks, recent window),
granularity (tokens or blocks), GQA reduction, head-wise or shared selection and the physical removal, so a new policy
is only its scoring rule.

Scores come back per KV head ``[B, Hkv, T]`` (per-query-head statistics are reduced over each GQA group with the
spec's ``group_reduce`` by :meth:`Scorer.to_kv_heads`) or shared ``[B, 1, T]``. Attention-based scorers read the stack's :class:`AttentionStats` (never an
eager attention of their own); :func:`aligned` maps a per-key statistic of the attention call onto the tier's tokens
as they are now (an earlier stage or the sliding-window drop may have moved tokens since).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import BaseModel, Field, field_validator, model_validator

if TYPE_CHECKING:  # pragma: no cover
    from kvstack.stack.stats import AttentionStats, StatsRequest
    from kvstack.stack.cache import StackLayer
    from kvstack.stack.shape import ModelShape
    from kvstack.stack.tiers import ExactTier

_SCORERS: dict[str, type["Scorer"]] = {}


class ScorerOptions(BaseModel):
    """Spec fields of every stage that ranks tokens with a scorer (``evict``, ``quantized_prune``). The stage
    declares ``scorer`` itself (its default differs)."""

    head_wise: bool | None = Field(
        default=None, description="Each KV head keeps its own tokens (None: the scorer's default)."
    )
    group_reduce: Literal["mean", "max"] = Field(
        default="mean", description="How query-head scores of one GQA group become the KV head's score."
    )
    window: int = Field(default=32, ge=1, description="snapkv / obcache: observation window (last prompt queries).")
    kernel: int = Field(default=7, ge=1, description="snapkv: pooling width along the sequence (odd).")
    pooling: Literal["max", "avg"] = Field(default="max", description="snapkv: pooling of the window's attention.")
    saliency: Literal["joint", "key", "value"] = Field(
        default="joint", description="obcache: which output change is measured (see docs/eviction.md)."
    )
    seed: int = Field(default=0, description="random: seed of the scores.")

    def scorer_inactive_options(self) -> set[str]:
        """Scorer option fields the chosen scorer does not read (``head_wise`` and ``group_reduce`` always act)."""
        own = set(get_scorer(self.scorer).options)
        return {"window", "kernel", "pooling", "saliency", "seed"} - own

    @property
    def is_head_wise(self) -> bool:
        return get_scorer(self.scorer).head_wise if self.head_wise is None else self.head_wise

    def protected_count(self) -> int:
        """Tokens the protected sets may hold: sinks + the longer of ``recent`` and the scorer's own window."""
        return self.n_sink + max(self.recent, get_scorer(self.scorer)(self, None).protected_recent())

    @field_validator("scorer", check_fields=False)
    @classmethod
    def _known_scorer(cls, value: str) -> str:
        names = scorer_names()
        if value not in names:
            import difflib

            close = difflib.get_close_matches(value, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown scorer {value!r}{hint}; available scorers: {', '.join(names)}")
        return value

    @model_validator(mode="after")
    def _odd_kernel(self):
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel={self.kernel} is not allowed: an odd width (the pooling window is centred)")
        return self


class Scorer:
    """Base class. ``head_wise``: by default each KV head keeps its own tokens (the spec's ``head_wise`` overrides)."""

    name: ClassVar[str] = ""
    head_wise: ClassVar[bool] = False
    #: the ``ScorerOptions`` fields this policy reads (the others do not act and ``kvstack show`` leaves them out)
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec, shape: "ModelShape") -> None:
        self.spec = spec
        self.shape = shape

    def request(self, layer: "StackLayer", query_length: int) -> "StatsRequest | None":
        """Attention statistics needed from the current forward (None: the scorer does not use attention)."""
        return None

    def observe(self, layer: "StackLayer", stats: "AttentionStats") -> None:
        """Called after every attention of the layer (accumulate running statistics here)."""

    def scores(self, layer: "StackLayer", tier_index: int, tier: "ExactTier", stats: "AttentionStats") -> torch.Tensor:
        """[B, 1 | Hkv, T] scores of the tokens of one exact tier; higher = more important."""
        raise NotImplementedError

    def to_kv_heads(self, layer: "StackLayer", x: torch.Tensor) -> torch.Tensor:
        """[B, Hq, T] per query head -> [B, Hkv, T]: reduce each GQA group with the spec's ``group_reduce``."""
        kv = layer.shape_heads()
        if x.shape[1] == kv or x.shape[1] == 1:
            return x
        g = x.reshape(x.shape[0], kv, x.shape[1] // kv, x.shape[-1])
        return g.amax(2) if self.spec.group_reduce == "max" else g.mean(2)

    def protected_recent(self) -> int:
        """Newest positions this policy needs kept (SnapKV's observation window), on top of the spec's ``recent``."""
        return 0

    def record_bytes_per_token(self, shape: "ModelShape") -> int:
        """Bytes of per-token records this scorer keeps in ``tier.token_data`` (counted in the memory bound)."""
        return 0


def protected_tokens(pos: torch.Tensor, valid: torch.Tensor, seen: int, n_sink: int, recent: int) -> torch.Tensor:
    """[B, W, T]: the first ``n_sink`` real tokens of each row (left padding shifts where a row starts) and the
    ``recent`` newest positions — never evicted or demoted."""
    out = torch.zeros_like(valid)
    if n_sink:
        big = torch.iinfo(pos.dtype).max
        ranked = torch.where(valid, pos, torch.full_like(pos, big)).sort(dim=-1).values
        k = min(n_sink, ranked.shape[-1])
        out = out | (valid & (pos <= ranked[..., k - 1 : k]))
    if recent:
        out = out | (valid & (pos >= seen - recent))
    return out


def union_scores(scorer: "Scorer", head_wise: bool, layer: "StackLayer", stats: "AttentionStats", tiers=None):
    """One ranking over ``tiers`` ([(index, tier)], default: every non-empty exact tier of the layer): returns
    (tiers, score, positions, valid), the last three [B, W, T_total] with W = Hkv for head-wise selection, else 1
    (scores averaged over heads)."""
    if tiers is None:
        tiers = [(i, t) for i, t in enumerate(layer.tiers) if t.num_tokens]
    scores = [scorer.scores(layer, i, t, stats).float() for i, t in tiers]
    if not head_wise:
        scores = [s.mean(1, keepdim=True) for s in scores]
    width = max(s.shape[1] for s in scores + [t.positions for _, t in tiers])
    score = torch.cat([s.expand(-1, width, -1) for s in scores], dim=-1)
    pos = torch.cat([t.positions.expand(-1, width, -1) for _, t in tiers], dim=-1)
    return tiers, score, pos, pos >= 0


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


_loaded = False


def _load() -> None:
    """Import the built-in scorer files once (each registers itself); later registrations go straight in."""
    global _loaded
    if _loaded:
        return
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__, prefix=__name__ + "."):
        importlib.import_module(info.name)
    _loaded = True


def aligned(
    stats: "AttentionStats", layer: "StackLayer", tier_index: int, per_tier: list[torch.Tensor | None]
) -> torch.Tensor:
    """A per-key statistic of the attention call (``per_tier[i]`` [B, H, T_i] over tier i's tokens then) for the
    tokens tier ``tier_index`` holds now, matched by absolute position; tokens the attention did not see get 0."""
    tier = layer.tiers[tier_index]
    if stats.key_positions[tier_index] is tier.positions:  # untouched since the attention call: same slots
        return per_tier[tier_index]
    ref = next(x for x in per_tier if x is not None)
    b, heads = ref.shape[0], max(ref.shape[1], tier.positions.shape[1])
    dump = layer.seen  # slot for empty positions
    buf = ref.new_zeros(b, heads, layer.seen + 1)
    for x, pos in zip(per_tier, stats.key_positions):
        if x is None:
            continue
        idx = pos.long().expand(b, heads, -1)
        buf.scatter_(-1, torch.where(idx >= 0, idx, dump), x.expand(b, heads, -1))
    now = tier.positions.long().expand(b, heads, -1)
    out = buf.gather(-1, torch.where(now >= 0, now, dump))
    return torch.where(now >= 0, out, torch.zeros_like(out))


def tier_keys_values(tier: "ExactTier") -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot's key and value [B, Hkv, T, D] in full precision (dequantized by the tier)."""
    b = tier.positions.shape[0]
    index = torch.arange(tier.num_tokens, device=tier.positions.device).expand(b, 1, -1)
    return tier.gather(index)
