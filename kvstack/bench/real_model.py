"""Quality vs. memory on a real instruction-tuned LLM (SmolLM2-135M-Instruct, GGUF): two protocols.

``code_kl`` (``kvstack bench --protocol code-kl``), per passage of ``smollm2-code-dev.jsonl`` (2048 tokens of Python,
``text`` tokenized without special tokens, truncated to ``max_len``):

* reference: ONE uncompressed forward of all tokens on the unmodified model; ``log_softmax`` in float64 of the logits
  predicting positions ``prefix .. len-1``;
* compressed run: prefill ``ids[:prefix]`` (default 1792) into the stack's cache in one forward (the stack compresses
  as its spec says), take the distribution at position ``prefix-1``, then feed ``ids[prefix:len-1]`` ONE token at a
  time with explicit absolute ``position_ids`` (teacher forcing; 255 one-token decode steps by default, 256
  predicted positions);
* metrics over all predicted positions of all passages: KL(reference || compressed) in nats per token, top-1
  agreement, perplexity of the true next tokens; memory: ``cache.memory_bytes()`` right after the prefix over
  ``kvstack.full_cache_bytes`` of the same tokens in the model's dtype, and the largest such ratio (and the largest
  bytes) over every decode step; decode time per token (the model calls only) over that of the full
  ``DynamicCache`` in the same run. The KL's spread: the standard error of the per-passage mean (``kl_se``) and the
  share of it carried by each passage's 8 worst positions (``kl_worst_share``). On SmolLM2 at a quarter of the cache
  that share is a third to a half: a few positions where the compressed run's distribution moves a lot decide the figure, so
  passages differ by 2x and two stacks within about two standard errors are not told apart.

``needle`` (``kvstack bench --protocol needle``), per task of ``smollm2-needle-dev.jsonl``: the user turn
``<context>\\n\\n<question>`` is formatted with the tokenizer's chat template (its default system prompt included,
``add_generation_prompt=True``) and cut at the end of the context. The first part (system turn, user header and the
whole context) is prefilled in one forward and compressed; its memory ratio is measured then. The rest (``\\n\\n``,
the question, the end of the turn and the assistant header) is fed in a second forward on the same cache, its
attention exact over what the cache holds; the stages apply their spec after that forward too (a budgeted stage
evicts again to stay in budget; the question's own tokens are not protected). Then up to ``max_new_tokens``
tokens (16: SmolLM2 answers with a sentence, "The secret number of NAME is NNNNN", 12 tokens, 13 for 36 of the 160
names) are decoded greedily, stopping at EOS; a task counts when ``answer`` appears in the decoded reply. Accuracy is
reported per context length (1024, 2048, 4096; 8000 with ``include_8k``) next to the full ``DynamicCache``'s on the
same tasks.

Both take presets (names or YAML files) and memory ratios; presets that take a budget run once per ratio through
:func:`kvstack.bench.harness.preset_runs` (the same override as ``kvstack bench``), the others once as written.
Outputs: ``code_kl.json`` / ``needle.json`` (metadata with every setting + one record per run) and a picture
(``code_kl_quality_vs_memory.png`` through :mod:`kvstack.bench.plot`, ``needle_accuracy_vs_memory.png``; skipped
with a message when matplotlib is missing).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvstack.stack.memory import full_cache_bytes
from kvstack.stack.shape import ModelShape

from . import harness, models, protocol

DEFAULT_MODEL = "../shared/models/smollm2-135m-instruct"
DEFAULT_CODE_DATA = "../shared/data/smollm2-code-dev.jsonl"
DEFAULT_NEEDLE_DATA = "../shared/data/smollm2-needle-dev.jsonl"
DEFAULT_RATIOS = (0.5, 0.25, 0.125, 0.0625)
NEEDLE_LENGTHS = (1024, 2048, 4096)
LONG_NEEDLE_LENGTH = 8000  # only with include_8k (a 8K prefill per task and preset)
CODE_PREFIX, CODE_MAX_LEN, CODE_PASSAGES = 1792, 2048, 4
NEEDLE_TASKS, NEEDLE_NEW_TOKENS = 10, 16  # 36 of the 160 answers take 13 tokens as a sentence
FULL_CACHE = harness.FULL_CACHE
CODE_KL_FILE, CODE_KL_PLOT = "code_kl.json", "code_kl_quality_vs_memory.png"
NEEDLE_FILE, NEEDLE_PLOT = "needle.json", "needle_accuracy_vs_memory.png"
NEEDLE_PROMPT = (
    "chat template, one user turn '<context>\\n\\n<question>', add_generation_prompt=True; prefilled and compressed: "
    "everything up to the end of the context; fed afterwards in one forward: the rest (question, end of turn, "
    "assistant header); stages still apply their spec after that forward"
)


def model_path() -> Path:
    return Path(os.environ.get("KVSTACK_REAL_MODEL", DEFAULT_MODEL))


def code_data_path() -> Path:
    return Path(os.environ.get("KVSTACK_CODE_DATA", DEFAULT_CODE_DATA))


def needle_data_path() -> Path:
    return Path(os.environ.get("KVSTACK_NEEDLE_DATA", DEFAULT_NEEDLE_DATA))


def _read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_code_passages(path: str | Path | None = None, n: int | None = CODE_PASSAGES) -> list[str]:
    """The ``text`` of the first ``n`` passages (all with ``n=None``)."""
    texts = [r["text"] for r in _read_jsonl(path if path is not None else code_data_path())]
    return texts[:n] if n else texts


def load_needle_tasks(
    path: str | Path | None = None, per_length: int | None = NEEDLE_TASKS, lengths=NEEDLE_LENGTHS,
    indices: list[int] | None = None,
) -> list[dict]:
    """The first ``per_length`` tasks (file order) at each of ``lengths`` (``context_tokens``), grouped by length; with
    ``indices``, the tasks at those positions of each length instead (0-based, file order)."""
    tasks = _read_jsonl(path if path is not None else needle_data_path())
    out = []
    for length in lengths:
        at = [t for t in tasks if t.get("context_tokens") == length]
        if indices is not None:
            if max(indices, default=-1) >= len(at):
                raise ValueError(f"task index {max(indices)} is not allowed at context_tokens={length}: 0.."
                                 f"{len(at) - 1} (the file holds {len(at)} tasks of that length)")
            out.extend(at[i] for i in indices)
        else:
            out.extend(at[:per_length] if per_length else at)
    return out


# --------------------------------------------------------------------------------------------------- shared helpers
def _cache_bytes(cache) -> int:
    return cache.memory_bytes() if hasattr(cache, "memory_bytes") else protocol._dynamic_bytes(cache)


@contextlib.contextmanager
def _stack(model, run: harness.Run):
    """Apply ``run``'s stack for the duration (nothing for the full-cache baseline); yields a cache factory."""
    import kvstack
    from transformers import DynamicCache

    if run.spec is None:
        yield lambda: DynamicCache(config=model.config)
        return
    kvstack.apply(model, run.spec)
    try:
        yield lambda: kvstack.cache_for(model)
    finally:
        kvstack.remove(model)


def _step(model, ids: torch.Tensor, start: int, cache, name: str, keep: int = 1):
    """One forward of ``ids`` [T] at absolute positions ``start..start+T-1``; logits of the last ``keep`` inputs
    (on CUDA the call waits for the device, so wall-clock timings around it are the forward's)."""
    positions = torch.arange(start, start + ids.shape[0], device=ids.device)[None]
    logits = model(ids[None], position_ids=positions, logits_to_keep=keep, **{name: cache}).logits[0]
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    return logits


def _runs(model, presets: list[str], ratios) -> list[harness.Run]:
    """The full-cache baseline, then every preset run (validated against the model before any work)."""
    runs = harness.preset_runs(presets, ratios)
    shape = ModelShape.from_model(model)
    for run in runs:
        run.spec.validate_for(shape)
    return [harness.Run(FULL_CACHE, FULL_CACHE, "baseline")] + runs


def _run_fields(run: harness.Run) -> dict:
    return dict(
        name=run.name, family=run.family, kind=run.kind, source=run.source, ratio_target=run.ratio_target,
        spec=run.spec.model_dump(mode="json", exclude_none=True) if run.spec is not None else None,
    )  # fmt: skip


def _metadata(model, presets, ratios, measured_with: dict, **settings) -> dict:
    return {
        **settings,
        "presets": list(presets),
        "ratios": list(ratios),
        "ratio_override": "stack budget := {ratio: r}; stage-level budgets dropped (kvstack.bench.harness.with_ratio)",
        "model_dtype": str(models.model_dtype(model)).removeprefix("torch."),
        "device": str(next(model.parameters()).device),
        "threads": torch.get_num_threads(),
        "baseline": f"{FULL_CACHE}: transformers DynamicCache",
        "versions": measured_with,
    }


@contextlib.contextmanager
def _threads(threads: int | None):
    before = torch.get_num_threads()
    threads = threads or int(os.environ.get("KVSTACK_BENCH_THREADS", 0)) or before
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not progress)


def _write(result: "RealModelResult", out: str | Path, name: str) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    return path


def _check_presets(presets: list[str], ratios) -> None:
    if not presets:
        raise ValueError("presets is empty: give preset names or YAML files")
    if any(not 0 < r <= 1 for r in ratios):
        raise ValueError(f"ratios={list(ratios)} is not allowed: every ratio must be in (0, 1]")
    harness.preset_runs(presets, ratios)  # unknown presets / invalid overrides fail before the model loads


@dataclass
class RealModelResult:
    rows: list
    metadata: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # what was written: json, plot (None when skipped, and why)

    def as_dict(self) -> dict:
        return {"metadata": self.metadata, "rows": [r.as_dict() for r in self.rows]}


# ----------------------------------------------------------------------------------------------------------- code_kl
@dataclass
class CodeKLRow:
    name: str  # "kivi-4", "streaming@0.25", "full-cache"
    family: str
    kind: str  # "baseline" | "preset"
    source: str | None
    ratio_target: float | None
    kl: float  # nats per predicted token, KL(one uncompressed forward || this run)
    top1: float
    ppl: float
    memory_bytes: int  # cache bytes right after the prefix (mean per passage)
    full_bytes: int  # uncompressed bytes of the prefix tokens, model dtype (mean per passage)
    memory_ratio: float  # sum of bytes after the prefix / sum of full bytes
    memory_bytes_max: int  # largest cache bytes over the prefix and every decode step (max over passages)
    memory_ratio_max: float  # largest bytes / full bytes of the tokens seen at that step, over steps and passages
    decode_steps: int  # one-token forwards over all passages
    decode_seconds: float  # their wall time (model calls only)
    decode_seconds_per_token: float
    decode_time_ratio: float  # decode_seconds_per_token / the full cache's in this run
    prefill_seconds: float  # prefix forwards over all passages
    wall_seconds: list[float]  # per passage: prefill + decode + memory reads
    positions: int  # predicted positions over all passages
    per_passage_kl: list[float]
    kl_se: float | None  # standard error of the mean of per_passage_kl (None for one passage)
    kl_worst_share: float  # share of the KL carried by each passage's WORST_POSITIONS positions: how spiky it is
    pareto: bool  # on the (memory ratio, KL) front of this run
    spec: dict | None

    def as_dict(self) -> dict:
        return asdict(self)


WORST_POSITIONS = 8  # per passage, for ``kl_worst_share``


def _standard_error(values: list[float]) -> float | None:
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def reference_logprobs(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """float64 log-probabilities [len - prefix, vocab] predicting positions prefix..len-1: one uncompressed forward
    (only the logits rows needed are projected)."""
    from kvstack.stack.apply import APPLIED_ATTR

    if getattr(model, APPLIED_ATTR, None) is not None:
        raise RuntimeError("reference_logprobs needs the unmodified model (call kvstack.remove first)")
    logits = model(ids[None], logits_to_keep=ids.shape[0] - prefix + 1).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def code_kl_passage(model, ids: torch.Tensor, prefix: int, cache, full_per_token: int) -> dict:
    """The compressed run of one passage: prefill, then teacher-forced one-token steps. Returns the float64
    log-probabilities [len - prefix, vocab] and the memory and time measurements."""
    from kvstack.stack.apply import cache_kwarg

    name = cache_kwarg(model)
    wall = time.perf_counter()
    start = time.perf_counter()
    rows = [_step(model, ids[:prefix], 0, cache, name)[-1]]
    prefill_seconds = time.perf_counter() - start
    held = _cache_bytes(cache)
    max_bytes, max_ratio = held, held / (full_per_token * prefix)
    decode_seconds = 0.0
    for p in range(prefix, ids.shape[0] - 1):
        start = time.perf_counter()
        rows.append(_step(model, ids[p : p + 1], p, cache, name)[-1])
        decode_seconds += time.perf_counter() - start
        nbytes = _cache_bytes(cache)
        max_bytes = max(max_bytes, nbytes)
        max_ratio = max(max_ratio, nbytes / (full_per_token * (p + 1)))
    return {
        "logprobs": torch.log_softmax(torch.stack(rows).double(), dim=-1),
        "bytes": held,
        "full_bytes": full_per_token * prefix,
        "max_bytes": max_bytes,
        "max_ratio": max_ratio,
        "steps": ids.shape[0] - 1 - prefix,
        "prefill_seconds": prefill_seconds,
        "decode_seconds": decode_seconds,
        "wall_seconds": time.perf_counter() - wall,
    }


def run_code_kl(
    model,
    tokenizer,
    passages: list[str],
    presets: list[str],
    *,
    ratios=DEFAULT_RATIOS,
    prefix: int = CODE_PREFIX,
    max_len: int = CODE_MAX_LEN,
    progress: bool = True,
) -> RealModelResult:
    """The ``code_kl`` protocol (module docstring) for the full cache and every preset run, references shared."""
    measured_with = harness.versions()  # at the start: the code the rows come from
    device = next(model.parameters()).device
    ids_list = [
        torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"][:max_len], device=device) for t in passages
    ]
    for i, ids in enumerate(ids_list):
        if ids.shape[0] <= prefix:
            raise ValueError(
                f"passage {i} has {ids.shape[0]} tokens (max_len={max_len}); code_kl needs more than prefix={prefix}"
            )
    runs = _runs(model, presets, ratios)
    full_per_token = full_cache_bytes(model.config, 1, dtype=models.model_dtype(model))
    with torch.inference_mode():
        references = [reference_logprobs(model, ids, prefix) for ids in ids_list]
    measured = []
    bar = _bar(len(runs) * len(ids_list), "code_kl", progress)
    for run in runs:
        bar.set_postfix_str(run.name)
        per = []
        with _stack(model, run) as new_cache:
            for ids, ref in zip(ids_list, references):
                with torch.inference_mode():
                    m = code_kl_passage(model, ids, prefix, new_cache(), full_per_token)
                    comp = m.pop("logprobs")
                    kl = (ref.exp() * (ref - comp)).sum(-1)
                    m["kl"] = float(kl.mean())
                    m["kl_worst"] = float(kl.topk(min(WORST_POSITIONS, kl.numel())).values.sum())
                    m["kl_sum"] = float(kl.sum())
                    m["positions"] = kl.numel()
                    m["agree"] = int((ref.argmax(-1) == comp.argmax(-1)).sum())
                    m["nll"] = float(-comp.gather(-1, ids[prefix:, None]).sum())
                per.append(m)
                bar.update()
        measured.append((run, per))
    bar.close()

    def total(per, key):
        return sum(m[key] for m in per)

    base = measured[0][1]  # the full cache: the time reference
    base_per_token = total(base, "decode_seconds") / max(total(base, "steps"), 1)
    rows = []
    for run, per in measured:
        positions, steps = total(per, "positions"), total(per, "steps")
        per_token = total(per, "decode_seconds") / max(steps, 1)
        rows.append(
            CodeKLRow(
                **{k: v for k, v in _run_fields(run).items() if k != "spec"},
                kl=sum(m["kl"] * m["positions"] for m in per) / positions,
                top1=total(per, "agree") / positions,
                ppl=float(torch.exp(torch.tensor(total(per, "nll") / positions))),
                memory_bytes=total(per, "bytes") // len(per),
                full_bytes=total(per, "full_bytes") // len(per),
                memory_ratio=total(per, "bytes") / total(per, "full_bytes"),
                memory_bytes_max=max(m["max_bytes"] for m in per),
                memory_ratio_max=max(m["max_ratio"] for m in per),
                decode_steps=steps,
                decode_seconds=total(per, "decode_seconds"),
                decode_seconds_per_token=per_token,
                decode_time_ratio=per_token / base_per_token if base_per_token else float("nan"),
                prefill_seconds=total(per, "prefill_seconds"),
                wall_seconds=[m["wall_seconds"] for m in per],
                positions=positions,
                per_passage_kl=[m["kl"] for m in per],
                kl_se=_standard_error([m["kl"] for m in per]),
                kl_worst_share=total(per, "kl_worst") / total(per, "kl_sum") if total(per, "kl_sum") > 0 else float("nan"),
                pareto=False,
                spec=_run_fields(run)["spec"],
            )
        )
    for row, flag in zip(rows, harness.pareto_flags([(r.memory_ratio, r.kl) for r in rows])):
        row.pareto = flag
    metadata = _metadata(
        model, presets, ratios, measured_with, protocol="code-kl", passages=len(passages), prefix=prefix,
        max_len=max_len, decode_steps_per_passage=[int(ids.shape[0]) - 1 - prefix for ids in ids_list],
        tokenization="text without special tokens, truncated to max_len",
    )  # fmt: skip
    return RealModelResult(rows, metadata)


def code_kl(
    model_source: str | Path | None = None,
    data: str | Path | None = None,
    presets: list[str] = ("identity",),
    out: str | Path = "runs/code-kl",
    *,
    passages: int = CODE_PASSAGES,
    ratios=DEFAULT_RATIOS,
    prefix: int = CODE_PREFIX,
    max_len: int = CODE_MAX_LEN,
    dtype=None,
    device: str | torch.device = "cpu",
    threads: int | None = None,
    progress: bool = True,
) -> RealModelResult:
    """Load the model (:func:`kvstack.bench.models.load_causal_lm`: a local path or a Hub id, on ``device``) and
    passages, :func:`run_code_kl`, and write ``code_kl.json`` and ``code_kl_quality_vs_memory.png`` into ``out``."""
    presets = list(presets)
    model_source = model_source if model_source is not None else model_path()
    data = Path(data) if data is not None else code_data_path()
    _check_presets(presets, ratios)
    if not 0 < prefix < max_len:
        raise ValueError(f"prefix={prefix} is not allowed: 0 < prefix < max_len ({max_len})")
    texts = load_code_passages(data, passages)
    if len(texts) < passages:
        raise ValueError(f"passages={passages} is not allowed: {data} holds only {len(texts)} passages")
    with _threads(threads):
        model, tokenizer = models.load_causal_lm(model_source, dtype=dtype, device=device)
        result = run_code_kl(model, tokenizer, texts, presets, ratios=ratios, prefix=prefix, max_len=max_len,
                             progress=progress)
    result.metadata = models.describe_source(model_source) | {"data": str(data)} | result.metadata
    result.files["json"] = str(_write(result, out, CODE_KL_FILE))
    try:
        from .plot import plot_quality_vs_memory
    except ImportError:
        result.files["plot"] = None
        result.files["plot_skipped"] = "matplotlib is not installed (pip install 'kvstack[plot]')"
        return result
    title = (f"{result.metadata['model']} ({result.metadata['model_dtype']}), code_kl: {len(texts)} passages, "
             f"prefix {prefix} of {max_len}")
    rows = [r.as_dict() for r in result.rows]
    result.files["plot"] = str(plot_quality_vs_memory(rows, Path(out) / CODE_KL_PLOT, title=title))
    return result


def code_kl_table(rows: list[CodeKLRow]) -> str:
    lines = [
        f"| stack | memory ratio | max ratio (decode) | bytes | KL | ± s.e. | worst {WORST_POSITIONS} | top-1 | ppl "
        "| decode time | s/passage | front |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in rows:
        wall = sum(r.wall_seconds) / len(r.wall_seconds)
        se = "" if r.kl_se is None else f"{r.kl_se:.2g}"
        lines.append(
            f"| {r.name} | {r.memory_ratio:.3f} | {r.memory_ratio_max:.3f} | {r.memory_bytes:,} | {r.kl:.4g} "
            f"| {se} | {r.kl_worst_share:.0%} "
            f"| {r.top1:.3f} | {r.ppl:.3f} | {r.decode_time_ratio:.2f}x | {wall:.1f} | {'*' if r.pareto else ''} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------ needle
@dataclass
class NeedleRow:
    name: str
    family: str
    kind: str
    source: str | None
    ratio_target: float | None
    accuracy: float  # over every task run
    accuracy_by_length: dict[str, float]  # context_tokens -> fraction of tasks whose reply contains the answer
    full_accuracy_by_length: dict[str, float]  # the full cache's on the same tasks
    tasks_by_length: dict[str, int]
    memory_bytes: int  # cache bytes right after the context's prefill (mean per task)
    full_bytes: int  # uncompressed bytes of the same tokens, model dtype (mean per task)
    memory_ratio: float  # sum of bytes / sum of full bytes, every task
    memory_ratio_by_length: dict[str, float]
    seconds_per_task_by_length: dict[str, float]  # wall time: prefill, question, decode
    tasks: list[dict]  # per task: context_tokens, depth, answer, reply, correct, prefill_tokens, memory_ratio, seconds
    pareto: bool  # on the (memory ratio, 1 - accuracy) front of this run
    spec: dict | None

    def as_dict(self) -> dict:
        return asdict(self)


def needle_texts(tokenizer, task: dict) -> tuple[str, str]:
    """(text prefilled and compressed: the chat-formatted prompt up to the end of the context, text fed afterwards:
    question + assistant header)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the needle protocol formats its prompt with the tokenizer's chat template; this one has none")
    content = f"{task['context']}\n\n{task['question']}"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    cut = text.index(content) + len(task["context"])
    return text[:cut], text[cut:]


def needle_prompt(tokenizer, task: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`needle_texts` as token ids (each part tokenized on its own, without special tokens)."""
    context, rest = needle_texts(tokenizer, task)
    return tuple(torch.tensor(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in (context, rest))


def _eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def needle_task(model, tokenizer, task: dict, cache, full_per_token: int, max_new_tokens: int, eos: set[int],
                after_context=None) -> dict:
    """One needle task on ``cache``: the context prefilled, then ``after_context(cache)`` if given (a diagnostic's
    change to what the cache holds), the question fed, the reply decoded greedily."""
    from kvstack.stack.apply import cache_kwarg

    name = cache_kwarg(model)
    start = time.perf_counter()
    device = next(model.parameters()).device
    context, question = (ids.to(device) for ids in needle_prompt(tokenizer, task))
    _step(model, context, 0, cache, name)
    if after_context is not None:
        after_context(cache)
    held = _cache_bytes(cache)
    full = full_per_token * context.shape[0]
    logits = _step(model, question, context.shape[0], cache, name)[-1]
    position = context.shape[0] + question.shape[0]
    reply = []
    for i in range(max_new_tokens):
        token = int(logits.argmax())
        if token in eos:
            break
        reply.append(token)
        if i + 1 < max_new_tokens:
            logits = _step(model, torch.tensor([token], device=device), position, cache, name)[-1]
            position += 1
    text = tokenizer.decode(reply, skip_special_tokens=True)
    return {
        "context_tokens": task["context_tokens"],
        "depth": task.get("depth"),
        "answer": str(task["answer"]),
        "reply": text,
        "correct": str(task["answer"]) in text,
        "prefill_tokens": int(context.shape[0]),
        "question_tokens": int(question.shape[0]),
        "memory_bytes": held,
        "full_bytes": full,
        "memory_ratio": held / full,
        "seconds": time.perf_counter() - start,
    }


def run_needle(
    model,
    tokenizer,
    tasks: list[dict],
    presets: list[str],
    *,
    ratios=DEFAULT_RATIOS,
    max_new_tokens: int = NEEDLE_NEW_TOKENS,
    progress: bool = True,
) -> RealModelResult:
    """The ``needle`` protocol (module docstring) for the full cache and every preset run."""
    measured_with = harness.versions()  # at the start: the code the rows come from
    runs = _runs(model, presets, ratios)
    full_per_token = full_cache_bytes(model.config, 1, dtype=models.model_dtype(model))
    eos = _eos_ids(model, tokenizer)
    lengths = sorted({t["context_tokens"] for t in tasks})
    measured = []
    bar = _bar(len(runs) * len(tasks), "needle", progress)
    for run in runs:
        bar.set_postfix_str(run.name)
        per = []
        with _stack(model, run) as new_cache:
            for task in tasks:
                with torch.inference_mode():
                    per.append(needle_task(model, tokenizer, task, new_cache(), full_per_token, max_new_tokens, eos))
                bar.update()
        measured.append((run, per))
    bar.close()

    def by_length(per, fn):
        return {str(n): fn([m for m in per if m["context_tokens"] == n]) for n in lengths}

    def accuracy(items):
        return sum(m["correct"] for m in items) / len(items)

    def ratio(items):
        return sum(m["memory_bytes"] for m in items) / sum(m["full_bytes"] for m in items)

    full_by_length = by_length(measured[0][1], accuracy)
    rows = []
    for run, per in measured:
        fields_ = _run_fields(run)
        rows.append(
            NeedleRow(
                **{k: v for k, v in fields_.items() if k != "spec"},
                accuracy=accuracy(per),
                accuracy_by_length=by_length(per, accuracy),
                full_accuracy_by_length=full_by_length,
                tasks_by_length=by_length(per, len),
                memory_bytes=sum(m["memory_bytes"] for m in per) // len(per),
                full_bytes=sum(m["full_bytes"] for m in per) // len(per),
                memory_ratio=ratio(per),
                memory_ratio_by_length=by_length(per, ratio),
                seconds_per_task_by_length=by_length(per, lambda items: sum(m["seconds"] for m in items) / len(items)),
                tasks=per,
                pareto=False,
                spec=fields_["spec"],
            )
        )
    for row, flag in zip(rows, harness.pareto_flags([(r.memory_ratio, 1 - r.accuracy) for r in rows])):
        row.pareto = flag
    metadata = _metadata(
        model, presets, ratios, measured_with, protocol="needle", tasks=len(tasks), lengths=lengths,
        max_new_tokens=max_new_tokens, prompt=NEEDLE_PROMPT,
        scoring="a task counts when `answer` appears in the greedy reply (EOS stops it)",
    )  # fmt: skip
    return RealModelResult(rows, metadata)


def needle(
    model_source: str | Path | None = None,
    data: str | Path | None = None,
    presets: list[str] = ("identity",),
    out: str | Path = "runs/needle",
    *,
    tasks_per_length: int = NEEDLE_TASKS,
    lengths=NEEDLE_LENGTHS,
    task_indices: list[int] | None = None,
    include_8k: bool = False,
    ratios=DEFAULT_RATIOS,
    max_new_tokens: int = NEEDLE_NEW_TOKENS,
    dtype=None,
    device: str | torch.device = "cpu",
    threads: int | None = None,
    progress: bool = True,
) -> RealModelResult:
    """Load the model (a local path or a Hub id, on ``device``) and tasks, :func:`run_needle`, and write
    ``needle.json`` and ``needle_accuracy_vs_memory.png`` into ``out``. 8000-token tasks run only with
    ``include_8k``; ``task_indices`` runs those tasks of each length (0-based, file order) instead of the first
    ``tasks_per_length``, e.g. to rerun the ones a stack missed."""
    presets = list(presets)
    model_source = model_source if model_source is not None else model_path()
    data = Path(data) if data is not None else needle_data_path()
    _check_presets(presets, ratios)
    lengths = [int(n) for n in lengths]
    if LONG_NEEDLE_LENGTH in lengths and not include_8k:
        raise ValueError(f"context length {LONG_NEEDLE_LENGTH} runs only with include_8k (CLI: --include-8k)")
    if include_8k and LONG_NEEDLE_LENGTH not in lengths:
        lengths.append(LONG_NEEDLE_LENGTH)
    tasks = load_needle_tasks(data, tasks_per_length, lengths, task_indices)
    for n in lengths:
        found = sum(t["context_tokens"] == n for t in tasks)
        if task_indices is None and found < tasks_per_length:
            raise ValueError(f"{data} holds {found} tasks at context_tokens={n}; {tasks_per_length} were asked for")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is not allowed: at least 1")
    with _threads(threads):
        model, tokenizer = models.load_causal_lm(model_source, dtype=dtype, device=device)
        result = run_needle(model, tokenizer, tasks, presets, ratios=ratios, max_new_tokens=max_new_tokens,
                            progress=progress)
    result.metadata = models.describe_source(model_source) | {"data": str(data)} | result.metadata
    if task_indices is not None:
        result.metadata["task_indices"] = list(task_indices)
    result.files["json"] = str(_write(result, out, NEEDLE_FILE))
    try:
        path = plot_accuracy_vs_memory([r.as_dict() for r in result.rows], Path(out) / NEEDLE_PLOT,
                                       title=f"{result.metadata['model']} ({result.metadata['model_dtype']}), needle")
    except ImportError:
        result.files["plot"] = None
        result.files["plot_skipped"] = "matplotlib is not installed (pip install 'kvstack[plot]')"
        return result
    result.files["plot"] = str(path)
    return result


def plot_accuracy_vs_memory(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """One panel per context length: accuracy against the memory ratio after the context, one curve per preset
    family, the full cache as a star (same Agg-canvas approach as :mod:`kvstack.bench.plot`). Needs matplotlib."""
    from collections import defaultdict

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lengths = list(rows[0]["accuracy_by_length"])
    fig = Figure(figsize=(4 * len(lengths) + 1, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(lengths), sharey=True, squeeze=False)[0]
    families: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        families[row["family"]].append(row)
    for ax, length in zip(axes, lengths):
        for family, members in families.items():
            members = sorted(members, key=lambda r: r["memory_ratio_by_length"][length])
            xs = [r["memory_ratio_by_length"][length] for r in members]
            ys = [r["accuracy_by_length"][length] for r in members]
            if members[0]["kind"] == "baseline":
                ax.scatter(xs, ys, marker="*", s=120, zorder=3, label=family)
            else:
                ax.plot(xs, ys, marker="o", linewidth=1.5, label=family)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{length} tokens of context")
        ax.set_xlabel("memory ratio after the context")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("needle accuracy (answer in the greedy reply)")
    axes[-1].legend(fontsize=8, loc="best")
    fig.suptitle(title or "needle accuracy vs. memory")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def needle_table(rows: list[NeedleRow]) -> str:
    lengths = list(rows[0].accuracy_by_length) if rows else []
    head = " | ".join(f"acc@{n} (full)" for n in lengths)
    lines = [
        f"| stack | memory ratio | {head} | s/task | front |",
        "| --- | ---: | " + " | ".join("---:" for _ in lengths) + " | ---: | :---: |",
    ]
    for r in rows:
        accs = " | ".join(f"{r.accuracy_by_length[n]:.2f} ({r.full_accuracy_by_length[n]:.2f})" for n in lengths)
        secs = sum(m["seconds"] for m in r.tasks) / len(r.tasks)
        lines.append(f"| {r.name} | {r.memory_ratio:.3f} | {accs} | {secs:.1f} | {'*' if r.pareto else ''} |")
    return "\n".join(lines)
