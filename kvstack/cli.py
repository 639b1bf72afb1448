"""``kvstack`` command line (typer): inspect presets and specs, see where a stack's bytes go, generate with a stack,
benchmark, calibrate."""

from __future__ import annotations

import json
import os
from enum import Enum
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


def _check_jsonl(data: Path, fields: tuple[str, ...] = ("text",)) -> None:
    """--data must be JSONL whose every non-empty line is an object with ``fields`` (``text`` a string), checked
    before any model is loaded."""
    if not data.is_file():
        _fail(f"--data {str(data)!r} is not a file")
    for number, line in enumerate(data.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            _fail(f"--data {str(data)!r} is not JSONL: line {number} is not a JSON object ({line[:60]!r})")
        missing = [f for f in fields if not isinstance(record, dict) or f not in record]
        if "text" in fields and "text" not in missing and not isinstance(record["text"], str):
            missing.append("text")
        if missing:
            _fail(f"--data {str(data)!r}: line {number} lacks {', '.join(missing)} (each line: {', '.join(fields)})")


def _int_list(option: str, value: str, low: int, high: int | None = None, allowed: str | None = None) -> list[int]:
    """A non-empty comma-separated list of integers in [low, high] for ``option``, or a clear error (``allowed``:
    what the message says is allowed; default the range)."""
    try:
        numbers = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        numbers = []
    if not numbers or any(n < low or (high is not None and n > high) for n in numbers):
        allowed = allowed or (f"integers >= {low}" if high is None else f"integers from {low} to {high}")
        _fail(f"{option} {value!r} is not allowed: comma-separated {allowed}")
    return numbers


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


def _with_ratio(spec, ratio: float):
    """``spec`` held to ``ratio`` as the bench's ratio override holds it, or a named error."""
    from kvstack import KVStackError
    from kvstack.bench.harness import takes_budget, with_ratio

    if not 0 < ratio <= 1:
        _fail(f"--ratio {ratio:g} is not allowed: a number in (0, 1]")
    if not takes_budget(spec):
        _fail(f"--ratio {ratio:g} is not allowed for {spec.name}: it takes no budget (neither the stack nor a stage "
              "sets one), so there is none to replace")
    try:
        return with_ratio(spec, ratio)
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


class SchemaFormat(str, Enum):
    """``kvstack schema --format`` choices."""

    json = "json"
    markdown = "markdown"


@app.command()
def schema(
    out: Optional[Path] = typer.Option(None, help="Write here instead of stdout."),
    format: SchemaFormat = typer.Option(SchemaFormat.json, case_sensitive=False,
                                        help="json (for editors) or markdown (docs/spec-reference.md)."),
) -> None:
    """Print the JSON schema of stack files (for editor validation), or the markdown spec reference."""
    from kvstack import StackSpec
    from kvstack.stack import spec_doc

    if format is SchemaFormat.json:
        text = json.dumps(StackSpec.model_json_schema(), indent=2)
    else:
        text = spec_doc.render().rstrip("\n")
    if out:
        out.write_text(text + "\n")
    else:
        typer.echo(text)


class DType(str, Enum):
    """``--dtype`` choices (the model's default when omitted: bfloat16 for a GGUF file, the config's otherwise)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class BenchProtocol(str, Enum):
    """``kvstack bench --protocol``: stories-style passages (prefill, decode) or the real-model protocols."""

    prefill = "prefill"
    decode = "decode"
    code_kl = "code-kl"
    needle = "needle"


MODEL_HELP = (
    "A Hugging Face causal LM directory, a .gguf file, or a directory holding exactly one .gguf (converted once into "
    "KVSTACK_CACHE_DIR, default ~/.cache/kvstack; needs kvstack's gguf extra: the gguf and accelerate packages). Or a "
    "Hugging Face Hub model id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct) when no such local path exists, loaded with "
    "from_pretrained (the Hub cache is used; HF_HUB_OFFLINE=1 uses only it)."
)
DEVICE_HELP = "Where the model runs: cpu, cuda, or auto (cuda when available, else cpu)."
DTYPE_HELP = "Model dtype (default: bfloat16 for a GGUF model, the config's dtype for a Hugging Face directory)."
PROTOCOL_METAVAR = "[" + "|".join(p.value for p in BenchProtocol) + "]"


def _load_model(model: str, dtype: "DType | None", device: str = "cpu"):
    """(model, tokenizer) through :func:`kvstack.bench.models.load_causal_lm` (a local path or a Hub id); a clear
    error instead of a trace."""
    from kvstack.bench import models

    try:
        return models.load_causal_lm(model, dtype=dtype.value if dtype is not None else None, device=device)
    except models.ModelLoadError as err:
        _fail(f"--model: {err}")


def _check_model_source(model: str) -> None:
    """A local ``--model`` that cannot load, before anything else runs (a Hub id is checked when it loads)."""
    from kvstack.bench import models

    if models.hub_id(model) is not None:
        return
    try:
        models.resolve_source(model)
    except models.ModelLoadError as err:
        _fail(f"--model: {err}")


class Device(str, Enum):
    """``--device`` choices: ``auto`` is cuda when torch sees a CUDA device, else cpu."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def _resolve_device(device: Device) -> str:
    """The torch device for ``--device``: checked before any model is loaded."""
    import torch

    if device is Device.auto:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device is Device.cuda and not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "finds no CUDA device"
        _fail(f"--device cuda is not available: torch {torch.__version__} {why}; use --device cpu (or auto)")
    return device.value


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from ``--prompt TEXT``, ``--prompt -`` (stdin) or ``--prompt-file PATH``; trailing newlines of a
    file or stdin are dropped (``echo`` adds one)."""
    if prompt is not None and prompt_file is not None:
        _fail("--prompt and --prompt-file are exclusive: give one")
    if prompt is None and prompt_file is None:
        _fail("a prompt is required: --prompt TEXT, --prompt - (read stdin) or --prompt-file PATH")
    if prompt_file is not None:
        if not prompt_file.is_file():
            _fail(f"--prompt-file {str(prompt_file)!r} is not a file")
        try:
            text, source = prompt_file.read_text(encoding="utf-8").rstrip("\r\n"), f"--prompt-file {str(prompt_file)!r}"
        except UnicodeDecodeError:
            _fail(f"--prompt-file {str(prompt_file)!r} is not UTF-8 text")
    elif prompt == "-":
        text, source = typer.get_text_stream("stdin").read().rstrip("\r\n"), "--prompt - (stdin)"
    else:
        text, source = prompt, "--prompt"
    if not text.strip():
        _fail(f"{source} is empty: give the prompt text")
    return text


def _sampling(do_sample: bool, temperature, top_p, top_k, seed) -> dict:
    """generate() keywords of the sampling flags (greedy unless --do-sample; its flags without it are an error)."""
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    if not do_sample:
        flags = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
        if flags:
            one = len(flags) == 1
            _fail(f"{', '.join(flags)} {'needs' if one else 'need'} --do-sample (greedy decoding, the default, ignores "
                  f"{'it' if one else 'them'})")
        return {"do_sample": False}
    if temperature is not None and temperature <= 0:
        _fail(f"--temperature {temperature:g} is not allowed: > 0 (use --greedy for greedy decoding)")
    if top_p is not None and not 0 < top_p <= 1:
        _fail(f"--top-p {top_p:g} is not allowed: in (0, 1]")
    if seed is not None:
        import torch

        torch.manual_seed(seed)  # every device's generator
    return {"do_sample": True, **{k: v for k, v in given.items() if v is not None}}


def _peak_rss_bytes() -> int | None:
    """The process's resident-set high-water mark (model loading included), or None where unknown."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB elsewhere


@app.command()
def generate(
    model: str = typer.Option(..., help=MODEL_HELP),
    preset: str = typer.Option("identity", help="Preset name or YAML file."),
    prompt: Optional[str] = typer.Option(None, help="Prompt text; - reads it from stdin."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from this UTF-8 file."),
    max_new_tokens: int = typer.Option(64, min=1, help="Tokens to generate at most (EOS stops earlier)."),
    chat: bool = typer.Option(False, "--chat", help="Format the prompt as one user turn with the tokenizer's chat "
                              "template (and its generation prompt); print only the reply."),
    dtype: Optional[DType] = typer.Option(None, case_sensitive=False, help=DTYPE_HELP),
    device: Device = typer.Option(Device.auto, case_sensitive=False, help=DEVICE_HELP),
    do_sample: bool = typer.Option(False, "--do-sample/--greedy", help="Sample, or decode greedily (the default)."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature (> 0; needs --do-sample)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass in (0, 1] (needs --do-sample)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=0, help="Sample among the k likeliest tokens (0: all; "
                                        "needs --do-sample)."),
    seed: Optional[int] = typer.Option(None, min=0, help="Seed torch's generators before sampling (reproducible "
                                       "--do-sample runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, speed, peak memory, cache bytes) "
                                 "instead of the text and summary lines."),
) -> None:
    """Generate with a stack applied; print the text, tokens/s and the cache memory vs. the full cache."""
    import time

    import torch

    import kvstack
    from kvstack.stack.apply import cache_kwarg

    text = _read_prompt(prompt, prompt_file)
    spec = _load(preset)
    sampling = _sampling(do_sample, temperature, top_p, top_k, seed)
    where = _resolve_device(device)
    _check_model_source(model)
    lm, tokenizer = _load_model(model, dtype, where)
    try:
        kvstack.apply(lm, spec)
    except kvstack.KVStackError as err:
        _fail(str(err))
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            _fail(f"--chat: the tokenizer of {model!r} has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        inputs = tokenizer(text, return_tensors="pt")
    inputs = {name: tensor.to(where) for name, tensor in inputs.items()}
    cache = kvstack.cache_for(lm)
    on_cuda = torch.device(where).type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.inference_mode():
        out = lm.generate(**inputs, max_new_tokens=max_new_tokens, **sampling, **{cache_kwarg(lm): cache})
    if on_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    prompt_tokens = inputs["input_ids"].shape[1]
    new_tokens = out.shape[1] - prompt_tokens
    reply = tokenizer.decode(out[0, prompt_tokens:], skip_special_tokens=True)
    shown = reply if chat else tokenizer.decode(out[0], skip_special_tokens=True)
    report = cache.memory_report()
    dtype_name = str(next(lm.parameters()).dtype).removeprefix("torch.")
    rss = _peak_rss_bytes()
    cuda_peak = int(torch.cuda.max_memory_allocated()) if on_cuda else None
    if as_json:
        typer.echo(json.dumps({
            "text": shown, "completion": reply, "model": model, "preset": spec.name, "device": where,
            "dtype": dtype_name, "do_sample": sampling["do_sample"], "seed": seed, "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": new_tokens / seconds if seconds else None,
            "peak_memory_bytes": cuda_peak if on_cuda else rss,
            "peak_memory_source": "torch.cuda.max_memory_allocated" if on_cuda else "process RSS high-water mark",
            "peak_rss_bytes": rss, "cuda_max_allocated_bytes": cuda_peak,
            "cache_bytes": report["total_bytes"], "full_cache_bytes": report["full_cache_bytes"],
            "ratio": report["ratio"], "tokens_seen": report["tokens_seen"],
        }))
        return
    typer.echo(shown)
    peak = (f"CUDA peak {cuda_peak / 2**20:,.0f} MiB allocated" if on_cuda
            else f"peak RSS {rss / 2**20:,.0f} MiB" if rss is not None else "peak memory unknown")
    typer.echo(
        f"speed: {new_tokens} new tokens in {seconds:.2f} s ({new_tokens / seconds:.1f} tokens/s, the prefill of "
        f"{prompt_tokens} prompt tokens included; {dtype_name} on {where}; {peak})"
    )
    typer.echo(
        f"memory: {report['total_bytes']:,} bytes held vs {report['full_cache_bytes']:,} for the full cache "
        f"at {report['tokens_seen']} tokens (ratio {report['ratio']:.3f})"
    )


@app.command()
def memory(
    stack: str = typer.Argument(..., help="Preset name or YAML file."),
    model: str = typer.Option(..., help=MODEL_HELP),
    tokens: str = typer.Option("1024", help="Prompt lengths, comma-separated: the cache is filled with each in turn."),
    layers: Optional[str] = typer.Option(None, help="Layers to list, comma-separated (default: every layer)."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Take each prompt from the start of this "
                                               "UTF-8 text (default: random token ids drawn with --seed)."),
    seed: int = typer.Option(0, min=0, help="Seed of the random prompt."),
    dtype: Optional[DType] = typer.Option(None, case_sensitive=False, help=DTYPE_HELP),
    device: Device = typer.Option(Device.auto, case_sensitive=False, help=DEVICE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the tables."),
    ratio: Optional[float] = typer.Option(None, help="Hold a stack that takes a budget to this memory ratio instead "
                                          "of its own: the stack budget := {ratio: r} and stage-level budgets "
                                          "dropped, as kvstack bench --ratios does."),
) -> None:
    """Where a stack's bytes go: prefill a prompt of each length, then list every layer's tokens per tier, the bytes
    it holds and the bytes its share of the budget allows (both as a fraction of the layer's uncompressed bytes),
    and the cache's total against the full cache and the budget."""
    import torch

    import kvstack
    from kvstack.stack.apply import cache_kwarg

    lengths = _int_list("--tokens", tokens, 1)
    spec = _load(stack)
    if ratio is not None:
        spec = _with_ratio(spec, ratio)
    where = _resolve_device(device)
    if prompt_file is not None and not prompt_file.is_file():
        _fail(f"--prompt-file {str(prompt_file)!r} is not a file")
    _check_model_source(model)
    lm, tokenizer = _load_model(model, dtype, where)
    num_layers = lm.config.num_hidden_layers
    shown = _int_list("--layers", layers, 0, num_layers - 1) if layers is not None else list(range(num_layers))
    if prompt_file is not None:
        try:
            ids = tokenizer(prompt_file.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
        except UnicodeDecodeError:
            _fail(f"--prompt-file {str(prompt_file)!r} is not UTF-8 text")
        if ids.shape[1] < max(lengths):
            _fail(f"--prompt-file {str(prompt_file)!r} has {ids.shape[1]} tokens: --tokens asks for {max(lengths)}")
    else:
        ids = torch.randint(0, lm.config.vocab_size, (1, max(lengths)), generator=torch.Generator().manual_seed(seed))
    try:
        kvstack.apply(lm, spec)
    except kvstack.KVStackError as err:
        _fail(str(err))
    runs = []
    for n in lengths:
        cache = kvstack.cache_for(lm)
        with torch.inference_mode():
            lm(ids[:, :n].to(where), **{cache_kwarg(lm): cache})
        report = cache.memory_report()
        full_layer = report["full_cache_bytes"] / num_layers
        limits = report.get("limit_bytes_by_layer", [None] * num_layers)
        rows = [{"layer": i, "tokens": report["tokens_by_layer"][i], "bytes": sum(report["by_layer"][i].values()),
                 "bytes_by_tier": report["by_layer"][i], "limit_bytes": limits[i], "full_bytes": full_layer}
                for i in shown]
        runs.append({key: report.get(key) for key in ("tokens_seen", "total_bytes", "full_cache_bytes", "ratio",
                                                      "budget", "budget_bytes")} | {"layers": rows})
    dtype_name = str(next(lm.parameters()).dtype).removeprefix("torch.")
    if as_json:
        typer.echo(json.dumps({"stack": spec.name, "model": model, "dtype": dtype_name, "runs": runs}))
        return
    typer.echo(f"{spec.name} on {model} ({dtype_name}, {num_layers} layers), budget: {runs[0]['budget'] or 'none'}")
    for run in runs:
        limit = f", budget {run['budget_bytes']:,}" if run["budget_bytes"] is not None else ""
        typer.echo(f"\n{run['tokens_seen']} tokens: {run['total_bytes']:,} bytes held, {run['ratio']:.4f} of the full "
                   f"cache's {run['full_cache_bytes']:,}{limit}")
        typer.echo("layer   held  limit  tokens per tier")
        for row in run["layers"]:
            share = "-" if row["limit_bytes"] is None else f"{row['limit_bytes'] / row['full_bytes']:.3f}"
            kept = ", ".join(f"{name} {count}" for name, count in row["tokens"].items()) or "-"
            typer.echo(f"{row['layer']:>5}  {row['bytes'] / row['full_bytes']:.3f}  {share:>5}  {kept}")
    typer.echo("\nheld, limit: the bytes a layer holds and may hold, as a fraction of its uncompressed bytes\n"
               "tokens per tier: real tokens per batch row and KV head")


@app.command()
def bench(
    model: str = typer.Option(..., help=MODEL_HELP),
    data: Optional[Path] = typer.Option(
        None, help="JSONL data. prefill/decode: passages, one {\"text\": ...} per line (required); code-kl: default "
        "../shared/data/smollm2-code-dev.jsonl (KVSTACK_CODE_DATA); needle: default "
        "../shared/data/smollm2-needle-dev.jsonl (KVSTACK_NEEDLE_DATA).",
    ),
    presets: str = typer.Option(..., help="Comma-separated preset names or YAML files, e.g. identity,streaming."),
    ratios: Optional[str] = typer.Option(
        None,
        help="Comma-separated memory ratios for presets that take a budget (stack budget := {ratio: r}, stage "
        "budgets dropped); an empty string runs every preset as written. Default: 0.5,0.25,0.125 (prefill, decode), "
        "0.5,0.25,0.125,0.0625 (code-kl, needle).",
    ),
    protocol: str = typer.Option(
        BenchProtocol.prefill.value, metavar=PROTOCOL_METAVAR,
        help="prefill: compress the prefix, then decode; decode: compress continuously while feeding tokens one at a "
        "time; code-kl: KL vs. the full cache on 2048-token code passages (prefix prefilled, the rest teacher-forced "
        "token by token); needle: needle-in-a-haystack accuracy per context length (docs/real-models.md).",
    ),
    passages: Optional[int] = typer.Option(None, min=1, help="Number of passages (the first N of --data; default 32, "
                                           "code-kl: 4)."),
    prefix: Optional[int] = typer.Option(None, min=1, help="Tokens before the first predicted position (default 384, "
                                         "code-kl: 1792)."),
    max_len: Optional[int] = typer.Option(None, min=2, help="Tokens per passage (truncated; default 512, code-kl: "
                                          "2048)."),
    decode_prefill: int = typer.Option(16, min=1, help="decode protocol: tokens prefilled in one forward."),
    tasks: int = typer.Option(10, min=1, help="needle: tasks per context length (the first N of each)."),
    task_ids: Optional[str] = typer.Option(None, help="needle: comma-separated task positions per context length "
                                           "(0-based, file order) to run instead of the first --tasks, e.g. 4,5,26 "
                                           "to rerun the tasks a stack missed."),
    lengths: str = typer.Option("1024,2048,4096", help="needle: comma-separated context lengths (context_tokens)."),
    include_8k: bool = typer.Option(False, "--include-8k", help="needle: also run the 8000-token tasks (slow)."),
    max_new_tokens: int = typer.Option(16, min=1, help="needle: greedy reply length limit (SmolLM2's sentence "
                                       "answer takes 12-13 tokens)."),
    dtype: Optional[DType] = typer.Option(None, case_sensitive=False, help=DTYPE_HELP + " prefill/decode: float32 "
                                          "only."),
    fp32: bool = typer.Option(False, "--fp32", help="Shorthand for --dtype float32."),
    device: Device = typer.Option(Device.auto, case_sensitive=False, help=DEVICE_HELP),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default: KVSTACK_BENCH_THREADS or torch's "
                                          "default; 1 is fastest on a busy 2-core machine)."),
    out: Path = typer.Option(..., help="Output directory (results.json, quality_vs_memory.png; code-kl: code_kl.json, "
                             "code_kl_quality_vs_memory.png; needle: needle.json, needle_accuracy_vs_memory.png)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Benchmark presets against the full cache (and, for prefill/decode, transformers' QuantizedCache): a table, a
    JSON file and a plot."""
    from kvstack import KVStackError
    from kvstack.bench import harness, real_model

    try:
        chosen = BenchProtocol(protocol)
    except ValueError:
        _fail(f"protocol={protocol!r} is not allowed: one of {', '.join(p.value for p in BenchProtocol)}")
    real = chosen in (BenchProtocol.code_kl, BenchProtocol.needle)
    if ratios is None:
        ratios = ",".join(f"{r:g}" for r in (real_model.DEFAULT_RATIOS if real else harness.DEFAULT_RATIOS))
    try:
        ratio_values = tuple(float(r) for r in ratios.split(",") if r.strip())
    except ValueError:
        _fail(f"--ratios {ratios!r} is not allowed: comma-separated numbers in (0, 1]")
    if any(not 0 < r <= 1 for r in ratio_values):
        _fail(f"--ratios {ratios!r} is not allowed: every ratio must be in (0, 1]")
    names = [p.strip() for p in presets.split(",") if p.strip()]
    if not names:
        _fail("--presets is empty: give comma-separated preset names or YAML files")
    if fp32:
        if dtype not in (None, DType.float32):
            _fail(f"--fp32 and --dtype {dtype.value} contradict each other: give one")
        dtype = DType.float32
    if not real and dtype not in (None, DType.float32):
        _fail(f"--dtype {dtype.value} is not allowed with --protocol {chosen.value}: it runs in float32 "
              "(kvstack.bench.protocol); code-kl and needle take --dtype")
    where = _resolve_device(device)
    try:
        harness.preset_runs(names, ratio_values)  # unknown presets / invalid overrides: before anything loads
    except KVStackError as err:
        _fail(str(err))
    if chosen is BenchProtocol.code_kl:
        data = data if data is not None else real_model.code_data_path()
        _check_jsonl(data)
    elif chosen is BenchProtocol.needle:
        data = data if data is not None else real_model.needle_data_path()
        _check_jsonl(data, ("context_tokens", "context", "question", "answer"))
    else:
        if data is None:
            _fail(f"--data is required with --protocol {chosen.value}: a JSONL file of {{\"text\": ...}} passages")
        _check_jsonl(data)
    task_indices = None
    if task_ids is not None:
        task_indices = _int_list("--task-ids", task_ids, 0, allowed="task positions >= 0, e.g. 4,5,26")
    length_values = _int_list("--lengths", lengths, 1, allowed="context lengths, e.g. 1024,2048")
    if out.exists() and not out.is_dir():
        _fail(f"--out {str(out)!r} is a file: give a directory (it is created when missing)")
    _check_model_source(model)
    _run_bench(chosen, model, data, names, out, ratio_values, passages=passages, prefix=prefix, max_len=max_len,
               decode_prefill=decode_prefill, tasks=tasks, task_indices=task_indices, lengths=length_values,
               include_8k=include_8k, max_new_tokens=max_new_tokens, dtype=dtype, device=where, threads=threads,
               progress=progress)


def _run_bench(chosen: BenchProtocol, model: str, data: Path, names: list[str], out: Path, ratios: tuple, *,
               passages, prefix, max_len, decode_prefill, tasks, task_indices, lengths, include_8k, max_new_tokens,
               dtype, device,
               threads, progress) -> None:
    """The protocol's run and its printout (options already checked; ``device`` resolved)."""
    import torch

    from kvstack import KVStackError
    from kvstack.bench import harness, models, real_model

    dtype_name = dtype.value if dtype is not None else None
    try:
        if chosen is BenchProtocol.code_kl:
            result = real_model.code_kl(
                model, data, names, out, passages=passages or real_model.CODE_PASSAGES, ratios=ratios,
                prefix=prefix or real_model.CODE_PREFIX, max_len=max_len or real_model.CODE_MAX_LEN, dtype=dtype_name,
                device=device, threads=threads, progress=progress,
            )
            typer.echo(real_model.code_kl_table(result.rows))
        elif chosen is BenchProtocol.needle:
            result = real_model.needle(
                model, data, names, out, tasks_per_length=tasks, lengths=lengths, task_indices=task_indices,
                include_8k=include_8k,
                ratios=ratios, max_new_tokens=max_new_tokens, dtype=dtype_name, device=device, threads=threads,
                progress=progress,
            )
            typer.echo(real_model.needle_table(result.rows))
        else:
            if threads:
                torch.set_num_threads(threads)
            result = harness.bench(
                model, data, names, out, passages=passages or 32, ratios=ratios, protocol_name=chosen.value,
                prefix=prefix or 384, max_len=max_len or 512, decode_prefill=decode_prefill, device=device,
                progress=progress,
            )
            typer.echo(harness.markdown_table(result.rows))
            typer.echo(f"\nwrote {out / harness.RESULTS_FILE} and {out / harness.PLOT_FILE}")
            return
    except models.ModelLoadError as err:  # a Hub id that cannot load
        _fail(f"--model: {err}")
    except (KVStackError, ValueError) as err:
        _fail(str(err))
    written = result.files
    if written.get("plot"):
        typer.echo(f"\nwrote {written['json']} and {written['plot']}")
    else:
        typer.echo(f"\nwrote {written['json']}; no plot: {written.get('plot_skipped')}")


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

@app.command("vllm-config")
def vllm_config(
    stack: str = typer.Argument(..., help="Preset name or YAML spec (evict, quantize, or both)."),
    block_size: Optional[int] = typer.Option(None, min=1, help="The engine's block size (CPU: a multiple of 32)."),
    tokens: Optional[int] = typer.Option(None, min=1, help="Budget: tokens per request (replaces the stack's)."),
    ratio: Optional[float] = typer.Option(None, help="Budget: a ratio of the uncompressed cache (replaces it)."),
    out: Optional[Path] = typer.Option(None, help="YAML file to write (default: print it)."),
) -> None:
    """vLLM server options that run STACK: `vllm serve MODEL --config FILE` (docs/vllm.md)."""
    import yaml

    from kvstack import KVStackError
    from kvstack.integrations.vllm import serve_config

    if tokens is not None and ratio is not None:
        _fail(f"--tokens {tokens} and --ratio {ratio} are both given: one budget")
    budget = {"tokens": tokens} if tokens is not None else {"ratio": ratio} if ratio is not None else None
    try:
        config = serve_config(_load(stack), block_size=block_size, budget=budget)
    except (KVStackError, ValueError) as err:
        _fail(str(err))
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    if out is None:
        typer.echo(text, nl=False)
        return
    if not out.parent.is_dir():
        _fail(f"--out {str(out)!r}: the folder {str(out.parent)!r} does not exist")
    out.write_text(text)
    typer.echo(f"wrote {out}: vllm serve MODEL --config {out}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()
