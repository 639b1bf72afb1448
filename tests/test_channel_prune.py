"""``kind: channel_prune``: ratio 0 is exact, static equals its pruned model, real bytes saved, composition, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstack
from archs import tiny_model
from kvstack.stack.apply import APPLIED_ATTR
from kvstack.stages._channel_tier import INDEX_BYTES, ChannelPrunedTier

HEAD_DIM, KV_HEADS, LAYERS = 16, 2, 2


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _calibration() -> list[torch.Tensor]:
    return [_ids(24, seed=100 + i) for i in range(2)]


def _spec(*stages: dict, budget: dict | None = None) -> dict:
    return {"stages": list(stages), **({"budget": budget} if budget else {})}


def _dynamic(ratio: float, **kw) -> dict:
    return {"kind": "channel_prune", "ratio": ratio, "window": 4, "recent": 3, **kw}


def _static(ratio: float, value_ratio: float = 0.0) -> dict:
    return {"kind": "channel_prune", "mode": "static", "ratio": ratio, "value_ratio": value_ratio}


@torch.no_grad()
def _stack_logits(model, ids: torch.Tensor, prefill: int):
    cache = kvstack.cache_for(model)
    out = [model(ids[:, :prefill], cache=cache).logits]
    for p in range(prefill, ids.shape[1]):
        out.append(model(ids[:, p : p + 1], cache=cache).logits)
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_ratio_zero_dynamic_is_exact(arch):
    model = tiny_model(arch, dtype=torch.float64)
    ids = _ids(20)
    kvstack.apply(model, "identity")
    reference, _ = _stack_logits(model, ids, 12)
    kvstack.apply(model, _spec(_dynamic(0.0)))
    out, cache = _stack_logits(model, ids, 12)
    kvstack.remove(model)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-10)
    tier = cache.layers[0].tiers[-1]
    assert isinstance(tier, ChannelPrunedTier) and tier.num_tokens == 20 - 3  # the machinery really ran


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_ratio_zero_static_is_exact(arch):
    model = tiny_model(arch, dtype=torch.float64)
    ids = _ids(16)
    reference = model(ids).logits
    kvstack.apply(model, _spec(_static(0.0)), calibration=_calibration())
    out, _ = _stack_logits(model, ids, 10)
    kvstack.remove(model)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_static_stack_equals_the_pruned_model_with_a_full_cache(arch):
    model = tiny_model(arch, dtype=torch.float64)
    ids = _ids(16)
    original = model(ids).logits
    kvstack.apply(model, _spec(_static(0.25, 0.25)), calibration=_calibration())
    out, cache = _stack_logits(model, ids, 10)
    model.set_attn_implementation("sdpa")  # the surgically pruned model, no kvstack cache
    with torch.no_grad():
        pruned_model = model(ids).logits
    model.set_attn_implementation("kvstack")
    spec = getattr(model, APPLIED_ATTR).spec
    channels = spec.stages[0]._channels
    bound = spec.memory_bound(kvstack.ModelShape.from_model(model), 16)
    kvstack.remove(model)
    torch.testing.assert_close(out, pruned_model, rtol=0, atol=1e-10)
    assert (out - original).abs().max() > 1e-3  # something was pruned
    pairs = sum(HEAD_DIM - k.shape[-1] for k, _ in channels) // 2
    values = sum(HEAD_DIM - v.shape[-1] for _, v in channels)
    assert (pairs, values) == (round(0.25 * LAYERS * HEAD_DIM / 2), round(0.25 * LAYERS * HEAD_DIM))
    assert cache.memory_bytes() == bound
    torch.testing.assert_close(model(ids).logits, original, rtol=0, atol=0)  # remove restored the weights


def test_static_key_pruning_keeps_rope_pairs():
    model = tiny_model("llama", dtype=torch.float64)
    kvstack.apply(model, _spec(_static(0.5)), calibration=_calibration())
    channels = getattr(model, APPLIED_ATTR).spec.stages[0]._channels
    kvstack.remove(model)
    assert sum(k.shape[-1] for k, _ in channels) == LAYERS * HEAD_DIM // 2
    for key_index, value_index in channels:
        assert value_index is None
        for head in key_index:
            kept = set(head.tolist())
            assert kept == {c for c in kept if c < HEAD_DIM // 2} | {c + HEAD_DIM // 2 for c in kept if c < HEAD_DIM // 2}
            assert len(kept) % 2 == 0


@settings(max_examples=15, deadline=None)
@given(
    ratio=st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.9375]),
    length=st.integers(1, 20),
    recent=st.integers(0, 6),
)
def test_dynamic_memory_shrinks_by_the_kept_fraction(ratio, length, recent):
    model = tiny_model("llama")
    kvstack.apply(model, _spec(_dynamic(ratio, recent=recent)))
    _, cache = _stack_logits(model, _ids(length), length)
    spec = getattr(model, APPLIED_ATTR).spec
    kvstack.remove(model)
    shape = kvstack.ModelShape.from_model(model)
    assert cache.memory_bytes() == spec.memory_bound(shape, length)  # analytic = actual
    kept = HEAD_DIM - round(ratio * HEAD_DIM)
    pruned_tokens = max(0, length - recent)
    item = 4
    expected = kvstack.full_cache_bytes(shape, length) + LAYERS * length * 4  # + int32 positions
    expected -= LAYERS * pruned_tokens * KV_HEADS * (HEAD_DIM - kept) * item  # dropped key channels
    expected += LAYERS * KV_HEADS * kept * INDEX_BYTES  # the channel index
    assert cache.memory_bytes() == expected
    for layer in cache.layers:
        assert layer.full.num_tokens == min(length, recent)
        assert layer.tiers[-1].keys.shape[-1] == kept


def test_dynamic_keeps_the_channels_queries_and_keys_use():
    model = tiny_model("llama", dtype=torch.float64)
    with torch.no_grad():  # key channels 0 and 8 (one RoPE pair) of every head silenced before RoPE
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight.view(KV_HEADS, HEAD_DIM, -1)
            w[:, [0, HEAD_DIM // 2]] = 0
    kvstack.apply(model, _spec(_dynamic(2 / HEAD_DIM)))
    _, cache = _stack_logits(model, _ids(12), 12)
    kvstack.remove(model)
    for layer in cache.layers:
        index = layer.tiers[-1].key_index
        assert index.shape[-1] == HEAD_DIM - 2
        assert not ({0, HEAD_DIM // 2} & set(index.flatten().tolist()))


def test_dynamic_composes_with_eviction():
    model = tiny_model("llama")
    # 11 tokens' bytes keep 10 (a position each)
    spec = _spec(_dynamic(0.5), {"kind": "evict", "scorer": "window", "n_sink": 2}, budget={"tokens": 11})
    kvstack.apply(model, spec)
    out, cache = _stack_logits(model, _ids(30), 20)
    applied = getattr(model, APPLIED_ATTR).spec
    kvstack.remove(model)
    assert torch.isfinite(out).all()
    for layer in cache.layers:
        assert int(layer.kept_counts().max()) == 10
        assert layer.full.num_tokens == 3 and layer.tiers[-1].num_tokens == 7
        positions = sorted(layer.tiers[-1].positions.flatten().tolist() + layer.full.positions.flatten().tolist())
        assert positions == [0, 1, *range(22, 30)]  # sinks + newest, across both tiers
    assert cache.memory_bytes() == applied.memory_bound(kvstack.ModelShape.from_model(model), 30)


@pytest.mark.parametrize(
    "stage, message",
    [
        (_dynamic(0.01), r"ratio=0.01 .*removes no channel of head_dim 16"),
        (_static(0.95), r"ratio=0.95 .*at most 0.875.*8 RoPE pairs \(head_dim 16, 2 layers\)"),
        (_static(0.01), r"ratio=0.01 .*2 x 8 RoPE pairs \(head_dim 16\)"),
        (_static(0.25, 0.97), r"value_ratio=0.97 .*16 value channels"),
    ],
)
def test_validation_names_the_models_dimensions(stage, message):
    model = tiny_model("llama")
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.apply(model, _spec(stage), calibration=_calibration())
    assert getattr(model, APPLIED_ATTR, None) is None


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"kind": "channel_prune", "ratio": 1.0}, "ratio"),
        ({"kind": "channel_prune", "ratio": -0.1}, "ratio"),
        (_dynamic(0.5, value_ratio=0.5), "value_ratio=0.5 .*dynamic"),
        ({**_static(0.5), "recent": 4}, "recent=4 .*static"),
    ],
)
def test_invalid_specs_are_rejected_on_load(stage, message):
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.StackSpec.load(_spec(stage))


def test_static_rejects_partial_rotary_and_missing_calibration():
    with pytest.raises(kvstack.UnsupportedModelError, match="Phi3"):
        kvstack.apply(tiny_model("phi3"), _spec(_static(0.25)))
    model = tiny_model("llama")
    with pytest.raises(kvstack.SpecError, match="calibration"):
        kvstack.apply(model, _spec(_static(0.25)))
    assert getattr(model, APPLIED_ATTR, None) is None


# --------------------------------------------------------------------- ThinK on KIVI (think-kivi)
def _kivi(bits: int = 4) -> dict:
    return {"kind": "quantize", "bits": bits, "group_size": 4, "residual": 4}


def test_pruning_the_quantized_tier_with_every_channel_kept_is_exact():
    model = tiny_model("llama")
    ids = _ids(22)
    kvstack.apply(model, _spec(_kivi()))
    reference, _ = _stack_logits(model, ids, 13)
    kvstack.apply(model, _spec(_kivi(), {"kind": "channel_prune", "ratio": 0.0, "window": 4}))
    out, cache = _stack_logits(model, ids, 13)
    kvstack.remove(model)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    for layer in cache.layers:  # the machinery ran: the quantized tier carries an index, no channel tier exists
        assert layer.tiers[-1].key_index.shape[-1] == HEAD_DIM
        assert not any(isinstance(t, ChannelPrunedTier) for t in layer.tiers)


@torch.no_grad()
def test_narrowing_drops_whole_key_columns_of_the_quantized_tier():
    from kvstack.stages.quantize import QuantizedTier

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, KV_HEADS, 8, HEAD_DIM, generator=g), torch.randn(2, KV_HEADS, 8, HEAD_DIM, generator=g)
    positions = torch.arange(8, dtype=torch.int32).expand(2, 1, -1)
    tier = QuantizedTier(4, 4, 4, torch.float32, label="test", name="quantized")
    tier.append(keys, values, positions)
    slots = torch.arange(8).expand(2, 1, -1)
    before = tier.gather(slots)[0]
    index = torch.stack([torch.randperm(HEAD_DIM, generator=g)[:6].sort().values for _ in range(2 * KV_HEADS)])
    index = index.view(2, KV_HEADS, 6)
    assert tier.keep_key_channels(index, HEAD_DIM)
    after = tier.gather(slots)[0]
    mask = torch.zeros(2, KV_HEADS, 1, HEAD_DIM).scatter(-1, index[:, :, None, :], 1.0)
    torch.testing.assert_close(after, before * mask, rtol=0, atol=0)  # kept channels unchanged, nothing requantized
    query = torch.randn(2, KV_HEADS, 3, HEAD_DIM, generator=g)
    keys_read = tier.attention_block(0, 8, torch.float32)[0]  # the narrowed keys attention reads

    def logits(q):
        return tier.attention_query(q) @ keys_read.transpose(-1, -2)

    assert keys_read.shape[-1] == 6
    torch.testing.assert_close(logits(query), logits(query * mask))  # dropped channels play no part
    assert tier.key_codes.shape[-1] == 6 and tier.kernel_data() is None
    tier.append(keys, values, positions + 8)  # later tokens arrive narrowed
    torch.testing.assert_close(tier.gather(slots + 8)[0], before * mask, rtol=0, atol=0)


@settings(max_examples=12, deadline=None)
@given(
    ratio=st.sampled_from([0.25, 0.5, 0.875]),
    prefill=st.integers(1, 24),
    steps=st.integers(0, 9),
    bits=st.sampled_from([2, 4, 8]),
)
def test_think_on_kivi_memory_is_exact_and_keys_shrink(ratio, prefill, steps, bits):
    model = tiny_model("llama")
    kvstack.apply(model, _spec(_kivi(bits), {"kind": "channel_prune", "ratio": ratio, "window": 4}))
    _, cache = _stack_logits(model, _ids(prefill + steps), prefill)
    spec = getattr(model, APPLIED_ATTR).spec
    kvstack.remove(model)
    shape = kvstack.ModelShape.from_model(model)
    seen = prefill + steps
    assert cache.memory_bytes() == spec.memory_bound(shape, seen, prefill_len=prefill)
    kivi_only = kvstack.StackSpec.load(_spec(_kivi(bits))).memory_bound(shape, seen, prefill_len=prefill)
    kept = HEAD_DIM - round(ratio * HEAD_DIM)
    quantized = cache.layers[0].tiers[-1]
    if quantized.num_tokens:
        saved = LAYERS * KV_HEADS * (HEAD_DIM - kept) * (quantized.num_tokens * bits // 8 + 2 * 4 * quantized.num_tokens // 4)
        assert cache.memory_bytes() == kivi_only - saved + LAYERS * KV_HEADS * kept * INDEX_BYTES


def test_think_on_kivi_chooses_thinks_channels_from_every_prompt_key():
    """The quantize stage moves most of the prompt out of the full tier before channels are chosen: the choice still
    sees every key (8-bit: the same channels as ThinK alone on the full-precision prompt)."""
    model = tiny_model("llama")
    ids = _ids(30)
    kvstack.apply(model, _spec(_dynamic(0.5)))
    _, alone = _stack_logits(model, ids, 30)
    kvstack.apply(model, _spec(_kivi(8), {"kind": "channel_prune", "ratio": 0.5, "window": 4}))
    _, composed = _stack_logits(model, ids, 30)
    kvstack.remove(model)
    for a, c in zip(alone.layers, composed.layers):
        assert c.tiers[-1].num_tokens >= 24  # most of the prompt was quantized before the choice
        torch.testing.assert_close(c.tiers[-1].key_index, a.tiers[-1].key_index, rtol=0, atol=0)


def test_static_pruning_narrows_the_quantized_tier_too():
    model = tiny_model("llama", dtype=torch.float32)
    ids = _ids(20)
    kvstack.apply(model, _spec(_kivi(8), _static(0.25)), calibration=_calibration())
    out, cache = _stack_logits(model, ids, 12)
    spec = getattr(model, APPLIED_ATTR).spec
    kvstack.remove(model)
    assert torch.isfinite(out).all()
    assert cache.memory_bytes() == spec.memory_bound(kvstack.ModelShape.from_model(model), 20, prefill_len=12)
    widths = {layer.tiers[-1].key_codes.shape[-1] for layer in cache.layers}
    assert sum(HEAD_DIM - w for w in widths) > 0


@pytest.mark.parametrize(
    "stages, message",
    [
        ([_dynamic(0.5), _kivi()], r"stages.0 \(channel_prune\).*after the quantize stage at stages.1"),
        ([_kivi(), _dynamic(0.5)], r"recent=3 .*unset after a quantize stage"),
        (
            [{"kind": "quantized_prune", "bits": 4, "budget": {"tokens": 8}}, {"kind": "channel_prune", "ratio": 0.5}],
            "without quantized_prune",
        ),
    ],
)
def test_composition_order_and_conflicts_are_explained(stages, message):
    with pytest.raises(kvstack.SpecError, match=message):
        kvstack.StackSpec.load(_spec(*stages))


def test_pruned_tokens_evicted_into_the_low_rank_state_fold_their_kept_channels():
    model = tiny_model("llama")
    spec = _spec(
        _kivi(),
        {"kind": "channel_prune", "ratio": 0.5, "window": 4},
        {"kind": "evict", "scorer": "window", "n_sink": 2},
        {"kind": "lowrank", "rank": 4},
        budget={"tokens": 15},  # 15 tokens' bytes: the state (552) and 12 kept tokens with their positions
    )
    kvstack.apply(model, spec)
    out, cache = _stack_logits(model, _ids(30), 20)
    applied = getattr(model, APPLIED_ATTR).spec
    kvstack.remove(model)
    assert torch.isfinite(out).all()
    for layer in cache.layers:
        assert int(layer.kept_counts().max()) == 12
        assert layer.tiers[-1].key_index.shape[-1] == HEAD_DIM // 2
        assert torch.isfinite(layer.state.c).all()  # evicted tokens were folded
    assert cache.memory_bytes() <= applied.memory_bound(kvstack.ModelShape.from_model(model), 30, prefill_len=20)


@pytest.mark.parametrize("stages", [[_static(0.25, 0.25)], [_kivi(), {"kind": "channel_prune", "ratio": 0.5}]])
def test_specs_round_trip_through_yaml(stages):
    spec = kvstack.StackSpec.load(_spec(*stages))
    assert kvstack.StackSpec.load(spec.to_yaml()) == spec
