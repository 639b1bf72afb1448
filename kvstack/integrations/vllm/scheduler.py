"""The scheduler side: after every step, free the blocks Algorithm 1 evicts back to vLLM's block pool.

``KVStackScheduler`` is vLLM's own scheduler with one addition. A request's logical block list keeps its length,
and a freed block becomes vLLM's null block in it, exactly as the sliding-window manager does with blocks that left
its window (``remove_skipped_blocks``): allocation, preemption and freeing at the end of a request keep working
unchanged. The freed blocks return to the pool at once, for this request's next blocks or for other requests.

Scores arrive from the workers with the step's output (``model_runner_output.kvstack_block_scores``: request id ->
{logical block index: score}, one entry per block that became full in that step), and the freed indices go back
with every later step (``scheduler_output.kvstack_evicted``), so attention skips them (``worker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from . import check_engine
from .paged_quant import PagedQuantLayout
from .plan import CONFIG_KEY, EnginePlan


@dataclass
class _RequestState:
    preemptions: int
    scores: dict[int, float] = field(default_factory=dict)
    evicted: set[int] = field(default_factory=set)


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
        if plan.eviction is not None and plan.quantize is not None:  # budgets count the quantized pages' bytes
            model = vllm_config.model_config
            heads = model.get_num_kv_heads(vllm_config.parallel_config)
            self.kvstack_plan = plan.eviction.with_pages(
                PagedQuantLayout.from_config(plan.quantize, model.hf_config, model.dtype, heads, plan.block_size))
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
        return super().update_from_output(scheduler_output, model_runner_output)

    def request_blocks(self, rid: str) -> int:
        if self.kvstack_plan is None:
            return super().request_blocks(rid)
        state = self._state(rid)  # reset when the request was preempted (it lost every block)
        return super().request_blocks(rid) - (len(state.evicted) if state else 0)  # freed ones are null blocks

    def after_step(self, scheduler_output) -> None:
        if self.kvstack_plan is None:
            return
        for rid in scheduler_output.num_scheduled_tokens:
            self._evict(rid)
        for rid in [r for r in self._states if r not in self.requests]:  # finished or aborted
            del self._states[rid]

    def _state(self, rid: str) -> _RequestState | None:
        request = self.requests.get(rid)
        if request is None:
            return None
        state = self._states.get(rid)
        if state is None or state.preemptions != request.num_preemptions:
            # a preempted request lost all its blocks and recomputes from its first token
            state = self._states[rid] = _RequestState(request.num_preemptions)
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
        ahead = sum(not b.is_null for b in blocks[n_blocks:])  # allocated for tokens not computed yet
        now = len(held) - len(victims) + ahead
        self.kvstack_stats.max_held_blocks = max(self.kvstack_stats.max_held_blocks, now)
        self.kvstack_stats.steps_over_budget += now > plan.allowed_blocks(seen)
