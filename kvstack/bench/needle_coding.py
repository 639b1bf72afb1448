"""What loses the needle, keys or values: the needle protocol with the context's keys and values transform-coded in
place, at chosen widths and key bases, with no budget and nothing dropped.

    python -m kvstack.bench.needle_coding [--model DIR|GGUF] [--codings 16/16,4c/3,4/3,16/3]
                                          [--tasks 4] [--lengths 1024,2048,4096] [--only 4,26]
                                          [--threads 2] [--out DIR]

Each task's context is prefilled into transformers' own ``DynamicCache``; then, in every layer, the keys and values
of all tokens but the first 4 and the newest 32 (a stack's sinks and residual) are replaced by their round trip
through a :class:`kvstack.kernels.transform_code.ComponentCode` fitted on them, as a transform-coded tier codes keys
(all KV heads of a token as one vector, keys pre-RoPE); then the question is fed and the answer decoded greedily, as
in :func:`kvstack.bench.real_model.needle_task`. A coding ``K/V`` gives the key and value bits per element (16: left
exact; fractional widths as ``key_bits`` takes them) and the key basis by a suffix on ``K``:

* none — the principal axes of this context's own keys (``own``: no cache could hold them for free, an upper bound
  on what a fixed basis does);
* ``c`` — ``key_basis: calibrated`` (fitted once per model on the text it samples itself, as the stage does);
* ``w`` — ``key_basis: weights`` (the ``k_proj`` weight's left singular vectors);
* ``c+16`` / ``w+16`` — that basis with the coded tokens' own 16 leading principal axes leading it, as
  ``prompt_axes: 16`` builds it (the reflectors rounded to the cache's dtype, as the tier holds them).

Values are coded in their own principal axes (a bound, as ``own`` keys are), or with a ``c`` suffix on ``V`` in the
calibrated value basis that ``value_coding: transform`` uses (fitted with the key basis, :func:`calibrate_bases`).
Nothing here is a memory figure: it separates the precision that loses a needle from the selection that does.
Writes ``DIR/needle_coding.json`` (one row per task and coding, with the reply) and prints the count per coding and
length, with the tasks each misses.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

#: tokens at each end of the context left exact, as a stack keeps its sinks and its residual
SINKS, RESIDUAL = 4, 32
EXACT = 16.0
_CODING = re.compile(r"^(?P<key>\d+(?:\.\d+)?)(?P<basis>[cw]?)(?:\+(?P<axes>\d+))?/(?P<value>\d+(?:\.\d+)?)"
                     r"(?P<vbasis>c?)$")
BASES = {"": "own", "c": "calibrated", "w": "weights"}


def parse_coding(text: str) -> tuple[float, str, float, str, int]:
    """``"4c/3"`` -> (4.0, "calibrated", 3.0, "own", 0); ``"3c/1.5c"`` -> (3.0, "calibrated", 1.5, "calibrated", 0);
    ``"4c+16/3"`` -> (4.0, "calibrated", 3.0, "own", 16): key bits, key basis, value bits, value basis, prompt axes;
    a ``ValueError`` naming the coding and the form otherwise."""
    match = _CODING.match(text.strip())
    if match is None or (match["axes"] is not None and not match["basis"]):
        raise ValueError(f"coding {text!r} is not allowed: KEY_BITS[c|w][+AXES]/VALUE_BITS[c], e.g. 4c/3, 4c+16/3 "
                         "or 3c/1.5c (+AXES: the prompt's axes leading a c or w basis)")
    key, value = float(match["key"]), float(match["value"])
    for name, bits in (("key", key), ("value", value)):
        if not (0 < bits <= 8 or bits == EXACT):
            raise ValueError(f"coding {text!r}: {name} bits {bits:g} are not allowed: in (0, 8], or 16 for exact")
    return key, BASES[match["basis"]], value, BASES[match["vbasis"]], int(match["axes"] or 0)


def own_axes(x: torch.Tensor) -> torch.Tensor:
    """Principal axes [C, C] (by decreasing variance) of vectors x [n, C]."""
    centred = x - x.mean(0)
    return torch.linalg.eigh((centred.T @ centred).double())[1].flip(-1).float()


def code_rows(x: torch.Tensor, bits: float, basis: torch.Tensor | None = None, prompt_axes: int = 0,
              axes_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [n, C] float32 -> x with rows ``SINKS:n-RESIDUAL`` replaced by their round trip through a coder fitted on
    them in ``basis`` (None: their own principal axes), led by their ``prompt_axes`` own axes (reflectors rounded to
    ``axes_dtype``, as ``prompt_axes`` holds them)."""
    from kvstack.kernels.transform_code import ComponentCode, own_axes_reflectors, reflector_product
    from kvstack.stages._transform_tier import coder_levels

    n, c = x.shape
    middle = x[SINKS : n - RESIDUAL]
    if middle.shape[0] < 2:
        return x
    basis = own_axes(middle) if basis is None else basis
    if prompt_axes:
        basis = basis @ reflector_product(own_axes_reflectors(middle @ basis, prompt_axes).to(axes_dtype))
    y = middle @ basis
    code = ComponentCode.fit(y, round(bits * c), coder_levels(c, bits))
    out = x.clone()
    out[SINKS : n - RESIDUAL] = code.decode(code.encode(y)) @ basis.T
    return out


@torch.no_grad()
def code_cache(cache, shape, key_bits: float, value_bits: float, bases: dict[int, torch.Tensor] | None,
               value_bases: dict[int, torch.Tensor] | None = None, prompt_axes: int = 0) -> None:
    """Code every layer of a ``DynamicCache`` holding one sequence at positions ``0..n-1`` in place (module
    docstring); ``bases`` / ``value_bases``: the key / value basis per layer (None: each layer's own axes);
    ``prompt_axes``: the keys' own axes leading their basis."""
    from kvstack.kernels.rope import apply_rope, rope_angles
    from kvstack.stages._quant_options import rope_frequencies
    from kvstack.stages._transform_tier import pre_rope_vectors

    for index, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values  # [1, Hkv, n, D]
        _, heads, n, dim = keys.shape
        if key_bits < EXACT:
            inv_freq = rope_frequencies(shape, index)
            positions = torch.arange(n, device=keys.device)
            x = pre_rope_vectors(keys, positions[None, None], inv_freq)[0]
            coded = code_rows(x, key_bits, None if bases is None else bases[index], prompt_axes, keys.dtype)
            cos, sin = rope_angles(positions, inv_freq.to(keys.device))
            rotated = apply_rope(coded.reshape(n, heads, dim).transpose(0, 1)[None], cos, sin).to(keys.dtype)
            middle = slice(SINKS, max(SINKS, n - RESIDUAL))
            layer.keys = keys.clone()
            layer.keys[..., middle, :] = rotated[..., middle, :]  # the exact rows as written, not via RoPE and back
        if value_bits < EXACT:
            x = values.float()[0].transpose(0, 1).reshape(n, -1)
            coded = code_rows(x, value_bits, None if value_bases is None else value_bases[index])
            layer.values = coded.reshape(n, heads, -1).transpose(0, 1)[None].to(values.dtype)


def measure(model, tokenizer, tasks: list[dict], codings: list[str], max_new_tokens: int = 16) -> list[dict]:
    """One row per (task, coding): the needle protocol's reply and whether it holds the answer."""
    from transformers import DynamicCache

    from kvstack.bench import real_model
    from kvstack.stack.shape import ModelShape
    from kvstack.stages._transform_tier import calibrate_bases, key_basis, value_basis

    parsed = {text: parse_coding(text) for text in codings}
    shape = ModelShape.from_model(model)
    layers = range(shape.num_layers)
    key_sources = {basis for key, basis, _, _, _ in parsed.values() if key < EXACT and basis != "own"}
    coded_values = any(vb == "calibrated" and bits < EXACT for _, _, bits, vb, _ in parsed.values())
    bases: dict[str, dict[int, torch.Tensor]] = {}
    value_bases = None
    # one calibration pass fits the keys' and the values' bases together
    undo = calibrate_bases(model) if "calibrated" in key_sources or coded_values else (lambda: None)
    try:
        for source in key_sources:
            bases[source] = {i: key_basis(shape, i, source) for i in layers}
        if coded_values:
            value_bases = {i: value_basis(shape, i) for i in layers}
    finally:
        undo()
    eos = real_model._eos_ids(model, tokenizer)
    rows = []
    for index, task in enumerate(tasks):
        for text, (key_bits, basis, value_bits, vbasis, axes) in parsed.items():
            def code(cache):
                code_cache(cache, shape, key_bits, value_bits, bases.get(basis),
                           value_bases if vbasis == "calibrated" else None, axes)

            row = real_model.needle_task(model, tokenizer, task, DynamicCache(config=model.config), 1,
                                         max_new_tokens, eos, after_context=code)
            rows.append({"task": task.get("_index", index), "coding": text, "key_bits": key_bits,
                         "key_basis": basis, "prompt_axes": axes, "value_bits": value_bits, "value_basis": vbasis,
                         "context_tokens": row["context_tokens"], "depth": row["depth"], "answer": row["answer"],
                         "reply": row["reply"], "correct": row["correct"]})
    return rows


def markdown(rows: list[dict]) -> str:
    """Found / tasks per coding and length, and the tasks (indices within their length) each coding misses."""
    lengths = sorted({r["context_tokens"] for r in rows})
    codings = list(dict.fromkeys(r["coding"] for r in rows))
    lines = ["| keys / values | " + " | ".join(f"{n} tokens" for n in lengths) + " | missed |",
             "| --- | " + " | ".join("---:" for _ in lengths) + " | --- |"]
    for coding in codings:
        cells, missed = [], []
        for n in lengths:
            at = [r for r in rows if r["coding"] == coding and r["context_tokens"] == n]
            cells.append(f"{sum(r['correct'] for r in at)}/{len(at)}")
            missed += [f"{n}:{r['task']}" for r in at if not r["correct"]]
        lines.append(f"| {coding} | " + " | ".join(cells) + f" | {', '.join(missed) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from kvstack.bench import models, real_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: the shared SmolLM2)")
    parser.add_argument("--codings", default="16/16,4c/3,4/3,16/3",
                        help="KEY_BITS[c|w][+AXES]/VALUE_BITS[c], comma-separated (16: exact; c: calibrated, "
                        "w: weights basis; +AXES: the prompt's own axes leading it)")
    parser.add_argument("--tasks", type=int, default=4, help="needle tasks per length (the first N)")
    parser.add_argument("--lengths", default="1024,2048,4096", help="context lengths of the needle dev set")
    parser.add_argument("--only", default=None, help="task indices within each length to run (e.g. 4,26)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="runs/needle-coding")
    args = parser.parse_args(argv)
    codings = args.codings.split(",")
    for text in codings:
        try:
            parse_coding(text)
        except ValueError as err:
            parser.error(f"--codings: {err}")
    if args.threads:
        torch.set_num_threads(args.threads)
    source = args.model or real_model.model_path()
    model, tokenizer = models.load_causal_lm(source)
    only = None if args.only is None else {int(i) for i in args.only.split(",")}
    tasks = []
    for length in (int(n) for n in args.lengths.split(",")):
        at = real_model.load_needle_tasks(lengths=(length,), per_length=args.tasks)
        tasks += [t | {"_index": i} for i, t in enumerate(at) if only is None or i in only]
    rows = measure(model, tokenizer, tasks, codings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = models.describe_source(source) | {"model_dtype": str(models.model_dtype(model)), "codings": codings,
                                             "tasks_per_length": args.tasks, "only": args.only,
                                             "sinks": SINKS, "residual": RESIDUAL, "threads": torch.get_num_threads()}
    (out / "needle_coding.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
    print(markdown(rows))
    print(f"\nwrote {out / 'needle_coding.json'}")


if __name__ == "__main__":
    main()
