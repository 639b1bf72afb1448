"""Quantization on the real model: ``python -m kvstack.bench.quantization [--out DIR] [--passages 32] [--parts ...]``.

Runs the quality protocol (:mod:`kvstack.bench.protocol`: dev passages, prefix 384 in one forward, then token by
token, KL vs. the full cache) for

1. ``kivi`` — KIVI at 2, 4 and 8 bits (``kind: quantize``) next to transformers' own ``QuantizedCache`` with every
   backend that runs here (quanto and hqq need extra packages; fp8 is built in), and the full ``DynamicCache`` whose
   decode time is the reference of the time ratio (all measured in the same run);
2. ``equal`` — "more tokens, lower precision" at equal memory (memory ratios 25% and 12.5%): H2O eviction at 16 bits
   (fewer tokens) vs. ``quantized_prune`` keeping more tokens at 8, 4 or 2 bits, and mixed precision tiers;
3. ``options`` (``--parts options``) — the precision options below 4 bits (docs/quantization.md): KIVI at 4, 3 and 2
   bits plain vs. each option (Hadamard / random rotation, pre-RoPE keys, nf codebook, cheaper scales) and their
   combinations, once per model dtype of ``--dtypes`` (the model loaded in that dtype; KL against the full cache of
   the same dtype). ``--model`` / ``--data`` / ``--prefix`` / ``--max-len`` run it on another model (an HF directory or
   a GGUF file through ``kvstack.bench.models``), passages tokenized without special tokens.

Prints markdown tables and writes ``quantization.json`` (``kivi``, ``equal``) and ``quantization_options.json``.
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


#: KIVI settings of the options table: as above, values one group per token and head
OPTION_BASE = {"group_size": 32, "value_group_size": "head_dim", "residual": 32}


def option_rows(dtype: torch.dtype, head_dim: int, short: bool = False) -> list[tuple[str, int, dict]]:
    """(label, bits, options) of the options table for a model of ``dtype``: each option alone, pre-RoPE keys with
    the others (not ``short``), the rotation + pre-RoPE + nf combination, with the cheaper scales, and with groups half
    as large (the bytes the cheaper scales save spent on finer groups)."""
    cheap = "bfloat16" if dtype == torch.float32 else "float8_e4m3fn"
    rotate = "hadamard" if head_dim & (head_dim - 1) == 0 else "random"
    pre = {"key_rope": "pre"}
    combined = dict(pre, rotate=rotate, codebook="nf")
    halved = {"group_size": OPTION_BASE["group_size"] // 2}
    if (head_dim // 2) % 8 == 0:
        halved["value_group_size"] = head_dim // 2
    rows = []
    for bits in (4, 3, 2):
        low = bits < 4 and not short
        rows.append(("plain", bits, {}))
        rows.append((f"rotate {rotate}", bits, {"rotate": rotate}))
        if low and rotate == "hadamard":
            rows.append(("rotate random", bits, {"rotate": "random"}))
        rows.append(("key_rope pre", bits, pre))
        rows.append(("codebook nf", bits, {"codebook": "nf"}))
        rows.append((f"scale_dtype {cheap}", bits, {"scale_dtype": cheap}))
        if low and cheap != "float8_e4m3fn":
            rows.append(("scale_dtype float8_e4m3fn", bits, {"scale_dtype": "float8_e4m3fn"}))
        if low:
            rows.append(("pre + nf", bits, dict(pre, codebook="nf")))
            rows.append((f"pre + {cheap}", bits, dict(pre, scale_dtype=cheap)))
        rows.append((f"{rotate} + pre + nf", bits, combined))
        rows.append((f"{rotate} + pre + nf + {cheap}", bits, dict(combined, scale_dtype=cheap)))
        rows.append((f"{rotate} + pre + nf + {cheap}, groups / 2", bits, dict(combined, scale_dtype=cheap, **halved)))
    return rows


class _NoSpecialTokens:
    """A tokenizer whose call leaves out special tokens (the SmolLM2 passages are exact token sequences)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text, **kwargs):
        return self.tokenizer(text, add_special_tokens=False, **kwargs)


def run_options(dtypes: list[torch.dtype], passages: int, model_path: Path | None, data: Path | None, prefix: int,
                max_len: int, short: bool = False, only: list[str] | None = None) -> list[dict]:
    rows = []
    for dtype in dtypes:
        if model_path is None:
            model, tokenizer = protocol.load_model(dtype=dtype)
        else:
            from . import models

            model, tokenizer = models.load_causal_lm(model_path, dtype=dtype)
            tokenizer = _NoSpecialTokens(tokenizer)
        texts = protocol.load_passages(data, n=passages)
        ids = [torch.tensor(tokenizer(t)["input_ids"][:max_len]) for t in texts]
        refs = protocol.reference_set(model, ids, prefix)
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

        def run(spec=None, **kw):
            return protocol.evaluate(model, tokenizer, texts, spec, prefix=prefix, max_len=max_len, references=refs,
                                     **kw)

        full = run(name="full cache")
        label = str(dtype).removeprefix("torch.")
        rows.append(row(full, full.decode_seconds, dtype=label, bits=16, options="-"))
        for name, bits, options in option_rows(dtype, head_dim, short):
            if only and not any(word in name for word in only):
                continue
            spec = {"name": f"kivi-{bits} {name}", "stages": [{"kind": "quantize", "bits": bits, **OPTION_BASE,
                                                                 **options}]}
            result = run(spec)
            rows.append(row(result, full.decode_seconds, dtype=label, bits=bits, options=name))
            print(f"{label} {bits}-bit {name}: kl {result.kl:.5f} top1 {result.top1:.3f} "
                  f"memory {result.memory_ratio:.3f}", flush=True)
        del model
    return rows


def main(
    out: Path = typer.Option(Path("bench-results/quantization"), help="Directory for the JSON results."),
    passages: int = typer.Option(32, help="Dev passages."),
    parts: str = typer.Option("kivi,equal", help="Comma-separated: kivi, equal, options."),
    dtypes: str = typer.Option("float32,bfloat16", help="options: model dtypes (float32, bfloat16, float16)."),
    model: Path = typer.Option(None, help="options: another model (HF directory or GGUF) instead of stories260K."),
    data: Path = typer.Option(None, help="options: passages (JSONL with 'text') for --model."),
    prefix: int = typer.Option(PREFIX, help="options: tokens prefilled in one forward."),
    max_len: int = typer.Option(512, help="options: tokens per passage."),
    short: bool = typer.Option(False, help="options: fewer rows (each option alone, two combinations)."),
    only: str = typer.Option("", help="options: comma-separated words; run only the rows whose label has one."),
) -> None:
    chosen = {p.strip() for p in parts.split(",") if p.strip()}
    unknown = chosen - {"kivi", "equal", "options"}
    if unknown:
        raise typer.BadParameter(f"parts={parts!r}: unknown {sorted(unknown)}; allowed: kivi, equal, options")
    if "options" in chosen:
        torch.manual_seed(0)
        started = time.perf_counter()
        names = [d.strip() for d in dtypes.split(",") if d.strip()]
        words = [w.strip() for w in only.split(",") if w.strip()]
        opt_rows = run_options([getattr(torch, d) for d in names], passages, model, data, prefix, max_len, short, words)
        columns = ["dtype", "bits", "options", "kl", "top1", "memory_ratio", "memory_bytes", "time_ratio"]
        print("## Precision options below 4 bits\n\n" + table(opt_rows, columns) + "\n")
        out.mkdir(parents=True, exist_ok=True)
        (out / "quantization_options.json").write_text(json.dumps({
            "passages": passages, "prefix": prefix, "max_len": max_len, "model": str(model or protocol.model_path()),
            "data": str(data or protocol.data_path()), "kivi": OPTION_BASE, "seconds": time.perf_counter() - started,
            "rows": opt_rows,
        }, indent=1))
    if not chosen & {"kivi", "equal"}:
        return
    main_parts(out, passages, chosen)


def main_parts(out: Path, passages: int, chosen: set[str]) -> None:
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
    missing = {}
    for bits in (8, 4, 2) if "kivi" in chosen else ():
        kivi_rows.append(row(run(kivi(bits)), full.decode_seconds, method=f"kvstack quantize, {bits} bit"))
    makers, missing = hf_backends(model) if "kivi" in chosen else ({}, {})
    for label, make in makers.items():
        kivi_rows.append(row(run(make_cache=make, name=label), full.decode_seconds, method="transformers"))

    equal_rows = []
    for ratio in RATIOS if "equal" in chosen else ():
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
