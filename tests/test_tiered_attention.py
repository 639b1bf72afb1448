"""Tests for kvstack.kernels.tiered_attention (fused tiered decode attention).

The Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported) and are
compared with the torch reference; the reference itself is checked against a naive float64 dense softmax.

Tolerances (absolute and relative, inputs of unit scale): fp32 tiers 2e-5; fp16 5e-3; bf16 5e-2 on ``out`` and
``lse``; per-key masses 1e-5 / 2e-3 / 2e-2 (observed worst cases over 40 random cases: 1e-6 / 6e-4 / 1.5e-2).
The kernel rounds the query and the probabilities to the storage dtype for its dots (tensor cores), the reference
multiplies in float32 — that rounding is what the fp16/bf16 tolerances cover.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvstack.kernels import tiered_attention as ta  # noqa: E402
from kvstack.kernels.lowrank_update import draw_features, empty_state, fold_reference, log_features  # noqa: E402
from kvstack.kernels.quant_pack import dequantize_reference, quantize_reference  # noqa: E402
from kvstack.kernels.tiered_attention import (  # noqa: E402
    FullTierData,
    QuantTierData,
    StateData,
    mass_selector,
    tiered_attention,
    tiered_attention_reference,
    tiered_attention_triton,
)

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False
needs_triton = pytest.mark.skipif(
    not (HAVE_TRITON and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available())),
    reason="needs triton with TRITON_INTERPRET=1 or a CUDA device",
)

TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2}
MASS_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = list(TOL)


@pytest.fixture(autouse=True)
def _default_kernels(monkeypatch):
    monkeypatch.delenv("KVSTACK_KERNELS", raising=False)


def make_case(
    seed, *, B=1, H=1, G=2, Q=1, D=16, dtype=torch.float32, q_dtype=None, tf=9, n_qgroups=1, k_bits=2,
    v_bits=4, k_group=8, v_group=8, rank=0, fold_n=6, head_positions=False, empty_frac=0.2,
):
    """Random tiers around a query block at the end of a sequence (some slots empty, some in the future)."""
    g = torch.Generator().manual_seed(seed)
    M = G * Q
    tq = n_qgroups * k_group
    seen = tf + tq + 4
    hp = H if head_positions else 1

    def positions(t):
        pos = torch.randint(0, seen + 2, (B, hp, t), generator=g, dtype=torch.int32)  # a few in the future
        empty = torch.rand(B, hp, t, generator=g) < empty_frac
        return torch.where(empty, torch.full_like(pos, -1), pos)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    query = torch.randn(B, H, M, D, generator=g).to(q_dtype or dtype)
    qpos = torch.arange(seen - Q, seen).repeat(G)
    full = FullTierData(rnd(B, H, tf, D), rnd(B, H, tf, D), positions(tf)) if tf else None
    quant = None
    if tq:
        quant = QuantTierData(
            quantize_reference(rnd(B, H, tq, D), k_bits, k_group, "token"),
            quantize_reference(rnd(B, H, tq, D), v_bits, v_group, "channel"),
            positions(tq),
        )
    state = None
    if rank:
        proj = draw_features(D, rank, seed, num_heads=H)
        s = empty_state(B, H, rank, D)
        if fold_n:
            keys = torch.randn(B, H, fold_n, D, generator=g)
            s = fold_reference(s, log_features(keys, proj, D**-0.5), torch.randn(B, H, fold_n, D, generator=g))
        state = StateData(s, log_features(query.float(), proj, D**-0.5))
    return query, qpos, dict(full=full, quant=quant, state=state)


def naive_dense(query, qpos, scaling, full=None, quant=None, state=None, softcap=None, sliding_window=None,
                mass_rows=None):
    """float64, row by row, key by key: exp of every visible logit (no stabiliser), the state as explicit sums
    ``sum_f exp(log phi_f + c) z_f`` / ``... H_f``, one division."""
    B, H, M, _ = query.shape
    q = query.double()
    tiers = []
    if full is not None:
        tiers.append((full.keys.double(), full.values.double(), full.positions))
    if quant is not None:
        tiers.append((dequantize_reference(quant.keys).double(), dequantize_reference(quant.values).double(),
                      quant.positions))
    dv = tiers[0][1].shape[-1] if tiers else (state.state.H.shape[-1] if state is not None else 0)
    out = torch.zeros(B, H, M, dv, dtype=torch.float64)
    lse = torch.full((B, H, M), -math.inf, dtype=torch.float64)
    weights = [torch.zeros(B, H, M, k.shape[2], dtype=torch.float64) for k, _, _ in tiers]
    for b in range(B):
        for h in range(H):
            for r in range(M):
                t = int(qpos[r])
                num = torch.zeros(dv, dtype=torch.float64)
                den = 0.0
                exps = []
                for k, v, pos in tiers:
                    e = torch.zeros(k.shape[2], dtype=torch.float64)
                    for i in range(k.shape[2]):
                        p = int(pos[b, min(h, pos.shape[1] - 1), i])
                        if p < 0 or p > t or (sliding_window and t - p >= sliding_window):
                            continue
                        logit = scaling * float(q[b, h, r] @ k[b, h, i])
                        if softcap:
                            logit = softcap * math.tanh(logit / softcap)
                        e[i] = math.exp(logit)
                    num = num + e @ v[b, h]
                    den += float(e.sum())
                    exps.append(e)
                if state is not None and not bool(torch.isneginf(state.state.c[b, h])):
                    w = torch.exp(state.log_phi_q[b, h, r].double() + float(state.state.c[b, h]))
                    den += float(w @ state.state.z[b, h].double())
                    num = num + w @ state.state.H[b, h].double()
                if den > 0:
                    out[b, h, r] = num / den
                    lse[b, h, r] = math.log(den)
                    for wt, e in zip(weights, exps):
                        wt[b, h, r] = e / den
    masses = [None if mass_rows is None else torch.einsum("jm,bhmt->bhjt", mass_rows.double(), w)
              for w in weights]
    return out, lse, masses


def assert_close(res, ref, dtype, has_full, has_quant):
    tol = TOL[dtype]
    torch.testing.assert_close(res.out.double(), ref.out.double(), atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(res.lse), torch.isneginf(ref.lse))
    fin = torch.isfinite(ref.lse)
    torch.testing.assert_close(res.lse[fin].double(), ref.lse[fin].double(), atol=tol, rtol=tol)
    for name, present in (("mass_full", has_full), ("mass_quant", has_quant)):
        a, b = getattr(res, name), getattr(ref, name)
        if not present:
            assert a is None and b is None
            continue
        mt = MASS_TOL[dtype]
        torch.testing.assert_close(a.double(), b.double(), atol=mt, rtol=mt)


# --------------------------------------------------------------------------- reference vs naive
@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 10_000),
    G=st.integers(1, 4),
    Q=st.integers(1, 3),
    tf=st.integers(0, 12),
    n_qgroups=st.integers(0, 2),
    bits=st.sampled_from([2, 4, 8]),
    rank=st.sampled_from([0, 4]),
    softcap=st.sampled_from([None, 3.0]),
    window=st.sampled_from([None, 5]),
)
def test_reference_matches_naive_dense(seed, G, Q, tf, n_qgroups, bits, rank, softcap, window):
    query, qpos, tiers = make_case(seed, B=2, H=2, G=G, Q=Q, D=8, tf=tf, n_qgroups=n_qgroups, k_bits=bits,
                                   v_bits=bits, rank=rank, head_positions=seed % 2 == 0)
    rows = mass_selector(G, Q, (None, 1))
    ref = tiered_attention_reference(query, qpos, 8**-0.5, softcap=softcap, sliding_window=window,
                                     mass_rows=rows, **tiers)
    out, lse, masses = naive_dense(query, qpos, 8**-0.5, softcap=softcap, sliding_window=window,
                                   mass_rows=rows, **tiers)
    torch.testing.assert_close(ref.out.double(), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.lse.double(), lse, atol=1e-5, rtol=1e-5)
    present = [m for m in (ref.mass_full, ref.mass_quant) if m is not None]
    assert len(present) == len(masses)
    for got, want in zip(present, masses):
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_mass_selector_rows():
    r = mass_selector(2, 3, (None, 1), per_head=True)
    # rows (g, q): g0q0 g0q1 g0q2 g1q0 g1q1 g1q2
    assert r.tolist() == [
        [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1],  # window None, heads 0 and 1
        [0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1],  # last query only
    ]
    assert mass_selector(2, 3, (2,), per_head=False).tolist() == [[0, 1, 1, 0, 1, 1]]
    with pytest.raises(ValueError, match="window"):
        mass_selector(2, 3, (0,))


def test_per_head_mass_sums_to_one_per_query():
    """Masses of all tiers plus the state's share sum to the number of selected queries with any visible key."""
    query, qpos, tiers = make_case(3, B=1, H=2, G=3, Q=2, D=16, tf=7, rank=4, empty_frac=0.0)
    rows = mass_selector(3, 2, (None,))
    ref = tiered_attention_reference(query, qpos, 0.25, mass_rows=rows, **tiers)
    total = ref.mass_full.sum(-1) + ref.mass_quant.sum(-1)  # [B, H, G]
    assert bool((total <= 2 + 1e-5).all()) and bool((total > 0.1).all())
    no_state = dict(tiers, state=None)
    ref2 = tiered_attention_reference(query, qpos, 0.25, mass_rows=rows, **no_state)
    torch.testing.assert_close(ref2.mass_full.sum(-1) + ref2.mass_quant.sum(-1), torch.full_like(total, 2.0))


# --------------------------------------------------------------------------- kernel vs reference
@needs_triton
@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    D=st.sampled_from([8, 16, 32, 64, 128]),
    G=st.integers(1, 8),
    Q=st.integers(1, 2),
    tf=st.integers(0, 40),
    n_qgroups=st.integers(0, 3),
    k_bits=st.sampled_from([2, 4, 8]),
    v_bits=st.sampled_from([2, 4, 8]),
    k_group=st.sampled_from([8, 16]),
    rank=st.sampled_from([0, 4, 20]),
    dtype=st.sampled_from(DTYPES),
    fp32_query=st.booleans(),
    split=st.sampled_from([16, 32, None]),
    softcap=st.sampled_from([None, 4.0]),
    window=st.sampled_from([None, 17]),
    mass=st.booleans(),
)
def test_kernel_matches_reference(seed, D, G, Q, tf, n_qgroups, k_bits, v_bits, k_group, rank,
                                  dtype, fp32_query, split, softcap, window, mass):
    query, qpos, tiers = make_case(
        seed, B=1 + seed % 2, H=1 + (seed // 2) % 2, G=G, Q=Q, D=D, dtype=dtype,
        q_dtype=torch.float32 if fp32_query else dtype, tf=tf, n_qgroups=n_qgroups, k_bits=k_bits,
        v_bits=v_bits, k_group=k_group, rank=rank, head_positions=seed % 3 == 0,
    )
    rows = mass_selector(G, Q, (None, 1)) if mass else None
    kw = dict(softcap=softcap, sliding_window=window, mass_rows=rows, **tiers)
    res = tiered_attention_triton(query, qpos, D**-0.5, split_tokens=split, **kw)
    ref = tiered_attention_reference(query, qpos, D**-0.5, **kw)
    assert res.out.dtype == torch.float32 and res.out.shape == ref.out.shape
    assert_close(res, ref, dtype, mass and tf > 0, mass and n_qgroups > 0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_many_splits_and_row_blocks(dtype):
    """More than one row block (M > 64) and several splits per tier with a ragged last block."""
    query, qpos, tiers = make_case(11, G=5, Q=14, D=16, dtype=dtype, q_dtype=torch.float32, tf=37,
                                   n_qgroups=3, k_group=16, rank=4)
    rows = mass_selector(5, 14, (None, 3))
    res = tiered_attention_triton(query, qpos, 0.25, mass_rows=rows, split_tokens=16, **tiers)
    ref = tiered_attention_reference(query, qpos, 0.25, mass_rows=rows, **tiers)
    assert_close(res, ref, dtype, True, True)


@needs_triton
def test_empty_inputs_give_zero_output_and_neg_inf_lse():
    query, qpos, tiers = make_case(5, B=2, H=2, G=2, Q=1, D=16, tf=10, n_qgroups=1, rank=4, fold_n=0)
    full, quant = tiers["full"], tiers["quant"]
    cases = {
        "nothing": {},
        "empty state only": {"state": tiers["state"]},
        "all positions empty": {
            "full": FullTierData(full.keys, full.values, torch.full_like(full.positions, -1)),
            "quant": QuantTierData(quant.keys, quant.values, torch.full_like(quant.positions, -1)),
        },
        "zero-length tiers": {"full": FullTierData(full.keys[:, :, :0], full.values[:, :, :0],
                                                   full.positions[..., :0])},
    }
    rows = mass_selector(2, 1)
    for name, kw in cases.items():
        for fn in (tiered_attention_triton, tiered_attention_reference):
            res = fn(query, qpos, 0.25, mass_rows=rows, **kw)
            assert torch.equal(res.out, torch.zeros_like(res.out)), name
            assert bool(torch.isneginf(res.lse).all()), name
            if name == "all positions empty":
                assert torch.equal(res.mass_full, torch.zeros_like(res.mass_full))
                assert torch.equal(res.mass_quant, torch.zeros_like(res.mass_quant))


@needs_triton
def test_state_only_and_partially_empty_state():
    """Only the low-rank state (fused readout); one (batch, head) empty, the other not."""
    query, qpos, tiers = make_case(8, B=2, H=1, G=3, Q=1, D=16, tf=0, n_qgroups=0, rank=20)
    s = tiers["state"].state
    s.c[0, 0] = float("-inf")
    s.H[0, 0] = 0
    s.z[0, 0] = 0
    res = tiered_attention_triton(query, qpos, 0.25, state=tiers["state"])
    ref = tiered_attention_reference(query, qpos, 0.25, state=tiers["state"])
    assert_close(res, ref, torch.float32, False, False)
    assert bool(torch.isneginf(res.lse[0]).all()) and bool(torch.isfinite(res.lse[1]).all())


# --------------------------------------------------------------------------- dispatcher and validation
def test_dispatcher_follows_env(monkeypatch):
    calls = []
    monkeypatch.setattr(ta, "tiered_attention_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(ta, "tiered_attention_reference", lambda *a, **k: calls.append("torch"))
    query, qpos, tiers = make_case(1)
    for mode in ("torch", "triton", "auto"):
        monkeypatch.setenv("KVSTACK_KERNELS", mode)
        tiered_attention(query, qpos, 0.25, **tiers)
    assert calls == ["torch", "triton", "triton" if torch.cuda.is_available() else "torch"]


def test_validation_errors():
    query, qpos, tiers = make_case(2, tf=5)
    full = tiers["full"]
    with pytest.raises(ValueError, match="query_positions"):
        tiered_attention_reference(query, qpos[:1], 0.25, **tiers)
    with pytest.raises(ValueError, match="full positions"):
        bad = FullTierData(full.keys, full.values, full.positions[..., :3])
        tiered_attention_reference(query, qpos, 0.25, full=bad)
    with pytest.raises(ValueError, match="axis"):
        q = tiers["quant"]
        tiered_attention_reference(query, qpos, 0.25, quant=QuantTierData(q.values, q.keys, q.positions))
    with pytest.raises(ValueError, match="mass_rows"):
        tiered_attention_reference(query, qpos, 0.25, mass_rows=torch.ones(1, 7), **tiers)
