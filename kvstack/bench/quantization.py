"""Quantization on the real model: ``python -m kvstack.bench.quantization [--out DIR] [--passages 32]``.

Runs the quality protocol (:mod:`kvstack.bench.protocol`: dev passages, prefix 384 in one forward, then token by
token, KL vs. the full cache) for

1. KIVI at 2, 4 and 8 bits (``kind: quantize``) next to transformers' own ``QuantizedCache`` with every backend that
   runs here (quanto and hqq need extra packages; fp8 is built in), and the full ``DynamicCache`` whose decode time
   is the reference of the time ratio (all measured in the same run);
2. "more tokens, lower precision" at equal memory (memory ratios 25% and 12.5%): H2O eviction at 16 bits (fewer
   tokens) vs. ``quantized_prune`` keeping more tokens at 8, 4 or 2 bits, and mixed precision tiers.

Prints markdown tables and writes ``quantization.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import typer

from . import protocol

PREFIX = 384
RATIOS = (0.25, 0.125)
#: KIVI as measured: key groups of 32 tokens; values one group per token and head (head_dim is 8 on the real model)
KIVI = {"group_size": 32, "value_group_size": "head_dim", "residual": 32}
RANKING = {"scorer": "h2o", "n_sink": 4, "recent": 16}
MIXED = {
    "16/4/2 (25/25/50%)": [{"fraction": 0.25, "bits": 16}, {"fraction": 0.25, "bits": 4}, {"rest": True, "bits": 2}],
    "16/8/4 (25/25/50%)": [{"fraction": 0.25, "bits": 16}, {"fraction": 0.25, "bits": 8}, {"rest": True, "bits": 4}],
    "8/4 (50/50%)": [{"fraction": 0.5, "bits": 8}, {"rest": True, "bits": 4}],
}


def kivi(bits: int) -> dict:
    return {"name": f"kivi-{bits}", "stages": [{"kind": "quantize", "bits": bits, **KIVI}]}


def evict16(ratio: float) -> dict:
    return {"name": "h2o 16-bit", "budget": {"ratio": ratio}, "stages": [{"kind": "evict", **RANKING}]}


def prune(name: str, tiers: list[dict], ratio: float) -> dict:
    stage = {"kind": "quantized_prune", "tiers": tiers, "group_size": 32, "value_group_size": "head_dim", **RANKING}
    return {"name": name, "budget": {"ratio": ratio}, "stages": [stage]}


def hf_backends(model) -> tuple[dict, dict]:
    """transformers' QuantizedCache per backend that constructs here; the reason for every one that does not."""
    from transformers import QuantizedCache

    makers, missing = {}, {}
    for backend, kwargs in (("quanto", {"nbits": 4}), ("quanto", {"nbits": 2}), ("hqq", {"nbits": 4}),
                            ("hqq", {"nbits": 2}), ("fp8", {})):
        label = f"QuantizedCache {backend}" + (f" {kwargs['nbits']}-bit" if kwargs else " (per-tensor float8)")

        def make(model, backend=backend, kwargs=kwargs):
            return QuantizedCache(backend, model.config, **kwargs)

        try:
            make(model)
            makers[label] = make
        except Exception as err:  # noqa: BLE001 - a backend that cannot run is reported, not fatal
            missing[label] = f"{type(err).__name__}: {err}".splitlines()[0][:160]
    return makers, missing


def row(result, full_seconds: float, **extra) -> dict:
    return {
        "name": result.name,
        "kl": result.kl,
        "top1": result.top1,
        "memory_ratio": result.memory_ratio,
        "memory_bytes": result.memory_bytes,
        "time_ratio": result.decode_seconds / full_seconds,
        **extra,
    }


def table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    fmt = {
        "kl": lambda v: f"{v:.5f}",
        "top1": lambda v: f"{v:.3f}",
        "memory_ratio": lambda v: f"{v:.3f}",
        "time_ratio": lambda v: f"{v:.2f}",
        "target": lambda v: f"{v:.3f}",
    }
    lines = []
    for r in rows:
        lines.append("| " + " | ".join(fmt.get(c, str)(r[c]) for c in columns) + " |")
    return head + "\n".join(lines)


def main(
    out: Path = typer.Option(Path("bench-results/quantization"), help="Directory for quantization.json."),
    passages: int = typer.Option(32, help="Dev passages."),
) -> None:
    torch.manual_seed(0)
    model, tokenizer = protocol.load_model()
    texts = protocol.load_passages(n=passages)
    ids = [torch.tensor(tokenizer(t)["input_ids"][:512]) for t in texts]
    refs = protocol.reference_set(model, ids, PREFIX)
    started = time.perf_counter()

    def run(spec=None, **kw):
        return protocol.evaluate(model, tokenizer, texts, spec, prefix=PREFIX, references=refs, **kw)

    full = run(name="full cache")
    kivi_rows = [row(full, full.decode_seconds, method="DynamicCache (reference)")]
    for bits in (8, 4, 2):
        kivi_rows.append(row(run(kivi(bits)), full.decode_seconds, method=f"kvstack quantize, {bits} bit"))
    makers, missing = hf_backends(model)
    for label, make in makers.items():
        kivi_rows.append(row(run(make_cache=make, name=label), full.decode_seconds, method="transformers"))

    equal_rows = []
    for ratio in RATIOS:
        equal_rows.append(row(run(evict16(ratio)), full.decode_seconds, target=ratio, precision="16 (evict)"))
        for bits in (8, 4, 2):
            spec = prune(f"h2o -> all {bits}-bit", [{"rest": True, "bits": bits}], ratio)
            equal_rows.append(row(run(spec), full.decode_seconds, target=ratio, precision=str(bits)))
        for name, tiers in MIXED.items():
            equal_rows.append(row(run(prune(f"h2o tiers {name}", tiers, ratio)), full.decode_seconds, target=ratio,
                                  precision="mixed"))

    kivi_table = table(kivi_rows, ["name", "method", "kl", "top1", "memory_ratio", "memory_bytes", "time_ratio"])
    equal_table = table(equal_rows, ["target", "name", "precision", "kl", "top1", "memory_ratio", "time_ratio"])
    print("## KIVI vs transformers' QuantizedCache\n\n" + kivi_table + "\n")
    if missing:
        print("Backends that did not run: " + "; ".join(f"{k} ({v})" for k, v in missing.items()) + "\n")
    print("## Equal memory: fewer tokens at 16 bit vs more tokens at lower precision\n\n" + equal_table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantization.json").write_text(
        json.dumps(
            {
                "passages": passages,
                "prefix": PREFIX,
                "seconds": time.perf_counter() - started,
                "missing_backends": missing,
                "kivi": kivi_rows,
                "equal_memory": equal_rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    typer.run(main)
