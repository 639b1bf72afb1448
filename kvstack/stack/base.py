"""What a stage is: a typed spec (validated, serialisable) and the behaviour it contributes to each cache layer.

A stage file in ``kvstack/stages/`` defines a ``StageSpec`` subclass with a unique ``kind`` literal, decorates it with
``@register_stage``, and implements whichever hooks it needs. The stack calls them in spec order:

* ``validate_with(budget)``, ``validate_in_stack(position, stages)`` — when the spec is loaded.
* ``validate_for(shape)`` — before anything is touched; raise :class:`SpecError` naming the model's dimension.
* ``prepare_model(model, calibration)`` — ``modifies_model`` stages only (GQA conversion, static channel pruning, a
  calibrated key basis).
* ``plan_memory(plan)`` — transform the analytic :class:`MemoryPlan` (the bound property tests check).
* ``build(shape)`` -> :class:`Stage` — the runtime object shared by all layers of one cache.

Runtime hooks of :class:`Stage` (per layer): ``init_layer`` (add tiers/state), ``attention_request`` (ask the
attention function for per-key statistics) and ``after_attention`` (compress: evict, demote, fold).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .cache import StackLayer
    from .memory import MemoryPlan
    from .shape import ModelShape
    from .stats import AttentionStats, StatsRequest


class Budget(BaseModel):
    """How much memory a layer may hold, as a promise (docs/budgets.md): ``tokens: n`` — the bytes of ``n``
    uncompressed tokens per layer (keys + values of every KV head in the model's dtype), and with even per-layer
    shares never more than ``n`` tokens per KV head (a pyramid schedule, per-layer bits or ``layer_weights`` let a
    layer hold more, the others less); ``ratio: r`` — ``r`` times the bytes of the uncompressed cache of the tokens
    seen. Every tensor the cache holds counts (codes, scales, zero points, positions, records, state)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tokens: int | None = Field(
        default=None, ge=1, description="The memory of this many uncompressed tokens per layer on average (with even "
        "per-layer shares, at most that many tokens per KV head)."
    )
    ratio: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Memory ratio of the full cache at the same token count."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "Budget":
        if (self.tokens is None) == (self.ratio is None):
            raise ValueError(
                f"budget must set exactly one of 'tokens' (int >= 1) or 'ratio' (0 < r <= 1); "
                f"got tokens={self.tokens}, ratio={self.ratio}"
            )
        return self

    def limit_bytes(self, seen: int, reference_bytes_per_token: int) -> int:
        """Bytes one layer of one batch row may hold after ``seen`` tokens (``reference_bytes_per_token``: one
        uncompressed token of that layer: keys + values of every KV head in the model's dtype)."""
        if self.tokens is not None:
            return self.tokens * reference_bytes_per_token
        return int(self.ratio * seen * reference_bytes_per_token + 1e-9)

    def describe(self) -> str:
        return f"tokens: {self.tokens}" if self.tokens is not None else f"ratio: {self.ratio:g}"


class StageSpec(BaseModel):
    """Base of every stage spec. Subclasses declare ``kind: Literal["..."]`` and their parameters. Assignments are
    validated like loading (``spec.stages[0].n_sink = -3`` raises)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    kind: str
    #: stages that prepare the model in ``kvstack.apply`` (``prepare_model``): surgery on its weights/config, or a
    #: per-model tensor fitted on calibration text (a calibrated key basis)
    modifies_model: ClassVar[bool] = False

    def inactive_options(self) -> set[str]:
        """Fields that do not act with this stage's other settings (``kvstack show`` leaves them out)."""
        return set()

    def override_names(self) -> set[str]:
        """Names ``StackSpec.with_overrides`` sets on this stage: its fields (a stage with a scorer adds the
        scorer's parameters)."""
        return set(type(self).model_fields)

    def apply_overrides(self, dumped: dict, overrides: dict) -> set[str]:
        """Write the ``overrides`` this stage takes into its ``model_dump`` form (``StackSpec.with_overrides``
        validates the result like YAML); returns the names it took."""
        taken = self.override_names() & set(overrides)
        dumped.update({name: overrides[name] for name in taken})
        return taken

    def prefill_chunk(self) -> int | None:
        """Longest prompt piece this stage wants per forward (None: any). ``kvstack.apply`` splits longer
        forwards into pieces so the stage can compress between them and peak memory stays bounded."""
        return None

    def keeps_budget(self) -> bool:
        """True for stages that size what they keep to a budget, in bytes (evict, quantized_prune with tiers): one
        of them keeps the stack's promise (its runtime ``Stage.fit``; docs/budgets.md)."""
        return False

    def effective_budget(self, stack_budget: Budget | None) -> Budget | None:
        """The budget this stage sizes itself to (its own, else the stack's)."""
        return None

    def layer_scale(self, layer_idx: int, shape: "ModelShape") -> float:
        """Share of the budget layer ``layer_idx`` of a model of ``shape`` gets, relative to the mean (1.0; a pyramid
        schedule or per-layer bits vary it; the shares of all layers sum to the number of layers)."""
        return 1.0

    def layer_share(self, layer_idx: int, shape: "ModelShape", dtype: torch.dtype, budget: Budget | None,
                    reference: "ModelShape | None" = None) -> "float | Callable[[int], float]":
        """The share a layer's promise scales the budget by: ``layer_scale``, or a function of the tokens seen
        (``LayerWeights.spill_unused``)."""
        return self.layer_scale(layer_idx, shape)

    def validate_with(self, stack_budget: Budget | None) -> None:
        """Checks that need the stack-wide budget but no model (run when the spec is loaded)."""

    def validate_in_stack(self, position: int, stages: "list[StageSpec]") -> None:
        """Checks against the other stages of the stack (this one is ``stages[position]``), run when the spec is
        loaded."""

    def validate_for(self, shape: "ModelShape", stack_budget: Budget | None) -> None:
        """Raise :class:`SpecError` if this stage cannot run on a model of this shape."""

    def prepare_model(self, model: Any, calibration: Any = None) -> "Callable[[], None] | None":
        """Model surgery or calibration (only for ``modifies_model`` stages). Return a callable that undoes it:
        ``kvstack.remove`` and a failed ``kvstack.apply`` call it so the model is never left half-patched."""
        return None

    def plan_memory(self, plan: "MemoryPlan", stack_budget: Budget | None) -> None:
        """Transform the analytic plan to what this stage guarantees."""

    def build(self, shape: "ModelShape", stack_budget: Budget | None) -> "Stage | None":
        """Runtime behaviour for one cache; None for stages that act only on the model."""
        return None


class Stage:
    """Runtime behaviour of one stage inside one cache (shared by its layers; per-layer data lives on the layer)."""

    def __init__(self, spec: StageSpec, shape: "ModelShape", stack_budget: Budget | None):
        self.spec = spec
        self.shape = shape
        self.stack_budget = stack_budget

    def init_layer(self, layer: "StackLayer") -> None:
        """Called once per layer when the cache is created: add tiers, state, per-layer bookkeeping."""

    def attention_request(self, layer: "StackLayer", query_length: int) -> "StatsRequest | None":
        """Statistics this stage needs from the attention of the current forward (None: none)."""
        return None

    def after_attention(self, layer: "StackLayer", stats: "AttentionStats") -> None:
        """Compress the layer after its attention ran (the only place tokens may leave a tier)."""

    def fit(self, layer: "StackLayer", stats: "AttentionStats", limit: int) -> None:
        """Stages that ``keeps_budget``: keep fewer of their best tokens until ``layer.memory_bytes() <= limit`` (the
        stack's promise; called after every stage's ``after_attention`` when the layer holds more). The first step
        drops what the excess costs at the dearest tier's price; it doubles when freed slots freed no bytes
        (quantized groups keep holes until they merge)."""
        drop, before = 0, None
        while layer.memory_bytes() > limit:
            kept = int(layer.kept_counts().max())
            if kept == 0 or kept == before:  # nothing left, or nothing more this stage can remove
                return
            before = kept
            per_token = max(t.bytes_per_token() for t in layer.tiers if t.num_tokens) * layer.full.keys.shape[0]
            drop = max(-(-(layer.memory_bytes() - limit) // int(per_token)), 2 * drop, 1)
            self.keep_at_most(layer, stats, max(kept - drop, 0))

    def keep_at_most(self, layer: "StackLayer", stats: "AttentionStats", cap: int) -> None:
        """Stages that ``keeps_budget``: keep at most ``cap`` tokens per (row, KV head), the best by the stage's
        ranking (what ``fit`` shrinks with)."""
        raise NotImplementedError(f"{type(self).__name__} does not size itself to a budget")


def spec_error(field: str, value: Any, allowed: str) -> SpecError:
    """A uniform message: which field, what it was, what is allowed."""
    return SpecError(f"{field}={value!r} is not allowed: {allowed}")
