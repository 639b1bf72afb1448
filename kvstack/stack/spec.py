"""The typed stack spec: which stages, in which order, under which budget.

``StackSpec`` is a pydantic v2 model whose ``stages`` field is a discriminated union (on ``kind``) of every registered
stage spec, so ``StackSpec.model_json_schema()`` describes every preset file an editor may validate.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from .base import Budget, StageSpec
from .errors import FIELD_ERRORS, SpecError, did_you_mean
from .memory import MemoryPlan
from .registry import on_change, stage_specs
from .shape import ModelShape

PRESET_PACKAGE = "kvstack.presets"


def _stage_union() -> Any:
    specs = tuple(stage_specs().values())
    if len(specs) == 1:
        return specs[0]
    return Annotated[Union[specs], Field(discriminator="kind")]  # noqa: UP007 (runtime-built union)


class StackSpec(BaseModel):
    """A composition of compression stages, applied to a model with ``kvstack.apply(model, spec)``."""

    model_config = ConfigDict(extra="forbid", title="kvstack stack spec", validate_assignment=True)

    name: str = Field(default="custom", description="Short name of the stack (a preset's file name).")
    description: str = Field(default="", description="One line: what this stack does.")
    reference: str | None = Field(default=None, description="The paper(s) the stack follows.")
    budget: Budget | None = Field(
        default=None, description="Stack-wide budget used by every stage that takes one and does not set its own."
    )
    stages: list[_stage_union()] = Field(  # type: ignore[valid-type]
        default_factory=list, description="Stages in the order they act (an empty list is the identity)."
    )
    prefill_chunk: int | None = Field(
        default=None,
        ge=1,
        description="Prefill prompts longer than this in pieces of this many tokens; the stages compress after "
        "each piece, so peak memory stays bounded (results may differ: docs/long-context.md).",
    )

    @field_validator("name", "description")
    @classmethod
    def _one_printable_line(cls, value: str) -> str:
        # a YAML reader takes some non-printable characters (NEL, U+2028) for line breaks: the spec would not
        # read back as written
        if not value.isprintable():
            raise ValueError("one line of printable characters")
        return value

    @model_validator(mode="after")
    def _stages_fit_budget(self) -> "StackSpec":
        for i, stage in enumerate(self.stages):
            try:
                stage.validate_with(self.budget)
                stage.validate_in_stack(i, self.stages)
            except SpecError as err:
                raise ValueError(f"stages.{i} ({stage.kind}): {err}") from None
        return self

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(cls, source: "StackSpec | dict | str | Path") -> "StackSpec":
        """From a spec, a dict, a preset name, a YAML file path, or YAML text."""
        if isinstance(source, StackSpec):
            return source
        if isinstance(source, dict):
            return cls._validate(source, "dict")
        if isinstance(source, Path):
            return cls._from_yaml_file(source)
        if not isinstance(source, str):
            raise SpecError(
                f"preset={source!r} is not allowed: pass a StackSpec, a dict, a preset name, a YAML path or YAML text"
            )
        presets = preset_names()
        if source in presets:
            text = resources.files(PRESET_PACKAGE).joinpath(f"{source}.yaml").read_text()
            return cls.from_yaml(text, origin=f"preset {source!r}")
        if "\n" in source or ": " in source:
            return cls.from_yaml(source)
        if source.endswith((".yaml", ".yml")) or Path(source).is_file():
            return cls._from_yaml_file(Path(source))
        raise SpecError(f"unknown preset {source!r}{did_you_mean(source, presets)}; available presets: {', '.join(presets)}")

    @classmethod
    def _from_yaml_file(cls, path: Path) -> "StackSpec":
        if not path.is_file():
            raise SpecError(f"stack file {str(path)!r} does not exist")
        return cls.from_yaml(path.read_text(), origin=str(path))

    @classmethod
    def from_yaml(cls, text: str, origin: str = "YAML text") -> "StackSpec":
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            raise SpecError(f"invalid YAML in {origin}{where}: {problem}") from None
        if not isinstance(data, dict):
            raise SpecError(f"{origin} must be a mapping with keys name/description/budget/stages, got {data!r}")
        return cls._validate(data, origin)

    @classmethod
    def _validate(cls, data: dict, origin: str) -> "StackSpec":
        _check_stage_kinds(data, origin)
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise SpecError(f"invalid stack spec in {origin}:\n" + describe_errors(err)) from None

    def with_overrides(self, **overrides: Any) -> "StackSpec":
        """A copy with fields replaced, validated like YAML: spec fields (``budget``, ``prefill_chunk``, ``name``,
        ...) by name, and any other name on every stage that declares it (``n_sink=8``, ``bits=2``, a scorer's
        ``window=16``); a name no stage declares is an error. ``budget`` also takes a number: a ratio if < 1 (or a
        float), tokens if an int."""
        data = self.model_dump(mode="json", exclude_none=True)
        origin = f"{self.name!r} with overrides {', '.join(sorted(overrides))}"
        budget = overrides.pop("budget", None)
        if budget is not None:
            if isinstance(budget, Budget):
                budget = budget.model_dump(exclude_none=True)
            elif isinstance(budget, bool) or not isinstance(budget, (int, float, dict)):
                raise SpecError(f"budget={budget!r} is not allowed: a dict ({{'ratio': r}} or {{'tokens': n}}), "
                                "a Budget, a float ratio in (0, 1] or an int number of tokens")
            elif isinstance(budget, float):
                budget = {"ratio": budget}
            elif isinstance(budget, int):
                budget = {"tokens": budget}
            data["budget"] = budget
        staged = {}
        for name, value in overrides.items():
            if name in StackSpec.model_fields:
                data[name] = value
            else:
                staged[name] = value
        taken = set()
        for stage, dumped in zip(self.stages, data.get("stages", [])):
            taken |= stage.apply_overrides(dumped, staged)
        for name, value in staged.items():
            if name not in taken:
                known = sorted({n for st in self.stages for n in st.override_names()} | set(StackSpec.model_fields))
                raise SpecError(
                    f"{name}={value!r} is not allowed: no stage of {self.name!r} has a field or scorer "
                    f"parameter {name!r}"
                    f"{did_you_mean(name, known)}; fields: {', '.join(known)}"
                )
        return StackSpec._validate(data, origin)

    def to_yaml(self) -> str:
        """The spec as YAML, every acting default spelled out (options the stage's scorer does not read are left
        out: they would not change anything)."""
        data = self.model_dump(mode="json", exclude_none=True)
        for stage, dumped in zip(self.stages, data.get("stages", [])):
            for name in stage.inactive_options():
                dumped.pop(name, None)
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)

    # ---------------------------------------------------------------- checking
    def validate_for(self, shape: ModelShape) -> None:
        """Raise :class:`SpecError` if any stage cannot run on a model of this shape."""
        for i, stage in enumerate(self.stages):
            try:
                stage.validate_for(shape, self.budget)
            except SpecError as err:
                raise SpecError(f"stages.{i} ({stage.kind}): {err}") from None

    @property
    def model_stages(self) -> list[StageSpec]:
        return [s for s in self.stages if s.modifies_model]

    def chunk_size(self) -> int | None:
        """Tokens per prefill forward: the smallest of the stack's ``prefill_chunk`` and any stage's own."""
        chunks = [c for c in (self.prefill_chunk, *(s.prefill_chunk() for s in self.stages)) if c]
        return min(chunks) if chunks else None

    # ------------------------------------------------------------------ memory
    def memory_plan(self, config_or_shape, seq_len: int, batch: int = 1, dtype=None, prefill_len=None) -> MemoryPlan:
        shape = config_or_shape if isinstance(config_or_shape, ModelShape) else ModelShape.from_config(config_or_shape)
        plan = MemoryPlan.uncompressed(shape, seq_len, batch, dtype, prefill_len)
        for stage in self.stages:
            stage.plan_memory(plan, self.budget)
        return plan

    def memory_bound(self, config_or_shape, seq_len: int, batch: int = 1, dtype=None, prefill_len=None) -> int:
        """Analytic upper bound on ``cache.memory_bytes()`` after ``seq_len`` tokens (all stages composed), the first
        ``prefill_len`` of them (default: all) in one forward and the rest one token per forward: the stages' plan,
        and never more than the budget the stack promises (docs/budgets.md)."""
        from .budget import LayerPromise, promise, reference_bytes_per_token

        plan = self.memory_plan(config_or_shape, seq_len, batch, dtype, prefill_len)
        held = promise(self)
        if held is None or held[1] is None:
            return plan.bytes
        (budget, keeper), n = held, plan.shape.num_layers
        ref = reference_bytes_per_token(plan.shape, plan.dtype)
        limit = sum(LayerPromise(budget, keeper.layer_share(i, plan.shape, plan.dtype, budget), ref).limit(seq_len)
                    for i in range(n))
        return min(plan.bytes, batch * limit)


def _refresh_stage_union() -> None:
    """A stage kind was registered (or removed) after import: rebuild the ``stages`` field's discriminated union."""
    field = StackSpec.model_fields["stages"]
    StackSpec.model_fields["stages"] = FieldInfo.merge_field_infos(field, annotation=list[_stage_union()])
    StackSpec.model_rebuild(force=True)


on_change(_refresh_stage_union)


def _check_stage_kinds(data: dict, origin: str) -> None:
    """A stage without ``kind`` or with an unknown one, named by its index, before pydantic's discriminator speaks."""
    stages = data.get("stages")
    if not isinstance(stages, list):
        return
    kinds = list(stage_specs())
    allowed = ", ".join(repr(k) for k in kinds)
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict):
            continue
        if "kind" not in stage:
            raise SpecError(f"invalid stack spec in {origin}: stages.{i} has no 'kind'; allowed kinds: {allowed}")
        if stage["kind"] not in kinds:
            raise SpecError(
                f"invalid stack spec in {origin}: stages.{i}.kind={stage['kind']!r} is not a stage kind"
                f"{did_you_mean(stage['kind'], kinds)}; allowed kinds: {allowed}"
            )


def describe_errors(err: ValidationError) -> str:
    """One line per error: the field's path, what is wrong, the value (whole-spec checks name their own field)."""
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"]:  # a whole-spec check: its message starts with the field it is about
            lines.append(f"  {msg}")
            continue
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == FIELD_ERRORS:  # a model check naming its fields (the values are in the messages)
            lines += [f"  {loc}.{path}: {text}" for path, text in e["ctx"]["lines"]]
            continue
        lines.append(f"  {loc}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def preset_names() -> list[str]:
    root = resources.files(PRESET_PACKAGE)
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def list_presets() -> dict[str, str]:
    """Preset name -> one-line description."""
    return {name: StackSpec.load(name).description for name in preset_names()}
