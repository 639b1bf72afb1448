"""A budget is a promise (docs/budgets.md): after every forward the cache holds at most what its budget allows, in
every dtype, at every head_dim and prompt length, for every budgeted preset and for random budgets on them; a stack
that cannot keep its budget is refused by ``apply`` with what it can reach."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import kvstack
from kvstack.stack.budget import BudgetError, SpilledShares, reference_bytes_per_token
from kvstack.stack.spec import preset_names

BUDGETED = [name for name in preset_names() if kvstack.StackSpec.load(name).budget is not None]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: layer_weights drawn for one of the two layers (the other 1): a share that starves it or one that takes most
WEIGHTS = st.sampled_from([0.25, 2.0, 8.0])


def llama(head_dim: int, dtype: torch.dtype, kv_heads: int = 2, layers: int = 2, seed: int = 0):
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=48 * kv_heads, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096, attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def limit_bytes(spec, cache, seen: int, batch: int) -> int:
    """What the promise allows the whole cache, worked out here from the budget alone."""
    budget = spec.budget
    ref = reference_bytes_per_token(cache.reference_shape, cache.layers[0].full.keys.dtype)
    per_layer = budget.tokens * ref if budget.tokens is not None else int(budget.ratio * seen * ref + 1e-9)
    return batch * cache.reference_shape.num_layers * per_layer


def run_and_check(model, spec, sizes, batch=1, pad=0, seed=0):
    """Feed ``sizes`` tokens per forward; after each, the cache holds at most the budget. Returns the last ratio."""
    gen = torch.Generator().manual_seed(seed)
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        mask = torch.ones(batch, 0, dtype=torch.long)
        seen = 0
        for i, n in enumerate(sizes):
            ids = torch.randint(3, 128, (batch, n), generator=gen)
            new = torch.ones(batch, n, dtype=torch.long)
            if i == 0 and pad:
                new[-1, :pad] = 0
            mask = torch.cat([mask, new], 1)
            with torch.inference_mode():
                model(ids, attention_mask=mask if pad else None, cache=cache)
            seen += n
            held, limit = cache.memory_bytes(), limit_bytes(spec, cache, seen, batch)
            assert held <= limit, f"after {seen} tokens: {held} bytes > budget {limit} ({spec.budget})"
            assert held <= spec.memory_bound(model.config, seen, batch=batch, dtype=cache.layers[0].full.keys.dtype,
                                             prefill_len=sizes[0]) or spec.stages[-1].kind != "evict"
        return held / cache.full_bytes()


@st.composite
def scenarios(draw):
    preset = draw(st.sampled_from(BUDGETED))
    spec = kvstack.StackSpec.load(preset)
    choice = draw(st.sampled_from(["own", "ratio", "tokens"]))
    if choice == "ratio":
        spec = spec.with_overrides(budget={"ratio": draw(st.sampled_from([0.5, 0.25, 0.125, 0.0625]))})
    elif choice == "tokens":
        floor = max((s.protected_count() for s in spec.stages if hasattr(s, "protected_count")), default=1)
        spec = spec.with_overrides(budget={"tokens": draw(st.integers(max(floor, 16), 200))})
    if draw(st.booleans()):  # the budget shared unevenly between the 2 layers, a share a layer cannot use spilled
        shares = {"layer_weights": {draw(st.integers(0, 1)): draw(WEIGHTS)}, "spill_unused": draw(st.booleans())}
        spec = spec.with_overrides(stages=[s.model_dump() | (shares if "layer_weights" in type(s).model_fields else {})
                                           for s in spec.stages])
    head_dim = draw(st.sampled_from([8, 16, 32, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    prompt = draw(st.integers(1, 300))
    steps = draw(st.lists(st.integers(1, 3), max_size=40))
    batch = draw(st.integers(1, 2))
    pad = draw(st.integers(0, min(5, prompt - 1))) if batch == 2 else 0
    return spec, head_dim, dtype, [prompt, *steps], batch, pad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_memory_never_exceeds_the_budget(scenario):
    spec, head_dim, dtype, sizes, batch, pad = scenario
    model = llama(head_dim, dtype)
    try:
        run_and_check(model, spec, sizes, batch, pad, seed=len(sizes))
    except BudgetError as err:  # refused before anything ran: only a state too big for a tokens budget
        assert spec.budget.tokens is not None and "low-rank state" in str(err), err


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.1, 8), min_size=1, max_size=8).flatmap(
        lambda w: st.tuples(st.just(w), st.lists(st.floats(0, 4), min_size=len(w), max_size=len(w)))
    ),
    st.integers(1, 5000),
)
def test_spilled_shares_fill_to_the_caps_and_never_exceed_the_budget(weights_caps, seen):
    """Water-filling (``spill_unused``): no layer gets more than it can use, none less than the smaller of its
    weighted share and what it can use, the layers below their cap are in proportion to their weights, and the shares
    sum to the layer count unless every layer has all it can use."""
    weights, caps = weights_caps
    n = len(weights)
    scales = [w * n / sum(weights) for w in weights]
    budget = kvstack.Budget(ratio=0.125)
    shares = SpilledShares(scales, [lambda s, c=c: c * budget.limit_bytes(s, 128) for c in caps], budget, 128).at(seen)
    assert sum(shares) <= n + 1e-9
    for share, scale, cap in zip(shares, scales, caps):
        assert min(scale, cap) - 1e-9 <= share <= cap + 1e-9
    below = [i for i in range(n) if shares[i] < caps[i] - 1e-9]
    if below:
        assert sum(shares) == pytest.approx(n)
        assert {round(shares[i] / scales[i], 9) for i in below} == {round(shares[below[0]] / scales[below[0]], 9)}


def test_spilled_shares_example():
    """Three layers with weighted shares 1.8, 0.6, 0.6: layer 0 can use 1.0 of the mean, so 2.0 is left for layers 1
    and 2 (1.0 each); with layer 1 able to use only 0.5, layer 2 takes 1.5."""
    budget = kvstack.Budget(ratio=0.5)
    mean = budget.limit_bytes(100, 10)
    needs = [lambda s: budget.limit_bytes(s, 10), lambda s: 10 * mean, lambda s: 10 * mean]
    assert SpilledShares([1.8, 0.6, 0.6], needs, budget, 10).at(100) == pytest.approx([1.0, 1.0, 1.0])
    needs[1] = lambda s: mean // 2
    assert SpilledShares([1.8, 0.6, 0.6], needs, budget, 10).at(100) == pytest.approx([1.0, 0.5, 1.5])


@st.composite
def quantized_prune_options(draw):
    """A quantized_prune stack with the precision options (3 and 2 bits, rotations, pre-RoPE keys, nf levels, cheaper
    scales, other bits in one layer, transform-coded keys at any width, with or without a scale per token, and
    transform-coded values at any width) under a
    random budget: the level costs it sizes with must be exact for every option, and the layers' shares must sum to
    the budget."""
    dtype = draw(st.sampled_from(DTYPES))
    cheaper = ["model", "float8_e4m3fn"] + (["float16", "bfloat16"] if dtype == torch.float32 else [])
    tiers = draw(st.sampled_from([
        [{"fraction": 0.02, "bits": 16}, {"fraction": 0.6, "bits": 3}, {"rest": True, "bits": 2}],
        [{"fraction": 0.1, "bits": 16}, {"rest": True, "bits": 3}],
        [{"fraction": 0.5, "bits": 4}, {"rest": True, "bits": 3}],
        [{"fill": True, "bits": 16}, {"rest": True, "bits": 3}],
        [{"fill": True, "bits": 8}, {"fraction": 0.5, "bits": 4}, {"rest": True, "bits": 2}],
    ]))
    stage = {
        "kind": "quantized_prune", "scorer": draw(st.sampled_from(["h2o", "key_norm", "window"])),
        "n_sink": draw(st.integers(0, 4)), "recent": draw(st.sampled_from([0, 8, 32])), "tiers": tiers,
        "group_size": draw(st.sampled_from([8, 16])), "value_group_size": draw(st.sampled_from(["head_dim", 8])),
        "rotate": draw(st.sampled_from(["none", "hadamard", "random"])), "key_rope": draw(st.sampled_from(["post", "pre"])),
        "codebook": draw(st.sampled_from(["uniform", "nf"])), "scale_dtype": draw(st.sampled_from(cheaper)),
        "every": draw(st.sampled_from([None, 1, 4])),
    }
    transform = draw(st.booleans())
    if transform:  # keys transform-coded (pre-RoPE), every head the same tokens
        key_scale = draw(st.sampled_from(["none", "token"]))
        stage.update(coding="transform", key_rope="pre", head_wise=False, key_scale=key_scale,
                     prompt_axes=draw(st.sampled_from([0, 8, 16])))  # C >= 16: the prompt's axes cost bytes too
        if draw(st.booleans()):  # and per layer
            stage["layer_prompt_axes"] = {draw(st.integers(0, 1)): draw(st.sampled_from([0, 8, 16]))}
    # transform-coded widths are averages: halves fill whole bytes for every head_dim drawn (C = 2 x head_dim >= 16)
    key_widths = st.sampled_from([0.5, 1, 1.5, 2, 2.5, 3, 4, 5.5, 8]) if transform else st.sampled_from([2, 3, 4, 8])
    if draw(st.booleans()):  # keys at other bits than the values on the last level
        tiers[-1] = {**tiers[-1], "key_bits": draw(key_widths)}
    if transform and draw(st.booleans()):  # values transform-coded too, in their calibrated basis, at any width
        stage.update(value_coding="transform", rotate="none", codebook="uniform")
        if draw(st.booleans()):
            tiers[-1] = {**tiers[-1], "value_bits": draw(key_widths)}
    if sum(t["bits"] != 16 for t in tiers) == 1 and draw(st.booleans()):  # mixed precision by layer
        stage["layer_bits"] = {draw(st.integers(0, 1)): draw(st.sampled_from([2, 4, 8]))}
    if sum(t["bits"] != 16 for t in tiers) == 1 and draw(st.booleans()):
        stage["layer_key_bits"] = {draw(st.integers(0, 1)): draw(key_widths)}
    if draw(st.booleans()):
        stage["layer_weights"] = {draw(st.integers(0, 1)): draw(WEIGHTS)}
    stage["spill_unused"] = draw(st.booleans())
    if stage["spill_unused"] and tiers[0].get("fill") and draw(st.booleans()):  # a 16-bit core before spilling
        stage["spill_full_tokens"] = draw(st.integers(0, 64))
    if draw(st.booleans()):
        budget = {"ratio": draw(st.sampled_from([0.5, 0.25, 0.125, 0.0625]))}
    else:
        budget = {"tokens": draw(st.integers(max(16, stage["n_sink"] + stage["recent"]), 200))}
    spec = kvstack.StackSpec.load({"name": "qp-options", "budget": budget, "stages": [stage]})
    head_dim = draw(st.sampled_from([8, 16, 32, 64]))
    prompt = draw(st.integers(1, 300))
    steps = draw(st.lists(st.integers(1, 3), max_size=40))
    return spec, head_dim, dtype, [prompt, *steps], draw(st.integers(1, 2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quantized_prune_options())
def test_quantized_prune_with_precision_options_keeps_the_budget(scenario):
    spec, head_dim, dtype, sizes, batch = scenario
    run_and_check(llama(head_dim, dtype), spec, sizes, batch, seed=len(sizes))


@pytest.mark.parametrize(
    "preset, dtype, budget",
    [
        ("obcache-kivi", torch.bfloat16, {"ratio": 0.25}),
        ("obcache-kivi", torch.bfloat16, {"ratio": 0.125}),
        ("obcache-kivi", torch.float32, {"ratio": 0.0625}),
        ("max-compression", torch.float32, {"ratio": 0.125}),
        ("quantized-pruning", torch.bfloat16, {"ratio": 0.25}),
    ],
)
def test_the_overshoots_of_issue_13_hold_now(preset, dtype, budget):
    """The cases that overshot (0.307 for 0.25, ...; a 384-token prefix): a 768-token prefix and 64 decode steps stay
    within budget and use a good part of it (a promise kept by holding nearly nothing would be useless). At 768
    tokens x 0.0625 the fixed parts (a partial group per level, the tokens waiting for the next re-assignment) take
    up to half of the budget; their share falls as the context grows."""
    spec = kvstack.StackSpec.load(preset).with_overrides(budget=budget)
    ratio = run_and_check(llama(64, dtype, kv_heads=3), spec, [768] + [1] * 64)
    assert 0.4 * budget["ratio"] < ratio <= budget["ratio"]


def test_h2o_with_a_window_larger_than_the_budget_yields():
    """n_sink 4 + recent 32 under ratio 0.1 of a 200-token prompt (20 tokens' worth): the protected tokens yield."""
    spec = kvstack.StackSpec.load(
        {"budget": {"ratio": 0.1}, "stages": [{"kind": "evict", "scorer": "h2o", "n_sink": 4, "recent": 32}]}
    )
    assert run_and_check(llama(16, torch.float32), spec, [200, 1, 1, 1]) <= 0.1


def test_tokens_budget_counts_positions():
    """tokens: 64 is the bytes of 64 uncompressed tokens: a full-precision token also carries its position, so
    streaming keeps 63 (head_dim 16, 2 KV heads, fp32: 256 + 4 bytes a token)."""
    model = llama(16, torch.float32)
    spec = kvstack.StackSpec.load("streaming").with_overrides(budget={"tokens": 64})
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        model(torch.randint(3, 128, (1, 100)), cache=cache)
        assert {int(n) for layer in cache.kept_tokens() for n in layer.flatten()} == {63}
        report = cache.memory_report()
        assert report["budget"] == "tokens: 64" and report["budget_bytes"] == 2 * 64 * 256  # 2 layers
        assert report["total_bytes"] == 2 * 63 * 260 <= report["budget_bytes"]


def test_a_budget_nothing_keeps_is_refused_with_what_the_stack_holds():
    model = llama(64, torch.bfloat16, kv_heads=3)
    with pytest.raises(BudgetError) as err:
        kvstack.apply(model, "kivi-4", budget=0.25)
    message = str(err.value)
    assert "budget {ratio: 0.25}" in message and "bfloat16" in message
    assert "sizes what it keeps to a budget" in message and "quantized" in message
    held = float(message.split("the stack holds ")[1].split(" ")[0])
    assert 0.25 < held < 0.4  # 4-bit codes, bf16 scales and zero points, the residual, positions
    assert getattr(model, "_kvstack_applied", None) is None  # nothing was touched


def test_a_state_too_big_for_a_tokens_budget_is_refused():
    model = llama(64, torch.float32, kv_heads=3)
    with pytest.raises(BudgetError, match=r"low-rank state costs \d+ bytes per layer.*at least \d+"):
        kvstack.apply(model, "less", budget=10)  # 6,252 state bytes > a quarter of 10 x 1,536


def test_state_appears_only_once_affordable():
    """max-compression under ratio 0.125: a short prompt drops what it evicts (no state bytes); a long one folds."""
    model = llama(64, torch.float32, kv_heads=3)
    with kvstack.applied(model, "max-compression"):
        short = kvstack.cache_for(model)
        model(torch.randint(3, 128, (1, 40)), cache=short)
        assert all(layer.state is None or not layer.state.allocated for layer in short.layers)
        long = kvstack.cache_for(model)
        model(torch.randint(3, 128, (1, 400)), cache=long)
        assert all(layer.state.allocated for layer in long.layers)
        assert long.memory_bytes() <= 0.125 * long.full_bytes()
