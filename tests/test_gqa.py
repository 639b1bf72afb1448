"""``kind: gqa``: exactness of the conversion's invariants, memory by the head ratio, save/reload, validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstack
from archs import tiny_model
from kvstack.stack.apply import APPLIED_ATTR
from kvstack.stages._calibration import attention_inputs, attention_modules, calibration_sequences
from kvstack.stages.gqa import convert_layer

SEPARATE_QKV = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _calibration() -> list[torch.Tensor]:
    return [_ids(24, seed=100 + i) for i in range(3)]


def _gqa(n: int, method: str = "mean") -> dict:
    return {"stages": [{"kind": "gqa", "kv_heads": n, "method": method}]}


@torch.no_grad()
def _stack_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    cache = kvstack.cache_for(model)
    out = [model(ids[:, :prefill], cache=cache).logits]
    for p in range(prefill, ids.shape[1]):
        out.append(model(ids[:, p : p + 1], cache=cache).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("arch", SEPARATE_QKV)
@pytest.mark.parametrize("method", ["mean", "align"])
def test_same_head_count_is_exact(arch, method):
    model = tiny_model(arch, dtype=torch.float64)
    ids = _ids(14)
    kvstack.apply(model, "identity")
    reference = _stack_logits(model, ids, 10)
    kvstack.apply(model, _gqa(2, method), calibration=_calibration())
    torch.testing.assert_close(_stack_logits(model, ids, 10), reference, rtol=0, atol=1e-10)
    kvstack.remove(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_identical_heads_in_a_group_are_exact(arch):
    model = tiny_model(arch, dtype=torch.float64)
    with torch.no_grad():
        for attn in attention_modules(model):
            d = attn.head_dim
            for proj in (attn.k_proj, attn.v_proj):
                proj.weight[d:] = proj.weight[:d]
                if proj.bias is not None:
                    proj.bias[d:] = proj.bias[:d]
    ids = _ids(12)
    reference = model(ids).logits
    kvstack.apply(model, _gqa(1))
    assert model.config.num_key_value_heads == 1
    assert all(a.num_key_value_groups == 4 and a.k_proj.out_features == a.head_dim for a in attention_modules(model))
    torch.testing.assert_close(_stack_logits(model, ids, 8), reference, rtol=0, atol=1e-10)
    kvstack.remove(model)
    assert model.config.num_key_value_heads == 2
    torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_alignment_is_exact_before_merging(arch):
    model = tiny_model(arch, dtype=torch.float64)
    ids = _ids(16)
    reference = model(ids).logits
    inputs = attention_inputs(model, calibration_sequences(_calibration(), "test"))
    before = [a.v_proj.weight.clone() for a in attention_modules(model)]
    for attn, x in zip(attention_modules(model), inputs):
        convert_layer(attn, 4, 2, 1, x, pool=False)
    # the heads really were rotated (otherwise this test could not fail)
    assert any((a.v_proj.weight - w).abs().max() > 1e-3 for a, w in zip(attention_modules(model), before))
    torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=1e-10)


def test_align_preserves_more_than_mean_on_tiny_model():
    ids = _ids(20, seed=7)
    errors = {}
    for method in ("mean", "align"):
        model = tiny_model("llama", dtype=torch.float64)
        with torch.no_grad():
            reference = torch.log_softmax(model(ids).logits, -1)
        kvstack.apply(model, _gqa(1, method), calibration=[_ids(64, seed=s) for s in range(4)])
        out = torch.log_softmax(_stack_logits(model, ids, 20), -1)
        errors[method] = float((reference.exp() * (reference - out)).sum(-1).mean())
    assert errors["align"] < errors["mean"]


@settings(max_examples=12, deadline=None)
@given(kv_heads=st.sampled_from([1, 2]), length=st.integers(1, 24))
def test_memory_shrinks_by_the_head_ratio(kv_heads, length):
    model = tiny_model("llama", dtype=torch.float32)
    ids = _ids(length)
    sizes = {}
    for n in (2, kv_heads):
        kvstack.apply(model, _gqa(n))
        cache = kvstack.cache_for(model)
        with torch.no_grad():
            model(ids, cache=cache)
        spec = getattr(model, APPLIED_ATTR).spec
        bound = spec.memory_bound(kvstack.ModelShape.from_config(model.config), length)
        kvstack.remove(model)
        assert cache.memory_bytes() == bound  # analytic = actual
        kv_bytes = sum(layer.full.keys.nbytes + layer.full.values.nbytes for layer in cache.layers)
        sizes[n] = (kv_bytes, cache.memory_bytes() - kv_bytes)
    assert sizes[kv_heads][0] * 2 == sizes[2][0] * kv_heads  # keys + values by exactly the head ratio
    assert sizes[kv_heads][1] == sizes[2][1]  # positions do not depend on heads


def test_analytic_bound_before_conversion_uses_the_new_head_count():
    model = tiny_model("llama")
    spec = kvstack.StackSpec.load(_gqa(1))
    full = kvstack.full_cache_bytes(model.config, 100)
    positions = 2 * 100 * 4
    assert spec.memory_bound(model.config, 100) == full // 2 + positions


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_saved_model_reloads_without_kvstack(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(arch, dtype=torch.float64)
    ids = _ids(12)
    kvstack.apply(model, _gqa(1, "align"), calibration=_calibration())
    converted = _stack_logits(model, ids, 12)
    model.save_pretrained(tmp_path)
    kvstack.remove(model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert reloaded.config.num_key_value_heads == 1
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, converted, rtol=0, atol=1e-10)


def test_kv_heads_must_divide_the_models_count():
    model = tiny_model("llama")
    with pytest.raises(kvstack.SpecError, match=r"kv_heads=3 .*2 KV heads \(4 query heads, head_dim 16\).*\[1, 2\]"):
        kvstack.apply(model, _gqa(3))
    assert getattr(model, APPLIED_ATTR, None) is None


def test_fused_qkv_is_rejected_by_name():
    with pytest.raises(kvstack.UnsupportedModelError, match="Phi3.*qkv_proj"):
        kvstack.apply(tiny_model("phi3"), _gqa(1))


def test_align_without_calibration_leaves_the_model_unchanged():
    model = tiny_model("llama")
    ids = _ids(8)
    reference = model(ids).logits
    with pytest.raises(kvstack.SpecError, match="calibration"):
        kvstack.apply(model, _gqa(1, "align"))
    assert model.config.num_key_value_heads == 2 and getattr(model, APPLIED_ATTR, None) is None
    torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=0)


def test_gqa_must_be_the_first_stage():
    spec = {"stages": [{"kind": "quantize", "bits": 4, "group_size": 4, "residual": 4}, {"kind": "gqa", "kv_heads": 1}]}
    with pytest.raises(kvstack.SpecError, match=r"stages.1 \(gqa\): kind='gqa' .*first stage only"):
        kvstack.StackSpec.load(spec)


def _norm_rows(norm) -> torch.Tensor:
    """Per-head weights of a query/key norm: Cohere's [heads, d] weight, or StableLM's LayerNorm per head."""
    return torch.stack([n.weight for n in norm.norms]) if hasattr(norm, "norms") else norm.weight


@pytest.mark.parametrize("arch", ["cohere", "stablelm"])
def test_alignment_regroups_per_head_norms_exactly(arch):
    """Per-head query/key norm weights follow their heads when ``align`` regroups them (8 query / 4 KV heads, so the
    grouping permutes heads): exact before merging."""
    model = tiny_model(arch, dtype=torch.float64, num_attention_heads=8, num_key_value_heads=4)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for attn in attention_modules(model):
            for norm in (getattr(attn, n, None) for n in ("q_norm", "k_norm", "q_layernorm", "k_layernorm")):
                for p in norm.parameters() if norm is not None else ():
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ids = _ids(16)
    reference = model(ids).logits
    inputs = attention_inputs(model, calibration_sequences(_calibration(), "test"))
    query_norm = "q_norm" if arch == "cohere" else "q_layernorm"
    before = [_norm_rows(getattr(a, query_norm)).clone() for a in attention_modules(model)]
    for attn, x in zip(attention_modules(model), inputs):
        convert_layer(attn, 8, 4, 2, x, pool=False)
    after = [_norm_rows(getattr(a, query_norm)) for a in attention_modules(model)]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))  # heads were permuted, their norms with them
    assert all(sorted(map(tuple, a.tolist())) == sorted(map(tuple, b.tolist())) for a, b in zip(after, before))
    torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=1e-10)


@pytest.mark.parametrize("value_heads, why", [(3, "does not run after its KV heads were converted"),
                                               (2, "layer 0 of LlamaForCausalLM stores keys of 1 and values of 2")])
def test_a_conversion_left_wrong_is_refused_at_apply_and_undone(monkeypatch, value_heads, why):
    """The dry run: a conversion that does not run (3 value heads for 4 query heads), or runs but stores other than
    the new KV heads (2 value heads: the model's sdpa accepts them), is refused by apply, the model restored."""
    from kvstack.stages import gqa

    model = tiny_model("llama", dtype=torch.float64)
    ids = _ids(10)
    reference = model(ids).logits
    modules = dict(model.named_modules())
    real = gqa.convert_layer

    def values_left_wrong(attn, *args, **kwargs):
        real(attn, *args, **kwargs)
        attn.v_proj = torch.nn.Linear(attn.v_proj.in_features, value_heads * attn.head_dim, bias=False,
                                      dtype=torch.float64)

    monkeypatch.setattr(gqa, "convert_layer", values_left_wrong)
    with pytest.raises(kvstack.UnsupportedModelError, match=f"gqa: .*{why}.*the model is restored"):
        kvstack.apply(model, _gqa(1))
    assert model.config.num_key_value_heads == 2 and model.config._attn_implementation == "sdpa"
    assert all(modules[name] is module for name, module in model.named_modules())
    assert all(a.num_key_value_groups == 2 for a in attention_modules(model))
    torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=0)
