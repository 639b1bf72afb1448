"""``coding: transform`` inside the stack (``kvstack/stages/_transform_tier.py``: transform-coded keys, KIVI values):
spec errors, exact bytes, attention through the tier against plain attention over its decoded tokens, near-identity at
8 bits, token moves that keep codes, re-fitting, every architecture. Numerics of the coder:
tests/test_transform_code.py."""

from __future__ import annotations

import pytest
import torch
from archs import ARCHS, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stepping import run
from transformers import DynamicCache

import kvstack
from kvstack.stack.cache import KVStackCache
from kvstack.stack.errors import KVStackError, SpecError
from kvstack.stack.shape import ModelShape
from kvstack.stages import _transform_tier
from kvstack.stages._transform_tier import TransformCodedTier, coder_bytes, key_basis

FAST = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])


def stage(bits=3, group_size=8, residual=8, **options) -> dict:
    quantize = {"kind": "quantize", "bits": bits, "group_size": group_size, "residual": residual,
                "coding": "transform", "key_rope": "pre", **options}
    return {"name": "transform", "stages": [quantize]}


def tier_of(cache, layer=0) -> TransformCodedTier:
    return next(t for t in cache.layers[layer].tiers if isinstance(t, TransformCodedTier))


# ------------------------------------------------------------------------------------------------ spec errors
def test_post_rope_keys_are_refused_by_name():
    with pytest.raises(SpecError, match=r"key_rope='post' is not allowed: 'pre' with coding: transform"):
        kvstack.StackSpec.load(stage(key_rope="post"))


def test_a_head_wise_selection_is_refused_when_the_spec_loads():
    spec = {"name": "x", "budget": {"ratio": 0.25}, "stages": [
        {"kind": "quantized_prune", "scorer": "h2o", "head_wise": True, "coding": "transform", "key_rope": "pre",
         "tiers": [{"fill": True, "bits": 16}, {"rest": True, "bits": 3}]}]}
    with pytest.raises(SpecError, match=r"coding='transform' is not allowed: 'kivi' in a stack with a head-wise"):
        kvstack.StackSpec.load(spec)
    evict = {"kind": "evict", "scorer": "h2o", "head_wise": True, "budget": {"tokens": 32}}
    evict_first = {"name": "y", "stages": [evict, stage()["stages"][0]]}
    with pytest.raises(SpecError, match="head-wise"):
        kvstack.StackSpec.load(evict_first)


def test_a_cache_from_a_config_alone_says_it_needs_the_weights():
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(stage())
    with pytest.raises(SpecError, match=r"needs the model's key projection weights"):
        KVStackCache(spec, ModelShape.from_config(model.config))


def test_kv_width_not_a_multiple_of_eight_is_refused_against_the_model():
    model = tiny_model("llama", head_dim=4, num_key_value_heads=1)
    with pytest.raises(SpecError, match=r"coding='transform' is not allowed: 'kivi' .* = 4 must be a multiple of 8"):
        kvstack.apply(model, stage(bits=4, group_size=4, residual=0))


# ------------------------------------------------------------------------------------------------ memory
def expected_bytes(model, seen, prefill, batch, bits, g, residual, item=4):
    """Independent count: residual tokens in full precision; each other token ``bits`` per element of every head's
    keys, its values' codes with a scale and zero point per ``g`` channels, and an int32 position; per layer, once a
    token is coded, the key coder (order int16, offsets int32, centre float32 per component; 1.5 x C x 2^bits
    levels)."""
    cfg = model.config
    h, d, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    x = prefill - g * (max(prefill - residual, 0) // g) + (seen - prefill)
    r = residual + (x - residual) % g if x >= residual + g else x
    q = seen - r
    level_item = 4 if item == 4 else 2
    coder = h * d * 10 + -(-3 * h * d * 2**bits // 2) * level_item if q else 0
    per_token = h * d * bits // 8 + h * (d * bits // 8 + 2 * item * (d // g)) + 4
    return layers * (batch * (r * (h * 2 * d * item + 4) + q * per_token) + coder)


@FAST
@given(bits=st.sampled_from([2, 3, 4, 8]), g=st.sampled_from([8, 16]), groups_residual=st.integers(0, 2),
       prefill=st.integers(1, 40), steps=st.integers(0, 10), batch=st.integers(1, 2))
def test_memory_bytes_equal_the_analytic_formula(bits, g, groups_residual, prefill, steps, batch):
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(stage(bits, g, g * groups_residual))
    ids = torch.randint(3, 128, (batch, prefill + steps), generator=torch.Generator().manual_seed(prefill))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :prefill], cache=cache)
        for t in range(prefill, prefill + steps + 1):
            seen = cache.get_seq_length()
            expected = expected_bytes(model, seen, prefill, batch, bits, g, g * groups_residual)
            assert cache.memory_bytes() == expected == spec.memory_bound(model.config, seen, batch, prefill_len=prefill)
            if t < prefill + steps:
                model(ids[:, t : t + 1], cache=cache)


def test_levels_are_float16_in_16_bit_models_and_the_coders_bytes_are_fixed():
    for dtype, item in ((torch.bfloat16, 2), (torch.float32, 4)):
        model = tiny_model("llama", dtype=dtype)
        cache, _ = run(model, stage(bits=3, residual=0), torch.randint(3, 128, (1, 40)), 40)
        tier = tier_of(cache)
        assert tier.key_code.levels.dtype == (torch.float16 if item == 2 else torch.float32)
        per_token = sum(t.nbytes for t in tier.tensors().values())
        assert tier.memory_bytes() - per_token == coder_bytes(cache.shape, 3, dtype)


# ------------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("bits", [2, 4])
def test_the_next_token_reads_the_decoded_tokens_exactly_as_plain_attention_would(bits):
    """After a prompt, every layer's tier is decoded into a DynamicCache; the model's next-token logits through that
    cache and plain attention equal the stack's own (residual 0: every token is coded)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 33), generator=torch.Generator().manual_seed(bits))
    spec = kvstack.StackSpec.load(stage(bits=bits, group_size=8, residual=0))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :32], cache=cache)
        decoded = []
        for layer in cache.layers:
            tier = tier_of(cache, layer.layer_idx)
            assert tier.num_tokens == 32 and layer.full.num_tokens == 0
            index = torch.arange(32).expand(2, 1, -1)
            decoded.append(tier.gather(index))
        ours = model(ids[:, 32:], cache=cache).logits
    plain = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(decoded):
        plain.update(k, v, i)
    with torch.no_grad():
        reference = model(ids[:, 32:], cache=plain, position_ids=torch.full((2, 1), 32)).logits
    assert torch.allclose(ours, reference, atol=1e-4, rtol=1e-4)


def test_close_to_the_identity_at_eight_bits_and_ordered_by_bits():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(2))
    _, reference = run(model, "identity", ids, 40)
    kivi8 = (run(model, {"name": "k", "stages": [{"kind": "quantize", "bits": 8, "residual": 0, "group_size": 8}]},
                 ids, 40)[1] - reference).abs().mean()
    errors = {b: float((run(model, stage(bits=b, residual=0), ids, 40)[1] - reference).abs().mean()) for b in (2, 4, 8)}
    assert errors[8] < 3 * float(kivi8) + 1e-3
    assert errors[8] < errors[4] < errors[2]


def test_decoded_keys_are_close_to_what_the_tier_received():
    model = tiny_model("llama", head_dim=32)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        exact = model(ids, use_cache=True).past_key_values
    cache, _ = run(model, stage(bits=4, residual=0), ids, 64)
    tier = tier_of(cache)
    keys, values = tier.gather(torch.arange(64).expand(1, 1, -1))
    k, v = exact.layers[0].keys, exact.layers[0].values
    assert float((keys - k).norm() / k.norm()) < 0.15 and float((values - v).norm() / v.norm()) < 0.15


# ------------------------------------------------------------------------------------------------ moves
@FAST
@given(seed=st.integers(0, 10_000), keep_frac=st.floats(0.1, 0.9))
def test_selecting_tokens_moves_their_codes_unchanged(seed, keep_frac):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(seed))
    cache, _ = run(model, stage(bits=3, residual=0), ids, 40)
    tier = tier_of(cache)
    before_k, before_v = tier.gather(torch.arange(40).expand(2, 1, -1))
    codes = tier.key_codes.clone()
    keep = torch.rand(2, 1, 40, generator=torch.Generator().manual_seed(seed)) < keep_frac
    cache.layers[0].retain(tier, keep, absorb=False)
    kept = tier.positions[tier.positions >= 0].reshape(-1)
    for row in range(2):
        slots = tier.positions[row, 0] >= 0
        pos = tier.positions[row, 0][slots].long()
        assert torch.equal(tier.key_codes[row, 0][slots], codes[row, 0][pos])
        k, v = tier.gather(torch.arange(tier.num_tokens).expand(2, 1, -1))
        assert torch.equal(k[row][:, slots], before_k[row][:, pos])
        assert torch.equal(v[row][:, slots], before_v[row][:, pos])
    assert kept.numel() == int(keep.sum())


def test_a_head_wise_move_reaching_the_tier_is_refused():
    model = tiny_model("llama")
    cache, _ = run(model, stage(bits=3, residual=0), torch.randint(3, 128, (1, 16)), 16)
    tier = tier_of(cache)
    index = torch.stack([torch.arange(8), torch.arange(8, 16)])[None]  # head 0 keeps 0-7, head 1 keeps 8-15
    with pytest.raises(KVStackError, match=r"every head must hold the same tokens"):
        tier.select(index, torch.ones_like(index, dtype=torch.bool))


def test_beam_reorder_moves_the_codes_with_their_rows():
    model = tiny_model("llama")
    cache, _ = run(model, stage(bits=3, residual=0), torch.randint(3, 128, (3, 24)), 24)
    tier = tier_of(cache)
    codes, positions = tier.key_codes.clone(), tier.positions.clone()
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert torch.equal(tier.key_codes, codes[[2, 0, 0]]) and torch.equal(tier.positions, positions[[2, 0, 0]])


def test_the_coders_are_refitted_as_the_tier_doubles_and_stay_the_same_size(monkeypatch):
    monkeypatch.setattr(_transform_tier, "FIT_TOKENS", 64)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(7))
    spec = kvstack.StackSpec.load(stage(bits=3, group_size=8, residual=0))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :8], cache=cache)
        tier = tier_of(cache)
        coder = lambda: tier.memory_bytes() - sum(t.nbytes for t in tier.tensors().values())  # noqa: E731
        fits, sizes = [tier.fitted_on], {coder()}
        for t in range(8, 100):
            model(ids[:, t : t + 1], cache=cache)
            fits.append(tier.fitted_on)
            sizes.add(coder())
        keys, _ = tier.gather(torch.arange(tier.num_tokens).expand(1, 1, -1))
    assert sorted(set(fits)) == [8, 16, 32, 64]  # doubled, then fixed once fitted on FIT_TOKENS
    assert sizes == {coder_bytes(cache.shape, 3, torch.float32)}  # the coder's bytes never changed
    assert bool(torch.isfinite(keys).all())


# ------------------------------------------------------------------------------------------------ architectures
@pytest.mark.parametrize("arch", ARCHS)
def test_transform_coding_runs_on_every_architecture(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    spec = kvstack.StackSpec.load(stage(bits=3, group_size=8, residual=0))
    cache, out = run(model, spec, ids, 20)
    assert bool(torch.isfinite(out).all())
    assert cache.memory_bytes() == spec.memory_bound(model.config, 30, batch=2, prefill_len=20)
    basis = key_basis(cache.shape, 0)
    c = cache.shape.num_kv_heads * cache.shape.head_dim
    assert basis.shape == (c, c) and torch.allclose(basis.T @ basis, torch.eye(c), atol=1e-4)
