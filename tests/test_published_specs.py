"""Every spec the results docs measure (``docs/results/smollm2/specs/``) loads, validates on SmolLM2's shape and keeps
its budget there, so the commands beside the figures rerun as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from archs import smollm2_shape

import kvstack
from kvstack.stack.budget import check_budget

SPECS = sorted((Path(__file__).resolve().parents[1] / "docs" / "results" / "smollm2" / "specs").glob("*.yaml"))


def test_the_specs_are_found():
    assert len(SPECS) > 10


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_published_spec_loads_validates_and_keeps_its_budget(path):
    spec = kvstack.StackSpec.load(path)
    assert spec.name == path.stem and spec.description
    shape = smollm2_shape()
    spec.validate_for(shape)
    check_budget(spec, shape, torch.bfloat16)


def test_every_spec_the_docs_name_is_published():
    """The docs name specs as ``$S/<name>.yaml`` in commands (``S=docs/results/smollm2/specs``) or by their path; each
    must exist, or a command beside a figure cannot be rerun."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *(root / "docs").glob("*.md")]
    named = {m for page in pages for m in re.findall(r"(?:\$S|smollm2/specs)/([\w.-]+\.yaml)", page.read_text())}
    assert len(named) > 10
    assert sorted(named - {path.name for path in SPECS}) == []
