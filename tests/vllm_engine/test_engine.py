"""kvstack's block eviction inside vLLM's CPU engine, against an independent transformers reference (reference.py).

Each engine runs in its own process (``kvstack.bench.vllm_serving.run_in_subprocess``). The model is a small random
Llama with head_dim 64 (vLLM's CPU attention takes head sizes from 32) and peaked logits, in float32, so greedy
tokens are stable and the comparison is exact in tokens and tight in log-probabilities.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstack.bench.vllm_serving import run_in_subprocess

from reference import generate, generate_kvstack

BLOCK = 32


def test_a_block_size_the_cpu_kernel_cannot_read_is_refused_before_an_engine_starts():
    from kvstack import SpecError
    from kvstack.integrations.vllm import engine_args

    with pytest.raises(SpecError, match="block_size=16 is not allowed on vLLM's CPU build: a multiple of 32"):
        engine_args("paged-eviction")  # the preset's 16-token blocks
    assert engine_args("paged-eviction", block_size=32)["block_size"] == 32


def _tiny_llama(path, heads, kv_heads, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64 * heads, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=2048,
        initializer_range=0.3, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"), heads=2, kv_heads=1, seed=0)


def _engine(model, stack, prompts, max_tokens, **kwargs):
    kwargs = {"max_model_len": 1024, **kwargs}
    return run_in_subprocess(model=model, stack=stack, prompts=prompts, max_tokens=max_tokens, dtype="float32",
                             block_size=BLOCK, logprobs=True, tokenizer=False, **kwargs)


def _stack(budget, **evict):
    return {"name": "test", "budget": budget,
            "stages": [{"kind": "evict", "granularity": "block", "block_size": BLOCK, **evict}]}


PROMPTS = [list(range(1, 300)), [(7 * i) % 500 + 1 for i in range(150)], list(range(100, 140))]


@pytest.fixture(scope="module")
def tokens_run(tiny_llama):
    stack = _stack({"tokens": 128}, scorer="value_key_ratio")
    return _engine(tiny_llama, stack, PROMPTS, 24)


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_batched_requests_match_the_reference(tiny_llama, tokens_run, index):
    """Three requests in one batch (two evict, the short one never does): each one's greedy tokens equal the
    reference's, and its log-probabilities agree; where eviction acts, the output differs from the full cache's."""
    ref_tokens, ref_logprobs = generate(tiny_llama, PROMPTS[index], max_tokens=24, block_size=BLOCK,
                                        budget={"tokens": 128})
    out = tokens_run["outputs"][index]
    assert out["token_ids"] == ref_tokens
    assert out["logprobs"] == pytest.approx(ref_logprobs, abs=2e-3)
    full_tokens, _ = generate(tiny_llama, PROMPTS[index], max_tokens=24, block_size=BLOCK, budget={"tokens": 10**6})
    evicts = len(PROMPTS[index]) + 24 > 128
    assert (full_tokens != ref_tokens) == evicts  # the comparison can fail: eviction changes this model's output


def test_budget_holds_and_blocks_return_to_the_pool(tokens_run):
    stats = tokens_run["stats"]
    assert stats["blocks_freed"] > 0
    assert stats["steps_over_budget"] == 0
    assert stats["max_held_blocks"] == 128 // BLOCK
    # all three requests together never held more than their budgets after a step: 4 + 4 + 2 blocks
    assert stats["peak_blocks_in_use"] <= 4 + 4 + 2
    # ... where the full cache of the same requests needs ceil(322/32) + ceil(173/32) + ceil(63/32) = 11 + 6 + 2
    assert stats["peak_blocks_during_step"] < 11 + 6 + 2
    assert stats["free_blocks_at_end"] == tokens_run["num_blocks"]  # nothing leaked


def test_each_request_reports_its_blocks_against_the_uncompressed_ones(tokens_run):
    """The per-request report: its tokens at the last step, its budget kept after every step, and the blocks stock
    vLLM holds for those tokens (322, 173 and 63 tokens: 11, 6 and 2 blocks)."""
    reports = [out["kv_report"] for out in tokens_run["outputs"]]
    for prompt, out, report in zip(PROMPTS, tokens_run["outputs"], reports):
        assert report["tokens"] == len(prompt) + len(out["token_ids"]) - 1  # the last token is never computed
        assert report["uncompressed_blocks"] == -(-report["tokens"] // BLOCK)
        assert report["allowed_blocks"] == 128 // BLOCK
        assert report["peak_blocks"] <= report["allowed_blocks"]
        assert report["page_ratio"] == 1.0 and report["preemptions"] == 0
    assert [r["uncompressed_blocks"] for r in reports] == [11, 6, 2]
    assert [r["blocks_held"] for r in reports] == [4, 4, 2]
    assert [r["blocks_freed"] for r in reports] == [7, 2, 0]  # the held and freed blocks make up every block
    assert sum(r["blocks_freed"] for r in reports) == tokens_run["stats"]["blocks_freed"]


def test_chunked_prefill_ratio_budget_and_protected_blocks(tiny_llama):
    """A 400-token prompt prefilled in 96-token chunks, evicting between chunks (causal masking over a compacted
    table), with sinks, a recent window, key_norm, min-aggregation and a ratio budget."""
    evict = dict(scorer="key_norm", n_sink=4, recent=40, aggregate="min")
    prompt = [(11 * i) % 500 + 1 for i in range(400)]
    stack = _stack({"ratio": 0.25}, head_wise=False, **evict)
    run = _engine(tiny_llama, stack, [prompt], 20, max_num_batched_tokens=96)
    ref_tokens, ref_logprobs = generate(tiny_llama, prompt, max_tokens=20, block_size=BLOCK, budget={"ratio": 0.25},
                                        chunk=96, **evict)
    out = run["outputs"][0]
    assert out["token_ids"] == ref_tokens
    assert out["logprobs"] == pytest.approx(ref_logprobs, abs=2e-3)
    assert run["stats"]["blocks_freed"] > 0
    assert run["stats"]["steps_over_budget"] == 0


def test_requests_at_once_grow_with_the_compression_at_a_fixed_pool(tiny_llama):
    """Six 300-token prompts, prefilled side by side in 64-token chunks, on a pool of 24 blocks (about two
    uncompressed requests): the requests running at once (mean over steps) grow as the budget shrinks, with fewer
    preemptions and steps, and each budget holds."""
    prompts = [[(13 * i + 5 * r) % 500 + 1 for i in range(300)] for r in range(6)]
    settings = dict(num_blocks=24, max_model_len=512, max_num_batched_tokens=512, long_prefill_token_threshold=64)
    runs = {ratio: _engine(tiny_llama, ratio and _stack({"ratio": ratio}, scorer="value_key_ratio"), prompts, 16,
                           **settings)["stats"] for ratio in (None, 0.5, 0.25)}
    stock, half, quarter = runs[None], runs[0.5], runs[0.25]
    assert stock["peak_request_blocks_during_step"] == -(-(300 + 16) // BLOCK)  # a whole request: 10 blocks
    # vLLM admits every prompt's first chunk while blocks are free and preempts when the pool runs out, so the
    # most requests at once is 6 for each; the mean over steps is what the pool sustains
    mean = {ratio: run["running_steps"] / run["steps"] for ratio, run in runs.items()}
    assert mean[None] < mean[0.5] < mean[0.25]
    assert stock["preemptions"] > half["preemptions"] > quarter["preemptions"]
    assert stock["steps"] > half["steps"] > quarter["steps"]
    assert quarter["peak_request_blocks_during_step"] <= 316 // 4 // BLOCK + 64 // BLOCK  # budget + one chunk
    assert half["steps_over_budget"] == quarter["steps_over_budget"] == 0


def test_window_scores_are_positions(tiny_llama):
    """``scorer: window`` with sinks (StreamingLLM on blocks): scores are the tokens' positions, read by no layer;
    the engine keeps the sink block and the newest ones, as the reference does."""
    stack = _stack({"tokens": 128}, scorer="window", n_sink=4)
    run = _engine(tiny_llama, stack, [PROMPTS[0]], 24)
    ref_tokens, ref_logprobs = generate(tiny_llama, PROMPTS[0], max_tokens=24, block_size=BLOCK,
                                        budget={"tokens": 128}, scorer="window", n_sink=4)
    other, _ = generate(tiny_llama, PROMPTS[0], max_tokens=24, block_size=BLOCK, budget={"tokens": 128})
    assert run["outputs"][0]["token_ids"] == ref_tokens != other  # a different selection than value_key_ratio's
    assert run["outputs"][0]["logprobs"] == pytest.approx(ref_logprobs, abs=2e-3)
    assert run["stats"]["steps_over_budget"] == 0


def test_tensor_parallel_ranks_score_every_kv_head(tmp_path, monkeypatch):
    """Two ranks, one KV head each: a block's score averages both heads (summed across the ranks), so the engine
    matches the single-process reference (with rank 0's head alone it does not: the test fails when the sum across
    ranks is removed)."""
    model = _tiny_llama(tmp_path / "two-kv-heads", heads=4, kv_heads=2, seed=1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one NUMA node here: let the two workers share it
    run = _engine(model, _stack({"tokens": 128}, scorer="value_key_ratio"), [PROMPTS[0]], 24, tensor_parallel_size=2)
    ref_tokens, _ = generate(model, PROMPTS[0], max_tokens=24, block_size=BLOCK, budget={"tokens": 128})
    full_tokens, _ = generate(model, PROMPTS[0], max_tokens=24, block_size=BLOCK, budget={"tokens": 10**6})
    assert run["outputs"][0]["token_ids"] == ref_tokens != full_tokens
    assert run["stats"]["steps_over_budget"] == 0


@pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU fp8 KV cache needs x86 with AVX-512 or AMX, which this CPU lacks (vLLM refuses to start)",
)
def test_eviction_composes_with_vllms_fp8_cache(tiny_llama):
    """vLLM's own fp8 KV cache under the same stack: blocks cost half, the pool holds twice as many, eviction and
    its budget work the same (the scores are taken before the cache write, from the model-dtype keys)."""
    stack = _stack({"tokens": 128}, scorer="value_key_ratio")
    runs = {dtype: run_in_subprocess(model=tiny_llama, stack=stack, prompts=[PROMPTS[0]], max_tokens=16,
                                     dtype="bfloat16", block_size=BLOCK, max_model_len=1024, tokenizer=False,
                                     kv_cache_dtype=dtype) for dtype in ("auto", "fp8_e4m3")}
    assert runs["fp8_e4m3"]["block_bytes"] * 2 == runs["auto"]["block_bytes"]
    for run in runs.values():
        assert run["stats"]["blocks_freed"] == runs["auto"]["stats"]["blocks_freed"] > 0
        assert run["stats"]["steps_over_budget"] == 0
        assert run["stats"]["max_held_blocks"] == 128 // BLOCK


# ------------------------------------------------------------------------------------------- quantized pages
KIVI_4 = {"name": "kivi-4-test", "stages": [{"kind": "quantize", "bits": 4, "group_size": 32,
                                            "value_group_size": "head_dim", "residual": 32}]}
#: every precision option at once, key groups of half a block, a residual of one group, prefilled in chunks
KIVI_3_OPTIONS = {"name": "kivi-3-test", "stages": [{
    "kind": "quantize", "bits": 3, "group_size": 16, "value_group_size": 32, "residual": 16, "rotate": "hadamard",
    "key_rope": "pre", "codebook": "nf", "scale_dtype": "float16"}]}


def _layout(model, stack):
    from transformers import AutoConfig

    from kvstack.integrations.vllm.paged_quant import PagedQuantLayout
    from kvstack.stack.shape import ModelShape
    from kvstack.stack.spec import StackSpec

    config = AutoConfig.from_pretrained(model)
    shape = ModelShape.from_config(config, torch.float32)
    return PagedQuantLayout(StackSpec.load(stack).stages[0], shape, config.num_key_value_heads, BLOCK)


@pytest.fixture(scope="module")
def kivi_run(tiny_llama):
    return _engine(tiny_llama, KIVI_4, PROMPTS, 24)


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_quantized_pages_match_kvstacks_own_cache(tiny_llama, kivi_run, index):
    """KIVI-4 in vLLM's pages, three requests batched: each request's greedy tokens are those of kvstack's own
    transformers cache with the same stack, log-probabilities within 2e-3; quantization changes the long prompts'
    outputs (so the comparison can fail)."""
    ref_tokens, ref_logprobs = generate_kvstack(tiny_llama, KIVI_4, PROMPTS[index], max_tokens=24)
    out = kivi_run["outputs"][index]
    assert out["token_ids"] == ref_tokens
    assert out["logprobs"] == pytest.approx(ref_logprobs, abs=2e-3)
    if len(PROMPTS[index]) > 100:
        full, _ = generate_kvstack(tiny_llama, {"name": "full", "stages": []}, PROMPTS[index], max_tokens=24)
        assert full != ref_tokens


def test_quantized_pages_are_smaller_blocks_of_the_same_pool(tiny_llama, kivi_run):
    """A page holds the layout's bytes (codes, scales, zero points of 32 tokens: 88 of the 512 bytes per token and
    KV head in float32), so the same KV space holds 512 / 88 times the blocks; the residual (at most 32 + 31 tokens
    per request and layer) is what stays outside the pool."""
    layout = _layout(tiny_llama, KIVI_4)
    assert layout.cell_bytes == 88 and layout.full_cell_bytes == 512
    layers = 2
    assert kivi_run["block_bytes"] == layers * BLOCK * layout.cell_bytes
    assert kivi_run["num_blocks"] == (1 << 30) // kivi_run["block_bytes"] - 1  # VLLM_CPU_KVCACHE_SPACE=1 GiB
    residual_cap = len(PROMPTS) * layers * (32 + 31) * layout.full_cell_bytes
    assert 0 < kivi_run["stats"]["peak_residual_bytes"] <= residual_cap
    for prompt, out in zip(PROMPTS, kivi_run["outputs"]):  # every block held, each at 88 / 512 of the bytes
        report = out["kv_report"]
        assert report["blocks_held"] == report["uncompressed_blocks"] == -(-(len(prompt) + 23) // BLOCK)
        assert report["page_ratio"] == 88 / 512 and report["allowed_blocks"] is None and report["blocks_freed"] == 0


def test_quantized_pages_with_every_precision_option_in_prefill_chunks(tiny_llama):
    """3-bit normal-float codes, Hadamard rotation, pre-RoPE keys, fp16 scales, key groups of 16 in 32-token blocks,
    a 400-token prompt prefilled 96 tokens per step: the same tokens as kvstack's cache prefilling 96 per forward."""
    prompt = [(11 * i) % 500 + 1 for i in range(400)]
    run = _engine(tiny_llama, KIVI_3_OPTIONS, [prompt], 24, max_num_batched_tokens=96, long_prefill_token_threshold=96)
    ref_tokens, ref_logprobs = generate_kvstack(tiny_llama, KIVI_3_OPTIONS, prompt, max_tokens=24, chunk=96)
    assert run["outputs"][0]["token_ids"] == ref_tokens
    assert run["outputs"][0]["logprobs"] == pytest.approx(ref_logprobs, abs=2e-3)
    plain = {"name": "plain-3", "stages": [{**KIVI_3_OPTIONS["stages"][0], "rotate": "none", "key_rope": "post"}]}
    assert generate_kvstack(tiny_llama, plain, prompt, max_tokens=24, chunk=96)[0] != ref_tokens  # options act


def test_quantized_pages_hold_more_requests_in_the_same_bytes(tiny_llama):
    """Six 300-token prompts, a pool of 24 uncompressed blocks' bytes (about two requests): with KIVI-4 pages the
    same bytes are 139 blocks, so more requests run at once, with fewer preemptions and steps."""
    prompts = [[(13 * i + 5 * r) % 500 + 1 for i in range(300)] for r in range(6)]
    settings = dict(max_model_len=512, max_num_batched_tokens=512, long_prefill_token_threshold=64)
    layout = _layout(tiny_llama, KIVI_4)
    stock = _engine(tiny_llama, None, prompts, 16, num_blocks=24, **settings)
    same_bytes = 24 * layout.full_cell_bytes // layout.cell_bytes
    quantized = _engine(tiny_llama, KIVI_4, prompts, 16, num_blocks=same_bytes, **settings)
    # num_blocks counts the usable blocks: the pool has one more (vLLM's null block)
    assert (quantized["num_blocks"] + 1) * quantized["block_bytes"] <= 24 * stock["block_bytes"]
    s, q = stock["stats"], quantized["stats"]
    assert s["running_steps"] / s["steps"] < q["running_steps"] / q["steps"]
    assert s["preemptions"] > q["preemptions"] == 0
    assert s["steps"] > q["steps"]


def test_quantized_pages_under_tensor_parallelism(tmp_path, monkeypatch):
    """Two ranks, one KV head each: every rank quantizes and reads its own heads' pages (codes and scales are per
    head), so the engine matches kvstack's single-process cache: the same tokens; log-probabilities within 1e-2
    (the ranks' all-reduce sums in another order, and a key or value at a rounding boundary then takes the next
    code)."""
    model = _tiny_llama(tmp_path / "two-kv-heads", heads=4, kv_heads=2, seed=1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    run = _engine(model, KIVI_4, [PROMPTS[0]], 24, tensor_parallel_size=2)
    ref_tokens, ref_logprobs = generate_kvstack(model, KIVI_4, PROMPTS[0], max_tokens=24)
    full, _ = generate_kvstack(model, {"name": "full", "stages": []}, PROMPTS[0], max_tokens=24)
    assert run["outputs"][0]["token_ids"] == ref_tokens != full
    assert run["outputs"][0]["logprobs"] == pytest.approx(ref_logprobs, abs=1e-2)


def test_block_eviction_over_quantized_pages_in_one_cache(tiny_llama):
    """The two composed: blocks leave by Algorithm 1 and the blocks held are KIVI-4 pages, under one ``ratio: 0.25``
    of the bytes (the residual's full-precision tokens paid first, a block at 88/512 of an uncompressed one). Two
    requests batched: the engine's tokens are the reference's (eviction on a transformers cache whose tokens beyond
    the residual become their dequantized values), the budget holds after every step, and the composition differs
    from eviction alone (more blocks held, quantized) and from quantization alone. (The prompts are long enough for
    the budget: the residual and its blocks alone are about 80 tokens' bytes, more than a quarter of a 150-token
    request.)"""
    evict = {"kind": "evict", "granularity": "block", "block_size": BLOCK, "scorer": "value_key_ratio"}
    stack = {"name": "evict-kivi", "budget": {"ratio": 0.25}, "stages": [evict, KIVI_4["stages"][0]]}
    prompts = [PROMPTS[0], [(3 * i) % 500 + 1 for i in range(420)]]
    run = _engine(tiny_llama, stack, prompts, 24)
    layout = _layout(tiny_llama, KIVI_4)
    kivi = {"bits": 4, "group_size": 32, "value_group": 64, "residual": 32, "cell": layout.cell_bytes,
            "full_cell": layout.full_cell_bytes}
    for prompt, out in zip(prompts, run["outputs"]):
        ref_tokens, ref_logprobs = generate(tiny_llama, prompt, max_tokens=24, block_size=BLOCK,
                                            budget={"ratio": 0.25}, kivi=kivi)
        assert out["token_ids"] == ref_tokens
        assert out["logprobs"] == pytest.approx(ref_logprobs, abs=2e-3)
    evict_only, _ = generate(tiny_llama, prompts[0], max_tokens=24, block_size=BLOCK, budget={"ratio": 0.25})
    quantize_only, _ = generate_kvstack(tiny_llama, KIVI_4, prompts[0], max_tokens=24)
    assert run["outputs"][0]["token_ids"] != evict_only and run["outputs"][0]["token_ids"] != quantize_only
    assert run["stats"]["blocks_freed"] > 0 and run["stats"]["steps_over_budget"] == 0


def test_the_example_serves_the_shared_smollm2(smollm2_source):
    """examples/vllm/serve_paged_eviction.py answers two chat prompts with SmolLM2, evicting blocks during decode."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(root / "examples/vllm/serve_paged_eviction.py"), "--model", str(smollm2_source),
         "--budget", "128", "--max-tokens", "120"],
        capture_output=True, text=True, timeout=900, cwd=root,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    freed = int(result.stdout.split("blocks freed back to vLLM's pool: ")[1].split(";")[0])
    assert freed > 0 and "steps over budget: 0" in result.stdout
    assert "most blocks one request held: 4 (budget 4" in result.stdout
