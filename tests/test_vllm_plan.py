"""The vLLM integration's policy, in kvstack's own environment (no vLLM): which specs run, Algorithm 1 on blocks,
block scores, the compacted block table attention reads, and the engine settings. The engine itself is tested
in tests/vllm_engine/ (its own virtual environment)."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack import SpecError
from kvstack.integrations.vllm import (
    SCHEDULER, WORKER, BlockEvictionPlan, EnginePlan, check_engine, compact_block_table, engine_args, engine_stats,
    serve_config,
)
from kvstack.integrations.vllm.plan import CONFIG_KEY, BlockScores


def stack(budget=None, stages=None, **evict):
    evict = {"kind": "evict", "granularity": "block", "block_size": 32, "scorer": "value_key_ratio", **evict}
    return {"name": "t", "budget": budget or {"tokens": 128}, "stages": stages if stages is not None else [evict]}


# ------------------------------------------------------------------------------------------------ which specs run
def test_paged_eviction_preset_runs_with_the_engines_block_size():
    plan = BlockEvictionPlan.from_spec("paged-eviction", block_size=32)
    assert (plan.block_size, plan.budget.tokens, plan.stage.scorer) == (32, 136, "value_key_ratio")
    assert plan.allowed_blocks(10_000) == 136 // 32


@pytest.mark.parametrize(
    "source, message",
    [
        ("quantized-pruning-3", "stages.0.kind='quantized_prune' is not allowed in vLLM yet (quantized pruning keeps "
                                "tokens at several precisions"),
        ("max-compression", "is not allowed in vLLM yet"),
        (stack(stages=[]), "has no stages"),
        (stack(granularity="token"), "stages.0.granularity='token' is not allowed in vLLM: 'block'"),
        (stack(scorer="snapkv"), "stages.0.scorer='snapkv' is not allowed in vLLM: it reads attention weights"),
        (stack(scorer="key_norm"), "stages.0.head_wise=True (the default of scorer 'key_norm') is not allowed in vLLM"),
        (stack(schedule="pyramid"), "stages.0.schedule='pyramid' is not allowed in vLLM: 'uniform'"),
        (stack(layer_weights={0: 2}), r"stages.0.layer_weights=\{0: 2.0\} is not allowed in vLLM: None"),
        (stack(spill_unused=True), "stages.0.spill_unused=True is not allowed in vLLM: False"),
        (stack(every=4), "stages.0.every=4 is not allowed in vLLM: 1"),
        (stack(budget={"tokens": 16}), "budget.tokens=16 is not allowed: at least one block (block_size = 32)"),
        ({**stack(), "prefill_chunk": 256}, "prefill_chunk=256 is not allowed in vLLM: None"),
    ],
)
def test_specs_vllm_cannot_run_are_refused_with_the_field(source, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EnginePlan.from_spec(source)


KIVI = {"name": "k", "stages": [{"kind": "quantize", "bits": 4, "group_size": 32, "residual": 32}]}


def test_a_quantize_stage_alone_runs_as_quantized_pages():
    plan = EnginePlan.from_spec("kivi-3")
    assert (plan.eviction, plan.quantize.bits, plan.block_size) == (None, 3, 32)
    assert EnginePlan.from_spec("kivi-3", block_size=64).block_size == 64
    evict = EnginePlan.from_spec(stack())
    assert evict.quantize is None and evict.eviction.budget.tokens == 128


@pytest.mark.parametrize(
    "source, kwargs, message",
    [
        ({**KIVI, "budget": {"ratio": 0.25}}, {}, "budget={'ratio': 0.25} is not allowed in vLLM with a quantize "
                                                  "stage alone: none"),
        (KIVI, {"budget": {"tokens": 512}}, "budget={'tokens': 512} is not allowed in vLLM with a quantize stage"),
        (KIVI, {"block_size": 48}, "block_size=48 is not allowed with stages.0.group_size=32: a multiple of "
                                   "group_size"),
        ({**KIVI, "stages": [{"kind": "quantize", "bits": 16}]}, {}, "stages.0.bits=16 is not allowed in vLLM: 2, 3, "
                                                                      "4 or 8"),
        ({**KIVI, "prefill_chunk": 128}, {}, "prefill_chunk=128 is not allowed in vLLM: None"),
        ({**KIVI, "stages": [{**KIVI["stages"][0], "coding": "transform", "key_rope": "pre"}]}, {},
         "stages.0.coding='transform' is not allowed in vLLM yet: 'kivi'"),
        (stack(stages=[KIVI["stages"][0], stack()["stages"][0]]), {},
         "stages.0.kind='quantize' is not allowed in vLLM yet (a quantize stage runs alone or after one evict stage"),
        (stack(stages=[stack()["stages"][0], {**KIVI["stages"][0], "group_size": 64, "residual": 64}]), {},
         "block_size=32 is not allowed with stages.1.group_size=64"),
    ],
)
def test_quantized_pages_refuse_what_they_cannot_run(source, kwargs, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EnginePlan.from_spec(source, **kwargs)


def test_eviction_over_quantized_pages_budgets_bytes():
    """``ratio: 0.25`` over KIVI-4 pages (76 of 256 bytes per token and KV head, bf16): the residual's
    full-precision tokens are paid first, then blocks at 76/256 of an uncompressed one; only blocks wholly in the
    pages may leave."""
    from kvstack.integrations.vllm.paged_quant import PagedQuantLayout
    from transformers import LlamaConfig

    kivi = {**KIVI["stages"][0], "value_group_size": "head_dim"}
    composed = stack(budget={"ratio": 0.25}, stages=[stack()["stages"][0], kivi])
    plan = EnginePlan.from_spec(composed)
    assert [s.kind for s in plan.spec.stages] == ["evict", "quantize"] and plan.quantize.bits == 4
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         num_hidden_layers=2, vocab_size=64)
    layout = PagedQuantLayout.from_config(plan.quantize, config, torch.bfloat16, 3, 32)
    eviction = plan.eviction.with_pages(layout)
    for seen in (100, 1000, 4096, 10_000):
        residual = seen - layout.quantized_count(seen)
        blocks = eviction.allowed_blocks(seen)
        assert blocks == max(int((0.25 * seen - residual) * 256 / (32 * 76) + 1e-9), 1)
        if blocks > 1:  # the bytes held stay within the budget
            assert blocks * 32 * 76 + residual * 256 <= 0.25 * seen * 256
    assert layout.cell_bytes == 76
    # 4096 tokens: 32 in the residual, (1024 - 32) tokens' bytes left for pages: 104 blocks, against 32 unquantized
    assert eviction.allowed_blocks(4096) == 104 > plan.eviction.allowed_blocks(4096) == 32
    seen = 32 * 10 + 5  # 10 full blocks; tokens 0..287 in the pages (the residual holds 288..324: block 9 and 10)
    scores = {j: float(-j) for j in range(10)}  # newer blocks rank lower: without pages block 9 would go first
    victims = eviction.victims(scores, list(range(11)), seen)
    assert layout.quantized_count(seen) == 288 and victims == [8, 7, 6, 5, 4, 3, 2]
    assert plan.eviction.victims(scores, list(range(11)), seen)[0] == 9


def test_window_scores_positions_and_reads_no_layer():
    window = BlockEvictionPlan.from_spec(stack(scorer="window", n_sink=4))
    assert window.position_only and not BlockEvictionPlan.from_spec(stack()).position_only
    assert window.position_scores(100, 3).tolist() == [100.0, 101.0, 102.0]


def test_a_new_block_size_is_checked_against_the_budget():
    with pytest.raises(SpecError, match="at least one block"):
        BlockEvictionPlan.from_spec(stack(budget={"tokens": 40}), block_size=64)
    assert BlockEvictionPlan.from_spec(stack(budget={"tokens": 40}), block_size=32).allowed_blocks(500) == 1


# ------------------------------------------------------------------------------------------------ Algorithm 1
@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(32, 2000), ratio=st.floats(0.01, 1.0), use_ratio=st.booleans(), seen=st.integers(1, 5000),
    bs=st.sampled_from([32, 64, 128]),
)
def test_allowed_blocks_keep_the_budget(tokens, ratio, use_ratio, seen, bs):
    budget = {"ratio": ratio} if use_ratio else {"tokens": max(tokens, bs)}
    plan = BlockEvictionPlan.from_spec(stack(budget=budget, block_size=bs), block_size=bs)
    allowed = plan.allowed_blocks(seen)
    assert allowed >= 1  # the newest block is always held
    limit = ratio * seen if use_ratio else max(tokens, bs)
    assert allowed * bs <= max(limit, bs) + 1e-6  # whole blocks within the budget (one block at least)
    assert (allowed + 1) * bs > limit  # and no block more could be held


@settings(max_examples=300, deadline=None)
@given(data=st.data(), seen=st.integers(1, 1200), n_sink=st.integers(0, 70), recent=st.integers(0, 200),
       budget=st.integers(32, 400))
def test_victims_follow_algorithm_1(data, seen, n_sink, recent, budget):
    bs = 32
    budget = max(budget, n_sink + recent)  # the spec itself refuses a budget below its protected tokens
    plan = BlockEvictionPlan.from_spec(stack(budget={"tokens": budget}, n_sink=n_sink, recent=recent))
    n_blocks = -(-seen // bs)
    newest = n_blocks - 1
    older = data.draw(st.lists(st.integers(0, newest - 1), max_size=n_blocks)) if newest else []
    held = sorted(set(older)) + [newest]
    scores = {j: data.draw(st.floats(-5, 5)) for j in held if j != newest}
    victims = plan.victims(scores, held, seen)
    assert len(victims) == max(0, len(held) - plan.allowed_blocks(seen))
    assert newest not in victims and set(victims) <= set(held)
    assert len(held) - len(victims) <= plan.allowed_blocks(seen)

    def protected(j):
        return j < -(-n_sink // bs) or (recent > 0 and j >= (seen - recent) // bs)

    kept = [j for j in held if j not in victims and j != newest]
    for v in victims:  # every victim ranks below every kept block: protection first, then the score
        for k in kept:
            assert (protected(v), scores[v]) <= (protected(k), scores[k])


def test_victims_by_hand():
    plan = BlockEvictionPlan.from_spec(stack(budget={"tokens": 96}, n_sink=4))  # 3 blocks
    scores = {0: -9.0, 1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3}
    # 6 blocks held, 3 allowed: block 0 holds the sinks (protected), block 5 is the newest
    assert plan.victims(scores, [0, 1, 2, 3, 4, 5], seen=170) == [2, 4, 1]
    assert plan.victims(scores, [0, 3, 5], seen=170) == []
    one_block = BlockEvictionPlan.from_spec(stack(budget={"tokens": 32}))
    with pytest.raises(RuntimeError, match="block 4 of a request has no score"):
        one_block.victims({0: 1.0}, [0, 4, 5], seen=170)


# ------------------------------------------------------------------------------------------------ scores
def test_token_scores_are_the_scorers_on_one_layer():
    plan = BlockEvictionPlan.from_spec(stack())
    keys, values = torch.randn(10, 3, 64), torch.randn(10, 3, 64)
    expected = (values.norm(dim=-1) / keys.norm(dim=-1)).mean(1)
    assert torch.allclose(plan.token_scores(keys, values), expected, atol=1e-6)
    norm = BlockEvictionPlan.from_spec(stack(scorer="key_norm", head_wise=False))
    assert torch.allclose(norm.token_scores(keys, values), -keys.norm(dim=-1).mean(1), atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(total=st.integers(1, 300), cuts=st.lists(st.integers(1, 80), min_size=1, max_size=30),
       aggregate=st.sampled_from(["mean", "min", "max"]))
def test_block_scores_do_not_depend_on_how_the_steps_cut_the_tokens(total, cuts, aggregate):
    plan = BlockEvictionPlan.from_spec(stack(aggregate=aggregate))
    scores = torch.randn(total)
    book, got, start = BlockScores(plan), {}, 0
    while start < total:
        n = min(cuts[len(got) % len(cuts)], total - start)
        got.update(book.add("r", start, scores[start : start + n]))
        start += n
    reduce = {"mean": torch.mean, "min": torch.amin, "max": torch.amax}[aggregate]
    assert got.keys() == set(range(total // 32))
    for j, s in got.items():
        assert s == pytest.approx(float(reduce(scores[j * 32 : (j + 1) * 32])))


def test_a_preempted_request_starts_its_scores_over():
    book = BlockScores(BlockEvictionPlan.from_spec(stack()))
    assert book.add("r", 0, torch.ones(40)) == {0: 1.0}
    assert book.add("r", 0, torch.zeros(32)) == {0: 0.0}  # recomputed from its first token
    with pytest.raises(RuntimeError, match="continues at position 50"):
        book.add("r", 50, torch.zeros(3))


# ------------------------------------------------------------------------------------------------ compaction
@settings(max_examples=200, deadline=None)
@given(data=st.data(), rows=st.integers(1, 5), width=st.integers(1, 12))
def test_compacted_table_lists_the_remaining_blocks_in_order(data, rows, width):
    bs = 32
    table = torch.randint(1, 1000, (rows, width), dtype=torch.int32)
    lens = torch.tensor([data.draw(st.integers(1, width * bs)) for _ in range(rows)], dtype=torch.int32)
    evicted = {}
    for r in range(rows):
        n_blocks = -(-int(lens[r]) // bs)
        gone = sorted(set(data.draw(st.lists(st.integers(0, max(n_blocks - 2, 0)), max_size=n_blocks - 1))))
        if gone and n_blocks > 1:
            evicted[r] = gone
    before = table.clone(), lens.clone()
    new_table, new_lens = compact_block_table(table, lens, evicted, bs)
    assert torch.equal(table, before[0]) and torch.equal(lens, before[1])  # the logical table is untouched
    for r in range(rows):
        n_blocks = -(-int(lens[r]) // bs)
        gone = evicted.get(r, [])
        kept = [int(table[r, j]) for j in range(n_blocks) if j not in gone]
        assert new_table[r, : len(kept)].tolist() == kept
        assert int(new_lens[r]) == int(lens[r]) - len(gone) * bs
        assert -(-int(new_lens[r]) // bs) == len(kept)  # attention reads exactly the kept blocks


# ------------------------------------------------------------------------------------------------ engine settings
def test_engine_args_name_kvstacks_scheduler_and_worker():
    args = engine_args("paged-eviction", block_size=32, dtype="bfloat16", additional_config={"other": 1})
    assert args["scheduler_cls"] == SCHEDULER and args["worker_cls"] == WORKER
    assert (args["block_size"], args["enable_prefix_caching"], args["enforce_eager"]) == (32, False, True)
    assert args["dtype"] == "bfloat16" and args["additional_config"]["other"] == 1
    carried = BlockEvictionPlan.from_spec(args["additional_config"][CONFIG_KEY], block_size=32)
    assert carried.stage.block_size == 32 and carried.budget.tokens == 136
    with pytest.raises(ValueError, match="enable_prefix_caching=True is not allowed with kvstack in vLLM"):
        engine_args("paged-eviction", block_size=32, enable_prefix_caching=True)
    with pytest.raises(SpecError, match="not allowed in vLLM yet"):
        engine_args("quantized-pruning")
    kivi = engine_args("kivi-4")  # a quantize stage alone: quantized pages, 32-token blocks unless told
    assert kivi["block_size"] == 32 and kivi["worker_cls"] == WORKER
    with pytest.raises(SpecError, match="kv_cache_dtype='fp8_e4m3' is not allowed with a quantize stage: 'auto'"):
        engine_args("kivi-4", kv_cache_dtype="fp8_e4m3")
    budgeted = BlockEvictionPlan.from_spec(
        engine_args("paged-eviction", block_size=64, budget={"ratio": 0.25})["additional_config"][CONFIG_KEY])
    assert (budgeted.budget.ratio, budgeted.stage.budget, budgeted.block_size) == (0.25, None, 64)
    with pytest.raises(SpecError, match="budget.tokens=40 is not allowed: at least one block"):
        engine_args("paged-eviction", block_size=64, budget={"tokens": 40})


def test_the_server_options_file_is_engine_args_under_vllms_option_names(tmp_path):
    """``kvstack vllm-config`` writes what ``vllm serve --config`` reads: ``engine_args`` with dashed names (the
    server itself runs in tests/vllm_engine/test_serve.py); bad input is refused before anything is written."""
    import yaml
    from typer.testing import CliRunner

    from kvstack.cli import app

    out = tmp_path / "kv.yaml"
    result = CliRunner().invoke(app, ["vllm-config", "paged-eviction", "--block-size", "32", "--tokens", "128",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = yaml.safe_load(out.read_text())
    args = engine_args("paged-eviction", block_size=32, budget={"tokens": 128})
    assert written == serve_config("paged-eviction", block_size=32, budget={"tokens": 128})
    assert written == {name.replace("_", "-"): value for name, value in args.items()}
    assert (written["scheduler-cls"], written["worker-cls"]) == (SCHEDULER, WORKER)
    assert BlockEvictionPlan.from_spec(written["additional-config"][CONFIG_KEY], block_size=32).budget.tokens == 128
    printed = CliRunner().invoke(app, ["vllm-config", "kivi-3"])  # no --out: the YAML on stdout
    assert printed.exit_code == 0 and yaml.safe_load(printed.output) == serve_config("kivi-3")
    for argv, message in [
        (["kivi-3", "--tokens", "64", "--ratio", "0.25"], "--tokens 64 and --ratio 0.25 are both given"),
        (["snapkv", "--block-size", "32"], "stages.0.granularity='token' is not allowed in vLLM: 'block'"),
        (["kivi-3", "--ratio", "0.25"], "not allowed in vLLM with a quantize stage alone"),
        (["kivi-3", "--out", str(tmp_path / "missing" / "kv.yaml")], "does not exist"),
    ]:
        refused = CliRunner().invoke(app, ["vllm-config", *argv])
        assert refused.exit_code == 2 and message in refused.output, (argv, refused.output)


def test_engine_stats_needs_kvstacks_scheduler_in_this_process():
    remote = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace()))  # a multiprocess engine
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        engine_stats(remote)


def _config(**changes):
    config = SimpleNamespace(
        additional_config={CONFIG_KEY: {}},
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        model_config=SimpleNamespace(enforce_eager=True),
        speculative_config=None, kv_transfer_config=None, use_v2_model_runner=False,
    )
    for path, value in changes.items():
        obj, _, name = path.rpartition(".")
        setattr(getattr(config, obj) if obj else config, name, value)
    return config


def test_check_engine_refuses_what_eviction_cannot_honour():
    check_engine(_config())
    with pytest.raises(ValueError, match=r"additional_config\['kvstack'\] is missing"):
        check_engine(_config(additional_config={}))
    with pytest.raises(ValueError, match="does not support enable_prefix_caching=True, pipeline_parallel_size=2"):
        check_engine(_config(**{"cache_config.enable_prefix_caching": True, "parallel_config.pipeline_parallel_size": 2}))
    with pytest.raises(ValueError, match="enforce_eager=False"):
        check_engine(_config(**{"model_config.enforce_eager": False}))
