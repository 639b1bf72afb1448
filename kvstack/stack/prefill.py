"""Chunked prefill: split a long forward into pieces so stages compress between them (bounded peak memory).

The model is run piece by piece on the same cache; each piece sees every earlier token that survived compression,
exactly as a decode step would. Positions stay absolute (the cache counts tokens seen), the 2-D padding mask is cut
to the tokens seen so far, and the logits of the pieces are concatenated (or only the last kept, as asked).
"""

from __future__ import annotations

import functools

import torch

from .cache import KVStackCache
from .errors import CacheUsageError


def wrap_forward(forward, chunk: int | None, cache_name: str):
    """The model's forward, checked for empty inputs on a ``KVStackCache`` and, with ``chunk``, prefilled in pieces."""

    @functools.wraps(forward)
    def chunked_forward(*args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        cache = kwargs.get(cache_name)
        if cache is None:  # the other spelling (past_key_values is deprecated in 5.24 but still accepted)
            cache = kwargs.get("past_key_values" if cache_name == "cache" else "cache")
        source = input_ids if input_ids is not None else embeds
        if not isinstance(cache, KVStackCache) or source is None:
            return forward(*args, **kwargs)
        if source.ndim < 2 or source.shape[1] == 0:
            raise CacheUsageError(
                f"an empty input (input shape {tuple(source.shape)}): give at least one token per sequence"
            )
        if chunk is None or source.shape[1] <= chunk:
            return forward(*args, **kwargs)
        kwargs = dict(kwargs)
        if args:
            kwargs["input_ids"] = args[0]
            args = args[1:]
        if args:
            raise TypeError("kvstack chunked prefill: pass forward arguments after input_ids by keyword")
        return _run_chunks(forward, kwargs, source.shape[1], chunk, cache)

    return chunked_forward


def _run_chunks(forward, kwargs, length: int, chunk: int, cache: KVStackCache):
    mask = kwargs.get("attention_mask")
    positions = kwargs.get("position_ids")
    keep = kwargs.get("logits_to_keep", 0)
    starts = list(range(0, length, chunk))
    # when only the last logits are wanted and they fall in the last piece, earlier pieces compute one row
    tail_only = isinstance(keep, int) and 0 < keep <= length - starts[-1]
    outputs, logits = None, []
    for i, start in enumerate(starts):
        end = min(start + chunk, length)
        last = i == len(starts) - 1
        piece = dict(kwargs)
        for name in ("input_ids", "inputs_embeds"):
            if kwargs.get(name) is not None:
                piece[name] = kwargs[name][:, start:end]
        if mask is not None:
            piece["attention_mask"] = mask[:, : mask.shape[1] - length + end]
        if positions is not None:
            piece["position_ids"] = positions[..., start:end]
        if "logits_to_keep" in kwargs or tail_only:
            piece["logits_to_keep"] = (keep if last else 1) if tail_only else 0
        outputs = forward(**piece)
        logits.append(outputs.logits)
    if tail_only:
        outputs.logits = logits[-1]
    else:
        full = torch.cat(logits, dim=1)
        outputs.logits = full[:, -keep:] if isinstance(keep, int) and keep > 0 else full
    return outputs
