"""Honest reports and errors that help (issue 14, sections 4 and 5): each case names the thing, the value and what
is allowed, and every figure a report gives is checked against the tensors."""

from __future__ import annotations

import json

import pytest
import torch
from archs import tiny_model
from pydantic import ValidationError
from typer.testing import CliRunner

import kvstack
from kvstack import CacheUsageError, SpecError, StackSpec
from kvstack.cli import app


def test_report_prices_the_full_cache_in_the_dtype_the_cache_holds():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40))
    with kvstack.applied(model, "kivi-4"):
        model.to(torch.bfloat16)
        cache = kvstack.cache_for(model)
        with torch.no_grad():
            model(ids, cache=cache)
        report = cache.memory_report()
    model.to(torch.float32)
    bf16_full = kvstack.full_cache_bytes(model.config, 40, dtype=torch.bfloat16)
    assert report["full_cache_bytes"] == bf16_full
    assert report["ratio"] == pytest.approx(report["total_bytes"] / bf16_full)


def test_a_cache_refuses_a_model_of_another_shape():
    small, other = tiny_model("llama"), tiny_model("phi3")  # head_dim 16 in both; phi3 has 4 KV heads? check below
    with kvstack.applied(small, "identity"):
        cache = kvstack.cache_for(small)
    bigger = tiny_model("llama", num_hidden_layers=3)
    with kvstack.applied(bigger, "identity"):
        with pytest.raises(CacheUsageError, match="has 2 layers"):
            bigger(torch.randint(3, 128, (1, 4)), cache=cache)
    fewer = tiny_model("llama", num_hidden_layers=1)
    with kvstack.applied(small, "identity"):
        cache = kvstack.cache_for(small)
    with kvstack.applied(fewer, "identity"):
        fewer(torch.randint(3, 128, (1, 4)), cache=cache)
    with pytest.raises(CacheUsageError, match="another number of layers"):
        cache.memory_report()
    assert other is not None


def test_a_cache_refuses_another_head_dim():
    model = tiny_model("llama")
    with kvstack.applied(model, "identity"):
        cache = kvstack.cache_for(model)
        with pytest.raises(CacheUsageError, match="head_dim 16, the model gives 2 of 8"):
            cache.layers[0].update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))


def test_a_cache_reused_for_another_batch_size_says_so():
    model = tiny_model("llama")
    with kvstack.applied(model, "identity"):
        cache = kvstack.cache_for(model)
        model(torch.randint(3, 128, (2, 5)), cache=cache)
        with pytest.raises(CacheUsageError, match="batch 2 .* batch 3"):
            model(torch.randint(3, 128, (3, 1)), cache=cache)


def test_an_empty_prompt_is_a_clear_error():
    model = tiny_model("llama")
    with kvstack.applied(model, "identity"):
        with pytest.raises(CacheUsageError, match="empty input"):
            model(torch.zeros(1, 0, dtype=torch.long), cache=kvstack.cache_for(model))


def test_lowrank_alone_is_refused_with_the_reason():
    with pytest.raises(SpecError, match="nothing is ever folded"):
        StackSpec.load({"stages": [{"kind": "lowrank"}]})


def test_apply_refuses_names_and_pipelines():
    with pytest.raises(SpecError, match="pass a loaded model"):
        kvstack.apply("gpt2", "identity")

    class Pipe:
        model = tiny_model("llama")

    with pytest.raises(SpecError, match="pipe.model"):
        kvstack.apply(Pipe(), "identity")
    with pytest.raises(SpecError, match="PreTrainedModel"):
        kvstack.apply(object(), "identity")


def test_generate_with_another_cache_implementation_is_refused():
    model = tiny_model("llama")
    with kvstack.applied(model, "identity"):
        with pytest.raises(CacheUsageError, match="cache_implementation='static'"):
            model.generate(torch.randint(3, 128, (1, 4)), max_new_tokens=2, cache_implementation="static")


def test_stage_without_kind_and_misspelt_names():
    with pytest.raises(SpecError, match=r"stages.0 has no 'kind'; allowed kinds: .*'evict'"):
        StackSpec.load({"stages": [{"n_sink": 4}]})
    with pytest.raises(SpecError, match=r"stages.0.kind='evcit' .*did you mean 'evict'"):
        StackSpec.load({"stages": [{"kind": "evcit"}]})
    with pytest.raises(SpecError, match="did you mean 'streaming'"):
        StackSpec.load("streamin")
    with pytest.raises(SpecError, match="did you mean 'snapkv'"):
        StackSpec.load({"budget": {"tokens": 64}, "stages": [{"kind": "evict", "scorer": "snapvk"}]})


def test_whole_spec_errors_point_at_the_field():
    with pytest.raises(SpecError) as err:
        StackSpec.load({"stages": [{"kind": "evict"}]})
    message = str(err.value)
    assert "stages.0 (evict): budget=None" in message and "(root)" not in message and "{'stages'" not in message


def test_assignments_are_validated():
    spec = StackSpec.load("streaming")
    with pytest.raises(ValidationError, match="n_sink"):
        spec.stages[0].n_sink = -3
    with pytest.raises(ValidationError, match="ratio"):
        spec.budget = {"ratio": 2.0}
    spec.budget = {"ratio": 0.5}
    assert spec.budget.ratio == 0.5


runner = CliRunner()


def test_cli_presets_tokens_must_be_positive_and_identity_is_explained():
    for bad in ("-5", "0"):
        result = runner.invoke(app, ["presets", "--tokens", bad])
        assert result.exit_code == 2 and "tokens" in result.output
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0 and "identity is above 1" in result.output


def test_cli_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"kvstack {kvstack.__version__}"


def test_cli_bench_checks_data_and_out_before_loading_anything(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    not_jsonl = tmp_path / "data.txt"
    not_jsonl.write_text("just text\n")
    result = runner.invoke(app, ["bench", "--model", str(model), "--data", str(not_jsonl), "--presets", "identity",
                                 "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "is not JSONL: line 1" in result.output
    good = tmp_path / "data.jsonl"
    good.write_text(json.dumps({"text": "a"}) + "\n")
    a_file = tmp_path / "file"
    a_file.write_text("")
    result = runner.invoke(app, ["bench", "--model", str(model), "--data", str(good), "--presets", "identity",
                                 "--out", str(a_file)])
    assert result.exit_code == 2 and "is a file" in result.output


def test_cli_calibrate_checks_out_before_training(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    good = tmp_path / "data.jsonl"
    good.write_text(json.dumps({"text": "a"}) + "\n")
    result = runner.invoke(app, ["calibrate", "--model", str(model), "--preset", "less", "--data", str(good),
                                 "--out", str(tmp_path / "missing" / "k.safetensors")])
    assert result.exit_code == 2 and "does not exist (checked before training)" in result.output


def test_gqa_ratio_is_against_the_original_model():
    model = tiny_model("llama", num_key_value_heads=4)  # 4 query heads, 4 KV heads -> gqa-mean keeps 2
    ids = torch.randint(3, 128, (1, 24))
    with kvstack.applied(model, "gqa-mean"):
        cache = kvstack.cache_for(model)
        with torch.no_grad():
            model(ids, cache=cache)
        report = cache.memory_report()
    original = 2 * 24 * 4 * (16 + 16) * 4  # layers x tokens x KV heads x (key + value dims) x fp32
    assert report["full_cache_bytes"] == original
    positions = 2 * 24 * 4
    assert report["total_bytes"] == original // 2 + positions
    assert report["ratio"] == pytest.approx(0.5 + positions / original)


def test_show_prints_only_what_acts():
    streaming = runner.invoke(app, ["show", "streaming"]).output
    for absent in ("window:", "kernel:", "pooling:", "saliency:", "seed:", "block_size:", "pyramid_spread:"):
        assert absent not in streaming
    assert "n_sink: 4" in streaming and "tokens: 128" in streaming
    snapkv = runner.invoke(app, ["show", "snapkv"]).output
    assert "window: 32" in snapkv and "kernel: 7" in snapkv and "saliency:" not in snapkv
    paged = runner.invoke(app, ["show", "paged-eviction"]).output
    assert "block_size: 16" in paged and "aggregate: mean" in paged
    for name in kvstack.preset_names():  # what is left out are defaults that do not act: the round trip holds
        spec = StackSpec.load(name)
        assert StackSpec.from_yaml(spec.to_yaml()) == spec or name == "less-learned"


def test_apply_overrides_are_validated_like_yaml():
    model = tiny_model("llama")
    with kvstack.applied(model, "h2o", budget=0.25, n_sink=8, prefill_chunk=64):
        spec = kvstack.cache_for(model).spec
    assert spec.budget.ratio == 0.25 and spec.stages[0].n_sink == 8 and spec.prefill_chunk == 64
    assert StackSpec.load("h2o").with_overrides(budget=64).budget.tokens == 64
    assert StackSpec.load("h2o").with_overrides(budget={"tokens": 48}).budget.tokens == 48
    with pytest.raises(SpecError, match=r"n_snik=8 is not allowed: .*did you mean 'n_sink'"):
        kvstack.apply(model, "h2o", n_snik=8)
    with pytest.raises(SpecError, match="n_sink"):
        kvstack.apply(model, "h2o", n_sink=-1)
    with pytest.raises(SpecError, match="budget"):
        kvstack.apply(model, "h2o", budget=2.0)
    with pytest.raises(SpecError, match="budget='a lot' is not allowed"):
        kvstack.apply(model, "h2o", budget="a lot")
    assert model.config._attn_implementation != "kvstack"  # nothing was applied by the failed calls


def test_a_stage_registered_outside_the_package_loads_from_yaml_and_runs():
    import importlib

    from kvstack.stack.registry import unregister_stage

    module = importlib.import_module("ext_stage")
    try:
        spec = StackSpec.from_yaml("name: mine\nstages:\n  - kind: keep_newest\n    keep: 5\n")
        assert isinstance(spec.stages[0], module.KeepNewestSpec) and spec.stages[0].keep == 5
        with pytest.raises(SpecError, match="keep"):
            StackSpec.from_yaml("stages:\n  - kind: keep_newest\n    keep: 0\n")
        assert "keep_newest" in kvstack.stage_specs()
        model = tiny_model("llama")
        with kvstack.applied(model, spec):
            cache = kvstack.cache_for(model)
            model(torch.randint(3, 128, (1, 12)), cache=cache)
        assert int(cache.layers[0].kept_counts().max()) == 5
        assert StackSpec.from_yaml(spec.to_yaml()) == spec
    finally:
        unregister_stage("keep_newest")
    with pytest.raises(SpecError, match="keep_newest"):
        StackSpec.from_yaml("stages:\n  - kind: keep_newest\n")
