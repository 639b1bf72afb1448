"""The precision options of the ``quantize`` stage (3 bits, rotations, pre-RoPE keys, nf levels, cheap scales) inside
the stack: spec errors, exact bytes, attention through a tier against a dense softmax over its dequantized keys and
values, pre-RoPE keys recovered from every architecture's own RoPE, beams and eviction.

Numerics of the primitives: tests/test_quant_pack.py and tests/test_quant_rotation.py."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from archs import ARCHS, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stepping import run

import kvstack
from kvstack.kernels.quant_pack import dequantize
from kvstack.kernels.rope import apply_rope, rope_angles
from kvstack.stack import engine
from kvstack.stack.cache import StackLayer, compaction_index
from kvstack.stack.shape import ModelShape
from kvstack.stack.stats import StatsRequest
from kvstack.stages._quant_options import QuantOptions, TierCodec, rope_frequencies
from kvstack.stages.quantize import QuantizationError, QuantizedTier, quantized_token_bytes
from kvstack.stages.scorers import tier_keys_values

FAST = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])
OPTION_SETS = [
    {},
    {"rotate": "hadamard"},
    {"rotate": "random", "rotate_seed": 5},
    {"key_rope": "pre"},
    {"codebook": "nf"},
    {"scale_dtype": "bfloat16"},
    {"scale_dtype": "float8_e4m3fn"},
    {"value_clip": True},
    {"rotate": "hadamard", "key_rope": "pre", "codebook": "nf", "scale_dtype": "float8_e4m3fn"},
    {"rotate": "hadamard", "key_rope": "pre", "codebook": "nf", "scale_dtype": "float8_e4m3fn", "value_clip": True},
]
SCALE_BYTES = {"model": None, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def stage(bits=3, group_size=8, residual=8, value_group_size=None, **options) -> dict:
    st_ = {"kind": "quantize", "bits": bits, "group_size": group_size, "residual": residual, **options}
    if value_group_size is not None:
        st_["value_group_size"] = value_group_size
    return {"name": "kivi-options", "stages": [st_]}


def expected_bytes(config, seen, prefill, batch, bits, g, vg, residual, item=4, scale_item=None, rotation=False):
    """Independent formula: residual tokens in full precision; the rest as b-bit codes (3 bits: 3 bytes per 8 codes)
    + key group scales/zeros + value token scales/zeros in the scale format, one int32 position per token; plus a
    float32 [D, D] matrix per layer for rotate: random, once a token is quantized."""
    h, d, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    e = scale_item or item
    x = prefill - g * (max(prefill - residual, 0) // g) + (seen - prefill)
    r = residual + (x - residual) % g if x >= residual + g else x
    q = seen - r
    full = r * (h * 2 * d * item + 4)
    keys = h * (q * d * bits // 8 + 2 * e * (q // g) * d)
    values = h * (q * d * bits // 8 + 2 * e * q * (d // vg))
    quant = keys + values + 4 * q
    return layers * (batch * (full + quant) + (d * d * 4 if rotation and q else 0))


# ------------------------------------------------------------------------------------------------ spec errors
@pytest.mark.parametrize(
    "options, message",
    [
        ({"bits": 3, "group_size": 4, "residual": 0},
         r"group_size=4 .* multiple of 8 for bits=3 \(8 codes packed in 3"),
        ({"bits": 3, "value_group_size": 4}, r"value_group_size=4 .* multiple of 8 for bits=3"),
        ({"bits": 8, "codebook": "nf"}, r"codebook='nf' is not allowed: uniform with bits=8"),
        ({"rotate": "fourier"}, r"rotate"),
        ({"scale_dtype": "float8_e5m2"}, r"scale_dtype"),
    ],
)
def test_options_are_checked_when_the_spec_loads(options, message):
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.StackSpec.load(stage(**options))


@pytest.mark.parametrize(
    "model_kwargs, options, message",
    [
        ({"dtype": torch.bfloat16}, {"scale_dtype": "bfloat16"},
         r"scale_dtype='bfloat16' is not allowed: 'model' or a format smaller than the model dtype bfloat16 "
         r"\(float8_e4m3fn\)"),
        ({"dtype": torch.float16}, {"scale_dtype": "float16"}, r"scale_dtype='float16' is not allowed"),
        ({"head_dim": 24}, {"rotate": "hadamard"},
         r"rotate='hadamard' is not allowed: a power-of-two head_dim .* head_dim=24\); use rotate: random"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, {"key_rope": "pre"},
         r"key_rope='pre' is not allowed: 'post' for this model: rope_type='dynamic'"),
    ],
)
def test_options_are_checked_against_the_model(model_kwargs, options, message):
    model = tiny_model("llama", **model_kwargs)
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.apply(model, stage(bits=3, **options))
    assert model.config._attn_implementation != "kvstack"


def test_pre_rope_needs_the_model_config():
    shape = ModelShape("llama", 1, 2, 2, 8, torch.float32, (None,))
    with pytest.raises(kvstack.SpecError, match=r"key_rope='pre' .* the shape carries no model config"):
        kvstack.StackSpec.load(stage(key_rope="pre")).validate_for(shape)


def test_pre_rope_refuses_model_types_whose_layout_is_not_checked():
    config = tiny_model("llama").config
    shape = ModelShape.from_config(config)
    other = ModelShape("cohere", *[getattr(shape, f) for f in ("num_layers", "num_q_heads", "num_kv_heads",
                                                               "head_dim", "dtype", "layer_windows")], config=config)
    with pytest.raises(kvstack.SpecError, match=r"model_type='cohere' is not one whose RoPE layout"):
        rope_frequencies(other, 0)


@pytest.mark.parametrize("options", [{"rotate": "hadamard"}, {"key_rope": "pre"}])
def test_transformed_keys_do_not_combine_with_channel_pruning(options):
    spec = {"stages": [stage(**options)["stages"][0], {"kind": "channel_prune", "ratio": 0.5}]}
    with pytest.raises(kvstack.SpecError, match=r"in a stack with channel_prune"):
        kvstack.StackSpec.load(spec)


def test_show_leaves_out_the_seed_unless_the_rotation_is_random():
    assert "rotate_seed" not in kvstack.StackSpec.load(stage(rotate="hadamard")).to_yaml()
    assert "rotate_seed: 3" in kvstack.StackSpec.load(stage(rotate="random", rotate_seed=3)).to_yaml()
    spec = kvstack.StackSpec.load(stage(rotate="random", key_rope="pre", codebook="nf", scale_dtype="bfloat16"))
    assert kvstack.StackSpec.from_yaml(spec.to_yaml()) == spec


# ------------------------------------------------------------------------------------------------ memory
@FAST
@given(
    bits=st.sampled_from([2, 3, 4]),
    g=st.sampled_from([8, 16]),
    groups_residual=st.integers(0, 2),
    vg=st.sampled_from([8, 16]),
    options=st.sampled_from(OPTION_SETS),
    prefill=st.integers(1, 40),
    steps=st.integers(0, 10),
    batch=st.integers(1, 2),
)
def test_memory_bytes_equal_the_analytic_formula_with_every_option(bits, g, groups_residual, vg, options, prefill,
                                                                   steps, batch):
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(stage(bits, g, g * groups_residual, vg, **options))
    ids = torch.randint(3, 128, (batch, prefill + steps), generator=torch.Generator().manual_seed(prefill))
    scale_item = SCALE_BYTES[options.get("scale_dtype", "model")]
    rotation = options.get("rotate") == "random"
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :prefill], cache=cache)
        for t in range(prefill, prefill + steps + 1):
            seen = cache.get_seq_length()
            expected = expected_bytes(model.config, seen, prefill, batch, bits, g, vg, g * groups_residual,
                                      scale_item=scale_item, rotation=rotation)
            assert cache.memory_bytes() == expected == spec.memory_bound(model.config, seen, batch, prefill_len=prefill)
            tier = cache.layers[0].tiers[1]
            if tier.num_tokens:
                sdt = options.get("scale_dtype", "model")
                assert tier.key_scale.dtype == (torch.float32 if sdt == "model" else getattr(torch, sdt))
                assert tier.bytes_per_token() == quantized_token_bytes(
                    cache.shape, torch.float32, bits, g, vg, 4, scale_dtype=tier.key_scale.dtype
                )
            if t < prefill + steps:
                model(ids[:, t : t + 1], cache=cache)


def test_three_bits_hold_three_eighths_of_a_byte_per_code():
    model = tiny_model("llama", dtype=torch.bfloat16, head_dim=64)
    spec = kvstack.StackSpec.load(stage(bits=3, group_size=32, residual=0, value_group_size="head_dim",
                                        scale_dtype="float8_e4m3fn"))
    ids = torch.randint(3, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids, cache=cache)
    tier = cache.layers[0].tiers[1]
    assert tier.key_codes.shape == (1, 2, 96, 64) and tier.value_codes.shape == (1, 2, 256, 24)
    # 3/8 byte per code + (2 bytes per 32 key tokens + 2 bytes per 64 value channels) per element, vs 2 bytes
    per_element = (3 / 8 + 2 / 32 / 2 + 2 / 64 / 2)
    held = cache.memory_report()["by_tier"]["quantized"]
    positions = 256 * 4 * model.config.num_hidden_layers
    assert held - positions == per_element * kvstack.full_cache_bytes(model.config, 256, dtype=torch.bfloat16) / 2


# ------------------------------------------------------------------------------------------------ attention
D = 16


@pytest.mark.parametrize("options", [{}, {"rotate": "hadamard", "codebook": "nf", "scale_dtype": "bfloat16"}])
def test_value_clip_clips_values_only_and_never_adds_error(options):
    config = tiny_model("llama", head_dim=D).config
    shape = ModelShape.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 2, 32, D, generator=g)
    values = torch.randn(2, 2, 32, D, generator=g)
    values[..., 3] *= 5  # a heavy channel sets every value group's range
    pos = torch.arange(32, dtype=torch.int32).expand(2, 1, 32)
    tiers = {}
    for clip in (False, True):
        codec = QuantOptions(**options, value_clip=clip).codec(shape, 0)
        tiers[clip] = QuantizedTier(3, 8, 8, torch.float32, label="test", name="quantized", codec=codec)
        tiers[clip].append(keys, values, pos)
    plain, clipped = tiers[False], tiers[True]
    assert torch.equal(plain.key_codes, clipped.key_codes) and torch.equal(plain.key_scale, clipped.key_scale)
    assert plain.memory_bytes() == clipped.memory_bytes()
    stored = plain.codec.store_values(values)  # what the tier quantizes
    err = {c: (dequantize(t.value_groups(), torch.float32) - stored).pow(2).reshape(2, 2, 32, -1, 8).sum(-1)
           for c, t in tiers.items()}
    assert bool((err[True] <= err[False] * (1 + 1e-6) + 1e-9).all())
    assert float(err[True].sum()) < 0.95 * float(err[False].sum())


def make_layer(seed, codec_options, bits, *, batch=2, kv_heads=2, quant=24, empty_frac=0.2, head_positions=False):
    """A layer with a full tier (the queries' own tokens) and a quantized tier of random post-RoPE keys at random
    positions (some empty)."""
    g = torch.Generator().manual_seed(seed)
    config = tiny_model("llama", head_dim=D).config
    shape = ModelShape.from_config(config, dtype=torch.float64)
    layer = StackLayer(0, shape, [])
    q_len = 3
    seen = quant + 40
    hp = kv_heads if head_positions else 1
    k = torch.randn(batch, kv_heads, q_len, D, generator=g, dtype=torch.float64)
    layer.lazy_initialization(k, k)
    layer.full.append(k, k.flip(-1), torch.arange(seen - q_len, seen, dtype=torch.int32).expand(batch, 1, q_len))
    pos = torch.stack([torch.randperm(seen - q_len, generator=g)[:quant] for _ in range(batch * hp)])
    pos = pos.to(torch.int32).reshape(batch, hp, quant)
    pos = torch.where(torch.rand(batch, hp, quant, generator=g) < empty_frac, torch.full_like(pos, -1), pos)
    # pre-RoPE keys as real models have them: per-channel scales and a few channels with a large mean
    offset = torch.zeros(D)
    offset[[1, 2, D // 2 + 3]] = torch.tensor([6.0, -4.0, 5.0])
    pre = torch.randn(batch, kv_heads, quant, D, generator=g) * torch.linspace(0.2, 2, D) + offset
    cos, sin = rope_angles(pos.clamp_min(0), rope_frequencies(shape, 0))
    keys = apply_rope(pre, cos, sin)  # what the cache receives: post-RoPE keys
    values = torch.randn(batch, kv_heads, quant, D, generator=g)
    opts = QuantOptions(**codec_options)
    tier = QuantizedTier(bits, 8, 8, torch.float32, label="test", name="quantized", codec=opts.codec(shape, 0))
    tier.append(keys, values, pos)
    layer.tiers.append(tier)
    layer.seen = seen
    layer.awaiting_attention = True
    return layer, tier, (keys, values, pos)


def dense(layer, query, scaling):
    """One float64 softmax over every tier's dequantized keys and values (``gather``: the model's basis)."""
    b, hq, q_len, _ = query.shape
    h = layer.shape_heads()
    q = query.reshape(b, h, hq // h * q_len, D)
    q_pos = torch.arange(layer.seen - q_len, layer.seen).repeat(hq // h)
    logits, values = [], []
    for tier in layer.tiers:
        k, v = (x.double() for x in tier_keys_values(tier))
        pos = tier.positions[:, :, None, :]
        vis = (pos >= 0) & (pos <= q_pos[None, None, :, None])
        logits.append((q @ k.transpose(-1, -2) * scaling).masked_fill(~vis, -math.inf))
        values.append(v)
    w = torch.softmax(torch.cat(logits, -1), -1)
    return (w @ torch.cat(values, -2)).reshape(b, hq, q_len, -1)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("head_positions", [False, True])
def test_attention_through_the_tier_equals_dense_attention_over_its_dequantized_tokens(bits, options,
                                                                                        head_positions, monkeypatch):
    if bits == 8 and options.get("codebook") == "nf":
        pytest.skip("nf levels are for 2-4 bits")
    monkeypatch.setenv("KVSTACK_KERNELS", "torch")
    monkeypatch.setattr(engine, "KEY_BLOCK", 8)  # several key blocks: every block re-ropes / un-rotates its own
    monkeypatch.setattr(engine, "TILE_ELEMENTS", 64)
    layer, tier, _ = make_layer(bits, options, bits, head_positions=head_positions)
    # the fused kernel reads uniform 2/4/8-bit codes with model-dtype scales; clipped values are such codes
    assert (tier.kernel_data() is None) == (bool(set(options) - {"value_clip"}) or bits == 3)
    query = torch.randn(2, 4, 3, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out, _ = engine.attend(layer, query, StatsRequest(), padded=True, scaling=D**-0.5, softcap=None,
                           sliding_window=None)
    torch.testing.assert_close(out, dense(layer, query, D**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", OPTION_SETS[1:])
def test_dequantized_keys_are_close_to_what_the_tier_received(options):
    bits = 4 if options.get("codebook") == "nf" else 8
    tol = 0.12 if bits == 4 else 0.02  # well under a wrong rotation's O(1) relative error
    _, tier, (keys, values, pos) = make_layer(0, options, bits, empty_frac=0.0)
    index = torch.arange(tier.num_tokens).expand(2, 1, -1)
    k, v = tier.gather(index)
    order = tier.positions.argsort(-1)  # the tier stores tokens in its own order; compare by position
    src = pos.argsort(-1)
    got_k = k.gather(2, order[..., None].expand(-1, 2, -1, D))
    want_k = keys.gather(2, src[..., None].expand(-1, 2, -1, D))
    rel = (got_k - want_k).norm() / want_k.norm()
    assert rel < tol, float(rel)
    got_v = v.gather(2, order[..., None].expand(-1, 2, -1, D))
    want_v = values.gather(2, src[..., None].expand(-1, 2, -1, D))
    assert (got_v - want_v).norm() / want_v.norm() < tol


def test_pre_rope_keys_quantize_better_than_post_rope_keys():
    """Keys with outlier channels of a consistent sign (what real models have): RoPE turns such a channel pair with
    the position, so post-RoPE per-channel groups span +-the offset; pre-RoPE groups only the noise."""
    errors = {}
    for rope in ("post", "pre"):
        _, tier, (keys, _, pos) = make_layer(1, {"key_rope": rope}, 3, quant=64, empty_frac=0.0)
        k, _ = tier.gather(torch.arange(tier.num_tokens).expand(2, 1, -1))
        order, src = tier.positions.argsort(-1), pos.argsort(-1)
        got = k.gather(2, order[..., None].expand(-1, 2, -1, D))
        want = keys.gather(2, src[..., None].expand(-1, 2, -1, D))
        errors[rope] = float((got - want).pow(2).mean())
    assert errors["pre"] < 0.7 * errors["post"], errors


# ------------------------------------------------------------------------------------------------ RoPE of the models
def _capture_rope(model):
    """Pre- and post-RoPE keys of every layer of one forward, captured around the model's apply_rotary_pos_emb."""
    module = sys.modules[type(model.model).__module__]
    original = module.apply_rotary_pos_emb
    seen = []

    def spy(q, k, cos, sin, *args, **kwargs):
        out = original(q, k, cos, sin, *args, **kwargs)
        seen.append((k.detach().clone(), out[1].detach().clone()))
        return out

    module.apply_rotary_pos_emb = spy
    return module, original, seen


@pytest.mark.parametrize("arch", ARCHS)
def test_un_rotating_the_cached_keys_gives_each_models_pre_rope_keys(arch):
    model = tiny_model(arch)
    shape = ModelShape.from_model(model)
    module, original, seen = _capture_rope(model)
    positions = torch.arange(5, 17)
    try:
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0)),
                  position_ids=positions[None])
    finally:
        module.apply_rotary_pos_emb = original
    assert len(seen) == shape.num_layers
    for layer, (pre, post) in enumerate(seen):
        codec = TierCodec(inv_freq=rope_frequencies(shape, layer))
        stored = codec.store_keys(post, positions.to(torch.int32).expand(1, 1, -1))
        torch.testing.assert_close(stored, pre.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(codec.keys(stored, positions.expand(1, 1, -1)), post.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_rope_frequencies_are_the_models_own(arch):
    model = tiny_model(arch)
    shape = ModelShape.from_model(model)
    rotary = model.model.rotary_emb
    layer_types = getattr(model.config, "layer_types", None) or [None] * shape.num_layers
    for layer in range(shape.num_layers):
        own = getattr(rotary, f"{layer_types[layer]}_inv_freq", None)  # per-layer-type RoPE (Gemma3)
        own = rotary.inv_freq if own is None else own
        assert torch.equal(rope_frequencies(shape, layer), own.float())


def test_scaled_rope_round_trips_with_its_attention_factor():
    """YaRN multiplies cos and sin by an attention factor: the pure inverse rotation gives factor * pre-RoPE keys,
    and re-rotating gives the model's post-RoPE keys back exactly."""
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    model = tiny_model("llama", rope_parameters=params)
    shape = ModelShape.from_model(model)
    factor = model.model.rotary_emb.attention_scaling
    assert factor != 1.0
    module, original, seen = _capture_rope(model)
    positions = torch.arange(100, 110)
    try:
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 10)), position_ids=positions[None])
    finally:
        module.apply_rotary_pos_emb = original
    pre, post = seen[0]
    codec = TierCodec(inv_freq=rope_frequencies(shape, 0))
    stored = codec.store_keys(post, positions.expand(1, 1, -1))
    torch.testing.assert_close(stored, factor * pre, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(codec.keys(stored, positions.expand(1, 1, -1)), post, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ in the stack
@pytest.mark.parametrize("arch", ARCHS)
def test_every_option_runs_on_every_architecture(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    options = {"rotate": "hadamard", "key_rope": "pre", "codebook": "nf", "scale_dtype": "bfloat16"}
    spec = kvstack.StackSpec.load(stage(bits=3, group_size=8, residual=0, **options))
    cache, out = run(model, spec, ids, 20)
    assert bool(torch.isfinite(out).all())
    assert cache.memory_bytes() == spec.memory_bound(model.config, 30, batch=2, prefill_len=20)


def test_options_close_to_the_identity_at_eight_bits():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    _, reference = run(model, "identity", ids, 32)
    plain = (run(model, stage(bits=8, residual=0), ids, 32)[1] - reference).abs().mean()
    for options in ({"rotate": "hadamard"}, {"rotate": "random"}, {"key_rope": "pre"},
                    {"rotate": "hadamard", "key_rope": "pre"}):
        err = (run(model, stage(bits=8, residual=0, **options), ids, 32)[1] - reference).abs().mean()
        assert err < 3 * plain + 1e-3, (options, float(err), float(plain))


@pytest.mark.parametrize("options", [{"rotate": "random"}, {"key_rope": "pre", "rotate": "hadamard"}])
def test_beam_reorder_keeps_the_rotation_and_moves_every_packed_tensor(options):
    model = tiny_model("llama")
    spec = stage(bits=3, group_size=8, residual=8, **options)
    ids = torch.randint(3, 128, (2, 25), generator=torch.Generator().manual_seed(4))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :24], cache=cache)
        swapped = kvstack.cache_for(model)
        model(ids[:, :24], cache=swapped)
        swapped.reorder_cache(torch.tensor([1, 0]))
        straight = model(ids[:, 24:], cache=cache).logits
        reordered = model(ids.flip(0)[:, 24:], cache=swapped).logits
    assert torch.equal(straight.flip(0), reordered)
    assert swapped.memory_bytes() == cache.memory_bytes()


@FAST
@given(seed=st.integers(0, 10_000), drop=st.floats(0.05, 0.9), options=st.sampled_from(OPTION_SETS[1:]))
def test_select_keeps_values_and_whole_key_groups_exact_with_options(seed, drop, options):
    _, tier, _ = make_layer(seed, options, 3, quant=24, empty_frac=0.0)
    before_k, before_v = tier.gather(torch.arange(tier.num_tokens).expand(2, 1, -1))
    before_pos = tier.positions.clone()
    keep = torch.rand(2, 2, tier.num_tokens, generator=torch.Generator().manual_seed(seed)) > drop
    index, slot_valid = compaction_index(keep)
    tier.select(index, slot_valid)
    for b in range(2):
        for h in range(2):
            pos = tier.positions[b, h]
            slots = (pos >= 0).nonzero().flatten()
            k, v = tier.gather(slots.expand(2, 1, -1))
            old = {int(p): i for i, p in enumerate(before_pos[b, 0].tolist())}
            rows = [old[int(p)] for p in pos[slots].tolist()]
            assert torch.equal(v[b, h], before_v[b, h, rows])
            for j, i in enumerate(rows):
                if bool(keep[b, h, i // 8 * 8 : i // 8 * 8 + 8].all()):  # its key group was kept whole
                    assert torch.equal(k[b, h, j], before_k[b, h, i])
    assert tier.num_tokens == 8 * math.ceil(int(keep.sum(-1).max()) / 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_models_with_float8_scales(dtype):
    model = tiny_model("llama", dtype=dtype)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(8))
    spec = kvstack.StackSpec.load(stage(bits=3, group_size=8, residual=0, scale_dtype="float8_e4m3fn",
                                        rotate="hadamard", key_rope="pre"))
    cache, out = run(model, spec, ids, 30)
    tier = cache.layers[0].tiers[1]
    assert tier.key_scale.dtype == tier.value_zero.dtype == torch.float8_e4m3fn
    assert bool(torch.isfinite(out).all())
    assert cache.memory_bytes() == spec.memory_bound(model.config, 40, prefill_len=30)


def test_keys_beyond_the_float8_range_raise_a_clear_error():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1e4)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(9))
    with pytest.raises(QuantizationError, match=r"layer 0, quantize: cannot quantize keys to 3 bits: .*float8_e4m3fn"):
        run(model, stage(bits=3, residual=0, scale_dtype="float8_e4m3fn"), ids, 16)


def test_the_options_mix_into_quantized_prune_without_shadowing_its_levels():
    from kvstack.stages.quantized_prune import QuantizedPruneSpec

    spec = QuantizedPruneSpec(tiers=[{"fraction": 0.5, "bits": 16}, {"rest": True, "bits": 3}], codebook="nf",
                              key_rope="pre", scale_dtype="bfloat16")
    assert [level.bits for level in spec.levels()] == [16, 3]
    assert spec.codebook == "nf" and spec.scale_torch_dtype() == torch.bfloat16


def test_a_random_rotation_is_drawn_at_the_first_quantized_token():
    """No matrix before a token is quantized (short prompts hold nothing for it); then the seeded one of its layer."""
    from kvstack.kernels.rotation import random_orthogonal

    model = tiny_model("llama")
    spec = stage(bits=3, group_size=8, residual=8, rotate="random", rotate_seed=5)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids[:, :15], cache=cache)  # 15 < residual + group: nothing quantized yet
        assert all(layer.tiers[1].codec.rotation is None for layer in cache.layers)
        model(ids[:, 15:], cache=cache)
    for layer in cache.layers:
        tier = layer.tiers[1]
        assert tier.num_tokens == 8
        assert torch.equal(tier.codec.rotation, random_orthogonal(16, 5 + layer.layer_idx).float())
