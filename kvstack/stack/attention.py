"""The adapter between transformers' attention interface and a layer's attention (``StackLayer.attend``).

Registered as ``"kvstack"`` in ``AttentionInterface`` and, as a mask function, in ``AttentionMaskInterface``.

* With a :class:`~kvstack.KVStackCache`, ``update`` has just recorded its layer (``cache.ACTIVE_LAYER``): the
  adapter hands the query to ``layer.attend`` (engine: ``kvstack/stack/engine.py``), which reads every tier,
  merges them under one softmax and compresses afterwards. The mask function builds no mask at all: it passes the
  2-D padding mask through (:class:`StackMask`), because stored positions, not lengths, decide visibility.
* Without one (``use_cache=False``, a loss or perplexity forward, a ``DynamicCache`` passed by the caller), the
  model's original attention runs with the mask its original mask function builds, exactly as before ``apply``.
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache import ACTIVE_LAYER
from .errors import CacheUsageError

ATTN_NAME = "kvstack"

#: id(config) -> the attention implementation the model had before ``apply`` (what runs without a KVStackCache)
_ORIGINAL: dict[int, str] = {}


def remember_original(config, implementation: str) -> None:
    """Record the implementation a forward without a KVStackCache falls back to (``kvstack.apply`` calls this)."""
    key = id(config)
    _ORIGINAL[key] = implementation
    weakref.finalize(config, _ORIGINAL.pop, key, None)


def forget_original(config) -> None:
    _ORIGINAL.pop(id(config), None)


def original_implementation(config) -> str:
    return _ORIGINAL.get(id(config), "sdpa")


class StackMask:
    """What the mask interface hands to the attention function: the 2-D padding mask ([B, tokens seen], True = real
    token; None when every token is real) for kvstack's attention, and — built only if a layer falls back to the
    original attention — the mask the original implementation would have made from the same arguments."""

    def __init__(self, padding: torch.Tensor | None, mask_kwargs: dict[str, Any]):
        self.padding = padding
        self._mask_kwargs = mask_kwargs
        self._original: dict[str, Any] = {}

    def original(self, implementation: str):
        if implementation not in self._original:
            build = ALL_MASK_ATTENTION_FUNCTIONS[implementation if implementation in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"]
            self._original[implementation] = build(**self._mask_kwargs)
        return self._original[implementation]


def stack_mask(*, attention_mask=None, **kwargs) -> StackMask:
    padding = None
    if attention_mask is not None:
        if attention_mask.ndim != 2:
            raise CacheUsageError(
                f"kvstack needs a 2-D padding attention_mask [batch, tokens seen]; got shape {tuple(attention_mask.shape)}"
            )
        padding = attention_mask.to(torch.bool)
        if bool(padding.all()):  # one host sync per forward, not per layer
            padding = None
    return StackMask(padding, dict(kwargs, attention_mask=attention_mask))


def stack_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    layer = ACTIVE_LAYER.get()
    # the keys are the very tensor this layer's update returned: the forward runs on a KVStackCache (a stale layer
    # left by an interrupted forward, or another cache's keys, never match)
    if layer is None or not layer.awaiting_attention or key is not layer.full.keys:
        return _original_attention(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap,
            sliding_window=sliding_window, **kwargs,
        )
    layer_idx = getattr(module, "layer_idx", layer.layer_idx)
    if layer.layer_idx != layer_idx:
        raise CacheUsageError(
            f"kvstack attention on layer {layer_idx} received the keys of KVStackCache layer {layer.layer_idx}"
        )
    ACTIVE_LAYER.set(None)
    if dropout and module.training:
        raise CacheUsageError("kvstack attention is for inference: attention dropout must be 0 (call model.eval())")
    if isinstance(attention_mask, torch.Tensor):
        raise CacheUsageError(
            "kvstack attention received a prepared tensor mask; pass a 2-D attention_mask (or none) so kvstack can "
            "build masks from token positions (custom 4-D masks are not supported)"
        )
    padding = attention_mask.padding if isinstance(attention_mask, StackMask) else None
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = layer.attend(query, padding, scaling=scaling, softcap=softcap, sliding_window=sliding_window)
    return out.transpose(1, 2).contiguous(), None  # [B, Hq, Q, Dv] -> [B, Q, Hq, Dv] as transformers expects


def _original_attention(module, query, key, value, attention_mask, **kwargs):
    config = getattr(module, "config", None)
    implementation = original_implementation(config)
    if isinstance(attention_mask, StackMask):
        attention_mask = attention_mask.original(implementation)
    if implementation == "eager" or implementation not in ALL_ATTENTION_FUNCTIONS:
        function = importlib.import_module(type(module).__module__).eager_attention_forward
    else:
        function = ALL_ATTENTION_FUNCTIONS[implementation]
    return function(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Register the attention and mask functions under the name ``"kvstack"`` (idempotent)."""
    AttentionInterface.register(ATTN_NAME, stack_attention)
    AttentionMaskInterface.register(ATTN_NAME, stack_mask)
