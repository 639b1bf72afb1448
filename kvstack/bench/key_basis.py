"""Which basis transform-coded keys should use: attention error of 1- to 4-bit keys per ``key_basis``, on SmolLM2.

    python -m kvstack.bench.key_basis [--model DIR|GGUF] [--bits 1,2,4] [--length 1024] [--texts 2]
                                      [--calibration sampled|random|FILE.jsonl] [--key-scale none,token]
                                      [--prompt-axes 16,32] [--threads 2] [--out DIR]

For every layer of a Llama-family model (separate ``q_proj``, standard RoPE) and each evaluation text (the first
``--texts`` code passages and the first ``--texts`` 1K needle contexts of the dev sets, cut to ``--length`` tokens),
the text's pre-RoPE keys are transform-coded as the ``coding: transform`` tier codes them
(:class:`kvstack.kernels.transform_code.ComponentCode` fitted on the coded tokens; the first 4 tokens and the newest
32 stay exact, as a stack's sinks and residual do) in three bases:

* ``weights`` — the left singular vectors of ``k_proj``'s weight (``key_basis: weights``);
* ``calibrated`` — the principal axes of the keys on calibration text (``key_basis: calibrated``,
  :func:`kvstack.stages._transform_tier.calibrate_bases`): by default (``sampled``) what the stage uses without
  ``calibration=``, text the model samples itself; ``random``: 4 x 512 random token ids; or the first 8 texts of a
  JSONL file of ``{"text": ...}`` lines (512 tokens each);
* ``own`` — the principal axes of the evaluated text's own keys: a reference no cache could hold for free (it
  would store C x C numbers per layer), showing how far a fixed basis is from the best one;
* ``calibrated+r`` (``--prompt-axes r``) — the calibrated basis led by the coded tokens' own ``r`` leading axes, as
  ``prompt_axes: r`` builds it (r reflectors of C numbers, rounded to the model dtype as the tier holds them).

With ``--key-scale none,token`` every width is measured twice: as ``key_scale: none`` codes keys, and as
``key_scale: token`` does (each vector centred and divided by its root mean square before the coder is fitted and
applied, the scale rounded to float8_e4m3fn: :func:`kvstack.kernels.transform_code.scale_tokens`).

The figure per (text, bits, key scale, basis) is the causal attention output's relative squared error with coded keys
and exact values, ``sum ||o^ - o||^2 / sum ||o||^2`` over queries, heads and layers (averaged over layers). Writes
``DIR/key_basis.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

#: tokens at each end kept exact, as a transform-coded stack keeps its sinks and its residual
SINKS, RESIDUAL = 4, 32
QUERY_CHUNK = 256


def _attention_error(q, k, k_hat, v, groups: int) -> tuple[float, float]:
    """(sum of squared output errors, sum of squared outputs) of causal attention, query rows in chunks."""
    scale = q.shape[-1] ** -0.5
    k, k_hat, v = (x.repeat_interleave(groups, 0) for x in (k, k_hat, v))
    err = ref = 0.0
    n = q.shape[1]
    for start in range(0, n, QUERY_CHUNK):
        rows = slice(start, min(start + QUERY_CHUNK, n))
        mask = torch.arange(n)[None, :] > torch.arange(n)[rows, None]
        out = []
        for keys in (k, k_hat):
            s = (q[:, rows] @ keys.transpose(-1, -2) * scale).masked_fill(mask, float("-inf"))
            out.append(s.softmax(-1) @ v)
        err += float((out[1] - out[0]).pow(2).sum())
        ref += float(out[0].pow(2).sum())
    return err, ref


@torch.no_grad()
def measure(model, texts: dict[str, list[torch.Tensor]], bits: list[float], calibration=None,
            key_scales=("none",), prompt_axes=()) -> list[dict]:
    """Rows per (text, bits, key scale, basis) (module docstring); ``calibration``: token ids for the calibrated
    basis (None: sampled by the model, as the stage does); ``prompt_axes``: the r of each ``calibrated+r`` basis."""
    from kvstack.kernels.rope import apply_rope, rope_angles
    from kvstack.kernels.transform_code import (
        ComponentCode, fit_token_scale, own_axes_reflectors, reflector_product, scale_tokens,
    )
    from kvstack.stack.apply import output_cache
    from kvstack.stack.shape import ModelShape
    from kvstack.stages._quant_options import rope_frequencies
    from kvstack.stages._transform_tier import calibrate_bases, coder_levels, key_basis, pre_rope_vectors

    shape = ModelShape.from_model(model)
    layers, heads, kv = shape.num_layers, model.config.num_attention_heads, shape.num_kv_heads
    undo = calibrate_bases(model, calibration)
    try:
        fixed = {name: [key_basis(shape, i, name) for i in range(layers)] for name in ("weights", "calibrated")}
    finally:
        undo()
    rows = []
    for kind, seqs in texts.items():
        for index, ids in enumerate(seqs):
            queries = {}
            hooks = [layer.self_attn.q_proj.register_forward_hook(
                lambda m, i, o, idx=idx: queries.__setitem__(idx, o[0].float()))
                for idx, layer in enumerate(model.model.layers)]
            try:
                cache = output_cache(model(ids[None], use_cache=True))
            finally:
                for h in hooks:
                    h.remove()
            n = ids.shape[0]
            totals: dict[tuple[float, str, str], list[float]] = {}
            for layer in range(layers):
                inv_freq = rope_frequencies(shape, layer)
                cos, sin = rope_angles(torch.arange(n), inv_freq)
                keys, values = cache.layers[layer].keys.float()[0], cache.layers[layer].values.float()[0]
                q = apply_rope(queries[layer].reshape(n, heads, -1).transpose(0, 1), cos, sin)
                x = pre_rope_vectors(keys[None], torch.arange(n)[None, None], inv_freq)[0]  # [n, C]
                coded = x[SINKS : n - RESIDUAL]
                centred = coded - coded.mean(0)
                own = torch.linalg.eigh((centred.T @ centred).double())[1].flip(-1).float()
                calibrated = fixed["calibrated"][layer]
                led = {f"calibrated+{r}": calibrated @ reflector_product(
                    own_axes_reflectors(coded @ calibrated, r).to(cache.layers[layer].keys.dtype)) for r in prompt_axes}
                for name, basis in (("weights", fixed["weights"][layer]), ("calibrated", calibrated), ("own", own),
                                    *led.items()):
                    y = x @ basis
                    middle = y[SINKS : n - RESIDUAL]
                    for b, key_scale in ((b, s) for b in bits for s in key_scales):
                        c = y.shape[-1]
                        if key_scale == "token":
                            mean, rms = fit_token_scale(middle)
                            z, scale = scale_tokens(middle, mean, rms, torch.float8_e4m3fn)
                        else:
                            z = middle
                        code = ComponentCode.fit(z, round(b * c), coder_levels(c, b))
                        z_hat = code.decode(code.encode(z))
                        y_hat = y.clone()
                        y_hat[SINKS : n - RESIDUAL] = (
                            mean + (scale.float() * rms)[:, None] * z_hat if key_scale == "token" else z_hat
                        )
                        k_hat = (y_hat @ basis.T).reshape(n, kv, -1).transpose(0, 1)
                        err, ref = _attention_error(q, keys, apply_rope(k_hat, cos, sin), values, heads // kv)
                        totals.setdefault((b, key_scale, name), []).append(err / ref)
            for (b, key_scale, name), errors in totals.items():
                rows.append({"text": f"{kind}[{index}]", "tokens": n, "bits": b, "key_scale": key_scale,
                             "basis": name, "attention_error": sum(errors) / len(errors)})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Mean over texts per (kind, bits, key scale, basis)."""
    out: dict[tuple, list[float]] = {}
    for r in rows:
        key = (r["text"].split("[")[0], r["bits"], r.get("key_scale", "none"), r["basis"])
        out.setdefault(key, []).append(r["attention_error"])
    return [{"texts": k, "bits": b, "key_scale": s, "basis": n, "attention_error": sum(v) / len(v), "count": len(v)}
            for (k, b, s, n), v in out.items()]


def markdown(rows: list[dict]) -> str:
    """One row per (texts, bits, key scale), a column per basis."""
    bases = list(dict.fromkeys(r["basis"] for r in rows))
    table = {}
    for r in summary(rows):
        table.setdefault((r["texts"], r["bits"], r["key_scale"], r["count"]), {})[r["basis"]] = r["attention_error"]
    lines = ["| texts | key bits | key scale | " + " | ".join(bases) + " |",
             "| --- | ---: | --- | " + " | ".join("---:" for _ in bases) + " |"]
    for (kind, b, key_scale, count), v in sorted(table.items()):
        lines.append(f"| {kind} ({count}) | {b:g} | {key_scale} | " + " | ".join(f"{v[n]:.4f}" for n in bases) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from kvstack.bench import models, real_model
    from kvstack.stack.shape import ModelShape

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: the shared SmolLM2)")
    parser.add_argument("--bits", default="1,2,4", help="key bits per element, comma-separated")
    parser.add_argument("--length", type=int, default=1024, help="tokens per evaluation text")
    parser.add_argument("--texts", type=int, default=2, help="code passages and needle contexts each")
    parser.add_argument("--calibration", default="sampled",
                        help="sampled (the model's own text), random (token ids) or a JSONL file of {\"text\": ...}")
    parser.add_argument("--key-scale", default="none",
                        help="none, token or none,token: key_scale of the coded keys (token: a float8 scale per key)")
    parser.add_argument("--prompt-axes", default="",
                        help="comma-separated r: also the calibrated basis led by the text's own r axes (prompt_axes)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="runs/key-basis")
    args = parser.parse_args(argv)
    try:
        prompt_axes = [int(r) for r in args.prompt_axes.split(",") if r]
    except ValueError:
        parser.error(f"--prompt-axes {args.prompt_axes!r} is not allowed: comma-separated whole numbers, e.g. 16,32")
    if any(r < 1 for r in prompt_axes):
        parser.error(f"--prompt-axes {args.prompt_axes!r} is not allowed: each at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    source = args.model or real_model.model_path()
    model, tokenizer = models.load_causal_lm(source)
    shape = ModelShape.from_model(model)
    components = shape.num_kv_heads * shape.head_dim
    if any(r > components for r in prompt_axes):
        parser.error(f"--prompt-axes {args.prompt_axes!r} is not allowed: each at most num_kv_heads x head_dim = "
                     f"{components} for this model")

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][: args.length])

    needles = real_model.load_needle_tasks(lengths=(1024,), per_length=args.texts)
    texts = {"code": [encode(t) for t in real_model.load_code_passages(n=args.texts)],
             "needle": [real_model.needle_prompt(tokenizer, t)[0][: args.length] for t in needles]}
    bits = [float(b) for b in args.bits.split(",")]
    key_scales = args.key_scale.split(",")
    for key_scale in key_scales:
        if key_scale not in ("none", "token"):
            parser.error(f"--key-scale {key_scale!r} is not allowed: none, token or both (none,token)")
    if args.calibration == "sampled":
        calibration = None
    elif args.calibration == "random":
        calibration = torch.randint(3, model.config.vocab_size, (4, 512), generator=torch.Generator().manual_seed(0))
    else:
        lines = [json.loads(line)["text"] for line in Path(args.calibration).read_text().splitlines() if line.strip()]
        calibration = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"][:512]) for t in lines[:8]]
    rows = measure(model, texts, bits, calibration, key_scales, prompt_axes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = models.describe_source(source) | {"model_dtype": str(next(model.parameters()).dtype), "bits": bits,
                                             "length": args.length, "calibration": args.calibration,
                                             "key_scale": key_scales, "prompt_axes": prompt_axes,
                                             "threads": torch.get_num_threads()}
    (out / "key_basis.json").write_text(json.dumps({"metadata": meta, "rows": rows, "summary": summary(rows)},
                                                   indent=2) + "\n")
    print(markdown(rows))
    print(f"\nwrote {out / 'key_basis.json'}")


if __name__ == "__main__":
    main()
