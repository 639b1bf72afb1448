"""Any decoder architecture: support is detected from the model (kvstack/stack/shape.py), not from a list of names.

* identity matrix, float64, over every arch of ``tests/archs.py`` (``ALL_ARCHS``: 24; 23 before transformers 5.25): logits of prefill + a
  multi-token continuation + single tokens, a left-padded batch of 2, and greedy generation, all equal to the
  untouched model with transformers' ``DynamicCache`` to 1e-10 (Gemma2: 1e-5, its eager attention takes the softmax in
  float32 even for float64 models, so the reference itself is float32-rounded). The MoE archs run float64 with
  ``experts_implementation="eager"``; with their default ``grouped_mm`` kernel (no float64 CPU kernel) they are
  checked in float32 against DynamicCache to 1e-4 on logits of magnitude ~8 and no further from the float64 truth
  than 1.5x DynamicCache's own float32 error (measured: 1.7e-5 and 0.9e-5 from DynamicCache).
* non-identity presets (streaming with a 16-token budget, kivi-4 with a short residual) run on every arch and hold
  fewer bytes than the full cache (not exactness).
* each refused family raises ``UnsupportedModelError`` with its reason and leaves the model as it was.
* ``gqa`` surgery on every arch with separate projections, query/key norms included (Qwen3, Gemma3, Cohere's
  per-head LayerNorm, StableLM's LayerNorm per head): merging identical KV heads is exact, ``align`` converts and
  generates; the archs it cannot convert (fused projections, OLMo2/OLMo3's key norm over all heads) are refused at
  ``apply`` with the reason, the model untouched.
"""

from __future__ import annotations

import pytest
import torch
from archs import (
    ALL_ARCHS,
    MOE_ARCHS,
    REFUSED,
    _config,
    falcon_uses_attention_interface,
    _model_class,
    _reinit,
    refused_model,
    tiny_model,
)
from test_identity import run_pieces
from torch import nn
from transformers import DynamicCache
from transformers.models.llama import modeling_llama

import kvstack
from kvstack.stack.shape import ModelShape, config_problem, support_problem

TOL64 = 1e-10


def tol64(arch: str) -> float:
    return 1e-5 if arch == "gemma2" else TOL64  # Gemma2's eager reference softmax is float32 (see the docstring)


def untouched(model, implementation) -> bool:
    return (
        model.config._attn_implementation == implementation
        and "generate" not in model.__dict__
        and "forward" not in model.__dict__
        and not hasattr(model, "_kvstack_applied")
    )


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=ALL_ARCHS)
def arch64(request):
    return request.param, tiny_model(request.param, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------ detection
def test_every_arch_is_detected_and_shaped_like_dynamic_cache(arch64):
    arch, model = arch64
    assert support_problem(model) is None
    shape = ModelShape.from_model(model)
    text = model.config
    assert (shape.num_layers, shape.num_q_heads) == (text.num_hidden_layers, text.num_attention_heads)
    # per-layer windows are those of transformers' own cache for this config
    windows = tuple(getattr(layer, "sliding_window", None) for layer in DynamicCache(config=text).layers)
    assert shape.layer_windows == windows
    assert shape.dtype == torch.float64
    assert text.model_type in kvstack.SUPPORTED_MODEL_TYPES


def test_supported_model_types_lists_exactly_the_tested_archs():
    tested = {_config(arch, "sdpa").model_type for arch in ALL_ARCHS}
    if not falcon_uses_attention_interface():  # listed for the transformers that hold its cache, tested there
        tested.add("falcon")
    assert tested == set(kvstack.SUPPORTED_MODEL_TYPES)


def test_detection_is_not_by_name():
    """A renamed model type still works; a Llama whose attention is hand-rolled (no attention interface) is refused."""
    model = tiny_model("llama", dtype=torch.float64)
    model.config.model_type = "my_private_llama"
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    reference = model(ids).logits
    with kvstack.applied(model, "identity"):
        assert (model(ids, cache=kvstack.cache_for(model)).logits - reference).abs().max().item() <= TOL64

    hand_rolled = tiny_model("llama")
    for layer in hand_rolled.model.layers:
        old = layer.self_attn
        layer.self_attn = HandRolledAttention(hand_rolled.config, old.layer_idx)
        layer.self_attn.load_state_dict(old.state_dict())
    with pytest.raises(kvstack.UnsupportedModelError, match="HandRolledAttention computes attention itself"):
        kvstack.apply(hand_rolled, "identity")
    assert untouched(hand_rolled, "sdpa")


class HandRolledAttention(modeling_llama.LlamaAttention):
    """Stores keys/values in the cache but computes attention with torch directly (as Falcon/Bloom do)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


# ------------------------------------------------------------------------------------------------ identity
def test_identity_logits_single_and_left_padded(arch64):
    arch, model = arch64
    batch = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(batch)
    mask[1, :9] = 0
    batch_positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with kvstack.applied(model, "identity"):
        single = run_pieces(model, batch[:1], None, batch_positions[:1], kvstack.cache_for(model))
        padded = run_pieces(model, batch, mask, batch_positions, kvstack.cache_for(model))
    # the reference of each row is DynamicCache on that row alone, unpadded (a padded DynamicCache batch is not:
    # Gemma2's eager attention turns padded rows into NaN, which its zero attention weights then spread)
    for row, pad in ((0, 0), (1, 9)):
        alone = batch[row : row + 1, pad:]
        ref = run_pieces(model, alone, None, torch.arange(30 - pad)[None], DynamicCache(config=model.config),
                         cuts=(20 - pad, 25 - pad))
        if row == 0:
            assert (single[0] - ref[0]).abs().max().item() <= tol64(arch)
        assert (padded[row, pad:] - ref[0]).abs().max().item() <= tol64(arch)


def test_identity_generation_single_and_left_padded(arch64):
    arch, model = arch64
    g = torch.Generator().manual_seed(2)
    batch = torch.randint(3, 128, (2, 14), generator=g)
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    batch[1, :5] = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True,
                  pad_token_id=0)

    def plain(prompt):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)

    alone = [plain(batch[:1]), plain(batch[1:, 5:])]
    with kvstack.applied(model, "identity"):
        single = model.generate(batch[:1], attention_mask=mask[:1], **kwargs)
        padded = model.generate(batch, attention_mask=mask, **kwargs)
    assert torch.equal(single.sequences, alone[0].sequences)
    assert max((a - b).abs().max().item() for a, b in zip(single.logits, alone[0].logits)) <= tol64(arch)
    for row, pad in ((0, 0), (1, 5)):
        assert torch.equal(padded.sequences[row, pad:], alone[row].sequences[0])
        diff = max((a[row] - b[0]).abs().max().item() for a, b in zip(padded.logits, alone[row].logits))
        assert diff <= tol64(arch)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_float32_default_experts_kernel(arch):
    """The MoE archs with their default experts kernel (grouped_mm: float32 only on the CPU)."""
    cfg = _config(arch, "sdpa")
    cfg._experts_implementation = None  # transformers' default
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _model_class(arch)(cfg)
    _reinit(model, 0)
    model.eval()
    truth_model = tiny_model(arch, dtype=torch.float64)  # same weights, eager experts
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(30)[None]
    truth = run_pieces(truth_model, ids, None, positions, DynamicCache(config=truth_model.config))
    reference = run_pieces(model, ids, None, positions, DynamicCache(config=model.config))
    with kvstack.applied(model, "identity"):
        ours = run_pieces(model, ids, None, positions, kvstack.cache_for(model))
    own_error = (reference - truth).abs().max().item()
    assert (ours - reference).abs().max().item() <= 1e-4
    assert (ours - truth).abs().max().item() <= max(1e-5, 1.5 * own_error)


# ------------------------------------------------------------------------------------------------ other presets
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_compressing_presets_run_and_hold_less_than_the_full_cache(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    steps = 8
    full = kvstack.full_cache_bytes(model.config, ids.shape[1] + steps, batch=2)
    for preset, overrides in (("streaming", {"budget": 16}), ("kivi-4", {"residual": 16, "group_size": 16})):
        with kvstack.applied(model, preset, **overrides):
            cache = kvstack.cache_for(model)
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        assert out.sequences.shape == (2, ids.shape[1] + steps)
        assert all(torch.isfinite(step[0]).all() and torch.isfinite(step[1]).all() for step in out.logits), preset
        held = cache.memory_bytes()
        assert 0 < held < full, (preset, held, full)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("family", list(REFUSED))
def test_refused_family_says_why_and_leaves_the_model_alone(family):
    model = refused_model(family)
    implementation = model.config._attn_implementation
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(kvstack.UnsupportedModelError, match=REFUSED[family]) as info:
        kvstack.apply(model, "streaming")
    assert "kvstack cannot hold the KV cache of model_type=" in str(info.value)
    assert untouched(model, implementation)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    if config_problem(model.config) is not None:  # what the config alone shows is refused from the config too
        with pytest.raises(kvstack.UnsupportedModelError, match=REFUSED[family]):
            kvstack.full_cache_bytes(model.config, 16)


def test_falcon_is_refused_while_it_computes_attention_itself_and_exact_once_it_does_not():
    """Support is read from the model's code: transformers 5.25 moved Falcon onto the attention interface, and from
    then on the identity stack must reproduce its logits (float64, a prefill then a chunk on the cache)."""
    model = refused_model("falcon").double()
    if not falcon_uses_attention_interface():
        with pytest.raises(kvstack.UnsupportedModelError, match="computes attention itself"):
            kvstack.apply(model, "identity")
        return
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        with kvstack.applied(model, "identity"):
            cache = kvstack.cache_for(model)
            ours = torch.cat([model(ids[:, :12], cache=cache).logits, model(ids[:, 12:], cache=cache).logits], 1)
    assert torch.allclose(ours, reference, atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------------ gqa surgery
#: archs gqa cannot convert, with the reason its refusal gives
GQA_REFUSED = {
    "phi3": "fused qkv_proj",
    "phi": "separate q/k/v/o projections",
    "gpt_neox": "separate q/k/v/o projections",
    "gpt2": "separate q/k/v/o projections",
    "falcon": "separate q/k/v/o projections",
    "olmo2": "normalises all 2 KV heads together, one statistic over 2 x 16 channels",
    "olmo3": "normalises all 2 KV heads together, one statistic over 2 x 16 channels",
}
GQA_REFUSED = {arch: why for arch, why in GQA_REFUSED.items() if arch in ALL_ARCHS}
GQA_ARCHS = [a for a in ALL_ARCHS if a not in GQA_REFUSED]
QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")


def _gqa(kv_heads: int, method: str = "mean") -> dict:
    return {"stages": [{"kind": "gqa", "kv_heads": kv_heads, "method": method}]}


@torch.no_grad()
def distinct_norms_and_identical_kv_heads(model) -> None:
    """Query/key norm weights drawn per head (so a conversion that mixes up their heads shows), then KV head 1 made a
    copy of KV head 0 (projections and key norm): merging them loses nothing."""
    from kvstack.stages._calibration import attention_modules

    g = torch.Generator().manual_seed(4)
    for attn in attention_modules(model):
        d = attn.head_dim
        for name in QK_NORM_NAMES:
            norm = getattr(attn, name, None)
            if norm is None:
                continue
            for p in norm.parameters():
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            if name.startswith("k"):
                if hasattr(norm, "norms"):  # StableLM: one LayerNorm per head
                    for a, b in zip(norm.norms[0].parameters(), norm.norms[1].parameters()):
                        b.copy_(a)
                elif norm.weight.ndim == 2:  # Cohere: weights [heads, head_dim]
                    norm.weight[1] = norm.weight[0]
        for proj in (attn.k_proj, attn.v_proj):
            proj.weight[d : 2 * d] = proj.weight[:d]
            if proj.bias is not None:
                proj.bias[d : 2 * d] = proj.bias[:d]


@pytest.mark.parametrize("arch", GQA_ARCHS)
def test_gqa_merging_identical_kv_heads_is_exact(arch):
    model = tiny_model(arch, dtype=torch.float64)
    distinct_norms_and_identical_kv_heads(model)
    ids = torch.randint(3, 128, (1, 28), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(28)[None]
    reference = run_pieces(model, ids, None, positions, DynamicCache(config=model.config))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with kvstack.applied(model, _gqa(1)):
        cache = kvstack.cache_for(model)
        ours = run_pieces(model, ids, None, positions, cache)
        assert model.config.num_key_value_heads == 1
        assert all(layer.full.keys.shape[1] == 1 for layer in cache.layers)
    assert (ours - reference).abs().max().item() <= tol64(arch)
    assert model.config.num_key_value_heads == 2  # remove restored the model exactly
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("arch", GQA_ARCHS)
def test_gqa_align_converts_and_generates(arch):
    model = tiny_model(arch)
    distinct_norms_and_identical_kv_heads(model)
    calibration = [torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    with kvstack.applied(model, _gqa(1, "align"), calibration=calibration):
        cache = kvstack.cache_for(model)
        out = model.generate(ids, cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
        assert all(layer.full.keys.shape[1] == 1 for layer in cache.layers)
    assert out.sequences.shape == (1, 16) and all(torch.isfinite(step).all() for step in out.logits)


@pytest.mark.parametrize("arch", list(GQA_REFUSED))
def test_gqa_refusal_says_why_and_leaves_the_model_alone(arch):
    model = tiny_model(arch, dtype=torch.float64)
    implementation = model.config._attn_implementation
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    with pytest.raises(kvstack.UnsupportedModelError, match=GQA_REFUSED[arch]):
        kvstack.apply(model, _gqa(1))
    assert untouched(model, implementation)
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(modules[name] is module for name, module in model.named_modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    if arch in ("olmo2", "olmo3"):  # keeping every head merges nothing: allowed, and the identity
        ids = torch.randint(3, 128, (1, 26), generator=torch.Generator().manual_seed(7))
        positions = torch.arange(26)[None]
        reference = run_pieces(model, ids, None, positions, DynamicCache(config=model.config))
        with kvstack.applied(model, _gqa(2, "align"), calibration=[ids[0]]):
            ours = run_pieces(model, ids, None, positions, kvstack.cache_for(model))
        assert (ours - reference).abs().max().item() <= tol64(arch)
