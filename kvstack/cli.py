"""``kvstack`` command line (typer): inspect presets and specs, generate with a stack, benchmark, calibrate."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Composable KV-cache compression for transformers.")

LLAMA3_8B = dict(  # analytic reference shape for `kvstack presets` (no weights needed)
    model_type="llama", num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, layer_windows=(None,) * 32
)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


def _check_jsonl(data: Path) -> None:
    """--data must be JSONL with a "text" string on every non-empty line: checked before any model is loaded."""
    if not data.is_file():
        _fail(f"--data {str(data)!r} is not a file")
    for number, line in enumerate(data.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            _fail(f"--data {str(data)!r} is not JSONL: line {number} is not a JSON object ({line[:60]!r})")
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            _fail(f"--data {str(data)!r}: line {number} has no \"text\" string (each line: {{\"text\": ...}})")


def _version(value: bool) -> None:
    if value:
        from kvstack import __version__

        typer.echo(f"kvstack {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Composable KV-cache compression for transformers."""


def _load(source: str):
    from kvstack import KVStackError, StackSpec

    try:
        return StackSpec.load(source)
    except KVStackError as err:
        _fail(str(err))


@app.command()
def presets(tokens: int = typer.Option(4096, min=1, help="Tokens seen for the analytic memory ratio.")) -> None:
    """List the shipped presets: name, memory ratio at TOKENS on a Llama-3-8B-shaped cache, description."""
    import torch

    from kvstack import ModelShape, StackSpec, full_cache_bytes, preset_names

    shape = ModelShape(dtype=torch.float16, **LLAMA3_8B)
    full = full_cache_bytes(shape, tokens)
    rows = []
    for name in preset_names():
        spec = StackSpec.load(name)
        ratio = spec.memory_bound(shape, tokens) / full
        rows.append((name, f"{ratio:.3f}", spec.description))
    width = max(len(r[0]) for r in rows)
    typer.echo(f"{'preset'.ljust(width)}  ratio@{tokens}  description")
    for name, ratio, desc in rows:
        typer.echo(f"{name.ljust(width)}  {ratio.rjust(6 + len(str(tokens)))}  {desc}")
    typer.echo(
        "\nratios: analytic bytes held / an uncompressed fp16 cache of the same tokens, on a Llama-3-8B shape "
        "(32 layers, 8 KV heads, head_dim 128). Every stack stores one int32 position per token, so identity is "
        "above 1 (1 + 4 / (8 * 2 * 128 * 2) = 1.001); gqa-mean converts this shape's 8 KV heads to 2 (0.25; a model with "
        "4 KV heads gets about 0.5)."
    )


@app.command()
def show(preset: str = typer.Argument(..., help="Preset name or YAML file.")) -> None:
    """Print a preset (or file) as the full YAML spec, every default spelled out."""
    typer.echo(_load(preset).to_yaml(), nl=False)


@app.command()
def validate(file: Path = typer.Argument(..., help="YAML stack file.")) -> None:
    """Validate a YAML stack file (exit 0 and a summary, or a clear error naming the field)."""
    spec = _load(str(file))
    typer.echo(f"ok: {spec.name} — {len(spec.stages)} stage(s): {', '.join(s.kind for s in spec.stages) or 'none'}")


@app.command()
def schema(
    out: Optional[Path] = typer.Option(None, help="Write here instead of stdout."),
    format: str = typer.Option("json", help="json (for editors) or markdown (docs/spec-reference.md)."),
) -> None:
    """Print the JSON schema of stack files (for editor validation), or the markdown spec reference."""
    from kvstack import StackSpec
    from kvstack.stack import spec_doc

    if format not in ("json", "markdown"):
        _fail(f"--format {format!r} is not allowed: json or markdown")
    text = json.dumps(StackSpec.model_json_schema(), indent=2) if format == "json" else spec_doc.render().rstrip("\n")
    if out:
        out.write_text(text + "\n")
    else:
        typer.echo(text)


@app.command()
def generate(
    model: Path = typer.Option(..., help="Path of a Hugging Face causal LM (local directory)."),
    preset: str = typer.Option("identity", help="Preset name or YAML file."),
    prompt: str = typer.Option(..., help="Prompt text."),
    max_new_tokens: int = typer.Option(64, min=1, help="Tokens to generate (greedy)."),
) -> None:
    """Generate greedily with a stack applied; print the text and the cache memory vs. the full cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvstack

    spec = _load(preset)
    if not model.is_dir():
        _fail(f"--model {str(model)!r} is not a directory holding a Hugging Face model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    try:
        kvstack.apply(lm, spec)
    except kvstack.KVStackError as err:
        _fail(str(err))
    inputs = tokenizer(prompt, return_tensors="pt")
    cache = kvstack.cache_for(lm)
    with torch.no_grad():
        out = lm.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **{"cache": cache})
    typer.echo(tokenizer.decode(out[0], skip_special_tokens=True))
    report = cache.memory_report()
    typer.echo(
        f"memory: {report['total_bytes']:,} bytes held vs {report['full_cache_bytes']:,} for the full cache "
        f"at {report['tokens_seen']} tokens (ratio {report['ratio']:.3f})"
    )


@app.command()
def bench(
    model: Path = typer.Option(..., help="Path of a Hugging Face causal LM (local directory)."),
    data: Path = typer.Option(..., help="JSONL file of passages, one {\"text\": ...} per line."),
    presets: str = typer.Option(..., help="Comma-separated preset names or YAML files, e.g. identity,streaming."),
    ratios: str = typer.Option(
        "0.5,0.25,0.125",
        help="Comma-separated memory ratios for presets that take a budget (stack budget := {ratio: r}, stage "
        "budgets dropped); an empty string runs every preset as written.",
    ),
    protocol: str = typer.Option("prefill", help="prefill: compress the prefix, then decode; decode: compress "
                                 "continuously while feeding tokens one at a time."),
    passages: int = typer.Option(32, min=1, help="Number of passages (the first N of --data)."),
    prefix: int = typer.Option(384, min=1, help="Tokens before the first predicted position."),
    max_len: int = typer.Option(512, min=2, help="Tokens per passage (truncated)."),
    decode_prefill: int = typer.Option(16, min=1, help="decode protocol: tokens prefilled in one forward."),
    out: Path = typer.Option(..., help="Output directory (results.json, quality_vs_memory.png)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Benchmark presets against the full cache and transformers' QuantizedCache: table, results.json and a plot."""
    from kvstack import KVStackError
    from kvstack.bench import harness

    try:
        ratio_values = tuple(float(r) for r in ratios.split(",") if r.strip())
    except ValueError:
        _fail(f"--ratios {ratios!r} is not allowed: comma-separated numbers in (0, 1]")
    if any(not 0 < r <= 1 for r in ratio_values):
        _fail(f"--ratios {ratios!r} is not allowed: every ratio must be in (0, 1]")
    names = [p.strip() for p in presets.split(",") if p.strip()]
    if not names:
        _fail("--presets is empty: give comma-separated preset names or YAML files")
    if not model.is_dir():
        _fail(f"--model {str(model)!r} is not a directory holding a Hugging Face model")
    _check_jsonl(data)
    if out.exists() and not out.is_dir():
        _fail(f"--out {str(out)!r} is a file: give a directory (it is created when missing)")
    try:
        result = harness.bench(
            model, data, names, out, passages=passages, ratios=ratio_values, protocol_name=protocol, prefix=prefix,
            max_len=max_len, decode_prefill=decode_prefill, progress=progress,
        )
    except (KVStackError, ValueError) as err:
        _fail(str(err))
    typer.echo(harness.markdown_table(result.rows))
    typer.echo(f"\nwrote {out / harness.RESULTS_FILE} and {out / harness.PLOT_FILE}")


@app.command()
def calibrate(
    model: Path = typer.Option(..., help="Path of a Hugging Face causal LM (local directory)."),
    preset: str = typer.Option(..., help="Preset or YAML file with `evict` and `lowrank` stages (budget, rank)."),
    data: Path = typer.Option(..., help="JSONL file of calibration passages, one {\"text\": ...} per line."),
    out: Path = typer.Option(..., help="Kernels file to write (.safetensors); reference it as `kernels:`."),
    start: int = typer.Option(32, min=0, help="First passage used (the default skips the 32 evaluation passages)."),
    passages: int = typer.Option(32, min=1, help="Number of calibration passages."),
    steps: Optional[int] = typer.Option(None, min=1, help="Adam steps (default 1500: about 2 CPU-minutes on stories260K)."),
    hidden: int = typer.Option(16, min=1, help="Hidden width of the kernel MLPs."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Train learned LESS kernels for `kind: lowrank, features: learned` (docs/lowrank.md)."""
    from kvstack import KVStackError
    from kvstack.stages.lowrank_learned import calibrate_file

    if not model.is_dir():
        _fail(f"--model {str(model)!r} is not a directory holding a Hugging Face model")
    _check_jsonl(data)
    if not out.parent.is_dir():
        _fail(f"--out {str(out)!r}: the folder {str(out.parent)!r} does not exist (checked before training)")
    if out.is_dir():
        _fail(f"--out {str(out)!r} is a directory: give the .safetensors file to write")
    try:
        options = {"steps": steps} if steps else {}
        summary = calibrate_file(model, preset, data, out, start=start, passages=passages, hidden=hidden,
                                 progress=progress, **options)
    except KVStackError as err:
        _fail(str(err))
    for layer, before, after in zip(summary["layers"], summary["relative_error_random"],
                                    summary["relative_error_learned"]):
        typer.echo(f"layer {layer}: attention error vs eviction alone {before:.3f} (random) -> {after:.3f} (learned)")
    typer.echo(f"wrote {out}")

def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()
