"""Calibrate LESS kernels for the `less` stack, reference them from YAML, and compare against random features.

    python examples/calibrate_less.py [--steps 40] [--out /tmp/less-kernels.safetensors]
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import kvstack
from kvstack.bench.protocol import evaluate, load_model, load_passages

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=os.environ.get("KVSTACK_MODEL", "../shared/models/stories260K"))
parser.add_argument("--data", default=os.environ.get("KVSTACK_DATA", "../shared/data/stories260K-samples-dev.jsonl"))
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--passages", type=int, default=4, help="evaluation passages (the first ones of --data)")
parser.add_argument("--out", default="/tmp/less-kernels.safetensors")
args = parser.parse_args()

# 1. train the kernels on passages 32.. (never the evaluation passages) with the CLI
cmd = [sys.executable, "-m", "kvstack.cli", "calibrate", "--model", args.model, "--preset", "less",
       "--data", args.data, "--out", args.out, "--steps", str(args.steps), "--passages", "8", "--no-progress"]
subprocess.run(cmd, check=True)

# 2. the same stack with learned features, referencing the file
spec = kvstack.StackSpec.load("less").model_dump()
lowrank = next(s for s in spec["stages"] if s["kind"] == "lowrank")
lowrank.update(features="learned", kernels=str(Path(args.out).resolve()), rank=None)
learned = kvstack.StackSpec.load({**spec, "name": "less-learned"})

# 3. quality on a few passages under the evaluation protocol
model, tokenizer = load_model(args.model)
passages = load_passages(args.data, n=args.passages)
for stack in ("less", learned):
    r = evaluate(model, tokenizer, passages, stack)
    print(f"{r.name:<14} KL {r.kl:.5f}  top-1 {r.top1:.3f}  memory ratio {r.memory_ratio:.3f}")
