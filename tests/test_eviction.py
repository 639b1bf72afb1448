"""The evict stage and its scorers against plain-torch references, Algorithm 1, budgets, schedules, padding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from archs import tiny_model

import kvstack
from kvstack.stack.cache import StackLayer
from kvstack.stack.shape import ModelShape
from kvstack.stages.evict import EvictSpec, block_keep

B, HQ, HKV, D = 2, 4, 2, 8
G = HQ // HKV
SHAPE = ModelShape("llama", 1, HQ, HKV, D, torch.float64, (None,))


def run_layer(steps, **fields):
    """Feed (q [B,Hq,n,D], k, v [B,Hkv,n,D]) forwards through one cache layer with an evict stage; returns the layer.
    ``budget="cap"``: the smallest tokens budget under which the stage keeps ``CAP`` tokens (a budget is bytes: each
    kept token also costs its positions and the scorer's records, and the ``every`` slack is inside it)."""
    if fields.get("budget") == "cap":
        fields["budget"] = cap_budget(**{k: v for k, v in fields.items() if k != "budget"})
    spec = EvictSpec(**fields)
    layer = StackLayer(0, SHAPE, [spec.build(SHAPE, None)])
    for q, k, v in steps:
        layer.update(k, v)
        layer.attend(q, scaling=D**-0.5)
    return layer


def random_qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, n, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    return q, k, v


def full_attention(q, k):
    """[B, Hq, n, n] causal softmax weights (the reference every attention scorer is checked against)."""
    n = q.shape[2]
    logits = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * D**-0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, -math.inf).softmax(-1)


def group_mean(x):  # [B, Hq, T] -> [B, Hkv, T]
    return x.reshape(B, HKV, G, -1).mean(2)


def kept_positions(layer):
    pos = layer.full.positions
    return [[sorted(p for p in pos[b, min(h, pos.shape[1] - 1)].tolist() if p >= 0) for h in range(HKV)] for b in range(B)]


def expected_top(score, cap, protected=()):
    """score [B, 1|Hkv, T] -> per (row, head) sorted positions of the top cap (protected positions first)."""
    score = score.clone().expand(B, HKV, -1).clone()
    for p in protected:
        score[..., p] = math.inf
    top = score.topk(cap, dim=-1).indices
    return [[sorted(top[b, h].tolist()) for h in range(HKV)] for b in range(B)]


N, CAP = 24, 10


def cap_budget(**fields):
    seen = N
    for tokens in range(CAP, 4 * CAP):
        if EvictSpec(budget={"tokens": tokens}, **fields).layer_cap(SHAPE, torch.float64, None, 0, seen) == CAP:
            return {"tokens": tokens}
    raise AssertionError("no tokens budget keeps CAP tokens")


def budget():
    return "cap"


def test_key_norm_keeps_lowest_key_norms_per_head():
    q, k, v = random_qkv(N)
    layer = run_layer([(q, k, v)], scorer="key_norm", budget=budget())
    assert kept_positions(layer) == expected_top(-k.norm(dim=-1), CAP)
    assert layer.full.positions.shape[1] == HKV  # head-wise by default


def test_value_key_ratio_is_shared_across_heads():
    q, k, v = random_qkv(N, 1)
    layer = run_layer([(q, k, v)], scorer="value_key_ratio", budget=budget())
    ref = (v.norm(dim=-1) / k.norm(dim=-1)).mean(1, keepdim=True)
    assert kept_positions(layer) == expected_top(ref, CAP)
    assert layer.full.positions.shape[1] == 1


def test_tova_keeps_what_the_last_query_attends_to():
    q, k, v = random_qkv(N, 2)
    layer = run_layer([(q, k, v)], scorer="tova", budget=budget())
    ref = group_mean(full_attention(q, k)[:, :, -1, :]).mean(1, keepdim=True)
    assert kept_positions(layer) == expected_top(ref, CAP)


@pytest.mark.parametrize("group_reduce", ["mean", "max"])
def test_snapkv_window_sum_pooled(group_reduce):
    q, k, v = random_qkv(N, 3)
    w = 4
    layer = run_layer(
        [(q, k, v)], scorer="snapkv", budget=budget(), window=w, kernel=5, pooling="max", group_reduce=group_reduce
    )
    mass = full_attention(q, k)[:, :, -w:, :].sum(2).reshape(B, HKV, G, N)
    mass = mass.amax(2) if group_reduce == "max" else mass.mean(2)
    pooled = F.max_pool1d(mass.reshape(B * HKV, 1, N), 5, 1, 2).reshape(B, HKV, N)
    assert kept_positions(layer) == expected_top(pooled, CAP, protected=range(N - w, N))


def test_h2o_accumulates_over_forwards_normalised_by_queries():
    """Prefill 16 then 8 decode steps with no eviction until the 24th token (every: 15 -> trigger above 24)."""
    q, k, v = random_qkv(N, 4)
    steps = [(q[:, :, :16], k[:, :, :16], v[:, :, :16])] + [
        (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(16, N)
    ]
    layer = run_layer(steps[:-1], scorer="h2o", budget=budget(), every=15)
    assert int(layer.kept_counts().max()) == N - 1  # slack: nothing evicted yet
    layer = run_layer(steps, scorer="h2o", budget=budget(), every=14)
    acc = group_mean(full_attention(q, k).sum(2))
    ref = acc / (N - torch.arange(N, dtype=torch.float64))
    assert kept_positions(layer) == expected_top(ref, CAP)
    assert "h2o" in layer.full.token_data and layer.full.token_data["h2o"].shape == (B, HKV, CAP)


@pytest.mark.parametrize("mode", ["joint", "key", "value"])
def test_obcache_output_change_matches_removing_the_token(mode):
    q, k, v = random_qkv(N, 5)
    w = 3
    layer = run_layer([(q, k, v)], scorer="obcache", budget=budget(), window=w, saliency=mode)
    a = full_attention(q, k)[:, :, -w:, :]  # [B, Hq, w, T]
    vr = v.repeat_interleave(G, 1)
    o = a @ vr
    if mode == "joint":  # the exact output change of dropping token i, computed by dropping it
        sal = torch.zeros(B, HQ, w, N, dtype=torch.float64)
        for i in range(N):
            a2 = a.clone()
            a2[..., i] = 0
            a2 = a2 / a2.sum(-1, keepdim=True)
            sal[..., i] = (a2 @ vr - o).norm(dim=-1)
    elif mode == "key":
        sal = a * (vr[:, :, None, :, :] - o[:, :, :, None, :]).norm(dim=-1)
    else:
        sal = a * vr.norm(dim=-1)[:, :, None, :]
    ref = group_mean(sal.sum(2))
    assert kept_positions(layer) == expected_top(ref, CAP, protected=range(N - w, N))


def test_random_is_seeded_and_keeps_the_budget():
    q, k, v = random_qkv(N, 6)
    a = kept_positions(run_layer([(q, k, v)], scorer="random", budget=budget(), seed=1))
    b = kept_positions(run_layer([(q, k, v)], scorer="random", budget=budget(), seed=1))
    c = kept_positions(run_layer([(q, k, v)], scorer="random", budget=budget(), seed=2))
    assert a == b != c
    assert all(len(h) == CAP for row in a for h in row)


def test_window_with_sinks_and_head_wise_override():
    q, k, v = random_qkv(N, 7)
    layer = run_layer([(q, k, v)], scorer="key_norm", budget=budget(), head_wise=False, n_sink=2, recent=3)
    ref = (-k.norm(dim=-1)).mean(1, keepdim=True)
    assert kept_positions(layer) == expected_top(ref, CAP, protected=[0, 1, N - 3, N - 2, N - 1])
    assert layer.full.positions.shape[1] == 1


def test_a_budget_below_the_protected_sets_keeps_the_sinks_then_the_newest():
    """A ratio budget may hold fewer tokens than the sinks and the recent window (the budget wins): the tokens kept
    are the sinks and then the newest, whatever the scores — not an arbitrary subset of the protected ones."""
    q, k, v = random_qkv(64, 3)
    layer = run_layer([(q, k, v)], scorer="key_norm", budget={"ratio": 0.2}, head_wise=False, n_sink=2, recent=32)
    kept = kept_positions(layer)[0][0]
    assert 2 < len(kept) < 2 + 32
    assert kept == [0, 1, *range(64 - (len(kept) - 2), 64)]


# ------------------------------------------------------------------------------------------- Algorithm 1
def test_algorithm_1_hand_made_example():
    """9 tokens, blocks of 2: b0=[5,5] b1=[1,2] b2=[9,0] b3=[3,3] b4=[0] (newest, partial). Budget 3 blocks."""
    score = torch.tensor([[[5, 5, 1, 2, 9, 0, 3, 3, 0]]], dtype=torch.float32)
    pos = torch.arange(9, dtype=torch.int32)[None, None]
    none = torch.zeros_like(pos, dtype=torch.bool)

    def evicted(agg, s=score, p=pos, prot=none, budget_blocks=3):
        keep = block_keep(s, p, prot, 2, budget_blocks, agg)
        return sorted(int(x) for x in p[~keep & (p >= 0)])

    assert evicted("mean") == [2, 3, 6, 7]  # means 5, 1.5, 4.5, 3 (+ newest 0, protected): b1 and b3 leave
    assert evicted("min") == [2, 3, 4, 5]  # minima 5, 1, 0, 3: b2 then b1
    assert evicted("max") == [2, 3, 6, 7]  # maxima 5, 2, 9, 3
    assert evicted("mean", budget_blocks=5) == []  # not over budget: nothing happens
    protect_b1 = none.clone()
    protect_b1[..., 2] = True
    assert evicted("mean", prot=protect_b1) == [4, 5, 6, 7]  # b1 protected: the next lowest (b3, b2) leave

    # in order, one block at a time as decode proceeds (budget 2 blocks): which block leaves at each step
    s, p = score[..., :5], pos[..., :5]  # b0=[5,5] b1=[1,2] b2=[9] (newest, partial)
    order = []
    for new_score in [0.0, 4.0, 8.0]:  # b2 fills with 0, then the tokens 4 and 8 open and fill a new block
        keep = block_keep(s, p, torch.zeros_like(p, dtype=torch.bool), 2, 2, "mean")
        order.append(sorted(int(x) for x in p[~keep]))
        s, p = s[keep][None, None], p[keep][None, None]
        s = torch.cat([s, torch.tensor([[[new_score]]])], -1)
        p = torch.cat([p, torch.tensor([[[int(p.max()) + 1]]], dtype=torch.int32)], -1)
    # step 1: [b0, b1, (9)] is 3 blocks > 2: b1 (mean 1.5) leaves. step 2: [b0, (9, 0)] is 2 blocks: nothing.
    # step 3: [b0, (9, 0), (4)]: the newest block (4) is protected, (9, 0) (mean 4.5 < 5) leaves.
    assert order == [[2, 3], [], [4, 5]]


def test_block_eviction_in_the_stage_keeps_whole_blocks():
    q, k, v = random_qkv(N, 8)
    layer = run_layer([(q, k, v)], scorer="value_key_ratio", budget={"tokens": 13}, granularity="block", block_size=4)
    ref = (v.norm(dim=-1) / k.norm(dim=-1)).mean(1)  # [B, T]
    for b in range(B):
        means = ref[b].reshape(6, 4).mean(-1)
        means[-1] = math.inf  # the newest block stays
        lost = sorted(means.argsort()[:3].tolist())
        expected = [p for p in range(N) if p // 4 not in lost]
        assert kept_positions(layer)[b][0] == expected


# ------------------------------------------------------------------------------------------- budgets
def test_pyramid_schedule_same_average_decreasing():
    spec = EvictSpec(scorer="window", budget={"tokens": 40}, schedule="pyramid", pyramid_spread=0.5)
    shape = ModelShape("llama", 5, HQ, HKV, D, torch.float32, (None,) * 5)
    caps = [spec.layer_cap(shape, torch.float32, None, i, 1000) for i in range(5)]
    # the bytes of (1.5 .. 0.5) x 40 tokens of 128 bytes, in kept tokens of 132 (their int32 position included)
    assert caps == [int(scale * 40 * 128) // 132 for scale in (1.5, 1.25, 1.0, 0.75, 0.5)] == [58, 48, 38, 29, 19]
    bound = kvstack.StackSpec(stages=[spec]).memory_plan(shape, 1000)
    assert [layer.tokens for layer in bound.layers] == caps


def test_layer_weights_scale_the_schedule_and_keep_the_total():
    """``layer_weights: {0: 3}`` over a pyramid: each layer's share is its pyramid share times its weight, normalised so
    the shares sum to the layer count; the caps and the analytic plan follow, and the budget's total is unchanged."""
    spec = EvictSpec(scorer="window", budget={"tokens": 40}, schedule="pyramid", pyramid_spread=0.5,
                     layer_weights={0: 3})
    shape = ModelShape("llama", 3, HQ, HKV, D, torch.float32, (None,) * 3)
    raw = [3 * 1.5, 1.0, 0.5]
    shares = [spec.layer_scale(i, shape) for i in range(3)]
    assert shares == pytest.approx([3 * r / sum(raw) for r in raw]) and sum(shares) == pytest.approx(3)
    caps = [spec.layer_cap(shape, torch.float32, None, i, 1000) for i in range(3)]
    assert caps == [int(scale * 40 * 128 + 1e-9) // 132 for scale in shares]
    assert [layer.tokens for layer in kvstack.StackSpec(stages=[spec]).memory_plan(shape, 1000).layers] == caps
    model = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(kvstack.SpecError, match=r"layer_weights=\{3: 2.0\} is not allowed: layer indices 0..2"):
        kvstack.apply(model, {"budget": {"tokens": 40}, "stages": [{"kind": "evict", "layer_weights": {3: 2}}]})


def test_spill_unused_gives_a_layer_s_unused_share_to_the_others():
    """``spill_unused`` with ``layer_weights: {0: 3}`` under ``tokens: 40``: after 50 tokens layer 0 keeps all 50 (its
    weighted share, 69 tokens, is more than it can use) and the other two split the rest; after 1000 tokens every
    layer is at its weighted share, as without spilling. The shares sum to the layer count either way."""
    spec = EvictSpec(scorer="window", budget={"tokens": 40}, layer_weights={0: 3}, spill_unused=True)
    shape = ModelShape("llama", 3, HQ, HKV, D, torch.float32, (None,) * 3)
    mean, own = 40 * 128, 132  # the budget's bytes per layer; one kept token with its position
    caps = [spec.layer_cap(shape, torch.float32, None, i, 50) for i in range(3)]
    rest = int((3 - 50 * own / mean) / 2 * mean + 1e-9) // own
    assert caps == [50, rest, rest] and rest > int(0.6 * mean) // own  # more than the unspilled 0.6 share
    assert [spec.layer_cap(shape, torch.float32, None, i, 1000) for i in range(3)] == [
        int(scale * mean + 1e-9) // own for scale in (1.8, 0.6, 0.6)
    ]
    plain = spec.model_copy(update={"spill_unused": False})
    assert [plain.layer_cap(shape, torch.float32, None, i, 50) for i in range(3)] == [69, 23, 23]


def test_every_slack_is_in_the_memory_bound():
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(
        {"budget": {"tokens": 14}, "stages": [{"kind": "evict", "scorer": "key_norm", "every": 4}]}
    )
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        ids = torch.randint(3, 128, (1, 30))
        model(ids[:, :12], cache=cache)
        kept = [int(cache.layers[0].kept_counts().max())]
        for t in range(12, 30):
            model(ids[:, t : t + 1], cache=cache)
            kept.append(int(cache.layers[0].kept_counts().max()))
            assert cache.memory_bytes() <= spec.memory_bound(model.config, t + 1)
    # 14 tokens' bytes hold 13 kept tokens (positions per head); the slack of 3 is inside: the cap is 10
    assert kept[:6] == [12, 13, 10, 11, 12, 13]  # grows up to 3 past the cap, then back to it
    assert max(kept) == 13
    assert spec.memory_bound(model.config, 30) == kvstack.StackSpec.load(
        {"budget": {"tokens": 14}, "stages": [{"kind": "evict", "scorer": "key_norm"}]}
    ).memory_bound(model.config, 30)


def test_chunked_prefill_peak_is_budget_plus_chunk(monkeypatch):
    peaks = []
    original = StackLayer.finish_forward

    def spy(self, stats):
        peaks.append(int(self.kept_counts().max()))  # everything the forward held when attention ran
        return original(self, stats)

    monkeypatch.setattr(StackLayer, "finish_forward", spy)
    model = tiny_model("qwen2")
    # 17 tokens' bytes keep 16 (each kept token also holds a position and an H2O score per KV head)
    spec = {"budget": {"tokens": 17}, "stages": [{"kind": "evict", "scorer": "h2o", "chunk_size": 8, "recent": 4}]}
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        out = model(torch.randint(3, 128, (1, 61)), cache=cache)
    assert out.logits.shape[1] == 61
    assert cache.get_seq_length() == 61
    assert max(peaks) == 16 + 8
    assert int(cache.layers[0].kept_counts().max()) == 16


@pytest.mark.parametrize("scorer", ["h2o", "tova", "key_norm", "snapkv", "obcache", "value_key_ratio", "random"])
def test_budget_at_least_tokens_seen_is_identity(scorer):
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 128, (1, 20))
    outs = []
    stage = {"kind": "evict", "scorer": scorer, **({"window": 4} if scorer in ("snapkv", "obcache") else {})}
    for spec in ("identity", {"budget": {"tokens": 40}, "stages": [stage]}):
        with kvstack.applied(model, spec):
            cache = kvstack.cache_for(model)
            logits = [model(ids[:, :8], cache=cache).logits]
            logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(8, 20)]
            outs.append(torch.cat(logits, 1))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("scorer", ["h2o", "tova", "key_norm"])
def test_left_padding_is_never_kept_and_rows_match_unpadded_runs(scorer):
    model = tiny_model("llama", dtype=torch.float64)
    spec = {"budget": {"tokens": 11}, "stages": [{"kind": "evict", "scorer": scorer, "n_sink": 2}]}  # keeps 10
    torch.manual_seed(5)
    long, short = torch.randint(3, 128, (1, 24)), torch.randint(3, 128, (1, 17))
    pad = 24 - 17
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with kvstack.applied(model, spec):
        cache = kvstack.cache_for(model)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        batched = model(ids, attention_mask=mask, position_ids=positions, cache=cache).logits
        counts = cache.layers[0].kept_counts()
        assert counts.tolist() == [[10, 10], [10, 10]]
        for layer in cache.layers:
            pos = layer.full.positions
            assert bool((pos[1][pos[1] >= 0] >= pad).all())  # no padding slot survived
        nxt = torch.tensor([[5], [6]])
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        step = model(nxt, attention_mask=mask2, position_ids=positions[:, -1:] + 1, cache=cache).logits
        single = model(short, cache=(c := kvstack.cache_for(model))).logits
        single_step = model(nxt[1:], cache=c).logits
    assert torch.allclose(batched[1, pad:], single[0], atol=1e-10)
    assert torch.allclose(step[1], single_step[0], atol=1e-10)


def test_spec_errors_name_the_field():
    with pytest.raises(kvstack.SpecError, match="budget.tokens"):
        kvstack.StackSpec.load({"budget": {"tokens": 20}, "stages": [{"kind": "evict", "scorer": "snapkv", "n_sink": 4}]})
    with pytest.raises(kvstack.SpecError, match="kernel"):
        kvstack.StackSpec.load({"budget": {"tokens": 64}, "stages": [{"kind": "evict", "scorer": "snapkv", "kernel": 4}]})
    with pytest.raises(kvstack.SpecError, match="block_size"):
        kvstack.StackSpec.load(
            {"budget": {"tokens": 8}, "stages": [{"kind": "evict", "granularity": "block", "block_size": 16}]}
        )
    with pytest.raises(kvstack.SpecError, match="available scorers"):
        kvstack.StackSpec.load({"budget": {"tokens": 8}, "stages": [{"kind": "evict", "scorer": "nope"}]})
