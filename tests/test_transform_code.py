"""Numerics of transform coding (``kvstack/kernels/transform_code.py``): the Gaussian Lloyd-Max levels, the bit
allocation, code packing, encode/decode against a brute-force float64 reference, the fitted levels and the weight
basis, the prompt-axes reflectors. The tier in the stack: tests/test_transform_tier.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstack.kernels.transform_code import (
    BLOCK, ComponentCode, _pack, _unpack, allocate_widths, fit_token_scale, gaussian_lloyd, lloyd_levels,
    own_axes_reflectors, reflector_product, scale_tokens, transform_reference, uniform_levels, weight_basis,
)

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_gaussian_levels_are_the_known_lloyd_max_quantizers():
    # Max (1960): 1 bit +-0.7979 (error 0.3634), 2 bits +-0.4528 / +-1.510 (0.1175), 3 bits error 0.03455
    levels, mse = gaussian_lloyd(1)
    assert levels == pytest.approx((-0.7979, 0.7979), abs=1e-4) and mse == pytest.approx(0.3634, abs=1e-4)
    levels, mse = gaussian_lloyd(2)
    assert levels == pytest.approx((-1.5104, -0.4528, 0.4528, 1.5104), abs=1e-4)
    assert mse == pytest.approx(0.1175, abs=1e-4)
    assert gaussian_lloyd(3)[1] == pytest.approx(0.03455, abs=1e-4)
    assert gaussian_lloyd(0) == ((0.0,), 1.0)
    errors = [gaussian_lloyd(b)[1] for b in range(9)]
    assert all(a > b for a, b in zip(errors, errors[1:]))


@FAST
@given(
    blocks=st.integers(1, 12), bits=st.integers(0, 8), seed=st.integers(0, 10_000), max_bits=st.integers(1, 8),
)
def test_allocation_spends_the_budget_in_non_increasing_widths(blocks, bits, seed, max_bits):
    c = blocks * BLOCK
    var = torch.rand(c, generator=torch.Generator().manual_seed(seed)) ** 4
    total = min(bits, max_bits) * c
    order, widths = allocate_widths(var, total, max_bits=max_bits)
    assert sorted(order.tolist()) == list(range(c))
    assert torch.all(var[order][:-1] >= var[order][1:])  # by decreasing variance
    assert list(widths) == sorted(widths, reverse=True) and max(widths) <= max_bits
    assert sum(widths) * BLOCK == total  # every bit spent: nothing blocks it below max_bits per component


def test_allocation_gives_more_bits_to_more_variance_and_none_to_empty_components():
    var = torch.tensor([100.0] * 8 + [1.0] * 8 + [0.0] * 16)
    _, widths = allocate_widths(var, 2 * 32)
    assert widths[0] > widths[1] > 0 and widths[2:] == (0, 0)
    # each bit quarters a component's error (roughly): 100x the variance is worth about log4(100) = 3.3 more bits
    assert 3 <= widths[0] - widths[1] <= 4


def test_allocation_respects_the_level_limit():
    var = torch.tensor([1e6] * 8 + [1.0] * 24)
    _, free = allocate_widths(var, 3 * 32)
    assert free[0] == 8  # unbounded: the dominant block takes the widest codes
    limit = uniform_levels(32, 3) * 2
    _, widths = allocate_widths(var, 3 * 32, max_levels=limit)
    assert sum(BLOCK * 2**w for w in widths) <= limit < sum(BLOCK * 2**w for w in free)


def test_allocation_spends_every_bit_whenever_the_uniform_allocation_fits_the_level_limit():
    var = torch.logspace(6, -6, 48) ** 2
    for bits in (1, 2, 3, 4):
        _, widths = allocate_widths(var, bits * 48, max_levels=uniform_levels(48, bits))
        assert sum(widths) * BLOCK == bits * 48 and widths == (bits,) * 6  # only the uniform one fits
        _, widths = allocate_widths(var, bits * 48, max_levels=2 * uniform_levels(48, bits))
        assert sum(widths) * BLOCK == bits * 48 and sum(BLOCK * 2**w for w in widths) <= 2 * uniform_levels(48, bits)


@pytest.mark.parametrize("c, total, why", [(12, 24, "multiple of 8"), (16, 16 * 9, "is not in"), (16, 12, "multiple")])
def test_allocation_refuses_what_it_cannot_lay_out(c, total, why):
    with pytest.raises(ValueError, match=why):
        allocate_widths(torch.ones(c), total)


@FAST
@given(w=st.integers(1, 8), n=st.integers(1, 6), rows=st.integers(1, 4), seed=st.integers(0, 1000))
def test_codes_pack_into_w_bytes_per_eight_and_back(w, n, rows, seed):
    codes = torch.randint(0, 2**w, (rows, n * BLOCK), generator=torch.Generator().manual_seed(seed))
    packed = _pack(codes, w)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, n * w)
    unpacked = _unpack(packed, w)
    assert unpacked.dtype == (torch.int32 if w <= 4 else torch.int64) and torch.equal(unpacked.long(), codes)


def test_packing_is_little_endian_within_a_block():
    codes = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1]])  # 3 bits: code 0 in bit 0, code 7 in bits 21-23
    assert _pack(codes, 3).tolist() == [[1, 0, 0b00100000]]


def _samples(n, c, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(1, -2, c)  # very unequal variances, and heavy tails in some components
    y = torch.randn(n, c, generator=g) * scale + torch.randn(c, generator=g) * 3
    y[:, : c // 4] += torch.distributions.Laplace(0.0, 1.0).sample((n, c // 4)) * scale[: c // 4]
    return y


@FAST
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([1, 2, 3, 4]), c=st.sampled_from([8, 16, 48]))
def test_decode_of_encode_is_the_nearest_level_of_every_component(seed, bits, c):
    y = _samples(300, c, seed)
    code = ComponentCode.fit(y, bits * c, 2 * uniform_levels(c, bits))
    assert code.nbytes_per_vector * 8 == bits * c
    basis = torch.linalg.qr(torch.randn(c, c, generator=torch.Generator().manual_seed(seed)))[0]
    x = y @ basis.T  # so that x @ basis == y
    packed = code.encode(x @ basis)
    assert packed.shape == (300, bits * c // 8) and packed.dtype == torch.uint8
    decoded = code.decode(packed) @ basis.T
    reference = transform_reference(x, basis, code)
    # float32 against float64: a value within rounding of a midpoint may take the other neighbour
    close = (decoded.double() - reference).abs().amax(-1) < 1e-3 * (1 + reference.abs().amax(-1))
    assert close.float().mean() > 0.99


@FAST
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([1, 3, 5, 8]), c=st.sampled_from([16, 48]))
def test_reconstruct_is_the_decoded_components_times_the_transposed_basis(seed, bits, c):
    y = _samples(200, c, seed)
    code = ComponentCode.fit(y, bits * c, 2 * uniform_levels(c, bits))
    basis = torch.linalg.qr(torch.randn(c, c, generator=torch.Generator().manual_seed(seed)))[0]
    packed = code.encode(y)
    expected = code.decode(packed).double() @ basis.double().T
    scale = 1 + expected.abs().amax(-1, keepdim=True)
    full = code.reconstruct(packed, basis)
    assert full.dtype == torch.float32 and ((full.double() - expected).abs() / scale).max() < 1e-5
    half = code.reconstruct(packed, basis, torch.bfloat16)  # a bf16 model's keys: the product in bf16
    assert half.dtype == torch.bfloat16
    assert ((half.double() - expected).abs() / scale).max() < 3e-2
    assert ((half.double() - expected).abs() / scale).max() > 1e-5  # it did run in bf16


def test_fitted_levels_beat_the_gaussian_levels_they_start_from_on_skewed_data():
    g = torch.Generator().manual_seed(0)
    y = torch.distributions.Exponential(1.0).sample((4000, 8))  # skewed: Gaussian levels waste half their range
    fitted = ComponentCode.fit(y, 3 * 8, uniform_levels(8, 3))
    gauss = ComponentCode.fit(y, 3 * 8, uniform_levels(8, 3), iters=0)
    err = lambda code: float(((code.decode(code.encode(y)) - y) ** 2).mean())  # noqa: E731
    assert err(fitted) < 0.6 * err(gauss)
    del g


def test_lloyd_never_increases_the_squared_error():
    y = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)) ** 3
    init = torch.tensor([[-1.0, 0.0, 1.0, 2.0]] * 3)

    def sse(c):
        idx = torch.searchsorted((c[:, 1:] + c[:, :-1]).contiguous() / 2, y)
        return float(((y - c.gather(1, idx)) ** 2).sum())

    errors = [sse(lloyd_levels(y, init, iters)) for iters in range(6)]
    assert all(a >= b - 1e-6 for a, b in zip(errors, errors[1:]))


def test_a_coder_holds_a_fixed_number_of_levels_and_zero_width_components_decode_to_their_mean():
    y = torch.cat([torch.randn(200, 8) * 10, torch.randn(200, 8) * 1e-4 + 5.0], 1)
    code = ComponentCode.fit(y, 8 * 4, 1000)
    assert code.levels.numel() == 1000 and code.widths == (4, 0)
    tensors = code.tensors()
    assert tensors["order"].dtype == torch.int16 and tensors["offsets"].dtype == torch.int32
    out = code.decode(code.encode(y))
    assert torch.allclose(out[:, 8:], y[:, 8:].mean(0).expand(200, -1), atol=1e-3)


def test_constant_components_are_exact():
    y = torch.full((50, 16), 2.5)
    y[:, 3] = -7.0
    code = ComponentCode.fit(y, 2 * 16, uniform_levels(16, 2))
    assert torch.equal(code.decode(code.encode(y)), y)


def test_the_weight_basis_is_orthonormal_and_decorrelates_outputs_of_white_inputs():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 40, generator=g) @ torch.diag(torch.logspace(0, -2, 40))
    u = weight_basis(weight)
    assert torch.allclose(u.T @ u, torch.eye(24), atol=1e-5)
    x = torch.randn(20000, 40, generator=g) @ weight.T
    cov = torch.cov((x @ u).T)
    off = cov - torch.diag(cov.diagonal())
    assert off.abs().max() < 0.05 * cov.diagonal().max()
    assert torch.all(cov.diagonal()[:-1] >= 0.9 * cov.diagonal()[1:])  # most energetic first
    tall = weight_basis(torch.randn(24, 8, generator=g))  # more outputs than inputs: completed to a square basis
    assert torch.allclose(tall.T @ tall, torch.eye(24), atol=1e-5)


# ------------------------------------------------------------------------------------------------ gain-shape
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]))
@settings(max_examples=20, deadline=None)
def test_scale_tokens_is_an_exact_decomposition_with_the_rounded_scale(seed, dtype):
    """``mean + s rms z`` gives every vector back (to float32 rounding) whatever format ``s`` is rounded to, each ``z``
    has a root mean square of about 1 (the rounding's relative step), and a vector equal to the mean gets the smallest
    normal scale and ``z = 0`` instead of a division by zero."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(64, 16, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 2) + 3.0
    mean, rms = fit_token_scale(y)
    y[0] = mean
    z, s = scale_tokens(y, mean, rms, dtype)
    assert s.dtype == dtype and s.shape == (64,)
    back = mean + (s.float() * rms)[:, None] * z
    assert torch.allclose(back, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))
    step = max(torch.finfo(dtype).eps, 1e-5)  # the rounding of s, or float32 arithmetic
    assert float(s[0].float()) == torch.finfo(dtype).smallest_normal and float(z[0].abs().max()) == 0.0
    assert torch.allclose(z[1:].pow(2).mean(-1).sqrt(), torch.ones(63), rtol=step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_scale_fitted_on_one_token_codes_it_and_the_next_ones(dtype):
    """A tier whose first assignment is one token fits the gain-shape scale on it: no spread to measure against, so
    scales are relative to 1, that token's ``z`` is 0 (not 0 / 0, which coded NaN keys when tokens were demoted one at
    a time), and later tokens decompose exactly."""
    one = torch.randn(1, 16, generator=torch.Generator().manual_seed(0)) + 2.0
    mean, rms = fit_token_scale(one)
    assert float(rms) == 1.0 and torch.equal(mean, one[0])
    z, s = scale_tokens(one, mean, rms, dtype)
    assert float(z.abs().max()) == 0.0
    later = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    z, s = scale_tokens(later, mean, rms, dtype)
    assert bool(torch.isfinite(z).all())
    assert torch.allclose(mean + (s.float() * rms)[:, None] * z, later, rtol=1e-5, atol=1e-5)


@FAST
@given(c=st.sampled_from([8, 16, 32]), frac=st.floats(0, 1), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_reflectors_in_any_precision_give_an_orthogonal_basis_led_by_the_samples_principal_axes(c, frac, seed, dtype):
    """``U Q`` is orthonormal whatever precision the reflectors are stored in (tau is recomputed from them), and its
    first r columns are the samples' r leading principal axes up to sign, as close as that precision allows; the
    reflectors have a unit diagonal and zeros above it (what ``prompt_axes`` holds: r x C numbers)."""
    gen = torch.Generator().manual_seed(seed)
    r = round(frac * c)
    basis = torch.linalg.qr(torch.randn(c, c, generator=gen, dtype=torch.float64))[0].float()
    spread = torch.logspace(1, -1, c, dtype=torch.float64)  # distinct variances: the axes are well defined
    mix = torch.linalg.qr(torch.randn(c, c, generator=gen, dtype=torch.float64))[0]
    x = ((torch.randn(4 * c, c, generator=gen, dtype=torch.float64) * spread) @ mix.T).float()
    reflectors = own_axes_reflectors(x @ basis, r)
    assert reflectors.shape == (c, r)
    assert torch.equal(torch.triu(reflectors, 1), torch.zeros_like(reflectors))
    assert torch.equal(reflectors.diagonal(), torch.ones(r))
    led = (basis @ reflector_product(reflectors.to(dtype))).double()
    assert torch.allclose(led.T @ led, torch.eye(c, dtype=torch.float64), atol=1e-5)
    centred = x.double() - x.double().mean(0)
    axes = torch.linalg.eigh(centred.T @ centred)[1].flip(-1)[:, :r]
    tolerance = 1e-4 if dtype == torch.float32 else 0.02
    assert bool(((led[:, :r] * axes).sum(0).abs() > 1 - tolerance).all())


def test_no_reflectors_leave_the_basis_as_it_is():
    assert torch.equal(reflector_product(torch.zeros(16, 0)), torch.eye(16))
