"""kvstack.bench.needle_survival: which tokens of the needle a stack still holds after the context's prefill."""

from __future__ import annotations

import json

import pytest
import torch

from kvstack.bench import models, needle_survival, real_model
from kvstack.bench.needle_survival import held_positions, markdown, measure, needle_tokens, survival

pytestmark = pytest.mark.usefixtures("one_thread")


def test_survival_counts_every_layer_and_head_and_the_16_bit_tier_apart():
    """Two layers: one holds the whole needle (half of it at 16 bits) in both heads, the other holds half the needle
    and the answer in head 0 only; empty slots (-1) and positions past the context are not context tokens."""
    needle, answer = torch.tensor([10, 11, 12, 13]), torch.tensor([12, 13])
    layer0 = [("full", torch.tensor([[0, 10, 11, -1]] * 2)), ("quantized", torch.tensor([[12, 13, 20, 30]] * 2))]
    layer1 = [("full", torch.tensor([[0, 12, 13, 40], [0, 1, 2, 3]]))]
    shares = survival([layer0, layer1], context=40, needle=needle, answer=answer)
    assert shares["context_held"] == pytest.approx((7 / 40 * 2 + 3 / 40 + 4 / 40) / 4)
    assert shares["needle_held"] == pytest.approx((1 + 1 + 0.5 + 0) / 4)
    assert shares["answer_held"] == pytest.approx((1 + 1 + 1 + 0) / 4)
    assert shares["needle_full"] == pytest.approx((0.5 + 0.5 + 0.5 + 0) / 4)


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    return models.load_causal_lm(smollm2_source)


def test_the_needle_tokens_are_the_sentence_and_the_answer_tokens_its_number(smollm2, smollm2_data):
    _, tokenizer = smollm2
    task = real_model.load_needle_tasks(smollm2_data[1], per_length=1, lengths=(1024,))[0]
    ids, needle, answer = needle_tokens(tokenizer, task)
    assert torch.equal(ids, real_model.needle_prompt(tokenizer, task)[0])  # what the protocol prefills
    sentence = tokenizer.decode(ids[needle])
    assert "The secret number of" in sentence and sentence.rstrip().endswith(f"is {task['answer']}.")
    assert tokenizer.decode(ids[answer]).strip() == task["answer"]
    assert bool((torch.diff(needle) == 1).all()) and set(answer.tolist()) <= set(needle.tolist())
    with pytest.raises(ValueError, match="has no sentence 'The secret number of"):
        needle_tokens(tokenizer, task | {"answer": "not-in-the-context"})


def test_a_window_keeps_none_of_an_early_needle_and_the_identity_all_of_it(smollm2, smollm2_data):
    """The first 1K task's needle sits at depth 0.05: `streaming` (4 sinks + the newest) holds a quarter of the
    context and none of it; `identity` holds all of it at 16 bits; a quantized stack holds all of it, none at 16
    bits (the fill tier holds the sinks and the newest tokens)."""
    model, tokenizer = smollm2
    (task,) = real_model.load_needle_tasks(smollm2_data[1], per_length=1, lengths=(1024,))
    assert task["depth"] < 0.1
    rows = {r["stack"]: r for r in measure(model, tokenizer, [task], ["identity", "streaming", "kivi-3-budget"], 0.25)}
    assert rows["identity"]["needle_held"] == rows["identity"]["needle_full"] == rows["identity"]["answer_held"] == 1
    streaming = rows["streaming@0.25"]
    assert streaming["context_held"] == pytest.approx(0.25, abs=0.01) and streaming["memory_ratio"] <= 0.25
    assert streaming["needle_held"] == streaming["answer_held"] == 0
    quantized = rows["kivi-3-budget@0.25"]
    assert quantized["needle_held"] == quantized["answer_held"] == 1 and quantized["needle_full"] == 0
    assert "| streaming@0.25 | 1024 | 1 | 0.2" in markdown(list(rows.values()))
    json.dumps(list(rows.values()))  # the JSON the bench writes


def test_the_bench_refuses_a_ratio_outside_0_1():
    with pytest.raises(SystemExit):
        needle_survival.main(["--ratio", "1.5"])


def test_held_positions_reads_every_exact_tier_of_every_layer(smollm2):
    import kvstack

    model, _ = smollm2
    with kvstack.applied(model, "kivi-3-budget"), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(torch.arange(3, 603)[None], cache=cache)
        held = held_positions(cache)
    assert len(held) == model.config.num_hidden_layers
    for tiers in held:
        names = [name for name, _ in tiers]
        assert names[0] == "full" and len(names) == 2
        every = torch.cat([p for _, p in tiers], -1)
        assert every.shape[0] == model.config.num_key_value_heads
        assert sorted(every[0][every[0] >= 0].tolist()) == list(range(600))
