"""The channel-pruned exact tier: tokens stored with only some key (and optionally value) channels per KV head.

Used by ``kind: channel_prune`` (ThinK, arXiv 2407.21018, and the static calibrated mode). Per (batch row, KV head)
the tier keeps ``key_index`` [B, Hkv, Dk'] — the channels its keys hold — and optionally ``value_index``
[B, Hkv, Dv'] for values. Attention gathers the same channels of the query (``attention_query``), so ``q·k`` is the
sum over the kept channels only; ``attention_block`` scatters the kept value channels of a key block back to the
full width (zeros elsewhere). Both
indices are tensors of the tier: batch-first (beam search reorders them) and counted in ``memory_bytes``.
"""

from __future__ import annotations

import torch

from kvstack.stack.tiers import ExactTier, gather_tokens, select_positions, take_channels, widen_channels

INDEX_DTYPE = torch.int64
INDEX_BYTES = 8


class ChannelPrunedTier(ExactTier):
    name = "channel_pruned"
    _tensor_names = ("keys", "values", "positions", "key_index", "value_index")

    def __init__(self, key_index: torch.Tensor, value_index: torch.Tensor | None, head_dim: int, like: torch.Tensor):
        """``like``: a full-tier key tensor (dtype/device). Indices [B, Hkv, D'] ascending per head; ``head_dim``
        is the full width of keys and values (the core uses one head_dim for both)."""
        self.token_data = {}
        b, h = key_index.shape[:2]
        self.key_index = key_index.to(INDEX_DTYPE)
        self.value_index = None if value_index is None else value_index.to(INDEX_DTYPE)
        self.head_dim = head_dim
        kept_v = head_dim if value_index is None else value_index.shape[-1]
        self.keys = like.new_empty(b, h, 0, key_index.shape[-1])
        self.values = like.new_empty(b, h, 0, kept_v)
        self.positions = torch.empty(b, 1, 0, dtype=torch.int32, device=like.device)

    def attention_query(self, query):
        return take_channels(query, self.key_index)

    def attention_block(self, start, stop, dtype):
        keys = self.keys[:, :, start:stop].to(dtype)
        return keys, widen_channels(self.values[:, :, start:stop].to(dtype), self.value_index, self.head_dim)

    def gather(self, index):
        """Full-width keys/values (pruned channels zero): what a state tier folds in or another tier receives."""
        keys = widen_channels(gather_tokens(self.keys, index), self.key_index, self.head_dim)
        return keys, widen_channels(gather_tokens(self.values, index), self.value_index, self.head_dim)

    def select(self, index, slot_valid):
        self.keys = gather_tokens(self.keys, index)
        self.values = gather_tokens(self.values, index)
        self.positions = select_positions(self.positions, index, slot_valid)
        self._select_token_data(index)

    def append(self, keys, values, positions, records=None) -> None:
        if positions.shape[1] != self.positions.shape[1]:
            hp = max(positions.shape[1], self.positions.shape[1])
            positions = positions.expand(-1, hp, -1)
            self.positions = self.positions.expand(-1, hp, -1)
        self.keys = torch.cat([self.keys, take_channels(keys, self.key_index).to(self.keys.dtype)], dim=-2)
        self.values = torch.cat([self.values, take_channels(values, self.value_index).to(self.values.dtype)], dim=-2)
        self.positions = torch.cat([self.positions, positions], dim=-1)
        self._append_token_data(keys.shape[-2], records)

    def bytes_per_token(self) -> float:
        h = self.keys.shape[1]
        return (
            h * (self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size())
            + self.positions.shape[1] * self.positions.element_size()
        )
