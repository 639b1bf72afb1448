"""``python -m kvstack.bench.lowrank`` — does the LESS state recover what eviction loses, at equal memory?

For each memory target (fraction of an uncompressed cache of the ``prefix`` tokens), three stacks:

* ``window+sinks``: ``evict`` (window scorer, 4 sinks) keeping ``round(target * prefix)`` tokens;
* ``+lowrank random`` / ``+lowrank learned``: the same eviction keeping FEWER tokens, so that the exact tokens plus
  the state's bytes (H, z, c of every full-attention layer) fit in the bytes of the first stack — equal memory.
  Learned kernels are calibrated (``kvstack.stages.lowrank_learned.calibrate``) for that stack on passages
  ``32..63`` of the data file, never on the evaluation passages.

Metrics: KL vs the full cache under the protocol (``kvstack.bench.protocol.evaluate``), the fraction of the
eviction gap recovered ``(KL_evict - KL_lowrank) / KL_evict``, and per layer the attention-output error of the
decode queries (positions ``prefix..``) with teacher forcing (q/k/v of the full model, recency eviction at each
stack's budget), as mean squared error relative to that of ``window+sinks``. Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvstack.bench.protocol import evaluate, load_model, load_passages, reference_set
from kvstack.stack.memory import POSITION_BYTES, _itemsize
from kvstack.stack.shape import ModelShape
from kvstack.stack.spec import StackSpec
from kvstack.stages.lowrank_learned import (
    DEFAULT_STEPS,
    calibrate,
    capture,
    merged_attention,
    recency_caps,
    recency_masks,
    save_kernels,
)

N_SINK = 4


def stack(name: str, tokens: int, lowrank: dict | None = None) -> StackSpec:
    stages = [{"kind": "evict", "scorer": "window", "n_sink": N_SINK, "budget": {"tokens": tokens}}]
    if lowrank is not None:
        stages.append({"kind": "lowrank", **lowrank})
    return StackSpec.load({"name": name, "stages": stages})


def equal_memory_tokens(shape: ModelShape, tokens: int, rank: int) -> int:
    """Exact tokens that, with a rank-``rank`` state, fit in the bytes of ``tokens`` exact tokens (per layer)."""
    per_token = shape.num_kv_heads * (shape.head_dim + shape.value_dim) * _itemsize(shape.dtype) + POSITION_BYTES
    state = stack("probe", tokens, {"rank": rank}).stages[1].state_bytes(shape, shape.dtype)
    return (tokens * per_token - state) // per_token


@torch.no_grad()
def layer_errors(data, layers, shape, spec: StackSpec, prefix: int, maps=None, chunk: int = 8) -> list[float]:
    """Per layer: mean squared attention-output error of the queries at positions ``prefix..`` (teacher forced)."""
    length = data[0]["k"].shape[2]
    group = shape.num_q_heads // shape.num_kv_heads
    pos = torch.arange(prefix, length)
    caps, n_sink = recency_caps(spec, shape, pos)
    kept, evicted = recency_masks(length, pos, caps, n_sink)
    kept, evicted = kept.repeat(group, 1), evicted.repeat(group, 1)
    rows = torch.cat([pos + g * length for g in range(group)])
    errors = []
    for layer, d in zip(layers, data):
        total = 0.0
        for idx in torch.arange(d["k"].shape[0]).split(chunk):
            q, k, v = d["q"][idx][:, :, rows], d["k"][idx], d["v"][idx]
            target = merged_attention(q, k, v, d["scaling"], kept | evicted, None)
            if maps is None:
                out = merged_attention(q, k, v, d["scaling"], kept, evicted)
            else:
                lk = maps[layer].log_key(k, d["scaling"])  # keys first: a centred map takes its centre from them
                lq = maps[layer].log_query(q, d["scaling"])
                out = merged_attention(q, k, v, d["scaling"], kept, evicted, lq.float(), lk.float())
            total += float((out - target).pow(2).mean()) * len(idx)
        errors.append(total / d["k"].shape[0])
    return errors


def run(args) -> dict:
    torch.manual_seed(0)
    model, tok = load_model()
    shape = ModelShape.from_model(model)
    passages = load_passages(n=args.passages)
    calib = load_passages(n=None)[32 : 32 + args.calibration]
    ids = [torch.tensor(tok(t)["input_ids"][: args.max_len]) for t in passages]
    refs = reference_set(model, ids, args.prefix)
    data, layers = capture(model, ids)
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"rank": args.rank, "steps": args.steps, "prefix": args.prefix, "passages": len(passages), "rows": []}
    for target in args.targets:
        tokens = round(target * args.prefix)
        small = equal_memory_tokens(shape, tokens, args.rank)
        base = stack("window+sinks", tokens)
        rand = stack("+lowrank random", small, {"rank": args.rank})
        t0 = time.perf_counter()
        kernels, summary = calibrate(model, tok, rand, calib, steps=args.steps, progress=not args.no_progress)
        kernel_path = out_dir / f"lowrank_kernels_{tokens}.safetensors"
        save_kernels(kernels, kernel_path, summary)
        calib_s = time.perf_counter() - t0
        learned = stack("+lowrank learned", small, {"features": "learned", "kernels": str(kernel_path)})
        base_err = layer_errors(data, layers, shape, base, args.prefix)
        for spec, maps in ((base, None), (rand, rand.stages[1].feature_maps(shape)),
                           (learned, learned.stages[1].feature_maps(shape))):
            res = evaluate(model, tok, passages, spec, references=refs, prefix=args.prefix, max_len=args.max_len)
            errs = layer_errors(data, layers, shape, spec, args.prefix, maps)
            row = {"target": target, "stack": spec.name, "exact_tokens": spec.stages[0].budget.tokens,
                   "memory_ratio": res.memory_ratio, "memory_bytes": res.memory_bytes, "kl": res.kl,
                   "top1": res.top1, "ppl": res.ppl,
                   "layer_error_vs_evict": [e / b for e, b in zip(errs, base_err)], "layer_mse": errs}
            if maps is not None:
                row["calibration_seconds"] = calib_s if spec is learned else None
            results["rows"].append(row)
            print(f"{target:.3f} {spec.name}: KL {res.kl:.5f} ratio {res.memory_ratio:.4f}", flush=True)
    base_kl = {r["target"]: r["kl"] for r in results["rows"] if r["stack"] == "window+sinks"}
    for r in results["rows"]:
        r["gap_recovered"] = (base_kl[r["target"]] - r["kl"]) / base_kl[r["target"]]
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


def markdown(results: dict) -> str:
    n_layers = len(results["rows"][0]["layer_error_vs_evict"])
    head = ["memory", "stack", "exact tokens", "memory ratio", "KL", "top-1", "gap recovered"]
    head += [f"L{i} err" for i in range(n_layers)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results["rows"]:
        cells = [f"{r['target']:.1%}", r["stack"], str(r["exact_tokens"]), f"{r['memory_ratio']:.4f}",
                 f"{r['kl']:.5f}", f"{r['top1']:.4f}",
                 "—" if r["stack"] == "window+sinks" else f"{r['gap_recovered']:+.1%}"]
        cells += [f"{e:.3f}" for e in r["layer_error_vs_evict"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passages", type=int, default=32, help="evaluation passages (the first N of the dev file)")
    p.add_argument("--calibration", type=int, default=32, help="calibration passages (from index 32 on)")
    p.add_argument("--targets", type=float, nargs="+", default=[0.25, 0.125], help="memory targets")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="calibration steps")
    p.add_argument("--prefix", type=int, default=384)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--out", default="lowrank_results.json", help="JSON output (kernels are written next to it)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    if any(not 0 < t <= 1 or math.isnan(t) for t in args.targets):
        p.error("--targets must be in (0, 1]")
    print(markdown(run(args)))


if __name__ == "__main__":
    main()
