"""One call: ``kvstack.apply(model, preset)`` prepares a model so that ``generate`` uses a composed cache.

``apply`` validates the spec against the model's config before touching anything, performs model-surgery stages,
installs the stack's attention function (a forward without a ``KVStackCache`` still runs the model's original
attention: losses, perplexity and ``use_cache=False`` are unchanged) and wraps ``model.generate`` (an instance attribute, so ``remove`` restores
the class method) to pass a fresh :class:`KVStackCache` unless the caller passes a cache. On any failure every change
is undone: a failed ``apply`` leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import attention, prefill
from .budget import check_budget
from .cache import KVStackCache
from .errors import CacheUsageError, SpecError
from .shape import ModelShape
from .spec import StackSpec

APPLIED_ATTR = "_kvstack_applied"


@dataclass
class Applied:
    spec: StackSpec
    shape: ModelShape  # after model surgery: what the cache holds
    original_attn: Any
    original_shape: ModelShape | None = None  # before surgery: what memory ratios are against
    undo: list[Callable[[], None]] = field(default_factory=list)


def cache_kwarg(model) -> str:
    """The name a model's forward and generate take the cache under: ``cache`` (5.24+) or ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output):
    """The cache a model's forward returned (``use_cache=True``): ``output.cache`` (5.24+) or ``past_key_values``."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def apply(model, preset: "StackSpec | dict | str | Path" = "identity", calibration: Any = None, **overrides):
    """Prepare ``model`` to run with the stack ``preset`` (name, YAML path or text, dict or :class:`StackSpec`).

    ``overrides`` replace fields, validated like YAML (:meth:`StackSpec.with_overrides`):
    ``kvstack.apply(model, "h2o", budget=0.25, n_sink=8)``. Returns the model. Applying again replaces the
    previous stack (its surgery is undone first).
    """
    _check_model(model)
    spec = StackSpec.load(preset)
    if overrides:
        spec = spec.with_overrides(**overrides)
    shape = ModelShape.from_model(model)
    spec.validate_for(shape)
    check_budget(spec, shape, shape.dtype)
    if getattr(model, APPLIED_ATTR, None) is not None:
        remove(model)

    attention.register()
    state = Applied(spec=spec, shape=shape, original_attn=model.config._attn_implementation, original_shape=shape)
    try:
        for stage in spec.model_stages:
            undo = stage.prepare_model(model, calibration)
            if undo is not None:
                state.undo.append(undo)
        state.shape = ModelShape.from_model(model)  # surgery may change heads/dims
        model.set_attn_implementation(attention.ATTN_NAME)
        if model.config._attn_implementation != attention.ATTN_NAME:
            raise SpecError(f"{type(model).__name__} does not accept a custom attention function")
        attention.remember_original(model.config, state.original_attn or "sdpa")
        model.generate = _wrap_generate(model, model.generate)
        model.forward = prefill.wrap_forward(model.forward, spec.chunk_size(), cache_kwarg(model))
        setattr(model, APPLIED_ATTR, state)
    except BaseException:
        _restore(model, state)
        raise
    return model


def _check_model(model) -> None:
    """A transformers model object, not a name or a pipeline: say what to pass instead."""
    if isinstance(model, (str, Path)):
        raise SpecError(
            f"model={str(model)!r} is not allowed: pass a loaded model, e.g. "
            f"kvstack.apply(AutoModelForCausalLM.from_pretrained({str(model)!r}), preset)"
        )
    if not hasattr(model, "config") and hasattr(getattr(model, "model", None), "config"):  # a transformers pipeline
        raise SpecError(f"model={type(model).__name__} is a pipeline: pass its model, kvstack.apply(pipe.model, preset)")
    if not (hasattr(model, "config") and hasattr(model, "parameters") and hasattr(model, "set_attn_implementation")):
        raise SpecError(f"model={type(model).__name__} is not allowed: a transformers PreTrainedModel (causal LM)")


def _restore(model, state: Applied) -> None:
    model.__dict__.pop("generate", None)
    model.__dict__.pop("forward", None)
    if hasattr(model, APPLIED_ATTR):
        delattr(model, APPLIED_ATTR)
    attention.forget_original(model.config)
    if model.config._attn_implementation != state.original_attn:
        model.set_attn_implementation(state.original_attn)
    for undo in reversed(state.undo):
        undo()


def remove(model) -> None:
    """Restore the model's original attention, ``generate`` and (where stages allow) weights."""
    state = getattr(model, APPLIED_ATTR, None)
    if state is None:
        raise CacheUsageError("remove: this model was not prepared with kvstack.apply")
    _restore(model, state)


@contextlib.contextmanager
def applied(model, preset="identity", calibration: Any = None, **overrides):
    """``with kvstack.applied(model, "streaming"): model.generate(...)`` — removed again on exit."""
    apply(model, preset, calibration, **overrides)
    try:
        yield model
    finally:
        remove(model)


def cache_for(model, spec: "StackSpec | dict | str | Path | None" = None) -> KVStackCache:
    """A fresh cache for manual loops: ``model(ids, cache=cache)`` (``past_key_values=`` before 5.24).

    ``spec`` defaults to the stack the model was prepared with; another spec may be given as long as its
    model-surgery stages are the ones applied.
    """
    state: Applied | None = getattr(model, APPLIED_ATTR, None)
    if state is None:
        raise CacheUsageError(
            "cache_for: the model is not prepared; call kvstack.apply(model, preset) first (it installs the attention "
            "function the cache needs)"
        )
    if spec is None:
        return KVStackCache(state.spec, state.shape, reference=state.original_shape)
    spec = StackSpec.load(spec)
    if spec.model_stages != state.spec.model_stages:
        raise SpecError(
            "cache_for: the spec's model-surgery stages "
            f"{[s.kind for s in spec.model_stages]} differ from those applied "
            f"{[s.kind for s in state.spec.model_stages]}; call kvstack.apply(model, spec) instead"
        )
    spec.validate_for(state.shape)
    check_budget(spec, state.original_shape, state.original_shape.dtype)
    return KVStackCache(spec, state.shape, reference=state.original_shape)


def _wrap_generate(model, generate):
    name = cache_kwarg(model)

    @functools.wraps(generate)
    def generate_with_stack(*args, **kwargs):
        if kwargs.get("use_cache") is False:  # no cache: the model's original attention runs every step
            return generate(*args, **kwargs)
        if kwargs.get("cache_implementation") is not None:
            raise CacheUsageError(
                f"generate(cache_implementation={kwargs['cache_implementation']!r}) on a kvstack-prepared model: the "
                "stack supplies the cache; drop cache_implementation, or kvstack.remove(model) to use another cache"
            )
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
            kwargs.pop("cache", None)
            kwargs.pop("past_key_values", None)
            kwargs[name] = cache_for(model)
        return generate(*args, **kwargs)

    return generate_with_stack
