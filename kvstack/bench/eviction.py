"""Eviction scorers on the real model: ``python -m kvstack.bench.eviction [--out DIR] [--passages 32]``.

Runs the quality protocol (:mod:`kvstack.bench.protocol`: dev passages, prefix 384 compressed once, then token by
token, KL vs. the full cache) for every scorer of the ``evict`` stage at keep ratios 50%, 25% and 12.5%, at token
and at block granularity. "Keep ratio" is tokens kept per layer and KV head over the 384 prefix tokens (kvpress's
definition; the budget is ``tokens: round(384 * keep)``); the real memory ratio (positions, per-token records and
head-wise positions included) is reported next to it. Like kvpress in ../shared/research/evaluation-protocol.md,
the stage compresses the prompt only (``phase: prefill``). Prints markdown tables and writes ``eviction.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import typer

from . import protocol

KEEP = (0.5, 0.25, 0.125)
PREFIX = 384
BLOCK = 16

#: scorer -> the stage fields it is measured with (the tuned defaults; docs/eviction.md says how they were chosen)
SCORERS: dict[str, dict] = {
    "window": {"scorer": "window", "n_sink": 4},
    "key_norm": {"scorer": "key_norm", "n_sink": 4, "recent": 32},
    "value_key_ratio": {"scorer": "value_key_ratio", "n_sink": 4, "recent": 32},
    "h2o": {"scorer": "h2o", "n_sink": 4, "recent": 32},
    "tova": {"scorer": "tova", "n_sink": 4, "recent": 16},
    "snapkv": {"scorer": "snapkv", "n_sink": 4, "window": 32},
    "obcache": {"scorer": "obcache", "n_sink": 4, "window": 32},
    "random": {"scorer": "random", "n_sink": 4, "recent": 32},
}

#: kvpress 0.5.5 under the same protocol (evaluation-protocol.md): KL at keep 50 / 25 / 12.5 %
KVPRESS = {
    "StreamingLLM": (0.00263, 0.00835, 0.02126),
    "SnapKV": (0.00221, 0.00741, 0.02852),
    "TOVA": (0.00289, 0.01254, 0.02672),
    "Knorm": (0.07068, 0.09644, 0.10004),
}


def stack(scorer: str, granularity: str, keep: float) -> dict:
    stage = {"kind": "evict", "phase": "prefill", "granularity": granularity, **SCORERS[scorer]}
    if granularity == "block":
        stage["block_size"] = BLOCK
    return {"name": f"{scorer}-{granularity}-{keep}", "budget": {"tokens": round(PREFIX * keep)}, "stages": [stage]}


def run(passages: int, scorers: list[str], granularities: list[str]) -> list[dict]:
    model, tokenizer = protocol.load_model()
    texts = protocol.load_passages(n=passages)
    ids = [torch.tensor(tokenizer(t)["input_ids"][:512]) for t in texts]
    references = protocol.reference_set(model, ids, PREFIX)
    rows = []
    for scorer in scorers:
        for granularity in granularities:
            for keep in KEEP:
                spec = stack(scorer, granularity, keep)
                r = protocol.evaluate(model, tokenizer, texts, spec, prefix=PREFIX, references=references)
                rows.append(
                    {
                        "scorer": scorer,
                        "granularity": granularity,
                        "keep": keep,
                        "kl": r.kl,
                        "top1": r.top1,
                        "ppl": r.ppl,
                        "memory_ratio": r.memory_ratio,
                        "spec": spec,
                    }
                )
                typer.echo(f"{scorer:16s} {granularity:5s} keep {keep:<6} KL {r.kl:.5f}", err=True)
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| scorer | granularity | " + " | ".join(f"KL @ {k:.1%}" for k in KEEP) + " |"
    lines = [head, "| --- | --- |" + " --- |" * len(KEEP)]
    best = {k: min(r["kl"] for r in rows if r["keep"] == k) for k in KEEP}
    by = {(r["scorer"], r["granularity"], r["keep"]): r for r in rows}
    for scorer, granularity in dict.fromkeys((r["scorer"], r["granularity"]) for r in rows):
        cells = []
        for k in KEEP:
            kl = by[(scorer, granularity, k)]["kl"]
            cells.append(f"**{kl:.5f}**" if kl == best[k] else f"{kl:.5f}")
        lines.append(f"| {scorer} | {granularity} | " + " | ".join(cells) + " |")
    for press, kls in KVPRESS.items():
        lines.append(f"| kvpress {press} | token (head-wise) | " + " | ".join(f"{x:.5f}" for x in kls) + " |")
    detail = ["| scorer | granularity | keep | KL | top-1 | perplexity | memory ratio |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        detail.append(
            f"| {r['scorer']} | {r['granularity']} | {r['keep']:.1%} | {r['kl']:.5f} | {r['top1']:.4f} | "
            f"{r['ppl']:.3f} | {r['memory_ratio']:.4f} |"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(detail)


def main(
    out: Path = typer.Option(Path("bench-results/eviction"), help="Directory for eviction.json."),
    passages: int = typer.Option(32, help="Dev passages to evaluate (the protocol uses 32)."),
    scorers: str = typer.Option(",".join(SCORERS), help="Comma-separated scorers."),
    granularities: str = typer.Option("token,block", help="Comma-separated: token, block."),
) -> None:
    rows = run(passages, scorers.split(","), granularities.split(","))
    out.mkdir(parents=True, exist_ok=True)
    (out / "eviction.json").write_text(json.dumps({"passages": passages, "prefix": PREFIX, "rows": rows}, indent=1))
    typer.echo(markdown(rows))


if __name__ == "__main__":
    typer.run(main)
