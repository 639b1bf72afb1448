"""The vLLM side of kvstack's quantized tier: an attention backend whose pages hold KIVI codes (``paged_quant.py``).

``KVStackWorker`` puts :class:`QuantizedAttentionBackend` (bound to the engine's :class:`PagedQuantLayout`) and a
:class:`QuantizedAttentionImpl` on every ``Attention`` layer after the model is loaded, before vLLM asks the layers
for their KV cache spec. Through the backend's ``customize_spec`` vLLM then sizes every page as packed uint8 cells
(``state_content_bytes``): its pool holds ``1 / page_ratio`` times the blocks in the same memory, and the scheduler,
block tables and preemption work unchanged. The impl writes and reads the pages itself (vLLM's own cache write,
``do_kv_cache_update``, is skipped: ``forward_includes_kv_cache_update``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder

from .paged_quant import PagedQuantLayout, Residual, request_attention


@dataclass
class QuantizedAttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: list[int]  # [num_reqs + 1], host side: the step's tokens are laid out request after request
    seq_lens: list[int]  # tokens of each request after the step
    block_table: torch.Tensor  # [>= num_reqs, W] logical block tables


class QuantizedAttentionMetadataBuilder(AttentionMetadataBuilder[QuantizedAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common, fast_build: bool = False) -> QuantizedAttentionMetadata:
        n = common.num_reqs
        return QuantizedAttentionMetadata(
            num_reqs=n, num_actual_tokens=common.num_actual_tokens,
            query_start_loc=common.query_start_loc_cpu[: n + 1].tolist(),
            seq_lens=common.seq_lens[:n].cpu().tolist(), block_table=common.block_table_tensor,
        )


class QuantizedAttentionBackend(AttentionBackend):
    """Pages of KIVI codes; bound to one engine's layout by :func:`backend_for`."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True  # the impl quantizes and writes after attention
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]
    layout: ClassVar[PagedQuantLayout]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return QuantizedAttentionImpl

    @staticmethod
    def get_builder_cls():
        return QuantizedAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        from vllm.v1.kv_cache_interface import KVCacheLayout

        return (KVCacheLayout.LBHNC,)  # a (block, KV head) region is one contiguous run of bytes

    @classmethod
    def customize_spec(cls, spec):
        return replace(spec, dtype=torch.uint8, state_content_bytes=cls.layout.cell_bytes)


def backend_for(layout: PagedQuantLayout) -> type[QuantizedAttentionBackend]:
    return type("QuantizedAttentionBackend", (QuantizedAttentionBackend,), {"layout": layout})


class QuantizedAttentionImpl(AttentionImpl):
    """Each request of a step: attention over its pages, its residual and the step's tokens
    (``paged_quant.request_attention``), then the tokens leaving the residual go into its pages."""

    def __init__(self, stock: AttentionImpl, layout: PagedQuantLayout, layer_idx: int, residual: Residual,
                 request_ids, evicted_of) -> None:
        self.num_heads, self.head_size, self.num_kv_heads = stock.num_heads, stock.head_size, stock.num_kv_heads
        self.scale = float(stock.scale)
        self.kv_cache_dtype = stock.kv_cache_dtype
        self.softcap = getattr(stock, "logits_soft_cap", None) or None
        self.layout, self.layer_idx, self.residual, self.request_ids = layout, layer_idx, residual, request_ids
        self.evicted_of = evicted_of  # request id -> logical indices of its blocks freed by block eviction
        self.codec = layout.codec(layer_idx)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvstack's quantized pages: fused output quantization is not supported")
        if attn_metadata is None:  # profiling and warm-up runs: no cache yet
            return output
        meta: QuantizedAttentionMetadata = attn_metadata
        ids = self.request_ids()
        for row in range(meta.num_reqs):
            a, b = meta.query_start_loc[row], meta.query_start_loc[row + 1]
            if a == b:
                continue
            seen = meta.seq_lens[row] - (b - a)
            before = self.layout.quantized_count(seen)
            held = self.residual.get(ids[row], self.layer_idx, before, seen, key[a:b], value[a:b])
            out, (start, keys, values) = request_attention(
                self.layout, self.codec, self.layer_idx, query[a:b], key[a:b], value[a:b], kv_cache,
                meta.block_table[row], seen, held, scaling=self.scale, softcap=self.softcap,
                evicted=self.evicted_of(ids[row]),
            )
            output[a:b] = out.to(output.dtype)
            self.residual.put(ids[row], self.layer_idx, start, keys, values)
        return output


def install(runner, spec, block_size: int, vllm_config, evicted_of=lambda request: frozenset()) -> Residual:
    """Put the quantized backend and impl on every ``Attention`` layer of ``runner``'s model; returns the residual
    store the layers share (the worker drops finished requests from it). ``evicted_of(request id)``: the logical
    indices of the request's blocks freed by block eviction (the impl reads the logical block table and skips
    them)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    layers = [m for m in runner.get_model().modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError("kvstack in vLLM: the model has no vllm Attention layers to quantize")
    cache_dtype = vllm_config.cache_config.cache_dtype
    for layer in layers:
        impl = layer.impl
        problems = {
            f"kv_cache_dtype={cache_dtype!r} (kvstack's pages hold their own codes: 'auto')": cache_dtype != "auto",
            "a sliding window": getattr(impl, "sliding_window", -1) not in (None, -1),
            "ALiBi": getattr(impl, "alibi_slopes", None) is not None,
            "attention sinks": getattr(impl, "sinks", None) is not None,
            "layers sharing a KV cache": layer.kv_sharing_target_layer_name is not None,
        }
        bad = [name for name, is_bad in problems.items() if is_bad]
        if bad:
            raise ValueError(f"kvstack's quantize stage in vLLM does not support {', '.join(bad)} ({layer.layer_name})")
    model = vllm_config.model_config
    layout = PagedQuantLayout.from_config(spec, model.hf_config, model.dtype, layers[0].num_kv_heads, block_size)
    backend = backend_for(layout)
    residual = Residual()
    request_ids = lambda: runner.input_batch.req_ids  # noqa: E731  (rows as the step's metadata orders them)
    for layer in layers:
        layer.attn_backend = backend
        layer.impl = QuantizedAttentionImpl(layer.impl, layout, extract_layer_index(layer.layer_name), residual,
                                            request_ids, evicted_of)
    return residual
