r"""Fused tiered decode attention: full-precision tier + packed quantized tier + low-rank state, one softmax.

References
----------
* T. Dao et al., "Flash-Decoding for long-context inference" (2023) and FlashAttention, arXiv:2205.14135:
  online softmax, and split-K over the key axis so a single long sequence fills the GPU.
* Liu et al., "KIVI", arXiv:2402.02750: the packed quantized layout (keys per channel, values per token), see
  :mod:`kvstack.kernels.quant_pack`.
* Dong et al., "LESS", arXiv:2402.09398: the low-rank state, see :mod:`kvstack.kernels.lowrank_update`.

Math
----
For one (batch, KV head) the ``M = G * Q`` query rows (query head ``h*G + g`` of KV head ``h``, row order
``(g, q)``) at absolute positions ``t_r`` see every stored key at position ``p`` with ``0 <= p <= t_r`` (and
``t_r - p < W`` under a sliding window ``W``).  Exact logits are ``l = s * q.k`` (``s = scaling``), softcapped
as ``c * tanh(l / c)`` when ``softcap = c``.  The low-rank state (``H``, ``z``, offset ``c_s``, see
``lowrank_update``) contributes, per feature ``f``, a logit ``log phi(q)_f + log z_f + c_s`` with value
``H_f / z_f`` -- summing those terms gives exactly ``lowrank_update.readout``'s ``log_den`` and ``value``, on the
same absolute scale as the exact logits.  With ``L`` the log-sum-exp over every visible logit of every tier and
the state features::

    out_r  = sum_i exp(l_ri - L_r) v_i                        [B, Hkv, M, Dv]  float32
    lse_r  = L_r                                               [B, Hkv, M]      float32 (-inf: nothing visible)
    mass_j = sum_r R[j, r] exp(l_ri - L_r)   for every exact key i                [B, Hkv, J, T_tier]

Rows that see nothing get ``out = 0`` and ``lse = -inf`` (never NaN).  ``R`` (``mass_rows``, ``[J, M]``) selects
and sums query rows; :func:`mass_selector` builds the usual ones (all rows / last ``w`` queries, per query head or
per KV group), so ``mass.reshape(B, Hkv * G, T)`` is exactly ``AttentionStats.mass(i, w)`` of the stack.

Kernels (Triton)
----------------
1. ``chunk`` (one launch per exact tier): program = (batch*KV head, row block, split); each split walks
   ``split_tokens`` keys in blocks of ``BLOCK_N`` with an online softmax and writes its partial
   ``(max m, sum l, unnormalised acc)``.  The quantized tier is dequantized in registers:
   key ``k[n, d] = ((packed[n // pf, d] >> (n % pf) * bits) & L) * scale[n // G, d] + zero[n // G, d]`` and value
   ``v[n, d] = ((packed[n, d // pf] >> (d % pf) * bits) & L) * scale[n, d // G] + zero[n, d // G]`` (float32, then
   cast to the storage dtype, exactly like ``dequantize_reference``).  ``q.k`` and ``p @ v`` run on tensor cores
   in the storage dtype (fp16/bf16) with float32 accumulation; float32 tiers use IEEE float32 dots.
2. ``combine`` (one launch): merges the splits of every tier and the state's features (fused readout) under one
   normaliser; writes ``out`` and ``lse``.
3. ``mass`` (only when ``mass_rows`` is given): the chunk kernels store their masked logits (float32, ``M`` per
   key) in a scratch buffer; this light pass reads them back with the final ``lse`` and reduces
   ``R @ exp(l - lse)``.  Choice: storing logits costs ``4 M`` bytes written + read per key, less than
   re-reading the keys for a second pass (``2 D`` bytes per fp16 key; decode has ``M = G <= 8``), and it needs
   no rescaling bookkeeping.  No ``[M, T]`` probability matrix is ever materialised in torch.

Split heuristic: on CUDA, about ``2 * SMs`` programs in total (at least 256 keys per split); ``split_tokens``
overrides it (tests force several splits on tiny inputs).

:func:`tiered_attention` dispatches (``kvstack.kernels.dispatch.use_triton``: CUDA, or ``KVSTACK_KERNELS=triton``)
to :func:`tiered_attention_triton`, else to :func:`tiered_attention_reference` (dequantize into temporaries, one
exact softmax in float32/float64).  Agreement (tests): fp32 tiers ``atol = rtol = 2e-5``, fp16 ``5e-3``, bf16
``5e-2`` on ``out``/``lse`` of unit-scale values (masses ``1e-5`` / ``2e-3`` / ``2e-2``); the kernel rounds
the query and the probabilities to the storage dtype for its tensor-core dots, the reference does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from kvstack.kernels.dispatch import use_triton
from kvstack.kernels.lowrank_update import LowRankState, readout
from kvstack.kernels.online_softmax import finish, log_term_partial, logits_partial, merge
from kvstack.kernels.quant_pack import QuantizedGroups, dequantize_reference

try:  # Triton is optional: the torch reference works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = [
    "FullTierData",
    "QuantTierData",
    "StateData",
    "TieredAttentionResult",
    "mass_selector",
    "tiered_attention",
    "tiered_attention_reference",
    "tiered_attention_triton",
]


# --------------------------------------------------------------------------- #
# inputs / outputs
# --------------------------------------------------------------------------- #
@dataclass
class FullTierData:
    """Full-precision exact tier: keys ``[B, Hkv, T, D]``, values ``[B, Hkv, T, Dv]``, positions int
    ``[B, 1|Hkv, T]`` (-1 = empty)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[-1])


@dataclass
class QuantTierData:
    """Packed quantized exact tier: ``keys`` with ``axis="token"`` (per-channel groups), ``values`` with
    ``axis="channel"`` (per-token groups), positions int ``[B, 1|Hkv, T]``."""

    keys: QuantizedGroups
    values: QuantizedGroups
    positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[-1])


@dataclass
class StateData:
    """Low-rank state and the queries' log features ``log phi(q)`` ``[B, Hkv, M, m]`` (``log_features`` of the
    rows of ``query``, made with the state's projections)."""

    state: LowRankState
    log_phi_q: torch.Tensor


@dataclass
class TieredAttentionResult:
    """``out`` ``[B, Hkv, M, Dv]`` and ``lse`` ``[B, Hkv, M]`` (float32, float64 for float64 references);
    ``mass_full`` / ``mass_quant`` ``[B, Hkv, J, T_tier]`` when ``mass_rows`` was given and the tier exists."""

    out: torch.Tensor
    lse: torch.Tensor
    mass_full: torch.Tensor | None = None
    mass_quant: torch.Tensor | None = None


def mass_selector(
    group: int,
    q_len: int,
    windows: Sequence[int | None] = (None,),
    per_head: bool = True,
    device=None,
) -> torch.Tensor:
    """Row-selection matrix ``R`` ``[J, G*Q]`` (float32, 0/1) for ``mass_rows``.

    Rows are ordered ``(g, q)``.  For each window ``w`` in ``windows`` (``None``: all ``Q`` queries, else the last
    ``w``) and, with ``per_head``, each query head ``g`` of the group, one output row sums the weights of the
    selected query rows.  ``J = len(windows) * (G if per_head else 1)``, windows outermost: with ``per_head`` the
    slice ``[i*G:(i+1)*G]`` of the mass reshaped to ``[B, Hkv*G, T]`` is the per-query-head mass of window ``i``.
    """
    if group < 1 or q_len < 1:
        raise ValueError(f"group={group} and q_len={q_len} must be >= 1")
    q_idx = torch.arange(q_len).repeat(group)  # [M]
    g_idx = torch.arange(group).repeat_interleave(q_len)
    rows = []
    for w in windows:
        if w is not None and w < 1:
            raise ValueError(f"mass window {w!r} must be None or >= 1")
        in_window = q_idx >= (q_len - w if w is not None else 0)
        if per_head:
            rows.extend(in_window & (g_idx == g) for g in range(group))
        else:
            rows.append(in_window)
    return torch.stack(rows).to(device=device, dtype=torch.float32)


# --------------------------------------------------------------------------- #
# validation (shared by both paths)
# --------------------------------------------------------------------------- #
def _check_positions(pos: torch.Tensor, B: int, H: int, T: int, name: str) -> None:
    if pos.dim() != 3 or pos.shape[0] != B or pos.shape[1] not in (1, H) or pos.shape[2] != T:
        raise ValueError(f"{name} positions must be [B={B}, 1|Hkv={H}, T={T}], got {tuple(pos.shape)}")
    if pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"{name} positions must be an integer tensor, got {pos.dtype}")


def _validate(query, query_positions, full, quant, state, mass_rows) -> int:
    """Check shapes; returns the value dim Dv (0 when there is nothing to attend to)."""
    if query.dim() != 4:
        raise ValueError(f"query must be [B, Hkv, M, D], got shape {tuple(query.shape)}")
    B, H, M, D = query.shape
    if query_positions.dim() != 1 or query_positions.shape[0] != M:
        raise ValueError(f"query_positions must be [M={M}], got shape {tuple(query_positions.shape)}")
    dvs = []
    if full is not None:
        T = full.keys.shape[2]
        if tuple(full.keys.shape) != (B, H, T, D):
            raise ValueError(f"full keys must be [{B}, {H}, T, {D}], got {tuple(full.keys.shape)}")
        if full.values.dim() != 4 or tuple(full.values.shape[:3]) != (B, H, T):
            raise ValueError(f"full values must be [{B}, {H}, {T}, Dv], got {tuple(full.values.shape)}")
        _check_positions(full.positions, B, H, T, "full")
        dvs.append(full.values.shape[3])
    if quant is not None:
        k, v = quant.keys, quant.values
        if k.axis != "token" or v.axis != "channel":
            raise ValueError(
                f"quantized keys must use axis='token' and values axis='channel', got {k.axis!r}/{v.axis!r}"
            )
        T = k.num_tokens
        if tuple(k.shape) != (B, H, T, D):
            raise ValueError(f"quantized keys must be [{B}, {H}, T, {D}], got {tuple(k.shape)}")
        if len(v.shape) != 4 or tuple(v.shape[:3]) != (B, H, T):
            raise ValueError(f"quantized values must be [{B}, {H}, {T}, Dv], got {tuple(v.shape)}")
        _check_positions(quant.positions, B, H, T, "quantized")
        dvs.append(v.shape[3])
    if state is not None:
        st = state.state
        if tuple(st.H.shape[:2]) != (B, H):
            raise ValueError(f"state H must be [{B}, {H}, m, Dv], got {tuple(st.H.shape)}")
        if tuple(state.log_phi_q.shape) != (B, H, M, st.H.shape[2]):
            raise ValueError(
                f"log_phi_q must be [{B}, {H}, {M}, m={st.H.shape[2]}], got {tuple(state.log_phi_q.shape)}"
            )
        dvs.append(st.H.shape[3])
    if len(set(dvs)) > 1:
        raise ValueError(f"value dims differ between tiers/state: {dvs}")
    if mass_rows is not None and (mass_rows.dim() != 2 or mass_rows.shape[1] != M):
        raise ValueError(f"mass_rows must be [J, M={M}], got shape {tuple(mass_rows.shape)}")
    return dvs[0] if dvs else 0


def _present(tier):
    return tier if tier is not None and tier.num_tokens > 0 else None


# --------------------------------------------------------------------------- #
# torch reference
# --------------------------------------------------------------------------- #
def tiered_attention_reference(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    *,
    full: FullTierData | None = None,
    quant: QuantTierData | None = None,
    state: StateData | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    mass_rows: torch.Tensor | None = None,
) -> TieredAttentionResult:
    """Plain torch: dequantize the quantized tier (temporaries), merge the tiers and the state's ``log_den`` (from
    ``lowrank_update.readout``) with the online-softmax primitive (``kvstack.kernels.online_softmax``).  Computes in
    float32 (float64 for a float64 query)."""
    dv = _validate(query, query_positions, full, quant, state, mass_rows)
    B, H, M, _ = query.shape
    ct = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(ct)
    qpos = query_positions.to(device=query.device, dtype=torch.long)[None, None, :, None]
    tiers = []
    if _present(full) is not None:
        tiers.append(("full", full.keys, full.values, full.positions))
    if _present(quant) is not None:
        k = dequantize_reference(quant.keys)
        v = dequantize_reference(quant.values)
        tiers.append(("quant", k, v, quant.positions))
    partial, logits = None, {}
    for name, k, v, pos in tiers:
        lg = torch.matmul(q, k.to(ct).transpose(-1, -2)) * scaling
        if softcap:
            lg = torch.tanh(lg / softcap) * softcap
        p = pos.to(torch.long)[:, :, None, :]
        visible = (p >= 0) & (p <= qpos)
        if sliding_window:
            visible = visible & (qpos - p < sliding_window)
        logits[name] = lg.masked_fill(~visible, -math.inf)
        partial = merge(partial, logits_partial(logits[name], v.to(ct)))
    if state is not None and not bool(state.state.is_empty().all()):
        log_den, value = readout(state.state, state.log_phi_q)
        partial = merge(partial, log_term_partial(log_den.to(ct), value.to(ct)))
    if partial is None:
        out = q.new_zeros(B, H, M, dv)
        return TieredAttentionResult(out, q.new_full((B, H, M), -math.inf))
    out, lse = finish(partial)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]
    weights = {name: torch.exp(lg - lse_safe) for name, lg in logits.items()}
    result = TieredAttentionResult(out, lse)
    if mass_rows is not None:
        r = mass_rows.to(device=query.device, dtype=ct)
        if "full" in weights:
            result.mass_full = torch.einsum("jm,bhmt->bhjt", r, weights["full"])
        if "quant" in weights:
            result.mass_quant = torch.einsum("jm,bhmt->bhjt", r, weights["quant"])
    return result


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #
def _chunk_kernel_fn(
    Q, QPOS, K, KS, KZ, V, VS, VZ, POS,
    O_PART, M_PART, L_PART, SCR,
    M, H, T, chunk, n_split, split0, n_split_total, n_mb, scr_t, scr_off,
    sq_b, sq_h, sq_m, sq_d,
    sk_b, sk_h, sk_t, sk_d,  # keys (full) or packed key codes (quantized)
    sks_b, sks_h, sks_t, sks_d,  # key scale/zero (quantized)
    sv_b, sv_h, sv_t, sv_d,  # values or packed value codes
    svs_b, svs_h, svs_t, svs_d,  # value scale/zero
    sp_b, sp_h, sp_t,
    scaling, softcap, window,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_BITS: tl.constexpr,
    V_GROUP: tl.constexpr, STORE_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    CLAMP_F16: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, STORE_LOGITS: tl.constexpr,
):
    # 1-D grid (CUDA caps grid dims 1/2 at 65535): pid -> (bh, row block, split).
    pid = tl.program_id(0).to(tl.int64)
    split = pid % n_split
    rest = pid // n_split
    mb = rest % n_mb
    bh = rest // n_mb
    b = bh // H
    h = bh % H

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    q = tl.load(
        Q + b * sq_b + h * sq_h + rows[:, None] * sq_m + offs_d[None, :] * sq_d,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32).to(STORE_DTYPE).to(DOT_DTYPE)
    qpos = tl.load(QPOS + rows, mask=row_ok, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)

    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h
    p_base = POS + b * sp_b + h * sp_h
    t_start = (split * chunk).to(tl.int32)  # token indices fit int32; keeps the index math narrow
    t_end = tl.minimum(t_start + chunk, T)
    for t0 in range(t_start, t_end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < t_end
        kmask = n_ok[:, None] & d_ok[None, :]
        vmask = n_ok[:, None] & dv_ok[None, :]
        pos = tl.load(p_base + offs_n * sp_t, mask=n_ok, other=-1)
        if QUANT:
            KPF: tl.constexpr = 8 // K_BITS
            VPF: tl.constexpr = 8 // V_BITS
            kc = tl.load(
                k_base + (offs_n // KPF)[:, None] * sk_t + offs_d[None, :] * sk_d, mask=kmask, other=0
            ).to(tl.int32)
            kc = (kc >> ((offs_n % KPF) * K_BITS)[:, None]) & ((1 << K_BITS) - 1)
            if K_GROUP % BLOCK_N == 0:
                # blocks start at multiples of BLOCK_N, so the whole block lies in one key group: load one
                # scale/zero row instead of a [BLOCK_N, D] tile (fewer registers and loads)
                ks_off = b * sks_b + h * sks_h + (t0 // K_GROUP) * sks_t + offs_d * sks_d
                ks = tl.load(KS + ks_off, mask=d_ok, other=0.0).to(tl.float32)[None, :]
                kz = tl.load(KZ + ks_off, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            else:
                ks_off = b * sks_b + h * sks_h + (offs_n // K_GROUP)[:, None] * sks_t + offs_d[None, :] * sks_d
                ks = tl.load(KS + ks_off, mask=kmask, other=0.0).to(tl.float32)
                kz = tl.load(KZ + ks_off, mask=kmask, other=0.0).to(tl.float32)
            kf = kc.to(tl.float32) * ks + kz
            vc = tl.load(
                v_base + offs_n[:, None] * sv_t + (offs_dv // VPF)[None, :] * sv_d, mask=vmask, other=0
            ).to(tl.int32)
            vc = (vc >> ((offs_dv % VPF) * V_BITS)[None, :]) & ((1 << V_BITS) - 1)
            vs_off = b * svs_b + h * svs_h + offs_n[:, None] * svs_t + (offs_dv // V_GROUP)[None, :] * svs_d
            vs = tl.load(VS + vs_off, mask=vmask, other=0.0).to(tl.float32)
            vz = tl.load(VZ + vs_off, mask=vmask, other=0.0).to(tl.float32)
            vf = vc.to(tl.float32) * vs + vz
            if CLAMP_F16:  # like dequantize_reference: the rounded-up scale may overshoot fp16's max
                kf = tl.minimum(tl.maximum(kf, -65504.0), 65504.0)
                vf = tl.minimum(tl.maximum(vf, -65504.0), 65504.0)
            k = kf.to(STORE_DTYPE).to(DOT_DTYPE)
            v = vf.to(STORE_DTYPE).to(DOT_DTYPE)
        else:
            k = tl.load(
                k_base + offs_n[:, None] * sk_t + offs_d[None, :] * sk_d, mask=kmask, other=0.0
            ).to(DOT_DTYPE)
            v = tl.load(
                v_base + offs_n[:, None] * sv_t + offs_dv[None, :] * sv_d, mask=vmask, other=0.0
            ).to(DOT_DTYPE)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scaling
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no tanh builtin needed
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (pos >= 0)[None, :] & (pos[None, :] <= qpos[:, None]) & n_ok[None, :] & row_ok[:, None]
        if WINDOW:
            visible = visible & ((qpos[:, None] - pos[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))
        if STORE_LOGITS:
            tl.store(
                SCR + bh * M * scr_t + rows[:, None] * scr_t + scr_off + offs_n[None, :],
                s, mask=row_ok[:, None] & n_ok[None, :],
            )
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX_COMBINE))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM_COMBINE)
        if IEEE:
            pv = tl.dot(p.to(STORE_DTYPE).to(DOT_DTYPE), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(DOT_DTYPE), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    slot = (bh * n_split_total + split0 + split) * M + rows
    tl.store(M_PART + slot, m_i, mask=row_ok)
    tl.store(L_PART + slot, l_i, mask=row_ok)
    tl.store(O_PART + slot[:, None] * DV + offs_dv[None, :], acc, mask=row_ok[:, None] & dv_ok[None, :])


def _combine_kernel_fn(
    O_PART, M_PART, L_PART, OUT, LSE, LPQ, SH, SZ, SC,
    M, n_split, n_mb, n_feat,
    sl_b, sl_h, sl_m, sl_f,
    sh_b, sh_h, sh_f, sh_d,
    sz_b, sz_h, sz_f,
    sc_b, sc_h,
    H,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_F: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    mb = pid % n_mb
    bh = pid // n_mb
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    omask = row_ok[:, None] & dv_ok[None, :]

    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    for s in range(0, n_split):
        slot = (bh * n_split + s) * M + rows
        m_s = tl.load(M_PART + slot, mask=row_ok, other=float("-inf"))
        l_s = tl.load(L_PART + slot, mask=row_ok, other=0.0)
        o_s = tl.load(O_PART + slot[:, None] * DV + offs_dv[None, :], mask=omask, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_run = tl.exp(m_run - m_use)
        a_s = tl.exp(m_s - m_use)
        l_run = l_run * a_run + l_s * a_s
        acc = acc * a_run[:, None] + o_s * a_s[:, None]
        m_run = m_new

    if HAS_STATE:
        # Fused low-rank readout: feature f is a pseudo-key with logit log phi(q)_f + log z_f + c and
        # value H_f / z_f (their log-sum-exp / weighted mean are readout's log_den / value).
        b = bh // H
        h = bh % H
        c = tl.load(SC + b * sc_b + h * sc_h).to(tl.float32)
        for f0 in range(0, n_feat, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            f_ok = offs_f < n_feat
            z = tl.load(SZ + b * sz_b + h * sz_h + offs_f * sz_f, mask=f_ok, other=0.0).to(tl.float32)
            zpos = z > 0.0
            log_z = tl.where(zpos, tl.log(tl.where(zpos, z, 1.0)), float("-inf"))
            lq = tl.load(
                LPQ + b * sl_b + h * sl_h + rows[:, None] * sl_m + offs_f[None, :] * sl_f,
                mask=row_ok[:, None] & f_ok[None, :], other=float("-inf"),
            ).to(tl.float32)
            st = tl.where(zpos[None, :] & row_ok[:, None], lq + log_z[None, :] + c, float("-inf"))
            hv = tl.load(
                SH + b * sh_b + h * sh_h + offs_f[:, None] * sh_f + offs_dv[None, :] * sh_d,
                mask=f_ok[:, None] & dv_ok[None, :], other=0.0,
            ).to(tl.float32)
            ratio = tl.where(zpos[:, None] & dv_ok[None, :], hv / tl.where(zpos, z, 1.0)[:, None], 0.0)
            m_new = tl.maximum(m_run, tl.reduce(st, 1, _MAX_COMBINE))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            a_run = tl.exp(m_run - m_use)
            p = tl.exp(st - m_use[:, None])
            l_run = l_run * a_run + tl.reduce(p, 1, _SUM_COMBINE)
            acc = acc * a_run[:, None] + tl.dot(p, ratio, input_precision="ieee")
            m_run = m_new

    m_fin = tl.where(m_run == float("-inf"), 0.0, m_run)
    has = l_run > 0.0
    lse = tl.where(has, tl.log(tl.where(has, l_run, 1.0)) + m_fin, float("-inf"))
    out = tl.where(has[:, None], acc / tl.where(has, l_run, 1.0)[:, None], 0.0)
    tl.store(LSE + bh * M + rows, lse, mask=row_ok)
    tl.store(OUT + (bh * M + rows)[:, None] * DV + offs_dv[None, :], out, mask=omask)


def _mass_kernel_fn(
    SCR, LSE, R, MASS, M, J, scr_t, n_tb,
    BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tb = pid % n_tb
    bh = pid // n_tb
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < scr_t
    offs_j = tl.arange(0, BLOCK_J)
    j_ok = offs_j < J
    acc = tl.full([BLOCK_J, BLOCK_T], 0.0, tl.float32)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        lse = tl.load(LSE + bh * M + rows, mask=row_ok, other=float("-inf"))
        fin = lse > float("-inf")
        lg = tl.load(
            SCR + (bh * M + rows)[:, None] * scr_t + offs_t[None, :],
            mask=row_ok[:, None] & t_ok[None, :], other=float("-inf"),
        )
        p = tl.where(fin[:, None], tl.exp(lg - tl.where(fin, lse, 0.0)[:, None]), 0.0)
        r = tl.load(R + offs_j[:, None] * M + rows[None, :], mask=j_ok[:, None] & row_ok[None, :], other=0.0)
        acc += tl.dot(r, p, input_precision="ieee")
    tl.store(
        MASS + (bh * J + offs_j)[:, None] * scr_t + offs_t[None, :], acc, mask=j_ok[:, None] & t_ok[None, :]
    )


# Only Triton builtins inside the kernels (tl.reduce with the standard combiners instead of tl.max / tl.sum,
# tl.full instead of tl.zeros): the standard library's @jit helpers are decorated when triton is first imported,
# which may predate TRITON_INTERPRET=1 (see quant_pack); the interpreter recognises these combiners by identity.
if tl is not None:
    _MAX_COMBINE = tl.standard._elementwise_max
    _SUM_COMBINE = tl.standard._sum_combine

_KERNELS: dict = {}


def _kernels():
    # JIT lazily and per interpreter mode (triton.jit decides at decoration time whether to interpret).
    if triton is None:
        raise RuntimeError("tiered_attention_triton needs the 'triton' package")
    interp = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False
    if interp not in _KERNELS:
        _KERNELS[interp] = (
            triton.jit(_chunk_kernel_fn),
            triton.jit(_combine_kernel_fn),
            triton.jit(_mass_kernel_fn),
        )
    return _KERNELS[interp]


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


_DOT_DTYPES = {}
if tl is not None:
    _DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

MIN_SPLIT_TOKENS = 256


def _dot_args(dtype: torch.dtype) -> dict:
    """Dot operands are rounded to the storage dtype (STORE_DTYPE) and multiplied in DOT_DTYPE: the storage dtype
    on GPUs (tensor cores), except that Triton's CPU interpreter computes bf16 dots wrongly, so there the rounded
    operands are multiplied in IEEE float32."""
    store = _DOT_DTYPES[dtype]
    interp = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False
    dot = tl.float32 if dtype == torch.float32 or (interp and dtype == torch.bfloat16) else store
    return dict(STORE_DTYPE=store, DOT_DTYPE=dot, IEEE=dot == tl.float32)


def _split_tokens(total_tokens: int, units: int, device: torch.device) -> int:
    """Keys per split: about 2 programs per SM over all (batch, head, row block) units, >= MIN_SPLIT_TOKENS."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    want = max(1, -(-2 * sms // max(units, 1)))
    return max(MIN_SPLIT_TOKENS, -(-total_tokens // want))


def tiered_attention_triton(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    *,
    full: FullTierData | None = None,
    quant: QuantTierData | None = None,
    state: StateData | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    mass_rows: torch.Tensor | None = None,
    split_tokens: int | None = None,
) -> TieredAttentionResult:
    """Triton path (see module docstring); same arguments and results as :func:`tiered_attention_reference`.
    ``split_tokens`` overrides the number of keys per split (rounded up to the key block)."""
    dv = _validate(query, query_positions, full, quant, state, mass_rows)
    chunk_k, combine_k, mass_k = _kernels()
    dev = query.device
    B, H, M, D = query.shape
    BH = B * H
    full, quant = _present(full), _present(quant)
    if state is not None and bool(state.state.is_empty().all()):
        state = None
    if full is None and quant is None and state is None:
        out = torch.zeros(B, H, M, dv, device=dev, dtype=torch.float32)
        return TieredAttentionResult(out, torch.full((B, H, M), -math.inf, device=dev, dtype=torch.float32))
    out = torch.empty(B, H, M, dv, device=dev, dtype=torch.float32)  # the combine kernel writes every entry
    lse = torch.empty(B, H, M, device=dev, dtype=torch.float32)
    result = TieredAttentionResult(out, lse)

    BLOCK_M = min(_pow2(M), 64)
    n_mb = -(-M // BLOCK_M)
    BLOCK_D = _pow2(D)
    BLOCK_DV = _pow2(dv)
    tf = full.num_tokens if full is not None else 0
    tq = quant.num_tokens if quant is not None else 0
    if split_tokens is None:
        split_tokens = _split_tokens(tf + tq, BH * n_mb, dev)
    # Key blocks: 64 fp16 keys / 32 packed keys per step keep the chunk kernel at <= ~190 registers per thread
    # with 8 warps on sm_90 (no spills, checked with ptxas); a packed block should not straddle key groups.
    bn_full = min(64 if BLOCK_D <= 128 else 32, _pow2(split_tokens))
    bn_quant = min(32 if BLOCK_D <= 128 else 16, _pow2(split_tokens))
    if quant is not None and quant.keys.group_size % 16 == 0:
        bn_quant = min(bn_quant, quant.keys.group_size & -quant.keys.group_size)
    chunk = -(-split_tokens // max(bn_full, bn_quant)) * max(bn_full, bn_quant)
    n_sf, n_sq = -(-tf // chunk), -(-tq // chunk)
    n_split = n_sf + n_sq

    qpos = query_positions.to(device=dev, dtype=torch.int32).contiguous()
    o_part = torch.empty(BH * n_split * M * dv, device=dev, dtype=torch.float32)
    m_part = torch.empty(BH * n_split * M, device=dev, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    want_mass = mass_rows is not None and n_split > 0
    scr_t = tf + tq
    scr = torch.empty(BH * M * scr_t if want_mass else 1, device=dev, dtype=torch.float32)
    common = dict(
        D=D, DV=dv, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        SOFTCAP=bool(softcap), WINDOW=bool(sliding_window), STORE_LOGITS=want_mass, num_warps=8,
    )
    scalars = (float(scaling), float(softcap or 1.0), int(sliding_window or 0))
    if full is not None:
        dt = full.keys.dtype
        if dt not in _DOT_DTYPES or full.values.dtype != dt:
            raise ValueError(f"full keys/values must share one of fp32/fp16/bf16, got {dt}/{full.values.dtype}")
        pos = full.positions
        chunk_k[(BH * n_mb * n_sf,)](
            query, qpos, full.keys, full.keys, full.keys, full.values, full.values, full.values, pos,
            o_part, m_part, l_part, scr,
            M, H, tf, chunk, n_sf, 0, n_split, n_mb, scr_t, 0,
            *query.stride(), *full.keys.stride(), 0, 0, 0, 0, *full.values.stride(), 0, 0, 0, 0,
            pos.stride(0), pos.stride(1) if pos.shape[1] > 1 else 0, pos.stride(2),
            *scalars,
            QUANT=False, K_BITS=8, K_GROUP=1, V_BITS=8, V_GROUP=1, **_dot_args(dt), CLAMP_F16=False,
            BLOCK_N=bn_full, **common,
        )
    if quant is not None:
        qk, qv = quant.keys, quant.values
        dt = qk.scale.dtype
        if dt not in _DOT_DTYPES or qv.scale.dtype != dt:
            raise ValueError(f"quantized scales must share one of fp32/fp16/bf16, got {dt}/{qv.scale.dtype}")
        kc, ks, kz = qk.packed.contiguous(), qk.scale.contiguous(), qk.zero.contiguous()
        vc, vs, vz = qv.packed.contiguous(), qv.scale.contiguous(), qv.zero.contiguous()
        pos = quant.positions
        chunk_k[(BH * n_mb * n_sq,)](
            query, qpos, kc, ks, kz, vc, vs, vz, pos,
            o_part, m_part, l_part, scr,
            M, H, tq, chunk, n_sq, n_sf, n_split, n_mb, scr_t, tf,
            *query.stride(), *kc.stride(), *ks.stride(), *vc.stride(), *vs.stride(),
            pos.stride(0), pos.stride(1) if pos.shape[1] > 1 else 0, pos.stride(2),
            *scalars,
            QUANT=True, K_BITS=qk.bits, K_GROUP=qk.group_size, V_BITS=qv.bits, V_GROUP=qv.group_size,
            **_dot_args(dt), CLAMP_F16=dt == torch.float16, BLOCK_N=bn_quant, **common,
        )
    if state is not None:
        st, lpq = state.state, state.log_phi_q
        n_feat = st.H.shape[2]
        state_args = (lpq, st.H, st.z, st.c, M, n_split, n_mb, n_feat,
                      *lpq.stride(), *st.H.stride(), *st.z.stride(), *st.c.stride())
    else:
        n_feat = 1
        state_args = (out, out, out, out, M, n_split, n_mb, 1, *([0] * 13))
    combine_k[(BH * n_mb,)](
        o_part, m_part, l_part, out, lse, *state_args, H,
        DV=dv, BLOCK_M=BLOCK_M, BLOCK_DV=BLOCK_DV, BLOCK_F=min(_pow2(n_feat), 64),
        HAS_STATE=state is not None, num_warps=4,
    )
    if want_mass:
        rmat = mass_rows.to(device=dev, dtype=torch.float32).contiguous()
        J = rmat.shape[0]
        mass = torch.empty(B, H, J, scr_t, device=dev, dtype=torch.float32)
        BLOCK_T = 64
        n_tb = -(-scr_t // BLOCK_T)
        mass_k[(BH * n_tb,)](
            scr, lse, rmat, mass, M, J, scr_t, n_tb,
            BLOCK_J=_pow2(J), BLOCK_M=min(_pow2(M), 32), BLOCK_T=BLOCK_T, num_warps=4,
        )
        if full is not None:
            result.mass_full = mass[..., :tf]
        if quant is not None:
            result.mass_quant = mass[..., tf:]
    return result


# --------------------------------------------------------------------------- #
# dispatcher
# --------------------------------------------------------------------------- #
def tiered_attention(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    *,
    full: FullTierData | None = None,
    quant: QuantTierData | None = None,
    state: StateData | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    mass_rows: torch.Tensor | None = None,
) -> TieredAttentionResult:
    """Attention of ``query`` ``[B, Hkv, M, D]`` (rows at absolute ``query_positions`` ``[M]``) over the full tier,
    the quantized tier and the low-rank state under one softmax; see the module docstring for the math.

    Returns ``out`` / ``lse`` and, when ``mass_rows`` ``[J, M]`` is given (:func:`mass_selector`), the per-key
    attention mass of each present exact tier.  Triton on CUDA or with ``KVSTACK_KERNELS=triton``, else the torch
    reference.
    """
    if use_triton(query):
        return tiered_attention_triton(
            query, query_positions, scaling, full=full, quant=quant, state=state, softcap=softcap,
            sliding_window=sliding_window, mass_rows=mass_rows,
        )
    return tiered_attention_reference(
        query, query_positions, scaling, full=full, quant=quant, state=state, softcap=softcap,
        sliding_window=sliding_window, mass_rows=mass_rows,
    )
