"""``KVStackCache``: one transformers ``Cache`` whose layers hold their tokens in tiers.

Data flow of one forward through one layer::

    new k, v ──► StackLayer.update ──► full tier (+ absolute positions) ──► returns stored+new for the queries
                                                                              │
             stack attention (one softmax over every tier + low-rank state) ◄─┘
                                                                              │
             StackLayer.finish_forward: sliding-window drop, then each stage's after_attention
             (evict / demote to a quantized tier / fold into the state), then the budget's check ◄─┘

Contracts with transformers (see docs/architecture.md): ``get_seq_length`` counts tokens SEEN, not kept;
``update`` returns everything the current queries need and nothing is removed before attention ran; masks are
built by the stack's attention function from stored positions, never from lengths.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from . import engine
from .budget import STATE_SHARE, BudgetError, LayerPromise, promise, reference_bytes_per_token
from .errors import CacheUsageError
from .memory import POSITION_DTYPE
from .shape import ModelShape
from .stats import AttentionStats, StatsRequest
from .tiers import EMPTY, ExactTier, FullTier, StateTier, gather_records, select_positions

if TYPE_CHECKING:  # pragma: no cover
    from .base import Stage
    from .spec import StackSpec

#: The handoff between transformers' two calls per layer: ``update`` records its layer here, and the attention call of
#: the same layer, which follows in the same forward, takes it (transformers passes no cache to attention functions).
ACTIVE_LAYER: ContextVar["StackLayer | None"] = ContextVar("kvstack_active_layer", default=None)


class StackLayer(CacheLayerMixin):
    """One decoder layer's cache: ordered exact tiers (``tiers[0]`` is the full-precision tier) + optional state."""

    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        layer_idx: int,
        shape: ModelShape,
        stages: list["Stage"],
        budget: tuple | None = None,
        reference: ModelShape | None = None,
    ):
        """``budget``: (the stack's promise, its keeper stage, whose ``layer_share`` sizes this layer) or None;
        ``reference``: the model shape memory is promised against (before GQA conversion; default ``shape``)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.shape = shape
        self.reference = reference or shape
        self.budget = budget
        self.promise: LayerPromise | None = None  # built at the first update (it knows the dtype held)
        self.window = shape.layer_windows[layer_idx]
        self.is_sliding = self.window is not None
        self.seen = 0
        self.full = FullTier()
        self.tiers: list[ExactTier] = [self.full]
        self.state: StateTier | None = None
        self.stages = stages
        self.awaiting_attention = False
        self.scratch: dict[str, object] = {}  # per-layer data stages keep between steps (e.g. accumulated scores)
        for stage in stages:
            stage.init_layer(self)

    # --------------------------------------------------------------- transformers layer contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.full.initialize(key_states, value_states)
        if self.budget is not None:
            budget, keeper = self.budget
            dtype = key_states.dtype
            share = keeper.spec.layer_share(self.layer_idx, self.shape, dtype, budget, self.reference)
            self.promise = LayerPromise(budget, share, reference_bytes_per_token(self.reference, dtype))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.awaiting_attention:
            raise CacheUsageError(
                f"layer {self.layer_idx}: the previous forward did not run kvstack's attention. A KVStackCache needs "
                "the model prepared with kvstack.apply(model, ...) (it installs the attention function that reads the "
                "tiers); do not change model.config._attn_implementation afterwards."
            )
        n = key_states.shape[-2]
        if n == 0:
            raise CacheUsageError(f"layer {self.layer_idx}: an empty input (0 tokens); give at least one token")
        if not self.is_initialized:
            self._check_shape(key_states)
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.full.keys.shape[0] or key_states.shape[1] != self.full.keys.shape[1]:
            raise CacheUsageError(
                f"layer {self.layer_idx}: this cache holds batch {self.full.keys.shape[0]} x "
                f"{self.full.keys.shape[1]} KV heads, the forward gives batch {key_states.shape[0]} x "
                f"{key_states.shape[1]}; use a fresh cache (kvstack.cache_for(model)) for another batch"
            )
        positions = torch.arange(self.seen, self.seen + n, dtype=POSITION_DTYPE, device=key_states.device)
        self.full.append(key_states, value_states, positions.expand(key_states.shape[0], 1, n))
        self.seen += n
        self.awaiting_attention = True
        ACTIVE_LAYER.set(self)
        return self.full.keys, self.full.values

    def _check_shape(self, key_states: torch.Tensor) -> None:
        heads, dim = key_states.shape[1], key_states.shape[-1]
        if heads != self.shape.num_kv_heads or dim != self.shape.head_dim:
            raise CacheUsageError(
                f"layer {self.layer_idx}: this cache was built for {self.shape.num_kv_heads} KV heads of head_dim "
                f"{self.shape.head_dim}, the model gives {heads} of {dim}; a cache belongs to the model it was built "
                "for (kvstack.cache_for(model))"
            )

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # <= 5.3 passed cache_position (a tensor); the mask itself is rebuilt from positions by the attention function
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.seen + q, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # transformers <= 5.16 name

    # ---------------------------------------------------------------------------- attention
    def attend(
        self,
        query: torch.Tensor,
        padding: torch.Tensor | None = None,
        *,
        scaling: float,
        softcap: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """The layer's attention, after ``update`` stored the forward's keys: ``query`` [B, Hq, Q, D] (post-RoPE)
        over every tier and the state -> output [B, Hq, Q, Dv]. Then compression (``finish_forward``).

        ``padding`` [B, tokens seen] (True = real token), or None when every token is real; padded new tokens are
        never visible nor kept.
        """
        if not self.awaiting_attention:
            raise CacheUsageError(f"layer {self.layer_idx}: attend() without a preceding update() of this forward")
        q_len = query.shape[2]
        if padding is not None:
            if padding.shape[-1] != self.seen:
                raise CacheUsageError(
                    f"attention_mask has {padding.shape[-1]} columns but layer {self.layer_idx} has seen {self.seen} "
                    "tokens including this call; pass the mask of every token seen so far (as generate does)"
                )
            self.mark_padding(padding[:, -q_len:])
        request = StatsRequest.merge(stage.attention_request(self, q_len) for stage in self.stages)
        out, stats = engine.attend(
            self, query, request, padded=padding is not None, scaling=scaling, softcap=softcap,
            sliding_window=sliding_window,
        )
        self.finish_forward(stats)
        return out

    def mark_padding(self, new_valid: torch.Tensor) -> None:
        """new_valid [B, n] bool for the n tokens appended by the current forward: padding never becomes visible."""
        n = new_valid.shape[-1]
        self.full.positions[..., -n:].masked_fill_(~new_valid[:, None, :], EMPTY)  # a fresh tensor of this update

    def finish_forward(self, stats: AttentionStats) -> None:
        """Runs right after this layer's attention: the only place tokens leave a tier."""
        self.awaiting_attention = False
        if self.window is not None:
            self._drop_outside_window()
        for stage in self.stages:
            stage.after_attention(self, stats)
        if self.promise is not None:
            self._keep_promise(stats)

    # ------------------------------------------------------------------------------- the budget
    def limit_bytes(self) -> int | None:
        """Bytes this layer may hold now (all batch rows), or None without a budget."""
        if self.promise is None:
            return None
        return self.full.keys.shape[0] * self.promise.limit(self.seen)

    def reserved_bytes(self) -> int:
        """Bytes per batch row the layer holds besides its tokens (the state, once it exists or may be created):
        what a sizing stage subtracts from the limit."""
        if self.state is None or not self.state_may_fold():
            return 0
        return self.state.row_bytes()

    def state_may_fold(self) -> bool:
        """The state exists, or creating it keeps it within its share of the limit (budget.STATE_SHARE)."""
        if self.state is None:
            return False
        if self.state.allocated or self.promise is None:
            return True
        return self.state.row_bytes() <= STATE_SHARE * self.promise.limit(self.seen)

    def _keep_promise(self, stats: AttentionStats) -> None:
        limit = self.limit_bytes()
        if self.memory_bytes() <= limit:  # tensor shapes: no host sync
            return
        keeper = self.budget[1]
        keeper.fit(self, stats, limit)
        held = self.memory_bytes()
        if held > limit:
            raise BudgetError(
                f"layer {self.layer_idx} holds {held} bytes after {self.seen} tokens, more than its budget "
                f"{{{self.promise.budget.describe()}}} allows ({limit} bytes), and {type(keeper.spec).__name__} "
                "found nothing more to remove; please report this"
            )

    def _drop_outside_window(self) -> None:
        # no future query of a sliding layer can see these: drop (never fold: the model would not attend to them)
        oldest_needed = self.seen - self.window + 1
        for tier in self.tiers:
            if tier.num_tokens:
                pos = tier.positions
                keep = (pos >= oldest_needed) & (pos >= 0)
                if not bool(keep.all()):
                    self.retain(tier, keep, absorb=False)

    def retain(self, tier: ExactTier, keep: torch.Tensor, absorb: bool = True) -> None:
        """Physically keep only ``keep`` [B, Hi, T] of ``tier`` (Hi 1: same tokens for every head, or Hkv).

        This is the one selection mechanism every eviction policy goes through. Rows are compacted to the largest
        kept count (rectangular tensors); shorter rows get empty slots. Valid tokens that are dropped are folded
        into the state tier when there is one (``absorb``), so nothing leaves the layer unaccounted.
        """
        keep = keep & tier.valid()
        index, slot_valid = compaction_index(keep)
        if absorb and self.state_may_fold():
            dropped = tier.valid() & ~keep
            if bool(dropped.any()):
                d_index, d_valid = compaction_index(dropped)
                k, v = tier.gather(d_index)
                self.state.absorb(k, v, d_valid.expand(-1, k.shape[1], -1))
        tier.select(index, slot_valid)

    def demote(self, src: ExactTier, move: torch.Tensor, dst: ExactTier) -> None:
        """Move the tokens ``move`` [B, Hi, T] of ``src`` into ``dst`` (e.g. full precision -> quantized tier),
        keeping their positions and per-token records; the order of arrival in ``dst`` is the order in ``src``."""
        move = move & src.valid()
        if not bool(move.any()):
            return
        index, slot_valid = compaction_index(move)
        keys, values = src.gather(index)
        positions = select_positions(src.positions, index, slot_valid)
        records = {name: gather_records(data, index) for name, data in src.token_data.items()}
        dst.append(keys, values, positions, records)
        self.retain(src, ~move, absorb=False)

    def kept_counts(self) -> torch.Tensor:
        """[B, Hkv] number of real tokens held in the exact tiers of each row and head."""
        total = 0
        for tier in self.tiers:
            if tier.num_tokens:
                total = total + tier.valid().sum(-1).expand(-1, self.shape_heads())
        if isinstance(total, int):
            batch = self.full.keys.shape[0] if self.full.keys is not None else 1
            return torch.zeros(batch, self.shape_heads(), dtype=torch.long)
        return total

    def shape_heads(self) -> int:
        return self.full.keys.shape[1] if self.full.keys is not None else self.shape.num_kv_heads

    def all_tiers(self):
        return [*self.tiers, *([self.state] if self.state is not None else [])]

    def memory_bytes(self) -> int:
        return sum(t.memory_bytes() for t in self.all_tiers())

    def memory_report(self) -> dict[str, int]:
        report: dict[str, int] = {}
        for t in self.all_tiers():
            report[t.name] = report.get(t.name, 0) + t.memory_bytes()
        return report

    def tokens_report(self) -> dict[str, int]:
        """Real tokens each exact tier holds per (batch row, KV head): the most over rows and heads."""
        report: dict[str, int] = {}
        for t in self.tiers:
            held = int(t.valid().sum(-1).max()) if t.num_tokens else 0
            report[t.name] = report.get(t.name, 0) + held
        return report

    # ------------------------------------------------------------ batch-dim operations
    def _map_batch(self, fn) -> None:
        for t in self.all_tiers():
            t.map_batch(fn)
        for key, value in list(self.scratch.items()):
            if isinstance(value, torch.Tensor):
                self.scratch[key] = fn(value)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t[indices])

    def offload(self) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    def reset(self) -> None:
        self.__init__(self.layer_idx, self.shape, self.stages, self.budget, self.reference)

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheUsageError(
            "KVStackCache cannot be cropped (compressed tokens cannot be restored); assisted/speculative decoding "
            "is not supported with kvstack"
        )


def compaction_index(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [B, Hi, T] -> (index [B, Hi, K] ascending per row, slot_valid [B, Hi, K]) with K = max kept per row."""
    k = int(keep.sum(-1).max()) if keep.numel() else 0
    # stable sort puts kept slots first, in their original order
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :k]
    index, _ = torch.sort(order, dim=-1)
    return index, keep.gather(-1, index)


class KVStackCache(Cache):
    """A transformers ``Cache`` composed from a :class:`~kvstack.StackSpec`: one :class:`StackLayer` per decoder layer.

    Usually created for you: ``kvstack.apply(model, preset)`` makes ``model.generate`` use a fresh one, and
    ``kvstack.cache_for(model)`` returns one for manual forward loops.
    """

    def __init__(self, spec: "StackSpec", shape: ModelShape, reference: ModelShape | None = None):
        """``shape``: the model the cache serves; ``reference``: the model before surgery (GQA conversion), whose
        uncompressed cache memory ratios are against (default ``shape``)."""
        self.spec = spec
        self.shape = shape
        self.reference_shape = reference or shape
        built = [(st, st.build(shape, spec.budget)) for st in spec.stages]
        stages = [stage for _, stage in built if stage is not None]
        held = promise(spec)
        keeper = None if held is None else next((stage for st, stage in built if st is held[1]), None)
        layers = []
        for i in range(shape.num_layers):
            budget = None
            if keeper is not None:
                budget = (held[0], keeper)
            layers.append(StackLayer(i, shape, stages, budget, self.reference_shape))
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        return f"KVStackCache(spec={self.spec.name!r}, layers={len(self.layers)}, seen={self.get_seq_length()})"

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise CacheUsageError(
                f"the model updates layer {layer_idx} but this cache has {len(self.layers)} layers: a cache belongs to "
                "the model it was built for (kvstack.cache_for(model))"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def memory_bytes(self) -> int:
        """Sum of ``nbytes`` of every tensor the cache holds: keys, values, codes, scales, zero points, positions,
        state. Nothing masked or zeroed is counted as saved."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def full_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of an uncompressed cache of the original model (before GQA conversion) at the same number of tokens
        seen (batch included), in ``dtype`` (default: the dtype the cache holds keys in now, e.g. after
        ``model.to(torch.bfloat16)``)."""
        from .memory import full_cache_bytes

        layer0 = self.layers[0]
        unseen = [layer.layer_idx for layer in self.layers if layer.seen != layer0.seen]
        if unseen:
            raise CacheUsageError(
                f"layers {unseen} of this {len(self.layers)}-layer cache saw a different number of tokens than layer "
                "0: it was run on a model with another number of layers (a cache belongs to the model it was built "
                "for: kvstack.cache_for(model))"
            )
        batch = layer0.full.keys.shape[0] if layer0.is_initialized else 0
        if dtype is None and layer0.is_initialized:
            dtype = layer0.full.keys.dtype
        return full_cache_bytes(self.reference_shape, self.get_seq_length(), batch=batch, dtype=dtype)

    def memory_report(self) -> dict:
        """Bytes by layer and by tier, the total, the uncompressed reference and their ratio; real tokens by layer and
        tier (``tokens_by_layer``: per batch row and KV head, the most); with a budget, what it allows in all and by
        layer (``budget_bytes``, ``limit_bytes_by_layer``)."""
        layers = [layer.memory_report() for layer in self.layers]
        by_tier: dict[str, int] = {}
        for rep in layers:
            for name, nbytes in rep.items():
                by_tier[name] = by_tier.get(name, 0) + nbytes
        total = sum(by_tier.values())
        full = self.full_bytes()
        report = {
            "tokens_seen": self.get_seq_length(),
            "total_bytes": total,
            "full_cache_bytes": full,
            "ratio": total / full if full else 0.0,
            "by_tier": by_tier,
            "by_layer": layers,
            "tokens_by_layer": [layer.tokens_report() for layer in self.layers],
        }
        limits = [layer.limit_bytes() if layer.is_initialized else None for layer in self.layers]
        if limits[0] is not None:  # the promise (docs/budgets.md)
            report["budget"] = self.layers[0].promise.budget.describe()
            report["budget_bytes"] = sum(limit or 0 for limit in limits)  # total_bytes never exceeds it
            report["limit_bytes_by_layer"] = limits
        return report

    def kept_tokens(self) -> list[torch.Tensor]:
        """Per layer, [B, Hkv] real tokens held in exact tiers."""
        return [layer.kept_counts() for layer in self.layers]
