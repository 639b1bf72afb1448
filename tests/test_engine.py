"""The layer attention engine (kvstack/stack/engine.py) against a dense float64 softmax over every tier.

Hypothesis draws block sizes (the engine's tile and key block are shrunk so queries and keys split into many
blocks), padding (empty slots), sliding windows, softcap, GQA ratios and every tier kind (full, quantized,
channel-pruned, low-rank state); outputs, per-key masses and OBCache saliency must equal the dense reference to float
rounding. The fast path (SDPA) must equal the tiled path, and no tensor may grow with queries x keys.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kvstack.stack import engine
from kvstack.stack.cache import StackLayer
from kvstack.stack.shape import ModelShape
from kvstack.stack.stats import StatsRequest
from kvstack.stages._channel_tier import ChannelPrunedTier
from kvstack.stages.lowrank import LowRankTier, random_feature_maps
from kvstack.stages.quantize import QuantizedTier
from kvstack.stages.scorers import tier_keys_values

D = 8
SAL_MODES = ("value", "key", "joint")


def make_layer(seed, *, batch, kv_heads, q_len, full, quant, pruned, state, empty_frac, head_positions):
    """A layer whose tiers hold random tokens at random distinct positions before/among the queries."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    seen = full + quant + pruned + q_len + 3
    shape = ModelShape("llama", 1, kv_heads, kv_heads, D, dt, (None,))
    layer = StackLayer(0, shape, [])
    hp = kv_heads if head_positions else 1

    def positions(n, newest=False):
        if newest:  # the forward's own tokens: the last q_len positions
            pos = torch.arange(seen - n, seen, dtype=torch.int32).expand(batch, hp, n).clone()
        else:
            pos = torch.stack([torch.randperm(seen - q_len, generator=g)[:n] for _ in range(batch * hp)])
            pos = pos.to(torch.int32).reshape(batch, hp, n)
        empty = torch.rand(batch, hp, n, generator=g) < empty_frac
        return torch.where(empty, torch.full_like(pos, -1), pos)

    def kv(n):
        return (torch.randn(batch, kv_heads, n, D, generator=g, dtype=dt),
                torch.randn(batch, kv_heads, n, D, generator=g, dtype=dt))

    k, v = kv(full + q_len)
    layer.lazy_initialization(k, v)
    layer.full.append(k, v, torch.cat([positions(full), positions(q_len, newest=True)], -1))
    if quant:
        tier = QuantizedTier(8, 4, D, torch.float32, label="test", name="quantized")  # dequantized to float64
        tier.append(*kv(quant), positions(quant))
        layer.tiers.append(tier)
    if pruned:
        index = torch.stack([torch.randperm(D, generator=g)[: D // 2].sort().values for _ in range(batch * kv_heads)])
        tier = ChannelPrunedTier(index.reshape(batch, kv_heads, -1), None, D, k)
        tier.append(*kv(pruned), positions(pruned))
        layer.tiers.append(tier)
    if state:
        layer.state = LowRankTier(random_feature_maps(4, seed, 1, kv_heads, D, dt)[0], dt, D, kv_heads)
        q0 = torch.zeros(batch, kv_heads, 1, D, dtype=dt)
        layer.state.prepare(q0, D**-0.5)
        sk, sv = kv(5)
        layer.state.absorb(sk, sv, torch.rand(batch, kv_heads, 5, generator=g) > 0.2)
    layer.seen = seen
    layer.awaiting_attention = True
    return layer


def dense_reference(layer, query, scaling, softcap, window, request):
    """Every logit at once (float64), one softmax; masses and saliency from the full weight matrix."""
    b, hq, q_len, _ = query.shape
    h = layer.shape_heads()
    g = hq // h
    q = query.reshape(b, h, g * q_len, D)
    q_pos = torch.arange(layer.seen - q_len, layer.seen).repeat(g)
    parts, values, sizes = [], [], []
    for tier in layer.tiers:
        if not tier.num_tokens:
            sizes.append(0)
            continue
        k, v = (x.to(torch.float64) for x in tier_keys_values(tier))
        lg = q @ k.transpose(-1, -2) * scaling
        if softcap:
            lg = torch.tanh(lg / softcap) * softcap
        pos = tier.positions[:, :, None, :]
        vis = (pos >= 0) & (pos <= q_pos[None, None, :, None])
        if window:
            vis = vis & (pos > q_pos[None, None, :, None] - window)
        parts.append(lg.masked_fill(~vis, -math.inf))
        values.append(v)
        sizes.append(tier.num_tokens)
    logits = torch.cat(parts, -1)
    vals = torch.cat(values, -2)
    state = layer.state.readout(q, scaling) if layer.state is not None else None
    columns = torch.cat([logits, state[0][..., None]], -1) if state is not None else logits
    lse = torch.logsumexp(columns, -1)
    lse0 = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.exp(logits - lse0[..., None])
    out = w @ vals
    if state is not None:
        out = out + torch.exp(state[0] - lse0)[..., None] * state[1]
    out = torch.where(torch.isfinite(lse)[..., None], out, torch.zeros_like(out))
    w5 = w.reshape(b, h, g, q_len, -1)
    o5 = out.reshape(b, h, g, q_len, -1)
    masses, saliency = {}, {}
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    for window_rows in request.mass_windows:
        rows = w5 if window_rows is None else w5[..., -window_rows:, :]
        total = rows.sum(-2).reshape(b, h * g, -1)
        for i, n in enumerate(sizes):
            if n:
                masses[(i, window_rows)] = total[..., bounds[i] : bounds[i + 1]]
    for window_rows, mode in request.saliency:
        ww = w5 if window_rows is None else w5[..., -window_rows:, :]
        oo = o5 if window_rows is None else o5[..., -window_rows:, :]
        v = vals[:, :, None, None]  # [B, H, 1, 1, T, D]
        if mode == "value":
            score = ww * v.norm(dim=-1)
        else:
            score = ww * (v - oo[..., None, :]).norm(dim=-1)
            if mode == "joint":
                score = score / (1 - ww).clamp_min(1e-6)
        if mode == "joint":  # a key holding (almost) all the weight: a / (1 - a) amplifies rounding, no test
            score = torch.where(ww.amax(-2, keepdim=True) > 0.999, torch.full_like(score, math.nan), score)
        total = score.sum(-2).reshape(b, h * g, -1)
        saliency[(window_rows, mode)] = [
            total[..., bounds[i] : bounds[i + 1]] if n else None for i, n in enumerate(sizes)
        ]
    return out.reshape(b, hq, q_len, -1), masses, saliency


@st.composite
def cases(draw):
    q_len = draw(st.integers(1, 12))
    windows = draw(st.lists(st.one_of(st.none(), st.integers(1, 14)), max_size=2, unique=True))
    sal = draw(st.lists(st.tuples(st.one_of(st.none(), st.integers(1, 14)), st.sampled_from(SAL_MODES)),
                        max_size=2, unique=True))
    return dict(
        seed=draw(st.integers(0, 2**16)),
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3])),
        q_len=q_len,
        full=draw(st.integers(0, 20)),
        quant=draw(st.sampled_from([0, 4, 12])),
        pruned=draw(st.integers(0, 6)),
        state=draw(st.booleans()),
        empty_frac=draw(st.sampled_from([0.0, 0.3])),
        head_positions=draw(st.booleans()),
        softcap=draw(st.sampled_from([None, 3.0])),
        window=draw(st.sampled_from([None, 5, 30])),
        tile=draw(st.sampled_from([8, 40, 1 << 20])),
        key_block=draw(st.sampled_from([4, 8, 64])),
        request=StatsRequest(tuple(windows), False, tuple(sal)),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_tiled_engine_equals_the_dense_softmax(case, monkeypatch):
    monkeypatch.setattr(engine, "TILE_ELEMENTS", case["tile"])
    monkeypatch.setattr(engine, "KEY_BLOCK", case["key_block"])
    monkeypatch.setenv("KVSTACK_KERNELS", "torch")
    layer = make_layer(
        case["seed"], batch=case["batch"], kv_heads=case["kv_heads"], q_len=case["q_len"], full=case["full"],
        quant=case["quant"], pruned=case["pruned"], state=case["state"], empty_frac=case["empty_frac"],
        head_positions=case["head_positions"],
    )
    g = torch.Generator().manual_seed(case["seed"] + 1)
    query = torch.randn(case["batch"], case["kv_heads"] * case["group"], case["q_len"], D, generator=g,
                        dtype=torch.float64)
    scaling = D**-0.5
    ref_out, ref_mass, ref_sal = dense_reference(layer, query, scaling, case["softcap"], case["window"],
                                                 case["request"])
    out, stats = engine.attend(layer, query, case["request"], padded=True, scaling=scaling, softcap=case["softcap"],
                               sliding_window=case["window"])
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    assert set(stats.masses) == set(ref_mass)
    for key, mass in ref_mass.items():
        torch.testing.assert_close(stats.mass(*key), mass, rtol=1e-10, atol=1e-12)
    for key, per_tier in ref_sal.items():
        for got, want in zip(stats.saliency[key], per_tier):
            assert (got is None) == (want is None)
            if want is not None:
                got = torch.where(want.isnan(), torch.zeros_like(got), got)
                want = torch.nan_to_num(want, nan=0.0)
                # ||v - o|| is computed as sqrt(|v|^2 + |o|^2 - 2 v.o) (no [.., T, D] difference tensor): where a key
                # carries all the weight, v = o and the cancellation leaves ~sqrt(eps) = 1e-8
                torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-6)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("request_", [StatsRequest(), StatsRequest((None, 32), False, ((32, "joint"),))])
def test_no_tensor_grows_with_queries_times_keys(request_, monkeypatch):
    monkeypatch.setattr(engine, "TILE_ELEMENTS", 4096)
    monkeypatch.setattr(engine, "KEY_BLOCK", 64)
    monkeypatch.setenv("KVSTACK_KERNELS", "torch")
    q_len, keys = 256, 512
    layer = make_layer(0, batch=1, kv_heads=2, q_len=q_len, full=keys - q_len, quant=64, pruned=0, state=True,
                       empty_frac=0.1, head_positions=False)
    query = torch.randn(1, 4, q_len, D, dtype=torch.float64)
    with _LargestTensor() as probe:
        engine.attend(layer, query, request_, padded=True, scaling=D**-0.5, softcap=None, sliding_window=None)
    dense = 4 * q_len * (keys + 64)  # [B, Hq, Q, T]: what a dense merge would hold
    linear = 4 * q_len * D + 2 * (keys + 64) * D  # queries and keys themselves
    assert probe.largest <= max(3 * 4096, linear) < dense // 8


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_fast_path_equals_the_tiled_path(dtype, group, monkeypatch):
    monkeypatch.setenv("KVSTACK_KERNELS", "torch")
    g = torch.Generator().manual_seed(group)
    shape = ModelShape("llama", 1, 2 * group, 2, D, dtype, (None,))
    q_len = 40
    k = torch.randn(2, 2, q_len, D, generator=g).to(dtype)
    v = torch.randn(2, 2, q_len, D, generator=g).to(dtype)
    query = torch.randn(2, 2 * group, q_len, D, generator=g).to(dtype)
    request = StatsRequest((8, 1), True, ((8, "joint"),))
    results = []
    for fast in (True, False):
        layer = StackLayer(0, shape, [])
        layer.update(k, v)
        assert engine._fast_path_applies(layer, engine.Geometry(2, 2, group, q_len, 0.3, None, None, dtype), False)
        # padded=True forces the tiled path on the same tokens
        results.append(engine.attend(layer, query, request, padded=not fast, scaling=0.3, softcap=None,
                                     sliding_window=None))
    (fast_out, fast_stats), (tiled_out, tiled_stats) = results
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast_out, tiled_out, **tol)
    for key in tiled_stats.masses:
        torch.testing.assert_close(fast_stats.masses[key], tiled_stats.masses[key], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fast_stats.saliency[(8, "joint")][0], tiled_stats.saliency[(8, "joint")][0],
                               rtol=1e-6, atol=1e-7)
    assert fast_stats.query is query and fast_stats.output.shape == (2, 2 * group, q_len, D)


def test_statistics_of_every_query_take_the_tiled_path_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(engine, "_sdpa", lambda *a: calls.append(1))
    shape = ModelShape("llama", 1, 2, 2, D, torch.float32, (None,))
    layer = StackLayer(0, shape, [])
    k = torch.randn(1, 2, 6, D)
    layer.update(k, k)
    out, stats = engine.attend(layer, torch.randn(1, 2, 6, D), StatsRequest((None,)), padded=False, scaling=1.0,
                               softcap=None, sliding_window=None)
    assert not calls and out.shape == (1, 2, 6, D)
    torch.testing.assert_close(stats.mass(0).sum(-1), torch.full((1, 2), 6.0))  # each query's weights sum to 1


def test_fast_path_is_taken_only_for_a_fresh_unpadded_prompt():
    shape = ModelShape("llama", 1, 2, 2, D, torch.float32, (None,))
    layer = StackLayer(0, shape, [])
    k = torch.randn(1, 2, 6, D)
    layer.update(k, k)
    geo = engine.Geometry(1, 2, 1, 6, 1.0, None, None, torch.float32)
    assert engine._fast_path_applies(layer, geo, padded=False)
    assert not engine._fast_path_applies(layer, geo, padded=True)
    assert not engine._fast_path_applies(layer, engine.Geometry(1, 2, 1, 6, 1.0, 2.0, None, torch.float32), False)
    assert not engine._fast_path_applies(layer, engine.Geometry(1, 2, 1, 6, 1.0, None, 4, torch.float32), False)
    layer.attend(torch.randn(1, 2, 6, D), scaling=1.0)
    layer.update(k[:, :, :1], k[:, :, :1])  # a second forward: earlier tokens exist
    assert not engine._fast_path_applies(layer, engine.Geometry(1, 2, 1, 1, 1.0, None, None, torch.float32), False)
