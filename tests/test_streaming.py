"""StreamingLLM through the evict stage: exact kept sets, exact bytes, constant memory."""

from __future__ import annotations

import torch
from archs import tiny_model

import kvstack


def streaming(window: int, n_sink: int = 4) -> dict:
    """Sinks + a recent window: a budget of one token more, whose bytes pay the kept tokens' int32 positions."""
    budget = {"tokens": n_sink + window + 1}
    return {"name": "s", "budget": budget, "stages": [{"kind": "evict", "n_sink": n_sink}]}


def test_keeps_exactly_sinks_and_window_after_every_step():
    torch.manual_seed(0)
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(streaming(window=12))
    kvstack.apply(model, spec)
    cache = kvstack.cache_for(model)
    ids = torch.randint(3, 128, (2, 70))
    model(ids[:, :30], cache=cache)
    for t in range(30, 70):
        seen = cache.get_seq_length()
        for layer in cache.layers:
            pos = layer.full.positions
            expected = list(range(4)) + list(range(seen - 12, seen))
            assert pos.shape[1] == 1  # recency is the same for every head: one position row
            for row in range(2):
                assert pos[row, 0].tolist() == expected
            assert layer.kept_counts().tolist() == [[16, 16], [16, 16]]
        assert cache.memory_bytes() == spec.memory_bound(model.config, seen, batch=2)
        model(ids[:, t : t + 1], cache=cache)
    kvstack.remove(model)


def test_streaming_keeps_what_attention_needs_at_prefill():
    """Eviction happens after attention: the prompt's queries see the whole prompt, so the prefill logits equal the
    identity stack's."""
    torch.manual_seed(1)
    model = tiny_model("qwen2", dtype=torch.float64)
    ids = torch.randint(3, 128, (1, 40))
    with kvstack.applied(model, "identity"):
        full = model(ids, cache=kvstack.cache_for(model)).logits
    with kvstack.applied(model, streaming(window=8)):
        cache = kvstack.cache_for(model)
        compressed = model(ids, cache=cache).logits
        assert cache.get_seq_length() == 40
        assert int(cache.layers[0].kept_counts().max()) == 12
    assert torch.allclose(full, compressed, atol=1e-12)


def test_memory_constant_over_2000_generated_tokens():
    torch.manual_seed(2)
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(streaming(window=60))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        ids = torch.randint(3, 128, (1, 8))
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2000, min_new_tokens=2000,
            do_sample=False,
        )
    assert out.shape[1] == 2008
    assert cache.get_seq_length() == 2007  # the last token generated is never fed back
    bound = spec.memory_bound(model.config, 64)
    assert cache.memory_bytes() == bound == spec.memory_bound(model.config, 2007)
    assert cache.memory_bytes() < kvstack.full_cache_bytes(model.config, 2007) / 25


def test_budget_at_least_tokens_seen_is_identity():
    torch.manual_seed(3)
    model = tiny_model("mistral", dtype=torch.float64, sliding_window=10_000)
    ids = torch.randint(3, 128, (1, 30))
    outs = []
    for spec in ("identity", streaming(window=40)):
        with kvstack.applied(model, spec):
            cache = kvstack.cache_for(model)
            logits = [model(ids[:, :10], cache=cache).logits]
            logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(10, 30)]
            outs.append(torch.cat(logits, 1))
    assert torch.equal(outs[0], outs[1])


def test_sliding_layers_drop_what_no_query_can_see():
    """Gemma3's sliding layers keep window-1 tokens (like transformers' sliding layer); full layers keep all."""
    torch.manual_seed(4)
    model = tiny_model("gemma3")
    with kvstack.applied(model, "identity"):
        cache = kvstack.cache_for(model)
        model(torch.randint(3, 128, (1, 30)), cache=cache)
        kept = [int(layer.kept_counts().max()) for layer in cache.layers]
        windows = [layer.window for layer in cache.layers]
    assert kept == [30 if w is None else w - 1 for w in windows]
    assert cache.memory_bytes() == kvstack.StackSpec.load("identity").memory_bound(model.config, 30)
