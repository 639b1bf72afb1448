"""Kernel primitives of the quantization options: Walsh-Hadamard and random rotations (kvstack/kernels/rotation.py)
and RoPE forwards/backwards (kvstack/kernels/rope.py), each against its float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstack.kernels.rope import apply_rope, rope_angles, rope_reference
from kvstack.kernels.rotation import (
    DENSE_MAX,
    fwht,
    fwht_butterfly,
    fwht_reference,
    hadamard_matrix,
    is_power_of_two,
    random_orthogonal,
)

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------- Walsh-Hadamard
def test_hadamard_matrix_is_sylvester_symmetric_and_orthogonal():
    h = hadamard_matrix(4)
    assert torch.equal(h * 2, torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]).double())
    for n in (1, 2, 8, 64):
        h = hadamard_matrix(n)
        assert torch.equal(h, h.T)
        torch.testing.assert_close(h @ h, torch.eye(n, dtype=torch.float64))


@FAST
@given(log_n=st.integers(0, 11), rows=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**16))
def test_fwht_matches_the_matrix_and_is_its_own_inverse(log_n, rows, dtype, seed):
    n = 1 << log_n
    x = torch.randn(2, rows, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    ref = fwht_reference(x)
    tol = dict(rtol=0, atol=(1e-12 if dtype == torch.float64 else 2e-5) * max(1.0, log_n))
    for fn in (fwht, fwht_butterfly):
        y = fn(x)
        assert y.dtype == dtype and y.shape == x.shape
        torch.testing.assert_close(y.double(), ref, **tol)
        torch.testing.assert_close(fn(y).double(), x.double(), **tol)  # involution
        torch.testing.assert_close(y.double().norm(dim=-1), x.double().norm(dim=-1), **tol)  # orthogonal


def test_fwht_takes_butterflies_beyond_the_dense_size():
    x = torch.randn(3, 2 * DENSE_MAX, dtype=torch.float64)
    torch.testing.assert_close(fwht(x), fwht_butterfly(x), rtol=0, atol=1e-12)


def test_an_outlier_channel_is_spread_over_every_channel():
    x = torch.zeros(1, 64)
    x[0, 5] = 8.0
    assert torch.allclose(fwht(x).abs(), torch.full((1, 64), 1.0))


@pytest.mark.parametrize("n", [0, 3, 6, 12, 80])
def test_fwht_refuses_lengths_that_are_not_powers_of_two(n):
    assert not is_power_of_two(n)
    with pytest.raises(ValueError, match=f"power-of-two length; got {n}"):
        fwht(torch.zeros(2, n))


@pytest.mark.parametrize("n", [1, 8, 12, 80])
def test_random_orthogonal_is_orthogonal_and_seeded(n):
    q = random_orthogonal(n, 3)
    assert q.dtype == torch.float64 and q.shape == (n, n)
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64))
    assert torch.equal(q, random_orthogonal(n, 3))
    if n > 1:
        assert not torch.equal(q, random_orthogonal(n, 4))
    x = torch.randn(5, n, dtype=torch.float64)
    torch.testing.assert_close((x @ q) @ q.T, x)


# ------------------------------------------------------------------------------------------------------ RoPE
def _inv_freq(rope_dim, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2).float() / rope_dim))


@FAST
@given(
    head_dim=st.sampled_from([8, 16, 64]),
    partial=st.sampled_from([1.0, 0.5, 0.25]),
    heads_positions=st.booleans(),
    max_pos=st.sampled_from([16, 4096, 100_000]),
    seed=st.integers(0, 2**16),
)
def test_rope_matches_the_pairwise_reference_and_inverts(head_dim, partial, heads_positions, max_pos, seed):
    g = torch.Generator().manual_seed(seed)
    rope_dim = int(head_dim * partial)
    inv_freq = _inv_freq(rope_dim)
    x = torch.randn(2, 3, 7, head_dim, generator=g, dtype=torch.float64)
    positions = torch.randint(0, max_pos, (2, 3 if heads_positions else 1, 7), generator=g, dtype=torch.int32)
    cos, sin = rope_angles(positions, inv_freq)
    assert cos.shape == (2, positions.shape[1], 7, rope_dim) and cos.dtype == torch.float32
    for inverse in (False, True):
        y = apply_rope(x, cos, sin, inverse=inverse)
        torch.testing.assert_close(y, rope_reference(x, positions, inv_freq, inverse), rtol=0, atol=1e-6)
        assert torch.equal(y[..., rope_dim:], x[..., rope_dim:])  # partial rotary: the rest passes through
    back = apply_rope(apply_rope(x, cos, sin), cos, sin, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-6)  # cos^2 + sin^2 of the float32 tables


def test_rope_is_what_transformers_applies():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 9, 16, generator=g)
    positions = torch.arange(100, 109, dtype=torch.int32)
    cos, sin = rope_angles(positions, _inv_freq(16))
    _, ref = apply_rotary_pos_emb(k, k, cos[None], sin[None])
    torch.testing.assert_close(apply_rope(k, cos, sin), ref, rtol=0, atol=0)


def test_rope_refuses_a_width_beyond_the_head():
    cos, sin = rope_angles(torch.arange(3), _inv_freq(16))
    with pytest.raises(ValueError, match="rotary width 16 must be even and at most the head_dim 8"):
        apply_rope(torch.zeros(1, 1, 3, 8), cos, sin)
