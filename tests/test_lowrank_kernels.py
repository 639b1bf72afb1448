"""Tests for kvstack.kernels.lowrank_update (LESS-style random-feature state).

Triton runs through its CPU interpreter: TRITON_INTERPRET must be set before
triton is imported.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvstack.kernels import lowrank_update as lr  # noqa: E402
from kvstack.kernels.lowrank_update import (  # noqa: E402
    LowRankState,
    draw_features,
    empty_state,
    fold,
    fold_reference,
    log_features,
    readout,
)

HYP = settings(max_examples=25, deadline=None, derandomize=True)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _unit(*shape, g):
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True)).float()


def _oracle(log_phi_q, log_psi_k, v):
    """float64 estimator value computed directly in log space (no state):
    log sum_j phi(q)^T psi(k_j) and the matching weighted mean of v."""
    lq = log_phi_q.double()[..., :, None, :]  # [B, H, Q, 1, m]
    lk = log_psi_k.double()[..., None, :, :]  # [B, H, 1, n, m]
    joint = lq + lk  # [B, H, Q, n, m]
    log_den = torch.logsumexp(joint.flatten(-2), dim=-1)
    w_tok = torch.softmax(joint.flatten(-2), dim=-1).unflatten(-1, joint.shape[-2:]).sum(-1)
    return log_den, w_tok @ v.double()


def _assert_state_close(a: LowRankState, b: LowRankState, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a.c, b.c, rtol=0, atol=0)
    torch.testing.assert_close(a.z, b.z, rtol=rtol, atol=atol)
    torch.testing.assert_close(a.H, b.H, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------
# feature maps
# --------------------------------------------------------------------------
def test_draw_features_shape_determinism_orthogonality():
    d, m = 8, 20
    p = draw_features(d, m, seed=3, num_heads=2)
    assert p.shape == (2, m, d) and p.dtype == torch.float32
    torch.testing.assert_close(p, draw_features(d, m, seed=3, num_heads=2), rtol=0, atol=0)
    assert not torch.allclose(p, draw_features(d, m, seed=4, num_heads=2))
    assert not torch.allclose(p[0], p[1])  # heads are independent
    p64 = draw_features(d, m, seed=3, num_heads=2, dtype=torch.float64)
    assert p64.dtype == torch.float64
    for h in range(2):
        for start in range(0, m, d):
            blk = p64[h, start : start + d]
            unit = blk / blk.norm(dim=-1, keepdim=True)
            gram = unit @ unit.T
            torch.testing.assert_close(gram, torch.eye(blk.shape[0], dtype=torch.float64))
    # rows are rescaled to chi(d) norms, not unit norm
    norms = draw_features(16, 4096, seed=0, dtype=torch.float64)[0].norm(dim=-1)
    assert abs(norms.pow(2).mean().item() - 16) < 1.0
    assert norms.std() > 0.1


def test_log_features_formula_and_broadcast():
    g = _gen(0)
    x = torch.randn(2, 3, 5, 8, generator=g)
    p = draw_features(8, 12, seed=1, num_heads=3)
    s = 8**-0.5
    out = log_features(x, p, s)
    xs = x.double() * math.sqrt(s)
    ref = (
        torch.einsum("bhtd,hmd->bhtm", xs, p.double())
        - 0.5 * (xs * xs).sum(-1, keepdim=True)
        - 0.5 * math.log(12)
    )
    assert out.shape == (2, 3, 5, 12)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    shared = log_features(x, p[0], s)  # [m, d] broadcast over heads
    torch.testing.assert_close(shared[:, 0], out[:, 0])
    with pytest.raises(ValueError):
        log_features(x, draw_features(8, 12, seed=1, num_heads=2), s)


# --------------------------------------------------------------------------
# statistics: unbiasedness and error shrinking with rank
# --------------------------------------------------------------------------
@pytest.mark.parametrize("d", [8, 32])
def test_estimate_unbiased_and_error_shrinks_with_rank(d):
    s = d**-0.5
    g = _gen(1)
    # ||x * sqrt(s)|| <= 1.2: moderate norms for which random features work well
    q = _unit(1, 1, 4, d, g=g) * d**0.25
    k = _unit(1, 1, 20, d, g=g) * d**0.25 * (0.2 + torch.rand(1, 1, 20, 1, generator=g))
    v = torch.randn(1, 1, 20, 3, generator=g)
    exact = torch.exp(s * q @ k.transpose(-1, -2)).sum(-1).double()  # [1, 1, 4]

    def estimates(rank, seeds):
        out = []
        for seed in seeds:
            p = draw_features(d, rank, seed=seed)
            state = fold(empty_state(1, 1, rank, 3), log_features(k, p, s), v)
            log_den, value = readout(state, log_features(q, p, s))
            assert torch.isfinite(log_den).all() and torch.isfinite(value).all()
            out.append(log_den.double().exp())
        return torch.stack(out)  # [S, 1, 1, 4]

    seeds = range(12)
    err16 = (estimates(16, seeds) / exact - 1).abs().mean().item()
    err256 = (estimates(256, seeds) / exact - 1).abs().mean().item()
    assert err256 < 0.15, err256
    assert err256 < 0.5 * err16, (err16, err256)
    # unbiasedness: the mean of many cheap (rank-16) estimates converges to the truth
    mean16 = estimates(16, range(100, 196)).mean(0)
    assert ((mean16 / exact - 1).abs().max().item()) < 0.1


# --------------------------------------------------------------------------
# fold: order independence and stabilization
# --------------------------------------------------------------------------
@HYP
@given(
    n=st.integers(1, 24),
    m=st.sampled_from([16, 33]),
    dv=st.integers(1, 6),
    key_scale=st.sampled_from([0.3, 3.0, 30.0, 300.0]),
    cuts=st.lists(st.integers(1, 23), max_size=4),
    use_valid=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fold_order_independent(n, m, dv, key_scale, cuts, use_valid, seed):
    g = _gen(seed)
    d, B, H = 8, 2, 2
    s = d**-0.5
    p = draw_features(d, m, seed=seed, num_heads=H)
    k = torch.randn(B, H, n, d, generator=g) * key_scale
    v = torch.randn(B, H, n, dv, generator=g)
    lk = log_features(k, p, s)
    valid = torch.rand(B, H, n, generator=g) > 0.3 if use_valid else None

    whole = fold(empty_state(B, H, m, dv), lk, v, valid)
    one_by_one = empty_state(B, H, m, dv)
    for j in range(n):
        vj = None if valid is None else valid[:, :, j : j + 1]
        one_by_one = fold(one_by_one, lk[:, :, j : j + 1], v[:, :, j : j + 1], vj)
    bounds = [0] + sorted({c for c in cuts if c < n}) + [n]
    chunked = empty_state(B, H, m, dv)
    for a, b in zip(bounds[:-1], bounds[1:]):
        vj = None if valid is None else valid[:, :, a:b]
        chunked = fold(chunked, lk[:, :, a:b], v[:, :, a:b], vj)

    for st_ in (whole, one_by_one, chunked):
        for t in (st_.H, st_.z):
            assert not torch.isnan(t).any() and not torch.isinf(t).any()
        assert not torch.isnan(st_.c).any() and not torch.isposinf(st_.c).any()
    _assert_state_close(one_by_one, whole)
    _assert_state_close(chunked, whole)

    # the readout equals the float64 log-space oracle of the same estimator
    q = torch.randn(B, H, 3, d, generator=g)
    lq = log_features(q, p, s)
    log_den, value = readout(whole, lq)
    if valid is None:
        o_den, o_val = _oracle(lq, lk, v)
        torch.testing.assert_close(log_den.double(), o_den, rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(value.double(), o_val, rtol=1e-3, atol=1e-4)
    else:
        for b in range(B):
            for h in range(H):
                sel = valid[b, h]
                if not sel.any():
                    assert torch.isneginf(log_den[b, h]).all()
                    assert (value[b, h] == 0).all()
                    continue
                o_den, o_val = _oracle(
                    lq[b : b + 1, h : h + 1], lk[b : b + 1, h : h + 1, sel], v[b : b + 1, h : h + 1, sel]
                )
                torch.testing.assert_close(log_den[b, h].double(), o_den[0, 0], rtol=1e-5, atol=1e-3)
                torch.testing.assert_close(value[b, h].double(), o_val[0, 0], rtol=1e-3, atol=1e-4)


def test_fold_huge_exponents_no_overflow():
    """log psi values around +1000 overflow a naive exp; the log-offset keeps
    the state finite and the readout on the absolute scale."""
    g = _gen(5)
    B, H, n, m, dv = 1, 2, 10, 16, 4
    lk = 1000.0 + 30.0 * torch.randn(B, H, n, m, generator=g)
    v = torch.randn(B, H, n, dv, generator=g)
    assert torch.isinf(torch.exp(lk)).any()  # the naive state would be inf
    state = empty_state(B, H, m, dv)
    for j in range(0, n, 3):  # increasing and decreasing offsets across chunks
        state = fold(state, lk[:, :, j : j + 3], v[:, :, j : j + 3])
    assert torch.isfinite(state.H).all() and torch.isfinite(state.z).all()
    torch.testing.assert_close(state.c, lk.amax(dim=(2, 3)))
    assert (state.z.amax(-1) >= 1 - 1e-6).all()
    lq = torch.randn(B, H, 5, m, generator=g) - 1000.0  # tiny phi(q): underflows naively
    log_den, value = readout(state, lq)
    o_den, o_val = _oracle(lq, lk, v)
    torch.testing.assert_close(log_den.double(), o_den, rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(value.double(), o_val, rtol=1e-3, atol=1e-4)


def test_fold_large_norm_keys_underflow_handled():
    """Very large keys: every naive exp(log psi) underflows to 0 (the naive
    state would be empty); the log-offset keeps the information."""
    g = _gen(6)
    d, m, n = 8, 64, 12
    s = d**-0.5
    p = draw_features(d, m, seed=0, num_heads=1)
    k = torch.randn(1, 1, n, d, generator=g) * 100.0
    v = torch.randn(1, 1, n, 2, generator=g)
    lk = log_features(k, p, s)
    assert (torch.exp(lk) == 0).all()
    state = fold(empty_state(1, 1, m, 2), lk, v)
    assert torch.isfinite(state.c).all() and state.c.item() < -100
    lq = log_features(torch.randn(1, 1, 3, d, generator=g), p, s)
    log_den, value = readout(state, lq)
    assert torch.isfinite(log_den).all() and torch.isfinite(value).all()
    o_den, o_val = _oracle(lq, lk, v)
    torch.testing.assert_close(log_den.double(), o_den, rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(value.double(), o_val, rtol=1e-3, atol=1e-4)


# --------------------------------------------------------------------------
# empty state / validity mask
# --------------------------------------------------------------------------
def test_empty_state_readout():
    state = empty_state(2, 3, 16, 5, device="cpu")
    assert torch.isneginf(state.c).all() and state.is_empty().all()
    lq = torch.randn(2, 3, 4, 16)
    log_den, value = readout(state, lq)
    assert log_den.shape == (2, 3, 4) and value.shape == (2, 3, 4, 5)
    assert torch.isneginf(log_den).all()
    assert (value == 0).all() and not torch.isnan(value).any()
    # merging with exact logits is a no-op
    logits = torch.randn(2, 3, 4, 7)
    merged = torch.logsumexp(torch.cat([logits, log_den[..., None]], -1), -1)
    torch.testing.assert_close(merged, torch.logsumexp(logits, -1))


def test_partially_empty_batch_no_nan():
    g = _gen(2)
    state = empty_state(2, 2, 16, 3)
    valid = torch.tensor([[True, False], [False, False]]).unsqueeze(-1).expand(2, 2, 4)
    state = fold(state, torch.randn(2, 2, 4, 16, generator=g), torch.randn(2, 2, 4, 3, generator=g), valid)
    assert torch.isfinite(state.c[0, 0]) and torch.isneginf(state.c).sum() == 3
    log_den, value = readout(state, torch.randn(2, 2, 5, 16, generator=g))
    assert torch.isfinite(log_den[0, 0]).all() and torch.isneginf(log_den).sum() == 15
    assert not torch.isnan(value).any() and (value[1] == 0).all() and (value[0, 1] == 0).all()


def test_invalid_tokens_do_not_change_state():
    g = _gen(3)
    B, H, n, m, dv = 2, 2, 9, 16, 3
    base = fold(empty_state(B, H, m, dv), torch.randn(B, H, 4, m, generator=g), torch.randn(B, H, 4, dv, generator=g))
    lk = torch.randn(B, H, n, m, generator=g)
    v = torch.randn(B, H, n, dv, generator=g)
    valid = torch.rand(B, H, n, generator=g) > 0.5
    # garbage (NaN / inf / huge) in padded positions must not leak in
    lk_bad = lk.masked_fill(~valid[..., None], float("nan"))
    lk_bad[..., 0, :] = torch.where(valid[..., 0, None], lk[..., 0, :], 1e30)
    v_bad = v.masked_fill(~valid[..., None], float("inf"))
    got = fold(base.clone(), lk_bad, v_bad, valid)
    for b in range(B):
        for h in range(H):
            sel = valid[b, h]
            one = LowRankState(
                base.H[b : b + 1, h : h + 1].clone(), base.z[b : b + 1, h : h + 1].clone(), base.c[b : b + 1, h : h + 1].clone()
            )
            ref = fold(one, lk[b : b + 1, h : h + 1, sel], v[b : b + 1, h : h + 1, sel])
            torch.testing.assert_close(got.H[b, h], ref.H[0, 0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.z[b, h], ref.z[0, 0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.c[b, h], ref.c[0, 0])
    # all-invalid: nothing changes, empty stays empty
    none = torch.zeros(B, H, n, dtype=torch.bool)
    same = fold(base.clone(), lk_bad, v_bad, none)
    _assert_state_close(same, base, rtol=0, atol=0)
    still_empty = fold(empty_state(B, H, m, dv), lk_bad, v_bad, none)
    assert still_empty.is_empty().all() and (still_empty.H == 0).all() and (still_empty.z == 0).all()


def test_state_helpers():
    state = empty_state(3, 2, 8, 4)
    assert state.nbytes() == (3 * 2 * 8 * 4 + 3 * 2 * 8 + 3 * 2) * 4
    state = fold(state, torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 4))
    sel = state.index_select(torch.tensor([2, 0]))
    torch.testing.assert_close(sel.H, state.H[[2, 0]])
    torch.testing.assert_close(sel.c, state.c[[2, 0]])
    with pytest.raises(ValueError):
        fold(state, torch.randn(3, 2, 5, 7), torch.randn(3, 2, 5, 4))


# --------------------------------------------------------------------------
# merge with exact attention on one shared scale
# --------------------------------------------------------------------------
@pytest.mark.parametrize("n_kept", [0, 5])
def test_merge_reproduces_softmax_attention(n_kept):
    g = _gen(4)
    B, Hkv, G, T, n, d, dv, rank = 1, 2, 2, 3, 12, 8, 4, 4096
    s = d**-0.5
    q = 0.5 * torch.randn(B, Hkv, G * T, d, generator=g)  # query heads of a group x length, flattened
    k = 0.5 * torch.randn(B, Hkv, n, d, generator=g)
    v = torch.randn(B, Hkv, n, dv, generator=g)
    logits = s * q @ k.transpose(-1, -2)
    exact_out = torch.softmax(logits, -1) @ v

    p = draw_features(d, rank, seed=7, num_heads=Hkv)
    state = fold(empty_state(B, Hkv, rank, dv), log_features(k[:, :, n_kept:], p, s), v[:, :, n_kept:])
    log_den, value = readout(state, log_features(q, p, s))

    # one normalizer over [exact logits of kept tokens ; log_den of the state]
    all_logits = torch.cat([logits[..., :n_kept], log_den[..., None]], -1)
    probs = torch.softmax(all_logits, -1)
    out = probs[..., :n_kept] @ v[:, :, :n_kept] + probs[..., -1:] * value
    torch.testing.assert_close(out, exact_out, rtol=0, atol=0.05)
    # the denominator itself lands on the absolute logit scale
    exact_lse = torch.logsumexp(logits, -1)
    torch.testing.assert_close(torch.logsumexp(all_logits, -1), exact_lse, rtol=0, atol=0.1)


# --------------------------------------------------------------------------
# Triton kernel vs reference (TRITON_INTERPRET=1)
# --------------------------------------------------------------------------
TRITON_SHAPES = [
    # B, H, n, m, dv, use_valid
    (1, 1, 1, 16, 16, False),
    (2, 3, 37, 20, 5, True),  # ragged n, m and dv not powers of two
    (1, 2, 70, 130, 80, True),  # several m- and dv-blocks
    (2, 1, 5, 16, 3, False),
]


def _random_fold_inputs(B, H, n, m, dv, use_valid, seed, scale=1.0, shift=0.0):
    g = _gen(seed)
    lk = scale * torch.randn(B, H, n, m, generator=g) + shift
    v = torch.randn(B, H, n, dv, generator=g)
    valid = (torch.rand(B, H, n, generator=g) > 0.3) if use_valid else None
    if valid is not None:
        valid[0, 0] = False  # one (b, h) with no valid token at all
        lk = lk.masked_fill(~valid[..., None], float("nan"))
    return lk, v, valid


@pytest.mark.parametrize("shape", TRITON_SHAPES)
def test_triton_fold_matches_reference(shape, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("KVSTACK_KERNELS", "triton")

    def _no_reference(*a, **k):
        raise AssertionError("reference path used although KVSTACK_KERNELS=triton")

    B, H, n, m, dv, use_valid = shape
    ref = empty_state(B, H, m, dv)
    tri = empty_state(B, H, m, dv)
    # three folds: from empty, then a chunk with larger exponents, then smaller
    for i, (scale, shift) in enumerate([(1.0, 0.0), (3.0, 20.0), (1.0, -50.0)]):
        lk, v, valid = _random_fold_inputs(B, H, n, m, dv, use_valid, seed=10 * i + n, scale=scale, shift=shift)
        ref = fold_reference(ref, lk, v, valid)
        with monkeypatch.context() as mp:
            mp.setattr(lr, "fold_reference", _no_reference)
            tri = fold(tri, lk, v, valid)
        torch.testing.assert_close(tri.c, ref.c, rtol=0, atol=0)
        torch.testing.assert_close(tri.z, ref.z, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tri.H, ref.H, rtol=1e-5, atol=1e-6)
    lq = torch.randn(B, H, 3, m)
    for a, b in zip(readout(tri, lq), readout(ref, lq)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_triton_fold_noncontiguous_and_half_values(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("KVSTACK_KERNELS", "triton")
    g = _gen(11)
    B, H, n, m, dv = 2, 2, 19, 24, 6
    lk = torch.randn(B, n, H, m, generator=g).transpose(1, 2)  # non-contiguous view
    v = torch.randn(B, H, dv, n, generator=g).transpose(-1, -2).to(torch.float16)
    valid = (torch.rand(B, H, n, generator=g) > 0.2)
    base = fold_reference(empty_state(B, H, m, dv), torch.randn(B, H, 3, m, generator=g), torch.randn(B, H, 3, dv, generator=g))
    ref = fold_reference(base.clone(), lk, v, valid)
    tri = lr.fold_triton(base.clone(), lk, v, valid)
    _assert_state_close(tri, ref)


def test_torch_mode_uses_reference(monkeypatch):
    monkeypatch.setenv("KVSTACK_KERNELS", "torch")

    def _no_triton(*a, **k):
        raise AssertionError("triton path used although KVSTACK_KERNELS=torch")

    monkeypatch.setattr(lr, "fold_triton", _no_triton)
    state = fold(empty_state(1, 1, 16, 2), torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 2))
    assert torch.isfinite(state.c).all()
