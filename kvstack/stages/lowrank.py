"""``kind: lowrank`` — fold every token that leaves the exact tiers into a constant-size low-rank state (LESS).

Dong et al., "Get More with LESS: Synthesizing Recurrence with KV Cache Compression for Efficient LLM Inference",
ICML 2024 (arXiv 2402.09398). Per (layer, KV head) and batch row the stage keeps

    H = sum_j psi(k_j) v_j^T   [rank, d_v]        z = sum_j psi(k_j)   [rank]

over the tokens j that left the layer (evicted by any scorer through ``StackLayer.retain``, or pushed out of a
quantized tier by an eviction stage: every exit except the sliding-window drop goes through ``retain``, which calls
``absorb``). The attention adds ``phi(q)^T H`` to its numerator and ``phi(q)^T z`` to its denominator. Memory is
constant in the sequence length: ``H``, ``z`` and one float32 log-offset ``c`` per (batch row, KV head).

Parameters:

* ``features: random`` (default) — training-free positive orthogonal random features (FAVOR+, Choromanski et al.,
  arXiv 2009.14794): ``log phi(x) = W x' - |x'|^2 / 2 - log(rank) / 2`` with ``x' = sqrt(s) x``, so
  ``E[phi(q)^T phi(k)] = exp(s q.k)`` exactly. ``rank`` features (default 16) per KV head, rows of ``W`` drawn in
  orthogonal blocks from ``seed`` (one draw for every layer and head).
* ``features: learned`` — LESS kernels trained by ``kvstack calibrate`` (``kvstack/stages/lowrank_learned.py``),
  loaded from the safetensors file ``kernels`` (absolute, or relative to the working directory); the rank is the
  file's.

One stabiliser for the exact part and the state: the state is stored as ``exp(-c) H`` and ``exp(-c) z`` with ``c``
the largest log-feature folded so far (``kvstack/kernels/lowrank_update.py``), and ``readout`` returns
``log(phi(q)^T z) = logsumexp_f(log phi(q)_f + log z_f) + c`` — the log of the state's share of the softmax
denominator on the same absolute scale as the exact logits ``s q.k``. The stack's attention takes ONE maximum ``m``
over every exact logit and this log-denominator, and divides everything by the one denominator
``sum exp(l - m) + exp(log_den - m)``; nothing is normalised separately, so neither part can overflow and the merge
equals softmax attention whenever the features are exact.

Sliding-window layers get no state: their model never attends beyond the window, and folded tokens would stay
visible forever. The feature maps (random projections or learned weights) are read-only parameters shared by every
cache and batch row, like the model's weights; they are not part of ``memory_bytes`` (their size is in
docs/lowrank.md). Models with attention-logit softcapping (Gemma 2) approximate the uncapped kernel ``exp(s q.k)``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from kvstack.kernels.lowrank_update import LowRankState, draw_features, empty_state, fold, log_features, readout
from kvstack.kernels.tiered_attention import StateData
from kvstack.stack.base import Stage, StageSpec, spec_error
from kvstack.stack.errors import CacheUsageError, SpecError
from kvstack.stack.registry import register_stage
from kvstack.stack.tiers import StateTier

DEFAULT_RANK = 16
OFFSET_BYTES = 4  # the float32 log-offset c per (batch row, KV head)


def state_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The state accumulates in float32 (float64 for float64 models, matching the attention's compute dtype)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


@register_stage
class LowRankSpec(StageSpec):
    """Fold evicted tokens into a constant-size low-rank state read by the attention."""

    kind: Literal["lowrank"] = "lowrank"
    features: Literal["random", "learned"] = Field(
        default="random", description="Feature map: training-free random features, or learned LESS kernels."
    )
    rank: int | None = Field(
        default=None, ge=1, le=4096, description=f"Random features per KV head (default {DEFAULT_RANK}); random only."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the orthogonal random projections; random only.")
    kernels: str | None = Field(
        default=None, description="safetensors file written by `kvstack calibrate`; required for learned features."
    )

    def validate_with(self, stack_budget) -> None:
        if self.features == "learned":
            if self.kernels is None:
                raise spec_error("kernels", None, "a safetensors file from `kvstack calibrate` for features: learned")
            if self.rank is not None:
                raise spec_error("rank", self.rank, "unset for features: learned (the kernels file sets the rank)")
        elif self.kernels is not None:
            raise spec_error("kernels", self.kernels, "unset for features: random (use features: learned)")

    def validate_in_stack(self, position, stages) -> None:
        evicting = [s.kind for s in stages if s.kind in ("evict", "quantized_prune")]
        if not evicting:
            raise spec_error(
                "kind", "lowrank",
                "together with a stage that removes tokens (evict or quantized_prune): alone, nothing is ever folded "
                "and the state only adds bytes on top of the full cache",
            )

    def validate_for(self, shape, stack_budget) -> None:
        self.validate_with(stack_budget)
        if self.features == "learned":
            from .lowrank_learned import check_kernels_file

            check_kernels_file(Path(self.kernels), shape)

    def effective_rank(self) -> int:
        if self.features == "learned":
            from .lowrank_learned import kernels_rank

            return kernels_rank(Path(self.kernels))
        return self.rank or DEFAULT_RANK

    def state_bytes(self, shape, dtype: torch.dtype) -> int:
        """Bytes of one layer's state per batch row: H, z and the offset c of every KV head."""
        item = torch.empty((), dtype=state_dtype(dtype)).element_size()
        rank = self.effective_rank()
        return shape.num_kv_heads * (rank * (shape.value_dim + 1) * item + OFFSET_BYTES)

    def plan_memory(self, plan, stack_budget) -> None:
        per_row = self.state_bytes(plan.shape, plan.dtype)
        for layer, window in zip(plan.layers, plan.shape.layer_windows):
            if window is None:
                layer.state_bytes += per_row

    def feature_maps(self, shape):
        if self.features == "learned":
            from .lowrank_learned import load_kernels

            return load_kernels(Path(self.kernels), shape)
        return random_feature_maps(self.rank or DEFAULT_RANK, self.seed, shape.num_layers, shape.num_kv_heads,
                                   shape.head_dim, state_dtype(shape.dtype))

    def build(self, shape, stack_budget) -> "LowRankStage":
        return LowRankStage(self, shape, stack_budget)


class RandomFeatures:
    """Positive orthogonal random features of one layer: projections ``[Hkv, rank, d]`` (copied once per device)."""

    def __init__(self, proj: torch.Tensor) -> None:
        self.proj = proj
        self._on_device: dict[torch.device, torch.Tensor] = {}

    @property
    def rank(self) -> int:
        return self.proj.shape[1]

    def _weights(self, device: torch.device) -> torch.Tensor:
        if device not in self._on_device:
            self._on_device[device] = self.proj.to(device)
        return self._on_device[device]

    def log_query(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return log_features(query, self._weights(query.device), scaling)

    def log_key(self, keys: torch.Tensor, scaling: float) -> torch.Tensor:
        return log_features(keys, self._weights(keys.device), scaling)


@functools.lru_cache(maxsize=8)
def random_feature_maps(
    rank: int, seed: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> list[RandomFeatures]:
    """One draw for every (layer, KV head), shared by every cache of the same shape and seed."""
    proj = draw_features(head_dim, rank, seed, num_heads=layers * kv_heads, dtype=dtype)
    return [RandomFeatures(p) for p in proj.reshape(layers, kv_heads, rank, head_dim)]


class LowRankTier(StateTier):
    """The state of one layer: ``H`` [B, Hkv, rank, d_v], ``z`` [B, Hkv, rank], ``c`` [B, Hkv] (float32, -inf for rows
    nothing was folded into). Created by the first ``absorb`` (a layer that never evicts holds no state bytes, and a
    budget decides when a state is affordable: kvstack/stack/budget.py); the attention's ``scaling`` recorded by
    ``prepare`` is the one keys are folded with (attention always runs before compression)."""

    name = "state"
    _tensor_names = ("H", "z", "c")

    def __init__(self, features, dtype: torch.dtype, value_dim: int, kv_heads: int) -> None:
        self.features = features
        self.dtype = dtype
        self.value_dim = value_dim
        self.kv_heads = kv_heads
        self.H: torch.Tensor | None = None
        self.z: torch.Tensor | None = None
        self.c: torch.Tensor | None = None
        self.scaling: float | None = None

    def _state(self) -> LowRankState:
        return LowRankState(self.H, self.z, self.c)

    def row_bytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.kv_heads * (self.features.rank * (self.value_dim + 1) * item + OFFSET_BYTES)

    def prepare(self, query, scaling) -> None:
        self.scaling = scaling

    def readout(self, query, scaling):
        if self.H is None:
            return None
        return readout(self._state(), self.features.log_query(query, scaling))

    def kernel_data(self, query, scaling):
        if self.H is None:
            return None
        return StateData(self._state(), self.features.log_query(query, scaling))

    def absorb(self, keys, values, valid) -> None:
        if self.scaling is None:
            raise CacheUsageError("low-rank state: tokens were folded before the layer's first attention ran")
        if self.H is None:
            batch, heads = keys.shape[:2]
            st = empty_state(batch, heads, self.features.rank, self.value_dim, device=keys.device, dtype=self.dtype)
            self.H, self.z, self.c = st.H, st.z, st.c
        log_psi = self.features.log_key(keys, self.scaling)
        st = fold(self._state(), log_psi, values, valid)
        self.H, self.z, self.c = st.H, st.z, st.c


class LowRankStage(Stage):
    spec: LowRankSpec

    def __init__(self, spec: LowRankSpec, shape, stack_budget) -> None:
        super().__init__(spec, shape, stack_budget)
        self.maps = spec.feature_maps(shape)
        self.dtype = state_dtype(shape.dtype)

    def init_layer(self, layer) -> None:
        if layer.is_sliding:
            return
        if layer.state is not None:
            raise SpecError(
                f"layer {layer.layer_idx} already has a state tier ({type(layer.state).__name__}); a stack holds at "
                "most one state stage (one `kind: lowrank`)"
            )
        layer.state = LowRankTier(self.maps[layer.layer_idx], self.dtype, self.shape.value_dim,
                                  self.shape.num_kv_heads)
