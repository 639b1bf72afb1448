r"""Low-rank (random-feature) state for evicted KV pairs, LESS-style.

References
----------
* H. Dong et al., "Get More with LESS: Synthesizing Recurrence with KV Cache
  Compression for Efficient LLM Inference", arXiv:2402.09398 (2024).  Evicted
  key/value pairs are folded into a constant-size recurrent state so attention
  still (approximately) sees them.
* K. Choromanski et al., "Rethinking Attention with Performers" (FAVOR+),
  arXiv:2009.14794 (2020).  Positive orthogonal random features for the
  softmax kernel.

Math
----
For one (batch, KV head) with attention scaling ``s`` (usually ``1/sqrt(d)``)
the softmax attention of a query ``q`` splits into the tokens ``S`` kept
exactly in the cache and the folded (evicted) tokens ``F``::

    out(q) = [ sum_{i in S} e^{s q.k_i} v_i + sum_{j in F} e^{s q.k_j} v_j ]
             / [ sum_{i in S} e^{s q.k_i}     + sum_{j in F} e^{s q.k_j} ]

Scale both sides as ``x' = x * sqrt(s)`` so that ``q'.k' = s q.k``.  With
``W`` an ``[m, d]`` matrix of Gaussian rows, the positive random features

    phi(x') = exp(W x' - ||x'||^2 / 2) / sqrt(m)          (psi = phi for keys)

satisfy ``E_W[phi(q')^T phi(k')] = exp(q'.k')`` exactly (because
``E[exp(w.(q'+k'))] = exp(||q'+k'||^2 / 2)`` for ``w ~ N(0, I)``) and every
term is positive, so the estimate of a softmax denominator is never negative.
FAVOR+ reduces the variance by drawing the rows in orthogonal blocks: each
block of ``d`` rows is the orthogonal factor of the QR decomposition of a
``d x d`` Gaussian matrix (sign-corrected so it is Haar distributed), and each
row is then rescaled to an independent ``chi(d)`` norm, so every row is still
marginally ``N(0, I)`` and the estimator stays unbiased
(:func:`draw_features`).

The folded tokens become the state::

    H = sum_{j in F} psi(k_j) v_j^T      [m, d_v]
    z = sum_{j in F} psi(k_j)            [m]

and the folded part of ``out(q)`` is approximated by ``phi(q)^T H`` (numerator)
and ``phi(q)^T z`` (denominator).

Everything is handled in log space: :func:`log_features` returns
``log phi(x) = W x' - ||x'||^2 / 2 - log(m) / 2``.

Stabilizer convention (how the exact part and the state share one scale)
-----------------------------------------------------------------------
``exp(W k' - ||k'||^2/2)`` overflows float32 quickly for large keys, so the
state stores ``H`` and ``z`` multiplied by ``exp(-c)``::

    state.H = exp(-c) * sum_j psi(k_j) v_j^T,   state.z = exp(-c) * sum_j psi(k_j)

with one float32 log-offset ``c`` per (batch, KV head).  ``c`` is the running
maximum of all ``log psi(k_j)_f`` folded so far (over tokens *and* features),
so the largest stored entry of ``z`` is ``>= 1`` and nothing overflows.  When a
fold brings a larger exponent, the old state is rescaled by
``exp(c_old - c_new) <= 1`` (:func:`fold`).  Folding is therefore independent
of the order / chunking of the tokens up to float rounding.

**Empty state:** ``c = -inf`` and ``H = z = 0``.  ``-inf`` is the neutral
element of the max, so the first fold needs no special case; every place that
would compute ``-inf - (-inf)`` guards it.

:func:`readout` returns ``log_den = log(phi(q)^T z_true)``, computed as
``logsumexp_f(log phi(q)_f + log state.z_f) + c``.  This is on the **same
absolute scale as the exact logits** ``s q.k_i`` (no max-subtraction is hidden
in it): the caller merges both parts under one normalizer::

    L   = [s q.k_i for i in S]  ++  [log_den]
    p   = softmax(L)
    out = sum_{i in S} p_i v_i + p_last * value

where ``value = phi(q)^T H / phi(q)^T z`` is the state's readout (a weighted
mean of folded values, returned by :func:`readout`).  An empty state gives
``log_den = -inf`` (weight 0) and ``value = 0`` so it merges as a no-op.

``value`` is computed stably as ``sum_f softmax_f(log phi(q)_f + log z_f) *
(H_f / z_f)``: ``H_f / z_f`` is the psi-weighted mean of the values in feature
``f`` (a convex combination of values, never overflows) and the weights are a
softmax, so neither ``c`` nor the magnitudes of phi matter.

Limitation of the single scalar offset: per-feature entries with
``log psi - c < ~-87`` underflow to 0 in float32.  Such features are
negligible unless a query puts ~e^87 more weight on them than on the dominant
feature, i.e. only for pathological key/query norms where the random-feature
estimate itself is meaningless.

Kernel
------
:func:`fold` dispatches (via :func:`kvstack.kernels.dispatch.use_triton`) to
:func:`fold_triton` -- one Triton kernel that takes the **precomputed**
``log_psi_k`` (so the feature map / projection stays a plain matmul in
:func:`log_features` and the kernel is agnostic to how features are made) and
fuses: masking of invalid tokens, the new log-offset (a max over the chunk),
exponentiation ``exp(log_psi - c_new)``, the accumulation of
``psi(k) v^T`` (``tl.dot`` in IEEE fp32) and ``psi(k)`` and the rescaling of
the old state.  It updates ``state.H`` / ``state.z`` **in place** and returns
a state with a new ``c`` tensor.  Otherwise :func:`fold_reference` (plain
torch, out of place) is used.  Both compute in float32; they agree to
``rtol=1e-5, atol=1e-6`` (relative to the ``exp(-c)``-normalized state, whose
largest ``z`` entry is >= 1).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

try:  # Triton is optional: the torch reference works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = [
    "LowRankState",
    "draw_features",
    "log_features",
    "empty_state",
    "fold",
    "fold_reference",
    "fold_triton",
    "readout",
]


# --------------------------------------------------------------------------
# Feature maps
# --------------------------------------------------------------------------
def draw_features(
    head_dim: int,
    rank: int,
    seed: int,
    *,
    num_heads: int = 1,
    device=None,
    dtype=torch.float32,
) -> torch.Tensor:
    """Orthogonal-block Gaussian projections ``[num_heads, rank, head_dim]``.

    For every head independently, ``ceil(rank / head_dim)`` blocks of
    ``head_dim`` orthonormal rows are drawn (QR of a Gaussian matrix, with the
    signs of ``diag(R)`` folded into ``Q`` so the block is Haar distributed),
    stacked and truncated to ``rank`` rows; then each row is scaled to the
    norm of an independent ``N(0, I_d)`` vector (chi(d) distributed).  So each
    row is marginally ``N(0, I_d)`` and rows inside a block are orthogonal.

    Drawn in float64 with a CPU ``torch.Generator`` seeded with ``seed``
    (deterministic for a given seed, independent of ``device``), then cast and
    moved.
    """
    if head_dim < 1 or rank < 1 or num_heads < 1:
        raise ValueError(
            f"head_dim, rank and num_heads must be >= 1, got {head_dim}, {rank}, {num_heads}"
        )
    d = int(head_dim)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    n_blocks = -(-rank // d)
    gauss = torch.randn(num_heads, n_blocks, d, d, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)  # q: [..., d, d] orthogonal
    sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    q = q * sign.unsqueeze(-2)  # scale columns -> Haar-distributed orthogonal matrix
    rows = q.transpose(-1, -2).reshape(num_heads, n_blocks * d, d)[:, :rank]
    norms = torch.randn(num_heads, rank, d, generator=gen, dtype=torch.float64).norm(dim=-1)
    proj = rows * norms.unsqueeze(-1)
    return proj.to(device=device, dtype=dtype)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    out = torch.float32
    for dt in dtypes:
        out = torch.promote_types(out, dt)
    return out


def log_features(x: torch.Tensor, proj: torch.Tensor, scaling: float) -> torch.Tensor:
    """``log phi(x)`` for positive random features.

    ``x`` ``[B, H, T, d]``, ``proj`` ``[H, m, d]`` (or ``[m, d]`` / ``[1, m, d]``,
    shared by all heads) -> ``[B, H, T, m]`` equal to
    ``proj @ x' - ||x'||^2 / 2 - log(m) / 2`` with ``x' = x * sqrt(scaling)``.

    Computed in float32 (float64 if an input is float64).  For grouped-query
    attention reshape the queries of a KV group to ``[B, Hkv, G*T, d]`` first:
    queries must use the projections of their KV head.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, T, d], got shape {tuple(x.shape)}")
    if proj.dim() == 2:
        proj = proj.unsqueeze(0)
    if proj.dim() != 3 or proj.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"proj must be [H, m, d] with d={x.shape[-1]}, got shape {tuple(proj.shape)}"
        )
    if proj.shape[0] not in (1, x.shape[1]):
        raise ValueError(
            f"proj has {proj.shape[0]} heads but x has {x.shape[1]} (reshape grouped queries "
            "to [B, Hkv, G*T, d])"
        )
    ct = _compute_dtype(x.dtype, proj.dtype)
    m = proj.shape[-2]
    xs = x.to(ct) * math.sqrt(float(scaling))
    w = proj.to(device=x.device, dtype=ct)
    lin = torch.matmul(xs, w.transpose(-1, -2))  # [B, H, T, m]
    sq = 0.5 * (xs * xs).sum(dim=-1, keepdim=True)
    return lin - sq - 0.5 * math.log(m)


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------
@dataclass
class LowRankState:
    """Log-stabilized random-feature state, batch first.

    * ``H`` ``[B, Hkv, m, d_v]``: ``exp(-c) * sum_j psi(k_j) v_j^T``
    * ``z`` ``[B, Hkv, m]``: ``exp(-c) * sum_j psi(k_j)``
    * ``c`` ``[B, Hkv]`` float32 log-offset; ``-inf`` marks an empty
      (batch, head) whose ``H`` and ``z`` are exactly 0.
    """

    H: torch.Tensor
    z: torch.Tensor
    c: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.H.shape[0]

    @property
    def num_heads(self) -> int:
        return self.H.shape[1]

    @property
    def rank(self) -> int:
        return self.H.shape[2]

    @property
    def value_dim(self) -> int:
        return self.H.shape[3]

    def is_empty(self) -> torch.Tensor:
        """Bool ``[B, Hkv]``: nothing folded yet."""
        return torch.isneginf(self.c)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.H, self.z, self.c))

    def index_select(self, batch_idx: torch.Tensor) -> "LowRankState":
        """Select / reorder batch rows (e.g. beam search)."""
        idx = batch_idx.to(device=self.H.device, dtype=torch.long)
        return LowRankState(
            H=self.H.index_select(0, idx),
            z=self.z.index_select(0, idx),
            c=self.c.index_select(0, idx),
        )

    def clone(self) -> "LowRankState":
        return LowRankState(H=self.H.clone(), z=self.z.clone(), c=self.c.clone())

    def to(self, device=None, dtype=None) -> "LowRankState":
        """Move; ``dtype`` applies to ``H`` and ``z`` only (``c`` stays float32)."""
        return LowRankState(
            H=self.H.to(device=device, dtype=dtype),
            z=self.z.to(device=device, dtype=dtype),
            c=self.c.to(device=device),
        )


def empty_state(batch, heads, rank, d_v, device=None, dtype=torch.float32) -> LowRankState:
    """State with nothing folded: ``H = z = 0``, ``c = -inf``."""
    return LowRankState(
        H=torch.zeros(batch, heads, rank, d_v, device=device, dtype=dtype),
        z=torch.zeros(batch, heads, rank, device=device, dtype=dtype),
        c=torch.full((batch, heads), float("-inf"), device=device, dtype=torch.float32),
    )


def _check_fold_args(state: LowRankState, log_psi_k, v, valid):
    B, Hh, m, dv = state.H.shape
    if log_psi_k.dim() != 4 or tuple(log_psi_k.shape[:2]) != (B, Hh) or log_psi_k.shape[3] != m:
        raise ValueError(
            f"log_psi_k must be [B={B}, Hkv={Hh}, n, m={m}], got {tuple(log_psi_k.shape)}"
        )
    n = log_psi_k.shape[2]
    if tuple(v.shape) != (B, Hh, n, dv):
        raise ValueError(f"v must be [{B}, {Hh}, {n}, {dv}], got {tuple(v.shape)}")
    if valid is not None and tuple(valid.shape) != (B, Hh, n):
        raise ValueError(f"valid must be [{B}, {Hh}, {n}], got {tuple(valid.shape)}")
    if tuple(state.z.shape) != (B, Hh, m) or tuple(state.c.shape) != (B, Hh):
        raise ValueError("inconsistent LowRankState shapes")


# --------------------------------------------------------------------------
# Fold: torch reference
# --------------------------------------------------------------------------
def fold_reference(
    state: LowRankState,
    log_psi_k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> LowRankState:
    """Plain-torch fold (out of place).  See :func:`fold`."""
    _check_fold_args(state, log_psi_k, v, valid)
    if log_psi_k.shape[2] == 0:
        return state
    ct = _compute_dtype(state.H.dtype)
    lp = log_psi_k.to(ct)
    vv = v.to(ct)
    if valid is not None:
        vmask = valid.to(torch.bool)
        lp = lp.masked_fill(~vmask.unsqueeze(-1), float("-inf"))
        vv = vv.masked_fill(~vmask.unsqueeze(-1), 0.0)  # padding may hold NaN/inf
    c_old = state.c.to(torch.float32)
    chunk_max = lp.amax(dim=(2, 3)).to(torch.float32)  # [B, H]
    c_new = torch.maximum(c_old, chunk_max)
    c_safe = torch.where(torch.isneginf(c_new), torch.zeros_like(c_new), c_new)
    scale_old = torch.where(
        torch.isneginf(c_old), torch.zeros_like(c_old), torch.exp(c_old - c_safe)
    ).to(ct)
    w = torch.exp(lp - c_safe.to(ct)[..., None, None])  # [B, H, n, m]; invalid -> 0
    H_new = state.H.to(ct) * scale_old[..., None, None] + torch.matmul(w.transpose(-1, -2), vv)
    z_new = state.z.to(ct) * scale_old[..., None] + w.sum(dim=2)
    return LowRankState(
        H=H_new.to(state.H.dtype), z=z_new.to(state.z.dtype), c=c_new.to(state.c.dtype)
    )


# --------------------------------------------------------------------------
# Fold: Triton kernel
# --------------------------------------------------------------------------
def _fold_kernel_impl(
    LP, V, VALID, Hs, Zs, C_IN, C_OUT,
    n, m, dv, NH,
    s_lp_b, s_lp_h, s_lp_n, s_lp_m,
    s_v_b, s_v_h, s_v_n, s_v_d,
    s_va_b, s_va_h, s_va_n,
    s_H_b, s_H_h, s_H_m, s_H_d,
    s_z_b, s_z_h, s_z_m,
    s_c_b, s_c_h,
    HAS_VALID: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (B * NH, cdiv(m, BLOCK_M), cdiv(dv, BLOCK_D)); each program owns one
    # [BLOCK_M, BLOCK_D] tile of H (and, for pid_d == 0, BLOCK_M entries of z).
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = pid_bh // NH
    h = pid_bh % NH
    lp_base = LP + b * s_lp_b + h * s_lp_h
    v_base = V + b * s_v_b + h * s_v_h
    va_base = VALID + b * s_va_b + h * s_va_h

    ar_n = tl.arange(0, BLOCK_N)
    ar_m = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + ar_m
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_ok = offs_m < m
    d_ok = offs_d < dv

    # ---- pass 1: new log-offset = max(c_old, max over valid tokens, all features)
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for n0 in range(0, n, BLOCK_N):
        offs_n = n0 + ar_n
        n_ok = offs_n < n
        if HAS_VALID:
            n_ok = n_ok & (tl.load(va_base + offs_n * s_va_n, mask=offs_n < n, other=0) != 0)
        for m0 in range(0, m, BLOCK_M):
            mm = m0 + ar_m
            msk = n_ok[:, None] & (mm < m)[None, :]
            t = tl.load(
                lp_base + offs_n[:, None] * s_lp_n + mm[None, :] * s_lp_m,
                mask=msk, other=float("-inf"),
            ).to(tl.float32)
            t = tl.where(msk, t, float("-inf"))
            run_max = tl.maximum(run_max, tl.max(t, axis=0))
    c_old = tl.load(C_IN + b * s_c_b + h * s_c_h).to(tl.float32)
    c_new = tl.maximum(c_old, tl.max(run_max, axis=0))
    c_safe = tl.where(c_new == float("-inf"), 0.0, c_new)
    scale_old = tl.where(c_old == float("-inf"), 0.0, tl.exp(c_old - c_safe))

    # ---- pass 2: exponentiate and accumulate psi v^T and psi for this tile
    acc_h = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc_z = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, n, BLOCK_N):
        offs_n = n0 + ar_n
        n_ok = offs_n < n
        if HAS_VALID:
            n_ok = n_ok & (tl.load(va_base + offs_n * s_va_n, mask=offs_n < n, other=0) != 0)
        msk = n_ok[:, None] & m_ok[None, :]
        t = tl.load(
            lp_base + offs_n[:, None] * s_lp_n + offs_m[None, :] * s_lp_m,
            mask=msk, other=float("-inf"),
        ).to(tl.float32)
        w = tl.where(msk, tl.exp(t - c_safe), 0.0)  # [BLOCK_N, BLOCK_M]
        vmsk = n_ok[:, None] & d_ok[None, :]
        vt = tl.load(
            v_base + offs_n[:, None] * s_v_n + offs_d[None, :] * s_v_d, mask=vmsk, other=0.0
        ).to(tl.float32)
        vt = tl.where(vmsk, vt, 0.0)  # padding may hold NaN/inf
        acc_h += tl.dot(tl.trans(w), vt, input_precision="ieee")
        acc_z += tl.sum(w, axis=0)

    h_ptrs = Hs + b * s_H_b + h * s_H_h + offs_m[:, None] * s_H_m + offs_d[None, :] * s_H_d
    h_msk = m_ok[:, None] & d_ok[None, :]
    h_old = tl.load(h_ptrs, mask=h_msk, other=0.0).to(tl.float32)
    h_new = h_old * scale_old + acc_h
    tl.store(h_ptrs, h_new.to(Hs.dtype.element_ty), mask=h_msk)

    z_ptrs = Zs + b * s_z_b + h * s_z_h + offs_m * s_z_m
    z_msk = m_ok & ((ar_m * 0 + pid_d) == 0)
    z_old = tl.load(z_ptrs, mask=z_msk, other=0.0).to(tl.float32)
    z_new = z_old * scale_old + acc_z
    tl.store(z_ptrs, z_new.to(Zs.dtype.element_ty), mask=z_msk)

    # c is written to a separate tensor: other programs still read C_IN.
    if pid_m == 0:
        if pid_d == 0:
            tl.store(C_OUT + pid_bh, c_new)


# The kernel is jitted lazily, keyed on TRITON_INTERPRET at first use, so the
# interpreter can be switched on after this module was imported.
_KERNELS: dict = {}


def _get_fold_kernel():
    if triton is None:
        raise RuntimeError("fold_triton needs the 'triton' package")
    interp = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
    kern = _KERNELS.get(interp)
    if kern is None:
        kern = triton.jit(_fold_kernel_impl)
        _KERNELS[interp] = kern
    return kern


def _pow2_clamp(x: int, lo: int, hi: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return max(lo, min(hi, p))


def fold_triton(
    state: LowRankState,
    log_psi_k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> LowRankState:
    """Triton fold.  Updates ``state.H`` and ``state.z`` **in place**; returns
    a state sharing them, with a fresh ``c``.  See :func:`fold`."""
    _check_fold_args(state, log_psi_k, v, valid)
    B, NH, m, dv = state.H.shape
    n = log_psi_k.shape[2]
    if n == 0:
        return state
    kern = _get_fold_kernel()
    if valid is not None:
        va = valid.to(torch.uint8)
        va_strides = va.stride()
        has_valid = True
    else:
        va = log_psi_k  # dummy pointer, never read
        va_strides = (0, 0, 0)
        has_valid = False
    c_in = state.c.to(torch.float32)
    c_out = torch.empty((B, NH), device=c_in.device, dtype=torch.float32)
    block_n = _pow2_clamp(n, 16, 32)
    block_m = _pow2_clamp(m, 16, 64)
    block_d = _pow2_clamp(dv, 16, 64)
    grid = (B * NH, triton.cdiv(m, block_m), triton.cdiv(dv, block_d))
    kern[grid](
        log_psi_k, v, va, state.H, state.z, c_in, c_out,
        n, m, dv, NH,
        *log_psi_k.stride(),
        *v.stride(),
        *va_strides,
        *state.H.stride(),
        *state.z.stride(),
        *c_in.stride(),
        HAS_VALID=has_valid,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
    )
    return replace(state, c=c_out.to(state.c.dtype))


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------
def _want_triton(t: torch.Tensor) -> bool:
    from kvstack.kernels.dispatch import use_triton

    return use_triton(t)


def fold(
    state: LowRankState,
    log_psi_k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> LowRankState:
    """Fold ``n`` new tokens into the state.

    ``log_psi_k`` ``[B, Hkv, n, m]`` (from :func:`log_features` of the keys),
    ``v`` ``[B, Hkv, n, d_v]``, ``valid`` bool ``[B, Hkv, n]`` or ``None``;
    ``valid=False`` tokens are ignored entirely (their ``log_psi_k`` and ``v``
    may even be NaN/inf).  The new log-offset is
    ``c_new = max(c_old, max_{valid j, f} log_psi_k[j, f])``, the old state is
    rescaled by ``exp(c_old - c_new)``.

    Always use the returned state: the Triton path updates ``H``/``z`` in place
    (and returns a new ``c``), the torch path returns new tensors.  Runs Triton
    when :func:`kvstack.kernels.dispatch.use_triton` says so (CUDA by default,
    or ``KVSTACK_KERNELS=triton``), else :func:`fold_reference`.
    """
    _check_fold_args(state, log_psi_k, v, valid)
    if log_psi_k.shape[2] == 0:
        return state
    if _want_triton(log_psi_k):
        return fold_triton(state, log_psi_k, v, valid)
    return fold_reference(state, log_psi_k, v, valid)


# --------------------------------------------------------------------------
# Readout
# --------------------------------------------------------------------------
def readout(state: LowRankState, log_phi_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query the state.

    ``log_phi_q`` ``[B, Hkv, Q, m]`` (``Q`` = query heads of the group x query
    length, flattened) -> ``(log_den [B, Hkv, Q], value [B, Hkv, Q, d_v])``:

    * ``log_den = log(phi(q)^T z_true) = logsumexp_f(log phi(q)_f + log z_f) + c``,
      on the absolute scale of the exact logits ``s q.k`` (merge with them by
      one softmax / logsumexp).
    * ``value = phi(q)^T H / phi(q)^T z`` (weighted mean of folded values).

    Empty (batch, head): ``log_den = -inf``, ``value = 0``; no NaN.  Both are
    float32 (float64 if the state is float64).
    """
    B, NH, m, dv = state.H.shape
    if log_phi_q.dim() != 4 or tuple(log_phi_q.shape[:2]) != (B, NH) or log_phi_q.shape[3] != m:
        raise ValueError(
            f"log_phi_q must be [B={B}, Hkv={NH}, Q, m={m}], got {tuple(log_phi_q.shape)}"
        )
    ct = _compute_dtype(state.H.dtype, log_phi_q.dtype)
    lq = log_phi_q.to(ct)
    z = state.z.to(ct)
    Hm = state.H.to(ct)
    pos = z > 0
    log_z = torch.where(pos, torch.log(torch.where(pos, z, torch.ones_like(z))), float("-inf"))
    logits = lq + log_z.unsqueeze(-2)  # [B, NH, Q, m]
    lse = torch.logsumexp(logits, dim=-1)  # -inf when the state is empty
    finite = torch.isfinite(lse)
    lse_safe = torch.where(finite, lse, torch.zeros_like(lse))
    weights = torch.exp(logits - lse_safe.unsqueeze(-1))
    weights = torch.where(finite.unsqueeze(-1), weights, torch.zeros_like(weights))
    denom = torch.where(pos, z, torch.ones_like(z)).unsqueeze(-1)
    ratio = torch.where(pos.unsqueeze(-1), Hm / denom, torch.zeros_like(Hm))  # per-feature mean
    value = torch.matmul(weights, ratio)
    c = state.c.to(ct).unsqueeze(-1)
    log_den = torch.where(finite, lse + torch.where(torch.isneginf(c), 0.0, c), float("-inf"))
    log_den = torch.where(torch.isneginf(c).expand_as(log_den), float("-inf"), log_den)
    return log_den, value
