"""On the real model (stories260K, dev passages): the protocol "prefill 384 tokens, compress, then one token at a
time" gives a finite KL that decreases as the budget grows, for every scorer (token granularity) and for block
granularity (two scorers, to keep the file fast). The stage fields are the benchmark's (kvstack.bench.eviction)."""

from __future__ import annotations

import math

import pytest
import torch

from kvstack.bench.eviction import SCORERS, stack
from kvstack.bench.protocol import evaluate, reference_set

PREFIX, LENGTH = 384, 416  # 32 decode steps per passage keeps the file fast
CASES = [(s, "token") for s in SCORERS] + [("value_key_ratio", "block"), ("snapkv", "block")]


@pytest.fixture(scope="module")
def setup(real_model_and_tokenizer, dev_passages):
    model, tokenizer = real_model_and_tokenizer
    passages = dev_passages[:3]
    ids = [torch.tensor(tokenizer(t)["input_ids"][:LENGTH]) for t in passages]
    return model, tokenizer, passages, reference_set(model, ids, PREFIX)


@pytest.mark.parametrize(("scorer", "granularity"), CASES)
def test_kl_finite_and_decreasing_with_budget(setup, scorer, granularity):
    model, tokenizer, passages, refs = setup
    kls = []
    for keep in (0.125, 0.25, 0.5):
        spec = stack(scorer, granularity, keep)
        result = evaluate(model, tokenizer, passages, spec, prefix=PREFIX, max_len=LENGTH, references=refs)
        assert math.isfinite(result.kl) and result.kl > 0
        kls.append(result.kl)
    assert kls[0] > kls[1] > kls[2], kls
