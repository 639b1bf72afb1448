"""The identity stack reproduces the uncompressed model: logits vs DynamicCache for every claimed architecture."""

from __future__ import annotations

import copy

import pytest
import torch
from archs import ARCHS, tiny_model
from transformers import DynamicCache

import kvstack

TOL = {torch.float32: 1e-5, torch.float64: 1e-11}


def tolerance(arch: str, dtype: torch.dtype) -> float:
    # Gemma2 runs transformers' eager attention, whose softmax is computed in float32 even for float64 models
    return 1e-5 if (arch == "gemma2" and dtype == torch.float64) else TOL[dtype]


def run_pieces(model, ids, mask, positions, cache, cuts=(20, 25)):
    """Prefill, a multi-token continuation, then one token at a time — the way generate and chat loops feed."""
    bounds = [0, *cuts, *range(cuts[-1] + 1, ids.shape[1] + 1)]
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        out.append(
            model(
                ids[:, start:end],
                attention_mask=None if mask is None else mask[:, :end],
                position_ids=positions[:, start:end],
                cache=cache,
            ).logits
        )
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_matches_dynamic_cache_float64(arch):
    torch.manual_seed(1)
    model = tiny_model(arch, dtype=torch.float64)
    ids = torch.randint(3, 128, (1, 30))
    positions = torch.arange(30)[None]
    reference = run_pieces(model, ids, None, positions, DynamicCache(config=model.config))
    with kvstack.applied(model, "identity"):
        ours = run_pieces(model, ids, None, positions, kvstack.cache_for(model))
    assert (ours - reference).abs().max().item() <= tolerance(arch, torch.float64)


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_float32_is_as_exact_as_dynamic_cache(arch):
    """float32: within 1e-5 of DynamicCache, and no further from the float64 truth than DynamicCache itself (these
    random models have logits of magnitude ~10, where float32 rounding alone is ~1e-5 and varies with threads)."""
    torch.manual_seed(1)
    model = tiny_model(arch)
    model64 = copy.deepcopy(model).to(torch.float64)
    ids = torch.randint(3, 128, (1, 30))
    positions = torch.arange(30)[None]
    truth = run_pieces(model64, ids, None, positions, DynamicCache(config=model64.config))
    reference = run_pieces(model, ids, None, positions, DynamicCache(config=model.config))
    with kvstack.applied(model, "identity"):
        ours = run_pieces(model, ids, None, positions, kvstack.cache_for(model))
    own_error = (reference - truth).abs().max().item()
    assert (ours - reference).abs().max().item() <= max(1e-5, own_error)
    assert (ours - truth).abs().max().item() <= max(1e-5, 1.5 * own_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("arch", ARCHS)
def test_identity_left_padded_batch_matches_each_row_alone(arch, dtype):
    """A left-padded batch through the stack gives every row the logits DynamicCache gives that row unpadded."""
    torch.manual_seed(2)
    model = tiny_model(arch, dtype=dtype)
    ids = torch.randint(3, 128, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with kvstack.applied(model, "identity"):
        ours = run_pieces(model, ids, mask, positions, kvstack.cache_for(model))
    assert torch.isfinite(ours).all()
    # float32: batch shapes change rounding; transformers' own cache moves a padded row by up to ~3e-5 on these
    # models, so the bound is the larger of 2x the tolerance and 1.5x DynamicCache's own padded-vs-alone difference
    if dtype == torch.float32:
        padded_dynamic = run_pieces(model, ids, mask, positions, DynamicCache(config=model.config))
    for row, pad in ((0, 0), (1, 9)):
        alone = ids[row : row + 1, pad:]
        pos = torch.arange(alone.shape[1])[None]
        ref = run_pieces(model, alone, None, pos, DynamicCache(config=model.config), cuts=(20 - pad, 25 - pad))
        bound = 2 * tolerance(arch, dtype)
        if dtype == torch.float32:
            bound = max(bound, 1.5 * (padded_dynamic[row, pad:] - ref[0]).abs().max().item())
        assert (ours[row, pad:] - ref[0]).abs().max().item() <= bound


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_identity_beam_search_equals_plain_generate(arch):
    torch.manual_seed(3)
    model = tiny_model(arch, dtype=torch.float64)
    ids = torch.randint(3, 128, (2, 12))
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False, return_dict_in_generate=True, output_scores=True)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    with kvstack.applied(model, "identity"):
        ours = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert torch.equal(plain.sequences, ours.sequences)
    assert torch.allclose(plain.sequences_scores, ours.sequences_scores, atol=1e-10)


def test_real_model_greedy_generation_equals_plain(real_model_and_tokenizer):
    model, tokenizer = real_model_and_tokenizer
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=60, do_sample=False)
    with kvstack.applied(model, "identity"):
        ours = model.generate(**inputs, max_new_tokens=60, do_sample=False)
    assert torch.equal(plain, ours)
    assert tokenizer.decode(ours[0]).startswith("<s> Once upon a time, there was a little girl named Lily")


def test_real_model_identity_logits(real_model_and_tokenizer, dev_passages):
    """float64: identical to DynamicCache. float32: as close to the float64 truth as DynamicCache itself is (on this
    model's logits of magnitude ~20, float32 rounding alone moves transformers' own cache by ~1.6e-5)."""
    model, tokenizer = real_model_and_tokenizer
    model64 = type(model)(model.config).to(torch.float64).eval()
    model64.load_state_dict(model.state_dict())
    ids = torch.tensor(tokenizer(dev_passages[0])["input_ids"][:200])[None]
    positions = torch.arange(ids.shape[1])[None]
    cuts = (150, 160)
    truth = run_pieces(model64, ids, None, positions, DynamicCache(config=model64.config), cuts=cuts)
    dynamic32 = run_pieces(model, ids, None, positions, DynamicCache(config=model.config), cuts=cuts)
    with kvstack.applied(model64, "identity"):
        ours64 = run_pieces(model64, ids, None, positions, kvstack.cache_for(model64), cuts=cuts)
    with kvstack.applied(model, "identity"):
        ours32 = run_pieces(model, ids, None, positions, kvstack.cache_for(model), cuts=cuts)
    assert (ours64 - truth).abs().max().item() <= 1e-12
    assert (ours32 - truth).abs().max().item() <= max(1e-5, 1.5 * (dynamic32 - truth).abs().max().item())
