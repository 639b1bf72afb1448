"""The scheduler side: after every step, free the blocks Algorithm 1 evicts back to vLLM's block pool.

``KVStackScheduler`` is vLLM's own scheduler with one addition. A request's logical block list keeps its length,
and a freed block becomes vLLM's null block in it, exactly as the sliding-window manager does with blocks that left
its window (``remove_skipped_blocks``): allocation, preemption and freeing at the end of a request keep working
unchanged. The freed blocks return to the pool at once, for this request's next blocks or for other requests.

Scores arrive from the workers with the step's output (``model_runner_output.kvstack_block_scores``: request id ->
{logical block index: score}, one entry per block that became full in that step), and the freed indices go back
with every later step (``scheduler_output.kvstack_evicted``), so attention skips them (``worker.py``).

When a request finishes, the scheduler reports what it held (``RequestReport``: kept in ``BlockStats.requests``
and logged by vLLM's logger, so a server started with ``vllm serve --config`` prints one line per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from . import check_engine
from .paged_quant import PagedQuantLayout
from .plan import CONFIG_KEY, EnginePlan


logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, whose handler and level a server configures

#: finished requests' reports kept in ``BlockStats.requests``: at least the newest this many (a server runs for long)
KEPT_REPORTS = 4096


@dataclass
class _RequestState:
    preemptions: int
    scores: dict[int, float] = field(default_factory=dict)
    evicted: set[int] = field(default_factory=set)
    # for the report (kept across preemptions: ``_state`` carries them over)
    tokens: int = 0  # tokens in its cache after its latest step
    blocks: int = 0  # real blocks it holds: during its latest step, then after that step's eviction
    peak_blocks: int = 0
    blocks_freed: int = 0


@dataclass(frozen=True)
class RequestReport:
    """One finished request: the blocks it held against the blocks stock vLLM holds for the same tokens.

    Blocks are blocks of the pool; with quantized pages each costs ``page_ratio`` of an uncompressed block, and the
    request's full-precision residual (at most ``residual + group_size - 1`` tokens per layer, outside the pool)
    is not in these counts (``BlockStats.peak_residual_bytes``)."""

    request_id: str
    tokens: int  # prompt and generated tokens in its cache at its last step
    blocks_held: int  # real blocks during its last step (its new block included: no eviction follows)
    peak_blocks: int  # most real blocks after any step's eviction: what the budget promises
    uncompressed_blocks: int  # what stock vLLM holds for ``tokens``: ceil(tokens / block_size)
    allowed_blocks: int | None  # its budget at ``tokens`` (None: no eviction)
    blocks_freed: int
    preemptions: int
    page_ratio: float  # bytes of one of its blocks / an uncompressed block's (1.0 without quantized pages)

    @property
    def memory_ratio(self) -> float:
        """Bytes of its blocks at the end / the bytes stock vLLM holds for its tokens (the residual aside)."""
        return self.blocks_held * self.page_ratio / max(self.uncompressed_blocks, 1)


@dataclass
class BlockStats:
    """What the engine held, for tests and benchmarks (every request together, in blocks of the pool)."""

    peak_blocks_during_step: int = 0  # before a step's eviction: the step's new blocks are allocated by then
    peak_blocks_in_use: int = 0  # after it
    peak_running: int = 0  # most requests running at once
    running_steps: int = 0  # requests running, summed over steps (/ steps: the mean number at once)
    steps: int = 0
    # the same over the steps at which requests were waiting: what the pool holds at once when it is the limit
    running_while_queued: int = 0
    queued_steps: int = 0
    peak_request_blocks_during_step: int = 0  # most blocks one request held during a step (its new blocks included)
    preemptions: int = 0
    # eviction only
    blocks_freed: int = 0
    steps_over_budget: int = 0  # steps after which a request held more blocks than its budget allows (0: kept)
    max_held_blocks: int = 0  # most real blocks one request held after a step
    # quantized pages (a quantize stage): the full-precision residual the worker held outside the pool (most at
    # once after a step: every request and layer of one rank)
    peak_residual_bytes: int = 0
    # kvstack's engines: one report per finished request, in finishing order (at least the newest KEPT_REPORTS)
    requests: list[RequestReport] = field(default_factory=list)


class CountingScheduler(Scheduler):
    """vLLM's scheduler, counting blocks in use and preemptions (stock vLLM's side of a comparison)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvstack_stats = BlockStats()

    def update_from_output(self, scheduler_output, model_runner_output):
        stats = self.kvstack_stats
        stats.peak_blocks_during_step = max(stats.peak_blocks_during_step, self.blocks_in_use())
        stats.peak_request_blocks_during_step = max(
            [stats.peak_request_blocks_during_step, *map(self.request_blocks, scheduler_output.num_scheduled_tokens)])
        stats.steps += 1
        stats.peak_residual_bytes = max(stats.peak_residual_bytes,
                                        getattr(model_runner_output, "kvstack_residual_bytes", 0))
        stats.running_steps += len(self.running)
        if self.waiting:
            stats.queued_steps += 1
            stats.running_while_queued += len(self.running)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.after_step(scheduler_output)
        stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, self.blocks_in_use())
        stats.peak_running = max(stats.peak_running, len(self.running))
        return outputs

    def after_step(self, scheduler_output) -> None:
        """Called once the step's outputs are processed (finished requests already freed)."""

    def _preempt_request(self, *args, **kwargs):
        self.kvstack_stats.preemptions += 1
        return super()._preempt_request(*args, **kwargs)

    def request_blocks(self, rid: str) -> int:
        """Blocks of the pool request ``rid`` holds now (its first KV cache group)."""
        return len(self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.get(rid, ()))

    def blocks_in_use(self) -> int:
        pool = self.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # the null block is never free


class KVStackScheduler(CountingScheduler):
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        check_engine(vllm_config)
        plan = EnginePlan.from_spec(vllm_config.additional_config[CONFIG_KEY],
                                    block_size=vllm_config.cache_config.block_size)
        # None with a quantize stage alone: nothing is evicted (the workers' pages are smaller instead)
        self.kvstack_plan = plan.eviction
        self._block_size = plan.block_size
        self._page_ratio = 1.0
        if plan.quantize is not None:
            model = vllm_config.model_config
            heads = model.get_num_kv_heads(vllm_config.parallel_config)
            pages = PagedQuantLayout.from_config(plan.quantize, model.hf_config, model.dtype, heads, plan.block_size)
            self._page_ratio = pages.page_ratio
            if plan.eviction is not None:  # budgets count the quantized pages' bytes
                self.kvstack_plan = plan.eviction.with_pages(pages)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1:
            raise ValueError(f"kvstack in vLLM: the model has {len(managers)} KV cache groups; one (every layer "
                             "full attention with the same block size) is supported")
        self._manager = managers[0]
        self._states: dict[str, _RequestState] = {}

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        output.kvstack_evicted = {
            rid: sorted(state.evicted)
            for rid, state in self._states.items()
            if state.evicted and rid in output.num_scheduled_tokens
        }
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        scores = getattr(model_runner_output, "kvstack_block_scores", None) or {}
        for rid, blocks in scores.items():
            state = self._state(rid)
            if state is not None:
                state.scores.update(blocks)
        for rid in scheduler_output.num_scheduled_tokens:  # before a request that finishes now frees its blocks
            state = self._state(rid)
            if state is not None:
                state.tokens = self.requests[rid].num_computed_tokens
                state.blocks = self.request_blocks(rid)
        return super().update_from_output(scheduler_output, model_runner_output)

    def request_blocks(self, rid: str) -> int:
        if self.kvstack_plan is None:
            return super().request_blocks(rid)
        state = self._state(rid)  # reset when the request was preempted (it lost every block)
        return super().request_blocks(rid) - (len(state.evicted) if state else 0)  # freed ones are null blocks

    def after_step(self, scheduler_output) -> None:
        if self.kvstack_plan is not None:
            for rid in scheduler_output.num_scheduled_tokens:
                self._evict(rid)
        for rid in scheduler_output.num_scheduled_tokens:
            state = self._states.get(rid)
            if state is not None and rid in self.requests:
                state.peak_blocks = max(state.peak_blocks, state.blocks)
        for rid in [r for r in self._states if r not in self.requests]:  # finished or aborted
            self._report(rid, self._states.pop(rid))

    def _report(self, rid: str, state: _RequestState) -> None:
        plan = self.kvstack_plan
        report = RequestReport(
            request_id=rid, tokens=state.tokens, blocks_held=state.blocks,
            peak_blocks=state.peak_blocks or state.blocks,  # a request done in one step had no eviction
            uncompressed_blocks=-(-state.tokens // self._block_size),
            allowed_blocks=None if plan is None else plan.allowed_blocks(state.tokens),
            blocks_freed=state.blocks_freed, preemptions=state.preemptions, page_ratio=self._page_ratio,
        )
        reports = self.kvstack_stats.requests
        reports.append(report)
        if len(reports) > 2 * KEPT_REPORTS:
            del reports[:-KEPT_REPORTS]
        logger.info("kvstack: request %s: %d tokens, %d blocks held (uncompressed: %d; %.3f of the bytes), at most "
                    "%d after a step (budget: %s), %d freed, %d preemptions", rid, report.tokens, report.blocks_held,
                    report.uncompressed_blocks, report.memory_ratio, report.peak_blocks,
                    "none" if plan is None else report.allowed_blocks, report.blocks_freed, report.preemptions)

    def _state(self, rid: str) -> _RequestState | None:
        request = self.requests.get(rid)
        if request is None:
            return None
        state = self._states.get(rid)
        if state is None or state.preemptions != request.num_preemptions:
            # a preempted request lost all its blocks and recomputes from its first token; its report goes on
            fresh = _RequestState(request.num_preemptions)
            if state is not None:
                fresh.peak_blocks, fresh.blocks_freed = state.peak_blocks, state.blocks_freed
            state = self._states[rid] = fresh
        return state

    def _evict(self, rid: str) -> None:
        request = self.requests.get(rid)
        if request is None or request.status != RequestStatus.RUNNING:
            return
        state = self._state(rid)
        plan = self.kvstack_plan
        seen = request.num_computed_tokens
        blocks = self._manager.req_to_blocks.get(rid, [])
        n_blocks = min(len(blocks), -(-seen // plan.block_size))
        held = [j for j in range(n_blocks) if not blocks[j].is_null]
        victims = plan.victims(state.scores, held, seen)
        if victims:
            freed = [blocks[j] for j in victims]
            for j in victims:
                blocks[j] = self._manager._null_block
                state.evicted.add(j)
                state.scores.pop(j, None)
            self.kv_cache_manager.block_pool.free_blocks(freed)
            self.kvstack_stats.blocks_freed += len(freed)
            state.blocks_freed += len(freed)
        ahead = sum(not b.is_null for b in blocks[n_blocks:])  # allocated for tokens not computed yet
        now = state.blocks = len(held) - len(victims) + ahead
        self.kvstack_stats.max_held_blocks = max(self.kvstack_stats.max_held_blocks, now)
        self.kvstack_stats.steps_over_budget += now > plan.allowed_blocks(seen)
