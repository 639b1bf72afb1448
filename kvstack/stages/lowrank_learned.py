"""Learned LESS kernels for ``kind: lowrank, features: learned``, trained by ``kvstack calibrate``.

Dong et al., "Get More with LESS" (arXiv 2402.09398) learn small per-(layer, head) MLPs ``phi``/``psi`` such that
``phi(q)^T psi(k)`` stands in for ``exp(s q.k)`` of evicted tokens, trained on the attention-output error of
queries that see evicted tokens. LESS's maps are ``|GELU(GELU(x W1) W2)|``: non-negative, but their scale is free,
so the state's share could not sit on the absolute scale of the exact logits. Here the maps produce LOG-features:

    log phi(q) = W_q q' - |q'|^2 / 2 - log(r) / 2  +  GELU(q' A_q + a_q) B_q + b_q        (q' = sqrt(s) q)
    log psi(k) = W_k k' - |k'|^2 / 2 - log(r) / 2  +  GELU(k' A_k + a_k) B_k + b_k

i.e. positive random features (``W_q = W_k`` drawn orthogonally, :func:`draw_features`) plus a learned residual MLP
in log space (``B = 0`` at the start, so an untrained kernel IS the random-feature estimator of the preset, and
training only moves away from it where that lowers the error). ``exp`` of a log-feature is positive, the state stays
log-stabilised by the same fold/readout as random features, and the readout is on the scale of ``s q.k``.

Parameters (per layer and KV head, stored as ``[layers, kv_heads, ...]`` tensors): ``q_proj``/``k_proj``
``[r, d]``, ``q_w1``/``k_w1`` ``[d, hidden]``, ``q_b1``/``k_b1`` ``[hidden]``, ``q_w2``/``k_w2`` ``[hidden, r]``,
``q_b2``/``k_b2`` ``[r]``; safetensors metadata records the format, rank, hidden width and the model's dimensions.

Calibration (:func:`calibrate`): the model runs once per calibration passage with the identity stack while a capture
state records, per layer, the post-RoPE queries exactly as the stack's attention sees them (and the scaling); keys
and values are the full tier's. The eviction of the preset's ``evict`` stage is simulated as recency (its ``n_sink``
sinks + the newest tokens of its budget, per query position), and the loss is, per layer, the mean squared error of
the merged attention output (exact kept tokens + learned kernel for the evicted ones) against full attention,
divided by the error of eviction alone (1.0 = no better than dropping the tokens); Adam on every parameter.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
from torch import nn

from kvstack.kernels.lowrank_update import draw_features
from kvstack.stack.base import spec_error
from kvstack.stack.errors import SpecError
from kvstack.stack.tiers import StateTier

FORMAT = "kvstack-lowrank-kernels/1"
PARAMS = ("proj", "w1", "b1", "w2", "b2")
#: Adam steps of ``kvstack calibrate``: recovery of the eviction gap on stories260K saturates here (200 steps: 14%,
#: 400: 35%, 1500: 48%, 4000: 47% at 25% memory; docs/lowrank.md), about 2 CPU-minutes
DEFAULT_STEPS = 1500


def _log_features(x: torch.Tensor, scaling: float, proj, w1, b1, w2, b2) -> torch.Tensor:
    """x [B, H, T, d] -> log-features [B, H, T, r] (see the module docstring); weights are [H, ...]."""
    xs = x * math.sqrt(scaling)
    base = torch.matmul(xs, proj.transpose(-1, -2)) - 0.5 * (xs * xs).sum(-1, keepdim=True)
    hidden = nn.functional.gelu(torch.matmul(xs, w1) + b1[:, None, :])
    return base - 0.5 * math.log(proj.shape[-2]) + torch.matmul(hidden, w2) + b2[:, None, :]


class LearnedKernels(nn.Module):
    """Trainable kernels of every layer and KV head (``[layers, kv_heads, ...]`` parameters)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, rank: int, hidden: int, seed: int = 0) -> None:
        super().__init__()
        self.layers, self.kv_heads, self.head_dim, self.rank, self.hidden = layers, kv_heads, head_dim, rank, hidden
        proj = draw_features(head_dim, rank, seed, num_heads=layers * kv_heads).reshape(layers, kv_heads, rank, -1)
        gen = torch.Generator().manual_seed(seed + 1)
        for side in ("q", "k"):
            w1 = torch.randn(layers, kv_heads, head_dim, hidden, generator=gen) / math.sqrt(head_dim)
            self.register_parameter(f"{side}_proj", nn.Parameter(proj.clone()))
            self.register_parameter(f"{side}_w1", nn.Parameter(w1))
            self.register_parameter(f"{side}_b1", nn.Parameter(torch.zeros(layers, kv_heads, hidden)))
            self.register_parameter(f"{side}_w2", nn.Parameter(torch.zeros(layers, kv_heads, hidden, rank)))
            self.register_parameter(f"{side}_b2", nn.Parameter(torch.zeros(layers, kv_heads, rank)))

    def weights(self, side: str, layer: int) -> list[torch.Tensor]:
        return [getattr(self, f"{side}_{p}")[layer] for p in PARAMS]

    def log_features(self, side: str, layer: int, x: torch.Tensor, scaling: float) -> torch.Tensor:
        return _log_features(x, scaling, *self.weights(side, layer))

    def save(self, path: Path, info: dict | None = None) -> None:
        from safetensors.torch import save_file

        meta = {"format": FORMAT, "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "rank": self.rank, "hidden": self.hidden, **(info or {})}
        tensors = {n: p.detach().contiguous().float() for n, p in self.named_parameters()}
        save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})


class LayerKernels:
    """Runtime feature map of one layer (read-only, copied once per device and dtype)."""

    def __init__(self, weights: dict[str, list[torch.Tensor]]) -> None:
        self.cpu = weights
        self.rank = weights["q"][0].shape[-2]
        self._cache: dict[tuple, list[torch.Tensor]] = {}

    def _weights(self, side: str, x: torch.Tensor) -> list[torch.Tensor]:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = (side, x.device, dtype)
        if key not in self._cache:
            self._cache[key] = [w.to(device=x.device, dtype=dtype) for w in self.cpu[side]]
        return self._cache[key]

    def _apply(self, side: str, x: torch.Tensor, scaling: float) -> torch.Tensor:
        w = self._weights(side, x)
        return _log_features(x.to(w[0].dtype), scaling, *w)

    def log_query(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return self._apply("q", query, scaling)

    def log_key(self, keys: torch.Tensor, scaling: float) -> torch.Tensor:
        return self._apply("k", keys, scaling)


def read_metadata(path: Path) -> dict:
    from safetensors import safe_open

    if not path.is_file():
        raise spec_error("kernels", str(path), "an existing safetensors file written by `kvstack calibrate`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # safetensors raises its own error types for foreign files
        raise spec_error("kernels", str(path), f"a safetensors file written by `kvstack calibrate` ({err})") from None
    if meta.get("format") != FORMAT:
        raise spec_error("kernels", str(path), f"a kernels file of format {FORMAT!r} (got {meta.get('format')!r})")
    return meta


def kernels_rank(path: Path) -> int:
    return int(read_metadata(path)["rank"])


def check_kernels_file(path: Path, shape) -> None:
    """Raise SpecError unless the file's kernels were trained for a model of this shape."""
    meta = read_metadata(path)
    for field, want in (("layers", shape.num_layers), ("kv_heads", shape.num_kv_heads), ("head_dim", shape.head_dim)):
        if int(meta[field]) != want:
            raise SpecError(
                f"kernels={str(path)!r}: trained for {field}={meta[field]} but the model has {field}={want}; "
                "run `kvstack calibrate` for this model"
            )


def load_kernels(path: Path, shape) -> list[LayerKernels]:
    check_kernels_file(path, shape)
    resolved = path.resolve()
    return _load(str(resolved), resolved.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> list[LayerKernels]:
    from safetensors.torch import load_file

    t = load_file(path)
    layers = t["q_proj"].shape[0]
    return [LayerKernels({s: [t[f"{s}_{p}"][i] for p in PARAMS] for s in ("q", "k")}) for i in range(layers)]


# --------------------------------------------------------------------------------------------------- calibration
class _Capture(StateTier):
    """Stands in a layer's state slot during calibration: records the queries the attention sees, holds nothing."""

    name = "capture"

    def __init__(self) -> None:
        self.query: torch.Tensor | None = None
        self.scaling: float | None = None

    def prepare(self, query, scaling) -> None:
        self.query, self.scaling = query.detach(), scaling

    def readout(self, query, scaling):
        return None

    def absorb(self, keys, values, valid) -> None:  # pragma: no cover - the identity stack never evicts
        raise AssertionError("the calibration capture never folds")


@torch.no_grad()
def capture(model, ids_list: list[torch.Tensor]) -> tuple[list[dict], list[int]]:
    """Per full-attention layer: {"q": [P, Hkv, G*T, d], "k"/"v": [P, Hkv, T, d], "scaling"}, passages cut to the
    shortest; and the indices of those layers."""
    import kvstack
    from kvstack.stack.apply import cache_kwarg

    length = min(int(ids.shape[0]) for ids in ids_list)
    kvstack.apply(model, "identity")
    try:
        per_pass = []
        for ids in ids_list:
            cache = kvstack.cache_for(model)
            layers = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
            for i in layers:
                cache.layers[i].state = _Capture()
            model(ids[None, :length].to(next(model.parameters()).device), **{cache_kwarg(model): cache})
            per_pass.append([(cache.layers[i].state, cache.layers[i].full) for i in layers])
    finally:
        kvstack.remove(model)
    out = []
    for j in range(len(layers)):
        out.append({
            "q": torch.cat([p[j][0].query for p in per_pass]).float(),
            "k": torch.cat([p[j][1].keys for p in per_pass]).float(),
            "v": torch.cat([p[j][1].values for p in per_pass]).float(),
            "scaling": per_pass[0][j][0].scaling,
        })
    return out, layers


def recency_masks(length: int, rows: torch.Tensor, caps: torch.Tensor, n_sink: int):
    """For query positions ``rows`` [M] with ``caps`` [M] kept tokens: (kept, evicted) [M, T] under recency eviction
    (the cap's tokens are the n_sink first ones and the newest, the query itself included)."""
    j = torch.arange(length)[None, :]
    t = rows[:, None]
    recent = (caps - n_sink)[:, None]
    causal = j <= t
    kept = causal & ((j < n_sink) | (j > t - recent))
    return kept, causal & ~kept


def merged_attention(q, k, v, scaling, kept, evicted, log_q=None, log_k=None):
    """Attention of q [P, H, M, d] over k/v [P, H, T, d]: exact logits on ``kept``, the kernel on ``evicted``."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if log_q is None:
        scores = logits.masked_fill(~kept, -math.inf)
    else:
        a = log_q.amax(-1, keepdim=True)
        b = log_k.amax(-1, keepdim=True)
        prod = torch.matmul(torch.exp(log_q - a), torch.exp(log_k - b).transpose(-1, -2))
        kern = a + b.transpose(-1, -2) + torch.log(prod.clamp_min(torch.finfo(prod.dtype).tiny))
        scores = torch.where(kept, logits, torch.where(evicted, kern, torch.full_like(logits, -math.inf)))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def recency_caps(spec, shape, positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Tokens kept at each query position under the spec's ``evict`` stage (its layer-0 cap), and its n_sink."""
    evicts = [s for s in spec.stages if s.kind == "evict"]
    if not evicts:
        raise SpecError("calibrate: the preset has no `kind: evict` stage, so no token would ever be folded")
    ev = evicts[0]
    cap = ev.layer_caps(shape, shape.dtype, spec.budget)[0]
    return torch.tensor([cap(int(p) + 1) for p in positions.tolist()], dtype=positions.dtype), ev.n_sink


def calibrate(
    model,
    tokenizer,
    spec,
    passages: list[str],
    *,
    hidden: int = 16,
    steps: int = DEFAULT_STEPS,
    lr: float = 5e-3,
    batch: int = 4,
    queries: int = 64,
    max_len: int = 512,
    seed: int = 0,
    progress: bool = True,
) -> tuple[LearnedKernels, dict]:
    """Train kernels for ``model`` under the eviction of ``spec`` (a StackSpec with ``evict`` and ``lowrank``
    stages; the lowrank stage's rank and, for random features, seed initialise the kernels). Returns the kernels
    and a summary (relative error per layer before/after: 1.0 = as bad as eviction alone)."""
    from tqdm import tqdm

    from kvstack.stack.shape import ModelShape

    lowrank = [s for s in spec.stages if s.kind == "lowrank"]
    if not lowrank:
        raise SpecError("calibrate: the preset has no `kind: lowrank` stage to train kernels for")
    if not passages:
        raise spec_error("passages", 0, "at least one calibration passage")
    shape = ModelShape.from_model(model)
    stage = lowrank[0]
    rank = stage.effective_rank()
    init_seed = stage.seed if stage.features == "random" else seed
    ids_list = [torch.tensor(tokenizer(text)["input_ids"][:max_len]) for text in passages]
    data, layers = capture(model, ids_list)
    length = data[0]["k"].shape[2]
    group = shape.num_q_heads // shape.num_kv_heads

    gen = torch.Generator().manual_seed(seed)
    caps, n_sink = recency_caps(spec, shape, torch.arange(length))
    eligible = torch.nonzero(torch.arange(length) - (caps - n_sink) > n_sink).flatten()  # queries that see evictions
    if eligible.numel() == 0:
        raise SpecError(f"calibrate: with {length}-token passages the preset's budget never evicts; use longer text")
    pick = eligible[torch.randperm(eligible.numel(), generator=gen)[:queries]].sort().values
    kept, evicted = recency_masks(length, pick, caps[pick], n_sink)
    kept, evicted = kept.repeat(group, 1), evicted.repeat(group, 1)  # rows g*T + t, as the attention orders them
    rows = torch.cat([pick + g * length for g in range(group)])
    causal = kept | evicted
    for d in data:
        d["q"] = d["q"][:, :, rows]
        d["target"] = merged_attention(d["q"], d["k"], d["v"], d["scaling"], causal, None)
        evict_only = merged_attention(d["q"], d["k"], d["v"], d["scaling"], kept, evicted)
        d["evict_err"] = (evict_only - d["target"]).pow(2).mean()

    kernels = LearnedKernels(shape.num_layers, shape.num_kv_heads, shape.head_dim, rank, hidden, seed=init_seed)
    opt = torch.optim.Adam(kernels.parameters(), lr=lr)

    def relative_errors(idx) -> list[torch.Tensor]:
        errs = []
        for layer, d in zip(layers, data):
            q, k, v = d["q"][idx], d["k"][idx], d["v"][idx]
            lq = kernels.log_features("q", layer, q, d["scaling"])
            lk = kernels.log_features("k", layer, k, d["scaling"])
            out = merged_attention(q, k, v, d["scaling"], kept, evicted, lq, lk)
            errs.append((out - d["target"][idx]).pow(2).mean() / d["evict_err"])
        return errs

    def mean_errors() -> list[float]:
        chunks = torch.arange(len(ids_list)).split(batch)
        with torch.no_grad():
            per_chunk = [relative_errors(idx) for idx in chunks]
        return [float(sum(c[j] * len(idx) for c, idx in zip(per_chunk, chunks)) / len(ids_list))
                for j in range(len(layers))]

    before = mean_errors()
    bar = tqdm(range(steps), desc="calibrate", disable=not progress)
    for _ in bar:
        idx = torch.randperm(len(ids_list), generator=gen)[:batch]
        loss = torch.stack(relative_errors(idx)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    after = mean_errors()
    summary = {"layers": layers, "relative_error_random": before, "relative_error_learned": after,
               "rank": rank, "hidden": hidden, "steps": steps, "passages": len(ids_list)}
    return kernels, summary


def save_kernels(kernels: LearnedKernels, path: Path, summary: dict | None = None) -> None:
    info = {"summary": json.dumps(summary)} if summary else None
    kernels.save(path, info)


def calibrate_file(
    model_path: Path,
    preset: str,
    data: Path,
    out: Path,
    *,
    start: int = 32,
    passages: int = 32,
    steps: int = DEFAULT_STEPS,
    hidden: int = 16,
    progress: bool = True,
) -> dict:
    """``kvstack calibrate``: train on passages ``start .. start+passages-1`` of the JSONL ``data`` (the defaults
    skip the 32 evaluation passages of the dev file) and write the kernels to ``out``. Returns the summary."""
    from kvstack.bench.protocol import load_model, load_passages
    from kvstack.stack.spec import StackSpec

    spec = StackSpec.load(preset)
    texts = load_passages(data, n=None)[start : start + passages]
    if not texts:
        raise spec_error("--start", start, f"an index below the {len(load_passages(data, n=None))} passages of {data}")
    model, tokenizer = load_model(model_path)
    kernels, summary = calibrate(model, tokenizer, spec, texts, hidden=hidden, steps=steps, progress=progress)
    summary.update(model=str(model_path), preset=spec.name, data=str(data), start=start)
    save_kernels(kernels, out, summary)
    return summary
