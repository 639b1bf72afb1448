"""Native-GPU agreement of every Triton kernel with its torch reference (run where CUDA is available).

    python -m kvstack.bench.gpu_check [--out DIR]

The CI tests run the kernels under ``TRITON_INTERPRET=1`` on the CPU; this check compiles them for the real device
and compares against the references on random inputs (fp32/fp16/bf16, bits 2/4/8, ragged lengths, GQA 4, a
low-rank state). Prints one line per case and exits non-zero on any disagreement beyond the stated tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvstack.kernels.lowrank_update import draw_features, empty_state, fold_reference, fold_triton, log_features
from kvstack.kernels.quant_pack import quantize_reference, quantize_triton
from kvstack.kernels.tiered_attention import (
    FullTierData,
    QuantTierData,
    StateData,
    mass_selector,
    tiered_attention_reference,
    tiered_attention_triton,
)

TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(a) & torch.isfinite(b)
    same_inf = (a == b) | finite
    if not bool(same_inf.all()):
        return float("inf")
    return float((a[finite].double() - b[finite].double()).abs().max()) if bool(finite.any()) else 0.0


def check_quant_pack(device) -> list[dict]:
    rows = []
    for dtype in TOL:
        for bits in (2, 4, 8):
            for axis, shape in (("token", (2, 4, 96, 128)), ("channel", (2, 4, 77, 128))):
                x = torch.randn(shape, device=device, dtype=dtype) * 3
                ref, tri = quantize_reference(x, bits, 32, axis), quantize_triton(x, bits, 32, axis)
                ok = torch.equal(ref.packed, tri.packed) and torch.equal(ref.scale, tri.scale)
                rows.append(dict(kernel="quant_pack", case=f"{dtype} {bits}b {axis}", error=0.0 if ok else 1.0, ok=ok))
    return rows


def check_fold(device) -> list[dict]:
    rows = []
    proj = draw_features(128, 64, seed=0, num_heads=4, device=device)
    for n in (1, 37, 1000):
        k = torch.randn(2, 4, n, 128, device=device)
        v = torch.randn(2, 4, n, 128, device=device)
        valid = torch.rand(2, 4, n, device=device) > 0.2
        lpsi = log_features(k, proj, 128**-0.5)
        ref = fold_reference(empty_state(2, 4, 64, 128, device=device), lpsi, v, valid)
        tri = fold_triton(empty_state(2, 4, 64, 128, device=device), lpsi, v, valid)
        err = max(_err(ref.H, tri.H) / max(1.0, float(ref.H.abs().max())), _err(ref.z, tri.z) / max(1.0, float(ref.z.abs().max())))
        rows.append(dict(kernel="lowrank_fold", case=f"n={n}", error=err, ok=err <= 1e-5))
    return rows


def check_tiered(device, sizes=((0, 61), (4096, 100), (32768, 128)), dims=(2, 4, 4, 128)) -> list[dict]:
    rows = []
    B, H, G, D = dims
    proj = draw_features(D, 32, seed=1, num_heads=H, device=device)
    for dtype in TOL:
        for bits in (2, 4, 8):
            for tq, tf in sizes:
                q = torch.randn(B, H, G, D, device=device, dtype=torch.float32)
                total = tq + tf
                qpos = torch.full((G,), total - 1, dtype=torch.int32, device=device)
                full = FullTierData(
                    torch.randn(B, H, tf, D, device=device, dtype=dtype),
                    torch.randn(B, H, tf, D, device=device, dtype=dtype),
                    torch.arange(tq, total, dtype=torch.int32, device=device).expand(B, 1, tf).contiguous(),
                )
                quant = None
                if tq:
                    quant = QuantTierData(
                        quantize_reference(torch.randn(B, H, tq, D, device=device, dtype=dtype), bits, 32, "token"),
                        quantize_reference(torch.randn(B, H, tq, D, device=device, dtype=dtype), bits, 32, "channel"),
                        torch.arange(0, tq, dtype=torch.int32, device=device).expand(B, 1, tq).contiguous(),
                    )
                old = torch.randn(B, H, 50, D, device=device)
                state = fold_reference(empty_state(B, H, 32, D, device=device), log_features(old, proj, D**-0.5), old)
                sd = StateData(state, log_features(q, proj, D**-0.5))
                rows_sel = mass_selector(G, 1, device=device)
                kw = dict(full=full, quant=quant, state=sd, mass_rows=rows_sel)
                ref = tiered_attention_reference(q, qpos, D**-0.5, **kw)
                tri = tiered_attention_triton(q, qpos, D**-0.5, **kw)
                err = max(_err(ref.out, tri.out), _err(ref.lse, tri.lse), _err(ref.mass_full, tri.mass_full))
                if tq:
                    err = max(err, _err(ref.mass_quant, tri.mass_quant))
                rows.append(
                    dict(kernel="tiered_attention", case=f"{dtype} {bits}b Tq={tq} Tf={tf}", error=err, ok=err <= TOL[dtype])
                )
    return rows


def check_stack_end_to_end(device) -> list[dict]:
    """A tiny random Llama on the GPU with eviction + 4-bit KIVI + low-rank state: the stack's attention takes the
    fused kernel at decode (KVSTACK_KERNELS=auto) and agrees with the torch path (KVSTACK_KERNELS=torch)."""
    import os

    from transformers import LlamaConfig, LlamaForCausalLM

    import kvstack
    from kvstack.stack.apply import cache_kwarg

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device).eval()
    spec = {"budget": {"tokens": 256}, "stages": [
        {"kind": "evict", "n_sink": 4}, {"kind": "quantize", "bits": 4, "group_size": 32, "residual": 32},
        {"kind": "lowrank", "rank": 16}]}
    ids = torch.randint(0, 256, (2, 400), device=device)
    outs = {}
    for mode in ("torch", "auto"):
        os.environ["KVSTACK_KERNELS"] = mode
        with torch.no_grad(), kvstack.applied(model, spec):
            arg = {cache_kwarg(model): kvstack.cache_for(model)}
            logits = [model(ids[:, :300], **arg).logits[:, -1]]
            logits += [model(ids[:, t : t + 1], **arg).logits[:, -1] for t in range(300, 400)]
        outs[mode] = torch.stack(logits, 1)
    os.environ.pop("KVSTACK_KERNELS")
    err = _err(outs["torch"], outs["auto"])
    return [dict(kernel="stack end-to-end", case="evict+kivi4+lowrank, 100 decode steps", error=err, ok=err <= 1e-3)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; the CPU tests cover the kernels under TRITON_INTERPRET=1")
        return 0
    device = torch.device("cuda")
    rows = check_quant_pack(device) + check_fold(device) + check_tiered(device) + check_stack_end_to_end(device)
    for r in rows:
        print(f"{'ok ' if r['ok'] else 'BAD'} {r['kernel']:<17} {r['case']:<36} max err {r['error']:.2e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
