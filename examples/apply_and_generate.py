"""Apply a preset with one call and generate; print the cache's memory against the full cache.

    python examples/apply_and_generate.py [--preset streaming] [--model PATH]
"""

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvstack

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=os.environ.get("KVSTACK_MODEL", "../shared/models/stories260K"))
parser.add_argument("--preset", default="streaming")
parser.add_argument("--max-new-tokens", type=int, default=200)
args = parser.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model).eval()
tokenizer = AutoTokenizer.from_pretrained(args.model)
kvstack.apply(model, args.preset)

inputs = tokenizer("Once upon a time", return_tensors="pt")
cache = kvstack.cache_for(model)  # pass our own cache only to read its memory afterwards
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, cache=cache)
print(tokenizer.decode(out[0], skip_special_tokens=True))
report = cache.memory_report()
print(f"{args.preset}: {report['total_bytes']:,} bytes vs {report['full_cache_bytes']:,} full ({report['ratio']:.3f})")
