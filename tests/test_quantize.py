"""The ``quantize`` stage (KIVI) inside the stack: exact bytes, identity cases, batches, beams, eviction, errors.

Packing and quantize/dequantize properties of the primitives live in tests/test_quant_pack.py."""

from __future__ import annotations

import math

import pytest
import torch
from archs import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stepping import run

import kvstack
from kvstack.stages.quantize import QuantizationError, QuantizedTier

FAST = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def kivi(bits=4, group_size=8, residual=8, value_group_size=None) -> dict:
    stage = {"kind": "quantize", "bits": bits, "group_size": group_size, "residual": residual}
    if value_group_size is not None:
        stage["value_group_size"] = value_group_size
    return {"name": "kivi", "stages": [stage]}


def expected_bytes(config, seen, prefill, batch, bits, g, vg, residual, item=4):
    """Independent formula: residual tokens in full precision, the rest as codes + key group scales/zeros + value
    token scales/zeros, one int32 position per token, per layer and batch row."""
    h, d, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    x = prefill - g * (max(prefill - residual, 0) // g) + (seen - prefill)
    r = residual + (x - residual) % g if x >= residual + g else x
    q = seen - r
    full = r * (h * 2 * d * item + 4)
    keys = h * (q * d * bits // 8 + 2 * item * (q // g) * d)
    values = h * (q * d * bits // 8 + 2 * item * q * (d // vg))
    quant = keys + values + 4 * q
    return layers * batch * (full + quant)


@FAST
@given(
    bits=st.sampled_from([2, 4, 8]),
    g=st.sampled_from([4, 8, 16]),
    groups_residual=st.integers(0, 2),
    vg=st.sampled_from([4, 8, 16]),
    prefill=st.integers(1, 40),
    steps=st.integers(0, 12),
    batch=st.integers(1, 2),
)
def test_memory_bytes_equal_the_analytic_formula(bits, g, groups_residual, vg, prefill, steps, batch):
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(kivi(bits, g, g * groups_residual, vg))
    ids = torch.randint(3, 128, (batch, prefill + steps), generator=torch.Generator().manual_seed(prefill))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        model(ids[:, :prefill], cache=cache)
        for t in range(prefill, prefill + steps + 1):
            seen = cache.get_seq_length()
            expected = expected_bytes(model.config, seen, prefill, batch, bits, g, vg, g * groups_residual)
            assert cache.memory_bytes() == expected == spec.memory_bound(model.config, seen, batch, prefill_len=prefill)
            full = cache.layers[0].full.num_tokens
            assert full == seen or g * groups_residual <= full <= g * groups_residual + g - 1
            if t < prefill + steps:
                model(ids[:, t : t + 1], cache=cache)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_layers_memory_is_exact(arch):
    model = tiny_model(arch)
    spec = kvstack.StackSpec.load(kivi(bits=4, group_size=4, residual=0))
    ids = torch.randint(3, 128, (1, 36), generator=torch.Generator().manual_seed(0))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        model(ids[:, :13], cache=cache)
        for t in range(13, 36):
            assert cache.memory_bytes() == spec.memory_bound(model.config, cache.get_seq_length(), prefill_len=13)
            model(ids[:, t : t + 1], cache=cache)


def test_two_bit_tier_of_head_dim_128_holds_under_a_fifth_of_fp16():
    model = tiny_model("llama", dtype=torch.float16, head_dim=128)
    spec = kvstack.StackSpec.load(kivi(bits=2, group_size=32, residual=0))
    ids = torch.randint(3, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        model(ids, cache=cache)
    report = cache.memory_report()["by_tier"]
    assert report["full"] == 0
    assert report["quantized"] <= 0.2 * kvstack.full_cache_bytes(model.config, 256, dtype=torch.float16)


@pytest.mark.parametrize("spec", [kivi(bits=16), kivi(bits=2, residual=32)])
def test_bits_16_or_residual_beyond_the_tokens_seen_is_the_identity(spec):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (2, 28), generator=torch.Generator().manual_seed(1))
    _, reference = run(model, "identity", ids, 20)
    _, out = run(model, spec, ids, 20)
    assert torch.equal(out, reference)


def test_quantization_error_shrinks_with_bits():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(2))
    _, reference = run(model, "identity", ids, 32)
    errors = [float((run(model, kivi(bits=b, residual=0), ids, 32)[1] - reference).abs().mean()) for b in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2] > 0


def test_left_padded_batch_matches_each_row_alone():
    model = tiny_model("llama")
    spec = kivi(bits=4, group_size=4, residual=4)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # RoPE positions of each row's own tokens (keys are quantized
    with kvstack.applied(model, spec):  # after RoPE, so row 1 must see the same rotations as when alone)
        cache = kvstack.cache_for(model)
        batched = [model(ids[:, :20], attention_mask=mask[:, :20], position_ids=positions[:, :20], cache=cache)]
        for t in range(20, 30):
            batched.append(
                model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=positions[:, t : t + 1],
                      cache=cache)
            )
        batched = [out.logits[:, -1] for out in batched]
        alone_cache = kvstack.cache_for(model)
        alone = [model(ids[1:, 5:20], cache=alone_cache).logits[:, -1]]
        alone += [model(ids[1:, t : t + 1], cache=alone_cache).logits[:, -1] for t in range(20, 30)]
    assert cache.layers[0].tiers[1].num_tokens > 0
    assert torch.allclose(torch.stack(batched)[:, 1], torch.stack(alone)[:, 0], atol=1e-4)


def test_beam_reorder_moves_every_packed_tensor():
    model = tiny_model("llama")
    spec = kivi(bits=2, group_size=4, residual=4)
    ids = torch.randint(3, 128, (2, 25), generator=torch.Generator().manual_seed(4))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        model(ids[:, :24], cache=cache)
        swapped = kvstack.cache_for(model)
        model(ids[:, :24], cache=swapped)
        swapped.reorder_cache(torch.tensor([1, 0]))
        straight = model(ids[:, 24:], cache=cache).logits
        reordered = model(ids.flip(0)[:, 24:], cache=swapped).logits
    assert torch.equal(straight.flip(0), reordered)
    assert swapped.memory_bytes() == cache.memory_bytes()


def test_beam_search_generates():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    with kvstack.applied(model, kivi(bits=4, group_size=4, residual=4)):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, max_new_tokens=20,
                             min_new_tokens=20, do_sample=False)
    assert out.shape == (1, 32)


def test_eviction_before_quantization_keeps_sinks_and_window_within_the_bound():
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(
        {"budget": {"tokens": 21}, "stages": [{"kind": "evict", "n_sink": 2}, kivi(4, 4, 4)["stages"][0]]}
    )
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(6))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        model(ids[:, :16], cache=cache)
        for t in range(16, 60):
            model(ids[:, t : t + 1], cache=cache)
            seen = cache.get_seq_length()
            layer = cache.layers[0]
            held = sorted(p for tier in layer.tiers for p in tier.positions[0, 0].tolist() if p >= 0)
            assert held == sorted({0, 1} | set(range(max(seen - 18, 0), seen)))
            assert cache.memory_bytes() <= spec.memory_bound(model.config, seen, batch=2, prefill_len=16)


def test_scattered_eviction_composes_and_stays_within_the_bound():
    model = tiny_model("llama")
    stages = [{"kind": "evict", "scorer": "h2o", "recent": 4}, *kivi(2, 4, 4)["stages"]]
    spec = kvstack.StackSpec.load({"budget": {"tokens": 24}, "stages": stages})
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(7))
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        model(ids[:, :30], cache=cache)
        for t in range(30, 70):
            model(ids[:, t : t + 1], cache=cache)
            assert int(cache.layers[1].kept_counts().max()) <= 24
            assert cache.memory_bytes() <= spec.memory_bound(model.config, cache.get_seq_length(), prefill_len=30)


def tier_with(keys, values, g=4, bits=4):
    tier = QuantizedTier(bits, g, keys.shape[-1], keys.dtype, label="test", name="quantized")
    b, _, t, _ = keys.shape
    tier.append(keys, values, torch.arange(t, dtype=torch.int32).expand(b, 1, t))
    return tier


@FAST
@given(seed=st.integers(0, 10_000), drop=st.floats(0.05, 0.9))
def test_select_keeps_exact_positions_values_and_whole_groups(seed, drop):
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 2, 24, 8, generator=gen), torch.randn(2, 2, 24, 8, generator=gen)
    tier = tier_with(keys, values)
    before_k, before_v = tier.gather(torch.arange(24).expand(2, 1, 24))
    keep = torch.rand(2, 2, 24, generator=gen) > drop
    index, slot_valid = kvstack.stack.cache.compaction_index(keep)
    tier.select(index, slot_valid)
    for b in range(2):
        for h in range(2):
            pos = tier.positions[b, h]
            kept = pos[pos >= 0]
            assert sorted(kept.tolist()) == keep[b, h].nonzero().flatten().tolist()
            slots = (pos >= 0).nonzero().flatten()
            k, v = tier.gather(slots.expand(2, 1, -1))
            assert torch.equal(v[b, h], before_v[b, h, kept.long()])
            whole = [p for p in kept.tolist() if bool(keep[b, h, p // 4 * 4 : p // 4 * 4 + 4].all())]
            rows = [i for i, p in enumerate(kept.tolist()) if p in whole]
            assert torch.equal(k[b, h, rows], before_k[b, h, whole])
    assert tier.num_tokens == 4 * math.ceil(int(keep.sum(-1).max()) / 4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), drop=st.floats(0.05, 0.9), bits=st.sampled_from([2, 3, 4]))
def test_merged_groups_hold_the_kept_keys_quantized_together(seed, drop, bits):
    """Once holes reach a group, each (row, head) holds its whole groups' codes, then its other kept keys (in slot
    order, the last repeated into the holes) quantized afresh as one run of groups; before that, every key keeps
    its codes. Rows keep different numbers of whole groups, so a merge must not re-quantize what a row copies."""
    from kvstack.kernels.quant_pack import dequantize, quantize

    g = 8 if bits == 3 else 4
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 2, 48, 8, generator=gen), torch.randn(2, 2, 48, 8, generator=gen)
    tier = tier_with(keys, values, g=g, bits=bits)
    before = tier.gather(torch.arange(48).expand(2, 1, 48))[0]
    keep = torch.rand(2, 2, 48, generator=gen) > drop
    groups = keep.reshape(2, 2, -1, g)
    merged = bool(((groups.any(-1).sum(-1) * g) - keep.sum(-1)).max() >= g)
    tier.select(*kvstack.stack.cache.compaction_index(keep))
    for b in range(2):
        for h in range(2):
            pos = tier.positions[b, h]
            slots = (pos >= 0).nonzero().flatten()
            k = tier.gather(slots.expand(2, 1, -1))[0][b, h]
            kept = pos[slots].long()
            whole = groups[b, h].all(-1).repeat_interleave(g)[kept]
            assert torch.equal(k[whole], before[b, h, kept[whole]])
            rest = kept[~whole]
            if not merged or not len(rest):
                assert torch.equal(k[~whole], before[b, h, rest])
                continue
            run = before[b, h, rest]
            run = torch.cat([run, run[-1:].expand((-len(rest)) % g, -1)])[None, None]
            expected = dequantize(quantize(run, bits, g, "token"), torch.float32)[0, 0, : len(rest)]
            assert torch.equal(k[~whole], expected)


@FAST
@given(seed=st.integers(0, 10_000), steps=st.lists(st.tuples(st.integers(0, 13), st.floats(0.0, 0.9)), max_size=8),
       g=st.sampled_from([4, 8]))
def test_a_tier_never_holds_a_group_beyond_its_tokens(seed, steps, g):
    """After any run of appends (of any size, with padding) and selections (drops anywhere), every (row, head) holds
    fewer than a group of empty slots, so the tier's slots are ``g * ceil(kept / g)`` for the row and head holding
    the most: the cost ``LevelSplit`` charges a level for its kept tokens, with no group for holes."""
    gen = torch.Generator().manual_seed(seed)
    tier, next_pos = None, 0
    for arrivals, drop in steps:
        if arrivals:
            keys, values = torch.randn(2, 2, arrivals, 8, generator=gen), torch.randn(2, 2, arrivals, 8, generator=gen)
            positions = torch.arange(next_pos, next_pos + arrivals, dtype=torch.int32).expand(2, 1, arrivals)
            next_pos += arrivals
            if tier is None:
                tier = QuantizedTier(4, g, 8, torch.float32, label="test", name="quantized")
            tier.append(keys, values, positions)
        if tier is not None and tier.num_tokens:
            keep = (torch.rand(2, 2, tier.num_tokens, generator=gen) >= drop) & tier.valid()
            tier.select(*kvstack.stack.cache.compaction_index(keep))
        if tier is not None:
            kept = tier.valid().sum(-1)
            assert tier.num_tokens == g * math.ceil(int(kept.max()) / g)
            groups = tier.valid().reshape(*kept.shape, -1, g).any(-1).sum(-1)
            assert bool((groups * g - kept < g).all())


def test_dropping_the_oldest_token_leaves_holes_not_requantization():
    keys, values = torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8)
    tier = tier_with(keys, values)
    before = tier.gather(torch.arange(12).expand(1, 1, 12))[0]
    for drop in range(1, 5):  # the sliding-window pattern: one oldest token at a time
        keep = tier.positions >= drop
        tier.select(*kvstack.stack.cache.compaction_index(keep))
        pos = tier.positions[0, 0]
        k = tier.gather((pos >= 0).nonzero().flatten().expand(1, 1, -1))[0]
        assert torch.equal(k[0, 0], before[0, 0, drop:])
    assert tier.num_tokens == 8  # the emptied first group left


def test_constant_and_large_groups_stay_exact_and_finite():
    keys = torch.full((1, 1, 8, 8), 3.5)
    values = torch.full((1, 1, 8, 8), -2.0)
    k, v = tier_with(keys, values).gather(torch.arange(8).expand(1, 1, 8))
    assert torch.equal(k, keys) and torch.equal(v, values)
    big = torch.randn(1, 1, 8, 8, dtype=torch.float16) * 6e4
    k, v = tier_with(big.clamp(-65504, 65504), big.clamp(-65504, 65504), bits=2).gather(torch.arange(8).expand(1, 1, 8))
    assert bool(torch.isfinite(k).all() and torch.isfinite(v).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_runs_in_every_supported_dtype(dtype):
    model = tiny_model("llama", dtype=dtype)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(8))
    cache, out = run(model, kivi(bits=4, residual=0), ids, 30)
    assert cache.layers[0].tiers[1].key_scale.dtype == dtype
    assert bool(torch.isfinite(out).all())


def test_non_finite_keys_raise_a_clear_error():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] = float("nan")
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(9))
    with pytest.raises(QuantizationError, match=r"layer 0, quantize: cannot quantize keys to 4 bits: .*NaN/Inf"):
        run(model, kivi(bits=4, residual=0), ids, 16)


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"value_group_size": 16}, r"value_group_size=16 .* head_dim=8"),
        ({"group_size": 16}, r"value_group_size=16 .* head_dim=8"),
        ({"residual": 12}, r"residual=12 .* multiple of group_size=8"),
        ({"bits": 2, "group_size": 6, "residual": 0}, r"group_size=6 .* multiple of 4"),
    ],
)
def test_invalid_specs_name_the_field_and_the_model_dimension(stage, message, real_model_and_tokenizer):
    model, _ = real_model_and_tokenizer
    spec = {"stages": [{"kind": "quantize", "bits": 4, "group_size": 8, "residual": 16, **stage}]}
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.apply(model, spec)
    assert model.config._attn_implementation != "kvstack"


def test_bits_must_be_a_supported_width():
    with pytest.raises(kvstack.SpecError, match="bits"):
        kvstack.StackSpec.load({"stages": [{"kind": "quantize", "bits": 5}]})


def test_float64_models_are_rejected_with_the_dtype_named():
    model = tiny_model("llama", dtype=torch.float64)
    with pytest.raises(kvstack.SpecError, match="16 for a torch.float64 model"):
        kvstack.apply(model, kivi())
