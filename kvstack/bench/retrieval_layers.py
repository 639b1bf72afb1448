"""Which layers retrieve: the layers whose attention reads a planted needle, to be given the budget with
``layer_weights`` (docs/budgets.md, "Layer weights").

    python -m kvstack.bench.retrieval_layers [--model DIR|GGUF] [--haystack FILE.jsonl] [--start 24] [--tasks 8]
                                             [--length 1024] [--top 10] [--weight 4] [--threads 2] [--out DIR]

Each of ``tasks`` passages of the haystack (JSON lines with a ``text``; default the code passages, from passage
``start`` on, so the ones ``--protocol code-kl`` evaluates are not used) is cut to ``length`` tokens, and a sentence
"The secret number of NAME is NNNNN." is planted at a seeded depth with the needle protocol's question after it
(:func:`kvstack.bench.real_model.needle_texts`: chat template, context, question). The context is prefilled into
transformers' own ``DynamicCache``; the question is then fed with eager attention, which returns its attention
weights (question tokens x context: nothing grows with the context squared). A KV head's score is the attention
mass its query heads (the most reading one of each group) put on the needle sentence's tokens, averaged over the
question's tokens and the tasks; a layer's is its best head's. Prints the layers by score and the ``layer_weights``
of the ``top`` ones at ``weight``; writes ``DIR/retrieval_layers.json`` (every task's scores, the means, the choice).

Nothing here is a memory figure and no stage imports it: it chooses the weights a spec then carries (on SmolLM2 the
ten layers it names are the same from code passages 0-7 and 24-31).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

NAMES = ("Zara", "Omar", "Lena", "Ivan", "Mei", "Tom", "Nia", "Raj", "Eva", "Kofi", "Ana", "Yuki")
SEED = 0


def planted_tasks(texts: list[str], tokenizer, length: int, seed: int = SEED) -> list[dict]:
    """One needle task per text: its first ``length`` tokens with the needle sentence at a seeded depth (5-95%)."""
    rng = random.Random(seed)
    tasks = []
    for text in texts:
        text = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:length])
        name, number = rng.choice(NAMES), str(rng.randrange(10000, 100000))
        cut = max(text.rfind(" ", 0, int(len(text) * rng.uniform(0.05, 0.95))), 0)
        needle = f"The secret number of {name} is {number}."
        tasks.append({
            "context": f"{text[:cut]} {needle} {text[cut:]}", "needle": needle, "answer": number,
            "question": f"What is the secret number of {name}? Answer with the number only.",
        })
    return tasks


def needle_span(tokenizer, context: str, needle: str) -> tuple[torch.Tensor, range]:
    """(the context's token ids, the range of those that hold the needle sentence's characters)."""
    encoded = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
    start = context.rindex(needle)
    end = start + len(needle)
    held = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < end and b > start]
    return torch.tensor(encoded["input_ids"]), range(held[0], held[-1] + 1)


@torch.no_grad()
def head_scores(model, tokenizer, task: dict) -> torch.Tensor:
    """[layers, KV heads]: the attention mass the question puts on the needle's tokens (module docstring)."""
    from transformers import DynamicCache

    from kvstack.bench.real_model import needle_texts
    from kvstack.stack.apply import cache_kwarg

    context_text, question_text = needle_texts(tokenizer, task)
    context, span = needle_span(tokenizer, context_text, task["needle"])
    question = torch.tensor(tokenizer(question_text, add_special_tokens=False)["input_ids"])
    device = next(model.parameters()).device
    cache = {cache_kwarg(model): DynamicCache(config=model.config)}
    model(context[None].to(device), use_cache=True, **cache)
    attention = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(question[None].to(device), use_cache=True, output_attentions=True, **cache)
    finally:
        model.set_attn_implementation(attention)
    text = model.config.get_text_config()
    kv_heads = text.num_key_value_heads
    scores = []
    for weights in out.attentions:  # [1, query heads, question, context + question]
        mass = weights[0, :, :, span.start : span.stop].float().sum(-1).mean(-1)  # per query head
        scores.append(mass.view(kv_heads, -1).amax(-1))
    return torch.stack(scores).cpu()


def choose(layer_scores: list[float], top: int, weight: float) -> dict[int, float]:
    """The ``top`` best-scored layers at ``weight`` (ties by index)."""
    order = sorted(range(len(layer_scores)), key=lambda i: (-layer_scores[i], i))[:top]
    return {i: weight for i in sorted(order)}


def main(argv=None) -> None:
    from kvstack.bench import models, real_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: the shared SmolLM2)")
    parser.add_argument("--haystack", default=None, help="JSON lines with 'text' (default: the code passages)")
    parser.add_argument("--start", type=int, default=24, help="first passage of the haystack to use")
    parser.add_argument("--tasks", type=int, default=8, help="passages, one needle each")
    parser.add_argument("--length", type=int, default=1024, help="tokens of haystack per task")
    parser.add_argument("--top", type=int, default=10, help="layers to weight")
    parser.add_argument("--weight", type=float, default=4.0, help="their weight (the others 1)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="runs/retrieval-layers")
    args = parser.parse_args(argv)
    for name in ("tasks", "length", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} is not allowed: at least 1")
    if args.weight <= 0:
        parser.error(f"--weight {args.weight:g} is not allowed: greater than 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    haystack = args.haystack or real_model.code_data_path()
    try:
        texts = real_model.load_code_passages(haystack, n=None)[args.start : args.start + args.tasks]
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        parser.error(f"--haystack {haystack}: every line must be a JSON object with a 'text' ({err!r})")
    if len(texts) < args.tasks:
        parser.error(f"--start {args.start} --tasks {args.tasks}: the haystack has {args.start + len(texts)} texts")
    source = args.model or real_model.model_path()
    model, tokenizer = models.load_causal_lm(source)
    tasks = planted_tasks(texts, tokenizer, args.length)
    per_task = torch.stack([head_scores(model, tokenizer, task) for task in tasks])  # [tasks, layers, KV heads]
    heads = per_task.mean(0)
    layers = heads.amax(-1).tolist()
    weights = choose(layers, min(args.top, len(layers)), args.weight)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = models.describe_source(source) | {
        "haystack": Path(haystack).name, "start": args.start, "tasks": args.tasks, "length": args.length,
        "seed": SEED, "model_dtype": str(models.model_dtype(model)),
        "score": "attention mass of the question's tokens on the needle sentence's tokens; per KV head: the max over "
                 "its query heads; per layer: the max over its KV heads; averaged over the tasks",
    }
    result = {"metadata": meta, "layer_scores": layers, "head_scores": heads.tolist(),
              "task_scores": per_task.tolist(), "answers": [t["answer"] for t in tasks],
              "layer_weights": {str(k): v for k, v in weights.items()}}
    (out / "retrieval_layers.json").write_text(json.dumps(result, indent=2) + "\n")
    ranked = sorted(range(len(layers)), key=lambda i: -layers[i])
    print("layer  score")
    for i in ranked:
        print(f"{i:5d}  {layers[i]:.3f}")
    print("\nlayer_weights: {" + ", ".join(f"{k}: {v:g}" for k, v in weights.items()) + "}")
    print(f"\nwrote {out / 'retrieval_layers.json'}")


if __name__ == "__main__":
    main()
