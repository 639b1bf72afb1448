"""Compress a context once, answer many questions from copies of the compressed cache; the pipeline task."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import pipeline
from transformers.pipelines import get_supported_tasks

import kvstack
from kvstack import CacheUsageError, ContextError, KVStackCache, SpecError, compress_context

QUESTIONS = [" Tim said", " The star"]
NEW = 12
STREAMING = dict(preset="streaming", budget=64)  # 200 context tokens: sinks + the 60 most recent stay


@pytest.fixture(scope="module")
def context(real_model_and_tokenizer):
    """~200 tokens of a stories passage (the model's positions stop at 512)."""
    from kvstack.bench.protocol import load_passages

    _, tok = real_model_and_tokenizer
    return tok.decode(tok(load_passages(n=1)[0]).input_ids[1:200])


def _untouched(model) -> bool:
    return getattr(model, "_kvstack_applied", None) is None and model.config._attn_implementation != "kvstack"


def _plain_greedy(model, tok, text: str, question: str) -> str:
    """Reference: the unprepared model on the context's tokens followed by the question's, DynamicCache."""
    ids = torch.cat([tok(text, return_tensors="pt").input_ids,
                     tok(question, add_special_tokens=False, return_tensors="pt").input_ids], dim=1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_identity_answers_equal_plain_generate(real_model_and_tokenizer, context):
    model, tok = real_model_and_tokenizer
    with compress_context(model, tok, context, "identity") as ctx:
        answers = ctx.answers(QUESTIONS, max_new_tokens=NEW)
    assert _untouched(model)
    assert answers == [_plain_greedy(model, tok, context, q) for q in QUESTIONS]
    assert all(answers)


def test_answers_from_copies_equal_compressing_from_scratch(real_model_and_tokenizer, context):
    model, tok = real_model_and_tokenizer
    with compress_context(model, tok, context, **STREAMING) as ctx:
        once = ctx.answers(QUESTIONS, max_new_tokens=NEW)
    scratch = []
    for question in QUESTIONS:
        with compress_context(model, tok, context, **STREAMING) as fresh:
            scratch.append(fresh.answer(question, max_new_tokens=NEW))
    assert once == scratch
    assert once[0] != once[1]  # the questions did lead to different replies
    assert _untouched(model)


def test_answering_does_not_mutate_the_compressed_cache(real_model_and_tokenizer, context):
    model, tok = real_model_and_tokenizer
    with compress_context(model, tok, context, **STREAMING) as ctx:
        before = ctx.memory_report()
        keys = [layer.full.keys.clone() for layer in ctx._cache.layers]
        positions = [layer.full.positions.clone() for layer in ctx._cache.layers]
        ctx.answers(QUESTIONS, max_new_tokens=NEW)
        after = ctx.memory_report()
        assert after == before and ctx.tokens == before["tokens_seen"] == ctx.context_ids.shape[1]
        assert all(torch.equal(k, layer.full.keys) for k, layer in zip(keys, ctx._cache.layers))
        assert all(torch.equal(p, layer.full.positions) for p, layer in zip(positions, ctx._cache.layers))


@pytest.mark.parametrize("preset", ["kivi-4", "less"])  # a bit-packed quantized tier; a low-rank state tier
def test_deepcopy_of_a_stack_cache_is_independent(real_model_and_tokenizer, context, preset):
    model, tok = real_model_and_tokenizer
    ids = tok(context, return_tensors="pt").input_ids
    with kvstack.applied(model, preset):
        cache = kvstack.cache_for(model)
        with torch.no_grad():
            model(ids, cache=cache)
        clone = copy.deepcopy(cache)
        assert isinstance(clone, KVStackCache) and clone.memory_report() == cache.memory_report()
        assert clone.layers[0].full.keys.data_ptr() != cache.layers[0].full.keys.data_ptr()
        with torch.no_grad():
            model(ids[:, :5], cache=clone)  # continue the copy only
        assert clone.get_seq_length() == cache.get_seq_length() + 5
        assert cache.get_seq_length() == ids.shape[1]
    assert _untouched(model)


@pytest.mark.parametrize("preset", ["streaming", "snapkv"])
def test_a_compressing_preset_saves_memory_and_answers(real_model_and_tokenizer, context, preset):
    model, tok = real_model_and_tokenizer
    with compress_context(model, tok, context, preset) as ctx:
        assert ctx.owns_stack
        assert model.config._attn_implementation == "kvstack"
        report = ctx.memory_report()
        assert report["tokens_seen"] == ctx.tokens and report["ratio"] < 0.75
        assert report["total_bytes"] < report["full_cache_bytes"]
        replies = ctx.answers(QUESTIONS, max_new_tokens=NEW)
    assert all(isinstance(r, str) and r for r in replies)
    assert _untouched(model)


def test_a_prepared_model_keeps_its_stack(real_model_and_tokenizer, context):
    """preset=None uses the applied stack (overrides give a variant of it) and leaves the model prepared."""
    model, tok = real_model_and_tokenizer
    kvstack.apply(model, "streaming")
    try:
        with compress_context(model, tok, context, budget=64) as ctx:
            assert not ctx.owns_stack and ctx.memory_report()["budget"] == "tokens: 64"
            reply = ctx.answer(QUESTIONS[0], max_new_tokens=NEW)
        assert model._kvstack_applied.spec.name == "streaming"  # still prepared
        with pytest.raises(CacheUsageError, match="closed"):
            ctx.answer(QUESTIONS[0])
        with pytest.raises(CacheUsageError, match="already prepared with 'streaming'"):
            compress_context(model, tok, context, "snapkv")
        ctx = compress_context(model, tok, context, budget=64)
    finally:
        kvstack.remove(model)
    with pytest.raises(CacheUsageError, match="stack changed"):
        ctx.answer(QUESTIONS[0])
    with compress_context(model, tok, context, **STREAMING) as owned:
        assert owned.answer(QUESTIONS[0], max_new_tokens=NEW) == reply
    assert _untouched(model)


def test_a_failure_while_compressing_removes_the_stack(real_model_and_tokenizer, context, monkeypatch):
    model, tok = real_model_and_tokenizer
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def explode(self, *args, **kwargs):
        raise RuntimeError("prefill failed")

    monkeypatch.setattr(KVStackCache, "update", explode)
    with pytest.raises(RuntimeError, match="prefill failed"):
        compress_context(model, tok, context, "streaming")
    assert _untouched(model) and "forward" not in model.__dict__ and "generate" not in model.__dict__
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_chat_mode_puts_the_context_in_the_user_turn(real_model_and_tokenizer, context):
    model, tok = real_model_and_tokenizer
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = (
        "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}{% if add_generation_prompt %}<bot>"
        "{% endif %}"
    )
    with compress_context(model, chat_tok, context, "identity", chat=True) as ctx:
        head = chat_tok.decode(ctx.context_ids[0])
        assert head.startswith("<user>") and "</user>" not in head and ctx.chat_suffix == "</user><bot>"
        fed = chat_tok.decode(ctx.question_ids(QUESTIONS[0])[0])
        assert fed.endswith("</user><bot>")
        assert isinstance(ctx.answer(QUESTIONS[0], max_new_tokens=4), str)
    with pytest.raises(ContextError, match="no chat template"):
        compress_context(model, tok, context, "identity", chat=True)
    assert _untouched(model)


def test_bad_input_gives_clear_errors(real_model_and_tokenizer, context):
    model, tok = real_model_and_tokenizer
    with pytest.raises(ContextError, match="context='' is not allowed: a non-empty str"):
        compress_context(model, tok, "", "streaming")
    with pytest.raises(ContextError, match="context=3 is not allowed: a str"):
        compress_context(model, tok, 3, "streaming")
    with pytest.raises(SpecError, match="unknown preset 'streamin'.*did you mean"):
        compress_context(model, tok, context, "streamin")
    with pytest.raises(SpecError, match="n_snk"):
        compress_context(model, tok, context, "streaming", n_snk=2)
    with pytest.raises(CacheUsageError, match="not prepared; pass preset="):
        compress_context(model, tok, context)
    assert _untouched(model)
    with compress_context(model, tok, context, **STREAMING) as ctx:
        with pytest.raises(ContextError, match=r"question=\['a'\] is not allowed: a str"):
            ctx.answer(["a"])
        with pytest.raises(ContextError, match="question='  ' is not allowed"):
            ctx.answer("  ")
        with pytest.raises(ContextError, match="questions='a b' is not allowed: a list of str"):
            ctx.answers("a b")
        with pytest.raises(ContextError, match=r"questions\[1\]=None"):
            ctx.answers(["a", None])
        with pytest.raises(ContextError, match="max_new_tokens=0 is not allowed"):
            ctx.answer("a", max_new_tokens=0)
        with pytest.raises(ContextError, match="past_key_values=None is not allowed"):
            ctx.answer("a", past_key_values=None)
        with pytest.raises(ContextError, match="num_return_sequences=2"):
            ctx.answer("a", num_return_sequences=2)
    assert _untouched(model)


def test_pipeline_task_answers(real_model_and_tokenizer, context):
    model, tok = real_model_and_tokenizer
    assert kvstack.register_pipeline() == "kvstack-text-generation"
    assert "kvstack-text-generation" in get_supported_tasks()
    pipe = pipeline("kvstack-text-generation", model=model, tokenizer=tok, device="cpu", max_new_tokens=NEW)
    assert isinstance(pipe, kvstack.KVStackPipeline)
    with compress_context(model, tok, context, **STREAMING) as ctx:
        expected = ctx.answers(QUESTIONS, max_new_tokens=NEW)
    assert pipe(context, question=QUESTIONS[0], **STREAMING) == {"answer": expected[0]}
    assert pipe(context, questions=QUESTIONS, **STREAMING) == [{"answer": a} for a in expected]
    assert _untouched(model)  # the preset was applied for the call only
    short = context[: len(context) // 2]
    with compress_context(model, tok, short, **STREAMING) as ctx:
        expected_short = ctx.answer(QUESTIONS[0], max_new_tokens=NEW)
    assert pipe([context, short], question=QUESTIONS[0], **STREAMING) == [
        {"answer": expected[0]}, {"answer": expected_short}]  # a list of contexts: one result each
    with kvstack.applied(model, "streaming", budget=64):  # no preset: the model's own stack, left applied
        assert pipe(context, question=QUESTIONS[0]) == {"answer": expected[0]}
        assert model._kvstack_applied.spec.name == "streaming"
    # no preset on an unprepared model: identity, i.e. plain generation
    assert pipe(context, question=QUESTIONS[0]) == {"answer": _plain_greedy(model, tok, context, QUESTIONS[0])}
    assert _untouched(model)


def test_pipeline_bad_input_gives_clear_errors(real_model_and_tokenizer, context):
    model, tok = real_model_and_tokenizer
    pipe = pipeline("kvstack-text-generation", model=model, tokenizer=tok, device="cpu")
    with pytest.raises(ContextError, match="context='' is not allowed"):
        pipe("", question="a")
    with pytest.raises(ContextError, match="context=\\[\\] is not allowed"):
        pipe([], question="a")
    with pytest.raises(ContextError, match="question= or questions= is required"):
        pipe(context)
    with pytest.raises(ContextError, match="exclusive"):
        pipe(context, question="a", questions=["b"])
    with pytest.raises(ContextError, match="question=5 is not allowed: a str"):
        pipe(context, question=5)
    with pytest.raises(SpecError, match="unknown preset 'nope'"):
        pipe(context, question="a", preset="nope")
    assert _untouched(model)
