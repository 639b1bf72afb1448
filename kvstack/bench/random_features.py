"""``python -m kvstack.bench.random_features`` — can a better training-free feature map rescue random features?

Teacher-forced attention-output error per layer (decode queries at positions ``prefix..``, recency eviction at the
equal-memory budget of ``kvstack.bench.lowrank``), relative to eviction alone at the full budget (1.0 = no better
than eviction; below 1 = the state helps), for unbiased variants of positive random features of ``exp(s q.k)``:

* ``favor+``: FAVOR+ (Choromanski et al., arXiv 2009.14794), the map ``kind: lowrank`` uses;
* ``gerf A``: generalized exponential random features (Likhosherstov et al., "Chefs' Random Tables", NeurIPS 2022):
  ``log phi(x) = A|w|^2 + sqrt(1-4A) w.x' - |x'|^2/2 + (d/4) log(1-4A) - log(m)/2``, unbiased for every ``A < 1/8``,
  relative variance ``~ exp(|q'+k'|^2 / (1-8A))`` (``A = 0`` is FAVOR+);
* ``balanced a``: queries scaled by ``a`` and keys by ``1/a`` (same kernel, different variance);
* ``centred``: ``exp(s q.k) = exp(s q.mu) exp(s q.(k - mu))`` with ``mu`` the mean of the passage's first
  ``prefix`` keys per head; the first factor is exact, the features estimate the second.

Also prints the norms ``|sqrt(s) q|``, ``|sqrt(s) k|`` and ``|sqrt(s) (k - mu)|`` that drive the variance. Writes JSON.
Calibration passages 32..39 of the dev file (8 passages), about 2 CPU-minutes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvstack.bench.lowrank import equal_memory_tokens, layer_errors, stack
from kvstack.bench.protocol import load_model, load_passages
from kvstack.stack.shape import ModelShape
from kvstack.stages.lowrank_learned import capture

GERF_A = (-0.5, -1.0, -2.0, -4.0, -16.0)
BALANCE = (0.5, 2.0)


def gerf_log_features(x: torch.Tensor, proj: torch.Tensor, a: float) -> torch.Tensor:
    """``log phi(x)`` of generalized exponential random features for already-scaled ``x`` [P, H, T, d] and
    projections ``proj`` [H, m, d] (rows ~ N(0, I)): ``E[phi(q).phi(k)] = exp(q.k)`` for every ``a < 1/8``."""
    d, m = x.shape[-1], proj.shape[-2]
    lin = math.sqrt(1 - 4 * a) * torch.matmul(x, proj.transpose(-1, -2))
    bias = a * (proj**2).sum(-1)[None, :, None, :] + (d / 4) * math.log(1 - 4 * a) - 0.5 * math.log(m)
    return lin + bias - 0.5 * (x * x).sum(-1, keepdim=True)


class VariantFeatures:
    """One layer's feature map for :func:`kvstack.bench.lowrank.layer_errors` (which calls ``log_key`` first)."""

    def __init__(self, proj: torch.Tensor, a: float = 0.0, balance: float = 1.0, centre_tokens: int | None = None):
        self.proj, self.a, self.balance, self.centre_tokens = proj.double(), a, balance, centre_tokens
        self.mu = None

    def log_key(self, k: torch.Tensor, scaling: float) -> torch.Tensor:
        k = k.double() * math.sqrt(scaling)
        centre = k[:, :, : self.centre_tokens].mean(2, keepdim=True) if self.centre_tokens else None
        self.mu = torch.zeros_like(k[:, :, :1]) if centre is None else centre
        return gerf_log_features((k - self.mu) / self.balance, self.proj, self.a)

    def log_query(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        q = q.double() * math.sqrt(scaling)
        shift = (q * self.mu).sum(-1, keepdim=True)  # exp(s q.mu), exact
        return gerf_log_features(q * self.balance, self.proj, self.a) + shift


def run(args) -> dict:
    model, tok = load_model()
    shape = ModelShape.from_model(model)
    texts = load_passages(n=None)[32 : 32 + args.passages]
    data, layers = capture(model, [torch.tensor(tok(t)["input_ids"][: args.max_len]) for t in texts])
    norms = []
    for layer, d in zip(layers, data):
        q, k = d["q"] * math.sqrt(d["scaling"]), d["k"] * math.sqrt(d["scaling"])
        centred = k - k[:, :, : args.prefix].mean(2, keepdim=True)
        norms.append({"layer": layer, "query": float(q.norm(dim=-1).mean()), "key": float(k.norm(dim=-1).mean()),
                      "centred_key": float(centred.norm(dim=-1).mean())})
    variants = {"favor+": {}} | {f"gerf A={a:g}": {"a": a} for a in GERF_A}
    variants |= {f"balanced a={b:g}": {"balance": b} for b in BALANCE} | {"centred": {"centre_tokens": args.prefix}}
    rows = []
    for target in args.targets:
        tokens = round(target * args.prefix)
        base = stack("window+sinks", tokens)
        lowrank = stack("+lowrank random", equal_memory_tokens(shape, tokens, args.rank), {"rank": args.rank})
        reference = layer_errors(data, layers, shape, base, args.prefix)
        projections = [m.proj for m in lowrank.stages[1].feature_maps(shape)]
        for name, options in ({"eviction only (fewer tokens)": None} | variants).items():
            maps = None if options is None else {l: VariantFeatures(projections[l], **options) for l in layers}
            errors = layer_errors(data, layers, shape, lowrank, args.prefix, maps)
            relative = [e / r for e, r in zip(errors, reference)]
            rows.append({"target": target, "variant": name, "relative_error": relative})
            print(f"{target:.3f} {name}: " + " ".join(f"{e:.3f}" for e in rows[-1]["relative_error"]), flush=True)
    result = {"rank": args.rank, "passages": len(texts), "norms": norms, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def markdown(result: dict) -> str:
    n = len(result["rows"][0]["relative_error"])
    lines = ["| memory | variant | " + " | ".join(f"L{i}" for i in range(n)) + " |", "|" + " --- |" * (n + 2)]
    for r in result["rows"]:
        errors = " | ".join(f"{e:.3f}" for e in r["relative_error"])
        lines.append(f"| {r['target']:.1%} | {r['variant']} | {errors} |")
    lines += ["", "| layer | mean sqrt(s) q norm | key norm | centred key norm |", "| --- | --- | --- | --- |"]
    lines += [f"| {x['layer']} | {x['query']:.2f} | {x['key']:.2f} | {x['centred_key']:.2f} |" for x in result["norms"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passages", type=int, default=8, help="calibration passages (from index 32 on)")
    p.add_argument("--targets", type=float, nargs="+", default=[0.25, 0.125], help="memory targets")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prefix", type=int, default=384)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--out", default="random_features.json")
    args = p.parse_args()
    print(markdown(run(args)))


if __name__ == "__main__":
    main()
