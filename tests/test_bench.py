"""`kvstack bench`: the CLI on the real model (2 passages, short prefix), the ratio override, the Pareto front, and the
`decode` protocol variant."""

from __future__ import annotations

import json
import subprocess
from dataclasses import fields
from pathlib import Path

import matplotlib.image
import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from typer.testing import CliRunner

from kvstack import StackSpec
from kvstack.bench import harness, protocol
from kvstack.bench.harness import BenchRow, pareto_flags, preset_runs, takes_budget, with_ratio
from kvstack.cli import app

PREFIX, MAX_LEN = 64, 96
RATIO_YAML = """\
name: window-half
description: sinks + recent tokens at a memory ratio
budget:
  ratio: 0.5
stages:
  - kind: evict
    scorer: window
    n_sink: 4
    budget:
      tokens: 8
"""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench_run(real_model_and_tokenizer, dev_passages, tmp_path_factory):
    """One CLI run shared by the tests below: identity, streaming and a YAML file with a ratio, at ratio 0.5."""
    root = tmp_path_factory.mktemp("bench")
    preset_file = root / "window-half.yaml"
    preset_file.write_text(RATIO_YAML)
    out = root / "out"
    args = [
        "bench", "--model", str(protocol.model_path()), "--data", str(protocol.data_path()),
        "--presets", f"identity,streaming,{preset_file}", "--ratios", "0.5", "--passages", "2",
        "--prefix", str(PREFIX), "--max-len", str(MAX_LEN), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads((out / harness.RESULTS_FILE).read_text())
    return result.output, data, out


def rows_by_name(data) -> dict[str, dict]:
    return {row["name"]: row for row in data["rows"]}


def test_no_commit_is_recorded_for_a_kvstack_outside_its_own_checkout(tmp_path):
    """An installed kvstack inside a venv that some other repository ignores reports no commit, not that repository's;
    so does one outside any repository."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t", *args], check=True,
                       capture_output=True)

    package = tmp_path / "venv" / "kvstack"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert harness._git_commit(package) is None  # no repository at all
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("venv/\n")
    git("add", ".gitignore")
    git("commit", "-q", "-m", "a project around the venv")
    assert harness._git_commit(package) is None


def test_results_json_has_every_row_and_field(bench_run):
    _, data, _ = bench_run
    rows = rows_by_name(data)
    assert set(rows) == {"full-cache", "QuantizedCache[fp8, 8-bit]", "identity", "streaming@0.5", "window-half@0.5"}
    expected = {f.name for f in fields(BenchRow)}
    for row in data["rows"]:
        assert set(row) == expected
        assert len(row["per_passage_kl"]) == 2
        assert row["positions"] == 2 * (MAX_LEN - PREFIX)
        assert row["memory_ratio"] == pytest.approx(row["memory_bytes"] / row["full_bytes"], rel=1e-2)
        assert row["decode_seconds"] > 0
    meta = data["metadata"]
    assert meta["model"] == protocol.model_path().name
    assert (meta["passages"], meta["protocol"], meta["prefix"], meta["max_len"]) == (2, "prefill", PREFIX, MAX_LEN)
    assert meta["versions"]["transformers"] == transformers.__version__
    assert meta["versions"]["torch"] == torch.__version__
    # the commit that reruns the figure: the tests run from a checkout (CI clones one)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parent).stdout.strip()
    assert meta["versions"]["kvstack_commit"] in (head, head + "+dirty")
    assert meta["baselines"]["quantized_cache"]["fp8"] == "ran"
    assert set(meta["baselines"]["quantized_cache"]) == set(harness.QUANTIZED_BACKENDS)


def test_full_cache_row_is_the_reference(bench_run):
    full = rows_by_name(bench_run[1])["full-cache"]
    assert abs(full["kl"]) <= 1e-9
    assert full["memory_ratio"] == 1.0
    assert full["decode_time_ratio"] == 1.0
    assert full["top1"] == 1.0


def test_identity_matches_the_full_cache(bench_run):
    rows = rows_by_name(bench_run[1])
    identity = rows["identity"]
    assert abs(identity["kl"]) <= 1e-9
    assert identity["top1"] == 1.0
    assert identity["ppl"] == pytest.approx(rows["full-cache"]["ppl"], rel=1e-6)
    assert identity["ratio_target"] is None  # no budget: run once, as written


def test_ratio_runs_respect_the_ratio_and_lose_quality(bench_run):
    rows = rows_by_name(bench_run[1])
    for name in ("streaming@0.5", "window-half@0.5"):
        row = rows[name]
        assert row["ratio_target"] == 0.5
        assert row["spec"]["budget"] == {"ratio": 0.5}
        assert row["memory_ratio"] <= 0.5 + 1e-9
        assert row["kl"] > 1e-6  # half the prefix is gone: the distribution moves
    assert "budget" not in rows["window-half@0.5"]["spec"]["stages"][0]  # the stage budget was dropped


def test_fp8_quantized_cache_memory_is_counted(bench_run):
    fp8 = rows_by_name(bench_run[1])["QuantizedCache[fp8, 8-bit]"]
    assert (fp8["backend"], fp8["bits"]) == ("fp8", 8)
    assert 0.25 <= fp8["memory_ratio"] < 0.26  # float8 codes of float32 keys/values + per-tensor scales
    assert fp8["kl"] > 0


def test_pareto_flags_in_results(bench_run):
    rows = bench_run[1]["rows"]
    assert [r["pareto"] for r in rows] == pareto_flags([(r["memory_ratio"], r["kl"]) for r in rows])
    by_name = rows_by_name(bench_run[1])
    assert by_name["full-cache"]["pareto"]
    assert not by_name["identity"]["pareto"]  # as exact as the full cache (up to rounding) but a little bigger


def test_plot_is_a_valid_png(bench_run):
    path = bench_run[2] / harness.PLOT_FILE
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0  # something was drawn


def test_terminal_table_lists_every_row(bench_run):
    output, data, _ = bench_run
    assert "| stack | memory ratio |" in output
    for row in data["rows"]:
        assert f"| {row['name']} |" in output


def test_with_ratio_sets_the_stack_budget_and_drops_stage_budgets():
    spec = StackSpec.from_yaml(RATIO_YAML)
    out = with_ratio(spec, 0.25)
    assert out.budget.ratio == 0.25 and out.budget.tokens is None
    assert out.stages[0].budget is None
    assert (out.stages[0].n_sink, out.stages[0].scorer) == (4, "window")
    assert spec.stages[0].budget.tokens == 8  # the original is untouched


def test_takes_budget_and_preset_runs():
    assert not takes_budget(StackSpec.load("identity"))
    assert takes_budget(StackSpec.load("streaming"))
    assert takes_budget(StackSpec.model_validate({"stages": [{"kind": "evict", "budget": {"tokens": 4}}]}))
    runs = preset_runs(["identity", "streaming"], (0.5, 0.125))
    assert [(r.name, r.ratio_target) for r in runs] == [("identity", None), ("streaming@0.5", 0.5),
                                                         ("streaming@0.125", 0.125)]  # fmt: skip
    as_written = preset_runs(["streaming"], ())
    assert [(r.name, r.spec.budget.tokens) for r in as_written] == [("streaming", 128)]


@given(st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(0.0, 1.0)), min_size=1, max_size=12))
def test_pareto_front_is_exactly_the_undominated_points(points):
    points = [(m, 0.0 if k <= harness.EXACT_KL else k) for m, k in points]
    flags = pareto_flags(points)
    assert any(flags)
    for (m, k), flag in zip(points, flags):
        dominated = any(m2 <= m and k2 <= k and (m2, k2) != (m, k) for m2, k2 in points)
        assert flag == (not dominated)


def test_decode_protocol_is_exact_uncompressed_and_compresses_while_decoding(real_model_and_tokenizer, dev_passages):
    model, tokenizer = real_model_and_tokenizer
    passages = dev_passages[:1]
    kwargs = dict(prefix=PREFIX, max_len=MAX_LEN, protocol="decode", decode_prefill=8)
    identity = protocol.evaluate(model, tokenizer, passages, "identity", **kwargs)
    assert abs(identity.kl) <= 1e-9 and identity.positions == MAX_LEN - PREFIX
    budget = {"name": "w", "budget": {"tokens": 16}, "stages": [{"kind": "evict", "n_sink": 2}]}
    decode = protocol.evaluate(model, tokenizer, passages, budget, **kwargs)
    prefill = protocol.evaluate(model, tokenizer, passages, budget, prefix=PREFIX, max_len=MAX_LEN)
    # a window holds the same tokens whichever way it got there, but under `decode` their keys and values were
    # computed from an already compressed context, so the distributions differ
    assert decode.memory_bytes == prefill.memory_bytes
    assert decode.kl > 1e-6 and abs(decode.kl - prefill.kl) > 1e-6
    with pytest.raises(ValueError, match="decode_prefill"):
        protocol.evaluate(model, tokenizer, passages, "identity", prefix=PREFIX, protocol="decode", decode_prefill=64)


def test_cli_rejects_bad_options(tmp_path):
    base = ["bench", "--model", str(tmp_path), "--data", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, base + ["--presets", "identity", "--ratios", "0.5,2"])
    assert result.exit_code == 2 and "every ratio must be in (0, 1]" in result.output
    result = CliRunner().invoke(app, base + ["--presets", " , "])
    assert result.exit_code == 2 and "--presets is empty" in result.output


def test_cli_rejects_a_bad_protocol_and_an_unknown_preset(tmp_path):
    data = tmp_path / "passages.jsonl"
    data.write_text('{"text": "Once upon a time."}\n')
    out = tmp_path / "out"
    base = ["bench", "--model", str(tmp_path), "--data", str(data), "--out", str(out)]  # errors come before loading
    result = CliRunner().invoke(app, base + ["--presets", "identity", "--protocol", "nope"])
    assert result.exit_code == 2 and "protocol='nope' is not allowed: one of prefill, decode" in result.output
    result = CliRunner().invoke(app, base + ["--presets", "identity,no-such-preset"])
    assert result.exit_code == 2 and "unknown preset 'no-such-preset'" in result.output
    assert not out.exists()
