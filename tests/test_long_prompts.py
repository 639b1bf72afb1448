"""Long prompts through a whole model: stack-level chunked prefill, the fast path in a model, and exactness."""

from __future__ import annotations

import pytest
import torch
from archs import tiny_model

import kvstack
from kvstack import SpecError, StackSpec
from kvstack.stack import engine


def _logits(model, ids, cache=None, **kw):
    with torch.no_grad():
        return model(ids, cache=cache, **kw).logits


def test_chunked_identity_prefill_reproduces_the_one_shot_logits():
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 128, (2, 45), generator=torch.Generator().manual_seed(0))
    plain = _logits(model, ids)
    with kvstack.applied(model, {"prefill_chunk": 8, "stages": []}):
        cache = kvstack.cache_for(model)
        chunked = _logits(model, ids, cache)
        assert cache.get_seq_length() == 45
    torch.testing.assert_close(chunked, plain, rtol=1e-10, atol=1e-10)


def test_chunked_prefill_bounds_what_a_compressing_stack_holds(monkeypatch):
    model = tiny_model("llama")
    held = []
    attend = engine.attend

    def spy(layer, query, *args, **kwargs):
        held.append(sum(t.num_tokens for t in layer.tiers))
        return attend(layer, query, *args, **kwargs)

    monkeypatch.setattr(engine, "attend", spy)
    spec = {"prefill_chunk": 16, "budget": {"tokens": 24}, "stages": [{"kind": "evict", "scorer": "h2o", "n_sink": 2}]}
    ids = torch.randint(3, 128, (1, 200))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        out = _logits(model, ids, cache, logits_to_keep=1)
    assert out.shape[1] == 1
    assert max(held) <= 24 + 16  # budget + one piece, never the whole prompt
    assert len(held) == model.config.num_hidden_layers * 13  # ceil(200 / 16) forwards per layer
    assert int(cache.layers[0].kept_counts().max()) == 22  # 24 tokens' bytes: positions and H2O scores per head


def test_stack_chunk_is_the_smallest_of_stack_and_stages():
    spec = StackSpec.load({"prefill_chunk": 64, "budget": {"tokens": 8},
                           "stages": [{"kind": "evict", "chunk_size": 32}]})
    assert spec.chunk_size() == 32
    assert StackSpec.load({"prefill_chunk": 16, "stages": []}).chunk_size() == 16
    assert StackSpec.load("identity").chunk_size() is None
    assert StackSpec.from_yaml(spec.to_yaml()) == spec
    with pytest.raises(SpecError, match="prefill_chunk"):
        StackSpec.load({"prefill_chunk": 0, "stages": []})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_prefill_takes_the_fast_path_exactly_once_per_layer_and_stays_exact(arch, monkeypatch):
    model = tiny_model(arch, dtype=torch.float64)
    calls = []
    sdpa = engine._sdpa
    monkeypatch.setattr(engine, "_sdpa", lambda *a: calls.append(1) or sdpa(*a))
    ids = torch.randint(3, 128, (1, 12))
    plain = _logits(model, ids)
    with kvstack.applied(model, "identity"):
        got = _logits(model, ids, kvstack.cache_for(model))
    tol = 1e-5 if arch == "gemma2" else 1e-10  # gemma2 runs eager attention, whose softmax is float32
    torch.testing.assert_close(got, plain, rtol=tol, atol=tol)
    softcapped = bool(getattr(model.config, "attn_logit_softcapping", None))
    assert len(calls) == (0 if softcapped else model.config.num_hidden_layers)  # softcap: SDPA cannot, tiled does
