"""Memory accounting: actual bytes of real appends vs. the spec's analytic bound (hypothesis)."""

from __future__ import annotations

import torch
from archs import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstack
from kvstack.stack.memory import full_cache_bytes

MODELS = {arch: tiny_model(arch) for arch in ("llama", "gemma3")}


@st.composite
def evict_specs(draw):
    n_sink = draw(st.integers(0, 4))
    recent = draw(st.integers(0, 4))
    if draw(st.booleans()):
        budget = {"tokens": draw(st.integers(n_sink + recent + 1, 40))}
    else:
        budget = {"ratio": draw(st.sampled_from([0.125, 0.25, 0.5, 0.9]))}
    return {"budget": budget, "stages": [{"kind": "evict", "n_sink": n_sink, "recent": recent}]}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=evict_specs(),
    arch=st.sampled_from(sorted(MODELS)),
    batch=st.integers(1, 3),
    prefill=st.integers(1, 40),
    steps=st.integers(0, 12),
)
def test_actual_bytes_within_the_bound_for_window_eviction(spec, arch, batch, prefill, steps):
    model = MODELS[arch]
    spec = kvstack.StackSpec.load(spec)
    ids = torch.randint(3, 128, (batch, prefill + steps))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        model(ids[:, :prefill], cache=cache)
        budget = spec.budget
        for t in range(prefill, prefill + steps + 1):
            bound = spec.memory_bound(model.config, t, batch=batch, prefill_len=prefill)
            if budget.tokens is not None:
                assert cache.memory_bytes() == bound  # recency eviction to a token budget: the formula is exact
            else:
                # a ratio budget grows with the tokens seen, but evicted tokens never come back: a true upper bound
                assert cache.memory_bytes() <= bound
            if t < prefill + steps:
                model(ids[:, t : t + 1], cache=cache)
        seen = prefill + steps
        if budget.ratio is not None:
            # the kept tokens cost at most `ratio` of the uncompressed cache at the same tokens (once over sinks)
            protected_bytes = spec.memory_bound(model.config, spec.stages[0].n_sink + spec.stages[0].recent, batch)
            assert cache.memory_bytes() <= max(budget.ratio * full_cache_bytes(model.config, seen, batch), protected_bytes)


def test_full_cache_bytes_formula():
    model = MODELS["llama"]
    c = model.config
    assert full_cache_bytes(c, 100, batch=3) == c.num_hidden_layers * 3 * 100 * c.num_key_value_heads * 2 * 16 * 4
    assert full_cache_bytes(c, 100, dtype=torch.float16) * 2 == full_cache_bytes(c, 100)
