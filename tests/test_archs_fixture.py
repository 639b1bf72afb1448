"""Sanity checks for the tiny random-model fixtures in tests/archs.py.

For every arch: incremental decoding with a DynamicCache reproduces a full
no-cache forward (single prompt and left-padded batch, generate-style
position_ids), and for sliding-window arches the window really changes logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from archs import ARCHS, SLIDING_ARCHS, SLIDING_WINDOW, tiny_model

TOL = 1e-4
PROMPT_LEN = 30
NEW_TOKENS = 10  # prompt + new tokens = 40 > SLIDING_WINDOW, so sliding caches wrap


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """position_ids the way generate computes them from a 2D attention mask."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _incremental(model, prompt: torch.Tensor, mask: torch.Tensor, steps: int):
    """Greedy decode with a DynamicCache; returns (full ids, full mask, logits per position).

    The returned logits tensor has shape [B, prompt_len + steps, V]: the prefill
    logits followed by one decode-step logit row per generated token (the last
    generated token is fed back once more, so every position has logits).
    """
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, attention_mask=mask, position_ids=_positions(mask), cache=cache, use_cache=True)
    logits = [out.logits]
    ids, am = prompt, mask
    for _ in range(steps):
        nxt = logits[-1][:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        am = torch.cat([am, torch.ones_like(nxt)], dim=1)
        pos = _positions(am)[:, -1:]
        out = model(input_ids=nxt, attention_mask=am, position_ids=pos, cache=cache, use_cache=True)
        logits.append(out.logits)
    return ids, am, torch.cat(logits, dim=1)


@torch.no_grad()
def _full(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=False).logits


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, tiny_model(request.param)


def test_builds_small_eval_finite(arch_model):
    arch, model = arch_model
    assert not model.training
    assert type(model).__name__.endswith("ForCausalLM")
    cfg = model.config
    assert cfg.vocab_size == 128 and 0 <= cfg.pad_token_id < 128
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    if arch == "gemma3":
        assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
    if arch in SLIDING_ARCHS:
        assert cfg.sliding_window == SLIDING_WINDOW
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 40, 128)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.5  # large-std init: logits are far from flat


def test_deterministic_per_seed():
    a, b, c = tiny_model("qwen3", seed=3), tiny_model("qwen3", seed=3), tiny_model("qwen3", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_incremental_matches_full_single(arch_model):
    _, model = arch_model
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 128, (1, PROMPT_LEN), generator=g)
    mask = torch.ones_like(prompt)
    ids, am, inc = _incremental(model, prompt, mask, NEW_TOKENS)
    ref = _full(model, ids, am)
    assert inc.shape == ref.shape == (1, PROMPT_LEN + NEW_TOKENS, 128)
    assert (inc - ref).abs().max().item() < TOL


def test_incremental_matches_full_left_padded_batch(arch_model):
    _, model = arch_model
    g = torch.Generator().manual_seed(1)
    n_pad = 9
    prompt = torch.randint(3, 128, (2, PROMPT_LEN), generator=g)
    mask = torch.ones_like(prompt)
    prompt[1, :n_pad] = model.config.pad_token_id
    mask[1, :n_pad] = 0
    ids, am, inc = _incremental(model, prompt, mask, NEW_TOKENS)
    ref = _full(model, ids, am)
    valid = am.bool()
    diff = (inc - ref).abs()[valid]
    assert diff.max().item() < TOL
    # the padded row must equal the same prompt run alone without padding
    solo_ids = ids[1:, n_pad:]
    solo = _full(model, solo_ids, torch.ones_like(solo_ids))
    assert (solo[0] - ref[1, n_pad:]).abs().max().item() < TOL


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
@torch.no_grad()
def test_sliding_window_is_exercised(arch):
    windowed = tiny_model(arch)
    unwindowed = tiny_model(arch, sliding_window=10_000)
    sa, sb = windowed.state_dict(), unwindowed.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # same weights, only the window differs
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    a, b = windowed(ids).logits, unwindowed(ids).logits
    # positions whose whole history fits in the window are unaffected...
    assert (a[:, :SLIDING_WINDOW] - b[:, :SLIDING_WINDOW]).abs().max().item() < TOL
    # ...later ones change clearly
    assert (a[:, SLIDING_WINDOW:] - b[:, SLIDING_WINDOW:]).abs().max().item() > 0.1
