"""Head and channel stages on the real model: ``python -m kvstack.bench.heads_channels [--out FILE]``.

Runs the quality protocol (:mod:`kvstack.bench.protocol`: 32 dev passages, prefix 384, token by token, KL vs. the
full cache) for GQA conversion (``mean`` vs. calibrated ``align``, to 2 and 1 KV heads) and channel pruning
(``dynamic`` ThinK vs. calibrated ``static``, 25% and 50% of key channels), and ThinK on 4-bit KIVI (the
``think-kivi`` composition). Calibration uses dev passages 32..63,
never the 32 evaluation passages. Memory is the cache's bytes right after the prefix over an uncompressed cache of
the ORIGINAL model (so GQA's saving shows). Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvstack
from kvstack.stack.memory import full_cache_bytes

from . import protocol

EVAL_PASSAGES = 32
CALIBRATION = slice(32, 64)

KIVI_4 = {"kind": "quantize", "bits": 4, "group_size": 32, "value_group_size": "head_dim", "residual": 32}

STACKS: list[tuple[str, dict]] = [
    ("full (identity stack)", {"stages": []}),
    ("gqa mean -> 2 KV heads", {"stages": [{"kind": "gqa", "kv_heads": 2, "method": "mean"}]}),
    ("gqa align -> 2 KV heads", {"stages": [{"kind": "gqa", "kv_heads": 2, "method": "align"}]}),
    ("gqa mean -> 1 KV head (MQA)", {"stages": [{"kind": "gqa", "kv_heads": 1, "method": "mean"}]}),
    ("gqa align -> 1 KV head (MQA)", {"stages": [{"kind": "gqa", "kv_heads": 1, "method": "align"}]}),
    ("channel_prune dynamic, keys -25%", {"stages": [{"kind": "channel_prune", "ratio": 0.25}]}),
    ("channel_prune static, keys -25%", {"stages": [{"kind": "channel_prune", "mode": "static", "ratio": 0.25}]}),
    ("channel_prune dynamic, keys -50%", {"stages": [{"kind": "channel_prune", "ratio": 0.5}]}),
    ("channel_prune dynamic, keys -40% (3 of 8)", {"stages": [{"kind": "channel_prune", "ratio": 0.4}]}),
    ("channel_prune static, keys -50%", {"stages": [{"kind": "channel_prune", "mode": "static", "ratio": 0.5}]}),
    (
        "channel_prune static, keys -25%, values -25%",
        {"stages": [{"kind": "channel_prune", "mode": "static", "ratio": 0.25, "value_ratio": 0.25}]},
    ),
    ("kivi-4 (reference for the compositions below)", {"stages": [KIVI_4]}),
    ("kivi-4 + dynamic keys -25%", {"stages": [KIVI_4, {"kind": "channel_prune", "ratio": 0.25}]}),
    ("kivi-4 + dynamic keys -40%", {"stages": [KIVI_4, {"kind": "channel_prune", "ratio": 0.4}]}),
    ("think-kivi preset: kivi-4 + dynamic keys -50%", {"stages": [KIVI_4, {"kind": "channel_prune", "ratio": 0.5}]}),
]


def run(prefix: int = 384) -> list[dict]:
    model, tokenizer = protocol.load_model()
    texts = protocol.load_passages(n=None)
    passages = texts[:EVAL_PASSAGES]
    calibration = [torch.tensor(tokenizer(t)["input_ids"][:512]) for t in texts[CALIBRATION]]
    ids = [torch.tensor(tokenizer(t)["input_ids"][:512]) for t in passages]
    references = protocol.reference_set(model, ids, prefix)
    dtype = next(model.parameters()).dtype
    full = full_cache_bytes(model.config, prefix, dtype=dtype)  # the ORIGINAL model's cache
    rows = []
    for name, spec in STACKS:
        kvstack.apply(model, spec, calibration=calibration)
        try:
            result = protocol.evaluate(
                model, tokenizer, passages, None, name=name, prefix=prefix,
                make_cache=kvstack.cache_for, references=references,
            )
        finally:
            kvstack.remove(model)
        row = result.as_dict()
        row.pop("per_passage_kl")
        row["memory_ratio"] = result.memory_bytes / full
        row["full_bytes"] = full
        row["spec"] = spec
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    out = [
        "| stack | KL (nats/token) | top-1 | ppl | bytes after prefix | vs. full cache |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['name']} | {r['kl']:.4f} | {r['top1']:.3f} | {r['ppl']:.3f} | {r['memory_bytes']:,} | "
            f"{r['memory_ratio']:.3f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/heads_channels.json"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the model is tiny: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = run()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(protocol.model_path()), "rows": rows}, indent=2) + "\n")
    print(markdown(rows))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
