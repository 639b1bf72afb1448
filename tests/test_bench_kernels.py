"""The kernel benchmark script runs end to end on CPU (tiny sizes) and writes the documented JSON fields."""

import json
import math

import pytest

from kvstack.bench import kernels as bk

SMALL = ["--device", "cpu", "--contexts", "160", "--batches", "1,2", "--kv-heads", "2", "--q-heads", "4",
         "--head-dim", "32", "--residual", "32", "--target-s", "0.001"]


def test_cli_writes_table_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVSTACK_KERNELS", raising=False)
    bk.main(SMALL + ["--out", str(tmp_path)])
    table = capsys.readouterr().out
    data = json.loads((tmp_path / "kernels.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["fused_path"] == "torch reference" and meta["peak_bytes_per_s"] is None
    assert (meta["kv_heads"], meta["q_heads"], meta["head_dim"], meta["residual"]) == (2, 4, 32, 32)
    methods = ["fused-2bit", "fused-2bit+mass", "dequant-sdpa-2bit", "fused-4bit", "dequant-sdpa-4bit", "sdpa-fp16"]
    assert [(r["context"], r["batch"], r["method"]) for r in rows] == [(160, b, m) for b in (1, 2) for m in methods]
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0 and r["peak_fraction"] is None
        assert math.isclose(r["gb_per_s"], r["bytes_read"] / (r["ms"] / 1e3) / 1e9, rel_tol=1e-6)
        assert f"| {r['context']} | {r['batch']} | {r['method']} |" in table
        assert (r["speedup_vs_dequant"] is not None) == r["method"].startswith("fused")
    by = {(r["batch"], r["method"]): r for r in rows}
    # bytes read: the 2-bit store is smaller than the 4-bit one; dequant+SDPA also reads the fp16 keys/values
    assert by[1, "fused-2bit"]["bytes_read"] < by[1, "fused-4bit"]["bytes_read"] < by[1, "sdpa-fp16"]["bytes_read"]
    assert by[1, "dequant-sdpa-2bit"]["bytes_read"] > by[1, "sdpa-fp16"]["bytes_read"]
    assert by[2, "sdpa-fp16"]["bytes_read"] > by[1, "sdpa-fp16"]["bytes_read"]


def test_configs_that_do_not_fit_are_skipped(tmp_path):
    cfg = bk.Config(kv_heads=2, q_heads=4, head_dim=32, residual=32, target_s=0.001, max_bytes=1.0)
    result = bk.run((160,), (1,), "cpu", tmp_path, cfg, progress=lambda s: None)
    assert [r["method"] for r in result["rows"]] == [
        "fused-2bit", "fused-2bit+mass", "dequant-sdpa-2bit", "fused-4bit", "dequant-sdpa-4bit", "sdpa-fp16"]
    assert all(r["status"].startswith("skipped") and r["ms"] is None for r in result["rows"])
    assert "skipped" in bk.markdown_table(result)


def test_bad_arguments():
    with pytest.raises(SystemExit):
        bk.main(["--device", "cpu", "--q-heads", "6", "--kv-heads", "4"])
    with pytest.raises(SystemExit):
        bk.main(["--device", "cpu", "--contexts", "64", "--residual", "128"])
