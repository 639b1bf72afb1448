"""kvstack's KIVI tier (``kind: quantize``) in vLLM's paged KV cache: the page layout and one request's attention.

Pure torch (no vLLM import): ``quantized.py`` is the vLLM backend around it.

A page of vLLM's pool is one block of ``N`` tokens of one layer. vLLM sizes a packed page as ``N`` cells of
``cell_bytes`` bytes per KV head (its ``state_content_bytes``); this layout fills the ``N * cell_bytes`` bytes of a
(block, KV head) with the tensors kvstack's :class:`~kvstack.stages.quantize.QuantizedTier` holds for those N
tokens, one field after the other::

    key codes [packed(N), D] | key scales [N/G, D] | key zeros [N/G, D]
    | value codes [N, packed(D)] | value scales [N, D/Gv] | value zeros [N, D/Gv]

Keys are grouped per channel over ``G = group_size`` tokens (``G`` divides ``N``, so a block holds whole groups),
values per token. Reading a request's blocks is therefore a concatenation along tokens: the tier tensors of its
quantized tokens, exactly as the stage would hold them (same codes, scales, zero points; positions are implicit).

The stage's full tier — the newest tokens not yet in a whole group beyond ``residual`` (between ``residual`` and
``residual + G - 1`` of them) — stays in full precision outside the pool (:class:`Residual`, per request and layer),
and the step's own new tokens join it. Attention is kvstack's engine (``kvstack.stack.engine.attend``: tiled, one
softmax over both tiers, no tensor that grows with queries x keys); after it the tokens that leave the residual are
quantized by a QuantizedTier (the stage's own code path) and their fields copied into the pages. So a request
computes what ``kind: quantize`` computes in kvstack's transformers cache, step for step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from kvstack.kernels.quant_pack import PACK_UNIT, packed_length
from kvstack.stack.engine import attend
from kvstack.stack.errors import SpecError
from kvstack.stack.memory import POSITION_DTYPE
from kvstack.stack.stats import StatsRequest
from kvstack.stack.tiers import FullTier
from kvstack.stages.quantize import QuantizedTier, QuantizeSpec, TierCodec, value_group_for


@dataclass(frozen=True)
class _Field:
    """One QuantizedTier tensor inside a (block, head) region: rows of ``width`` elements of ``dtype``."""

    name: str
    dtype: torch.dtype
    width: int
    rows_per_token: Fraction  # key codes: bits / 8 (packed along tokens); key scales: 1 / G; values: 1
    offset: int  # bytes into the region

    @property
    def row_bytes(self) -> int:
        return self.width * torch.empty((), dtype=self.dtype).element_size()

    def rows(self, tokens: int) -> int:
        return int(tokens * self.rows_per_token)


class PagedQuantLayout:
    """Where the bytes of ``block_size`` quantized tokens of one KV head go in a vLLM page (module docstring)."""

    def __init__(self, spec: QuantizeSpec, shape, num_kv_heads: int, block_size: int) -> None:
        if spec.bits == 16:
            raise SpecError("stages.0.bits=16 is not a quantized tier: run vLLM without kvstack (the identity)")
        if block_size % spec.group_size:
            raise SpecError(f"block_size={block_size} is not allowed with stages.0.group_size={spec.group_size}: a "
                            "multiple of group_size (a vLLM block holds whole key groups)")
        spec.validate_for(shape, None)
        self.spec, self.shape, self.heads, self.block_size = spec, shape, num_kv_heads, block_size
        self.group = spec.group_size
        self.value_group = value_group_for(spec.value_group_size, spec.group_size, shape)
        scale = spec.scale_torch_dtype() or shape.dtype
        dk, dv, bits = shape.head_dim, shape.value_dim, spec.bits
        codes_per_unit, unit_bytes = PACK_UNIT[bits]
        fields, offset = [], 0
        for name, dtype, width, per_token in (
            ("key_codes", torch.uint8, dk, Fraction(unit_bytes, codes_per_unit)),
            ("key_scale", scale, dk, Fraction(1, self.group)),
            ("key_zero", scale, dk, Fraction(1, self.group)),
            ("value_codes", torch.uint8, packed_length(dv, bits), Fraction(1)),
            ("value_scale", scale, dv // self.value_group, Fraction(1)),
            ("value_zero", scale, dv // self.value_group, Fraction(1)),
        ):
            field = _Field(name, dtype, width, per_token, offset)
            fields.append(field)
            offset += field.rows(block_size) * field.row_bytes
        self.fields = tuple(fields)
        self.region_bytes = offset
        #: bytes per token and KV head of a page (vLLM's ``state_content_bytes``); the last < 1 byte is padding
        self.cell_bytes = math.ceil(offset / block_size)

    @classmethod
    def from_config(cls, spec: QuantizeSpec, config, dtype: torch.dtype, num_kv_heads: int,
                    block_size: int) -> "PagedQuantLayout":
        """The layout on a model of transformers ``config`` in ``dtype`` (``num_kv_heads``: this rank's)."""
        from kvstack.stack.shape import ModelShape

        return cls(spec, ModelShape.from_config(config, dtype), num_kv_heads, block_size)

    # ------------------------------------------------------------------------------------------ sizes
    @property
    def full_cell_bytes(self) -> int:
        """Bytes per token and KV head of an uncompressed page (keys and values in the model dtype)."""
        itemsize = torch.empty((), dtype=self.shape.dtype).element_size()
        return (self.shape.head_dim + self.shape.value_dim) * itemsize

    @property
    def page_ratio(self) -> float:
        """A quantized page's bytes / an uncompressed page's: the pool holds 1 / page_ratio times the blocks."""
        return self.cell_bytes / self.full_cell_bytes

    def quantized_count(self, seen: int) -> int:
        """Tokens in the pages after ``seen`` tokens (the stage's flush: whole groups beyond the residual)."""
        return max(0, (seen - self.spec.residual) // self.group) * self.group

    def residual_bytes(self, seen: int) -> int:
        """Full-precision bytes of one layer's residual after ``seen`` tokens (outside vLLM's pool)."""
        return (seen - self.quantized_count(seen)) * self.heads * self.full_cell_bytes

    # ------------------------------------------------------------------------------------------ pages
    def codec(self, layer_idx: int) -> TierCodec:
        return self.spec.codec(self.shape, layer_idx)

    def new_tier(self, codec: TierCodec, layer_idx: int) -> QuantizedTier:
        return QuantizedTier(self.spec.bits, self.group, self.value_group, self.shape.dtype,
                             label=f"layer {layer_idx}, quantize (vLLM)", name="quantized", codec=codec)

    def read(self, pages: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, codec: TierCodec,
             layer_idx: int, positions: torch.Tensor | None = None) -> QuantizedTier:
        """The tier of a request's ``num_tokens`` held quantized tokens (a multiple of G), from its held blocks
        ``block_ids`` [>= ceil(num_tokens / N)] of ``pages`` [num_blocks, H, N, cell_bytes] uint8, in order;
        ``positions`` [num_tokens]: their logical positions (default 0, 1, ...: no block evicted)."""
        n_blocks = -(-num_tokens // self.block_size)
        region = pages.index_select(0, block_ids[:n_blocks]).reshape(n_blocks, self.heads, -1)
        tier = self.new_tier(codec, layer_idx)
        for f in self.fields:
            per_block = f.rows(self.block_size)
            x = region[:, :, f.offset : f.offset + per_block * f.row_bytes]
            x = x.reshape(n_blocks, self.heads, per_block, f.row_bytes).transpose(0, 1)
            x = x.reshape(1, self.heads, n_blocks * per_block, f.row_bytes)[:, :, : f.rows(num_tokens)]
            setattr(tier, f.name, x.contiguous().view(f.dtype))
        if positions is None:
            positions = torch.arange(num_tokens, device=pages.device)
        tier.positions = positions.to(POSITION_DTYPE)[None, None]
        return tier

    def write(self, pages: torch.Tensor, block_ids: torch.Tensor, tier: QuantizedTier, first: int) -> None:
        """Copy ``tier`` (the request's tokens ``first ...``, whole groups, ``first`` a multiple of G) into the
        request's blocks ``block_ids`` (its logical block table)."""
        n, bs = tier.num_tokens, self.block_size
        sources = {f.name: getattr(tier, f.name).view(torch.uint8)[0] for f in self.fields}  # [H, rows, bytes]
        t = first
        while t < first + n:
            lo = t % bs
            hi = min(bs, lo + first + n - t)
            region = pages[int(block_ids[t // bs])].view(self.heads, -1)  # a view: writes land in the pool
            for f in self.fields:
                src = sources[f.name][:, f.rows(t - first) : f.rows(t - first + hi - lo)]
                start = f.offset + f.rows(lo) * f.row_bytes
                region[:, start : start + src.shape[1] * f.row_bytes] = src.reshape(self.heads, -1)
            t += hi - lo


class Residual:
    """The full-precision tokens of each (request, layer) that are not in pages yet: the stage's full tier."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], tuple[int, torch.Tensor, torch.Tensor]] = {}

    def get(self, request: str, layer: int, start: int, seen: int, keys: torch.Tensor, values: torch.Tensor):
        """(keys, values) [H, seen - start, D] of tokens ``start .. seen - 1`` (``keys`` / ``values`` [n, H, D]:
        the step's, for the empty case)."""
        held = self._held.get((request, layer))
        if held is None or seen == 0:  # a new request, or one that restarts from its first token (preempted)
            if start != seen:
                raise RuntimeError(f"kvstack: request {request!r}, layer {layer}: tokens {start}..{seen} are not "
                                   "in the residual")
            empty = lambda x: x.new_empty(x.shape[1], 0, x.shape[2])  # noqa: E731
            return empty(keys), empty(values)
        first, held_keys, held_values = held
        if first != start or first + held_keys.shape[1] != seen:
            raise RuntimeError(f"kvstack: request {request!r}, layer {layer}: the residual holds tokens "
                               f"{first}..{first + held_keys.shape[1]}, the step needs {start}..{seen}")
        return held_keys, held_values

    def put(self, request: str, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._held[(request, layer)] = (start, keys.clone(), values.clone())  # not views of the step's tensors

    def drop(self, requests) -> None:
        gone = set(requests)
        for key in [k for k in self._held if k[0] in gone]:
            del self._held[key]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for _, k, v in self._held.values())


class _EngineLayer:
    """What ``kvstack.stack.engine.attend`` reads of a cache layer: one request's tiers for one step."""

    state = None

    def __init__(self, tiers, full: FullTier, seen: int, heads: int) -> None:
        self.tiers, self.full, self.seen, self._heads = tiers, full, seen, heads

    def shape_heads(self) -> int:
        return self._heads


def request_attention(
    layout: PagedQuantLayout,
    codec: TierCodec,
    layer_idx: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    seen: int,
    residual: tuple[torch.Tensor, torch.Tensor],
    *,
    scaling: float,
    softcap: float | None,
    evicted: "set[int] | frozenset[int]" = frozenset(),
) -> tuple[torch.Tensor, tuple[int, torch.Tensor, torch.Tensor]]:
    """One request's step on one layer: attention of ``query`` [n, Hq, D] (the step's tokens, after ``seen``
    tokens) over its quantized pages, its residual (keys, values [H, r, D]) and the step's ``keys`` / ``values``
    [n, H, D]; then the tokens that leave the residual are quantized into the pages. ``block_ids``: the request's
    logical block table; ``evicted``: the logical indices of its blocks freed by block eviction (whole blocks,
    every one wholly in the pages), which attention skips.

    Returns (output [n, Hq, Dv], (first position, keys, values) of the new residual)."""
    n = query.shape[0]
    before, after = layout.quantized_count(seen), layout.quantized_count(seen + n)
    full = FullTier()
    full_keys = torch.cat([residual[0], keys.transpose(0, 1)], dim=1)[None]  # [1, H, r + n, D]
    full_values = torch.cat([residual[1], values.transpose(0, 1)], dim=1)[None]
    full.initialize(full_keys, full_values)
    positions = torch.arange(before, seen + n, dtype=POSITION_DTYPE, device=query.device)[None, None]
    full.append(full_keys, full_values, positions)
    tiers = [full]
    bs, n_blocks = layout.block_size, -(-before // layout.block_size)
    held = (torch.tensor([j for j in range(n_blocks) if j not in evicted], dtype=torch.long) if evicted
            else torch.arange(n_blocks))
    if held.numel():  # evicted blocks are whole, so only the newest held block may be partly in the pages
        count = before - (n_blocks - held.numel()) * bs
        pos = (held[:, None] * bs + torch.arange(bs)).flatten()[:count].to(query.device)
        tiers.append(layout.read(pages, block_ids[held.to(block_ids.device)], count, codec, layer_idx, pos))
    out, _ = attend(_EngineLayer(tiers, full, seen + n, layout.heads), query.transpose(0, 1)[None], StatsRequest(),
                    padded=False, scaling=scaling, softcap=softcap, sliding_window=None)
    leaving = after - before
    if leaving:
        tier = layout.new_tier(codec, layer_idx)
        tier.append(full_keys[:, :, :leaving], full_values[:, :, :leaving], positions[..., :leaving])
        layout.write(pages, block_ids, tier, before)
    return out[0].transpose(0, 1), (after, full_keys[0, :, leaving:], full_values[0, :, leaving:])
