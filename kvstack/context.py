"""Compress a long context once, then answer many questions against copies of the compressed cache.

    ctx = kvstack.compress_context(model, tokenizer, long_text, "snapkv", budget=0.25)
    with ctx:
        ctx.answers(["\\nQuestion: who? Answer:", "\\nQuestion: where? Answer:"])

The context is prefilled ONCE into a :class:`~kvstack.KVStackCache`, which compresses it as its stack says. Each
answer runs ``generate`` on a deep copy of that cache, fed the question's tokens after the context (positions
continue), so questions never see each other and the compressed cache stays as it was. The compression is
question-agnostic: the context is compressed before any question is known; the question's own forward is then
compressed by the same stack, like any prompt forward.

Who owns the stack: with ``preset`` given, ``compress_context`` applies it to a model that is NOT prepared and the
returned context owns it — ``close()`` (or leaving its ``with`` block) runs ``kvstack.remove``; any failure while
compressing removes it at once, so the model is never left half-patched. With ``preset=None`` the model must already
be prepared (``kvstack.apply``); the context uses that stack (``overrides`` give a variant of it, as
``kvstack.cache_for``) and leaves the model prepared when closed.

The transformers pipeline task ``"kvstack-text-generation"`` (:class:`KVStackPipeline`) wraps the same steps; it is
registered when ``kvstack`` is imported (:func:`register_pipeline`).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Sequence

import torch
from transformers.pipelines.base import Pipeline

from .stack.apply import APPLIED_ATTR, apply, cache_for, cache_kwarg, remove
from .stack.cache import KVStackCache
from .stack.errors import CacheUsageError, KVStackError

PIPELINE_TASK = "kvstack-text-generation"
DEFAULT_MAX_NEW_TOKENS = 64
#: Stands in for the user message while the chat template is split into (before the context, after the question).
_CONTENT_MARK = "\x00kvstack-user-content\x00"
#: generate() arguments the context supplies itself: passing them would bypass (or break) the copied cache.
_OWN_GENERATE_ARGS = ("input_ids", "inputs", "inputs_embeds", "attention_mask", "cache", "past_key_values",
                      "use_cache", "cache_implementation", "position_ids", "cache_position")


class ContextError(KVStackError, ValueError):
    """A context or question that cannot be compressed or answered (empty, not a string, a bad argument)."""


def _check_text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ContextError(f"{name}={value!r} is not allowed: a str ({type(value).__name__} given)")
    if not value.strip():
        raise ContextError(f"{name}={value!r} is not allowed: a non-empty str")
    return value


def _chat_parts(tokenizer) -> tuple[str, str]:
    """The chat template around one user message, with its generation prompt: (before, after) the message text."""
    if not getattr(tokenizer, "chat_template", None):
        raise ContextError(
            f"chat=True is not allowed: the tokenizer ({type(tokenizer).__name__}) has no chat template; use chat=False"
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT_MARK}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(_CONTENT_MARK) != 1:
        raise ContextError(
            "chat=True is not allowed with this tokenizer: its chat template does not place the user message verbatim "
            "once, so the context cannot be compressed before the question; use chat=False and format it yourself"
        )
    before, after = text.split(_CONTENT_MARK)
    return before, after


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


class CompressedContext:
    """A context prefilled once into a compressed cache; :meth:`answer` runs each question on a deep copy of it.

    Made by :func:`compress_context`. Use it as a context manager (or call :meth:`close`) when it owns the stack it
    applied, so the model gets its original attention back."""

    def __init__(self, model, tokenizer, cache: KVStackCache, context_ids: torch.Tensor, *, suffix: str | None,
                 owns_stack: bool):
        self.model = model
        self.tokenizer = tokenizer
        self._cache = cache
        self.context_ids = context_ids  # [1, T]: what the cache has seen
        self.chat_suffix = suffix  # chat mode: the template text after the user message (None without chat)
        self.owns_stack = owns_stack
        self._state = getattr(model, APPLIED_ATTR)
        self._closed = False

    def __repr__(self) -> str:
        report = self._cache.memory_report()
        return (f"CompressedContext(spec={self._cache.spec.name!r}, tokens={report['tokens_seen']}, "
                f"ratio={report['ratio']:.3f}, closed={self._closed})")

    # ------------------------------------------------------------------------- lifetime
    def __enter__(self) -> "CompressedContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the context; when it applied the stack itself, remove it from the model (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.owns_stack and getattr(self.model, APPLIED_ATTR, None) is self._state:
            remove(self.model)

    def _check_usable(self) -> None:
        if self._closed:
            raise CacheUsageError("this CompressedContext is closed; compress the context again (compress_context)")
        if getattr(self.model, APPLIED_ATTR, None) is not self._state:
            raise CacheUsageError(
                "the model's stack changed since compress_context (kvstack.remove or another kvstack.apply): the "
                "compressed cache needs the stack it was made with; compress the context again"
            )

    # ------------------------------------------------------------------------- reading
    @property
    def tokens(self) -> int:
        """Tokens of the context the cache has seen (kept or not)."""
        return self._cache.get_seq_length()

    def memory_report(self) -> dict:
        """The compressed cache's bytes by layer and tier, the full cache's bytes and their ratio
        (:meth:`KVStackCache.memory_report`)."""
        return self._cache.memory_report()

    def cache_copy(self) -> KVStackCache:
        """A deep copy of the compressed cache, for a manual loop that continues after the context."""
        self._check_usable()
        return copy.deepcopy(self._cache)

    # ------------------------------------------------------------------------- answering
    def question_ids(self, question: str) -> torch.Tensor:
        """[1, Q] tokens fed after the context: the question as given (no separator is added; chat mode appends the
        rest of the chat template, generation prompt included)."""
        _check_text("question", question)
        text = question if self.chat_suffix is None else question + self.chat_suffix
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if ids.shape[1] == 0:
            raise ContextError(f"question={question!r} is not allowed: it gives no tokens")
        return ids.to(self.context_ids.device)

    def answer(self, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **generate_kwargs) -> str:
        """Generate the reply to ``question`` from a deep copy of the compressed cache (greedy unless
        ``do_sample=True``); returns only the new text. ``generate_kwargs`` go to ``model.generate``."""
        self._check_usable()
        _check_generate_args(max_new_tokens, generate_kwargs)
        ids = torch.cat([self.context_ids, self.question_ids(question)], dim=1)
        kwargs = {"do_sample": False, **generate_kwargs, cache_kwarg(self.model): copy.deepcopy(self._cache)}
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=max_new_tokens, **kwargs)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def answers(self, questions: Sequence[str], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                **generate_kwargs) -> list[str]:
        """:meth:`answer` for each question, in order, each from its own copy of the compressed cache."""
        if isinstance(questions, str) or not isinstance(questions, Sequence):
            raise ContextError(f"questions={questions!r} is not allowed: a list of str (one str: use answer())")
        if not questions:
            raise ContextError("questions=[] is not allowed: give at least one question")
        for i, question in enumerate(questions):
            _check_text(f"questions[{i}]", question)
        return [self.answer(q, max_new_tokens, **generate_kwargs) for q in questions]


def _check_generate_args(max_new_tokens: Any, generate_kwargs: dict) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ContextError(f"max_new_tokens={max_new_tokens!r} is not allowed: an int >= 1")
    own = [name for name in _OWN_GENERATE_ARGS if name in generate_kwargs]
    if own:
        raise ContextError(
            f"{own[0]}={generate_kwargs[own[0]]!r} is not allowed: the compressed context supplies the input tokens, "
            "their attention mask and a copy of its cache to generate"
        )
    n = generate_kwargs.get("num_return_sequences", 1)
    if n != 1:
        raise ContextError(f"num_return_sequences={n!r} is not allowed: answer() returns one reply")


def compress_context(model, tokenizer, context: str, preset=None, *, chat: bool = False,
                     **overrides) -> CompressedContext:
    """Prefill ``context`` once into a compressed cache and return a :class:`CompressedContext` to ask it questions.

    ``preset`` (name, YAML, dict or :class:`~kvstack.StackSpec`) is applied to an unprepared model and owned by the
    returned context (removed by ``close()``); ``preset=None`` uses the stack the model was prepared with.
    ``overrides`` (``budget=0.25``, ``n_sink=8``, ...) are validated like ``kvstack.apply``'s. ``chat=True`` puts
    the context at the start of one user turn of the tokenizer's chat template; each question ends that turn.
    """
    _check_text("context", context)
    if isinstance(model, Pipeline):
        raise ContextError(f"model={type(model).__name__} is a pipeline: pass its model (pipe.model) or call the "
                           f"pipeline itself (task {PIPELINE_TASK!r})")
    prepared = getattr(model, APPLIED_ATTR, None) is not None
    if preset is None and not prepared:
        raise CacheUsageError(
            "compress_context: the model is not prepared; pass preset= (e.g. preset='streaming') or call "
            "kvstack.apply(model, preset) first"
        )
    if preset is not None and prepared:
        raise CacheUsageError(
            f"compress_context(preset={preset!r}) on a model already prepared with "
            f"{getattr(model, APPLIED_ATTR).spec.name!r}: drop preset= to use that stack, or kvstack.remove(model) "
            "first (compress_context does not replace a stack it did not apply)"
        )
    before, suffix = _chat_parts(tokenizer) if chat else ("", None)
    if chat:
        ids = tokenizer(before + context, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(context, return_tensors="pt")["input_ids"]
    if preset is not None:
        apply(model, preset, **overrides)  # validated before touching the model: a failure leaves it unchanged
    try:
        if preset is None and overrides:  # a variant of the applied stack (its surgery stages unchanged)
            cache = cache_for(model, getattr(model, APPLIED_ATTR).spec.with_overrides(**overrides))
        else:
            cache = cache_for(model)
        ids = ids.to(_model_device(model))
        _prefill(model, ids, cache)
    except BaseException:
        if preset is not None:
            remove(model)
        raise
    return CompressedContext(model, tokenizer, cache, ids, suffix=suffix, owns_stack=preset is not None)


def _prefill(model, ids: torch.Tensor, cache: KVStackCache) -> None:
    """One forward of the context into ``cache`` (chunked when the stack says so); only the last logits are made."""
    kwargs = {cache_kwarg(model): cache, "attention_mask": torch.ones_like(ids)}
    if "logits_to_keep" in inspect.signature(type(model).forward).parameters:
        kwargs["logits_to_keep"] = 1
    with torch.no_grad():
        model(input_ids=ids, **kwargs)


# ----------------------------------------------------------------------------------------- the pipeline task
class KVStackPipeline(Pipeline):
    """``pipeline("kvstack-text-generation", model=..., tokenizer=...)``: compress a context once, answer questions.

    ``pipe(context, question="...")`` -> ``{"answer": str}``; ``pipe(context, questions=[...])`` -> a list of them.
    ``preset`` (default: the stack the model is prepared with, else ``identity``: no compression) is applied for the
    call only; ``budget=`` and other stack fields override it; ``max_new_tokens``, ``chat`` and ``generate``'s own
    parameters (``do_sample``, ``temperature``, ...) are passed on. Arguments may be given at construction (defaults)
    or per call.
    """

    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False
    _pipeline_calls_generate = False  # the compressed context calls generate itself, on a copy of its cache

    _OWN = ("question", "questions", "preset", "chat", "max_new_tokens")

    def __call__(self, context=None, *args, **kwargs):
        """``context``: a str (or a list of them: one result per context)."""
        if context is None:
            context = kwargs.pop("inputs", None)
        if isinstance(context, (list, tuple)):
            if not context:
                raise ContextError("context=[] is not allowed: a str or a non-empty list of str")
            for i, text in enumerate(context):
                _check_text(f"context[{i}]", text)
            context = list(context)
        else:
            _check_text("context", context)
        return super().__call__(context, *args, **kwargs)

    def _sanitize_parameters(self, **params):
        from transformers import GenerationConfig

        generation = {k for k in vars(GenerationConfig()) if not k.startswith("_")} - {"max_new_tokens"}
        forward: dict = {}
        if "question" in params and "questions" in params:
            raise ContextError("question= and questions= are exclusive: give one str or one list of str")
        for name in self._OWN:
            if name in params:
                forward[name] = params.pop(name)
        if "question" in forward:
            _check_text("question", forward["question"])
        gen = {k: params.pop(k) for k in list(params) if k in generation or k == "generation_config"}
        if gen:
            forward["generate_kwargs"] = gen
        if params:  # stack fields (budget, n_sink, ...): validated against the preset when it is loaded
            forward["overrides"] = params
        return {}, forward, {}

    def preprocess(self, context, **_):
        return {"context": _check_text("context", context)}

    def _forward(self, inputs, question=None, questions=None, preset=None, chat=False,
                 max_new_tokens=DEFAULT_MAX_NEW_TOKENS, generate_kwargs=None, overrides=None):
        if question is None and questions is None:
            raise ContextError("question= or questions= is required: the question(s) to answer about the context")
        if preset is None and getattr(self.model, APPLIED_ATTR, None) is None:
            preset = "identity"
        generate_kwargs = generate_kwargs or {}
        with compress_context(self.model, self.tokenizer, inputs["context"], preset, chat=bool(chat),
                              **(overrides or {})) as ctx:
            if question is not None:
                return {"answers": [ctx.answer(question, max_new_tokens, **generate_kwargs)], "single": True}
            return {"answers": ctx.answers(questions, max_new_tokens, **generate_kwargs), "single": False}

    def postprocess(self, outputs, **_):
        if outputs["single"]:
            return {"answer": outputs["answers"][0]}
        return [{"answer": a} for a in outputs["answers"]]


def register_pipeline() -> str:
    """Register the ``"kvstack-text-generation"`` task with transformers (done by ``import kvstack``; idempotent).

    Returns the task name."""
    from transformers import AutoModelForCausalLM
    from transformers.pipelines import PIPELINE_REGISTRY

    registered = PIPELINE_REGISTRY.supported_tasks.get(PIPELINE_TASK)
    if registered is None or registered.get("impl") is not KVStackPipeline:
        PIPELINE_REGISTRY.register_pipeline(PIPELINE_TASK, pipeline_class=KVStackPipeline,
                                            pt_model=AutoModelForCausalLM, type="text")
    return PIPELINE_TASK
