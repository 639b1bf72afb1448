"""``quantized_prune``: precision tiers by importance, the eviction short form, ratio budgets, the precision options
of ``quantize`` on its levels (3 bits, rotations, pre-RoPE keys, nf levels, cheap scales), and the
recent-quantized-far-lowrank preset."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from archs import smollm2_shape, tiny_model
from test_quant_options import OPTION_SETS, SCALE_BYTES, dense  # the options of quantize, on every level here

import kvstack
from kvstack.kernels.quant_pack import dequantize
from kvstack.kernels.rotation import random_orthogonal
from kvstack.stack import engine
from kvstack.stack.stats import StatsRequest
from kvstack.stages._quant_options import QuantOptions
from kvstack.stages.quantized_prune import LevelSplit, QuantizedPruneSpec, levels_without_promotion
from kvstack.stages.scorers import Scorer, register_scorer, unregister_scorer

TIERS = [{"fraction": 0.25, "bits": 16}, {"fraction": 0.25, "bits": 4}, {"rest": True, "bits": 2}]
LOW_BITS = [{"fraction": 0.25, "bits": 16}, {"fraction": 0.5, "bits": 3}, {"rest": True, "bits": 2}]
FILL_3 = [{"fill": True, "bits": 16}, {"rest": True, "bits": 3}]


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


class _TableScorer(Scorer):
    """Scores from a table the test sets: ``table[position]``."""

    name = "test_position_table"
    head_wise = False
    table = torch.zeros(0)

    def scores(self, layer, tier_index, tier, stats):
        return type(self).table[tier.positions.clamp_min(0).long()]


def test_a_quantized_token_is_never_moved_up_and_its_band_goes_to_a_token_still_at_that_precision():
    register_scorer(_TableScorer)
    try:
        model = tiny_model("llama")
        _TableScorer.table = torch.arange(64, dtype=torch.float32)  # the newest first
        ids = torch.randint(3, 128, (1, 36), generator=torch.Generator().manual_seed(0))
        with kvstack.applied(model, stack(scorer="test_position_table", tiers=TIERS)):
            cache = kvstack.cache_for(model)
            model(ids[:, :32], cache=cache)
            layer = cache.layers[0]
            held = lambda i: sorted(p for p in layer.tiers[i].positions[0, 0].tolist() if p >= 0)  # noqa: E731
            assert (held(0), held(1), held(2)) == (list(range(24, 32)), list(range(16, 24)), list(range(16)))
            _TableScorer.table = -torch.arange(64, dtype=torch.float32)  # now the oldest first
            for t in range(32, 36):  # the stage re-ranks at 36 tokens (every = group_size = 4)
                model(ids[:, t : t + 1], cache=cache)
        # 36 tokens: 9 at 16 bits, 9 at 4, 18 at 2. Tokens 0-15 rank first but hold 2-bit error: they stay 2-bit.
        # The 16-bit band takes the oldest tokens still at 16 bits, the 4-bit band the 4-bit ones and then the next.
        assert held(0) == list(range(24, 33))
        assert held(1) == list(range(16, 24)) + [33]
        assert held(2) == list(range(16)) + [34, 35]
    finally:
        unregister_scorer("test_position_table")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_levels_are_cut_from_the_ranking_and_never_rise(data):
    n = data.draw(st.integers(1, 24))
    num_levels = data.draw(st.integers(1, 4))
    score = torch.tensor(data.draw(st.lists(st.integers(-4, 4), min_size=n, max_size=n)), dtype=torch.float32)
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    current = torch.tensor(data.draw(st.lists(st.integers(-1, num_levels - 1), min_size=n, max_size=n)))
    steps = data.draw(st.lists(st.integers(0, n), min_size=num_levels, max_size=num_levels))
    bounds = torch.tensor(steps).cumsum(0).clamp_max(int(valid.sum()))
    level = levels_without_promotion(score[None, None], valid[None, None], bounds[None, None], current[None, None])[0, 0]
    assert bool((level[~valid] == num_levels).all())  # empty slots are not placed
    assert bool((level[valid] >= current[valid].clamp_min(0)).all())  # nobody moves up
    for j in range(num_levels):
        at_or_above = valid & (level <= j)
        assert int(at_or_above.sum()) <= int(bounds[j])
        taken, passed = valid & (level == j), valid & (level > j) & (current <= j)
        if bool(passed.any()):
            # a band is left unfilled only when no slot that could take it is left
            assert int(at_or_above.sum()) == int(bounds[j])
            if bool(taken.any()):  # and it took the best-scored of those that could
                assert float(score[taken].min()) >= float(score[passed].max())
    plain = levels_without_promotion(
        score[None, None], valid[None, None], bounds[None, None], torch.full_like(current, -1)[None, None]
    )[0, 0]
    order = torch.where(valid, score, torch.full_like(score, -math.inf)).argsort(descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(n))
    cut = torch.where(valid, (rank[:, None] >= bounds[None, :]).sum(-1), torch.full_like(rank, num_levels))
    assert torch.equal(plain, cut)  # with no quantized slot: the plain cut of the ranking at the bounds


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
@pytest.mark.parametrize("bits, options", [(2, {}), (3, {"scale_dtype": "float8_e4m3fn", "rotate": "random"})])
def test_ratio_budget_buys_more_tokens_at_lower_precision(ratio, bits, options):
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(
        stack(stack_budget={"ratio": ratio}, scorer="h2o", tiers=[{"rest": True, "bits": bits}], group_size=16,
              value_group_size="head_dim", **options)
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
    # whole 16-token groups of b-bit codes (+ scales and zero points in the scale format, positions and H2O scores
    # per head) within ratio x 256 tokens, less the 15 tokens that wait in full precision (net of the budget's
    # growth; at most a quarter of the limit). No group more for holes: a tier's holes stay within its groups
    e = 1 if options.get("scale_dtype") else 4
    slot = 2 * (16 * 32 * bits // 8 + 2 * e * 16 + 2 * e * 16) + 16 * 2 * 4 + 16 * 2 * 4
    assert slot == stage.level_costs(shape, torch.float32)[0] * 16
    rotation = 16 * 16 * 4 if options.get("rotate") == "random" else 0  # reserved from the layer's limit
    limit = int(ratio * 256 * reference + 1e-9) - rotation
    wait = math.ceil(15 * ((reference + 16) - ratio * reference))  # a full token: its position and H2O score per head
    assert n == 16 * ((limit - min(wait, limit // 4)) // slot)
    sixteen_bit = math.floor(ratio * 256 * reference / (reference + 16))  # what h2o eviction keeps
    assert n > 1.5 * sixteen_bit
    assert held[f"quantized{bits}"] >= n - 16


@pytest.mark.parametrize("every", [None, 4])
def test_a_fill_tier_takes_the_bytes_the_levels_below_leave(every):
    """``[{fill: true, bits: 16}, {rest: true, bits: 3}]`` under ``ratio: 0.3``: every token is kept at 3 bits while
    they fit, and the sinks and newest tokens take what is left at 16 bits — as many as fit, less the room for the
    tokens that arrive before the next assignment."""
    model = tiny_model("llama", head_dim=16)
    spec = kvstack.StackSpec.load(stack(
        stack_budget={"ratio": 0.3}, scorer="window", n_sink=2, group_size=8, value_group_size="head_dim",
        scale_dtype="float8_e4m3fn",
        every=every, tiers=[{"fill": True, "bits": 16}, {"rest": True, "bits": 3}],
    ))
    stage: QuantizedPruneSpec = spec.stages[0]
    shape = kvstack.ModelShape.from_model(model)
    split = stage.level_split(shape, torch.float32, spec.budget)
    full_counts = []
    with kvstack.applied(model, spec):
        for cache in drive(model, None, prefill=200, steps=20):
            seen = cache.get_seq_length()
            layer = cache.layers[0]
            assert cache.memory_bytes() <= 0.3 * cache.full_bytes()  # the promise
            held = counts(layer)
            assert held["full"] + held["quantized3"] == seen  # nothing evicted: 3 bits hold every token
            full_counts.append(held["full"])
            if seen % stage.period == 0:  # just re-assigned: the fill tier is as large as the bytes allow
                limit = split._limit(seen, 0)
                limit -= split._slack_bytes(seen, limit)
                fill = held["full"]
                assert split.cost(seen, fill) <= limit < split.cost(seen, fill + 1)
                positions = sorted(p for p in layer.full.positions[0, 0].tolist() if p >= 0)
                assert positions == [0, 1, *range(seen - fill + 2, seen)]  # sinks, then the newest
    assert min(full_counts) > 2  # more than the sinks: the budget left room
    # a shorter period reserves less room for the tokens that arrive meanwhile: a larger fill tier after assignment
    longer = stage.model_copy(update={"every": 16}).level_split(shape, torch.float32, spec.budget)
    assert split.fill_count(216, 0, 216) > longer.fill_count(216, 0, 216)


@pytest.mark.parametrize("scorer", ["h2o", "key_norm"])
def test_a_fill_tier_smaller_than_the_protected_sets_takes_the_sinks_then_the_newest(scorer):
    """With ``recent`` (or a scorer's window) larger than the fill tier, the fill tier holds the sinks and then the
    newest protected tokens, not the oldest of the window."""
    model = tiny_model("llama", head_dim=16)
    spec = stack(
        stack_budget={"ratio": 0.3}, scorer=scorer, n_sink=2, recent=150, group_size=8, value_group_size="head_dim",
        scale_dtype="float8_e4m3fn", every=4, tiers=FILL_3,
    )
    with kvstack.applied(model, spec):
        cache = next(drive(model, None, prefill=200))
    for layer in cache.layers:
        positions = sorted(p for p in layer.full.positions[0, 0].tolist() if p >= 0)
        assert 2 < len(positions) < 2 + 150
        assert positions == [0, 1, *range(200 - (len(positions) - 2), 200)]


@pytest.mark.parametrize("per_layer, name", [
    ({"layer_bits": {1: 4}}, "quantized4"), ({"layer_key_bits": {1: 4}}, "quantized-k4v3"),
])
def test_layer_bits_give_a_layer_its_bits_and_a_share_of_the_budget_by_what_its_tokens_cost(per_layer, name):
    """``layer_bits: {1: 4}`` (or ``layer_key_bits``: the keys only) on a 3-bit fill stack under ``ratio: 0.3``: layer
    1 stores its tokens at 4 bits and may hold more than 0.3 of its own bytes, the other layers less, the shares in
    proportion to the quantized token costs and summing to the layer count, so the whole cache keeps the budget;
    every token stays (4 bits fit in the larger share)."""
    model = tiny_model("llama", head_dim=16, num_hidden_layers=3)
    spec = kvstack.StackSpec.load(stack(
        stack_budget={"ratio": 0.3}, scorer="window", n_sink=2, group_size=8, value_group_size="head_dim",
        scale_dtype="float8_e4m3fn", tiers=FILL_3, **per_layer,
    ))
    stage: QuantizedPruneSpec = spec.stages[0]
    shape = kvstack.ModelShape.from_model(model)
    shares = [stage.layer_scale(i, shape) for i in range(3)]
    costs = [stage.level_costs(shape, torch.float32, i)[-1] for i in range(3)]
    assert sum(shares) == pytest.approx(3) and shares[0] == shares[2] < 1 < shares[1]
    assert shares[1] / shares[0] == pytest.approx(costs[1] / costs[0]) and costs[1] > costs[0]
    ratios = []
    with kvstack.applied(model, spec):
        for cache in drive(model, None, prefill=200, steps=20):
            seen = cache.get_seq_length()
            assert cache.memory_bytes() <= 0.3 * cache.full_bytes()  # the promise, for the whole cache
            names = [[t.name for t in layer.tiers] for layer in cache.layers]
            assert names == [["full", "quantized3"], ["full", name], ["full", "quantized3"]]
            if "layer_key_bits" in per_layer:
                assert (cache.layers[1].tiers[1].key_bits, cache.layers[1].tiers[1].bits) == (4, 3)
            for i, layer in enumerate(cache.layers):
                held = counts(layer)
                assert sum(held.values()) == seen  # nothing evicted
                assert layer.memory_bytes() <= layer.limit_bytes()  # each layer its own share
            ratios.append([layer.memory_bytes() / (cache.full_bytes() / 3) for layer in cache.layers])
    assert all(r[1] > r[0] and r[0] < 0.3 for r in ratios[-4:])  # the 4-bit layer holds more, the others less than 0.3


@pytest.mark.parametrize("coding", ["kivi", "transform"])
def test_layer_weights_move_the_budget_between_layers_and_keep_the_total(coding):
    """``layer_weights: {1: 4}`` on a 3-layer stack under ``ratio: 0.125``: layer 1 gets 4x the share of the others
    (2 of 3 layers' worth against 0.5 each), holds more tokens than they do at the same bits, and the whole cache
    keeps the budget. Layers with the same bits but other weights are sized apart (they once shared one split)."""
    model = tiny_model("llama", head_dim=16, num_hidden_layers=3)
    options = {"coding": "transform", "key_basis": "weights", "key_rope": "pre", "tiers": [{"fill": True, "bits": 16},
               {"rest": True, "bits": 2, "key_bits": 2}]} if coding == "transform" else {"tiers": FILL_3}
    spec = kvstack.StackSpec.load(stack(
        stack_budget={"ratio": 0.125}, scorer="window", n_sink=2, group_size=8, value_group_size="head_dim",
        scale_dtype="float8_e4m3fn", layer_weights={1: 4}, **options,
    ))
    shape = kvstack.ModelShape.from_model(model)
    assert [spec.stages[0].layer_scale(i, shape) for i in range(3)] == pytest.approx([0.5, 2, 0.5])
    with kvstack.applied(model, spec):
        for cache in drive(model, None, prefill=300, steps=12):
            assert cache.memory_bytes() <= 0.125 * cache.full_bytes()  # the promise, for the whole cache
            held = [sum(counts(layer).values()) for layer in cache.layers]
            assert held[0] == held[2] and held[1] > 2 * held[0]
            for layer in cache.layers:
                assert layer.memory_bytes() <= layer.limit_bytes()
            assert cache.layers[1].limit_bytes() == pytest.approx(4 * cache.layers[0].limit_bytes(), abs=2)


def test_spill_unused_keeps_the_weighted_layer_whole_and_gives_the_rest_to_the_others():
    """``layer_weights: {1: 8}, spill_unused: true`` under ``ratio: 0.125``: layer 1's share (2.4 of 3 layers' worth)
    is more than every token at 3 bits costs, so it keeps every token and its limit is what they cost; layers 0 and 2
    get the rest (more than their unspilled 0.3 each), and the whole cache keeps the budget."""
    model = tiny_model("llama", head_dim=16, num_hidden_layers=3)
    spec = kvstack.StackSpec.load(stack(
        stack_budget={"ratio": 0.125}, scorer="window", n_sink=2, group_size=8, value_group_size="head_dim",
        scale_dtype="float8_e4m3fn", tiers=FILL_3, layer_weights={1: 8}, spill_unused=True,
    ))
    stage, shape = spec.stages[0], kvstack.ModelShape.from_model(model)
    need = stage.layer_need(1, shape, torch.float32, spec.budget, None)
    with kvstack.applied(model, spec):
        for cache in drive(model, None, prefill=300, steps=12):
            seen = cache.get_seq_length()
            assert cache.memory_bytes() <= 0.125 * cache.full_bytes()  # the promise, for the whole cache
            assert sum(layer.limit_bytes() for layer in cache.layers) <= 0.125 * cache.full_bytes()
            assert sum(counts(cache.layers[1]).values()) == seen  # the weighted layer keeps every token
            assert cache.layers[1].limit_bytes() == pytest.approx(need(seen), abs=1)
            mean = cache.full_bytes() / 3
            assert cache.layers[0].limit_bytes() == cache.layers[2].limit_bytes() > 0.3 * 0.125 * mean
            assert 2 * cache.layers[0].limit_bytes() + need(seen) == pytest.approx(0.375 * mean, abs=3)


def test_spill_full_tokens_keeps_that_many_at_16_bits_in_a_layer_that_keeps_every_token():
    """``spill_full_tokens: 16`` on top of the previous test's stack: layer 1 still keeps every token, 16 of them
    (plus the arrivals' room, under one period) at 16 bits where its weighted share holds 43; its limit is what that
    costs, and layers 0 and 2 get the rest: more than without spilling, less than with plain ``spill_unused`` (which
    leaves layer 1 its 2 sinks at 16 bits). The whole cache keeps the budget."""
    model = tiny_model("llama", head_dim=16, num_hidden_layers=3)

    def run(**shares):
        spec = kvstack.StackSpec.load(stack(
            stack_budget={"ratio": 0.125}, scorer="window", n_sink=2, group_size=8, value_group_size="head_dim",
            scale_dtype="float8_e4m3fn", tiers=FILL_3, layer_weights={1: 8}, **shares,
        ))
        with kvstack.applied(model, spec):
            cache = next(drive(model, None, prefill=300))
            assert cache.memory_bytes() <= 0.125 * cache.full_bytes()  # the promise, for the whole cache
            need = spec.stages[0].layer_need(1, kvstack.ModelShape.from_model(model), torch.float32, spec.budget, None)
            return [counts(layer) for layer in cache.layers], [layer.limit_bytes() for layer in cache.layers], need(300)

    kept, limits, need = run(spill_unused=True, spill_full_tokens=16)
    assert sum(kept[1].values()) == 300 and 16 <= kept[1]["full"] < 16 + 8
    assert limits[1] == pytest.approx(need, abs=1)
    weighted, weighted_limits, _ = run()
    assert weighted[1]["full"] > 2 * kept[1]["full"]  # the share that spilled
    _, plain_limits, _ = run(spill_unused=True)
    assert weighted_limits[0] < limits[0] == limits[2] < plain_limits[0]


def test_layer_weights_compose_with_layer_bits():
    """Shares follow the quantized token's cost times the weight, normalised to the layer count."""
    spec = QuantizedPruneSpec(scorer="window", group_size=8, tiers=FILL_3, layer_bits={2: 4}, layer_weights={0: 3})
    shape = kvstack.ModelShape.from_model(tiny_model("llama", head_dim=16, num_hidden_layers=3))
    costs = [spec.level_costs(shape, torch.float32, i)[-1] for i in range(3)]
    raw = [3 * costs[0], costs[1], costs[2]]
    assert [spec.layer_scale(i, shape) for i in range(3)] == pytest.approx([3 * r / sum(raw) for r in raw])


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
        ({"tiers": LOW_BITS, "group_size": 4}, r"group_size=4 .* multiple of 8 for bits=3 \(8 codes packed in 3"),
        ({"bits": 3, "budget": {"ratio": 0.5}, "group_size": 8, "value_group_size": 4}, r"value_group_size=4 .* multiple of 8"),
        ({"tiers": [{"fraction": 0.5, "bits": 16}, {"rest": True, "bits": 8}], "group_size": 8, "codebook": "nf"},
         r"codebook='nf' is not allowed: uniform with bits=8"),
        ({"tiers": TIERS, "rotate": "fourier"}, r"rotate"),
        ({"tiers": [{"rest": True, "bits": 5}]}, r"bits"),
        ({"tiers": [{"fraction": 0.5, "bits": 16}, {"fill": True, "bits": 4}]}, r"tiers.fill=True .* first tier"),
        ({"tiers": [{"fill": True, "bits": 16}, {"rest": True, "bits": 4}]}, r"tiers.fill=True .* a budget"),
        ({"tiers": [{"fill": True, "bits": 16}], "budget": {"ratio": 0.5}}, r"tiers.fill=True .* a tier below"),
        ({"tiers": [{"fill": True, "rest": True, "bits": 16}]}, "exactly one of 'fraction', 'rest: true' or 'fill"),
        ({"tiers": TIERS, "layer_bits": {0: 3}}, r"layer_bits=\{0: 3\} is not allowed: none with 2 quantized levels"),
        ({"tiers": FILL_3, "group_size": 8, "budget": {"ratio": 0.5}, "layer_bits": {-1: 4}}, r"layer_bits=\{-1: 4\} .* layer indices from 0"),
        ({"tiers": FILL_3, "group_size": 8, "layer_bits": {0: 5}},
         r"layer_bits.0: Input should be 2, 3, 4 or 8 \(got 5\)"),
        ({"tiers": [{"fraction": 0.5, "bits": 16}, {"rest": True, "bits": 4}], "layer_bits": {1: 3}},
         r"group_size=4 .* multiple of 8 for bits=3"),
        ({"tiers": [{"fraction": 0.5, "bits": 16, "key_bits": 4}, {"rest": True, "bits": 4}]},
         r"key_bits=4 on a 16-bit tier"),
        ({"tiers": [{"fraction": 0.5, "bits": 16}, {"rest": True, "bits": 4, "key_bits": 3}]},
         r"group_size=4 .* multiple of 8 for bits=3"),  # key groups pack the keys' 3-bit codes
        ({"tiers": [{"fraction": 0.5, "bits": 16}, {"rest": True, "bits": 2, "key_bits": 4}], "group_size": 4,
          "value_group_size": 4}, None),  # 2-bit values pack 4 per byte: value groups of 4 are fine
        ({"tiers": TIERS, "layer_key_bits": {0: 4}},
         r"layer_key_bits=\{0: 4\} is not allowed: none with 2 quantized levels"),
        ({"tiers": FILL_3, "group_size": 8, "budget": {"ratio": 0.5}, "layer_key_bits": {-2: 4}}, r"layer_key_bits=\{-2: 4\} .* layer indices from 0"),
        ({"tiers": FILL_3, "group_size": 8, "layer_weights": {0: 0}},
         r"layer_weights.0: Input should be greater than 0"),
        ({"tiers": FILL_3, "group_size": 8, "layer_weights": {0: float("nan")}}, r"layer_weights.0: Input should be a "
         r"finite number"),
        ({"tiers": FILL_3, "group_size": 8, "layer_weights": {-1: 2}}, r"layer_weights.-1.\[key\]: Input should be "
         r"greater than or equal to 0"),
        ({"tiers": FILL_3, "group_size": 8, "budget": {"ratio": 0.5}, "spill_full_tokens": 64},
         r"spill_full_tokens=64 is not allowed: 0 unless spill_unused: true and the first tier has fill: true"),
        ({"tiers": TIERS, "budget": {"ratio": 0.5}, "spill_unused": True, "spill_full_tokens": 64},
         r"spill_full_tokens=64 is not allowed: 0 unless spill_unused: true and the first tier has fill: true"),
        ({"tiers": FILL_3, "group_size": 8, "budget": {"ratio": 0.5}, "spill_unused": True, "spill_full_tokens": 64},
         None),
        ({"tiers": FILL_3, "group_size": 8, "spill_full_tokens": -1}, r"spill_full_tokens: Input should be greater "
         r"than or equal to 0"),
    ],
)
def test_invalid_specs_are_rejected_clearly(stage, message):
    if message is None:  # a valid neighbour of the refused ones
        kvstack.StackSpec.load(stack(**stage))
        return
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.StackSpec.load(stack(**stage))


@pytest.mark.parametrize(
    "model_kwargs, options, message",
    [
        ({"dtype": torch.bfloat16}, {"scale_dtype": "bfloat16"},
         r"scale_dtype='bfloat16' is not allowed: 'model' or a format smaller than the model dtype bfloat16"),
        ({"head_dim": 24}, {"rotate": "hadamard"}, r"rotate='hadamard' is not allowed: a power-of-two head_dim"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, {"key_rope": "pre"},
         r"key_rope='pre' is not allowed: 'post' for this model: rope_type='dynamic'"),
    ],
)
def test_options_are_checked_against_the_model(model_kwargs, options, message):
    model = tiny_model("llama", **model_kwargs)
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.apply(model, options_stack(**options))
    # a stack with no quantized level: the options do not act, and are not checked
    with kvstack.applied(model, options_stack([{"fraction": 1.0, "bits": 16}], **options)):
        pass


def test_options_show_only_where_a_level_is_quantized():
    assert "rotate" not in kvstack.StackSpec.load(options_stack([{"rest": True, "bits": 16}], rotate="hadamard")).to_yaml()
    text = kvstack.StackSpec.load(options_stack(rotate="hadamard", codebook="nf")).to_yaml()
    assert "rotate: hadamard" in text and "codebook: nf" in text and "rotate_seed" not in text
    spec = kvstack.StackSpec.load(options_stack(rotate="random", rotate_seed=3, key_rope="pre"))
    assert kvstack.StackSpec.from_yaml(spec.to_yaml()) == spec


def test_a_level_with_key_bits_stores_its_keys_and_values_at_their_own_bits():
    """``{rest: true, bits: 3, key_bits: 8}`` against plain 3 bits on the same prompt: the values are the same
    3-bit codes, the keys 8-bit ones (far closer to the keys as received), and the tier costs what its tensors hold,
    the amount the budget is sized with."""
    model = tiny_model("llama")
    tiers = {
        key_bits: [{"fraction": 0.25, "bits": 16}, {"rest": True, "bits": 3, **({"key_bits": key_bits} if key_bits else {})}]
        for key_bits in (None, 8)
    }
    plain, _ = prefill(model, options_stack(tiers[None]), 64)
    mixed, _ = prefill(model, options_stack(tiers[8]), 64)
    full, _ = prefill(model, "identity", 64)
    stage: QuantizedPruneSpec = kvstack.StackSpec.load(options_stack(tiers[8])).stages[0]
    for a, b, reference in zip(plain.layers, mixed.layers, full.layers):
        three, eight = a.tiers[1], b.tiers[1]
        assert (eight.name, eight.key_bits, eight.bits) == ("quantized-k8v3", 8, 3)
        assert torch.equal(eight.value_codes, three.value_codes) and torch.equal(eight.positions, three.positions)
        keys = _by_position(reference.full.keys, eight.positions)
        err = lambda t: float((dequantize(t.key_groups(), torch.float32) - keys).norm() / keys.norm())  # noqa: E731
        assert err(eight) < err(three) / 8
        assert eight.key_codes.shape[2] == 48 and three.key_codes.shape[2] == 48 * 3 // 8  # 48 slots, packed
        assert eight.bytes_per_token() == stage.level_costs(mixed.shape, torch.float32)[-1]
        assert eight.memory_bytes() - three.memory_bytes() == 48 * 2 * 16 * (8 - 3) // 8  # the keys' codes only


def test_layer_bits_name_layers_of_the_model():
    model = tiny_model("llama", num_hidden_layers=2)
    with pytest.raises(kvstack.SpecError, match=r"layer_bits=\{5: 4\} is not allowed: layer indices 0..1 \(the model "
                       r"has 2 layers\)"):
        kvstack.apply(model, stack(stack_budget={"ratio": 0.5}, group_size=8, tiers=FILL_3, layer_bits={5: 4}))
    with pytest.raises(kvstack.SpecError, match=r"layer_key_bits=\{2: 4\} is not allowed: layer indices 0..1"):
        kvstack.apply(model, stack(stack_budget={"ratio": 0.5}, group_size=8, tiers=FILL_3, layer_key_bits={2: 4}))
    with pytest.raises(kvstack.SpecError, match=r"layer_weights=\{2: 4.0\} is not allowed: layer indices 0..1"):
        kvstack.apply(model, stack(stack_budget={"ratio": 0.5}, group_size=8, tiers=FILL_3, layer_weights={2: 4}))
    plain = kvstack.StackSpec.load(stack(stack_budget={"ratio": 0.5}, group_size=8, tiers=FILL_3))
    assert "layer_bits" not in plain.to_yaml()
    mixed = plain.with_overrides(stages=[{**plain.stages[0].model_dump(), "layer_bits": {1: 4}}])
    assert kvstack.StackSpec.from_yaml(mixed.to_yaml()) == mixed  # YAML round trip with integer layer keys


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


# ------------------------------------------------------------------------------------------ precision options
def options_stack(tiers=LOW_BITS, stack_budget=None, **options) -> dict:
    # window: one ranking for all heads and no per-token records, so every byte below has a closed form
    return stack(stack_budget, scorer="window", group_size=8, tiers=tiers, **options)


def prefill(model, spec, n, batch=1, seed=0):
    ids = torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids, cache=cache)
    return cache, ids


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("n, batch", [(32, 1), (45, 2)])
def test_memory_bytes_are_exact_with_every_option(options, n, batch):
    """Independent count: 16-bit tokens with a position; each quantized level in whole 8-token groups of b-bit codes
    (3 bits: 3 bytes per 8 codes), key scales/zeros per group and channel, value scales/zeros per token and group,
    in the scale format, a position per slot; one float32 [D, D] matrix per layer for rotate: random (not one per
    level)."""
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(options_stack(**options))
    stage: QuantizedPruneSpec = spec.stages[0]
    cache, _ = prefill(model, spec, n, batch)
    h, d, layers = 2, 16, model.config.num_hidden_layers
    e = SCALE_BYTES[options.get("scale_dtype", "model")] or 4
    counts_ = [n // 4, 3 * n // 4 - n // 4, n - 3 * n // 4]  # floor(0.25 n), floor(0.75 n) - floor(0.25 n), rest
    expected = counts_[0] * (h * 2 * d * 4 + 4)
    for bits, count in zip((3, 2), counts_[1:]):
        slots = 8 * math.ceil(count / 8)
        expected += h * (2 * slots * d * bits // 8 + 2 * e * (slots // 8) * d + 2 * e * slots * (d // 8)) + 4 * slots
    rotation = d * d * 4 if options.get("rotate") == "random" else 0
    assert cache.memory_bytes() == layers * (batch * expected + rotation)
    costs = stage.level_costs(cache.shape, torch.float32)
    for layer in cache.layers:
        assert counts(layer) == dict(zip(("full", "quantized3", "quantized2"), counts_))
        for tier, cost in zip(layer.tiers[1:], costs[1:]):
            assert tier.bytes_per_token() == cost  # the amortised cost the budget is sized with
            assert tier.key_scale.dtype == tier.value_zero.dtype == (
                torch.float32 if e == 4 else getattr(torch, options["scale_dtype"])
            )


def _by_position(x, positions):
    """x [B, H, T, D] of an identity cache (positions 0..T-1) at the slots' positions [B, 1, S] (holes: 0)."""
    index = positions.clamp_min(0).long()[..., None].expand(-1, x.shape[1], -1, x.shape[-1])
    return x.gather(2, index)


@pytest.mark.parametrize("options", OPTION_SETS)
def test_every_level_stores_what_the_options_say(options):
    """Each quantized level holds ``R unrope(k)`` / ``R v`` (docs/quantization.md) of its tokens in the options'
    levels and scale format — the same stored domain a ``quantize`` stage with these options keeps (an 8-bit level
    keeps uniform levels under ``codebook: nf``)."""
    model = tiny_model("llama")
    tiers = [{"fraction": 0.25, "bits": 16}, {"fraction": 0.25, "bits": 8}, {"fraction": 0.25, "bits": 4},
             {"rest": True, "bits": 3}]
    cache, ids = prefill(model, options_stack(tiers, **options), 64)
    full, _ = prefill(model, "identity", 64)
    shape = kvstack.ModelShape.from_model(model)
    transformed = options.get("rotate", "none") != "none" or options.get("key_rope") == "pre"
    for layer, reference in zip(cache.layers, full.layers):
        want = QuantOptions(**options).codec(shape, layer.layer_idx)
        for tier in layer.tiers[1:]:
            codec = tier.codec
            assert (codec.levels, codec.scale_dtype, codec.rotate) == (want.levels, want.scale_dtype, want.rotate)
            codebook = options.get("codebook", "uniform") if tier.bits <= 4 else "uniform"
            assert tier.key_groups().levels == tier.value_groups().levels == codebook
            keys = _by_position(reference.full.keys, tier.positions)
            values = _by_position(reference.full.values, tier.positions)
            stored_k = dequantize(tier.key_groups(), torch.float32)
            stored_v = dequantize(tier.value_groups(), torch.float32)
            want_k = want.store_keys(keys, tier.positions)
            want_v = want.store_values(values)
            rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
            assert rel(stored_k, want_k) < 0.25 and rel(stored_v, want_v) < 0.25  # 3/4-bit error
            if transformed:  # and not the keys as received: a transform is O(1) away from them
                assert rel(stored_k, keys) > 0.5
            if options.get("rotate") == "random":
                assert codec.rotation is layer.tiers[1].codec.rotation  # one matrix per layer
                assert torch.equal(codec.rotation, random_orthogonal(16, 5 + layer.layer_idx).float())


@pytest.mark.parametrize("options", OPTION_SETS)
def test_attention_equals_a_dense_softmax_over_the_dequantized_tiers(options, monkeypatch):
    """After a prompt and decode steps that re-assign levels (tokens move 16 -> 3 -> 2 bits through the codec),
    attention through the layer's tiers equals one float64 softmax over every tier's dequantized keys and values
    in the model's basis."""
    monkeypatch.setenv("KVSTACK_KERNELS", "torch")
    monkeypatch.setattr(engine, "KEY_BLOCK", 8)  # several key blocks per tier
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(stack(scorer="h2o", n_sink=2, recent=4, group_size=8, tiers=LOW_BITS, **options))
    with kvstack.applied(model, spec), torch.no_grad():
        *_, cache = drive(model, None, prefill=40, steps=9, batch=2)  # re-assigns at 40 and 48 tokens
    for layer in cache.layers:
        assert counts(layer)["quantized2"] > 0
        query = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(layer.layer_idx), dtype=torch.float64)
        out, _ = engine.attend(layer, query, StatsRequest(), padded=True, scaling=0.25, softcap=None,
                               sliding_window=None)
        torch.testing.assert_close(out, dense(layer, query, 0.25), rtol=1e-5, atol=1e-5)


def test_a_random_rotation_comes_out_of_the_budget_before_any_token():
    """head_dim 64: the float32 matrix (16 KiB a layer) is more than ratio 0.25 of 40 tokens (10 KiB): nothing is kept
    and no matrix is drawn; at 256 tokens (64 KiB) it is, and the levels fill what is left."""
    model = tiny_model("llama", head_dim=64)
    spec = kvstack.StackSpec.load(options_stack(stack_budget={"ratio": 0.25}, rotate="random"))
    for n, kept in ((40, False), (256, True)):
        cache, _ = prefill(model, spec, n)
        held = cache.memory_bytes()
        assert held <= 0.25 * cache.full_bytes()
        for layer in cache.layers:
            assert (layer.tiers[1].codec.rotation is not None) == kept
            assert (int(layer.kept_counts().max()) > 0) == kept
    assert held > 0.2 * cache.full_bytes()


def test_with_a_fill_tier_the_tokens_the_matrix_would_cost_are_kept_at_16_bits_and_the_matrix_goes_with_the_codes():
    """The same budget with a 16-bit fill tier: at 40 tokens the layer keeps 16-bit tokens alone in the bytes the
    matrix would take (``LevelSplit.alone``), drawing none; at 256 tokens it codes, with the matrix; and when
    ``keep_at_most`` empties the layer, the matrix is dropped with the last code."""
    model = tiny_model("llama", head_dim=64)
    tiers = [{"fill": True, "bits": 16}, {"rest": True, "bits": 3}]
    spec = kvstack.StackSpec.load(options_stack(tiers, stack_budget={"ratio": 0.25}, rotate="random"))
    for n, coded in ((40, False), (256, True)):
        cache, _ = prefill(model, spec, n)
        assert cache.memory_bytes() <= 0.25 * cache.full_bytes()
        for layer in cache.layers:
            assert (layer.tiers[1].codec.rotation is not None) == coded == (layer.tiers[1].num_tokens > 0)
            assert int(layer.kept_counts().max()) == layer.stages[0].split_for(layer).cap(n) > 0
    layer = cache.layers[0]
    layer.stages[0].keep_at_most(layer, None, 0)  # the window scorer reads no statistics
    assert layer.tiers[1].num_tokens == 0 and layer.tiers[1].codec.rotation is None and layer.memory_bytes() == 0


def test_transform_budget_keeps_short_prompts_at_16_bits_alone_until_coding_keeps_as_many():
    """docs/budgets.md ("Fixed bytes only while something is coded"): under a quarter of SmolLM2's bf16 cache
    ``transform-budget`` keeps a 74-token prompt's 16 best tokens at 16 bits with no coder, where coding beside the
    coders' 11,136 bytes would keep 3; from 89 tokens on it codes, at every length to 2K."""
    shape = smollm2_shape()
    spec = kvstack.StackSpec.load("transform-budget")
    split = spec.stages[0].level_split(shape, torch.bfloat16, spec.budget, None, 0)
    assert split.fixed == 11136
    assert split.cap(74) == split.alone(74) == 16 and split.coded_cap(74, 0) == 3
    assert all(split.alone(n) is not None for n in range(4, 89))
    assert all(split.alone(n) is None and split.cap(n) == split.coded_cap(n, 0) for n in range(89, 2048))


@settings(max_examples=200, deadline=None)
@given(fractions=st.lists(st.integers(1, 60), min_size=1, max_size=3), rest=st.booleans(), fill=st.booleans(),
       top=st.integers(0, 8), n=st.integers(0, 120))
def test_a_level_is_charged_for_the_most_any_row_of_a_batch_holds(fractions, rest, fill, top, n):
    """Rows of a batch keep different numbers of tokens (padding), and each level's tensors hold every row at the
    count of its fullest one. ``LevelSplit.cost`` for ``n`` kept tokens charges each level at least the count of any
    row keeping fewer: a level between two fractions gets one token spare, as its count can fall by one as ``n``
    grows (with fractions 0.5 and 0.1: one token at 5 kept, none at 6)."""
    fractions = [f / 100 for f in fractions]
    cumulative = [sum(fractions[: i + 1]) for i in range(len(fractions))] + ([None] if rest else [])
    levels = len(cumulative) + fill
    split = LevelSplit(None, 1, [lambda k: k] * levels, 1, 0, cumulative, fill=fill)
    charged = [c + spare for c, spare in zip(split.counts(n, top), split.spare)]
    assert split.cost(n, top) == sum(charged)
    for fewer in range(n + 1):
        assert all(c <= most for c, most in zip(split.counts(fewer, top), charged)), (fewer, n)


def test_a_level_between_two_fractions_can_shrink_as_more_tokens_are_kept():
    split = LevelSplit(None, 1, [lambda k: k] * 3, 1, 0, [0.5, 0.6, None])
    assert split.counts(5) == [2, 1, 2] and split.counts(6) == [3, 0, 3]
    assert split.spare == [0, 1, 0] and split.cost(6) == 7


def test_the_memory_bound_counts_the_spare_token_a_padded_row_holds():
    """A middle level (fractions 0.5 and 0.1) holds one token more in a padded row than in the fullest one (1 at 5
    kept, 0 at 6), and its tensors hold both rows at the most: ``memory_bound`` for a batch counts that token, as the
    budget does (``LevelSplit.spare``). Re-assigned every step, no 16-bit slack covers it."""
    model = tiny_model("llama")
    tiers = [{"fraction": 0.5, "bits": 8}, {"fraction": 0.1, "bits": 4}, {"rest": True, "bits": 2}]
    spec = kvstack.StackSpec.load(stack(scorer="key_norm", n_sink=0, every=1, tiers=tiers))
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    with kvstack.applied(model, spec), torch.inference_mode():
        cache = kvstack.cache_for(model)
        model(ids[:, :4], attention_mask=mask[:, :4], cache=cache)
        middle = []
        for t in range(4, 12):
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache)
            middle.append(cache.layers[0].tiers[2].valid().sum(-1)[:, 0].tolist())
            assert cache.memory_bytes() <= spec.memory_bound(model.config, t + 1, batch=2, prefill_len=4)
    assert [0, 1] in middle  # the shorter row held the middle level's token while the fuller one held none


@pytest.mark.parametrize(("preset", "sinks_from", "every_token_from"),
                         [("kivi-3-budget", 17, 358), ("transform-budget", 22, 966)])
def test_the_budget_presets_keep_every_token_from_the_documented_length_with_the_sinks_at_16_bits(
    preset, sinks_from, every_token_from
):
    """docs/quantization.md ("A tier that fills the budget"): under a quarter of SmolLM2's bf16 cache the preset's
    levels, with its 4 sinks at 16 bits, hold every token of a prompt from ``every_token_from`` tokens on (shorter
    ones drop their oldest tokens after the sinks), and the 4 sinks are in the 16-bit fill tier from ``sinks_from``
    tokens on (before, the budget cannot hold them: they yield, the first sinks last; ``transform-budget`` keeps its
    short prompts at 16 bits alone, without the coders' fixed bytes, so its sinks fit much earlier than the 75 tokens
    after which the budget less the coders would hold them)."""
    shape = smollm2_shape()
    spec = kvstack.StackSpec.load(preset)
    split = spec.stages[0].level_split(shape, torch.bfloat16, spec.budget, None, 0)
    short = [n for n in range(8, 2048) if split.cap(n) < n]
    assert max(short) + 1 == every_token_from
    fill = {n: split.fill_count(n, 0, min(split.cap(n), n)) for n in range(4, 2048)}
    assert fill[sinks_from - 1] < 4 and all(fill[n] >= 4 for n in range(sinks_from, 2048))
