"""Where a stack keeps the needle: after a needle task's context is prefilled and compressed, how much of the needle
sentence every layer and KV head still holds, and how much of it in full precision, against how much of the whole
context it holds.

    python -m kvstack.bench.needle_survival [--model DIR|GGUF] [--presets streaming,snapkv,tova,h2o,knorm]
                                            [--ratio 0.25] [--tasks 4] [--lengths 1024,2048,4096]
                                            [--threads 2] [--out DIR]

The needle is the sentence "The secret number of NAME is NNNNN." of the needle protocol
(:mod:`kvstack.bench.real_model`); its tokens are those whose characters overlap it, the answer's tokens those that
overlap the number. Per preset (at ``--ratio`` where it takes a budget) and task, over every layer and KV head:

* ``context_held``: the share of the context's tokens held, in any tier;
* ``needle_held``: the share of the needle's tokens held, in any tier;
* ``answer_held``: the share of (layer, KV head) pairs that hold every token of the answer;
* ``needle_full``: the share of the needle's tokens held in the 16-bit tier (the rest are quantized or gone).

A selection blind to the needle holds about as much of it as of the context (``needle_held`` ~ ``context_held``);
one that sees it holds more. Nothing here reads the question: it is what the cache holds when the question arrives.
Writes ``DIR/needle_survival.json`` and prints a markdown table (means over tasks, per length).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

NEEDLE_OPENING = "The secret number of"
FULL_TIER = "full"


def needle_tokens(tokenizer, task: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the context's ids as the needle protocol prefills them, positions of the needle sentence's tokens, positions
    of the answer's tokens); raises ``ValueError`` for a task without "The secret number of ... is ANSWER." in it."""
    from kvstack.bench.real_model import needle_texts

    text, _ = needle_texts(tokenizer, task)
    answer = f" is {task['answer']}."
    end = text.rfind(answer)
    start = text.rfind(NEEDLE_OPENING, 0, end)
    if end < 0 or start < 0:
        raise ValueError(f"task at depth {task.get('depth')} has no sentence '{NEEDLE_OPENING} ...{answer}'")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = torch.tensor(encoded["offset_mapping"])  # [T, 2] character ranges

    def overlapping(lo: int, hi: int) -> torch.Tensor:
        return torch.nonzero((spans[:, 0] < hi) & (spans[:, 1] > lo))[:, 0]

    number = end + len(" is ")
    return (torch.tensor(encoded["input_ids"]), overlapping(start, end + len(answer)),
            overlapping(number, number + len(str(task["answer"]))))


def held_positions(cache) -> list[list[tuple[str, torch.Tensor]]]:
    """Per layer, per exact tier: (tier name, positions held [Hkv, T], -1 for an empty slot) of batch row 0."""
    out = []
    for layer in cache.layers:
        heads = layer.shape_heads()
        out.append([(tier.name, tier.positions[0].expand(heads, -1)) for tier in layer.tiers
                    if tier.positions is not None])
    return out


def survival(held: list[list[tuple[str, torch.Tensor]]], context: int, needle: torch.Tensor,
             answer: torch.Tensor) -> dict[str, float]:
    """The four shares of the module docstring, over every layer and KV head of ``held``."""
    totals = {"context_held": 0.0, "needle_held": 0.0, "answer_held": 0.0, "needle_full": 0.0}
    pairs = 0
    for tiers in held:
        heads = tiers[0][1].shape[0]
        for h in range(heads):
            every = torch.cat([p[h] for _, p in tiers])
            full = torch.cat([p[h] for name, p in tiers if name == FULL_TIER] or [every[:0]])
            totals["context_held"] += int(((every >= 0) & (every < context)).sum()) / context
            totals["needle_held"] += float(torch.isin(needle, every).float().mean())
            totals["answer_held"] += float(torch.isin(answer, every).all())
            totals["needle_full"] += float(torch.isin(needle, full).float().mean())
            pairs += 1
    return {k: v / pairs for k, v in totals.items()}


@torch.no_grad()
def measure(model, tokenizer, tasks: list[dict], presets: list[str], ratio: float | None) -> list[dict]:
    """One row per (preset run, task): the task's length and depth, the memory ratio after the prefill, the shares."""
    import kvstack
    from kvstack.bench import harness, models
    from kvstack.bench.real_model import _step
    from kvstack.stack.apply import cache_kwarg
    from kvstack.stack.memory import full_cache_bytes

    per_token = full_cache_bytes(model.config, 1, dtype=models.model_dtype(model))
    rows = []
    for run in harness.preset_runs(presets, [ratio] if ratio is not None else []):
        with kvstack.applied(model, run.spec):
            for task in tasks:
                ids, needle, answer = needle_tokens(tokenizer, task)
                cache = kvstack.cache_for(model)
                _step(model, ids, 0, cache, cache_kwarg(model))
                shares = survival(held_positions(cache), ids.shape[0], needle, answer)
                rows.append({"stack": run.name, "context_tokens": task["context_tokens"], "depth": task.get("depth"),
                             "needle_tokens": int(needle.numel()),
                             "memory_ratio": cache.memory_bytes() / (per_token * ids.shape[0]), **shares})
    return rows


def markdown(rows: list[dict]) -> str:
    """Means over tasks, one row per (stack, length)."""
    keys = ["memory_ratio", "context_held", "needle_held", "answer_held", "needle_full"]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["stack"], r["context_tokens"]), []).append(r)
    lines = ["| stack | context | tasks | memory ratio | context held | needle held | answer held | needle, 16-bit |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (stack, length), items in groups.items():
        means = [sum(r[k] for r in items) / len(items) for k in keys]
        lines.append(f"| {stack} | {length} | {len(items)} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from kvstack.bench import models, real_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: the shared SmolLM2)")
    parser.add_argument("--presets", default="streaming,snapkv,tova,h2o,knorm", help="presets or YAML files")
    parser.add_argument("--ratio", type=float, default=0.25, help="memory ratio for presets that take a budget")
    parser.add_argument("--tasks", type=int, default=4, help="needle tasks per length (the first N)")
    parser.add_argument("--lengths", default="1024,2048,4096", help="context lengths of the needle dev set")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="runs/needle-survival")
    args = parser.parse_args(argv)
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio {args.ratio:g} is not allowed: a memory ratio in (0, 1]")
    if args.threads:
        torch.set_num_threads(args.threads)
    source = args.model or real_model.model_path()
    model, tokenizer = models.load_causal_lm(source)
    tasks = real_model.load_needle_tasks(lengths=tuple(int(n) for n in args.lengths.split(",")),
                                         per_length=args.tasks)
    rows = measure(model, tokenizer, tasks, args.presets.split(","), args.ratio)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = models.describe_source(source) | {"model_dtype": str(models.model_dtype(model)), "ratio": args.ratio,
                                             "presets": args.presets.split(","), "tasks_per_length": args.tasks,
                                             "threads": torch.get_num_threads()}
    (out / "needle_survival.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
    print(markdown(rows))
    print(f"\nwrote {out / 'needle_survival.json'}")


if __name__ == "__main__":
    main()
