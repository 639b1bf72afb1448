"""``python -m kvstack.bench.retrieval_layers``: planted needles, the attention the question puts on them, and the
``layer_weights`` it proposes (a spec then carries them)."""

from __future__ import annotations

import json

import pytest

import kvstack
from kvstack.bench import models, real_model, retrieval_layers
from kvstack.bench.retrieval_layers import choose, head_scores, needle_span, planted_tasks

pytestmark = pytest.mark.usefixtures("one_thread")


def test_choose_takes_the_best_scored_layers_ties_by_index():
    assert choose([0.1, 0.5, 0.2, 0.5, 0.0], top=3, weight=4.0) == {1: 4.0, 2: 4.0, 3: 4.0}
    assert choose([0.3, 0.3], top=1, weight=2.5) == {0: 2.5}


def test_bad_arguments_are_refused_by_name(capsys, tmp_path):
    for argv, message in ((["--weight", "0"], "--weight 0 is not allowed"), (["--top", "0"], "--top 0 is not allowed")):
        with pytest.raises(SystemExit):
            retrieval_layers.main(argv)
        assert message in capsys.readouterr().err
    # a haystack without texts, or too short for --start/--tasks, is refused before the model loads
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "x"}\n')
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "a b c"}\n')
    for argv, message in ((["--haystack", str(bad)], "every line must be a JSON object with a 'text'"),
                          (["--haystack", str(short), "--start", "0", "--tasks", "2"], "the haystack has 1 texts")):
        with pytest.raises(SystemExit):
            retrieval_layers.main(["--model", str(tmp_path / "no-model"), *argv])
        assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    return models.load_causal_lm(smollm2_source)


def test_planted_needles_are_in_the_context_and_their_tokens_found(smollm2, smollm2_data):
    _, tokenizer = smollm2
    texts = real_model.load_code_passages(smollm2_data[0], n=3)
    tasks = planted_tasks(texts, tokenizer, length=200)
    assert tasks == planted_tasks(texts, tokenizer, length=200)  # seeded
    for task in tasks:
        assert task["needle"] in task["context"] and task["answer"] in task["needle"]
        context, _ = real_model.needle_texts(tokenizer, task)
        ids, span = needle_span(tokenizer, context, task["needle"])
        assert task["needle"] in tokenizer.decode(ids[span.start : span.stop].tolist())
        assert len(span) < 20


def test_the_question_reads_the_needle_more_than_a_decoy_of_its_size(smollm2, smollm2_data):
    model, tokenizer = smollm2
    (task,) = planted_tasks(real_model.load_code_passages(smollm2_data[0], n=1), tokenizer, length=300)
    scores = head_scores(model, tokenizer, task)
    text = model.config.get_text_config()
    assert scores.shape == (text.num_hidden_layers, text.num_key_value_heads)
    assert float(scores.min()) >= 0 and float(scores.max()) <= 1
    start, size = task["context"].index(task["needle"]), len(task["needle"])
    at = start - 120 if start >= 120 else start + size + 60  # haystack text as long as the needle, away from it
    decoy = task["context"][at : at + size]
    decoy_scores = head_scores(model, tokenizer, task | {"needle": decoy})
    assert float(scores.amax(-1).max()) > 3 * float(decoy_scores.amax(-1).max())
    assert model.config._attn_implementation != "eager"  # the model's attention is given back


def test_main_writes_weights_a_spec_takes(smollm2_source, tmp_path, capsys):
    retrieval_layers.main(["--model", str(smollm2_source), "--start", "0", "--tasks", "1", "--length", "200",
                           "--top", "3", "--weight", "4", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "retrieval_layers.json").read_text())
    weights = {int(k): v for k, v in result["layer_weights"].items()}
    assert len(weights) == 3 and set(weights.values()) == {4.0}
    ranked = sorted(range(len(result["layer_scores"])), key=lambda i: -result["layer_scores"][i])
    assert set(weights) == set(ranked[:3])
    assert "layer_weights: {" in capsys.readouterr().out
    spec = kvstack.StackSpec.load({"budget": {"ratio": 0.125}, "stages": [
        {"kind": "evict", "scorer": "window", "n_sink": 4, "layer_weights": weights}]})
    assert spec.stages[0].layer_weights == weights
