"""Tiers: where a layer's tokens live.

A layer holds an ordered list of *exact tiers* (every stored token has its own key/value, at full or reduced
precision/width, and its absolute position) and at most one *state tier* (constant-size summary of tokens that left
the exact tiers, e.g. the LESS low-rank state). The layer's attention engine (``kvstack/stack/engine.py``) reads each
exact tier one key block at a time (``attention_block``: dequantized or widened temporaries of that block only) and
the state tier's log-denominator and value readout, and merges them under one normaliser. Quantized and channel-pruned tiers subclass :class:`ExactTier` in their stage files.

Shapes: batch first everywhere (so beam search reorders with one ``index_select``); keys ``[B, Hkv, T, Dk]``;
positions ``[B, Hp, T]`` int32 with ``Hp`` 1 (all heads hold the same tokens) or ``Hkv`` (head-wise selection);
position ``-1`` marks an empty or padding slot that attention never sees and eviction never keeps.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvstack.kernels.tiered_attention import FullTierData

from .memory import POSITION_DTYPE

EMPTY = -1


class Tier:
    """Anything a layer stores. Subclasses list their tensors in ``_tensor_names``."""

    name = "tier"
    _tensor_names: tuple[str, ...] = ()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: t for n in self._tensor_names if (t := getattr(self, n, None)) is not None}

    def memory_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to every tensor (batch is dim 0): beam reorder, batch select, repeat, device moves."""
        for n, t in self.tensors().items():
            setattr(self, n, fn(t))


class ExactTier(Tier):
    """Tokens stored one by one. Subclasses implement the storage layout; the interface is what attention needs.

    ``token_data`` holds per-token bookkeeping of the stages ([B, Hp or Hkv, T] tensors, e.g. H2O's accumulated
    attention): it moves with its tokens through ``select`` and is counted in the tier's memory.
    """

    positions: torch.Tensor | None = None
    token_data: dict[str, torch.Tensor]

    def tensors(self) -> dict[str, torch.Tensor]:
        out = super().tensors()
        out.update({f"token_data.{k}": v for k, v in getattr(self, "token_data", {}).items()})
        return out

    def map_batch(self, fn) -> None:
        for n in self._tensor_names:
            if (t := getattr(self, n, None)) is not None:
                setattr(self, n, fn(t))
        self.token_data = {k: fn(v) for k, v in self.token_data.items()}

    def _append_token_data(self, n: int, records: dict[str, torch.Tensor] | None = None) -> None:
        """Extend every per-token record by n tokens: their incoming records, else zeros."""
        records = records or {}
        for k, v in self.token_data.items():
            new = records.get(k)
            if new is None:
                new = v.new_zeros(*v.shape[:-1], n)
            if new.shape[1] != v.shape[1]:
                width = max(new.shape[1], v.shape[1])
                new, v = new.expand(-1, width, -1), v.expand(-1, width, -1)
            self.token_data[k] = torch.cat([v, new.to(v.dtype)], dim=-1)
        for k, new in records.items():  # a record this tier did not have yet: earlier tokens start at zero
            if k not in self.token_data:
                old = new.new_zeros(*new.shape[:-1], self.num_tokens - n)
                self.token_data[k] = torch.cat([old, new], dim=-1)

    def _select_token_data(self, index: torch.Tensor) -> None:
        for k, v in self.token_data.items():
            self.token_data[k] = gather_records(v, index)

    @property
    def num_tokens(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def valid(self) -> torch.Tensor:
        """[B, Hp, T] bool: slots holding a real (non-padding) token."""
        return self.positions >= 0

    #: key blocks handed to attention start at multiples of this many slots (quantized tiers: one key group)
    block_align: int = 1

    def attention_query(self, query: torch.Tensor) -> torch.Tensor:
        """query [B, Hkv, M, D] -> the query as this tier's keys read it (a channel-pruned tier keeps its channels)."""
        return query

    def attention_block(self, start: int, stop: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, Hkv, n, Dk'] (the channels ``attention_query`` keeps) and values [B, Hkv, n, Dv] (full width, in
        the basis ``attention_output`` maps back) of slots ``start:stop`` in ``dtype``, dequantized when the tier is
        quantized: temporaries of one key block, so attention never holds a dequantized copy of the whole tier.
        ``start`` is a multiple of ``block_align``."""
        raise NotImplementedError

    def attention_output(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., Dv] in the basis of ``attention_block``'s values -> the model's basis. Linear, so attention
        maps its weighted sum of a tier's values once instead of every value (a rotated tier un-rotates there)."""
        return x

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (full precision, model dtype) of the slots ``index`` [B, Hi, K] (Hi 1 or Hkv)."""
        raise NotImplementedError

    def select(self, index: torch.Tensor, slot_valid: torch.Tensor) -> None:
        """Keep only slots ``index`` [B, Hi, K] (ascending per row); slots with ``slot_valid`` False become empty."""
        raise NotImplementedError

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        records: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add tokens at the end. ``records``: their per-token records when they come from another tier (missing
        records start at zero)."""
        raise NotImplementedError

    def bytes_per_token(self) -> float:
        """Current cost of one more token per (batch row, all KV heads): drives ratio budgets."""
        raise NotImplementedError

    def kernel_data(self):
        """This tier's tensors in a layout the fused decode kernel reads (``kvstack.kernels.tiered_attention``),
        or None when the kernel does not cover this tier (attention then takes the torch path)."""
        return None

    def keep_key_channels(self, index: torch.Tensor, head_dim: int) -> bool:
        """Store only the key channels ``index`` [B, Hkv, Dk'] (of ``head_dim``) of this tier's tokens, now and for
        tokens appended later (``kind: channel_prune`` narrowing a reduced-precision tier); ``gather`` still returns
        full-width keys (zeros in the dropped channels). False: this tier cannot, and the caller keeps pruned tokens
        elsewhere."""
        return False


def take_channels(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """x [B, H, T, D] -> the channels ``index`` [B, H, D'] of every token (None: all)."""
    if index is None:
        return x
    return x.gather(-1, index[:, :, None, :].expand(-1, -1, x.shape[2], -1))


def widen_channels(x: torch.Tensor, index: torch.Tensor | None, width: int) -> torch.Tensor:
    """Inverse of :func:`take_channels`: kept channels back at their places, zeros elsewhere."""
    if index is None:
        return x
    out = x.new_zeros(*x.shape[:-1], width)
    return out.scatter(-1, index[:, :, None, :].expand(-1, -1, x.shape[2], -1), x)


def gather_records(data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-token records [B, Hd, T] at slots ``index`` [B, Hi, K]; a width-1 side is shared by every head (a record
    kept per KV head survives a selection made for all heads at once)."""
    width = max(data.shape[1], index.shape[1])
    return data.expand(-1, width, -1).gather(-1, index.expand(-1, width, -1))


def expand_heads(index: torch.Tensor, heads: int) -> torch.Tensor:
    return index if index.shape[1] == heads else index.expand(-1, heads, -1)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], index [B, Hi, K] -> [B, H, K, D]."""
    index = expand_heads(index, x.shape[1])
    return x.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))


def bytewise(fn, t: torch.Tensor, *args):
    """``fn(t, *args)`` for an index op (gather); float8 tensors move as their bytes (torch has no float8 gather on
    the CPU)."""
    if t.is_floating_point() and t.element_size() == 1:
        return fn(t.view(torch.uint8), *args).view(t.dtype)
    return fn(t, *args)


def select_positions(positions: torch.Tensor, index: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
    if index.shape[1] != positions.shape[1]:
        positions = positions.expand(-1, index.shape[1], -1)
    kept = positions.gather(2, index)
    return torch.where(slot_valid, kept, torch.full_like(kept, EMPTY))


class FullTier(ExactTier):
    """Full-precision tokens (sinks, recent window, kept heavy hitters): plain tensors in the model dtype."""

    name = "full"
    _tensor_names = ("keys", "values", "positions")

    def __init__(self) -> None:
        self.token_data = {}
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def initialize(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        b, h, _, dk = keys.shape
        self.keys = keys.new_empty(b, h, 0, dk)
        self.values = values.new_empty(b, h, 0, values.shape[-1])
        self.positions = torch.empty(b, 1, 0, dtype=POSITION_DTYPE, device=keys.device)

    def append(self, keys, values, positions, records=None) -> None:
        if positions.shape[1] != self.positions.shape[1]:
            hp = max(positions.shape[1], self.positions.shape[1])
            positions = positions.expand(-1, hp, -1)
            self.positions = self.positions.expand(-1, hp, -1)
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)
        self.positions = torch.cat([self.positions, positions], dim=-1)
        self._append_token_data(keys.shape[-2], records)

    def attention_block(self, start, stop, dtype):
        return self.keys[:, :, start:stop].to(dtype), self.values[:, :, start:stop].to(dtype)

    def gather(self, index):
        return gather_tokens(self.keys, index), gather_tokens(self.values, index)

    def kernel_data(self):
        return FullTierData(self.keys, self.values, self.positions)

    def select(self, index, slot_valid):
        self.keys = gather_tokens(self.keys, index)
        self.values = gather_tokens(self.values, index)
        self.positions = select_positions(self.positions, index, slot_valid)
        self._select_token_data(index)

    def bytes_per_token(self) -> float:
        h = self.keys.shape[1]
        return (
            h * (self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size())
            + self.positions.shape[1] * self.positions.element_size()
        )


class StateTier(Tier):
    """Constant-size summary of tokens that left the exact tiers (e.g. the LESS low-rank state)."""

    name = "state"

    @property
    def allocated(self) -> bool:
        """True once the state holds tensors (it is created by the first ``absorb``, not before)."""
        return bool(self.tensors())

    def row_bytes(self) -> int:
        """Bytes of the state per batch row once created (constant: what the budget reserves for it)."""
        raise NotImplementedError

    def prepare(self, query: torch.Tensor, scaling: float) -> None:
        """Called once per forward before attention reads the state, with every query of the forward
        [B, Hkv, G*Q, D] (rows ``(g, q)``, compute dtype) and the attention's scaling."""

    def absorb(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Fold keys/values [B, Hkv, n, D] of evicted tokens in; ``valid`` [B, Hkv, n] False entries are skipped."""
        raise NotImplementedError

    def kernel_data(self, query: torch.Tensor, scaling: float):
        """``StateData`` for the fused decode kernel, None while empty, or False when the kernel does not cover
        this state (attention then takes the torch path)."""
        return False

    def readout(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """query [B, Hkv, M, D] -> (log-denominator [B, Hkv, M] on the scale of the exact logits,
        value [B, Hkv, M, Dv]); None while empty."""
        raise NotImplementedError
