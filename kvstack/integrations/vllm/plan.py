"""What of a kvstack spec runs inside vLLM's paged KV cache (``EnginePlan``), and Algorithm 1 on vLLM's blocks.

Pure Python and torch (no vLLM import), so the policy is tested in kvstack's own environment. The vLLM side
(``scheduler.py``, ``worker.py``, ``quantized.py``) only moves block ids and scores around it; the quantized pages'
layout is ``paged_quant.py``.

vLLM differs from a transformers cache in one way that shapes everything here: a request's block table is shared by
every layer and every KV head, so a block is one unit of memory across the whole model. Selection is therefore one
ranking per request: a token's score is the scorer's score averaged over the layers and KV heads, a block's score is
the spec's ``aggregate`` of its tokens' scores, and an evicted block is freed for every layer at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from kvstack.stack.base import Budget, StageSpec
from kvstack.stack.errors import SpecError
from kvstack.stack.spec import StackSpec
from kvstack.stack.tiers import FullTier
from kvstack.stages.quantize import QuantizeSpec
from kvstack.stages.scorers import Scorer, get_scorer

from .paged_quant import PagedQuantLayout

#: the key of ``VllmConfig.additional_config`` under which the stack travels to the scheduler and the workers
CONFIG_KEY = "kvstack"

#: the engine block size of a stack with a ``quantize`` stage and no block size of its own
QUANTIZED_BLOCK_SIZE = 32

_NOT_YET = {
    "quantize": "a quantize stage runs alone or after one evict stage in vLLM",
    "quantized_prune": "quantized pruning keeps tokens at several precisions, and vLLM's pages all have one size",
    "lowrank": "a low-rank state needs an attention kernel that merges it with the paged blocks",
    "lowrank_learned": "a low-rank state needs an attention kernel that merges it with the paged blocks",
    "gqa": "head conversion changes the model's weights, which vLLM loads itself",
    "channel_prune": "pruned channels need a paged layout with fewer channels than the model's head_dim",
}


@dataclass(frozen=True)
class EnginePlan:
    """What of a stack runs in vLLM, and where: block eviction (``eviction``: the scheduler frees blocks, the worker
    scores them), kvstack's quantized tier in the pages (``quantize``: the worker's attention backend), or both
    (``[evict, quantize]``: the scheduler's budget then counts the pages' bytes, ``BlockEvictionPlan.with_pages``)."""

    spec: StackSpec
    block_size: int  # the engine's block size
    eviction: "BlockEvictionPlan | None" = None
    quantize: "QuantizeSpec | None" = None

    @classmethod
    def from_spec(
        cls, source: "StackSpec | dict | str | Path", block_size: int | None = None, budget: "Budget | dict | None" = None
    ) -> "EnginePlan":
        spec = StackSpec.load(source)
        kinds = [s.kind for s in spec.stages]
        if kinds == ["quantize"]:
            return cls._quantized_only(spec, block_size, budget)
        if kinds == ["evict", "quantize"]:  # blocks leave, and those held are quantized pages: budgets in bytes
            quantize = spec.stages[1]
            data = spec.model_dump()
            data["stages"] = data["stages"][:1]
            eviction = BlockEvictionPlan.from_spec(data, block_size=block_size, budget=budget)
            _check_quantize(quantize, eviction.block_size, where="stages.1")
            full = eviction.spec.model_dump()
            full["stages"].append(quantize.model_dump())
            return cls(StackSpec.load(full), eviction.block_size, eviction=eviction, quantize=quantize)
        eviction = BlockEvictionPlan.from_spec(spec, block_size=block_size, budget=budget)
        return cls(eviction.spec, eviction.block_size, eviction=eviction)

    @classmethod
    def _quantized_only(cls, spec: StackSpec, block_size, budget) -> "EnginePlan":
        stage = spec.stages[0]
        if budget is not None or spec.budget is not None:
            value = budget if budget is not None else spec.budget.model_dump(exclude_none=True)
            raise SpecError(f"budget={value!r} is not allowed in vLLM with a quantize stage alone: none (its pages "
                            "hold a fixed fraction of the bytes, and a budget needs an evict stage before it)")
        _check_prefill_chunk(spec)
        size = QUANTIZED_BLOCK_SIZE if block_size is None else block_size
        _check_quantize(stage, size, where="stages.0")
        return cls(spec, size, quantize=stage)


def _check_prefill_chunk(spec: StackSpec) -> None:
    if spec.prefill_chunk is not None:
        raise SpecError(f"prefill_chunk={spec.prefill_chunk!r} is not allowed in vLLM: None (vLLM splits prefills "
                        "itself: set max_num_batched_tokens on the engine)")


def _check_quantize(stage: "QuantizeSpec", block_size: int, where: str) -> None:
    if stage.bits == 16:
        raise SpecError(f"{where}.bits=16 is not allowed in vLLM: 2, 3, 4 or 8 (16 quantizes nothing: leave the "
                        "stage out)")
    if stage.coding != "kivi":
        raise SpecError(f"{where}.coding={stage.coding!r} is not allowed in vLLM yet: 'kivi' (a page holds KIVI's key "
                        "groups; transform-coded keys need a coder fitted per request, which the pages do not carry)")
    if block_size % stage.group_size:
        raise SpecError(f"block_size={block_size} is not allowed with {where}.group_size={stage.group_size}: a "
                        "multiple of group_size (a vLLM block holds whole key groups)")


@dataclass(frozen=True)
class BlockEvictionPlan:
    """Algorithm 1 (section 4 of the seed: page-aware importance pruning) on vLLM blocks.

    After every engine step, a request holding more real blocks than its budget allows loses its lowest-scored
    blocks (``aggregate`` of the token scores) until it fits: never the newest block (it is being filled), and
    blocks holding a sink (``n_sink``) or a recent token (``recent``) only after every other block. Evicting k
    blocks at once equals k rounds of the algorithm, since removing a block leaves the others' scores unchanged.

    Budgets are promises: ``tokens: n`` -> at most ``n // block_size`` blocks; ``ratio: r`` -> at most
    ``floor(r * seen / block_size)`` blocks of the ``seen`` tokens (vLLM stores no per-token record beside keys and
    values, and a block is allocated whole, so this is the byte ratio). The newest block is always held, so a ratio
    budget holds from ``seen >= block_size / r`` tokens on; below that a request holds its one block.
    """

    spec: StackSpec  # the stack as it runs: its one evict stage, with the engine's block size
    stage: StageSpec
    budget: Budget
    block_size: int
    #: the quantized pages of a quantize stage after the evict stage (``with_pages``): budgets count their bytes
    pages: "PagedQuantLayout | None" = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(
        cls, source: "StackSpec | dict | str | Path", block_size: int | None = None, budget: "Budget | dict | None" = None
    ) -> "BlockEvictionPlan":
        """Check that ``source`` runs in vLLM and build its plan. ``block_size`` replaces the stage's (the engine's
        block size must be the eviction block: vLLM frees whole blocks); ``budget`` replaces the stack's and the
        stage's own."""
        spec = StackSpec.load(source)
        if not spec.stages:
            raise SpecError(f"stack {spec.name!r} has no stages: in vLLM, run the engine without kvstack")
        for i, stage in enumerate(spec.stages):
            if stage.kind in _NOT_YET:
                raise SpecError(
                    f"stages.{i}.kind={stage.kind!r} is not allowed in vLLM yet ({_NOT_YET[stage.kind]}); "
                    "the vLLM integration runs one `evict` stage with granularity: block, one `quantize` stage, or "
                    "the two in that order"
                )
        if len(spec.stages) != 1 or spec.stages[0].kind != "evict":
            kinds = [s.kind for s in spec.stages]
            raise SpecError(f"stages={kinds} is not allowed in vLLM: ['evict'], ['quantize'] or ['evict', "
                            "'quantize']")
        _check_prefill_chunk(spec)
        if block_size is not None or budget is not None:
            data = spec.model_dump()
            if block_size is not None:
                data["stages"][0]["block_size"] = block_size
            if budget is not None:
                data["budget"] = budget.model_dump() if isinstance(budget, Budget) else budget
                data["stages"][0]["budget"] = None
            spec = StackSpec.load(data)  # every check again, the budget against the new block size included
        stage = spec.stages[0]
        cls._check_stage(stage)
        return cls(spec=spec, stage=stage, budget=stage.effective_budget(spec.budget), block_size=stage.block_size)

    @staticmethod
    def _check_stage(stage) -> None:
        where = "stages.0"
        if stage.granularity != "block":
            raise SpecError(
                f"{where}.granularity={stage.granularity!r} is not allowed in vLLM: 'block' (vLLM frees whole blocks)"
            )
        scorer = get_scorer(stage.scorer)
        if scorer.request is not Scorer.request or scorer.observe is not Scorer.observe:
            raise SpecError(
                f"{where}.scorer={stage.scorer!r} is not allowed in vLLM: it reads attention weights, which vLLM's "
                "attention kernels do not return; use a scorer that reads stored keys and values "
                "(value_key_ratio, key_norm)"
            )
        if stage.is_head_wise:
            default = f" (the default of scorer {stage.scorer!r})" if stage.head_wise is None else ""
            raise SpecError(f"{where}.head_wise=True{default} is not allowed in vLLM: false (a block holds every KV "
                            "head)")
        fixed = {"schedule": "uniform", "layer_weights": None, "spill_unused": False, "phase": "always", "every": 1,
                 "chunk_size": None}
        for name, allowed in fixed.items():
            if getattr(stage, name) != allowed:
                raise SpecError(
                    f"{where}.{name}={getattr(stage, name)!r} is not allowed in vLLM: {allowed!r} (vLLM schedules "
                    "prefill chunks itself and a block table is shared by all layers)"
                )

    def with_pages(self, pages: "PagedQuantLayout") -> "BlockEvictionPlan":
        """This plan over quantized pages (``pages``: the model's page layout, known once the engine has a model)."""
        if pages.block_size != self.block_size:
            raise ValueError(f"the page layout has {pages.block_size}-token blocks, the plan {self.block_size}")
        return dataclasses.replace(self, pages=pages)

    # ------------------------------------------------------------------ the policy
    def allowed_blocks(self, seen: int) -> int:
        """Real blocks a request may hold after a step, ``seen`` tokens computed (at least the newest block).

        The budget is bytes: ``tokens: n`` -> n uncompressed tokens' bytes, ``ratio: r`` -> r x the ``seen``
        tokens' bytes. Over quantized pages the residual's full-precision tokens (outside the pool) are paid
        first, and a block costs ``cell_bytes / full_cell_bytes`` of an uncompressed one."""
        room = self.budget.tokens if self.budget.tokens is not None else self.budget.ratio * seen  # in tokens
        if self.pages is None:
            return max(math.floor(room / self.block_size + 1e-9), 1)
        pages = self.pages
        room = (room - (seen - pages.quantized_count(seen))) * pages.full_cell_bytes
        return max(math.floor(room / (self.block_size * pages.cell_bytes) + 1e-9), 1)

    def victims(self, scores: dict[int, float], held: Sequence[int], seen: int) -> list[int]:
        """Logical indices of the blocks to free, lowest priority first.

        ``held``: the logical indices of the request's real (not yet evicted) blocks among the first
        ``ceil(seen / block_size)``; ``scores``: the score of every full block (higher = keep). Over quantized pages
        only blocks wholly in the pages may leave (the residual's full-precision tokens stay with their request).
        """
        excess = len(held) - self.allowed_blocks(seen)
        if excess <= 0:
            return []
        bs = self.block_size
        newest = (seen - 1) // bs
        first_unprotected = math.ceil(self.stage.n_sink / bs)
        first_recent = (seen - self.stage.recent) // bs if self.stage.recent else newest + 1
        in_pages = newest if self.pages is None else min(newest, self.pages.quantized_count(seen) // bs)
        candidates = []
        for j in held:
            if j >= in_pages:
                continue
            if j not in scores:
                raise RuntimeError(f"kvstack: block {j} of a request has no score (seen={seen}): a full block was "
                                   "not scored by the worker")
            protected = j < first_unprotected or j >= first_recent
            candidates.append((protected, scores[j], j))
        candidates.sort()
        return [j for _, _, j in candidates[:excess]]

    # ------------------------------------------------------------------ scoring
    @property
    def position_only(self) -> bool:
        """The scorer's score is a function of positions alone (``window``): no layer needs reading."""
        return self._scorer.position_only

    def position_scores(self, start: int, count: int) -> torch.Tensor:
        """Scores [count] of a position-only scorer for the tokens at ``start ...`` (their keys and values unread)."""
        empty = torch.zeros(1, 1, count, 0)
        return self._score(empty, empty, torch.arange(start, start + count))

    def token_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The scorer's score [T] of T tokens of one layer (keys, values [T, Hkv, D]), averaged over KV heads.
        Only scorers that read a token's own key and value run in vLLM, so a token is scored once, when written."""
        k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, Hkv, T, D]
        return self._score(k, v, torch.arange(k.shape[2], device=k.device))  # positions unread by these scorers

    def _score(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tier = FullTier()
        tier.initialize(k, v)
        tier.append(k, v, positions.to(tier.positions.dtype)[None, None])
        return self._scorer.scores(None, 0, tier, None).float().mean(1)[0]

    @functools.cached_property
    def _scorer(self) -> Scorer:
        # a scorer of stored keys and values reads neither the layer nor the model's shape
        return get_scorer(self.stage.scorer)(self.stage, None)

    def aggregate(self, token_scores: torch.Tensor) -> float:
        """A full block's score from its tokens' scores (averaged over layers)."""
        reduce = {"mean": torch.mean, "min": torch.amin, "max": torch.amax}[self.stage.aggregate]
        return float(reduce(token_scores))


class BlockScores:
    """Token scores of each request's block being filled, until it is full and gets its block score.

    ``add(request, start, scores)``: the scores of the request's tokens at positions ``start ...`` (one step's
    tokens, already averaged over layers); returns {logical block index: score} for the blocks they filled. A
    request that restarts (preempted: ``start`` back at a block boundary before its last position) starts over.
    """

    def __init__(self, plan: BlockEvictionPlan) -> None:
        self.plan = plan
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (first position, its scores so far)

    def add(self, request: str, start: int, scores: torch.Tensor) -> dict[int, float]:
        bs = self.plan.block_size
        first, pending = self._pending.get(request, (start - start % bs, scores[:0]))
        if first + pending.numel() != start:  # a restart (or the first step of a request)
            if start % bs:
                raise RuntimeError(f"kvstack: request {request!r} continues at position {start}, but its scores "
                                   f"cover {first}..{first + pending.numel()}")
            first, pending = start, scores[:0]
        pending = torch.cat([pending, scores.float()])
        full = pending.numel() // bs
        out = {first // bs + j: self.plan.aggregate(pending[j * bs : (j + 1) * bs]) for j in range(full)}
        self._pending[request] = (first + full * bs, pending[full * bs :])
        return out

    def drop(self, request: str) -> None:
        self._pending.pop(request, None)


def compact_block_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor, evicted: dict[int, Sequence[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention reads for requests with freed blocks: each row's remaining blocks moved to the front, in order,
    and its length less the freed tokens. The keys in the cache carry their rotary positions already, and every
    freed block is a full block before the newest one, so the remaining tokens are contiguous in the compacted row
    and the newest tokens stay last (causal masking of a prefill chunk is unchanged).

    ``block_table`` [R, W] and ``seq_lens`` [R] are not modified (the logical table still maps new tokens to their
    slots); ``evicted`` maps a row to the logical indices of its freed blocks.
    """
    if not evicted:
        return block_table, seq_lens
    table = block_table.clone()
    lens = seq_lens.clone()
    width = table.shape[1]
    for row, gone in evicted.items():
        if not gone:
            continue
        n_blocks = -(-int(seq_lens[row]) // block_size)
        drop = torch.zeros(width, dtype=torch.bool)
        drop[list(gone)] = True
        drop[n_blocks:] = True
        kept = block_table[row][~drop]
        table[row, : kept.numel()] = kept
        table[row, kept.numel():] = 0
        lens[row] = seq_lens[row] - len(gone) * block_size
    return table, lens
