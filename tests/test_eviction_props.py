"""Property: after any sequence of prefill/decode forwards (batch, left padding, every scorer, tokens or ratio budget,
token or block granularity, slack), the kept count per row and head equals the formula, and memory stays within the
spec's analytic bound and the budget."""

from __future__ import annotations

import math

import pytest
import torch
from archs import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstack

SCORERS = ["window", "key_norm", "value_key_ratio", "h2o", "tova", "snapkv", "obcache", "random"]
WINDOWED = ("snapkv", "obcache")  # scorers with an observation window (a parameter of theirs only)
HEAD_WISE_DEFAULT = {"key_norm": True, "h2o": True, "snapkv": True, "obcache": True}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def expected_cap(stage: dict, budget: dict, seen: int, cfg) -> int:
    """(cap, most held before compressing): the budget's bytes (tokens x or ratio x seen x an uncompressed token) over
    what one kept token costs, less the every slack; whole blocks. No protected floor: the budget wins."""
    heads, dim = cfg.num_key_value_heads, cfg.head_dim
    reference = heads * 2 * dim * 4
    head_wise = stage.get("head_wise", HEAD_WISE_DEFAULT.get(stage["scorer"], False))
    own = reference + 4 * (heads if head_wise else 1) + (4 * heads if stage["scorer"] == "h2o" else 0)
    limit = budget["tokens"] * reference if "tokens" in budget else int(budget["ratio"] * seen * reference + 1e-9)
    cap = max(limit // own - (stage["every"] - 1), 0)
    if stage["granularity"] == "block":
        cap = cap // stage["block_size"] * stage["block_size"]
    return cap, min(cap + stage["every"] - 1, limit // own)  # the slack stays within the budget


@st.composite
def scenarios(draw):
    scorer = draw(st.sampled_from(SCORERS))
    stage = {
        "kind": "evict",
        "scorer": scorer,
        "n_sink": draw(st.integers(0, 2)),
        "recent": draw(st.integers(0, 2)),
        "every": draw(st.integers(1, 3)),
        "granularity": draw(st.sampled_from(["token", "block"])),
        "block_size": draw(st.sampled_from([2, 4])),
    }
    if scorer in WINDOWED:
        stage["window"] = 2
    if draw(st.booleans()):
        stage["head_wise"] = draw(st.booleans())
    if draw(st.booleans()):
        budget = {"tokens": draw(st.integers(8, 14))}
    else:
        budget = {"ratio": draw(st.sampled_from([0.3, 0.5, 0.8]))}
    batch = draw(st.integers(1, 2))
    pad = draw(st.integers(0, 5)) if batch == 2 else 0
    sizes = [draw(st.integers(pad + 1, 20))] + draw(st.lists(st.integers(1, 4), min_size=1, max_size=8))
    return stage, budget, batch, pad, sizes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios())
def test_kept_counts_follow_the_formula_and_memory_stays_bounded(model, scenario):
    stage, budget, batch, pad, sizes = scenario
    spec = kvstack.StackSpec.load({"budget": budget, "stages": [stage]})
    cfg = model.config
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        gen = torch.Generator().manual_seed(sum(sizes))
        mask = torch.ones(batch, 0, dtype=torch.long)
        kept = [0] * batch
        seen = 0
        for i, n in enumerate(sizes):
            ids = torch.randint(3, 128, (batch, n), generator=gen)
            new_mask = torch.ones(batch, n, dtype=torch.long)
            if i == 0 and pad:
                new_mask[1, :pad] = 0
            mask = torch.cat([mask, new_mask], 1)
            model(ids, attention_mask=mask, cache=cache)
            seen += n
            kept = [k + int(new_mask[b].sum()) for b, k in enumerate(kept)]
            cap, allowed = expected_cap(stage, budget, seen, cfg)
            if max(kept) > allowed:
                if stage["granularity"] == "token":
                    kept = [min(k, cap) for k in kept]
                else:  # whole blocks leave; with room for no block, the newest (maybe partial) one goes too
                    bs = stage["block_size"]
                    kept = [max(k - max(-(-k // bs) - cap // bs, 0) * bs, 0) for k in kept]
            for layer in cache.layers:
                counts = layer.kept_counts()
                assert counts.tolist() == [[k] * cfg.num_key_value_heads for k in kept]
            assert cache.memory_bytes() <= spec.memory_bound(cfg, seen, batch=batch)
            reference = 4 * 2 * cfg.head_dim * cfg.num_key_value_heads
            limit = budget["tokens"] * reference if "tokens" in budget else int(budget["ratio"] * seen * reference + 1e-9)
            assert cache.memory_bytes() <= batch * cfg.num_hidden_layers * limit  # the promise
