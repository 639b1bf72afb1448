"""The worker side: score tokens as they are written, and let attention read only the blocks a request still holds.

``KVStackWorker`` is vLLM's CPU worker with three hooks on what its model runner builds itself (instance wrappers
and torch forward pre-hooks: the runner and the model are made inside vLLM, so there is no class to substitute):

* each ``Attention`` layer's new keys and values are scored as they arrive (``BlockEvictionPlan.token_scores``:
  the kernels' cache layout is never read); after ``execute_model``, the blocks the step filled get their scores
  (``BlockScores``), which ride to the scheduler on the step's ``ModelRunnerOutput`` as ``kvstack_block_scores``;
* every attention-metadata builder sees, for requests with freed blocks, a compacted block table and the shorter
  sequence length (``compact_block_table``), so the stock attention kernel never reads a freed block. Slots for new
  tokens are computed before that from the logical table, and positions (RoPE) are the logical ones.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from . import check_engine
from .plan import CONFIG_KEY, BlockEvictionPlan, BlockScores, EnginePlan, compact_block_table


class _RunnerHooks:
    """Per-step state between the scheduler's message, the attention layers and the model runner."""

    def __init__(self, runner, plan: BlockEvictionPlan) -> None:
        self.runner = runner
        self.plan = plan
        self.book = BlockScores(plan)
        self.evicted: dict[str, frozenset[int]] = {}
        self.scores: dict[str, dict[int, float]] = {}
        self._token_sum: torch.Tensor | None = None  # this step's token scores, summed over the layers so far
        self._heads = 0  # KV heads x layers summed into _token_sum
        execute, sample = runner.execute_model, runner.sample_tokens

        def execute_model(scheduler_output, *args, **kwargs):
            # sets, once per step: every quantized layer asks which of a request's blocks are gone
            self.evicted = {rid: frozenset(gone) for rid, gone in
                            (getattr(scheduler_output, "kvstack_evicted", None) or {}).items()}
            self._token_sum, self._heads = None, 0
            out = execute(scheduler_output, *args, **kwargs)
            self.scores = self.block_scores(scheduler_output)
            return self.attach(out)

        def sample_tokens(*args, **kwargs):
            return self.attach(sample(*args, **kwargs))

        runner.execute_model = execute_model
        runner.sample_tokens = sample_tokens

    def attach(self, out):
        if out is not None and hasattr(out, "sampled_token_ids"):  # the step's ModelRunnerOutput
            out.kvstack_block_scores, self.scores = self.scores, {}
        return out

    # ------------------------------------------------------------------ attention reads only the blocks held
    def wrap_builders(self) -> None:
        from .quantized import QuantizedAttentionMetadataBuilder

        for groups in self.runner.attn_groups:
            for group in groups:
                for builder in group.metadata_builders:
                    if isinstance(builder, QuantizedAttentionMetadataBuilder):
                        continue  # quantized pages read the logical table and skip the freed blocks themselves
                    builder.build = self._compacting(builder.build)

    def _compacting(self, build):
        def wrapped(common_prefix_len, common, *args, **kwargs):
            if self.evicted:
                common = self.compact(common)
                common_prefix_len = 0  # a shared prefix may have lost blocks in one request only
            return build(common_prefix_len, common, *args, **kwargs)

        return wrapped

    def compact(self, common):
        req_ids = self.runner.input_batch.req_ids
        rows = {i: self.evicted[rid] for i, rid in enumerate(req_ids[: common.num_reqs]) if rid in self.evicted}
        if not rows:
            return common
        bs = self.plan.block_size
        table, lens = compact_block_table(common.block_table_tensor, common.seq_lens, rows, bs)
        changes = {"block_table_tensor": table, "seq_lens": lens, "max_seq_len": int(lens[: common.num_reqs].max())}
        if common.seq_lens_cpu_upper_bound is not None:
            upper = common.seq_lens_cpu_upper_bound.clone()
            for row, gone in rows.items():
                upper[row] -= len(gone) * bs
            changes["seq_lens_cpu_upper_bound"] = upper
        return dataclasses.replace(common, **changes)

    # ------------------------------------------------------------------ scoring, as keys and values are written
    def hook_attention_layers(self) -> None:
        from vllm.model_executor.layers.attention import Attention

        layers = [m for m in self.runner.get_model().modules() if isinstance(m, Attention)]
        if not layers:
            raise ValueError("kvstack in vLLM: the model has no vllm Attention layers to score")
        if self.plan.position_only:  # scores from positions alone: nothing to read in the layers
            return
        for layer in layers:
            layer.register_forward_pre_hook(self._score_layer)

    @torch.inference_mode()
    def _score_layer(self, layer, args) -> None:
        _, key, value = args[:3]
        if key is None or value is None:  # a layer sharing another layer's cache writes nothing
            return
        keys = key.view(-1, layer.num_kv_heads, layer.head_size)
        values = value.view(-1, layer.num_kv_heads, layer.head_size_v)
        # summed over this rank's KV heads; block_scores divides by every rank's heads and layers
        scores = self.plan.token_scores(keys, values) * layer.num_kv_heads
        self._token_sum = scores if self._token_sum is None else self._token_sum + scores
        self._heads += layer.num_kv_heads

    def _mean_over_ranks(self) -> torch.Tensor:
        """Token scores averaged over every KV head of every layer: with tensor parallelism each rank holds some
        heads (or a replica), so sums and head counts are added across the ranks, which all run this step."""
        total = torch.cat([self._token_sum.float(), self._token_sum.new_tensor([self._heads], dtype=torch.float)])
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

        if get_tensor_model_parallel_world_size() > 1:
            total = tensor_model_parallel_all_reduce(total)
        return total[:-1] / total[-1]

    def block_scores(self, scheduler_output) -> dict[str, dict[int, float]]:
        """Scores of the blocks that became full in this step, per request: {logical index: score}."""
        for rid in scheduler_output.finished_req_ids:
            self.book.drop(rid)
        if self._token_sum is None and not self.plan.position_only:
            return {}
        per_token = None if self.plan.position_only else self._mean_over_ranks().cpu()
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        out: dict[str, dict[int, float]] = {}
        offset = 0  # a step's tokens are laid out request after request, in the batch's row order
        for rid in self.runner.input_batch.req_ids:
            n = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if n and rid in starts:
                start = starts[rid]
                scores = (self.plan.position_scores(start, n) if per_token is None
                          else per_token[offset : offset + n])
                filled = self.book.add(rid, start, scores)
                if filled:
                    out[rid] = filled
            offset += n
        return out

class KVStackWorker(CPUWorker):
    """vLLM's CPU worker, with the kvstack hooks on its model runner (block eviction) or kvstack's quantized
    attention on its layers (a quantize stage)."""

    def init_device(self):
        super().init_device()
        check_engine(self.vllm_config)
        self.kvstack_plan = EnginePlan.from_spec(
            self.vllm_config.additional_config[CONFIG_KEY], block_size=self.vllm_config.cache_config.block_size
        )
        eviction = self.kvstack_plan.eviction
        self.kvstack_hooks = None if eviction is None else _RunnerHooks(self.model_runner, eviction)
        self.kvstack_residual = None

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        if self.kvstack_plan.quantize is not None:  # before vLLM asks the layers for their KV cache spec
            from .quantized import install

            hooks, none = self.kvstack_hooks, frozenset()
            evicted_of = (lambda rid: none) if hooks is None else (lambda rid: hooks.evicted.get(rid, none))
            self.kvstack_residual = install(self.model_runner, self.kvstack_plan.quantize, self.kvstack_plan.block_size,
                                            self.vllm_config, evicted_of)

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"kvstack in vLLM: the model has {len(groups)} KV cache groups; one is supported")
        if self.kvstack_hooks is not None:
            self.kvstack_hooks.wrap_builders()
            self.kvstack_hooks.hook_attention_layers()

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self.kvstack_residual is not None:
            self.kvstack_residual.drop(scheduler_output.finished_req_ids)
        return self._with_residual(super().execute_model(scheduler_output, *args, **kwargs))

    def sample_tokens(self, *args, **kwargs):
        return self._with_residual(super().sample_tokens(*args, **kwargs))

    def _with_residual(self, out):
        if self.kvstack_residual is not None and out is not None and hasattr(out, "sampled_token_ids"):
            out.kvstack_residual_bytes = self.kvstack_residual.nbytes()  # for the scheduler's BlockStats
        return out
