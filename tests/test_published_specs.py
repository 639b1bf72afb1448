"""Every spec the results docs measure (``docs/results/smollm2/specs/``) loads, validates on SmolLM2's shape and keeps
its budget there, so the commands beside the figures rerun as written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import kvstack
from kvstack.stack.budget import check_budget
from kvstack.stack.shape import ModelShape

SPECS = sorted((Path(__file__).resolve().parents[1] / "docs" / "results" / "smollm2" / "specs").glob("*.yaml"))

# SmolLM2-135M's attention (its GGUF's metadata): 30 layers, 9 query / 3 KV heads of 64 channels, RoPE base 1e5
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, vocab_size=49152)


def test_the_specs_are_found():
    assert len(SPECS) > 10


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_published_spec_loads_validates_and_keeps_its_budget(path):
    spec = kvstack.StackSpec.load(path)
    assert spec.name == path.stem and spec.description
    shape = ModelShape.from_config(SMOLLM2, torch.bfloat16)
    spec.validate_for(shape)
    check_budget(spec, shape, torch.bfloat16)
