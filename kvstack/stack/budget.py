"""A budget is a promise (docs/budgets.md).

With ``budget: {ratio: r}`` the cache never holds more than ``r`` times the bytes of an uncompressed cache of the same
tokens in the dtype the cache holds; with ``budget: {tokens: n}`` never more than the bytes of ``n`` uncompressed
tokens per layer. Every tensor counts: codes, scales, zero points, positions, per-token records, the low-rank state.

Three parts keep it:

* the stages that size themselves to a budget (``evict``, ``quantized_prune`` with tiers: ``StageSpec.keeps_budget``) work out
  their token counts in bytes, from the layer's limit minus what the layer holds besides its tokens (the state);
* after every forward, each layer compares the bytes it holds with its limit; if it holds more (rounding, a decode
  step between two periodic compressions, a stage downstream of the sizing one), the owner's ``Stage.fit`` removes
  its lowest-ranked tokens until it fits. Protected tokens (sinks, recent window) yield last, but they yield;
* ``check_budget`` (run by ``kvstack.apply`` before anything is touched) refuses a stack that cannot keep its budget
  and says what it can reach.

The low-rank state is created only once it costs at most ``STATE_SHARE`` of the layer's limit (a state worth more
than a quarter of the budget would leave too little for exact tokens); tokens evicted before that are dropped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Callable, Union

import torch
from pydantic import BaseModel, Field, NonNegativeInt

from .base import Budget, StageSpec, spec_error
from .errors import SpecError
from .shape import ModelShape

if TYPE_CHECKING:  # pragma: no cover
    from .spec import StackSpec

#: the low-rank state is created once it costs at most this share of the layer's limit
STATE_SHARE = 0.25
#: token count at which a stack without a sizing stage is priced in a refusal
PRICING_TOKENS = 4096


class BudgetError(SpecError):
    """The stack cannot keep its budget on this model and dtype (raised by ``kvstack.apply``), or a layer holds more
    than its budget with nothing left to remove (a bug: reported, never silently overshot)."""


def reference_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """One uncompressed token of one layer and batch row: keys + values of every KV head in ``dtype``."""
    return shape.num_kv_heads * (shape.head_dim + shape.value_dim) * torch.empty((), dtype=dtype).element_size()


def promise(spec: "StackSpec") -> tuple[Budget, StageSpec] | None:
    """(the budget the whole cache keeps, the stage that keeps it), or None for a stack without a budget.

    The stack's ``budget`` is the promise; without one, the own budget of its sizing stage. The last sizing stage
    keeps it (it acts last). A budget with no sizing stage has no keeper: ``check_budget`` refuses it.
    """
    sizing = [s for s in spec.stages if s.keeps_budget()]
    owner = sizing[-1] if sizing else None
    budget = spec.budget or (owner.effective_budget(None) if owner is not None else None)
    if budget is None:
        return None
    return budget, owner


#: a layer's share of the budget relative to the mean: a number, or a function of the tokens seen (``spill_unused``)
Share = Union[float, Callable[[int], float]]


class LayerWeights(BaseModel):
    """Spec fields of the stages that size what they keep to a budget (``evict``, ``quantized_prune``): how the
    stack's bytes are shared between layers: on SmolLM2 a third of the layers read a planted needle, and giving them
    the bytes the others can spare is what lets an eighth of the cache find most needles (docs/budgets.md, "Layer
    weights"). List this class before ``StageSpec`` in the stage's bases; a stage with ``spill_unused`` implements
    ``layer_need``."""

    layer_weights: dict[NonNegativeInt, Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(
        default=None,
        description="{layer index: weight}: a listed layer gets weight x the budget of an unlisted one (weight 1), "
        "the shares scaled so that all layers together hold the stack's budget (e.g. the layers that retrieve: "
        "python -m kvstack.bench.retrieval_layers).",
    )
    spill_unused: bool = Field(
        default=False,
        description="a layer's share beyond what it can use after the tokens seen so far (every one of them kept, "
        "the protected ones at full precision) goes to the other layers in proportion to their shares; the shares "
        "still sum to the stack's budget at every length.",
    )

    def weighted_scale(self, layer_idx: int, shape: ModelShape, base: Callable[[int], float]) -> float:
        """Layer ``layer_idx``'s share of the budget relative to the mean: ``base(i)`` (the stage's own per-layer
        share, 1 for a uniform one) times its weight, normalised so the shares of all layers sum to their number."""
        weights = self.layer_weights or {}
        n = shape.num_layers
        raw = [weights.get(i, 1.0) * base(i) for i in range(n)]
        return raw[layer_idx] * n / sum(raw)

    def layer_share(self, layer_idx: int, shape: ModelShape, dtype: torch.dtype, budget: Budget | None,
                    reference: ModelShape | None = None) -> Share:
        """The share a ``LayerPromise`` of layer ``layer_idx`` scales the budget by: ``layer_scale``, or with
        ``spill_unused`` that share capped at the layer's ``layer_need`` after the tokens seen, the rest spilled."""
        if not self.spill_unused or budget is None:
            return self.layer_scale(layer_idx, shape)
        # one water-filling per stage, model and dtype, shared by the layers and the stage's sizing (a private
        # attribute would make equal specs compare unequal)
        key = (type(self), self.model_dump_json(), shape, dtype, budget.ratio, budget.tokens, reference or shape)
        if key not in _SPILLS:
            if len(_SPILLS) > 64:
                _SPILLS.clear()
            n = shape.num_layers
            _SPILLS[key] = SpilledShares(
                [self.layer_scale(i, shape) for i in range(n)],
                [self.layer_need(i, shape, dtype, budget, reference) for i in range(n)],
                budget, reference_bytes_per_token(reference or shape, dtype),
            )
        return _SPILLS[key].of(layer_idx)

    def layer_need(self, layer_idx: int, shape: ModelShape, dtype: torch.dtype, budget: Budget,
                   reference: ModelShape | None) -> Callable[[int], int]:
        """Bytes per batch row layer ``layer_idx`` can use after ``seen`` tokens: every one kept (the stage's own)."""
        raise NotImplementedError(f"{type(self).__name__} does not support spill_unused")

    def check_layer_weights(self, shape: ModelShape) -> None:
        check_layer_indices("layer_weights", self.layer_weights, shape)


_SPILLS: dict[tuple, "SpilledShares"] = {}


class SpilledShares:
    """Water-filling: after ``seen`` tokens each layer gets its share ``scales[i]`` of the mean budget, except that
    no layer gets more than it can use (``needs[i](seen)`` bytes); what is left over goes to the layers below their
    need, in proportion to their shares, until none is left or every layer has what it can use. The shares never sum
    to more than ``sum(scales)`` (the number of layers), so the whole cache keeps the budget at every length."""

    def __init__(self, scales: list[float], needs: list[Callable[[int], int]], budget: Budget, reference: int):
        self.scales, self.needs, self.budget, self.reference = scales, needs, budget, reference
        self._memo: dict[int, list[float]] = {}

    def of(self, layer_idx: int) -> Callable[[int], float]:
        return lambda seen: self.at(seen)[layer_idx]

    def at(self, seen: int) -> list[float]:
        if seen not in self._memo:
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[seen] = self._fill(seen)
        return self._memo[seen]

    def _fill(self, seen: int) -> list[float]:
        mean = self.budget.limit_bytes(seen, self.reference)
        if mean <= 0:
            return list(self.scales)
        caps = [need(seen) / mean for need in self.needs]
        shares = [0.0] * len(self.scales)
        open_ = set(range(len(self.scales)))
        left = float(sum(self.scales))
        while open_:
            weight = sum(self.scales[i] for i in open_)
            full = {i for i in open_ if left * self.scales[i] / weight >= caps[i]}
            if not full:
                for i in open_:
                    shares[i] = left * self.scales[i] / weight
                break
            for i in full:
                shares[i] = caps[i]
                left -= caps[i]
            open_ -= full
        return shares


def check_layer_indices(field: str, per_layer: dict[int, object] | None, shape: ModelShape) -> None:
    """Refuse a ``{layer index: ...}`` field that names a layer past the model's, by name."""
    if per_layer and max(per_layer) >= shape.num_layers:
        raise spec_error(field, per_layer,
                         f"layer indices 0..{shape.num_layers - 1} (the model has {shape.num_layers} layers)")


class LayerPromise:
    """The limit of one layer: ``scale * budget`` (the owner's share of the layer, ``layer_share``) in bytes per batch
    row."""

    __slots__ = ("budget", "scale", "reference")

    def __init__(self, budget: Budget, scale: Share, reference: int) -> None:
        self.budget, self.scale, self.reference = budget, scale, reference

    def share(self, seen: int) -> float:
        return self.scale(seen) if callable(self.scale) else self.scale

    def limit(self, seen: int) -> int:
        return int(self.share(seen) * self.budget.limit_bytes(seen, self.reference) + 1e-9)


def check_budget(spec: "StackSpec", shape: ModelShape, dtype: torch.dtype, reference: ModelShape | None = None) -> None:
    """Raise :class:`BudgetError` if ``spec`` cannot keep its budget on a model of ``shape`` in ``dtype``: no stage
    keeps it (the message prices what the stack holds and why), or the low-rank state alone exceeds its share of a
    ``tokens`` budget (it would never be created)."""
    held = promise(spec)
    if held is None:
        return
    budget, owner = held
    reference = reference or shape
    ref_token = reference_bytes_per_token(reference, dtype)
    where = f"budget {{{budget.describe()}}} on this model in {str(dtype).removeprefix('torch.')}"
    if owner is None:
        n = PRICING_TOKENS
        plan = spec.memory_plan(shape, n, dtype=dtype)
        full = reference.num_layers * n * ref_token
        why = ", ".join(f"{name} {nbytes / full:.3f}" for name, nbytes in plan.report().items())
        reach = f"{plan.bytes / full:.3f} of the full cache at {n} tokens ({why})"
        if budget.tokens is not None:
            reach += " and grows with every token"
        raise BudgetError(
            f"{where}: none of the stages of {spec.name!r} sizes what it keeps to a budget (evict, quantized_prune with tiers), so "
            f"nothing keeps it: the stack holds {reach}. Add an evict or quantized_prune stage, or drop the budget"
        )
    plan = spec.memory_plan(shape, 1, dtype=dtype)
    state = max((layer.state_bytes for layer in plan.layers), default=0)
    if state and budget.tokens is not None:
        scale = min(owner.layer_scale(i, shape) for i in range(shape.num_layers))
        limit = LayerPromise(budget, scale, ref_token).limit(0)
        if state > STATE_SHARE * limit:
            need = math.ceil(state / (STATE_SHARE * scale * ref_token))
            raise BudgetError(
                f"{where}: the low-rank state costs {state} bytes per layer, more than {STATE_SHARE:.0%} of the "
                f"{limit} bytes a layer may hold, so it would never be created; raise budget.tokens to at least "
                f"{need}, or lower the lowrank rank"
            )

