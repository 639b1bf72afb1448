"""Compare presets on quality vs memory with `kvstack bench` (table, results.json, quality_vs_memory.png).

    python examples/compare_presets.py [--passages 4] [--out /tmp/kvstack-compare]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=os.environ.get("KVSTACK_MODEL", "../shared/models/stories260K"))
parser.add_argument("--data", default=os.environ.get("KVSTACK_DATA", "../shared/data/stories260K-samples-dev.jsonl"))
parser.add_argument("--presets", default="streaming,obcache,kivi-4,obcache-kivi")
parser.add_argument("--ratios", default="0.25")
parser.add_argument("--passages", type=int, default=4)
parser.add_argument("--out", default="/tmp/kvstack-compare")
args = parser.parse_args()

subprocess.run(
    [sys.executable, "-m", "kvstack.cli", "bench", "--model", args.model, "--data", args.data,
     "--presets", args.presets, "--ratios", args.ratios, "--passages", str(args.passages), "--out", args.out,
     "--no-progress"],
    check=True,
)
rows = json.loads((Path(args.out) / "results.json").read_text())["rows"]
best = min((r for r in rows if r["kind"] == "preset"), key=lambda r: r["kl"])
print(f"lowest KL: {best['name']} (KL {best['kl']:.5f} at memory ratio {best['memory_ratio']:.3f})")
print(f"plot: {Path(args.out) / 'quality_vs_memory.png'}")
