"""Write a stack in YAML, validate it, and run it on the real model with a manual decode loop.

    python examples/custom_yaml_stack.py [--stack examples/my_stack.yaml]
"""

import argparse
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvstack

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=os.environ.get("KVSTACK_MODEL", "../shared/models/stories260K"))
parser.add_argument("--stack", default=str(Path(__file__).with_name("my_stack.yaml")))
args = parser.parse_args()

spec = kvstack.StackSpec.load(args.stack)  # clear errors name the field, the value and what is allowed
print(spec.to_yaml())

model = AutoModelForCausalLM.from_pretrained(args.model).eval()
tokenizer = AutoTokenizer.from_pretrained(args.model)
with kvstack.applied(model, spec):
    inputs = tokenizer("The little dog ran to the park and", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=120, do_sample=False)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    bound = spec.memory_bound(model.config, seq_len=out.shape[1] - 1)
    full = kvstack.full_cache_bytes(model.config, out.shape[1] - 1)
    print(f"analytic bound after {out.shape[1] - 1} tokens: {bound:,} bytes = {bound / full:.3f} of the full cache")
