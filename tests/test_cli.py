"""The command line: presets, show, validate, schema, generate."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvstack.bench.protocol import model_path
from kvstack.cli import app

runner = CliRunner()


def test_presets_lists_names_ratios_and_descriptions():
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0, result.output
    table = result.output.split("\n\n")[0]  # the footnote follows a blank line
    lines = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert "identity" in lines and "streaming" in lines
    assert float(lines["identity"].split()[1]) > 1.0  # positions cost a little
    assert float(lines["streaming"].split()[1]) < 0.05  # 132 of 4096 tokens


def test_show_prints_round_trippable_yaml():
    result = runner.invoke(app, ["show", "streaming"])
    assert result.exit_code == 0
    assert "kind: evict" in result.output and "n_sink: 4" in result.output


def test_validate_good_and_bad_files(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("name: mine\nbudget: {tokens: 64}\nstages:\n  - kind: evict\n    n_sink: 2\n")
    result = runner.invoke(app, ["validate", str(good)])
    assert result.exit_code == 0 and "ok: mine" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: mine\nstages:\n  - kind: evict\n    budget: {tokens: 1}\n    n_sink: 4\n")
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2
    assert "budget.tokens=1" in result.output


def test_schema_is_json(tmp_path):
    out = tmp_path / "schema.json"
    assert runner.invoke(app, ["schema", "--out", str(out)]).exit_code == 0
    assert json.loads(out.read_text())["title"] == "kvstack stack spec"


def test_generate_prints_text_and_memory(real_model_and_tokenizer):
    result = runner.invoke(
        app,
        ["generate", "--model", str(model_path()), "--preset", "streaming", "--prompt", "Once upon a time",
         "--max-new-tokens", "150"],
    )
    assert result.exit_code == 0, result.output
    assert "Once upon a time" in result.output
    memory = result.output.strip().splitlines()[-1]
    assert memory.startswith("memory:") and "ratio" in memory
    ratio = float(memory.rsplit("ratio", 1)[1].strip(" )"))
    assert ratio < 0.9  # 132 kept of 155 tokens seen, positions included
