"""Token scorers for the ``evict`` stage: one file per policy, registered by name.

A scorer turns what a layer holds (and, when it asks, the attention of the current forward) into one score per stored
token — higher means keep. The ``evict`` stage owns everything else: budgets, protected sets (sinks, recent window),
granularity (tokens or blocks), GQA reduction, head-wise or shared selection and the physical removal, so a new policy
is only its scoring rule — and its own parameters: a scorer declares them as ``class Params(ScorerParams)`` (types,
bounds, defaults, descriptions, checks of its own), the stage validates its ``scorer_params`` against the chosen
scorer's ``Params`` when the spec loads (flat keys next to ``scorer`` are routed there), and the scorer reads them as
``self.params``.

Scores come back per KV head ``[B, Hkv, T]`` (per-query-head statistics are reduced over each GQA group with the
spec's ``group_reduce`` by :meth:`Scorer.to_kv_heads`) or shared ``[B, 1, T]``. Attention-based scorers read the stack's :class:`AttentionStats` (never an
eager attention of their own); :func:`aligned` maps a per-key statistic of the attention call onto the tier's tokens
as they are now (an earlier stage or the sliding-window drop may have moved tokens since).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import torch
from pydantic import (
    BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, ValidationInfo, WithJsonSchema, field_validator,
    model_validator,
)

from kvstack.stack.errors import did_you_mean, field_errors

if TYPE_CHECKING:  # pragma: no cover
    from kvstack.stack.stats import AttentionStats, StatsRequest
    from kvstack.stack.cache import StackLayer
    from kvstack.stack.shape import ModelShape
    from kvstack.stack.tiers import ExactTier

_SCORERS: dict[str, type["Scorer"]] = {}


class ScorerParams(BaseModel):
    """Base of a scorer's own parameters: a scorer declares ``class Params(ScorerParams)`` with typed, bounded,
    described fields (they go into docs/spec-reference.md). Frozen, so a change goes through the stage and is
    validated there (``stage.scorer_params = {...}``, ``spec.with_overrides(window=16)``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


SCORER_PARAMS_HELP = (
    "The scorer's own parameters (its `Params`, listed under Scorers below). A key next to `scorer` that is not a "
    "field of the stage is read as one of them: `window: 32` is `scorer_params: {window: 32}`."
)


class ScorerOptions(BaseModel):
    """Spec fields of every stage that ranks tokens with a scorer (``evict``, ``quantized_prune``): the scorer, its
    parameters — validated against the scorer's ``Params`` when the spec loads — and how its scores are reduced.
    The stage redeclares ``scorer`` with its own default; list this class before ``StageSpec`` in the stage's
    bases, so its hooks (``inactive_options``, overrides) take effect."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    scorer: str = Field(description="Scoring policy (see docs/eviction.md).")
    scorer_params: Annotated[SerializeAsAny[ScorerParams], WithJsonSchema({"type": "object"})] = Field(
        default_factory=ScorerParams, description=SCORER_PARAMS_HELP
    )
    head_wise: bool | None = Field(
        default=None, description="Each KV head keeps its own tokens (None: the scorer's default)."
    )
    group_reduce: Literal["mean", "max"] = Field(
        default="mean", description="How query-head scores of one GQA group become the KV head's score."
    )

    @property
    def scorer_class(self) -> type["Scorer"]:
        return get_scorer(self.scorer)

    @property
    def is_head_wise(self) -> bool:
        return self.scorer_class.head_wise if self.head_wise is None else self.head_wise

    def protected_count(self) -> int:
        """Tokens the protected sets may hold: sinks + the longer of ``recent`` and the scorer's own window."""
        return self.n_sink + max(self.recent, self.scorer_class(self, None).protected_recent())

    def inactive_options(self) -> set[str]:
        """The empty ``scorer_params`` of a scorer without parameters (``kvstack show`` leaves it out)."""
        return set() if self.scorer_class.Params.model_fields else {"scorer_params"}

    def override_names(self) -> set[str]:
        return super().override_names() | set(self.scorer_class.Params.model_fields)

    def apply_overrides(self, dumped: dict, overrides: dict) -> set[str]:
        """Stage fields go in as they are, the scorer's parameters into ``scorer_params``; a new ``scorer`` keeps
        the parameters set for the old one that it also has (:func:`carried_params`)."""
        taken = set(type(self).model_fields) & set(overrides)
        dumped.update({name: overrides[name] for name in taken})
        scorer = overrides.get("scorer", self.scorer)
        if scorer != self.scorer:
            dumped["scorer_params"] = carried_params(self.scorer_params, scorer)
        if scorer in scorer_names():  # an unknown one is reported when the result is validated
            params = (set(overrides) - taken) & set(get_scorer(scorer).Params.model_fields)
            dumped["scorer_params"] = {**dumped.get("scorer_params", {}), **{n: overrides[n] for n in params}}
            taken |= params
        return taken

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, value: str) -> str:
        names = scorer_names()
        if value not in names:
            hint = did_you_mean(value, names)
            raise ValueError(f"unknown scorer {value!r}{hint}; available scorers: {', '.join(names)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _route_scorer_params(cls, data: Any, info: ValidationInfo) -> Any:
        """Flat keys (not fields of the stage) into ``scorer_params``, validated against the scorer's ``Params``;
        assigning ``scorer`` carries over the parameters the new scorer also has."""
        if not isinstance(data, dict) or info.field_name == "scorer_params":  # that assignment: the field validator
            return data
        fields = cls.model_fields
        name = data.get("scorer", fields["scorer"].default)
        flat = {k: v for k, v in data.items() if k not in fields}
        kept = {k: v for k, v in data.items() if k in fields and k != "scorer_params"}
        if not isinstance(name, str) or name not in scorer_names():
            return kept  # the scorer field reports the name; parameters of an unknown scorer cannot be checked
        given = data.get("scorer_params")
        if isinstance(given, get_scorer(name).Params) and not flat:
            return data
        if isinstance(given, BaseModel) and info.field_name == "scorer":
            given = carried_params(given, name)
        return {**kept, "scorer_params": _validated_params(cls, name, given, flat)}

    @field_validator("scorer_params", mode="before")
    @classmethod
    def _assigned_scorer_params(cls, value: Any, info: ValidationInfo) -> Any:
        """``stage.scorer_params = {...}``: validated against the current scorer (loading went through the model
        validator above and arrives here as the scorer's ``Params``)."""
        name = info.data.get("scorer")
        if name is None or isinstance(value, get_scorer(name).Params):
            return value
        return _validated_params(cls, name, value, {})


def _validated_params(stage: type[BaseModel], name: str, given: Any, flat: dict) -> ScorerParams:
    """``given`` (a mapping, or another scorer's ``Params``) and the ``flat`` keys, as scorer ``name``'s ``Params``;
    every wrong name or value is reported with its field (:func:`kvstack.stack.errors.field_errors`)."""
    scorer = get_scorer(name)
    own = scorer.Params.model_fields
    takes = f"{name!r} takes {', '.join(own)}" if own else f"{name!r} takes no parameters"
    if isinstance(given, BaseModel):  # passed by hand: what it sets must be this scorer's
        given = given.model_dump(exclude_unset=True)
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise field_errors([("scorer_params", f"scorer_params={given!r} is not allowed: a mapping ({takes})")])
    def path(key: str) -> str:  # where the user wrote it
        return key if key in flat else f"scorer_params.{key}"

    twice = [k for k in flat if k in given]
    problems = [(k, f"{k} is given twice, next to scorer and in scorer_params: give it once") for k in twice]
    merged = {**given, **flat}
    kind = stage.model_fields["kind"].default if "kind" in stage.model_fields else stage.__name__
    for key in (k for k in merged if k not in own):
        others = [n for n in scorer_names() if key in get_scorer(n).Params.model_fields]
        if key in flat:
            hint = "" if others else did_you_mean(key, [*stage.model_fields, *own])
            why = f"neither a field of {kind} nor a parameter of scorer {name!r}{hint}"
        else:
            why = f"not a parameter of scorer {name!r}{'' if others else did_you_mean(key, own)}"
        elsewhere = f"; scorers with {key!r}: {', '.join(others)}" if others else ""
        problems.append((path(key), f"{key}={merged[key]!r} is not allowed: {why}; {takes}{elsewhere}"))
    if problems:
        raise field_errors(problems)
    try:
        return scorer.Params.model_validate(merged)
    except ValidationError as err:
        raise field_errors([
            (path(".".join(map(str, e["loc"]))) if e["loc"] else "scorer_params",
             f"{name}'s {'.'.join(map(str, e['loc'])) or 'parameters'}={e.get('input')!r} is not allowed: "
             f"{e['msg'].removeprefix('Value error, ')}")
            for e in err.errors()
        ]) from None


def carried_params(params: BaseModel, scorer: str) -> dict:
    """The parameters set in ``params`` (another scorer's) that ``scorer`` also declares: what a change of scorer
    keeps (SnapKV's ``window`` carries over to OBCache; nothing of it to ``random``)."""
    own = get_scorer(scorer).Params.model_fields if scorer in scorer_names() else {}
    return {k: v for k, v in params.model_dump(include=params.model_fields_set).items() if k in own}


class Scorer:
    """Base class. ``head_wise``: by default each KV head keeps its own tokens (the spec's ``head_wise`` overrides)."""

    name: ClassVar[str] = ""
    head_wise: ClassVar[bool] = False
    #: the scores are a function of the tokens' positions alone (no keys, values or attention read)
    position_only: ClassVar[bool] = False
    #: the scorer's own parameters: subclasses declare ``class Params(ScorerParams)``; read them as ``self.params``
    Params: ClassVar[type[ScorerParams]] = ScorerParams

    def __init__(self, spec, shape: "ModelShape") -> None:
        self.spec = spec
        self.shape = shape

    @property
    def params(self) -> ScorerParams:
        """This scorer's parameters as the stage validated them (an instance of ``Params``)."""
        return self.spec.scorer_params

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
    ``recent`` newest positions — never evicted or demoted while the budget holds them all."""
    return _sink_tokens(pos, valid, n_sink) | (valid & (pos >= seen - recent) if recent else torch.zeros_like(valid))


def _sink_tokens(pos: torch.Tensor, valid: torch.Tensor, n_sink: int) -> torch.Tensor:
    if not n_sink:
        return torch.zeros_like(valid)
    big = torch.iinfo(pos.dtype).max
    ranked = torch.where(valid, pos, torch.full_like(pos, big)).sort(dim=-1).values
    k = min(n_sink, ranked.shape[-1])
    return valid & (pos <= ranked[..., k - 1 : k])


def keep_order(
    score: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, seen: int, n_sink: int, recent: int
) -> torch.Tensor:
    """[B, W, T] float64 keys, higher = kept (or kept at higher precision) first: the sinks, then the other
    protected tokens newest first, then every other token by its score (unchanged, ties as ``topk`` breaks them);
    empty slots -inf. When a budget holds fewer tokens than the protected sets, the ones it keeps are therefore the
    sinks and the newest, never an arbitrary subset."""
    key = score.double()
    sinks = _sink_tokens(pos, valid, n_sink)
    recent_ = valid & (pos >= seen - recent) if recent else torch.zeros_like(valid)
    scored = valid & ~(sinks | recent_) & key.isfinite()
    top = torch.where(scored, key, torch.full_like(key, -math.inf)).amax(-1, keepdim=True)
    base = torch.where(top.isfinite(), top, torch.zeros_like(top)) + 1  # above every score (float64: exact steps)
    key = torch.where(recent_, base + (pos - (seen - recent)).double(), key)  # 0..recent - 1, newer higher
    key = torch.where(sinks, base + recent + 1, key)
    return torch.where(valid, key, torch.full_like(key, -math.inf))


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
    """Class decorator: ``scorer: <cls.name>`` works in every stack loaded afterwards."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a name")
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, ScorerParams)):
        raise TypeError(f"{cls.__name__}.Params must subclass kvstack.ScorerParams (a pydantic model of the "
                        f"scorer's parameters), got {cls.Params!r}")
    _SCORERS[cls.name] = cls
    return cls


def unregister_scorer(name: str) -> None:
    """Remove a scorer registered from outside the package (tests, plugins being unloaded)."""
    _SCORERS.pop(name, None)


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
