"""The long-context benchmark script runs end to end (tiny shape) and reports ratios to the baseline."""

from __future__ import annotations

import json

from kvstack.bench import long_context


def test_sweep_writes_ratios_to_the_baseline(tmp_path):
    long_context.main(["--shape", "tiny", "--lengths", "96", "--stacks", "identity,kivi-4+chunk32",
                       "--decode-steps", "3", "--device", "cpu", "--out", str(tmp_path)])
    result = json.loads((tmp_path / long_context.RESULTS_FILE).read_text())
    rows = {r["stack"]: r for r in result["rows"]}
    assert set(rows) >= {"dynamic-cache", "identity", "kivi-4+chunk32"}
    assert all("error" not in r for r in rows.values())
    assert rows["identity"]["cache_ratio"] > 1.0  # stored positions: 4 bytes per token on top of the keys/values
    assert rows["kivi-4+chunk32"]["cache_ratio"] < 0.6
    assert rows["dynamic-cache"]["prefill_ratio"] == 1.0
    table = long_context.markdown_table(result)
    assert "kivi-4+chunk32" in table and "dynamic-cache + SDPA" in table


def test_chunk_suffix_sets_the_stack_level_chunk():
    assert long_context.stack_spec("kivi-4+chunk4096").prefill_chunk == 4096
    assert long_context.stack_spec("kivi-4").prefill_chunk is None
