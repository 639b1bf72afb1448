"""The stack's attention takes the fused Triton decode kernel when kernels are on (CUDA, or KVSTACK_KERNELS=triton
under TRITON_INTERPRET=1 here) and gives the same logits and the same eviction decisions as the torch path."""

from __future__ import annotations

import pytest
import torch
from archs import tiny_model

import kvstack
import kvstack.stack.engine as engine

STACKS = {
    "streaming": {"budget": {"tokens": 12}, "stages": [{"kind": "evict", "n_sink": 2}]},
    "h2o": {"budget": {"tokens": 12}, "stages": [{"kind": "evict", "scorer": "h2o", "n_sink": 2}]},
    "kivi-4": {"stages": [{"kind": "quantize", "bits": 4, "group_size": 8, "residual": 8}]},
    "recent-quantized-far-lowrank": {
        "budget": {"tokens": 20},
        "stages": [
            {"kind": "evict", "n_sink": 2},
            {"kind": "quantize", "bits": 4, "group_size": 8, "residual": 8},
            {"kind": "lowrank", "rank": 8},
        ],
    },
    "less": {
        "budget": {"tokens": 12},  # the state must fit a quarter of the budget (docs/budgets.md)
        "stages": [{"kind": "evict", "n_sink": 2}, {"kind": "lowrank", "rank": 4}],
    },
    "keys-4-values-2": {  # the kernel unpacks keys and values at their own bits
        "stages": [{
            "kind": "quantized_prune", "scorer": "window", "n_sink": 2, "group_size": 8,
            "tiers": [{"fraction": 0.25, "bits": 16}, {"rest": True, "bits": 2, "key_bits": 4}],
        }],
    },
}


def decode(model, spec, ids):
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        logits = [model(ids[:, :20], cache=cache).logits]
        logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(20, ids.shape[1])]
    kept = [tier.positions.clone() for layer in cache.layers for tier in layer.tiers if tier.num_tokens]
    return torch.cat(logits, 1), kept


@pytest.mark.parametrize("name", sorted(STACKS))
def test_fused_decode_matches_torch_path(name, monkeypatch):
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 28))
    calls = []
    original = engine.tiered_attention
    monkeypatch.setattr(engine, "tiered_attention", lambda *a, **k: calls.append(1) or original(*a, **k))

    monkeypatch.setenv("KVSTACK_KERNELS", "torch")
    reference, kept_ref = decode(model, STACKS[name], ids)
    assert not calls
    monkeypatch.setenv("KVSTACK_KERNELS", "triton")
    fused, kept = decode(model, STACKS[name], ids)
    assert len(calls) == 8 * model.config.num_hidden_layers  # every decode step, every layer; prefill is torch
    assert (fused - reference).abs().max().item() < 1e-4
    for a, b in zip(kept, kept_ref):
        assert torch.equal(a, b)
