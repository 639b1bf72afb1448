"""Long-prompt benchmark: prefill time, peak memory and decode-step time of stacks vs plain transformers.

    python -m kvstack.bench.long_context [--shape llama-1b-2l|llama-8b] [--lengths 2048,8192,16384]
                                         [--stacks identity,streaming,kivi-4,obcache-kivi,max-compression]
                                         [--decode-steps 8] [--device cpu|cuda] [--out DIR]
    python -m kvstack.bench.long_context --chunk-effect [--stacks ...]    # what chunked prefill changes

Random weights, no download. Shapes: ``llama-1b-2l`` — the Llama-3.2-1B attention and MLP shape (hidden 2048,
32 query / 8 KV heads, head_dim 64, intermediate 8192) with 2 layers, float32, for the CPU; ``llama-8b`` — the
Llama-3-8B shape, all 32 layers, bfloat16, for CUDA.

Each configuration (baseline or stack, at one prompt length) runs in a fresh subprocess:

* the baseline is ``DynamicCache`` + SDPA (transformers' default), the stacks are ``kvstack.apply(model, name)``;
  ``quantized-cache`` (transformers' ``QuantizedCache``) joins when its quanto backend is installed;
* prefill: one forward of the whole prompt with ``logits_to_keep=1`` (as ``generate`` does), timed after a short
  warm-up forward;
* peak extra memory: on CPU the process's peak resident set during the prefill minus the resident set before it
  (the kernel's high-water mark, reset through ``/proc/self/clear_refs``); on CUDA
  ``torch.cuda.max_memory_allocated`` minus the allocation before the prefill;
* decode step: mean time of ``--decode-steps`` one-token forwards after the prefill;
* cache bytes: the bytes the cache holds after the prefill (``memory_bytes()``; the keys and values for
  ``DynamicCache``).

Every figure in the table is a ratio to the baseline measured in the same invocation; the JSON keeps the raw
seconds and bytes too. Writes ``DIR/long_context.json`` and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "llama-1b-2l": dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
        num_hidden_layers=2, vocab_size=32000, dtype="float32",
    ),
    "tiny": dict(  # for the tests of this script
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        num_hidden_layers=2, vocab_size=128, dtype="float32",
    ),
    "llama-8b": dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
        num_hidden_layers=32, vocab_size=128256, dtype="bfloat16",
    ),
}
BASELINE = "dynamic-cache"
QUANTIZED_CACHE = "quantized-cache"
DEFAULT_STACKS = ("identity", "streaming", "kivi-4", "obcache-kivi", "max-compression")
DEFAULT_LENGTHS = (2048, 8192, 16384)
RESULTS_FILE = "long_context.json"


# ----------------------------------------------------------------------------------------------- one configuration
def _peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the resident-set high-water mark (VmHWM)
        f.write("5")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def build_model(shape: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(SHAPES[shape])
    dtype = getattr(torch, fields.pop("dtype"))
    config = LlamaConfig(**fields, max_position_embeddings=262144, rope_theta=500000.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def _cache_bytes(cache) -> int:
    from kvstack.bench.protocol import _dynamic_bytes

    return int(cache.memory_bytes()) if hasattr(cache, "memory_bytes") else _dynamic_bytes(cache)


def stack_spec(stack: str):
    """A preset or YAML file, optionally ``NAME+chunkN``: the same stack with stack-level ``prefill_chunk: N``."""
    from kvstack.stack.spec import StackSpec

    name, _, chunk = stack.partition("+chunk")
    spec = StackSpec.load(name)
    return spec.model_copy(update={"prefill_chunk": int(chunk)}) if chunk else spec


def run_one(shape: str, stack: str, length: int, decode_steps: int, device: str) -> dict:
    """Measure one configuration in this process (the parent runs each in a fresh subprocess)."""
    import kvstack
    from kvstack.stack.apply import cache_kwarg
    from transformers import DynamicCache

    torch.set_num_threads(int(os.environ.get("KVSTACK_BENCH_THREADS", torch.get_num_threads())))
    model = build_model(shape, device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(3, vocab, (1, length + decode_steps), generator=gen).to(device)
    prompt, steps = ids[:, :length], ids[:, length:]

    if stack == BASELINE:
        new_cache = lambda: DynamicCache(config=model.config)  # noqa: E731
    elif stack == QUANTIZED_CACHE:
        from transformers import QuantizedCache

        new_cache = lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4)  # noqa: E731
    else:
        # stacks that calibrate (key_basis: calibrated) fit on random ids like the prompt's: this shape's weights are
        # random, and sampling text from it would only cost time
        calibration = torch.randint(3, vocab, (4, 512), generator=torch.Generator().manual_seed(0)).to(device)
        kvstack.apply(model, stack_spec(stack), calibration=calibration)
        new_cache = lambda: kvstack.cache_for(model)  # noqa: E731

    def forward(x, cache):
        return model(x, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        forward(prompt[:, :64], new_cache())  # warm-up: kernels, allocator
        cache = new_cache()
        sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            _peak_reset()
            before = _status_kb("VmRSS") * 1024
        t0 = time.perf_counter()
        forward(prompt, cache)
        sync()
        prefill_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else _status_kb("VmHWM") * 1024
        cache_bytes = _cache_bytes(cache)
        times = []
        for t in range(decode_steps):
            t0 = time.perf_counter()
            forward(steps[:, t : t + 1], cache)
            sync()
            times.append(time.perf_counter() - t0)
    decode_s = sum(times[1:]) / max(len(times) - 1, 1) if times else None  # the first step may allocate
    return {
        "shape": shape, "stack": stack, "length": length, "prefill_s": prefill_s, "peak_extra_bytes": peak - before,
        "decode_step_s": decode_s, "cache_bytes": cache_bytes, "device": device,
    }


def _quanto_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


# --------------------------------------------------------------------------------------------------- the sweep
def run_sweep(shape: str, lengths, stacks, decode_steps: int, device: str, timeout_s: float = 3600.0) -> dict:
    configs = [BASELINE, *stacks]
    if _quanto_available():
        configs.append(QUANTIZED_CACHE)
    rows = []
    for length in lengths:
        for stack in configs:
            cmd = [sys.executable, "-m", "kvstack.bench.long_context", "--child", shape, stack, str(length),
                   str(decode_steps), device]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            if proc.returncode != 0:
                rows.append({"shape": shape, "stack": stack, "length": length, "error": proc.stderr.strip()[-2000:]})
            else:
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(_progress(rows[-1]), file=sys.stderr, flush=True)
    _add_ratios(rows)
    return {
        "meta": {
            "shape": shape, "shape_config": SHAPES[shape], "device": device, "decode_steps": decode_steps,
            "torch": torch.__version__, "threads": int(os.environ.get("KVSTACK_BENCH_THREADS", torch.get_num_threads())),
            "machine": platform.machine(), "quantized_cache": QUANTIZED_CACHE in configs,
        },
        "rows": rows,
    }


def _progress(row: dict) -> str:
    if "error" in row:
        return f"{row['stack']}@{row['length']}: ERROR {row['error'].splitlines()[-1] if row['error'] else ''}"
    return (f"{row['stack']}@{row['length']}: prefill {row['prefill_s']:.2f}s, peak +{row['peak_extra_bytes'] / 2**20:.0f} "
            f"MiB, decode {1e3 * (row['decode_step_s'] or 0):.1f} ms")


def _add_ratios(rows: list[dict]) -> None:
    base = {r["length"]: r for r in rows if r["stack"] == BASELINE and "error" not in r}
    for r in rows:
        b = base.get(r["length"])
        if b is None or "error" in r:
            continue
        r["prefill_ratio"] = r["prefill_s"] / b["prefill_s"]
        r["memory_ratio"] = r["peak_extra_bytes"] / b["peak_extra_bytes"] if b["peak_extra_bytes"] > 0 else None
        if r["decode_step_s"] and b["decode_step_s"]:
            r["decode_ratio"] = r["decode_step_s"] / b["decode_step_s"]
        r["cache_ratio"] = r["cache_bytes"] / b["cache_bytes"] if b["cache_bytes"] else None


def markdown_table(result: dict) -> str:
    lines = [
        "| tokens | stack | prefill time | peak extra memory | decode step | cache bytes |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['length']} | {r['stack']} | failed | | | |")
            continue
        if r["stack"] == BASELINE:
            lines.append(
                f"| {r['length']} | {BASELINE} + SDPA | 1.00x | 1.00x ({r['peak_extra_bytes'] / 2**30:.2f} GiB) "
                f"| 1.00x | 1.00x ({r['cache_bytes'] / 2**20:.0f} MiB) |"
            )
            continue

        def fmt(key):
            v = r.get(key)
            return "n/a" if v is None else f"{v:.2f}x"

        lines.append(
            f"| {r['length']} | {r['stack']} | {fmt('prefill_ratio')} | {fmt('memory_ratio')} | {fmt('decode_ratio')} "
            f"| {fmt('cache_ratio')} |"
        )
    return "\n".join(lines)


def chunk_effect(presets, chunks=(64, 128), passages: int = 32) -> dict:
    """How much stack-level chunked prefill changes quality: the quality protocol (stories260K, 384-token prefix,
    ``kvstack.bench.protocol``) for each preset prefilled in one forward and in pieces of each of ``chunks``."""
    from kvstack.bench.protocol import evaluate, load_model, load_passages, reference_set
    from kvstack.stack.spec import StackSpec

    model, tokenizer = load_model()
    texts = load_passages(n=passages)
    ids = [torch.tensor(tokenizer(t)["input_ids"][:512]) for t in texts]
    references = reference_set(model, ids, 384)
    rows = []
    for preset in presets:
        spec = StackSpec.load(preset)
        for chunk in (None, *chunks):
            variant = spec.model_copy(update={"prefill_chunk": chunk})
            r = evaluate(model, tokenizer, texts, variant, name=preset, references=references)
            rows.append({"stack": preset, "prefill_chunk": chunk, "kl": r.kl, "top1": r.top1,
                         "memory_ratio": r.memory_ratio})
    return {"meta": {"model": "stories260K", "prefix": 384, "passages": passages}, "rows": rows}


def chunk_table(result: dict) -> str:
    lines = ["| stack | one forward: KL / top-1 | "
             + " | ".join(f"chunks of {c}: KL / top-1" for c in sorted({r['prefill_chunk'] for r in result['rows']
                                                                      if r['prefill_chunk']})) + " |"]
    chunks = sorted({r["prefill_chunk"] for r in result["rows"] if r["prefill_chunk"]})
    lines.append("| --- | ---: |" + " ---: |" * len(chunks))
    for stack in dict.fromkeys(r["stack"] for r in result["rows"]):
        cells = []
        for chunk in (None, *chunks):
            r = next(x for x in result["rows"] if x["stack"] == stack and x["prefill_chunk"] == chunk)
            cells.append(f"{r['kl']:.4f} / {r['top1']:.3f}")
        lines.append(f"| {stack} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=5, metavar=("SHAPE", "STACK", "LENGTH", "STEPS", "DEVICE"), help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--lengths", default=None, help="Comma-separated prompt lengths (default 2048,8192,16384).")
    parser.add_argument("--stacks", default=",".join(DEFAULT_STACKS),
                        help="Comma-separated presets or YAML files; NAME+chunkN adds prefill_chunk: N.")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results/long_context"))
    parser.add_argument("--chunk-effect", action="store_true",
                        help="Instead: quality of --stacks with and without stack-level chunked prefill (stories260K).")
    args = parser.parse_args(argv)
    if args.chunk_effect:
        result = chunk_effect([s for s in args.stacks.split(",") if s])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chunk_effect.json").write_text(json.dumps(result, indent=2))
        print(chunk_table(result))
        return
    if args.child:
        shape, stack, length, steps, device = args.child
        print(json.dumps(run_one(shape, stack, int(length), int(steps), device)))
        return
    shape = args.shape or ("llama-8b" if args.device == "cuda" else "llama-1b-2l")
    lengths = [int(x) for x in (args.lengths.split(",") if args.lengths else DEFAULT_LENGTHS)]
    if any(n < 64 for n in lengths):
        parser.error(f"--lengths: every length must be >= 64 (the warm-up forward), got {lengths}")
    stacks = [s for s in args.stacks.split(",") if s]
    result = run_sweep(shape, lengths, stacks, args.decode_steps, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / RESULTS_FILE).write_text(json.dumps(result, indent=2))
    print(markdown_table(result))
    print(f"\nwrote {args.out / RESULTS_FILE}")


if __name__ == "__main__":
    main()
