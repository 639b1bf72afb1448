"""The smallest possible eviction policy: keep the tokens whose VALUES are largest (docs/writing-a-stage.md), with a
parameter of its own that the spec validates.

    python examples/custom_scorer.py
"""

import argparse
import os

from pydantic import Field
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvstack


@kvstack.register_scorer
class ValueNormScorer(kvstack.Scorer):
    """Score = ||v_i||_p: a token that moves the output a lot when attended is worth keeping."""

    name = "value_norm"
    head_wise = True  # each KV head keeps its own top tokens

    class Params(kvstack.ScorerParams):  # validated when a spec loads; read as self.params
        p: float = Field(default=2.0, ge=1.0, description="Order of the value norm (large p: the largest channel).")

    def scores(self, layer, tier_index, tier, stats):
        _, values = kvstack.tier_keys_values(tier)  # [B, Hkv, T, D], dequantized if the tier is quantized
        return values.float().norm(p=self.params.p, dim=-1)  # [B, Hkv, T]: higher = keep


parser = argparse.ArgumentParser()
parser.add_argument("--model", default=os.environ.get("KVSTACK_MODEL", "../shared/models/stories260K"))
args = parser.parse_args()

stack = """
name: value-norm
description: sinks + recent window + the largest-value tokens, the bytes of 64 tokens per layer
budget: {tokens: 64}
stages:
  - kind: evict
    scorer: value_norm
    scorer_params: {p: 1.0}
    n_sink: 4
    recent: 16
"""
try:  # the parameter is validated like any spec field
    kvstack.StackSpec.load(stack.replace("p: 1.0", "p: 0.5"))
except kvstack.SpecError as err:
    print("refused:", str(err).splitlines()[-1].strip())
model = AutoModelForCausalLM.from_pretrained(args.model).eval()
tokenizer = AutoTokenizer.from_pretrained(args.model)
with kvstack.applied(model, stack):
    cache = kvstack.cache_for(model)
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=150, do_sample=False, cache=cache)
print(tokenizer.decode(out[0], skip_special_tokens=True))
kept = cache.kept_tokens()[0]
print(f"kept per KV head in layer 0: {kept.tolist()} of {cache.get_seq_length()} seen")
# the budget is bytes: 64 uncompressed tokens' worth, and each kept token also holds its position per head
spec = kvstack.StackSpec.load(stack)
cap = spec.stages[0].layer_cap(kvstack.ModelShape.from_model(model), model.dtype, spec.budget, 0, cache.get_seq_length())
assert int(kept.max()) == cap < 64
