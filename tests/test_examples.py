"""Every example runs on the real test model (small settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

CASES = {
    "apply_and_generate.py": ["--max-new-tokens", "60"],
    "custom_yaml_stack.py": [],
    "manual_decode_loop.py": ["--steps", "120"],
    "custom_scorer.py": [],
    "compare_presets.py": ["--passages", "1", "--presets", "streaming,obcache-kivi"],
    "calibrate_less.py": ["--steps", "2", "--passages", "1"],
}


def test_every_example_is_covered():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name, real_model_and_tokenizer, tmp_path):
    args = list(CASES[name])
    if name in ("compare_presets.py", "calibrate_less.py"):
        args += ["--out", str(tmp_path / ("out" if name == "compare_presets.py" else "k.safetensors"))]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=600, cwd=EXAMPLES.parent
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip()
