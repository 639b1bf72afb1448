"""Render the spec reference (docs/spec-reference.md) from the pydantic models, so it cannot drift from the code.

Regenerate with ``kvstack schema --format markdown --out docs/spec-reference.md``; a test compares the file with
what this module renders.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from .base import Budget
from .registry import stage_specs
from .spec import StackSpec


def _type_of(info: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in info:
        return info["$ref"].rsplit("/", 1)[-1]
    if "const" in info:
        return json.dumps(info["const"])
    if "enum" in info:
        return " \\| ".join(json.dumps(v) for v in info["enum"])
    if "anyOf" in info:
        return " \\| ".join(_type_of(i, defs) for i in info["anyOf"])
    if "oneOf" in info:
        return " \\| ".join(_type_of(i, defs) for i in info["oneOf"])
    if info.get("type") == "array":
        return f"list[{_type_of(info.get('items', {}), defs)}]"
    return str(info.get("type", "any"))


def _bounds(info: dict[str, Any]) -> str:
    parts = []
    for key, sym in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in info:
            parts.append(f"{sym} {info[key]}")
    for alt in info.get("anyOf", []):
        part = _bounds(alt)
        if part:
            parts.append(part)
    return ", ".join(parts)


def model_table(model: type[BaseModel] | dict[str, Any]) -> str:
    """The fields of a model (or of one model's JSON schema, as a ``$defs`` entry gives it) as a markdown table."""
    schema = model if isinstance(model, dict) else model.model_json_schema()
    defs = schema.get("$defs", {})
    required = set(schema.get("required", []))
    rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, info in schema.get("properties", {}).items():
        default = "required" if name in required else json.dumps(info.get("default")) if "default" in info else ""
        bounds = _bounds(info)
        kind = _type_of(info, defs) + (f" ({bounds})" if bounds else "")
        description = (info.get("description") or "").replace("\n", " ")
        rows.append(f"| `{name}` | {kind} | {default} | {description} |")
    return "\n".join(rows)


def render() -> str:
    out = [
        "# Stack spec reference",
        "",
        "Generated from the pydantic models by `kvstack schema --format markdown` — do not edit by hand.",
        "Every object rejects unknown fields. `kvstack schema` prints the JSON schema for editor validation.",
        "",
        "## StackSpec",
        "",
        (StackSpec.__doc__ or "").strip(),
        "",
        model_table(StackSpec),
        "",
        "## Budget",
        "",
        " ".join((Budget.__doc__ or "").split()),
        "",
        model_table(Budget),
    ]
    documented = {"Budget"}
    for kind, spec in stage_specs().items():
        doc = " ".join((spec.__doc__ or "").split())
        out += ["", f"## Stage `kind: {kind}`", "", doc, "", model_table(spec)]
        for name, nested in spec.model_json_schema().get("$defs", {}).items():
            if name not in documented and "properties" in nested:  # an object a field holds, e.g. a tier
                documented.add(name)
                out += ["", f"### `{name}`", "", " ".join(nested.get("description", "").split()), "",
                        model_table(nested)]
    return "\n".join(out + scorer_sections()) + "\n"


def scorer_sections() -> list[str]:
    """A section per scorer: what it scores (the first line of its module's docstring) and its ``Params``."""
    import sys

    from kvstack.stages.scorers import get_scorer, scorer_names

    out = [
        "", "## Scorers", "",
        "The `scorer` of `evict` and `quantized_prune`, and its parameters, given in `scorer_params` (the form "
        "`kvstack show` prints) or as keys next to `scorer` that are not fields of the stage. A parameter the "
        "scorer does not have is an error.",
    ]
    for name in scorer_names():
        scorer = get_scorer(name)
        doc = scorer.__dict__.get("__doc__") or sys.modules[scorer.__module__].__doc__ or ""
        out += ["", f"### `scorer: {name}`", "", doc.strip().split("\n")[0], ""]
        out.append(model_table(scorer.Params) if scorer.Params.model_fields else "No parameters.")
    return out
