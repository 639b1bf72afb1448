"""The adapter between transformers' attention interface and a layer's attention (``StackLayer.attend``).

Registered as ``"kvstack"`` in ``AttentionInterface`` and, as a mask function, in ``AttentionMaskInterface``.

* With a :class:`~kvstack.KVStackCache`, ``update`` has just recorded its layer (``cache.ACTIVE_LAYER``): the
  adapter hands the query to ``layer.attend`` (engine: ``kvstack/stack/engine.py``), which reads every tier,
  merges them under one softmax and compresses afterwards. The mask function builds no mask at all: it passes the
  2-D padding mask through (:class:`StackMask`), because stored positions, not lengths, decide visibility.
* Without one (``use_cache=False``, a loss or perplexity forward, a ``DynamicCache`` passed by the caller), the
  model's original attention runs with the mask its original mask function builds, exactly as before ``apply``.

Transformers can compose the causal mask with an overlay (``or_mask_function`` / ``and_mask_function`` of
``create_causal_mask``: bidirectional image-token blocks, token-type masks, block-wise attention). kvstack's attention
masks by stored positions only (causal, and the layer's sliding window), so a KVStackCache forward whose mask
function would let a query see other keys than that is refused (:class:`CacheUsageError`) instead of being attended
without its overlay; without a KVStackCache the original attention applies the overlay as usual.
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, causal_mask_function, sdpa_mask,
    sliding_window_causal_mask_function,
)
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
        self._overlay: bool | None = None

    def check_no_overlay(self, layer_idx: int) -> None:
        """Refuse a mask function that differs from the causal (sliding-window) mask kvstack builds from positions:
        its overlay would be silently dropped. Checked once per mask (per forward), when a KVStackCache layer
        attends."""
        if self._overlay is None:
            self._overlay = mask_overlay_acts(self._mask_kwargs)
        if self._overlay:
            window = self._mask_kwargs.get("local_size")
            plain = "causal" + (f" within a sliding window of {window}" if window else "")
            raise CacheUsageError(
                f"layer {layer_idx}: this forward's attention mask is not {plain}: the model composed an overlay into "
                "its mask function (transformers' or_mask_function / and_mask_function: image or token-type blocks, "
                "block-wise attention), and kvstack's attention masks by stored token positions only, so it cannot "
                "apply it; run this forward without a KVStackCache (kvstack.remove(model), or use_cache=False), "
                "where the model's own attention applies the overlay (the cache now holds part of this forward: "
                "make a new one with kvstack.cache_for(model))"
            )

    def original(self, implementation: str):
        if implementation not in self._original:
            build = ALL_MASK_ATTENTION_FUNCTIONS[implementation if implementation in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"]
            self._original[implementation] = build(**self._mask_kwargs)
        return self._original[implementation]


def plain_mask_function(window: int | None):
    """The mask function kvstack's attention implements: causal, within ``window`` on a sliding layer."""
    return causal_mask_function if window is None else sliding_window_causal_mask_function(window)


def _closure(function, name: str):
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents


def _is_plain(mask_function, window: int | None) -> bool:
    """Recognise, without evaluating it, the mask function transformers builds when there is no overlay."""
    if window is None:
        return mask_function is causal_mask_function
    parts = _closure(mask_function, "mask_functions")  # sliding: and_masks(sliding_window_overlay(w), causal)
    return (
        isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function
        and getattr(parts[0], "__qualname__", "").startswith("sliding_window_overlay.")
        and _closure(parts[0], "sliding_window") == window
    )


def mask_overlay_acts(mask_kwargs: dict[str, Any]) -> bool:
    """Whether the mask function of a mask call lets some query of this forward see other keys than the plain causal
    (sliding-window) mask does: recognised structurally when transformers composed nothing, else both masks are
    built over this forward's queries and keys (padding aside) and compared."""
    mask_function = mask_kwargs.get("mask_function")
    window = mask_kwargs.get("local_size")
    if mask_function is None or _is_plain(mask_function, window):
        return False
    grid = {name: mask_kwargs[name] for name in ("batch_size", "q_length", "kv_length") if name in mask_kwargs}
    if len(grid) < 3:  # a mask call kvstack does not know the sizes of: only the plain function is known to be safe
        return True
    grid.update(q_offset=mask_kwargs.get("q_offset", 0), kv_offset=mask_kwargs.get("kv_offset", 0),
                device=mask_kwargs.get("device", "cpu"), allow_is_causal_skip=False)
    theirs = sdpa_mask(**grid, mask_function=mask_function, use_vmap=bool(mask_kwargs.get("use_vmap", False)))
    ours = sdpa_mask(**grid, mask_function=plain_mask_function(window))
    return not torch.equal(theirs, ours)


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
    padding = None
    if isinstance(attention_mask, StackMask):
        attention_mask.check_no_overlay(layer.layer_idx)
        padding = attention_mask.padding
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
