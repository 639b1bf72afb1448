"""Memory accounting: the uncompressed reference, and analytic bounds that stages compose.

Actual bytes are always ``sum(t.nbytes)`` over the tensors a cache holds (see ``KVStackCache.memory_bytes``).
The analytic side is a :class:`MemoryPlan`: per layer, a list of tiers (how many tokens each may hold per batch row
and KV head, and what that many tokens cost) plus constant-size state. Each stage spec transforms the plan in
``plan_memory``; ``StackSpec.memory_bound`` applies them in order and sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .shape import ModelShape

POSITION_DTYPE = torch.int32
POSITION_BYTES = 4


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def full_cache_bytes(config_or_shape, seq_len: int, batch: int = 1, dtype: torch.dtype | None = None) -> int:
    """Bytes of an uncompressed cache (keys + values, every layer, no positions) holding ``seq_len`` tokens.

    ``config_or_shape`` is a transformers config or a :class:`ModelShape`; ``dtype`` defaults to the model's.
    This is the reference all memory ratios divide by.
    """
    shape = config_or_shape if isinstance(config_or_shape, ModelShape) else ModelShape.from_config(config_or_shape)
    dtype = dtype or shape.dtype
    per_token = shape.num_kv_heads * (shape.head_dim + shape.value_dim) * _itemsize(dtype)
    return shape.num_layers * batch * seq_len * per_token


@dataclass
class TierPlan:
    """At most ``tokens`` tokens per (batch row, KV head); ``bytes_for(n)`` is what n such tokens cost per batch row
    (all KV heads of the layer, positions included). ``without_key_channels(c)``, for tiers that can drop key
    channels in place (see ``ExactTier.keep_key_channels``), is ``bytes_for`` once ``c`` key channels per head are
    dropped."""

    name: str
    tokens: int
    bytes_for: Callable[[int], int]
    without_key_channels: Callable[[int], Callable[[int], int]] | None = None

    @property
    def bytes(self) -> int:
        return self.bytes_for(self.tokens)


@dataclass
class LayerPlan:
    tiers: list[TierPlan]
    state_bytes: int = 0  # constant-size state per batch row (low-rank state, channel indices, ...)
    fixed_bytes: int = 0  # per layer, independent of batch (e.g. shared projections)

    def tier(self, name: str) -> TierPlan | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.tiers)


@dataclass
class MemoryPlan:
    """Analytic memory of a stack after ``seq_len`` tokens were seen (state after each forward's compression), of
    which the first ``prefill_len`` came in the first forward (default: all of them) and the rest one per forward."""

    shape: ModelShape
    seq_len: int
    batch: int
    dtype: torch.dtype
    layers: list[LayerPlan] = field(default_factory=list)
    prefill_len: int | None = None

    @classmethod
    def uncompressed(
        cls,
        shape: ModelShape,
        seq_len: int,
        batch: int = 1,
        dtype: torch.dtype | None = None,
        prefill_len: int | None = None,
    ):
        dtype = dtype or shape.dtype
        prefill_len = seq_len if prefill_len is None else min(prefill_len, seq_len)
        plan = cls(shape, seq_len, batch, dtype, prefill_len=prefill_len)
        for window in shape.layer_windows:
            # sliding layers drop what no future query can see: the newest window-1 tokens remain
            tokens = seq_len if window is None else min(seq_len, window - 1)
            plan.layers.append(LayerPlan([TierPlan("full", tokens, full_tier_bytes(shape, dtype))]))
        return plan

    @property
    def bytes(self) -> int:
        per_row = sum(sum(t.bytes for t in layer.tiers) + layer.state_bytes for layer in self.layers)
        return self.batch * per_row + sum(layer.fixed_bytes for layer in self.layers)

    def report(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in self.layers:
            for tier in layer.tiers:
                out[tier.name] = out.get(tier.name, 0) + self.batch * tier.bytes
            if layer.state_bytes:
                out["state"] = out.get("state", 0) + self.batch * layer.state_bytes
        return out


def full_tier_bytes(
    shape: ModelShape,
    dtype: torch.dtype,
    *,
    positions_per_head: bool = False,
    key_dim: int | None = None,
    value_dim: int | None = None,
) -> Callable[[int], int]:
    """Cost of n full-precision tokens in one batch row: keys + values of every KV head, and their positions
    (one int32 per token, or per token and head once heads keep different tokens)."""
    k = shape.head_dim if key_dim is None else key_dim
    v = shape.value_dim if value_dim is None else value_dim
    item = _itemsize(dtype)
    pos_heads = shape.num_kv_heads if positions_per_head else 1

    def cost(n: int) -> int:
        return n * (shape.num_kv_heads * (k + v) * item + pos_heads * POSITION_BYTES)

    return cost
