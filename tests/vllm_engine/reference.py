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


def allowed(budget, seen, bs, kivi=None):
    """Blocks a request may hold after ``seen`` tokens. With ``kivi`` the budget is in bytes: the residual's
    full-precision tokens first, then quantized blocks at ``cell / full_cell`` of a full block's bytes."""
    room = budget["tokens"] if "tokens" in budget else budget["ratio"] * seen
    if kivi is None:
        return max(math.floor(room / bs + 1e-9), 1)
    room = (room - (seen - quantized_count(kivi, seen))) * kivi["full_cell"] / (bs * kivi["cell"])
    return max(math.floor(room + 1e-9), 1)


def quantized_count(kivi, seen):
    return max(0, (seen - kivi["residual"]) // kivi["group_size"]) * kivi["group_size"]


def fake_quantize(cache, keep, kivi):
    """KIVI on the cached tokens ``keep`` (a contiguous run of whole key groups): keys per channel over group_size
    tokens, values per token over value_group channels, replaced by what their codes dequantize to."""
    from kvstack.kernels.quant_pack import dequantize, quantize

    for layer in cache.layers:
        k, v = layer.keys[:, :, keep], layer.values[:, :, keep]
        layer.keys[:, :, keep] = dequantize(quantize(k.contiguous(), kivi["bits"], kivi["group_size"], "token"))
        layer.values[:, :, keep] = dequantize(quantize(v.contiguous(), kivi["bits"], kivi["value_group"], "channel"))


def generate(path, prompt, *, max_tokens, block_size, budget, scorer="value_key_ratio", aggregate="mean",
             n_sink=0, recent=0, chunk=None, kivi=None):
    """``kivi``: also quantize (dict: bits, group_size, value_group, residual, and the page's cell / full_cell
    bytes): after each forward, the whole key groups beyond the residual become their dequantized values, and only
    blocks wholly quantized may leave."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    logical = torch.empty(0, dtype=torch.long)  # the logical position of every cached token
    scores = torch.empty(0)  # every token's score, by logical position, taken as it arrives
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
            before, seen = seen, seen + n
            if not pieces:
                lp = out.logits[0, -1].float().log_softmax(-1)
                tokens.append(int(lp.argmax()))
                logprobs.append(float(lp[tokens[-1]]))
            keys = torch.stack([layer.keys[0, :, -n:] for layer in cache.layers]).float()
            values = torch.stack([layer.values[0, :, -n:] for layer in cache.layers]).float()
            scores = torch.cat([scores, token_scores(keys, values, scorer, torch.arange(before, seen))])
            if kivi is not None:
                lo, hi = quantized_count(kivi, before), quantized_count(kivi, seen)
                if hi > lo:
                    fake_quantize(cache, (logical >= lo) & (logical < hi), kivi)
            block_of = logical // block_size
            held = sorted(set(block_of.tolist()))
            for b in held:
                if (b + 1) * block_size <= seen and b not in block_score:
                    mine = scores[b * block_size : (b + 1) * block_size]
                    block_score[b] = float(getattr(mine, {"mean": "mean", "min": "amin", "max": "amax"}[aggregate])())
            excess = len(held) - allowed(budget, seen, block_size, kivi)
            newest = (seen - 1) // block_size
            if excess > 0:
                def protected(b):
                    return b < math.ceil(n_sink / block_size) or (recent and b >= (seen - recent) // block_size)

                def in_pages(b):
                    return kivi is None or (b + 1) * block_size <= quantized_count(kivi, seen)

                ranked = sorted((protected(b), block_score[b], b) for b in held if b != newest and in_pages(b))
                gone = {b for _, _, b in ranked[:excess]}
                keep = ~torch.isin(block_of, torch.tensor(sorted(gone), dtype=torch.long))
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
                logical = logical[keep]
    return tokens, logprobs


def generate_kvstack(path, stack, prompt, *, max_tokens, chunk=None):
    """Greedy tokens and log-probabilities of kvstack's own transformers cache with ``stack`` (float32): what the
    engine's quantized pages must reproduce. ``chunk``: the prompt is prefilled ``chunk`` tokens per forward."""
    import kvstack

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kvstack.apply(model, {**stack, "prefill_chunk": chunk})
    cache = kvstack.cache_for(model)
    tokens, logprobs, ids = [], [], list(prompt)
    with torch.no_grad():
        while len(tokens) < max_tokens:
            out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
            lp = out.logits[0, -1].float().log_softmax(-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp[tokens[-1]]))
            ids = [tokens[-1]]
    return tokens, logprobs
