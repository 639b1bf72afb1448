"""``quantized_prune``: precision tiers by importance, the eviction short form, ratio budgets, and the
recent-quantized-far-lowrank preset."""

from __future__ import annotations

import math

import pytest
import torch
from archs import tiny_model

import kvstack
from kvstack.stages.quantized_prune import QuantizedPruneSpec

TIERS = [{"fraction": 0.25, "bits": 16}, {"fraction": 0.25, "bits": 4}, {"rest": True, "bits": 2}]


def stack(stack_budget=None, **stage) -> dict:
    spec = {"name": "qp", "stages": [{"kind": "quantized_prune", "group_size": 4, **stage}]}
    if stack_budget is not None:
        spec["budget"] = stack_budget
    return spec


def counts(layer) -> dict[str, int]:
    return {t.name: int(t.valid().sum(-1).max()) for t in layer.tiers}


def drive(model, spec, prefill=32, steps=0, batch=1, seed=0):
    ids = torch.randint(3, 128, (batch, prefill + steps), generator=torch.Generator().manual_seed(seed))
    cache = kvstack.cache_for(model)
    model(ids[:, :prefill], cache=cache)
    for t in range(prefill, prefill + steps):
        model(ids[:, t : t + 1], cache=cache)
        yield cache
    if not steps:
        yield cache


def test_tiers_split_the_ranked_tokens_by_fraction():
    model = tiny_model("llama")
    with kvstack.applied(model, stack(scorer="h2o", tiers=TIERS)):
        cache = next(drive(model, None))
    for layer in cache.layers:
        assert counts(layer) == {"full": 8, "quantized4": 8, "quantized2": 16}


def test_window_scorer_puts_the_newest_tokens_at_the_highest_precision():
    model = tiny_model("llama")
    with kvstack.applied(model, stack(scorer="window", n_sink=2, tiers=TIERS)):
        cache = next(drive(model, None))
    layer = cache.layers[0]
    full = sorted(p for p in layer.full.positions[0, 0].tolist() if p >= 0)
    q4 = sorted(p for p in layer.tiers[1].positions[0, 0].tolist() if p >= 0)
    assert full == [0, 1] + list(range(26, 32)) and q4 == list(range(18, 26))


def test_fractions_without_rest_evict_the_remainder_within_the_bound():
    model = tiny_model("llama")
    tiers = [{"fraction": 0.5, "bits": 8}, {"fraction": 0.25, "bits": 2}]
    spec = kvstack.StackSpec.load(stack(scorer="key_norm", tiers=tiers))
    with kvstack.applied(model, spec):
        for cache in drive(model, None, steps=12, batch=2):
            seen = cache.get_seq_length()
            assert sum(counts(cache.layers[0]).values()) <= math.floor(0.75 * seen) + 3
            assert cache.memory_bytes() <= spec.memory_bound(model.config, seen, batch=2, prefill_len=32)


def test_short_form_demotes_what_eviction_would_drop():
    model = tiny_model("llama")
    # the short form's budget selects the 16-bit tokens; it is not a memory promise, so it sits on the stage
    with kvstack.applied(model, stack(scorer="window", n_sink=2, bits=2, budget={"tokens": 10})):
        cache = next(drive(model, None))
    layer = cache.layers[0]
    full = sorted(p for p in layer.full.positions[0, 0].tolist() if p >= 0)
    # what evict(window, n_sink=2) to 10 tokens' bytes keeps: 9 tokens and their positions
    assert full == [0, 1] + list(range(25, 32))
    assert counts(layer) == {"full": 9, "quantized2": 23}  # nothing is lost


@pytest.mark.parametrize("ratio", [0.25, 0.125])
def test_ratio_budget_buys_more_tokens_at_lower_precision(ratio):
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(
        stack(stack_budget={"ratio": ratio}, scorer="h2o", tiers=[{"rest": True, "bits": 2}], group_size=16,
              value_group_size="head_dim")
    )
    stage: QuantizedPruneSpec = spec.stages[0]
    shape = kvstack.ModelShape.from_model(model)
    with kvstack.applied(model, spec):
        for cache in drive(model, None, prefill=256, steps=8):
            seen = cache.get_seq_length()
            held = counts(cache.layers[0])
            assert cache.memory_bytes() <= spec.memory_bound(model.config, seen, prefill_len=256)
            assert cache.memory_bytes() <= ratio * cache.full_bytes()  # the promise
    reference = 2 * (16 + 16) * 4
    n = sum(stage.level_counts(shape, torch.float32, spec.budget, 256, 256))
    # whole 16-token groups of 2-bit codes (+ scales, zero points, positions, records) within ratio x 256 tokens,
    # less the 15 tokens that wait in full precision (net of the budget's growth; at most a quarter of the limit)
    slot = round(stage.level_costs(shape, torch.float32)[0] * 16)
    limit = int(ratio * 256 * reference + 1e-9)
    wait = math.ceil(15 * ((reference + 16) - ratio * reference))  # a full token: its position and H2O score per head
    assert n == 16 * ((limit - min(wait, limit // 4)) // slot) - 15  # room for the holes of one more group
    sixteen_bit = math.floor(ratio * 256 * reference / (reference + 16))  # what h2o eviction keeps
    assert n > 1.5 * sixteen_bit
    assert held["quantized2"] >= n - 16


def test_all_tokens_at_16_bits_is_the_identity():
    model = tiny_model("llama", dtype=torch.float64)  # h2o's statistics take the tiled path, identity SDPA
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    outs = []
    for spec in ("identity", stack(scorer="h2o", tiers=[{"fraction": 1.0, "bits": 16}])):
        with kvstack.applied(model, spec):
            cache = kvstack.cache_for(model)
            logits = [model(ids[:, :20], cache=cache).logits]
            logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(20, 30)]
        outs.append(torch.cat(logits, 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"tiers": [{"fraction": 0.5, "bits": 4}, {"rest": True, "bits": 8}]}, "strictly decreasing bits"),
        ({"tiers": [{"rest": True, "bits": 16}, {"fraction": 0.5, "bits": 4}]}, "only on the last tier"),
        ({"tiers": [{"fraction": 0.7, "bits": 16}, {"fraction": 0.7, "bits": 4}]}, "at most 1"),
        ({"bits": 2}, "a budget"),
        ({"tiers": TIERS, "bits": 2}, "exactly one of 'tiers'"),
        ({"tiers": [{"fraction": 0.5, "rest": True, "bits": 4}]}, "exactly one of 'fraction'"),
        ({"tiers": TIERS, "group_size": 6}, r"group_size=6 .* multiple of 4"),
    ],
)
def test_invalid_specs_are_rejected_clearly(stage, message):
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.StackSpec.load(stack(**stage))


def test_value_groups_must_divide_the_models_head_dim(real_model_and_tokenizer):
    model, _ = real_model_and_tokenizer
    with pytest.raises(kvstack.SpecError, match=r"value_group_size=16 .* head_dim=8"):
        kvstack.apply(model, stack(tiers=TIERS, value_group_size=16))


def test_recent_quantized_far_lowrank_preset_runs_on_the_real_model(real_model_and_tokenizer):
    model, tokenizer = real_model_and_tokenizer
    spec = kvstack.StackSpec.load("recent-quantized-far-lowrank")
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        out = model.generate(**inputs, max_new_tokens=140, min_new_tokens=140, do_sample=False, cache=cache)
        seen = cache.get_seq_length()
        assert cache.memory_bytes() <= spec.memory_bound(model.config, seen, prefill_len=inputs.input_ids.shape[1])
    report = cache.memory_report()["by_tier"]
    assert report["full"] > 0 and report["quantized"] > 0 and report["state"] > 0
    layer = cache.layers[0]
    assert int(layer.kept_counts().max()) <= 128
    assert int(layer.full.positions.min()) > int(layer.tiers[1].positions.max())  # recent full, middle quantized
    assert tokenizer.decode(out[0]).strip()
