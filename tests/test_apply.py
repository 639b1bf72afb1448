"""One-call apply: generate uses the stack, remove restores, failures leave the model untouched, cache contracts."""

from __future__ import annotations

import pytest
import torch
from archs import refused_model, tiny_model
from transformers import DynamicCache

import kvstack
from kvstack import CacheUsageError, KVStackCache, SpecError, UnsupportedModelError


def test_generate_uses_a_fresh_stack_cache_without_arguments(monkeypatch):
    model = tiny_model("llama")
    created = []
    original = KVStackCache.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(KVStackCache, "__init__", spy)
    kvstack.apply(model, "streaming")
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    # min_new_tokens: the random model's greedy choice is sometimes EOS, which would stop generate early
    kwargs = dict(attention_mask=torch.ones_like(ids), min_new_tokens=3, max_new_tokens=3, do_sample=False)
    model.generate(ids, **kwargs)
    model.generate(ids, **kwargs)
    assert len(created) == 2 and created[0] is not created[1]
    assert created[0].get_seq_length() == 7
    kvstack.remove(model)


def test_remove_restores_attention_and_generate():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    kvstack.apply(model, "identity")
    assert model.config._attn_implementation == "kvstack"
    kvstack.remove(model)
    assert model.config._attn_implementation == before
    assert "generate" not in model.__dict__
    with pytest.raises(CacheUsageError, match="not prepared"):
        kvstack.remove(model)


def test_context_manager_removes_on_error():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError):
        with kvstack.applied(model, "identity"):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_failed_apply_leaves_model_unchanged(monkeypatch):
    model = tiny_model("qwen2")
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def explode(self, model, calibration=None):
        raise RuntimeError("surgery failed")

    from kvstack.stages.evict import EvictSpec

    monkeypatch.setattr(EvictSpec, "modifies_model", True)
    monkeypatch.setattr(EvictSpec, "prepare_model", explode)
    with pytest.raises(RuntimeError, match="surgery failed"):
        kvstack.apply(model, "streaming")
    assert model.config._attn_implementation == "sdpa"
    assert "generate" not in model.__dict__ and not hasattr(model, "_kvstack_applied")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_invalid_spec_is_rejected_before_touching_the_model():
    model = tiny_model("llama")
    with pytest.raises(SpecError):
        kvstack.apply(model, {"stages": [{"kind": "evict"}]})
    assert model.config._attn_implementation == "sdpa"


def test_unsupported_architecture_says_why():
    """Support is detected from the model (tests/test_any_arch.py); a model that computes attention itself is
    refused with the reason, before anything is touched."""
    model = refused_model("bloom")
    with pytest.raises(UnsupportedModelError, match="computes attention itself"):
        kvstack.apply(model, "identity")
    assert getattr(model, "_kvstack_applied", None) is None


def test_cache_for_needs_apply_and_accepts_another_spec():
    model = tiny_model("llama")
    with pytest.raises(CacheUsageError, match="apply"):
        kvstack.cache_for(model)
    with kvstack.applied(model, "identity"):
        cache = kvstack.cache_for(model, "streaming")
        assert cache.spec.name == "streaming"


def test_both_cache_argument_names_work():
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 128, (1, 10))
    with kvstack.applied(model, "identity"):
        a = model(ids, cache=kvstack.cache_for(model)).logits
        with pytest.warns(Warning):
            b = model(ids, past_key_values=kvstack.cache_for(model)).logits
    assert torch.equal(a, b)


def test_output_cache_returns_the_cache_the_forward_filled():
    from kvstack.stack.apply import cache_kwarg, output_cache

    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 128, (1, 10))
    given = DynamicCache(config=model.config)
    assert output_cache(model(ids, **{cache_kwarg(model): given})) is given
    made = output_cache(model(ids, use_cache=True))  # the model's own: read without the deprecated attribute
    assert made.get_seq_length() == 10


def test_seq_length_counts_tokens_seen_not_kept():
    model = tiny_model("llama")
    with kvstack.applied(model, {"budget": {"tokens": 7}, "stages": [{"kind": "evict", "n_sink": 2}]}):
        cache = kvstack.cache_for(model)
        model(torch.randint(3, 128, (1, 20)), cache=cache)
        assert cache.get_seq_length() == 20
        assert int(cache.layers[0].kept_counts().max()) == 6  # 7 tokens' bytes: 6 tokens and their positions


def test_stack_cache_without_stack_attention_is_an_error():
    model = tiny_model("llama")
    with kvstack.applied(model, "identity"):
        cache = kvstack.cache_for(model)
    ids = torch.randint(3, 128, (1, 4))
    with pytest.raises(CacheUsageError):
        model(ids, cache=cache)
        model(ids, cache=cache)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])  # sdpa; sliding-window sdpa; eager + softcap
def test_forwards_without_a_stack_cache_run_the_original_attention_exactly(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding goes through the original mask function
    plain = model(ids, attention_mask=mask).logits
    loss = model(ids, labels=ids).loss
    with kvstack.applied(model, "streaming"):
        assert model.config._attn_implementation == "kvstack"
        assert torch.equal(model(ids, attention_mask=mask, cache=DynamicCache(config=model.config)).logits, plain)
        assert torch.equal(model(ids, attention_mask=mask, use_cache=False).logits, plain)
        assert torch.equal(model(ids, labels=ids).loss, loss)
        greedy = model.generate(ids[:1], max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(greedy, model.generate(ids[:1], max_new_tokens=4, do_sample=False, use_cache=False))


def test_stack_cache_after_an_interrupted_forward_is_not_confused():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 6))
    plain = model(ids).logits
    with kvstack.applied(model, "identity"):
        cache = kvstack.cache_for(model)
        cache.layers[0].update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))  # an update whose attention never ran
        assert torch.equal(model(ids).logits, plain)  # a DynamicCache forward ignores the stale layer


def test_reorder_and_batch_select_act_on_all_tiers():
    model = tiny_model("llama")
    with kvstack.applied(model, "streaming"):
        cache = kvstack.cache_for(model)
        model(torch.randint(3, 128, (3, 10)), cache=cache)
        keys = cache.layers[0].full.keys.clone()
        cache.reorder_cache(torch.tensor([2, 0, 1]))
        assert torch.equal(cache.layers[0].full.keys, keys[[2, 0, 1]])
        cache.batch_select_indices(torch.tensor([1]))
        assert torch.equal(cache.layers[0].full.keys, keys[[0]])
        assert cache.layers[0].full.positions.shape[0] == 1
        cache.batch_repeat_interleave(2)
        assert cache.layers[0].full.keys.shape[0] == 2
        with pytest.raises(CacheUsageError, match="crop"):
            cache.crop(-1)


def test_memory_report_breaks_down_by_layer_and_tier():
    model = tiny_model("llama")
    with kvstack.applied(model, "identity"):
        cache = kvstack.cache_for(model)
        model(torch.randint(3, 128, (2, 12)), cache=cache)
    report = cache.memory_report()
    assert report["total_bytes"] == cache.memory_bytes() == sum(sum(r.values()) for r in report["by_layer"])
    assert report["full_cache_bytes"] == kvstack.full_cache_bytes(model.config, 12, batch=2)
    # the identity stack pays only for positions: one int32 per token and row
    assert report["total_bytes"] - report["full_cache_bytes"] == 2 * 12 * 4 * len(cache.layers)



# ------------------------------------------------------------------------ mask overlays (multimodal / token types)
def _with_overlay(monkeypatch, module, name: str, **overlay) -> None:
    """Make the model's mask creation compose ``overlay`` (or_mask_function / and_mask_function) into its mask, as
    multimodal models do for image tokens."""
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: real(*args, **{**kwargs, **overlay}))


def _image_block(batch_idx, head_idx, q_idx, kv_idx):
    """The first 4 tokens (an 'image') see each other both ways."""
    return (q_idx < 4) & (kv_idx < 4)


@pytest.mark.parametrize("arch, creator, plain", [
    ("llama", "create_causal_mask", "causal"),
    ("mistral", "create_sliding_window_causal_mask", "causal within a sliding window of 8"),
])
def test_a_mask_overlay_is_refused_with_a_stack_cache_and_kept_without(monkeypatch, arch, creator, plain):
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral

    module = modeling_llama if arch == "llama" else modeling_mistral
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    causal = model(ids).logits
    _with_overlay(monkeypatch, module, creator, or_mask_function=_image_block)
    overlaid = model(ids).logits
    assert not torch.allclose(overlaid[:, :4], causal[:, :4])  # the overlay acts (else this test could not fail)
    with kvstack.applied(model, "identity"):
        with pytest.raises(CacheUsageError, match=f"attention mask is not {plain}: .*or_mask_function / "
                                                  "and_mask_function.*without a KVStackCache"):
            model(ids, cache=kvstack.cache_for(model))
        assert torch.equal(model(ids, use_cache=False).logits, overlaid)  # the original attention applies it


def test_an_overlay_that_changes_nothing_runs(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with kvstack.applied(model, "identity"):
        reference = model(ids, cache=kvstack.cache_for(model)).logits
        _with_overlay(monkeypatch, modeling_llama, "create_causal_mask",
                      and_mask_function=lambda b, h, q, kv: kv >= 0)  # every key allowed: the causal mask stays
        assert torch.equal(model(ids, cache=kvstack.cache_for(model)).logits, reference)


def test_plain_masks_are_recognised_without_building_them(monkeypatch):
    """No overlay: nothing is evaluated (a long prompt would otherwise build a queries x keys mask per forward)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    from kvstack.stack import attention

    monkeypatch.setattr(attention, "sdpa_mask", lambda **kwargs: pytest.fail("a plain mask was built"))
    sizes = dict(batch_size=1, q_length=10**6, kv_length=10**6)
    assert not attention.mask_overlay_acts({**sizes, "mask_function": causal_mask_function})
    sliding = sliding_window_causal_mask_function(8)
    assert not attention.mask_overlay_acts({**sizes, "mask_function": sliding, "local_size": 8})
    assert attention._is_plain(sliding, 8) and not attention._is_plain(sliding, 16)
    assert not attention._is_plain(causal_mask_function, 8) and not attention._is_plain(sliding, None)
