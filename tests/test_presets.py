"""Every shipped preset validates, applies to the real model, generates, and stays within its memory bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstack
from kvstack.stack import spec_doc
from kvstack.stages.quantized_prune import PrecisionTier

PRESETS = kvstack.preset_names()
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_applies_generates_and_respects_its_bound(name, real_model_and_tokenizer):
    model, tokenizer = real_model_and_tokenizer
    spec = kvstack.StackSpec.load(name)
    assert spec.name == name and spec.description
    if name != "identity":
        assert spec.reference, f"preset {name} must name the paper it follows"
    calibration = None
    if spec.model_stages:
        from kvstack.bench.protocol import load_passages

        calibration = [torch.tensor(tokenizer(t)["input_ids"][:128]) for t in load_passages(n=40)[32:36]]
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with kvstack.applied(model, spec, calibration=calibration):
        cache = kvstack.cache_for(model)
        out = model.generate(**inputs, max_new_tokens=160, min_new_tokens=160, do_sample=False, cache=cache)
        seen = cache.get_seq_length()
        assert out.shape[1] == inputs.input_ids.shape[1] + 160 and seen == out.shape[1] - 1
        bound = spec.memory_bound(model.config, seen, prefill_len=inputs.input_ids.shape[1])
        assert cache.memory_bytes() <= bound
    assert tokenizer.decode(out[0]).strip()


def test_spec_reference_is_current():
    """docs/spec-reference.md is generated from the code: regenerate with
    `kvstack schema --format markdown --out docs/spec-reference.md`."""
    assert (REPO / "docs" / "spec-reference.md").read_text() == spec_doc.render()


def test_spec_reference_documents_nested_objects():
    """Objects a stage field holds (a tier of `tiers`) get their own table, with every field, once."""
    text = spec_doc.render()
    section = text.split("### `PrecisionTier`", 1)[1].split("\n## ", 1)[0]
    for field in PrecisionTier.model_fields:
        assert f"| `{field}` |" in section
    assert text.count("### `PrecisionTier`") == 1 and "### `Budget`" not in text
