"""``kind: lowrank`` (LESS state): exactness while empty, order independence, padding, beams, memory, calibration."""

from __future__ import annotations

import pytest
import torch
from archs import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstack
from kvstack import SpecError, StackSpec
from kvstack.stack.apply import cache_kwarg
from kvstack.stack.shape import ModelShape
from kvstack.stages.lowrank import LowRankTier, random_feature_maps

HYP = settings(max_examples=8, deadline=None, derandomize=True)


def _spec(tokens=10_000, n_sink=2, **lowrank):
    """evict (window scorer) + lowrank; the default budget is never reached (lowrank alone is refused)."""
    stages = [{"kind": "evict", "scorer": "window", "n_sink": n_sink, "budget": {"tokens": tokens}},
              {"kind": "lowrank", **lowrank}]
    return {"name": "t", "stages": stages}


def _run(model, spec, ids, mask=None):
    kvstack.apply(model, spec)
    try:
        cache = kvstack.cache_for(model)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, **{cache_kwarg(model): cache}).logits
        return out, cache
    finally:
        kvstack.remove(model)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_empty_state_equals_identity(arch):
    model = tiny_model(arch, dtype=torch.float64)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    reference, _ = _run(model, "identity", ids)
    # eviction budgets the sequence never reaches: the state stays empty
    for spec in (_spec(rank=8), _spec(tokens=64, rank=8)):
        out, cache = _run(model, spec, ids)
        assert torch.equal(out, reference)
        states = [layer.state for layer in cache.layers if layer.state is not None]
        assert states and not any(s.allocated for s in states)  # created by the first fold, not before
        assert cache.memory_report()["by_tier"].get("state", 0) == 0


def test_state_changes_output_once_tokens_are_folded():
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    evict_only, _ = _run(model, {"stages": _spec(tokens=8)["stages"][:1]}, ids)
    with_state, cache = _run(model, _spec(tokens=8, rank=2), ids)  # the state fits a quarter of the budget
    # a single forward attends everything exactly and compresses after it: same logits, but tokens were folded
    assert torch.equal(evict_only, with_state)
    assert bool(torch.isfinite(cache.layers[0].state.c).all())
    kvstack.apply(model, _spec(tokens=8, rank=2))
    try:
        cache_a = kvstack.cache_for(model)
        cache_b = kvstack.cache_for(model, {"stages": _spec(tokens=8)["stages"][:1]})
        with torch.no_grad():
            model(ids, **{cache_kwarg(model): cache_a})
            model(ids, **{cache_kwarg(model): cache_b})
            step = torch.tensor([[5]])
            pos = torch.tensor([[30]])
            a = model(step, position_ids=pos, **{cache_kwarg(model): cache_a}).logits
            b = model(step, position_ids=pos, **{cache_kwarg(model): cache_b}).logits
    finally:
        kvstack.remove(model)
    assert not torch.allclose(a, b)


def _tier(rank=8, heads=2, dim=16, seed=0, dtype=torch.float64):
    maps = random_feature_maps(rank, seed, 1, heads, dim, dtype)
    return LowRankTier(maps[0], dtype, dim, heads)


def test_folding_one_at_a_time_equals_one_batch():
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 2, 12, 16
    keys = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    values = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    valid = torch.rand(b, h, n, generator=g) > 0.2
    query = torch.randn(b, h, 3, d, generator=g, dtype=torch.float64)
    scaling = d**-0.5

    whole, single = _tier(), _tier()
    for t in (whole, single):
        t.prepare(query, scaling)
        assert t.readout(query, scaling) is None  # empty: the attention skips it
    whole.absorb(keys, values, valid)
    for j in torch.randperm(n, generator=g).tolist():  # one at a time, in a shuffled order
        single.absorb(keys[:, :, j : j + 1], values[:, :, j : j + 1], valid[:, :, j : j + 1])
    # the log-offset c is float32 (kernel convention): rescaling the state by exp(c_old - c_new) rounds at 1e-7
    torch.testing.assert_close(single.c, whole.c, rtol=0, atol=0)
    torch.testing.assert_close(single.z, whole.z, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(single.H, whole.H, rtol=1e-6, atol=1e-9)
    for x, y in zip(single.readout(query, scaling), whole.readout(query, scaling)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-9)


def test_readout_is_on_the_exact_logit_scale():
    # with many random features the state's log-denominator approaches log sum_j exp(s q.k_j) of the folded tokens
    g = torch.Generator().manual_seed(3)
    d, n = 16, 40
    keys = 0.5 * torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    values = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    query = 0.5 * torch.randn(1, 1, 4, d, generator=g, dtype=torch.float64)
    tier = _tier(rank=4096, heads=1, dim=d)
    tier.prepare(query, d**-0.5)
    tier.absorb(keys, values, torch.ones(1, 1, n, dtype=torch.bool))
    log_den, value = tier.readout(query, d**-0.5)
    logits = query @ keys.transpose(-1, -2) * d**-0.5
    torch.testing.assert_close(log_den, torch.logsumexp(logits, -1), rtol=0, atol=0.05)
    torch.testing.assert_close(value, torch.softmax(logits, -1) @ values, rtol=0, atol=0.05)


@HYP
@given(
    rank=st.integers(1, 4),
    tokens=st.integers(12, 24),  # the state fits a quarter of the budget (docs/budgets.md)
    n_sink=st.integers(0, 2),
    batch=st.integers(1, 2),
    steps=st.integers(1, 6),
    arch=st.sampled_from(["llama", "gemma2"]),
)
def test_memory_constant_after_the_window_fills_and_equals_the_bound(rank, tokens, n_sink, batch, steps, arch):
    model = tiny_model(arch)
    spec = StackSpec.load(_spec(tokens=tokens, n_sink=n_sink, rank=rank))
    shape = ModelShape.from_model(model)
    prompt = tokens + 4
    ids = torch.randint(3, 128, (batch, prompt + steps), generator=torch.Generator().manual_seed(rank))
    kvstack.apply(model, spec)
    try:
        cache = kvstack.cache_for(model)
        seen_bytes = set()
        with torch.no_grad():
            model(ids[:, :prompt], **{cache_kwarg(model): cache})
            for p in range(prompt, prompt + steps):
                model(ids[:, p : p + 1], position_ids=torch.tensor([[p]] * batch), **{cache_kwarg(model): cache})
                # the bound plans the evict cap without the state's reservation: an upper bound, and the promise
                assert cache.memory_bytes() <= spec.memory_bound(shape, p + 1, batch)
                assert cache.memory_bytes() <= cache.memory_report()["budget_bytes"]
                seen_bytes.add(cache.memory_bytes())
    finally:
        kvstack.remove(model)
    assert len(seen_bytes) == 1
    full_layers = sum(w is None for w in shape.layer_windows)
    per_layer = spec.stages[1].state_bytes(shape, shape.dtype)
    assert cache.memory_report()["by_tier"]["state"] == batch * full_layers * per_layer
    assert per_layer == shape.num_kv_heads * (rank * (shape.value_dim + 1) * 4 + 4)


def test_padding_never_enters_the_state():
    model = tiny_model("llama", dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    long = torch.randint(3, 128, (1, 28), generator=g)
    short = torch.randint(3, 128, (1, 20), generator=g)
    pad = torch.zeros(1, 8, dtype=torch.long)
    ids = torch.cat([torch.cat([pad, short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros_like(pad), torch.ones_like(short)], 1), torch.ones_like(long)]).bool()
    spec = _spec(tokens=6, rank=2)
    kvstack.apply(model, spec)
    try:
        kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0)
        with torch.no_grad():
            both = model.generate(ids, attention_mask=mask, **kw)
            alone = model.generate(short, **kw)
    finally:
        kvstack.remove(model)
    for s_both, s_alone in zip(both.scores, alone.scores):
        torch.testing.assert_close(s_both[0], s_alone[0], rtol=1e-9, atol=1e-9)


def test_beam_search_reorders_the_state():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    kvstack.apply(model, _spec(tokens=6, rank=2))
    try:
        cache = kvstack.cache_for(model)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0,
                                 **{cache_kwarg(model): cache})
    finally:
        kvstack.remove(model)
    assert out.shape == (2, 21)
    state = cache.layers[0].state
    assert state.H.shape[0] == state.z.shape[0] == state.c.shape[0] == 6
    assert bool(torch.isfinite(state.c).all())


def test_spec_errors_name_the_field(tmp_path):
    with pytest.raises(SpecError, match="kernels"):
        StackSpec.load(_spec(features="learned"))
    with pytest.raises(SpecError, match="kernels"):
        StackSpec.load(_spec(kernels="k.safetensors"))
    with pytest.raises(SpecError, match="rank"):
        StackSpec.load(_spec(features="learned", kernels="k.safetensors", rank=8))
    model = tiny_model("llama")
    with pytest.raises(SpecError, match="kernels"):
        kvstack.apply(model, _spec(features="learned", kernels=str(tmp_path / "missing.safetensors")))
    from kvstack.stages.lowrank_learned import LearnedKernels

    path = tmp_path / "other.safetensors"
    LearnedKernels(layers=3, kv_heads=2, head_dim=16, rank=4, hidden=4).save(path)
    with pytest.raises(SpecError, match="layers=3"):
        kvstack.apply(model, _spec(features="learned", kernels=str(path)))
    two = [{"kind": "evict"}, {"kind": "lowrank", "rank": 2}, {"kind": "lowrank", "rank": 2}]
    kvstack.apply(model, {"budget": {"tokens": 64}, "stages": two})
    try:
        with pytest.raises(SpecError, match="at most one state"):
            kvstack.cache_for(model)
    finally:
        kvstack.remove(model)


class _InMemory:
    """The trained module's own maps for one layer (what the file must reproduce)."""

    def __init__(self, kernels, layer):
        self.kernels, self.layer, self.rank = kernels, layer, kernels.rank

    def log_query(self, q, scaling):
        return self.kernels.log_features("q", self.layer, q.float(), scaling).detach()

    def log_key(self, k, scaling):
        return self.kernels.log_features("k", self.layer, k.float(), scaling).detach()


def test_calibration_round_trip(real_model_and_tokenizer, dev_passages, tmp_path):
    from kvstack.stages.lowrank_learned import calibrate, save_kernels

    model, tok = real_model_and_tokenizer
    train = StackSpec.load(_spec(tokens=48, n_sink=4, rank=8))
    kernels, summary = calibrate(model, tok, train, dev_passages[32:34], steps=3, batch=2, queries=32,
                                 progress=False)
    assert len(summary["relative_error_learned"]) == model.config.num_hidden_layers
    path = tmp_path / "kernels.safetensors"
    save_kernels(kernels, path, summary)
    yaml_spec = (
        "name: learned\nstages:\n  - kind: evict\n    scorer: window\n    n_sink: 4\n    budget: {tokens: 48}\n"
        f"  - kind: lowrank\n    features: learned\n    kernels: {path}\n"
    )
    ids = torch.tensor(tok(dev_passages[32])["input_ids"][:80])[None]
    outs = []
    kvstack.apply(model, StackSpec.from_yaml(yaml_spec))
    try:
        for in_memory in (False, True):
            cache = kvstack.cache_for(model)
            if in_memory:
                for i, layer in enumerate(cache.layers):
                    layer.state.features = _InMemory(kernels, i)
            with torch.no_grad():
                model(ids[:, :64], **{cache_kwarg(model): cache})
                rows = [model(ids[:, p : p + 1], position_ids=torch.tensor([[p]]), **{cache_kwarg(model): cache})
                        .logits for p in range(64, 80)]
            outs.append(torch.cat(rows, 1))
    finally:
        kvstack.remove(model)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    random_out, _ = _run(model, _spec(tokens=48, n_sink=4, rank=8), ids[:, :64])
    assert random_out.shape[-1] == outs[0].shape[-1]


def test_calibrate_command(real_model_and_tokenizer, tmp_path):
    from typer.testing import CliRunner

    from kvstack.bench.protocol import data_path, model_path
    from kvstack.cli import app

    spec = tmp_path / "less.yaml"
    spec.write_text(StackSpec.load(_spec(tokens=48, n_sink=4, rank=4)).to_yaml())
    out = tmp_path / "k.safetensors"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(model_path()), "--preset", str(spec), "--data",
                                      str(data_path()), "--out", str(out), "--passages", "1", "--steps", "1",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "layer 0" in result.output and out.is_file()
    bad = CliRunner().invoke(app, ["calibrate", "--model", str(model_path()), "--preset", "identity", "--data",
                                   str(data_path()), "--out", str(out), "--passages", "1", "--steps", "1"])
    assert bad.exit_code == 2 and "lowrank" in bad.output
