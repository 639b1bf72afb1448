"""``coding: transform`` inside the stack (``kvstack/stages/_transform_tier.py``: transform-coded keys, KIVI or
transform-coded values): spec errors, exact bytes, attention through the tier against plain attention over its
decoded tokens, near-identity at 8 bits, token moves that keep codes, re-fitting, every architecture. Numerics of the
coder: tests/test_transform_code.py."""

from __future__ import annotations

import pytest
import torch
from archs import ARCHS, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stepping import run
from transformers import DynamicCache

import kvstack
from kvstack.kernels.rope import apply_rope, rope_angles
from kvstack.stack.cache import KVStackCache
from kvstack.stack.errors import KVStackError, SpecError
from kvstack.stack.shape import ModelShape
from kvstack.stages import _transform_tier
from kvstack.stages._transform_tier import TransformCodedTier, coder_bytes, key_basis, value_basis

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
    with pytest.raises(SpecError, match=r"needs the model's weights or calibrated bases"):
        KVStackCache(spec, ModelShape.from_config(model.config))


def test_kv_width_not_a_multiple_of_eight_is_refused_against_the_model():
    model = tiny_model("llama", head_dim=4, num_key_value_heads=1)
    with pytest.raises(SpecError, match=r"coding='transform' is not allowed: 'kivi' .* = 4 must be a multiple of 8"):
        kvstack.apply(model, stage(bits=4, group_size=4, residual=0))


# ------------------------------------------------------------------------------------------------ memory
def expected_bytes(model, seen, prefill, batch, bits, g, residual, item=4, key_scale="none", value_coding="kivi",
                   prompt_axes=0):
    """Independent count: residual tokens in full precision; each other token ``bits`` per element of every head's
    keys (with ``key_scale: token`` and its scale), its values' codes with a scale and zero point per ``g`` channels
    (``value_coding: transform``: ``bits`` per element, nothing else), and an int32 position; per layer, once a token
    is coded, the key coder (order int16, offsets int32, centre float32 per component; 1.5 x C x 2^bits levels; with
    ``key_scale: token`` a float32 mean per component and one mean RMS), with transform-coded values their coder
    alike, and ``prompt_axes`` reflectors of C numbers each in the model dtype."""
    cfg = model.config
    h, d, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    x = prefill - g * (max(prefill - residual, 0) // g) + (seen - prefill)
    r = residual + (x - residual) % g if x >= residual + g else x
    q = seen - r
    level_item = 4 if item == 4 else 2
    scaled = key_scale == "token"
    one_coder = h * d * 10 + -(-3 * h * d * 2**bits // 2) * level_item
    coded_values = value_coding == "transform"
    axes = prompt_axes * h * d * item
    coder = one_coder * (1 + coded_values) + scaled * (h * d + 1) * 4 + axes if q else 0
    values = h * d * bits // 8 if coded_values else h * (d * bits // 8 + 2 * item * (d // g))
    per_token = h * d * bits // 8 + scaled * item + values + 4
    return layers * (batch * (r * (h * 2 * d * item + 4) + q * per_token) + coder)


@FAST
@given(bits=st.sampled_from([2, 3, 4, 8]), g=st.sampled_from([8, 16]), groups_residual=st.integers(0, 2),
       prefill=st.integers(1, 40), steps=st.integers(0, 10), batch=st.integers(1, 2),
       key_scale=st.sampled_from(["none", "token"]), value_coding=st.sampled_from(["kivi", "transform"]),
       prompt_axes=st.sampled_from([0, 4]))
def test_memory_bytes_equal_the_analytic_formula(bits, g, groups_residual, prefill, steps, batch, key_scale,
                                                 value_coding, prompt_axes):
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(stage(bits, g, g * groups_residual, key_scale=key_scale, value_coding=value_coding,
                                        prompt_axes=prompt_axes))
    ids = torch.randint(3, 128, (batch, prefill + steps), generator=torch.Generator().manual_seed(prefill))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :prefill], cache=cache)
        for t in range(prefill, prefill + steps + 1):
            seen = cache.get_seq_length()
            expected = expected_bytes(model, seen, prefill, batch, bits, g, g * groups_residual, key_scale=key_scale,
                                      value_coding=value_coding, prompt_axes=prompt_axes)
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
@pytest.mark.parametrize(("bits", "key_scale", "value_coding", "prompt_axes"),
                         [(2, "none", "kivi", 0), (4, "none", "kivi", 0), (3, "token", "kivi", 0),
                          (2, "none", "transform", 0), (3, "token", "kivi", 6)])
def test_the_next_token_reads_the_decoded_tokens_exactly_as_plain_attention_would(bits, key_scale, value_coding,
                                                                                  prompt_axes):
    """After a prompt, every layer's tier is decoded into a DynamicCache; the model's next-token logits through that
    cache and plain attention equal the stack's own (residual 0: every token is coded)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 33), generator=torch.Generator().manual_seed(bits))
    spec = kvstack.StackSpec.load(stage(bits=bits, group_size=8, residual=0, key_scale=key_scale,
                                        value_coding=value_coding, prompt_axes=prompt_axes))
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


# ------------------------------------------------------------------------------------------------ prompt_axes
def _k_proj_outputs(model, ids, layer=0) -> torch.Tensor:
    """Independent reference: the layer's pre-RoPE keys of all heads [n, C] float64 (Llama's k_proj outputs)."""
    grabbed = []
    hook = model.model.layers[layer].self_attn.k_proj.register_forward_hook(lambda m, i, o: grabbed.append(o[0]))
    with torch.no_grad():
        model(ids, use_cache=False)
    hook.remove()
    return grabbed[0].double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_axes_lead_the_basis_with_the_prompts_own_principal_axes_and_cost_their_reflectors(dtype):
    """After a prompt whose tokens are all coded, the basis the tier reads is orthonormal and its first r columns are
    the r leading principal axes of that prompt's pre-RoPE keys (up to sign); the cache holds r reflectors of C
    numbers in the model dtype besides what it held without them."""
    model = tiny_model("llama", head_dim=16, dtype=dtype)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    r = 4
    plain, _ = run(model, stage(bits=3, residual=0), ids, 40)
    cache, _ = run(model, stage(bits=3, residual=0, prompt_axes=r), ids, 40)
    tier = tier_of(cache)
    assert tier.axes.dtype == dtype and tuple(tier.axes.shape) == (tier.basis.shape[0], r)
    basis = tier._key_basis("cpu").double()
    c = basis.shape[0]
    assert torch.allclose(basis.T @ basis, torch.eye(c, dtype=basis.dtype), atol=1e-5)
    keys = _k_proj_outputs(model, ids)
    eig, vectors = torch.linalg.eigh(torch.cov(keys.T))
    cosines = (basis[:, :r] * vectors.flip(-1)[:, :r]).sum(0).abs()
    assert bool((cosines > (0.999 if dtype == torch.float32 else 0.99)).all()), cosines
    item = torch.empty((), dtype=dtype).element_size()
    assert cache.memory_bytes() - plain.memory_bytes() == model.config.num_hidden_layers * r * c * item


def test_prompt_axes_recover_what_a_basis_blind_to_the_prompt_loses(monkeypatch):
    """Keys with very unequal channel variances coded in a random orthogonal basis (blind to them) lose much more
    than in the same basis led by the prompt's own axes; all C axes code as well as the keys' principal axes."""
    model = tiny_model("llama", head_dim=16)
    rows = model.model.layers[0].self_attn.k_proj.weight.shape[0]
    gains = torch.logspace(0, 1.5, rows)[torch.randperm(rows, generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.k_proj.weight.mul_(gains[:, None])
    blind = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(1)))[0]
    monkeypatch.setattr(_transform_tier, "key_basis", lambda shape, layer_idx, source="weights": blind)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    exact = _k_proj_outputs(model, ids)

    def error(r: int) -> float:
        tier = tier_of(run(model, stage(bits=2, residual=0, prompt_axes=r), ids, 64)[0])
        decoded = tier.key_code.reconstruct(tier.key_codes[:, 0], tier._key_basis("cpu"))[0].double()
        return float((decoded - exact).pow(2).sum() / exact.pow(2).sum())

    none, some, every = error(0), error(8), error(32)
    assert some < 0.7 * none and every < 0.7 * none, (none, some, every)


def test_prompt_axes_are_refused_beyond_the_key_components_and_inactive_without_transform_coding():
    model = tiny_model("llama")  # C = num_kv_heads x head_dim
    c = model.config.num_key_value_heads * model.config.head_dim
    with pytest.raises(SpecError, match=rf"prompt_axes={c + 1} is not allowed: 0 to num_kv_heads x head_dim = {c}"):
        kvstack.apply(model, stage(bits=3, prompt_axes=c + 1))
    kivi = kvstack.StackSpec.load({"name": "k", "stages": [{"kind": "quantize", "bits": 2, "prompt_axes": 8}]})
    assert "prompt_axes" not in kivi.to_yaml()
    assert "prompt_axes: 8" in kvstack.StackSpec.load(stage(bits=2, prompt_axes=8)).to_yaml()
    with pytest.raises(SpecError, match="prompt_axes"):
        kvstack.StackSpec.load(stage(bits=2, prompt_axes=-1))


def qp_axes(ratio=0.25, **options) -> dict:
    """A budgeted transform-coded quantized_prune stack (a 16-bit fill tier over 3-bit codes)."""
    return {"name": "qp-axes", "budget": {"ratio": ratio}, "stages": [{
        "kind": "quantized_prune", "scorer": "window", "head_wise": False, "n_sink": 4, "coding": "transform",
        "key_rope": "pre", "value_group_size": "head_dim",
        "tiers": [{"fill": True, "bits": 16}, {"rest": True, "bits": 3}], **options}]}


def test_layer_prompt_axes_hold_reflectors_only_in_the_layers_listed_within_each_layers_limit():
    """``layer_prompt_axes: {1: 4}`` (``prompt_axes`` 0 elsewhere): after a prompt and decode steps, layer 1's coded
    tier holds 4 reflectors of C numbers and layer 0's none; the plan charges them to layer 1 alone; every layer keeps
    its limit and the cache the budget."""
    model = tiny_model("llama", head_dim=16)
    ids = torch.randint(3, 128, (1, 208), generator=torch.Generator().manual_seed(7))
    spec = kvstack.StackSpec.load(qp_axes(layer_prompt_axes={1: 4}))
    cache, _ = run(model, spec, ids, 200)
    c = model.config.num_key_value_heads * model.config.head_dim
    assert tier_of(cache, 0).num_tokens > 0 and tier_of(cache, 0).axes is None  # coded, without reflectors
    assert tuple(tier_of(cache, 1).axes.shape) == (c, 4)
    stage, shape = spec.stages[0], ModelShape.from_config(model.config)
    item = torch.empty((), dtype=shape.dtype).element_size()
    assert stage.fixed_bytes(shape, layer_idx=1) - stage.fixed_bytes(shape, layer_idx=0) == 4 * c * item
    for layer in cache.layers:
        assert layer.memory_bytes() <= layer.limit_bytes()
    assert cache.memory_bytes() <= 0.25 * kvstack.full_cache_bytes(model.config, 208)


def test_layer_prompt_axes_override_prompt_axes_per_layer():
    """``prompt_axes: 4`` with ``layer_prompt_axes: {0: 0}`` is the mirror image: reflectors in layer 1 only."""
    model = tiny_model("llama", head_dim=16)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(8))
    cache, _ = run(model, qp_axes(prompt_axes=4, layer_prompt_axes={0: 0}), ids, 200)
    assert tier_of(cache, 0).axes is None and tier_of(cache, 1).axes.shape[1] == 4


def test_layer_prompt_axes_are_refused_by_name():
    model = tiny_model("llama", head_dim=16)
    c = model.config.num_key_value_heads * model.config.head_dim
    layers = model.config.num_hidden_layers
    with pytest.raises(SpecError, match=r"layer_prompt_axes=\{0: 4\} is not allowed: none with coding: kivi"):
        kvstack.StackSpec.load(qp_axes(coding="kivi", key_rope="post", layer_prompt_axes={0: 4}))
    past = rf"layer_prompt_axes=\{{{layers}: 4\}} is not allowed: layer indices 0\.\.{layers - 1}"
    with pytest.raises(SpecError, match=past):
        kvstack.apply(model, qp_axes(layer_prompt_axes={layers: 4}))
    too_many = rf"layer_prompt_axes=\{{0: {c + 1}\}} is not allowed: 0 to num_kv_heads x head_dim = {c} for this"
    with pytest.raises(SpecError, match=too_many):
        kvstack.apply(model, qp_axes(layer_prompt_axes={0: c + 1}))
    with pytest.raises(SpecError, match="layer_prompt_axes"):
        kvstack.StackSpec.load(qp_axes(layer_prompt_axes={0: -1}))
    with pytest.raises(SpecError, match=r"layer_prompt_axes=\{-1: 4\} is not allowed: layer indices from 0"):
        kvstack.StackSpec.load(qp_axes(layer_prompt_axes={-1: 4}))
    assert getattr(model, "_kvstack_applied", None) is None  # each refusal left the model as it was
    assert "layer_prompt_axes:" in kvstack.StackSpec.load(qp_axes(layer_prompt_axes={0: 4})).to_yaml()


# ------------------------------------------------------------------------------------------------ key_scale
def _loud_and_quiet_tier(key_scale: str, scale_dtype: str = "model", dtype=torch.float32):
    """A tier fed 256 tokens whose pre-RoPE keys are Gaussian times a per-token gain from 1/30 to 30 (log-uniform): a
    spread of norms no set of levels fitted to all tokens resolves. Each key comes with its negation, so their mean is
    exactly zero and the centred keys are the keys. Returns (tier, exact post-RoPE keys [1, H, T, D], gains [T])."""
    model = tiny_model("llama", head_dim=16, dtype=dtype)  # C = 32
    spec = kvstack.StackSpec.load(stage(bits=3, residual=0, key_scale=key_scale, scale_dtype=scale_dtype))
    shape = ModelShape.from_model(model)
    codec = spec.stages[0].codec(shape, 0)
    g = torch.Generator().manual_seed(3)
    t, h, d = 256, shape.num_kv_heads, shape.head_dim
    gains = torch.exp(torch.empty(t // 2).uniform_(-3.4, 3.4, generator=g)).repeat(2)
    half = torch.randn(1, h, t // 2, d, generator=g)
    pre = torch.cat([half, -half], 2) * gains[None, None, :, None]
    cos, sin = rope_angles(torch.arange(t), codec.inv_freq)
    keys = apply_rope(pre, cos, sin).to(dtype)
    tier = TransformCodedTier(3, 3, d, dtype, "test", "quantized", torch.eye(h * d), codec,
                              token_scale=key_scale == "token")
    tier.append(keys, torch.randn(1, h, t, d, generator=g).to(dtype), torch.arange(t)[None, None])
    return tier, keys.float(), gains


def test_a_scale_per_token_codes_loud_and_quiet_keys_alike():
    """With ``key_scale: none`` the levels fitted to all tokens lose the quiet keys (their steps are the loud keys'
    size, so a quiet key decodes to about the mean); with ``token`` each key is coded by its own RMS, so every token's
    relative error is about the coder's at 3 bits, whatever its gain."""
    errors = {}
    for key_scale in ("none", "token"):
        tier, keys, gains = _loud_and_quiet_tier(key_scale)
        decoded, _ = tier.gather(torch.arange(256).expand(1, 1, -1))
        errors[key_scale] = (decoded - keys).norm(dim=(1, 3))[0] / keys.norm(dim=(1, 3))[0]  # [T]
    quiet = gains < 0.1
    assert float(errors["none"][quiet].median()) > 0.9  # the quiet ones are lost
    assert float(errors["token"].max()) < 0.35  # 3 bits per element, every gain
    assert float(errors["token"].mean()) < 0.5 * float(errors["none"].mean())


@pytest.mark.parametrize(("dtype", "scale_dtype", "scale_bytes"), [
    (torch.float32, "model", 4), (torch.bfloat16, "model", 2), (torch.bfloat16, "float8_e4m3fn", 1),
])
def test_a_scale_per_token_costs_its_format_and_the_coder_a_mean_and_rms(dtype, scale_dtype, scale_bytes):
    """The scale is stored in the stage's scale format (one byte in float8), and the budget is sized with it."""
    with_scale, _, _ = _loud_and_quiet_tier("token", scale_dtype, dtype)
    without, _, _ = _loud_and_quiet_tier("none", scale_dtype, dtype)
    assert with_scale.key_scale.element_size() == scale_bytes and without.key_scale is None
    assert with_scale.bytes_per_token() - without.bytes_per_token() == scale_bytes
    c = with_scale.key_codes.shape[-1] * 8 // 3
    assert with_scale.memory_bytes() - without.memory_bytes() == 256 * scale_bytes + (c + 1) * 4
    shape = ModelShape.from_model(tiny_model("llama", head_dim=16, dtype=dtype))
    assert coder_bytes(shape, 3, dtype, "token") - coder_bytes(shape, 3, dtype) == (c + 1) * 4


def test_key_scale_acts_only_on_transform_coded_keys():
    kivi = kvstack.StackSpec.load({"name": "k", "stages": [{"kind": "quantize", "bits": 2, "key_scale": "token"}]})
    assert "key_scale" not in kivi.to_yaml()
    assert "key_scale: token" in kvstack.StackSpec.load(stage(bits=2, key_scale="token")).to_yaml()


# ------------------------------------------------------------------------------------------------ moves
@FAST
@given(seed=st.integers(0, 10_000), keep_frac=st.floats(0.1, 0.9), key_scale=st.sampled_from(["none", "token"]),
       value_coding=st.sampled_from(["kivi", "transform"]))
def test_selecting_tokens_moves_their_codes_unchanged(seed, keep_frac, key_scale, value_coding):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(seed))
    cache, _ = run(model, stage(bits=3, residual=0, key_scale=key_scale, value_coding=value_coding), ids, 40)
    tier = tier_of(cache)
    before_k, before_v = tier.gather(torch.arange(40).expand(2, 1, -1))
    codes, value_codes = tier.key_codes.clone(), tier.value_codes.clone()
    keep = torch.rand(2, 1, 40, generator=torch.Generator().manual_seed(seed)) < keep_frac
    cache.layers[0].retain(tier, keep, absorb=False)
    kept = tier.positions[tier.positions >= 0].reshape(-1)
    for row in range(2):
        slots = tier.positions[row, 0] >= 0
        pos = tier.positions[row, 0][slots].long()
        assert torch.equal(tier.key_codes[row, 0][slots], codes[row, 0][pos])
        if value_coding == "transform":
            assert torch.equal(tier.value_codes[row, 0][slots], value_codes[row, 0][pos])
        k, v = tier.gather(torch.arange(tier.num_tokens).expand(2, 1, -1))
        # the same codes decode to the same keys up to the matrix product's rounding, which may depend on how many
        # tokens are decoded together (BLAS blocking): a few float32 ulps of keys of order 1-10 (a token's scale
        # multiplies them), not a change of level
        torch.testing.assert_close(k[row][:, slots], before_k[row][:, pos], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[row][:, slots], before_v[row][:, pos], rtol=1e-5, atol=1e-5)
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


# ------------------------------------------------------------------------------------------------ fractional widths
def pruned(key_bits, bits=3, **options) -> dict:
    """quantized_prune: a quarter of the tokens at 16 bits, the rest transform-coded at ``key_bits`` / ``bits``."""
    tiers = [{"fraction": 0.25, "bits": 16}, {"rest": True, "bits": bits, "key_bits": key_bits}]
    return {"name": "frac", "stages": [{"kind": "quantized_prune", "scorer": "window", "head_wise": False,
                                        "coding": "transform", "key_rope": "pre", "group_size": 8,
                                        "value_group_size": "head_dim", "tiers": tiers, **options}]}


def test_a_fractional_key_width_spends_that_average_and_lands_between_its_neighbours():
    """``key_bits: 1.5`` (and 2.25) on a model with C = 32 key components: the tier's key codes are ``1.5 x 32 / 8``
    = 6 bytes per token, its bytes are what the budget is sized with, and the decoded keys' error falls between the
    neighbouring whole widths'."""
    model = tiny_model("llama", head_dim=16)  # 2 KV heads: C = 32
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = model(ids, use_cache=True).past_key_values
    errors = {}
    for key_bits in (1, 1.5, 2, 2.25, 3):
        spec = kvstack.StackSpec.load(pruned(key_bits, bits=4))
        cache, _ = run(model, spec, ids, 64)
        tier = tier_of(cache)
        assert tier.key_bits == key_bits and tier.name == f"quantized-k{key_bits}v4"
        assert tier.key_codes.shape[-1] == round(key_bits * 32) // 8  # bytes of one token's key code
        assert tier.bytes_per_token() == spec.stages[0].level_costs(cache.shape, torch.float32)[-1]
        index = torch.sort(tier.positions[0, 0]).indices.expand(1, 1, -1)  # slots in position order
        keys, _ = tier.gather(index)
        k = exact.layers[0].keys[:, :, torch.sort(tier.positions[0, 0]).values.long()]
        errors[key_bits] = float((keys - k).norm() / k.norm())
    assert errors[1] > errors[1.5] > errors[2] > errors[2.25] > errors[3]


def test_a_fractional_key_width_keeps_a_budget_and_buys_tokens_between_its_neighbours():
    """Under ``ratio: 0.09`` (fill tier at 16 bits, the rest 2-bit values: no width holds every token) the cache
    holds at most the budget at every key width, and half a bit less per key element keeps more tokens."""
    model = tiny_model("llama", head_dim=16)
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(6))
    full = kvstack.full_cache_bytes(model.config, 200, batch=2)
    kept = {}
    for key_bits in (1, 1.5, 2):
        spec = pruned(key_bits, bits=2, n_sink=4, scale_dtype="float16")
        spec["stages"][0]["tiers"][0] = {"fill": True, "bits": 16}
        spec["budget"] = {"ratio": 0.09}
        cache, out = run(model, spec, ids, 160)
        assert bool(torch.isfinite(out).all())
        assert cache.memory_bytes() <= 0.09 * full
        kept[key_bits] = sum(t.num_tokens for t in cache.layers[0].tiers)
    assert 200 > kept[1] > kept[1.5] > kept[2]


def test_the_sinks_keep_the_fill_tier_when_the_levels_below_could_take_every_byte():
    """Keys at 1.5 bits and values at 2 under ``ratio: 0.1`` cost about the whole budget per token: the levels below
    could hold nearly every token and leave the fill tier nothing. The 4 sinks (``n_sink``: always in the top tier)
    stay at 16 bits after the prompt and every decode step, the oldest other tokens leave instead, and the budget
    holds."""
    model = tiny_model("llama", head_dim=16)
    spec = pruned(1.5, bits=2, n_sink=4, scale_dtype="float16", every=1)
    spec["stages"][0]["tiers"][0] = {"fill": True, "bits": 16}
    spec["budget"] = {"ratio": 0.1}
    spec = kvstack.StackSpec.load(spec)
    ids = torch.randint(3, 128, (1, 220), generator=torch.Generator().manual_seed(8))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :200], cache=cache)
        for t in range(200, 220):
            for layer in cache.layers:
                assert set(range(4)) <= set(layer.full.positions[0, 0].tolist()), layer.full.positions
                assert tier_of(cache, layer.layer_idx).num_tokens < t - 4  # the levels below gave up tokens
            assert cache.memory_bytes() <= 0.1 * kvstack.full_cache_bytes(model.config, t)
            model(ids[:, t : t + 1], cache=cache)


def test_a_layer_whose_share_barely_pays_its_coders_keeps_16_bit_tokens_alone_until_coding_keeps_more():
    """Under ``ratio: 0.25`` of a 40-token prompt a layer's limit is little more than its coders' bytes: coding would
    keep 2 tokens, the fill tier alone (no coder held) keeps 9 at 16 bits, the sinks first. Decoding on, the stack
    codes from the step where coding keeps more (51 tokens on), fitting the coders then; the budget holds at every
    step. When the levels below empty again (``keep_at_most`` to the sinks), the coders go with their last token,
    and the next token fits them afresh."""
    model = tiny_model("llama", head_dim=16)
    spec = pruned(3, bits=3, n_sink=4, scale_dtype="float16", every=1)
    spec["stages"][0]["tiers"][0] = {"fill": True, "bits": 16}
    spec["budget"] = {"ratio": 0.25}
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(8))
    with kvstack.applied(model, kvstack.StackSpec.load(spec)), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :40], cache=cache)
        for layer in cache.layers:
            split = layer.stages[0].split_for(layer)
            assert split.cap(40) == split.alone(40) == 9 and split.coded_cap(40, 0) == 2
            tier = tier_of(cache, layer.layer_idx)
            assert tier.memory_bytes() == 0 and tier.key_code is None
            assert sorted(layer.full.positions[0, 0].tolist())[:4] == [0, 1, 2, 3] and layer.full.num_tokens == 9
        assert cache.memory_bytes() <= 0.25 * kvstack.full_cache_bytes(model.config, 40)
        coded_from = None
        for t in range(40, 69):
            model(ids[:, t : t + 1], cache=cache)
            assert cache.memory_bytes() <= 0.25 * kvstack.full_cache_bytes(model.config, t + 1)
            if coded_from is None and tier_of(cache).num_tokens:
                coded_from = t + 1
                assert tier_of(cache).key_code is not None
        layer = cache.layers[0]
        split = layer.stages[0].split_for(layer)
        assert coded_from == min(n for n in range(41, 70) if split.alone(n) is None) == 51
        tier, before = tier_of(cache), layer.memory_bytes()
        fixed = coder_bytes(cache.shape, 3, torch.float32)
        layer.stages[0].keep_at_most(layer, None, 4)  # the window scorer reads no statistics
        assert tier.num_tokens == 0 and tier.key_code is None and tier.memory_bytes() == 0
        assert before - layer.memory_bytes() >= fixed
        model(ids[:, 69:70], cache=cache)
        assert tier.num_tokens and tier.key_code is not None
        assert cache.memory_bytes() <= 0.25 * kvstack.full_cache_bytes(model.config, 70)


@pytest.mark.parametrize("value_coding", ["kivi", "transform"])
def test_the_recent_window_keeps_the_fill_tier_when_the_levels_below_could_take_every_byte(value_coding):
    """3-bit keys and values under ``ratio: 0.25`` could hold every token (and pay their coders) and leave the fill tier
    fewer tokens than the sinks and the window. With ``recent: 16`` the sinks and the newest 16 positions (at answer
    time: the question and the reply so far) stay at 16 bits after the prompt and after every decode step, the oldest
    others leave to pay for them, and the budget holds — with KIVI values and with transform-coded ones."""
    model = tiny_model("llama", head_dim=16)
    spec = pruned(3, bits=3, n_sink=4, recent=16, scale_dtype="float16", every=1, value_coding=value_coding)
    spec["stages"][0]["tiers"][0] = {"fill": True, "bits": 16}
    spec["budget"] = {"ratio": 0.25}
    ids = torch.randint(3, 128, (1, 220), generator=torch.Generator().manual_seed(9))
    with kvstack.applied(model, kvstack.StackSpec.load(spec), calibration=_calibration()), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :200], cache=cache)
        for t in range(200, 220):
            protected = set(range(4)) | set(range(t - 16, t))
            for layer in cache.layers:
                assert protected <= set(layer.full.positions[0, 0].tolist()), (t, layer.full.positions)
                assert tier_of(cache, layer.layer_idx).num_tokens < t - len(protected)
            assert cache.memory_bytes() <= 0.25 * kvstack.full_cache_bytes(model.config, t)
            model(ids[:, t : t + 1], cache=cache)


@pytest.mark.parametrize(("tiers_key_bits", "options", "model_kw", "message"), [
    (1.3, {}, {}, r"key_bits: 1.3 bits per element is not a multiple of 0.25 in \[0.25, 8\]"),
    (8.5, {}, {}, r"key_bits: 8.5 bits per element is not a multiple of 0.25"),
    (1.5, {"coding": "kivi", "key_rope": "post"}, {},
     r"tiers.key_bits=1.5 is not allowed: 2, 3, 4 or 8 with coding: kivi \(multiples of 0.25 up to 8 with coding: "
     r"transform\)"),
    (1.25, {}, {"head_dim": 8},
     r"tiers.key_bits=1.25 is not allowed: a width whose bits per token, key_bits x 16 key components "
     r"\(num_kv_heads x head_dim\), are a multiple of 8 on this model: 0.5, 1, 1.5, 2"),
])
def test_a_key_width_the_codes_cannot_hold_is_refused_by_name(tiers_key_bits, options, model_kw, message):
    model = tiny_model("llama", **model_kw)
    with pytest.raises(SpecError, match=message):
        kvstack.apply(model, pruned(tiers_key_bits, **options))


# ------------------------------------------------------------------------------------------------ coded values
def test_a_fractional_value_width_spends_that_average_and_lands_between_its_neighbours():
    """``value_bits: 1.5`` (C = 32 value components): 6 bytes of value codes per token and nothing else for the
    values (no scale, no zero point), the bytes the budget is sized with, the coder's bytes fixed, and the decoded
    values' error between the neighbouring widths'."""
    model = tiny_model("llama", head_dim=16)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = model(ids, use_cache=True).past_key_values
    errors = {}
    for value_bits in (1, 1.5, 2, 3):
        spec = pruned(4, bits=2, value_coding="transform")
        spec["stages"][0]["tiers"][-1]["value_bits"] = value_bits
        spec = kvstack.StackSpec.load(spec)
        cache, _ = run(model, spec, ids, 64)
        tier = tier_of(cache)
        assert tier.name == f"quantized-k4v{value_bits}" and tier.value_scale is None and tier.value_zero is None
        assert tier.value_codes.shape[-1] == round(value_bits * 32) // 8
        assert tier.bytes_per_token() == spec.stages[0].level_costs(cache.shape, torch.float32)[-1]
        per_token = sum(t.nbytes for t in tier.tensors().values())
        assert tier.memory_bytes() - per_token == coder_bytes(cache.shape, 4, torch.float32, value_bits=value_bits)
        order = torch.sort(tier.positions[0, 0])
        _, values = tier.gather(order.indices.expand(1, 1, -1))
        v = exact.layers[0].values[:, :, order.values.long()]
        errors[value_bits] = float((values - v).norm() / v.norm())
    assert errors[1] > errors[1.5] > errors[2] > errors[3]


def test_coded_values_keep_a_budget_in_bf16_and_buy_more_tokens_than_kivi_values():
    """An eighth of a bf16 cache: 4 sinks at 16 bits, the rest with 2.5-bit keys and values at 1.5 bits transform-coded
    (6 bytes a token here) or KIVI's 2 bits (4 bytes of codes and 4 of scales and zero points a head): at every step
    the budget holds, and coded values leave room for more tokens, although their coder takes a fixed part of it."""
    model = tiny_model("llama", head_dim=16, dtype=torch.bfloat16)
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(9))
    kept = {}
    for value_coding in ("kivi", "transform"):
        spec = pruned(2.5, bits=2, value_coding=value_coding, n_sink=4, every=4)
        coded = {"value_bits": 1.5} if value_coding == "transform" else {}
        spec["stages"][0]["tiers"] = [{"fill": True, "bits": 16}, {"rest": True, "bits": 2, "key_bits": 2.5, **coded}]
        spec["budget"] = {"ratio": 0.125}
        with kvstack.applied(model, spec), torch.no_grad():
            cache = kvstack.cache_for(model)
            model(ids[:, :260], cache=cache)
            for t in range(260, 300):
                budget = 0.125 * kvstack.full_cache_bytes(model.config, t, dtype=torch.bfloat16)
                assert 0.8 * budget < cache.memory_bytes() <= budget
                model(ids[:, t : t + 1], cache=cache)
        kept[value_coding] = tier_of(cache).num_tokens
    assert kept["transform"] > 1.15 * kept["kivi"]


@pytest.mark.parametrize(("options", "tier", "message"), [
    ({"value_coding": "transform", "coding": "kivi", "key_rope": "post"}, {},
     r"value_coding='transform' is not allowed: 'kivi' unless coding: transform"),
    ({"value_coding": "transform", "rotate": "hadamard"}, {},
     r"rotate='hadamard' is not allowed: 'none' with value_coding: transform"),
    ({"value_coding": "transform", "codebook": "nf"}, {}, r"codebook='nf' is not allowed: 'uniform' with value_coding"),
    ({"value_coding": "transform", "value_clip": True}, {}, r"value_clip=True is not allowed: False with value_coding"),
    ({}, {"value_bits": 1.5}, r"tiers.value_bits=1.5 is not allowed: none with value_coding: kivi"),
    ({"value_coding": "transform"}, {"value_bits": 1.25},
     r"tiers.value_bits=1.25 is not allowed: a width whose bits per token, value_bits x 16 value components"),
    ({"value_coding": "transform"}, {"value_bits": 1.3}, r"value_bits: 1.3 bits per element is not a multiple of 0.25"),
])
def test_value_coding_that_cannot_act_is_refused_by_name(options, tier, message):
    model = tiny_model("llama", head_dim=8)
    spec = pruned(2, bits=2, **options)
    spec["stages"][0]["tiers"][-1].update(tier)
    with pytest.raises(SpecError, match=message):
        kvstack.apply(model, spec)
    assert getattr(model, "_kvstack_applied", None) is None


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


# ------------------------------------------------------------------------------------------------ key_basis
def _calibration(n=2, length=48, seed=11):
    return [torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed + i)) for i in range(n)]


def _projected(model, seqs, layer=0, projection="k_proj"):
    """Independent reference: a projection's outputs (Llama's k_proj: the pre-RoPE keys; v_proj: the values), each
    sequence's first positions left out."""
    grabbed = []
    module = getattr(model.model.layers[layer].self_attn, projection)
    hook = module.register_forward_hook(lambda m, i, o: grabbed.append(o[0]))
    with torch.no_grad():
        for ids in seqs:
            model(ids[None], use_cache=False)
    hook.remove()
    return torch.cat([k[_transform_tier.CALIBRATION_SKIP :] for k in grabbed]).double()


def _assert_principal_axes(basis, cov):
    """``basis`` is orthonormal and diagonalises ``cov``, its columns by decreasing eigenvalue."""
    eig = torch.linalg.eigvalsh(cov).flip(0)
    rotated = basis.T @ cov @ basis
    assert torch.allclose(basis.T @ basis, torch.eye(basis.shape[0], dtype=basis.dtype), atol=1e-5)
    assert torch.allclose(rotated.diagonal(), eig, rtol=1e-4, atol=1e-5 * float(eig[0]))
    off = rotated - torch.diag(rotated.diagonal())
    assert float(off.abs().max()) < 1e-4 * float(eig[0])


@pytest.mark.parametrize(("option", "projection"), [
    ({"key_basis": "calibrated"}, "k_proj"),
    ({"value_coding": "transform"}, "v_proj"),
])
def test_a_calibrated_basis_is_the_principal_axes_of_the_calibration_vectors(option, projection):
    """The keys' basis (``key_basis: calibrated``) and the values' (``value_coding: transform``), fitted in one pass:
    the eigenvectors of the covariance of the layer's pre-RoPE key vectors (k_proj's outputs on Llama) or value
    vectors (v_proj's), all KV heads of a token as one vector, each sequence's first positions left out; removing
    the stack forgets them."""
    def basis_of(shape, layer):
        return key_basis(shape, layer, "calibrated") if projection == "k_proj" else value_basis(shape, layer)

    model = tiny_model("llama", head_dim=16)
    seqs = _calibration()
    with kvstack.applied(model, kvstack.StackSpec.load(stage(bits=2, **option)), calibration=seqs):
        shape = ModelShape.from_model(model)
        for layer in range(model.config.num_hidden_layers):
            vectors = _projected(model, seqs, layer, projection)
            _assert_principal_axes(basis_of(shape, layer).double(), torch.cov(vectors.T))
    with pytest.raises(SpecError, match=r"needs the basis fitted when the stack is applied"):
        basis_of(shape, 0)


def test_a_calibrated_stack_codes_keys_in_that_basis_and_remove_forgets_it():
    model = tiny_model("llama", head_dim=16)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with kvstack.applied(model, stage(bits=2, residual=0, key_basis="calibrated"), calibration=_calibration()):
        shape = ModelShape.from_model(model)
        cache = kvstack.cache_for(model)
        with torch.no_grad():
            model(ids, cache=cache)
        for layer in cache.layers:
            assert tier_of(cache, layer.layer_idx).basis is key_basis(shape, layer.layer_idx, "calibrated")
            weights = key_basis(shape, layer.layer_idx)
            assert not torch.allclose(tier_of(cache, layer.layer_idx).basis.abs(), weights.abs())
    with pytest.raises(SpecError, match=r"key_basis='calibrated' needs the basis fitted when the stack is applied"):
        key_basis(shape, 0, "calibrated")
    weights = run(model, stage(bits=2, residual=0), ids, 40)[0]  # key_basis: weights needs no calibration
    assert tier_of(weights).basis is key_basis(shape, 0)


def test_without_calibration_the_model_samples_its_own_text_deterministically():
    spec = stage(bits=2, key_basis="calibrated")
    rng = torch.random.get_rng_state()
    bases = []
    for _ in range(2):  # two instances of the same model: each samples and fits
        model = tiny_model("llama", head_dim=16)
        with kvstack.applied(model, spec):
            bases.append(key_basis(ModelShape.from_model(model), 0, "calibrated").clone())
    assert torch.equal(torch.random.get_rng_state(), rng)  # the sampling's seed is its own
    assert torch.equal(bases[0], bases[1])
    with kvstack.applied(model, spec, calibration=_calibration()):
        assert not torch.equal(key_basis(ModelShape.from_model(model), 0, "calibrated"), bases[0])


def test_applying_again_reuses_the_fit_until_the_weights_or_the_calibration_change():
    """The second apply of a calibrated stack to the same model runs nothing (no forward, the very same bases); an
    in-place change of a weight or other calibration text fits again."""
    model = tiny_model("llama", head_dim=16)
    spec = stage(bits=2, key_basis="calibrated")
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))

    def fit(calibration=None):
        forwards.clear()
        with kvstack.applied(model, spec, calibration=calibration):
            return key_basis(ModelShape.from_model(model), 0, "calibrated"), len(forwards)

    first, ran = fit()
    assert ran > 0
    again, ran = fit()
    assert ran == 0 and again is first
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    changed, ran = fit()
    assert ran > 0 and changed is not first
    assert fit()[1] == 0
    text, ran = fit(_calibration())
    assert ran == len(_calibration()) and not torch.equal(text, changed)
    assert fit(_calibration())[1] == 0 and fit(_calibration(seed=3))[1] == len(_calibration())


def test_calibration_that_cannot_fit_a_basis_is_refused_and_leaves_the_model_as_it_was():
    model = tiny_model("llama", head_dim=16)
    spec = stage(bits=2, key_basis="calibrated")
    short = [torch.tensor([5, 6, 7, 8])]
    with pytest.raises(SpecError, match=r"calibration holds 0 key\(s\) past the first 4 positions"):
        kvstack.apply(model, spec, calibration=short)
    with pytest.raises(kvstack.CacheUsageError, match="was not prepared"):
        kvstack.remove(model)
    with pytest.raises(SpecError, match=r"calibration\[0\]='Tensor' is not allowed: a non-empty integer tensor"):
        kvstack.apply(model, spec, calibration=[torch.ones(3)])
    model.config.bos_token_id = model.generation_config.bos_token_id = None
    with pytest.raises(SpecError, match=r"samples its calibration from the model's BOS token and this model has none"):
        kvstack.apply(model, spec)


def test_key_basis_acts_only_on_transform_coded_keys():
    kivi = {"name": "k", "stages": [{"kind": "quantize", "bits": 2, "key_basis": "calibrated"}]}
    spec = kvstack.StackSpec.load(kivi)
    assert "key_basis" not in spec.to_yaml() and not spec.model_stages
    assert kvstack.StackSpec.load(stage(bits=2, key_basis="calibrated")).model_stages
    assert not kvstack.StackSpec.load(stage(bits=2)).model_stages


def test_the_key_basis_bench_reports_every_basis_width_and_key_scale_and_near_zero_error_at_eight_bits():
    from kvstack.bench.key_basis import markdown, measure

    model = tiny_model("llama", head_dim=16)
    texts = {"random": [torch.randint(3, 128, (80,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]}
    rows = measure(model, texts, [1, 8], key_scales=("none", "token"), prompt_axes=(32,))
    bases = ("weights", "calibrated", "own", "calibrated+32")
    assert {(r["bits"], r["key_scale"], r["basis"]) for r in rows} == {
        (b, s, n) for b in (1, 8) for s in ("none", "token") for n in bases}
    assert len(rows) == 2 * 2 * 2 * 4
    # all C = 32 of the text's own axes leading the calibrated basis are its own axes: the same error
    for r in rows:
        if r["basis"] == "calibrated+32":
            own = next(o for o in rows if o["basis"] == "own" and
                       (o["text"], o["bits"], o["key_scale"]) == (r["text"], r["bits"], r["key_scale"]))
            assert r["attention_error"] == pytest.approx(own["attention_error"], rel=0.05, abs=1e-6)
    for r in rows:
        assert r["attention_error"] < (1e-3 if r["bits"] == 8 else 1.0)
    for name in bases:
        for key_scale in ("none", "token"):
            at = {r["bits"]: r["attention_error"] for r in rows
                  if r["basis"] == name and r["text"] == "random[0]" and r["key_scale"] == key_scale}
            assert at[8] < at[1]
    assert "| random (2) | 1 | none |" in markdown(rows) and "| random (2) | 8 | token |" in markdown(rows)
    assert "calibrated+32 |" in markdown(rows).splitlines()[0]


@pytest.mark.parametrize("bad", ["x", "16,0"])
def test_the_key_basis_bench_refuses_prompt_axes_it_cannot_build_before_loading_a_model(bad, capsys):
    from kvstack.bench import key_basis

    with pytest.raises(SystemExit):
        key_basis.main(["--prompt-axes", bad, "--model", "/nonexistent"])
    assert f"--prompt-axes {bad!r} is not allowed" in capsys.readouterr().err


def test_the_key_basis_bench_refuses_more_prompt_axes_than_the_model_has_components(monkeypatch, capsys):
    from kvstack.bench import key_basis, models

    model = tiny_model("llama", head_dim=16)  # C = 32
    monkeypatch.setattr(models, "load_causal_lm", lambda source: (model, None))
    with pytest.raises(SystemExit):
        key_basis.main(["--prompt-axes", "16,33", "--model", "tiny"])
    assert "each at most num_kv_heads x head_dim = 32 for this model" in capsys.readouterr().err
