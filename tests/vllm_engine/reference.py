"""Algorithm 1 on a transformers cache, written independently of kvstack's vLLM code: what the engine must match.

Greedy decoding in float32 with a DynamicCache; after every forward (each prefill chunk, each decode step) the
request's blocks (of ``block_size`` logical positions) are scored — the scorer per token averaged over layers and KV
heads, then aggregated per block — and while more blocks are held than allowed, the lowest-ranked block that is not
the newest leaves every layer (protected blocks, holding a sink or a recent token, last). Positions keep counting.
"""

import math

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def token_scores(keys, values, scorer, positions):
    if scorer == "window":  # recency: the token's position
        return positions.float()
    if scorer == "value_key_ratio":
        s = values.norm(dim=-1) / keys.norm(dim=-1).clamp_min(1e-6)
    elif scorer == "key_norm":
        s = -keys.norm(dim=-1)
    else:
        raise ValueError(scorer)
    return s.mean((0, 1))  # [L, H, T] -> [T]


def allowed(budget, seen, bs):
    if "tokens" in budget:
        return max(budget["tokens"] // bs, 1)
    return max(math.floor(budget["ratio"] * seen / bs + 1e-9), 1)


def generate(path, prompt, *, max_tokens, block_size, budget, scorer="value_key_ratio", aggregate="mean",
             n_sink=0, recent=0, chunk=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    logical = torch.empty(0, dtype=torch.long)  # the logical position of every cached token
    block_score: dict[int, float] = {}
    pieces = [prompt[i : i + (chunk or len(prompt))] for i in range(0, len(prompt), chunk or len(prompt))]
    tokens, logprobs, seen = [], [], 0
    with torch.no_grad():
        while len(tokens) < max_tokens:
            ids = pieces.pop(0) if pieces else [tokens[-1]]
            n = len(ids)
            out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(seen, seen + n)[None],
                        past_key_values=cache, use_cache=True)
            logical = torch.cat([logical, torch.arange(seen, seen + n)])
            seen += n
            if not pieces:
                lp = out.logits[0, -1].float().log_softmax(-1)
                tokens.append(int(lp.argmax()))
                logprobs.append(float(lp[tokens[-1]]))
            keys = torch.stack([layer.keys[0] for layer in cache.layers]).float()
            values = torch.stack([layer.values[0] for layer in cache.layers]).float()
            per_token = token_scores(keys, values, scorer, logical)
            block_of = logical // block_size
            held = sorted(set(block_of.tolist()))
            for b in held:
                mine = per_token[block_of == b]
                if mine.numel() == block_size and b not in block_score:
                    block_score[b] = float(getattr(mine, {"mean": "mean", "min": "amin", "max": "amax"}[aggregate])())
            excess = len(held) - allowed(budget, seen, block_size)
            newest = (seen - 1) // block_size
            if excess > 0:
                def protected(b):
                    return b < math.ceil(n_sink / block_size) or (recent and b >= (seen - recent) // block_size)

                ranked = sorted((protected(b), block_score[b], b) for b in held if b != newest)
                gone = {b for _, _, b in ranked[:excess]}
                keep = ~torch.isin(block_of, torch.tensor(sorted(gone)))
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
                logical = logical[keep]
    return tokens, logprobs
