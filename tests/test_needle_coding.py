"""kvstack.bench.needle_coding: the needle with the context's keys and values transform-coded in place."""

from __future__ import annotations

import json

import pytest
import torch
from archs import tiny_model
from transformers import DynamicCache

from kvstack.bench import models, needle_coding, real_model
from kvstack.bench.needle_coding import RESIDUAL, SINKS, code_cache, code_rows, markdown, measure, parse_coding
from kvstack.stack.apply import cache_kwarg
from kvstack.stack.shape import ModelShape

pytestmark = pytest.mark.usefixtures("one_thread")


def test_codings_read_key_bits_basis_and_value_bits_and_refuse_the_rest():
    assert parse_coding("4c/3") == (4.0, "calibrated", 3.0, "own", 0)
    assert parse_coding("1.5w/16") == (1.5, "weights", 16.0, "own", 0)
    assert parse_coding("16/2") == (16.0, "own", 2.0, "own", 0)
    assert parse_coding("3c/1.5c") == (3.0, "calibrated", 1.5, "calibrated", 0)
    assert parse_coding("4c+16/3") == (4.0, "calibrated", 3.0, "own", 16)
    for bad, why in (("4x/3", "KEY_BITS"), ("4/", "KEY_BITS"), ("9/3", "key bits 9"), ("4/0", "value bits 0"),
                     ("4/2w", "VALUE_BITS"), ("4+16/3", r"\+AXES"), ("4c+/3", "KEY_BITS")):
        with pytest.raises(ValueError, match=why):
            parse_coding(bad)
    with pytest.raises(SystemExit):
        needle_coding.main(["--codings", "4/3,4q/3"])


def test_only_the_middle_rows_are_coded_and_more_bits_code_them_closer():
    x = torch.randn(200, 16, generator=torch.Generator().manual_seed(0)) * torch.linspace(3, 0.1, 16)
    errors = []
    for bits in (1, 2, 4):
        y = code_rows(x, bits)
        assert torch.equal(y[:SINKS], x[:SINKS]) and torch.equal(y[-RESIDUAL:], x[-RESIDUAL:])
        middle = slice(SINKS, 200 - RESIDUAL)
        errors.append(float((y[middle] - x[middle]).pow(2).sum() / x[middle].pow(2).sum()))
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.02
    identity = code_rows(x, 2, torch.eye(16))  # a basis given is the one coded in
    assert not torch.allclose(identity, code_rows(x, 2))
    # the prompt's own axes leading a basis: all of them code exactly as the own axes do, more than none closer
    mixed = x @ torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))[0]
    error = lambda y: float((y - mixed)[middle].pow(2).sum())  # noqa: E731
    assert torch.allclose(code_rows(mixed, 2, torch.eye(16), 16), code_rows(mixed, 2), atol=1e-4)
    assert error(code_rows(mixed, 2, torch.eye(16), 8)) < 0.75 * error(code_rows(mixed, 2, torch.eye(16)))


def test_a_cache_is_coded_in_place_through_rope_and_16_bits_leave_it_exact():
    """Keys are coded pre-RoPE and rotated back: at 8 bits each layer's keys and values stay within 1% of what the
    model wrote; 16/16 changes nothing."""
    model = tiny_model("llama")
    shape = ModelShape.from_model(model)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    name = cache_kwarg(model)
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(ids, **{name: reference})
        for bits, tolerance in ((16.0, 0.0), (8.0, 0.01)):
            cache = DynamicCache(config=model.config)
            model(ids, **{name: cache})
            code_cache(cache, shape, bits, bits, None)
            for ours, theirs in zip(cache.layers, reference.layers):
                for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                    assert float((a - b).pow(2).sum() / b.pow(2).sum()) <= tolerance**2
                    assert torch.equal(a[..., :SINKS, :], b[..., :SINKS, :])
                    assert torch.equal(a[..., -RESIDUAL:, :], b[..., -RESIDUAL:, :])


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    return models.load_causal_lm(smollm2_source)


def test_exact_coding_reproduces_the_full_cache_and_coding_runs_on_smollm2(smollm2, smollm2_data):
    model, tokenizer = smollm2
    (task,) = real_model.load_needle_tasks(smollm2_data[1], per_length=1, lengths=(1024,))
    eos = real_model._eos_ids(model, tokenizer)
    full = real_model.needle_task(model, tokenizer, task, DynamicCache(config=model.config), 1, 16, eos)
    rows = measure(model, tokenizer, [task], ["16/16", "1w/1", "16/1c"])
    exact, coarse, calibrated_values = rows
    assert exact["reply"] == full["reply"] and exact["correct"] == full["correct"]
    assert coarse["reply"] != full["reply"]  # 1-bit keys and values in a model's cache change the answer
    assert (coarse["key_bits"], coarse["key_basis"], coarse["value_bits"]) == (1.0, "weights", 1.0)
    assert calibrated_values["value_basis"] == "calibrated" and calibrated_values["key_basis"] == "own"
    table = markdown(rows)
    assert "| 16/16 | 1/1 | - |" in table or "| 16/16 | 0/1 | 1024:0 |" in table
    json.dumps(rows)
