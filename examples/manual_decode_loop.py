"""A manual decode loop: feed tokens yourself and watch the cache's memory by tier.

    python examples/manual_decode_loop.py [--preset streaming] [--steps 300]
"""

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvstack

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=os.environ.get("KVSTACK_MODEL", "../shared/models/stories260K"))
parser.add_argument("--preset", default="streaming")
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model).eval()
tokenizer = AutoTokenizer.from_pretrained(args.model)
kvstack.apply(model, args.preset)
cache = kvstack.cache_for(model)

ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
tokens = ids[0].tolist()
with torch.no_grad():
    logits = model(ids, cache=cache).logits[:, -1]  # prefill
    for step in range(args.steps):
        next_id = logits.argmax(-1, keepdim=True)
        tokens.append(int(next_id))
        logits = model(next_id, cache=cache).logits[:, -1]  # positions come from cache.get_seq_length()
        if step % 100 == 0 or step == args.steps - 1:
            r = cache.memory_report()
            tiers = ", ".join(f"{k}={v:,}" for k, v in r["by_tier"].items())
            print(f"seen {r['tokens_seen']:4d}: {r['total_bytes']:,} bytes ({r['ratio']:.3f} of full) [{tiers}]")
print(tokenizer.decode(tokens, skip_special_tokens=True)[:300])
