"""Decode-step attention benchmark: the fused tiered kernel vs. dequantize-then-SDPA vs. SDPA on an fp16 cache.

    python -m kvstack.bench.kernels [--device cuda|cpu] [--contexts 4096,16384,32768,131072] [--batches 1,8,32]
                                    [--out DIR] [--peak-tbps 4.8]

Synthetic tensors only (no model download): ``kv-heads`` KV heads, ``q-heads`` query heads, ``head-dim`` 128,
fp16, one query token per sequence (a decode step).  For every (context, batch) the methods are:

* ``fused-{2,4}bit``: :func:`kvstack.kernels.tiered_attention.tiered_attention` over a packed quantized tier of
  ``context - residual`` tokens (KIVI layout, group 32: keys per channel, values per token) and a ``residual`` of
  fp16 tokens (default 128); ``fused-2bit+mass`` also returns the per-key attention mass (fused scoring).
  On CUDA this is the Triton kernel; with ``--device cpu`` the torch reference (the table then only tests the
  script).
* ``dequant-sdpa-{2,4}bit``: what transformers' ``QuantizedCache`` does each step: dequantize the whole quantized
  store (``dequantize_reference``), concatenate the fp16 residual, torch SDPA.
* ``sdpa-fp16``: torch SDPA on an fp16 cache of ``context`` tokens; ``flash-attn`` (``flash_attn_with_kvcache``)
  when the package is importable on CUDA.

Both SDPA baselines get their best layout: the ``G = q_heads / kv_heads`` query heads of a KV head are fed as ``G``
query rows of that head (exact for one decode token, no repeated keys, flash backend eligible).

Time per step: CUDA events around ``iters`` calls after warm-up (wall clock on CPU).  Bytes read per step: the
tensors the method must read — fused: packed codes + scales + zeros + residual keys/values + positions + query;
dequant-sdpa: the quantized store plus the dequantized fp16 keys/values SDPA reads back; sdpa/flash: the fp16
keys/values.  Bandwidth = bytes / time and its fraction of ``--peak-tbps`` (n/a on CPU).  A configuration whose
estimated peak memory exceeds the free device memory (or ``--max-gb``) is skipped and marked in the table.

Writes ``DIR/kernels.json`` (metadata + every row) and prints the markdown table (:func:`markdown_table`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kvstack.kernels.dispatch import use_triton
from kvstack.kernels.quant_pack import PACK_FACTOR, QuantizedGroups, dequantize_reference
from kvstack.kernels.tiered_attention import FullTierData, QuantTierData, mass_selector, tiered_attention

DEFAULT_CONTEXTS = (4096, 16384, 32768, 131072)
DEFAULT_BATCHES = (1, 8, 32)
CPU_CONTEXTS = (256, 1024)
CPU_BATCHES = (1, 2)
GROUP = 32
DTYPE = torch.float16


@dataclass
class Row:
    context: int
    batch: int
    method: str
    status: str = "ok"  # "ok" or why the row was skipped
    ms: float | None = None
    bytes_read: int | None = None
    gb_per_s: float | None = None
    peak_fraction: float | None = None
    speedup_vs_dequant: float | None = None


@dataclass
class Config:
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    residual: int = 128
    peak_bytes_per_s: float | None = 4.8e12
    target_s: float = 0.1  # time budget of one measurement
    max_bytes: float | None = None


# --------------------------------------------------------------------------- synthetic inputs
def _quant_store(B, H, T, D, bits, device, gen) -> tuple[QuantizedGroups, QuantizedGroups]:
    """Random packed codes with plausible scales (timing does not depend on the values)."""
    pf = PACK_FACTOR[bits]

    def groups(axis):
        if axis == "token":
            packed_shape, sz_shape = (B, H, T // pf, D), (B, H, T // GROUP, D)
        else:
            packed_shape, sz_shape = (B, H, T, D // pf), (B, H, T, D // GROUP)
        packed = torch.randint(0, 256, packed_shape, dtype=torch.uint8, device=device, generator=gen)
        scale = torch.full(sz_shape, 2.0 / ((1 << bits) - 1), dtype=DTYPE, device=device)
        zero = torch.full(sz_shape, -1.0, dtype=DTYPE, device=device)
        return QuantizedGroups(packed, scale, zero, bits, GROUP, axis, (B, H, T, D))

    return groups("token"), groups("channel")


def _quant_bytes(B, H, T, D, bits) -> int:
    n = B * H * T * D
    return 2 * (n * bits // 8 + 2 * (n // GROUP) * 2)


def _fp16_kv_bytes(B, H, T, D) -> int:
    return 2 * B * H * T * D * 2


def _estimate_peak(method: str, B, H, T, D, residual) -> int:
    """Peak bytes of one method's step (inputs + temporaries), for skipping what does not fit."""
    n = B * H * T * D
    if method.startswith("fused"):
        return _quant_bytes(B, H, T, D, 4) + n // 8  # store + scratch logits (mass) with margin
    if method.startswith("dequant"):
        # store + per tensor: uint8 codes twice (unpack, contiguous), float32 codes, two float32 temporaries
        # (code * scale, + zero); then both fp16 results and their concatenated copies
        return _quant_bytes(B, H, T, D, 4) + n * (1 + 1 + 4 + 4 + 4) + 2 * n * 2 * 2
    return _fp16_kv_bytes(B, H, T, D) * 3 // 2


def _free_bytes(device: torch.device, cfg: Config) -> float:
    if cfg.max_bytes is not None:
        return cfg.max_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.9 * free
    return 4e9


# --------------------------------------------------------------------------- timing
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device, target_s: float) -> float:
    """Seconds per call: one untimed call (compiles Triton), a short estimate, then enough calls to fill
    ``target_s`` (3..50)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    est = max(time.perf_counter() - t0, 1e-6)
    iters = int(min(50, max(3, target_s / est)))
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


# --------------------------------------------------------------------------- methods
def _sdpa_grouped(q, k, v, scaling):
    """q [B, Hkv, G, D] against k/v [B, Hkv, T, D]: one decode token per query head, no mask needed."""
    return F.scaled_dot_product_attention(q, k, v, scale=scaling)


def _flash_attn():
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def run_config(T: int, B: int, device: torch.device, cfg: Config, progress=print) -> list[Row]:
    H, D, G, R = cfg.kv_heads, cfg.head_dim, cfg.q_heads // cfg.kv_heads, cfg.residual
    Tq = ((T - R) // GROUP) * GROUP
    R = T - Tq
    scaling = D**-0.5
    gen = torch.Generator(device=device).manual_seed(T * 131 + B)
    free = _free_bytes(device, cfg)
    q = torch.randn(B, H, G, D, generator=gen, device=device, dtype=DTYPE)
    qpos = torch.full((G,), T - 1, dtype=torch.int32, device=device)
    res_k = torch.randn(B, H, R, D, generator=gen, device=device, dtype=DTYPE)
    res_v = torch.randn(B, H, R, D, generator=gen, device=device, dtype=DTYPE)
    res_pos = torch.arange(Tq, T, dtype=torch.int32, device=device).expand(B, 1, R).contiguous()
    quant_pos = torch.arange(0, Tq, dtype=torch.int32, device=device).expand(B, 1, Tq).contiguous()
    full = FullTierData(res_k, res_v, res_pos)
    small = q.nbytes + res_k.nbytes + res_v.nbytes + res_pos.nbytes + quant_pos.nbytes
    rows: list[Row] = []

    def record(method, fn, nbytes):
        row = Row(T, B, method)
        need = _estimate_peak(method, B, H, T, D, R)
        if need > free:
            row.status = f"skipped: needs ~{need / 1e9:.0f} GB > {free / 1e9:.0f} GB"
        else:
            try:
                sec = _time(fn, device, cfg.target_s)
            except torch.OutOfMemoryError:
                row.status = "skipped: out of memory"
                sec = None
            if sec is not None:
                row.ms = sec * 1e3
                row.bytes_read = int(nbytes)
                row.gb_per_s = nbytes / sec / 1e9
                if device.type == "cuda" and cfg.peak_bytes_per_s:
                    row.peak_fraction = nbytes / sec / cfg.peak_bytes_per_s
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        progress(f"  T={T:>6} B={B:>2} {method:<18} " + (f"{row.ms:9.3f} ms" if row.ms else row.status))

    mass_rows = mass_selector(G, 1, device=device)
    for bits in (2, 4):
        if _estimate_peak("fused", B, H, T, D, R) > free:
            for m in (f"fused-{bits}bit", "fused-2bit+mass" if bits == 2 else None, f"dequant-sdpa-{bits}bit"):
                if m is not None:
                    record(m, None, 0)
            continue
        kq, vq = _quant_store(B, H, Tq, D, bits, device, gen)
        quant = QuantTierData(kq, vq, quant_pos)
        store = kq.nbytes() + vq.nbytes()
        record(f"fused-{bits}bit", lambda: tiered_attention(q, qpos, scaling, full=full, quant=quant),
               store + small)
        if bits == 2:
            record("fused-2bit+mass",
                   lambda: tiered_attention(q, qpos, scaling, full=full, quant=quant, mass_rows=mass_rows),
                   store + small)

        def dequant_sdpa():
            k = torch.cat([dequantize_reference(kq), res_k], dim=2)
            v = torch.cat([dequantize_reference(vq), res_v], dim=2)
            return _sdpa_grouped(q, k, v, scaling)

        record(f"dequant-sdpa-{bits}bit", dequant_sdpa, store + _fp16_kv_bytes(B, H, T, D) + q.nbytes)
        del kq, vq, quant

    kv_bytes = _fp16_kv_bytes(B, H, T, D)
    if _estimate_peak("sdpa", B, H, T, D, R) <= free:
        k = torch.randn(B, H, T, D, generator=gen, device=device, dtype=DTYPE)
        v = torch.randn(B, H, T, D, generator=gen, device=device, dtype=DTYPE)
        record("sdpa-fp16", lambda: _sdpa_grouped(q, k, v, scaling), kv_bytes + q.nbytes)
        del k, v
    else:
        record("sdpa-fp16", None, 0)
    flash = _flash_attn() if device.type == "cuda" else None
    if flash is not None:
        if _estimate_peak("flash", B, H, T, D, R) <= free:
            k = torch.randn(B, T, H, D, generator=gen, device=device, dtype=DTYPE)
            v = torch.randn(B, T, H, D, generator=gen, device=device, dtype=DTYPE)
            qf = q.reshape(B, H * G, 1, D).transpose(1, 2).contiguous()  # [B, 1, Hq, D]
            record("flash-attn", lambda: flash(qf, k, v, softmax_scale=scaling), kv_bytes + q.nbytes)
            del k, v
        else:
            record("flash-attn", None, 0)

    for row in rows:
        if row.method.startswith("fused") and row.ms:
            bits = row.method.split("-")[1][:4]
            base = next((r for r in rows if r.method == f"dequant-sdpa-{bits}" and r.ms), None)
            if base is not None:
                row.speedup_vs_dequant = base.ms / row.ms
    return rows


# --------------------------------------------------------------------------- driver
def run(
    contexts=DEFAULT_CONTEXTS,
    batches=DEFAULT_BATCHES,
    device: str = "cuda",
    out: Path | str | None = None,
    cfg: Config | None = None,
    progress=print,
) -> dict:
    """Run the grid; returns (and writes to ``out/kernels.json`` when ``out`` is given) the results."""
    cfg = cfg or Config()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was requested but CUDA is not available (use --device cpu)")
    for T in contexts:
        if T <= cfg.residual:
            raise SystemExit(f"context {T} must exceed the residual {cfg.residual}")
    probe = torch.empty(0, device=dev)
    meta = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "fused_path": "triton" if use_triton(probe) else "torch reference",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "dtype": str(DTYPE),
        "group_size": GROUP,
        **{k: v for k, v in asdict(cfg).items() if k != "max_bytes"},
    }
    if dev.type != "cuda":
        meta["peak_bytes_per_s"] = None
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    rows: list[Row] = []
    t0 = time.perf_counter()
    for T in contexts:
        for B in batches:
            progress(f"context {T}, batch {B} ({time.perf_counter() - t0:.0f} s elapsed)")
            rows.extend(run_config(T, B, dev, cfg, progress))
    meta["seconds"] = time.perf_counter() - t0
    result = {"meta": meta, "rows": [asdict(r) for r in rows]}
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "kernels.json").write_text(json.dumps(result, indent=2))
    return result


def _fmt(x, spec):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"Device: {meta['device']} (fused path: {meta['fused_path']}); {meta['kv_heads']} KV heads, "
        f"{meta['q_heads']} query heads, head_dim {meta['head_dim']}, fp16, residual {meta['residual']}, "
        f"group {meta['group_size']}; peak "
        + (f"{meta['peak_bytes_per_s'] / 1e12:.2f} TB/s" if meta["peak_bytes_per_s"] else "n/a"),
        "",
        "| context | batch | method | ms / step | MB read | GB/s | % of peak | speedup vs dequant+SDPA |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['context']} | {r['batch']} | {r['method']} | {r['status']} | | | | |")
            continue
        pct = None if r["peak_fraction"] is None else 100 * r["peak_fraction"]
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['method']} | {_fmt(r['ms'], '.3f')} | "
            f"{_fmt(r['bytes_read'] / 1e6, '.1f')} | {_fmt(r['gb_per_s'], '.1f')} | {_fmt(pct, '.0f')} | "
            f"{_fmt(r['speedup_vs_dequant'], '.2f')} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--contexts", type=_ints, default=None,
                        help=f"default {DEFAULT_CONTEXTS} (cuda) / {CPU_CONTEXTS} (cpu)")
    parser.add_argument("--batches", type=_ints, default=None,
                        help=f"default {DEFAULT_BATCHES} (cuda) / {CPU_BATCHES} (cpu)")
    parser.add_argument("--out", type=Path, default=Path("results/kernels"))
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="device peak bandwidth, TB/s (H200: 4.8)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--residual", type=int, default=128, help="fp16 tokens beside the quantized tier")
    parser.add_argument("--target-s", type=float, default=0.1, help="time budget of one measurement")
    parser.add_argument("--max-gb", type=float, default=None, help="skip configs needing more (default: free)")
    args = parser.parse_args(argv)
    if args.q_heads % args.kv_heads:
        parser.error(f"--q-heads {args.q_heads} must be a multiple of --kv-heads {args.kv_heads}")
    cpu = args.device == "cpu"
    cfg = Config(
        kv_heads=args.kv_heads, q_heads=args.q_heads, head_dim=args.head_dim, residual=args.residual,
        peak_bytes_per_s=args.peak_tbps * 1e12, target_s=args.target_s,
        max_bytes=None if args.max_gb is None else args.max_gb * 1e9,
    )
    result = run(
        args.contexts or (CPU_CONTEXTS if cpu else DEFAULT_CONTEXTS),
        args.batches or (CPU_BATCHES if cpu else DEFAULT_BATCHES),
        args.device, args.out, cfg, progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(markdown_table(result))
    print(f"\nwrote {args.out / 'kernels.json'} in {result['meta']['seconds']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
