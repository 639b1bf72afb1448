"""The quality protocol every kvstack number uses (docs/evaluation.md; same as kvpress's comparison numbers).

Per passage: ``ids = tokenizer(text).input_ids[:512]``; the reference is ONE forward of the whole sequence with no
compression (``log_softmax`` in float64 of the logits at positions ``prefix-1 .. len-2``); the compressed run
prefills ``ids[:prefix]`` into the stack's cache (the stack compresses as its spec says), takes the distribution at
the last prefix position, then feeds the remaining tokens ONE at a time with explicit absolute ``position_ids``.
Metrics over all predicted positions of all passages: KL(reference || compressed) in nats per token, top-1
agreement with the reference, perplexity of the true next tokens; memory is the cache's bytes right after the
prefix over the bytes of an uncompressed cache of the same tokens in the model's dtype.

``protocol="decode"`` compresses while decoding instead: only ``ids[:decode_prefill]`` is prefilled and every later
token is fed one at a time, so the stack compresses the whole sequence step by step. The predicted positions, the
memory point (``prefix`` tokens seen) and the timed part (positions ``prefix..``) are the same as for ``prefill``,
so the two protocols' numbers are directly comparable.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DEFAULT_MODEL = "../shared/models/stories260K"
DEFAULT_DATA = "../shared/data/stories260K-samples-dev.jsonl"
PROTOCOLS = ("prefill", "decode")


def model_path() -> Path:
    return Path(os.environ.get("KVSTACK_MODEL", DEFAULT_MODEL))


def data_path() -> Path:
    return Path(os.environ.get("KVSTACK_DATA", DEFAULT_DATA))


def load_passages(path: str | Path | None = None, n: int | None = 32) -> list[str]:
    """The first ``n`` passages (``{"text": ...}`` per line) of a JSONL file (default: the dev passages)."""
    path = Path(path) if path is not None else data_path()
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    return texts[:n] if n else texts


def passage_ids(model, tokenizer, passages: list[str], max_len: int) -> list[torch.Tensor]:
    """Each passage's first ``max_len`` token ids, on the model's device."""
    device = next(model.parameters()).device
    return [torch.tensor(tokenizer(text)["input_ids"][:max_len], device=device) for text in passages]


def load_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)


@dataclass
class QualityResult:
    name: str
    kl: float  # nats per predicted token, KL(reference || compressed)
    top1: float  # fraction of positions whose argmax matches the reference
    ppl: float  # perplexity of the true next tokens under the compressed run
    memory_ratio: float  # cache bytes after the prefix / uncompressed bytes of the same tokens
    memory_bytes: int
    full_bytes: int
    positions: int
    decode_seconds: float = 0.0  # wall time of the token-by-token part (for ratios within one run only)
    per_passage_kl: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """float64 log-probabilities [len - prefix, vocab] predicting positions prefix..len-1, no compression."""
    from kvstack.stack.apply import APPLIED_ATTR

    if getattr(model, APPLIED_ATTR, None) is not None:
        raise RuntimeError("reference_logprobs needs the unmodified model (call kvstack.remove first)")
    logits = model(ids[None]).logits[0, prefix - 1 : -1]
    return torch.log_softmax(logits.double(), dim=-1)


@torch.no_grad()
def compressed_logprobs(
    model, ids: torch.Tensor, prefix: int, cache, *, protocol: str = "prefill", decode_prefill: int = 16
) -> tuple[torch.Tensor, int, float]:
    """Prefill ``ids[:prefix]`` into ``cache`` (``decode``: only ``ids[:decode_prefill]``, then one token at a time up
    to the prefix), then one token at a time. Returns (logprobs, bytes after prefix, decode seconds)."""
    from kvstack.stack.apply import cache_kwarg

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is not allowed: one of {', '.join(PROTOCOLS)}")
    if protocol == "decode" and not 0 < decode_prefill < prefix:
        raise ValueError(f"decode_prefill={decode_prefill} is not allowed: 0 < decode_prefill < prefix ({prefix})")
    name = cache_kwarg(model)
    first = decode_prefill if protocol == "decode" else prefix
    out = model(ids[None, :first], **{name: cache})
    for p in range(first, prefix):
        out = model(ids[None, p : p + 1], position_ids=torch.tensor([[p]], device=ids.device), **{name: cache})
    rows = [out.logits[0, -1]]
    memory = cache.memory_bytes() if hasattr(cache, "memory_bytes") else _dynamic_bytes(cache)
    _sync(ids.device)
    start = time.perf_counter()
    for p in range(prefix, ids.shape[0] - 1):
        out = model(ids[None, p : p + 1], position_ids=torch.tensor([[p]], device=ids.device), **{name: cache})
        rows.append(out.logits[0, -1])
    _sync(ids.device)  # CUDA runs asynchronously: the time is the forwards', not their launches'
    seconds = time.perf_counter() - start
    return torch.log_softmax(torch.stack(rows).double(), dim=-1), memory, seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dynamic_bytes(cache) -> int:
    """Bytes a transformers cache holds: keys/values, and the quantized states of ``QuantizedCache`` layers."""
    names = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(_tensor_bytes(getattr(layer, n, None)) for layer in cache.layers for n in names)


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__"):  # tensor subclasses (quanto's QTensor) hold inner tensors
            return sum(_tensor_bytes(getattr(obj, n)) for n in obj.__tensor_flatten__()[0])
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):  # hqq's quantization metadata (scales, zero points)
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    passages: list[str],
    spec=None,
    *,
    name: str | None = None,
    prefix: int = 384,
    max_len: int = 512,
    make_cache=None,
    references: list[torch.Tensor] | None = None,
    protocol: str = "prefill",
    decode_prefill: int = 16,
) -> QualityResult:
    """Run the protocol for one stack ``spec`` (None: the full ``DynamicCache``), or for caches from
    ``make_cache(model)`` (baselines such as transformers' QuantizedCache). ``references`` may be passed to reuse
    the reference log-probabilities across stacks (``reference_set``). ``protocol``: ``prefill`` (default) or
    ``decode`` (see the module docstring)."""
    import kvstack
    from kvstack.stack.memory import full_cache_bytes
    from transformers import DynamicCache

    ids_list = passage_ids(model, tokenizer, passages, max_len)
    if references is None:
        references = reference_set(model, ids_list, prefix)
    # the uncompressed reference is the model as loaded (before any GQA conversion the stack performs)
    full_per_token = full_cache_bytes(model.config, 1, dtype=next(model.parameters()).dtype)
    if spec is not None:
        kvstack.apply(model, spec)
    try:
        kls, agree, nll, count, mem, full, seconds = [], 0, 0.0, 0, 0, 0, 0.0
        for ids, ref in zip(ids_list, references):
            if spec is not None:
                cache = kvstack.cache_for(model)
            elif make_cache is not None:
                cache = make_cache(model)
            else:
                cache = DynamicCache(config=model.config)
            comp, nbytes, secs = compressed_logprobs(
                model, ids, prefix, cache, protocol=protocol, decode_prefill=decode_prefill
            )
            kl = (ref.exp() * (ref - comp)).sum(-1)
            kls.append(float(kl.mean()))
            agree += int((ref.argmax(-1) == comp.argmax(-1)).sum())
            targets = ids[prefix:]
            nll += float(-comp.gather(-1, targets[:, None]).sum())
            count += kl.numel()
            mem += nbytes
            full += full_per_token * prefix
            seconds += secs
    finally:
        if spec is not None:
            kvstack.remove(model)
    total_kl = sum(k * (len(i) - prefix) for k, i in zip(kls, ids_list)) / count
    label = name or (getattr(kvstack.StackSpec.load(spec), "name", "stack") if spec is not None else "full")
    return QualityResult(
        name=label,
        kl=total_kl,
        top1=agree / count,
        ppl=float(torch.exp(torch.tensor(nll / count))),
        memory_ratio=mem / full,
        memory_bytes=mem // len(ids_list),
        full_bytes=full // len(ids_list),
        positions=count,
        decode_seconds=seconds,
        per_passage_kl=kls,
    )


@torch.no_grad()
def reference_set(model, ids_list: list[torch.Tensor], prefix: int) -> list[torch.Tensor]:
    return [reference_logprobs(model, ids, prefix) for ids in ids_list]
