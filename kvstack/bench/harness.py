"""``kvstack bench``: compare presets (and transformers' own caches) on quality vs. memory, in one run.

For every preset, and — when the preset takes a budget — every memory ratio, the harness runs the evaluation
protocol (:mod:`kvstack.bench.protocol`) on the same passages against ONE shared set of full-cache references, and
reports per stack: bytes held after the prefix and their ratio to an uncompressed cache of the same tokens, KL of
the next-token distribution vs. the full cache, top-1 agreement, perplexity, and the token-by-token time as a ratio
to the full cache's time measured in the same run.

Ratio override (:func:`with_ratio`): a preset *takes a budget* when it has a stack-wide ``budget`` or a stage with
its own ``budget``. For memory ratio ``r`` the stack budget becomes ``{ratio: r}`` and every stage-level ``budget`` is
dropped, so every budgeted stage follows the one stack-wide ratio (a stage's ratio prices tokens as full-precision
tokens; the measured memory ratio, not ``r``, is what the table and plot report). Presets without a budget run once,
as written. ``ratios=()`` runs every preset as written.

Baselines in the same run: the full ``DynamicCache`` (the KL and time reference) and transformers'
``QuantizedCache`` with every backend that is installed (``quanto`` and ``hqq`` at 4 and 2 bits, ``fp8`` per-tensor);
a missing or failing backend is recorded in the metadata instead of a row.

Outputs in ``out``: ``results.json`` (metadata + every field of every row), ``quality_vs_memory.png``
(:mod:`kvstack.bench.plot`) and the markdown table (:func:`markdown_table`) the CLI prints.
"""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kvstack.stack.base import Budget
from kvstack.stack.shape import ModelShape
from kvstack.stack.spec import StackSpec

from . import protocol

DEFAULT_RATIOS = (0.5, 0.25, 0.125)
FULL_CACHE = "full-cache"
QUANTIZED_FAMILY = "QuantizedCache"
#: backend -> bit widths tried (quanto and hqq are group-wise integer quantizers; fp8 is per-tensor float8)
QUANTIZED_BACKENDS = {"quanto": (4, 2), "hqq": (4, 2), "fp8": (8,)}
EXACT_KL = 1e-9  # nats/token: what float rounding leaves between two uncompressed runs (counts as 0)
RESULTS_FILE = "results.json"
PLOT_FILE = "quality_vs_memory.png"


def takes_budget(spec: StackSpec) -> bool:
    """True when the stack has a stack-wide budget or any stage sets its own ``budget``."""
    return spec.budget is not None or any(isinstance(getattr(s, "budget", None), Budget) for s in spec.stages)


def with_ratio(spec: StackSpec, ratio: float) -> StackSpec:
    """The same stack with the stack budget set to ``{ratio: ratio}`` and every stage-level budget dropped (so all
    budgeted stages follow it). The result is validated like any spec."""
    data = spec.model_dump(mode="json")
    data["budget"] = {"ratio": ratio}
    for stage in data["stages"]:
        if "budget" in stage:
            stage["budget"] = None
    return StackSpec.load(data)


@dataclass
class Run:
    """One evaluation to perform: a stack (``spec``) or a baseline cache factory (``make_cache``)."""

    name: str
    family: str
    kind: str  # "baseline" or "preset"
    spec: StackSpec | None = None
    make_cache: Callable[[Any], Any] | None = None
    source: str | None = None  # the preset argument the run comes from
    ratio_target: float | None = None
    backend: str | None = None
    bits: int | None = None


@dataclass
class BenchRow:
    name: str  # "streaming@0.25", "full-cache", "QuantizedCache[fp8, 8-bit]"
    family: str  # the preset (curve of the plot) or the baseline's family
    kind: str  # "baseline" | "preset"
    source: str | None  # preset name or YAML path as given
    ratio_target: float | None  # the overriding stack ratio (None: as written / baseline)
    backend: str | None  # QuantizedCache backend
    bits: int | None  # QuantizedCache bits
    kl: float  # nats per predicted token, KL(full cache || this)
    top1: float  # top-1 agreement with the full cache
    ppl: float  # perplexity of the true next tokens
    memory_bytes: int  # cache bytes after the prefix (mean per passage)
    full_bytes: int  # uncompressed bytes of the same tokens (model dtype)
    memory_ratio: float  # memory_bytes / full_bytes
    decode_seconds: float  # token-by-token wall time over all passages
    decode_time_ratio: float  # decode_seconds / the full cache's decode_seconds in this run
    positions: int  # predicted positions over all passages
    per_passage_kl: list[float]
    pareto: bool  # on the (memory ratio, KL) Pareto front of this run
    spec: dict | None  # the stack spec actually run (None for baselines)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class BenchResult:
    rows: list[BenchRow]
    metadata: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"metadata": self.metadata, "rows": [row.as_dict() for row in self.rows]}


def preset_runs(presets: list[str], ratios: tuple[float, ...] | list[float]) -> list[Run]:
    """One run per preset, or one per ratio for presets that take a budget. Raises ``SpecError`` for an unknown
    preset or a spec the ratio override makes invalid."""
    runs = []
    for source in presets:
        spec = StackSpec.load(source)
        family = Path(source).stem  # a preset name, or a YAML file's stem
        if ratios and takes_budget(spec):
            for r in ratios:
                ratio_spec = with_ratio(spec, r)
                runs.append(Run(f"{family}@{r:g}", family, "preset", ratio_spec, source=source, ratio_target=r))
        else:
            runs.append(Run(family, family, "preset", spec, source=source))
    return runs


def quantized_baselines() -> tuple[list[Run], dict[str, str]]:
    """Runs for every installed ``QuantizedCache`` backend, and a status line per backend (for the metadata)."""
    from transformers import QuantizedCache
    from transformers.utils import is_hqq_available, is_optimum_quanto_available

    installed = {
        "quanto": (is_optimum_quanto_available(), "optimum-quanto is not installed"),
        "hqq": (is_hqq_available(), "hqq is not installed"),
        "fp8": (hasattr(torch, "float8_e4m3fn"), "this torch has no float8_e4m3fn"),
    }
    runs, status = [], {}
    for backend, bit_widths in QUANTIZED_BACKENDS.items():
        ok, why = installed[backend]
        if not ok:
            status[backend] = f"unavailable: {why}"
            continue
        for bits in bit_widths:
            # fp8 takes no group-wise options (nbits is fixed by its dtype)
            kwargs = {} if backend == "fp8" else {"nbits": bits}

            def make(model, backend=backend, kwargs=kwargs):
                return QuantizedCache(backend, model.config, **kwargs)

            name = f"{QUANTIZED_FAMILY}[{backend}, {bits}-bit]"
            runs.append(Run(name, QUANTIZED_FAMILY, "baseline", make_cache=make, backend=backend, bits=bits))
        status[backend] = "ran"
    return runs, status


def pareto_flags(points: list[tuple[float, float]]) -> list[bool]:
    """For (memory ratio, KL) points: True where no other point is at most as large in both and smaller in one.
    KLs up to ``EXACT_KL`` count as 0, so rounding noise does not put a bigger exact cache on the front."""
    points = [(m, k if k > EXACT_KL else 0.0) for m, k in points]
    return [
        not any(m2 <= m and k2 <= k and (m2 < m or k2 < k) for m2, k2 in points)
        for m, k in points
    ]


def check_protocol(protocol_name: str, prefix: int, decode_prefill: int) -> None:
    if protocol_name not in protocol.PROTOCOLS:
        raise ValueError(f"protocol={protocol_name!r} is not allowed: one of {', '.join(protocol.PROTOCOLS)}")
    if protocol_name == "decode" and not 0 < decode_prefill < prefix:
        raise ValueError(f"decode_prefill={decode_prefill} is not allowed: 0 < decode_prefill < prefix ({prefix})")


def run_bench(
    model,
    tokenizer,
    passages: list[str],
    presets: list[str],
    *,
    ratios: tuple[float, ...] | list[float] = DEFAULT_RATIOS,
    protocol_name: str = "prefill",
    prefix: int = 384,
    max_len: int = 512,
    decode_prefill: int = 16,
    progress: bool = True,
) -> BenchResult:
    """Evaluate the baselines and every preset run on ``passages``; references are computed once and shared."""
    from tqdm.auto import tqdm

    check_protocol(protocol_name, prefix, decode_prefill)
    measured_with = versions()  # at the start: the code the rows come from
    ids_list = protocol.passage_ids(model, tokenizer, passages, max_len)
    for i, ids in enumerate(ids_list):
        if ids.shape[0] <= prefix:
            raise ValueError(
                f"passage {i} has {ids.shape[0]} tokens (max_len={max_len}); the protocol needs more than "
                f"prefix={prefix} tokens to predict from"
            )
    runs = preset_runs(presets, ratios)
    shape = ModelShape.from_model(model)
    for run in runs:  # fail before the first minute of work, not in the middle
        run.spec.validate_for(shape)
    quantized, backend_status = quantized_baselines()
    runs = [Run(FULL_CACHE, FULL_CACHE, "baseline")] + quantized + runs

    references = protocol.reference_set(model, ids_list, prefix)
    results = []
    bar = tqdm(runs, desc="kvstack bench", unit="stack", disable=not progress)
    for run in bar:
        bar.set_postfix_str(run.name)
        try:
            result = protocol.evaluate(
                model,
                tokenizer,
                passages,
                run.spec,
                name=run.name,
                prefix=prefix,
                max_len=max_len,
                make_cache=run.make_cache,
                references=references,
                protocol=protocol_name,
                decode_prefill=decode_prefill,
            )
        except Exception as err:  # a transformers baseline that cannot run here is reported, not fatal
            if run.backend is None:
                raise
            backend_status[run.backend] = f"failed at {run.bits} bits: {type(err).__name__}: {err}"
            continue
        results.append((run, result))
    bar.close()

    full_seconds = results[0][1].decode_seconds
    flags = pareto_flags([(r.memory_ratio, r.kl) for _, r in results])
    rows = [
        BenchRow(
            name=run.name,
            family=run.family,
            kind=run.kind,
            source=run.source,
            ratio_target=run.ratio_target,
            backend=run.backend,
            bits=run.bits,
            kl=r.kl,
            top1=r.top1,
            ppl=r.ppl,
            memory_bytes=r.memory_bytes,
            full_bytes=r.full_bytes,
            memory_ratio=r.memory_ratio,
            decode_seconds=r.decode_seconds,
            decode_time_ratio=r.decode_seconds / full_seconds,
            positions=r.positions,
            per_passage_kl=r.per_passage_kl,
            pareto=flag,
            spec=run.spec.model_dump(mode="json", exclude_none=True) if run.spec is not None else None,
        )
        for (run, r), flag in zip(results, flags)
    ]
    metadata = {
        "passages": len(passages),
        "protocol": protocol_name,
        "prefix": prefix,
        "max_len": max_len,
        "decode_prefill": decode_prefill if protocol_name == "decode" else None,
        "presets": list(presets),
        "ratios": list(ratios),
        "ratio_override": "stack budget := {ratio: r}; stage-level budgets dropped (kvstack.bench.harness.with_ratio)",
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(next(model.parameters()).device),
        "baselines": {"full_cache": "transformers DynamicCache", "quantized_cache": backend_status},
        "versions": measured_with,
    }
    return BenchResult(rows, metadata)



def versions() -> dict:
    """The versions a result was measured with, and kvstack's git commit when it runs from a checkout (``+dirty``
    with uncommitted changes; None otherwise): the commit to check out to rerun a figure as it was measured."""
    import transformers

    import kvstack

    return {
        "kvstack": kvstack.__version__,
        "kvstack_commit": _git_commit(Path(kvstack.__file__).resolve().parent),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _git_commit(package: Path) -> str | None:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10,
                              check=True)
        return done.stdout.strip()

    try:
        git("ls-files", "--error-unmatch", "__init__.py")  # kvstack's own checkout, not a repository around a venv
        commit = git("rev-parse", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
        return None


def bench(
    model_source: str | Path,
    data_path: str | Path,
    presets: list[str],
    out: str | Path,
    *,
    passages: int = 32,
    ratios: tuple[float, ...] | list[float] = DEFAULT_RATIOS,
    protocol_name: str = "prefill",
    prefix: int = 384,
    max_len: int = 512,
    decode_prefill: int = 16,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> BenchResult:
    """Load the model (float32 on ``device``: an HF directory, a GGUF file or a Hub id,
    :func:`kvstack.bench.models.load_causal_lm`) and passages, :func:`run_bench`, and write ``results.json`` and the
    plot into ``out`` (the plot needs matplotlib: ``pip install kvstack[plot]``; without it the JSON and the table
    are still written)."""
    from . import models

    data_path, out = Path(data_path), Path(out)
    check_protocol(protocol_name, prefix, decode_prefill)  # option errors before the model loads
    preset_runs(presets, ratios)
    texts = protocol.load_passages(data_path, passages)
    if len(texts) < passages:
        raise ValueError(f"passages={passages} is not allowed: {data_path} holds only {len(texts)} passages")
    model, tokenizer = models.load_causal_lm(model_source, dtype=torch.float32, device=device)
    result = run_bench(
        model, tokenizer, texts, presets, ratios=ratios, protocol_name=protocol_name, prefix=prefix, max_len=max_len,
        decode_prefill=decode_prefill, progress=progress,
    )
    result.metadata = models.describe_source(model_source) | {"data": str(data_path)} | result.metadata
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    try:
        from .plot import plot_quality_vs_memory
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install 'kvstack[plot]'); wrote {out / RESULTS_FILE}")
        return result
    title = f"{result.metadata['model']}, {len(texts)} passages, protocol {result.metadata['protocol']}"
    plot_quality_vs_memory([row.as_dict() for row in result.rows], out / PLOT_FILE, title=title)
    return result


def markdown_table(rows: list[BenchRow]) -> str:
    """The terminal/docs table: one line per row, Pareto-front rows marked with ``*``."""
    lines = [
        "| stack | memory ratio | bytes | KL | top-1 | ppl | decode time | front |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.memory_ratio:.3f} | {r.memory_bytes:,} | {r.kl:.4g} | {r.top1:.3f} | {r.ppl:.3f} "
            f"| {r.decode_time_ratio:.2f}x | {'*' if r.pareto else ''} |"
        )
    return "\n".join(lines)
