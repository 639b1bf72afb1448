"""Tests for kvstack.kernels.quant_pack (KIVI-style group quantization + packing).

Error tolerance used throughout: per element
    |x - dequant(quant(x))| <= scale / 2 + 4 * eps(dtype) * gmax
where gmax = max |x| over the element's group. The float term covers float32
arithmetic (a few eps32 * gmax) and, for fp16/bf16, the final cast of the
dequantized value (half an ulp of |x^|).
"""

import os

# Must happen before triton is imported anywhere, so Triton kernels run in the CPU
# interpreter (the kernel module also JITs lazily, reading the flag at first use).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvstack.kernels import dispatch  # noqa: E402
from kvstack.kernels import quant_pack as qp  # noqa: E402
from kvstack.kernels.quant_pack import (  # noqa: E402
    PACK_FACTOR,
    PACK_UNIT,
    QuantizedGroups,
    dequantize,
    dequantize_reference,
    pack_codes,
    quantize,
    quantize_reference,
    unpack_codes,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [8, 16, 32, 64, 128]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False
TRITON_RUNNABLE = HAVE_TRITON and (
    os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
)
needs_triton = pytest.mark.skipif(
    not TRITON_RUNNABLE, reason="needs triton with TRITON_INTERPRET=1 or a CUDA device"
)


@pytest.fixture(autouse=True)
def _default_kernels(monkeypatch):
    # Tests pick the path explicitly; don't inherit KVSTACK_KERNELS from the shell.
    monkeypatch.delenv("KVSTACK_KERNELS", raising=False)


# --------------------------------------------------------------------------- helpers
def _expand(t: torch.Tensor, q: QuantizedGroups) -> torch.Tensor:
    """Broadcast a per-group tensor [.., T/G, D] or [.., T, D/G] to [B, H, T, D]."""
    return t.repeat_interleave(q.group_size, dim=2 if q.axis == "token" else 3)


def _group_absmax(x: torch.Tensor, q: QuantizedGroups) -> torch.Tensor:
    B, H, T, D = x.shape
    G = q.group_size
    a = x.float().abs()
    if q.axis == "token":
        m = a.reshape(B, H, T // G, G, D).amax(dim=3)
    else:
        m = a.reshape(B, H, T, D // G, G).amax(dim=4)
    return _expand(m, q)


def _assert_error_bound(x: torch.Tensor, q: QuantizedGroups) -> None:
    y = dequantize(q)
    assert y.dtype == x.dtype and y.shape == x.shape
    err = (y.float() - x.float()).abs()
    s = _expand(q.scale.float(), q)
    tol = 4 * torch.finfo(x.dtype).eps * _group_absmax(x, q)
    bad = err > s / 2 + tol
    assert not bad.any(), (
        f"max excess {(err - s / 2 - tol).max().item()} at {bad.nonzero()[:3].tolist()}"
    )


def _expected_shapes(shape, bits, G, axis):
    B, H, T, D = shape
    codes, nbytes = PACK_UNIT[bits]
    if axis == "token":
        return (B, H, T * nbytes // codes, D), (B, H, T // G, D)
    return (B, H, T, D * nbytes // codes), (B, H, T, D // G)


def _assert_same(a: QuantizedGroups, b: QuantizedGroups) -> None:
    assert a.packed.dtype == b.packed.dtype == torch.uint8
    assert torch.equal(a.packed, b.packed), "packed codes differ"
    assert a.scale.dtype == b.scale.dtype and torch.equal(a.scale, b.scale), "scale differs"
    assert a.zero.dtype == b.zero.dtype and torch.equal(a.zero, b.zero), "zero differs"
    assert (a.bits, a.group_size, a.axis, a.shape) == (b.bits, b.group_size, b.axis, b.shape)


# --------------------------------------------------------------------------- packing
@FAST
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    groups=st.integers(0, 6),
    pos=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_roundtrip(bits, lead, groups, pos, seed):
    pf, nbytes = PACK_UNIT[bits]
    shape = list(lead)
    dim = min(pos, len(shape))
    shape.insert(dim, groups * pf)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits, dim=dim)
    expect = list(shape)
    expect[dim] = expect[dim] * nbytes // pf
    assert packed.dtype == torch.uint8 and list(packed.shape) == expect
    assert torch.equal(unpack_codes(packed, bits, dim=dim), codes)
    # negative dim addresses the same axis
    assert torch.equal(pack_codes(codes, bits, dim=dim - len(shape)), packed)


def test_pack_bit_layout():
    # code i of a byte goes to bits [i*b, (i+1)*b)
    c = torch.tensor([1, 2, 3, 0], dtype=torch.uint8)
    assert pack_codes(c, 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack_codes(torch.tensor([5, 12], dtype=torch.uint8), 4).tolist() == [5 | 12 << 4]
    assert pack_codes(torch.tensor([7, 255], dtype=torch.uint8), 8).tolist() == [7, 255]
    # 3 bits: 8 codes form a 24-bit little-endian word, code i in bits [3i, 3i + 3)
    codes = [1, 2, 3, 4, 5, 6, 7, 0]
    word = sum(c << (3 * i) for i, c in enumerate(codes))
    assert pack_codes(torch.tensor(codes, dtype=torch.uint8), 3).tolist() == [word & 255, word >> 8 & 255, word >> 16]


def test_pack_validation():
    with pytest.raises(ValueError, match="bits=5"):
        pack_codes(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="not divisible by the pack factor 8 for bits=3"):
        pack_codes(torch.zeros(12, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="not a multiple of 3 bytes"):
        unpack_codes(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="not divisible by the pack factor 4"):
        pack_codes(torch.zeros(6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="< 2\\*\\*bits"):
        pack_codes(torch.full((4,), 4, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(torch.zeros(4, dtype=torch.int64), 2)


# --------------------------------------------------------------------------- quantize
@st.composite
def quant_cases(draw):
    bits = draw(st.sampled_from([2, 4, 8]))
    axis = draw(st.sampled_from(["token", "channel"]))
    dtype = draw(st.sampled_from(DTYPES))
    pf = PACK_FACTOR[bits]
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    D = draw(st.sampled_from(HEAD_DIMS))
    if axis == "token":
        G = draw(st.sampled_from([g for g in (1, 2, 3, 4, 8, 16, 32) if g % pf == 0]))
        T = G * draw(st.integers(1, 4))
    else:
        G = draw(st.sampled_from([g for g in (1, 2, 4, 8, 16, 32, 64, 128) if g % pf == 0 and D % g == 0]))
        T = draw(st.integers(1, 9))
    mag = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -30.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return (B, H, T, D), bits, G, axis, dtype, mag, offset, seed


@FAST
@given(case=quant_cases())
def test_quantize_error_bound_and_layout(case):
    shape, bits, G, axis, dtype, mag, offset, seed = case
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * mag + offset).to(dtype)
    q = quantize(x, bits, G, axis)  # CPU + auto -> torch reference
    pshape, sshape = _expected_shapes(shape, bits, G, axis)
    assert tuple(q.packed.shape) == pshape and q.packed.dtype == torch.uint8
    assert tuple(q.scale.shape) == sshape and tuple(q.zero.shape) == sshape
    assert q.scale.dtype == dtype and q.zero.dtype == dtype
    assert q.shape == shape and (q.bits, q.group_size, q.axis) == (bits, G, axis)
    # zero point is the exact group minimum
    xf = x.float()
    if axis == "token":
        mn = xf.reshape(shape[0], shape[1], shape[2] // G, G, shape[3]).amin(3)
    else:
        mn = xf.reshape(shape[0], shape[1], shape[2], shape[3] // G, G).amin(4)
    assert torch.equal(q.zero.float(), mn)
    assert (q.scale.float() >= 0).all()
    _assert_error_bound(x, q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_constant_groups_dequantize_exactly(dtype, axis, bits):
    # each group constant, different constant per group
    B, H, T, D, G = 1, 2, 16, 16, 8
    if axis == "token":
        vals = torch.arange(B * H * (T // G) * D, dtype=torch.float32).reshape(B, H, T // G, 1, D)
        x = (vals * 0.37 - 3).expand(B, H, T // G, G, D).reshape(B, H, T, D)
    else:
        vals = torch.arange(B * H * T * (D // G), dtype=torch.float32).reshape(B, H, T, D // G, 1)
        x = (vals * 0.37 - 3).expand(B, H, T, D // G, G).reshape(B, H, T, D)
    x = x.to(dtype).contiguous()
    q = quantize(x, bits, G, axis)
    assert torch.all(q.scale == 0)
    assert torch.equal(dequantize(q), x)
    assert torch.all(unpack_codes(q.packed, bits, dim=q.packed_dim) == 0)


@pytest.mark.parametrize(
    "dtype,big", [(torch.float32, 1e30), (torch.float16, 65504.0), (torch.float16, 6e4), (torch.bfloat16, 1e38)]
)
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", [2, 8])
def test_large_magnitudes(dtype, big, axis, bits):
    g = torch.Generator().manual_seed(0)
    x = ((torch.rand(1, 2, 16, 16, generator=g) * 2 - 1) * big).to(dtype)
    x[..., 0, 0] = big  # full +-max range inside groups (fp16: mx - mn overflows fp16)
    x[..., 1, 0] = -big
    x[..., 0, 1] = big
    x[..., 0, 2] = -big
    q = quantize(x, bits, 16, axis)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.zero).all()
    y = dequantize(q)
    assert torch.isfinite(y).all()
    _assert_error_bound(x, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_range_overflowing_float32_raises(dtype):
    x = torch.zeros(1, 1, 8, 8, dtype=dtype)
    x[0, 0, 0, 0] = 3e38
    x[0, 0, 1, 0] = -3e38
    with pytest.raises(ValueError, match="overflows float32"):
        quantize(x, 2, 8, "token")


@pytest.mark.parametrize(
    "dtype,unit", [(torch.float16, 2.0**-24), (torch.bfloat16, 2.0**-133), (torch.float32, 2.0**-149)]
)
def test_subnormal_ranges_are_exact(dtype, unit):
    # range > 0 but (mx - mn) / 255 underflows: scale becomes the smallest subnormal
    x = torch.zeros(1, 1, 1, 8, dtype=torch.float32)
    x[..., 1], x[..., 2], x[..., 5] = unit, 2 * unit, 3 * unit
    x = x.to(dtype)
    q = quantize(x, 8, 8, "channel")
    assert q.scale.float().item() > 0
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_raises(bad, dtype):
    x = torch.randn(1, 2, 8, 16).to(dtype)
    x[0, 1, 3, 5] = bad
    for fn in (quantize, quantize_reference):
        with pytest.raises(ValueError, match="cannot quantize non-finite values: 1 NaN/Inf found in"):
            fn(x, 4, 8, "token")


@pytest.mark.parametrize(
    "shape,bits,G,axis,match",
    [
        ((1, 1, 8, 8), 5, 8, "token", r"bits=5 .*allowed: \[2, 3, 4, 8\]"),
        ((1, 1, 8, 8), 3, 4, "token", r"group_size=4 is not a multiple of the pack factor 8 .*8 per 3 bytes"),
        ((1, 1, 8, 8), True, 8, "token", r"bits=True"),
        ((1, 1, 8, 8), 2, 6, "token", r"group_size=6 is not a multiple of the pack factor 4"),
        ((1, 1, 8, 8), 4, 3, "channel", r"group_size=3 is not a multiple of the pack factor 2"),
        ((1, 1, 8, 8), 2, 16, "channel", r"does not divide the head_dim 8"),
        ((1, 1, 5, 8), 8, 4, "token", r"does not divide the token count 5"),
        ((1, 1, 8, 8), 2, 0, "token", r"group_size=0 must be a positive int"),
        ((1, 1, 8, 8), 2, 8, "tokens", r"axis='tokens' .*allowed"),
        ((1, 8, 8), 2, 8, "token", r"shape \[B, H, T, D\]"),
    ],
)
def test_bad_arguments(shape, bits, G, axis, match):
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=match):
        quantize(x, bits, G, axis)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype torch.int32 is not supported"):
        quantize(torch.zeros(1, 1, 8, 8, dtype=torch.int32), 2, 8, "token")


def test_empty_token_axis():
    for axis in ("token", "channel"):
        q = quantize(torch.randn(2, 2, 0, 8), 2, 4, axis)
        assert dequantize(q).shape == (2, 2, 0, 8) and q.nbytes() == 0


# --------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis,G", [("token", 16), ("channel", 8), ("channel", 32)])
def test_nbytes_formula(dtype, bits, axis, G):
    x = torch.randn(2, 3, 32, 64).to(dtype)
    q = quantize(x, bits, G, axis)
    n, e = x.numel(), x.element_size()
    assert q.packed.numel() * q.packed.element_size() == n * bits // 8
    assert q.nbytes() == n * bits // 8 + 2 * (n // G) * e


@pytest.mark.parametrize("axis", ["token", "channel"])  # keys, values
def test_2bit_head_dim_128_group_32_is_under_a_fifth_of_fp16(axis):
    x = torch.randn(1, 4, 128, 128, dtype=torch.float16)
    q = quantize(x, 2, 32, axis)
    fp16_bytes = x.numel() * 2
    assert q.nbytes() <= 0.2 * fp16_bytes  # analytically 0.1875
    assert q.nbytes() == int(0.1875 * fp16_bytes)


# --------------------------------------------------------------------------- container helpers
def test_container_helpers():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 16, 16, generator=g)
    for axis in ("token", "channel"):
        q = quantize(x, 4, 8, axis)
        full = dequantize(q)
        idx = torch.tensor([2, 0])
        assert torch.equal(dequantize(q.index_select(idx)), full.index_select(0, idx))
        a, b = q.slice_tokens(0, 8), q.slice_tokens(8, 16)
        assert a.shape == (3, 2, 8, 16)
        assert torch.equal(dequantize(b), full[:, :, 8:16])
        assert torch.equal(dequantize(QuantizedGroups.cat_tokens([a, b])), full)
        assert dequantize(q, torch.float16).dtype == torch.float16
    qt = quantize(x, 4, 8, "token")
    with pytest.raises(ValueError, match="aligned to group_size 8"):
        qt.slice_tokens(0, 5)
    qc = quantize(x, 4, 8, "channel")
    assert torch.equal(dequantize(qc.slice_tokens(3, 7)), dequantize(qc)[:, :, 3:7])


# --------------------------------------------------------------------------- dispatch
def test_dispatch_env(monkeypatch):
    t = torch.zeros(1)
    assert dispatch.use_triton(t) is False  # auto on CPU
    monkeypatch.setenv("KVSTACK_KERNELS", "torch")
    assert dispatch.use_triton(t) is False
    if HAVE_TRITON:
        monkeypatch.setenv("KVSTACK_KERNELS", "triton")
        assert dispatch.use_triton(t) is True
    monkeypatch.setenv("KVSTACK_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"KVSTACK_KERNELS='cuda'.*'auto', 'torch', 'triton'"):
        dispatch.use_triton(t)


def test_dispatch_torch_never_calls_triton(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("triton path used")

    monkeypatch.setattr(qp, "quantize_triton", boom)
    monkeypatch.setenv("KVSTACK_KERNELS", "torch")
    quantize(torch.randn(1, 1, 8, 8), 2, 8, "token")
    monkeypatch.setenv("KVSTACK_KERNELS", "triton")
    with pytest.raises(AssertionError, match="triton path used"):
        quantize(torch.randn(1, 1, 8, 8), 2, 8, "token")


# --------------------------------------------------------------------------- triton kernel
def _special_values(shape, dtype, seed):
    """Random data plus constant groups, exact rounding ties, large and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[0, 0, :, :4] = 1.25  # constant runs (constant groups for small channel groups)
    x[0, -1, :4, :] = -0.5  # constant groups along tokens
    # ties: for a {0, 3} group with 2 bits, scale 1 and 0.5/1.5/2.5 sit on .5
    x[-1, 0, 0, :8] = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 0.5, 1.5, 2.5])
    x[-1, -1, -1, -3:] = torch.tensor([1e4, -1e4, 2.0**-20])
    return x.to(dtype)


TRITON_CASES = [
    # shape, bits, G, axis, dtype  (ragged: non-power-of-2 head dims / groups)
    ((1, 2, 16, 24), 2, 8, "token", torch.float32),
    ((2, 1, 12, 24), 4, 6, "channel", torch.float32),
    ((1, 2, 9, 40), 8, 3, "token", torch.float32),
    ((2, 2, 5, 48), 2, 12, "channel", torch.float32),
    ((1, 1, 8, 16), 2, 8, "channel", torch.float32),
    ((1, 2, 16, 24), 4, 8, "token", torch.float16),
    ((2, 1, 7, 24), 8, 24, "channel", torch.float16),
    ((1, 2, 12, 20), 2, 4, "token", torch.bfloat16),
    ((1, 1, 6, 64), 4, 16, "channel", torch.bfloat16),
]


@needs_triton
@pytest.mark.parametrize("shape,bits,G,axis,dtype", TRITON_CASES)
def test_triton_matches_reference(monkeypatch, shape, bits, G, axis, dtype):
    x = _special_values(shape, dtype, seed=hash((shape, bits, G, axis)) % 1000)
    ref = quantize_reference(x, bits, G, axis)
    monkeypatch.setenv("KVSTACK_KERNELS", "triton")
    out = quantize(x, bits, G, axis)
    _assert_same(out, ref)
    assert torch.equal(dequantize_reference(out), dequantize_reference(ref))


@needs_triton
def test_triton_non_contiguous_and_errors(monkeypatch):
    monkeypatch.setenv("KVSTACK_KERNELS", "triton")
    x = torch.randn(1, 16, 2, 32).transpose(1, 2)  # [1, 2, 16, 32], non-contiguous
    _assert_same(quantize(x, 4, 8, "token"), quantize_reference(x, 4, 8, "token"))
    x = x.contiguous()
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf found in"):
        quantize(x, 4, 8, "token")
    with pytest.raises(ValueError, match="head_dim 32"):
        quantize(torch.randn(1, 1, 4, 32), 2, 12, "channel")


# --------------------------------------------------------------------------- options below 4 bits
from kvstack.kernels.quant_pack import nf_levels  # noqa: E402

SCALE_FORMATS = [None, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [8, 32, 64, 128])
def test_nf_levels_are_the_lloyd_max_levels_of_a_gaussian(bits, n):
    c = nf_levels(bits, n)
    assert c.shape == (1 << bits,) and c[0] == 0 and c[-1] == 1
    assert bool((c[1:] > c[:-1]).all())
    torch.testing.assert_close(c + c.flip(0), torch.ones_like(c))  # symmetric
    # independent check by numerical integration: each interior level is the mean of a standard normal over its
    # cell (between the midpoints to its neighbours), on [-a, a] with a the expected maximum of n samples
    a = float(torch.special.ndtri(torch.tensor((n - 0.375) / (n + 0.25), dtype=torch.float64)))
    y = c * 2 * a - a
    mids = (y[:-1] + y[1:]) / 2
    for k in range(1, len(c) - 1):
        grid = torch.linspace(float(mids[k - 1]), float(mids[k]), 20001, dtype=torch.float64)
        w = torch.exp(-grid * grid / 2)
        mean = torch.trapezoid(grid * w, grid) / torch.trapezoid(w, grid)
        assert abs(float(mean) - float(y[k])) < 1e-7


def _reference_checks(x, q, levels, scale_dtype):
    """The float64 reference: every element's level is a nearest level of the stored (scale, zero); zero <= group min
    (equal when scales are in the data dtype); the error is within half the widest step."""
    B, H, T, D = x.shape
    G = q.group_size
    codes = unpack_codes(q.packed, q.bits, dim=q.packed_dim).double()
    s = _expand(q.scale.double(), q)
    z = _expand(q.zero.double(), q)
    x64 = x.double()
    # uniform: integer levels in units of the stored step; nf: the codebook in units of the stored range
    book = torch.arange(1 << q.bits, dtype=torch.float64) if levels == "uniform" else nf_levels(q.bits, G)
    t = (x64 - z) / torch.where(s > 0, s, torch.ones_like(s))
    dist = (t[..., None] - book).abs()
    chosen = dist.gather(-1, codes.long()[..., None])[..., 0]
    positive = s > 0
    assert bool((chosen[positive] <= dist.amin(-1)[positive] + 1e-4).all()), "a code is not a nearest level"
    mn = x64.reshape(B, H, T // G, G, D).amin(3) if q.axis == "token" else x64.reshape(B, H, T, D // G, G).amin(4)
    mn = mn.repeat_interleave(G, dim=2 if q.axis == "token" else 3)
    assert bool((z <= mn).all())
    if scale_dtype in (None, x.dtype):
        assert torch.equal(z, mn)
    step = 1.0 if levels == "uniform" else float((book[1:] - book[:-1]).max())
    err = (dequantize(q).double() - x64).abs()
    tol = 4 * torch.finfo(x.dtype).eps * _group_absmax(x, q).double()
    assert bool((err <= s * step / 2 + tol).all()), float((err - s * step / 2 - tol).max())


@st.composite
def option_cases(draw):
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    levels = draw(st.sampled_from(["uniform", "nf"] if bits != 8 else ["uniform"]))
    dtype = draw(st.sampled_from(DTYPES))
    smaller = [f for f in SCALE_FORMATS if f is None or torch.empty((), dtype=f).element_size() < x_size(dtype)]
    scale_dtype = draw(st.sampled_from(smaller))
    axis = draw(st.sampled_from(["token", "channel"]))
    pf = PACK_UNIT[bits][0]
    D = draw(st.sampled_from([8, 16, 64]))
    if axis == "token":
        G = draw(st.sampled_from([g for g in (8, 16, 32) if g % pf == 0]))
        T = G * draw(st.integers(1, 3))
    else:
        G = draw(st.sampled_from([g for g in (8, 16, 64) if D % g == 0]))
        T = draw(st.integers(1, 6))
    mag = draw(st.sampled_from([1e-2, 1.0, 20.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -30.0]))
    return (2, 2, T, D), bits, G, axis, dtype, levels, scale_dtype, mag, offset, draw(st.integers(0, 2**31 - 1))


def x_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


@FAST
@given(case=option_cases())
def test_options_keep_the_error_bound_against_a_float64_reference(case):
    shape, bits, G, axis, dtype, levels, scale_dtype, mag, offset, seed = case
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * mag + offset).to(dtype)
    q = quantize(x, bits, G, axis, levels=levels, scale_dtype=scale_dtype)
    pshape, sshape = _expected_shapes(shape, bits, G, axis)
    assert tuple(q.packed.shape) == pshape and tuple(q.scale.shape) == sshape == tuple(q.zero.shape)
    assert q.scale.dtype == q.zero.dtype == (scale_dtype or dtype) and q.dtype == dtype
    assert q.levels == levels and dequantize(q).dtype == dtype
    _reference_checks(x, q, levels, scale_dtype)
    # bytes: codes b/8 per element, scale and zero per group in the scale format
    n = x.numel()
    assert q.nbytes() == n * bits // 8 + 2 * (n // G) * x_size(scale_dtype or dtype)


@pytest.mark.parametrize("scale_dtype,eps", [(torch.bfloat16, 2**-8), (torch.float8_e4m3fn, 2**-3)])
def test_cheap_scales_round_the_zero_down_and_the_scale_up(scale_dtype, eps):
    x = torch.tensor([[-3.3, -0.7, 0.2, 5.1, 1.0, 2.0, -1.0, 4.0]]).reshape(1, 1, 1, 8)
    q = quantize(x, 3, 8, "channel", scale_dtype=scale_dtype)
    z, s = float(q.zero.float()), float(q.scale.float())
    assert z <= -3.3 and -3.3 - z <= 3.3 * eps  # one ulp of the minimum at most
    # the nearer neighbour of the exact step, but the top element at most half a step above the top level
    exact = (5.1 - z) / 7
    assert abs(s - exact) <= exact * eps and 7.5 * s >= 5.1 - z
    assert float((dequantize(q) - x).abs().max()) <= s / 2 + 1e-6
    # a tiny negative minimum that rounds to +0 steps to the smallest negative subnormal
    tiny = torch.tensor([-1e-30, 0.5, 0.25, 0.0, 0.1, 0.2, 0.3, 0.4]).reshape(1, 1, 1, 8)
    qt = quantize(tiny, 3, 8, "channel", scale_dtype=scale_dtype)
    assert float(qt.zero.float()) < 0 and float(qt.zero.float()) <= -1e-30
    assert float((dequantize(qt) - tiny).abs().max()) <= float(qt.scale.float()) / 2 + 1e-6


@pytest.mark.parametrize("what", ["zero", "scale"])
def test_values_beyond_the_scale_format_raise(what):
    x = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    if what == "zero":  # a group minimum below -448
        x[0, 0, 0, 0] = -500.0
    else:  # a range whose scale exceeds 448 (a minimum above 448 rounds down to 448, which is allowed)
        x = x * 3000 + 1e4
    with pytest.raises(ValueError, match=r"outside the finite range of the scale dtype float8_e4m3fn \(\+-448\)"):
        quantize(x, 3, 8, "token", scale_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float16"):
        quantize(x * 200, 3, 8, "token", scale_dtype=torch.float16)
    assert quantize(x, 3, 8, "token", scale_dtype=torch.bfloat16).scale.dtype == torch.bfloat16


@pytest.mark.parametrize("levels", ["uniform", "nf"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_constant_groups_stay_exact_with_any_levels(levels, bits):
    x = torch.full((1, 2, 16, 8), 0.37)
    x[:, 1] = -2.5
    q = quantize(x, bits, 8, "token", levels=levels)
    assert torch.all(q.scale == 0) and torch.equal(dequantize(q), x)


def test_nf_spends_levels_where_gaussian_data_is():
    x = torch.randn(4, 4, 64, 64, generator=torch.Generator().manual_seed(0))
    for bits in (2, 3, 4):
        for axis, G in (("token", 32), ("channel", 64)):
            uniform = (dequantize(quantize(x, bits, G, axis)) - x).pow(2).mean()
            nf = (dequantize(quantize(x, bits, G, axis, levels="nf")) - x).pow(2).mean()
            assert nf < 0.95 * uniform, (bits, axis, float(nf / uniform))


@FAST
@given(case=option_cases())
def test_a_clip_search_never_loses_to_the_unclipped_group(case):
    shape, bits, G, axis, dtype, levels, scale_dtype, mag, offset, seed = case
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * mag + offset).to(dtype)
    x.view(-1)[seed % x.numel()] += 6 * mag  # an outlier in one group
    plain = quantize(x, bits, G, axis, levels=levels, scale_dtype=scale_dtype)
    clipped = quantize(x, bits, G, axis, levels=levels, scale_dtype=scale_dtype, clip=(1.0, 0.9, 0.8, 0.7))
    assert clipped.scale.dtype == plain.scale.dtype and clipped.nbytes() == plain.nbytes()  # the same layout

    def group_sq_err(q):
        err = (dequantize(q, torch.float64) - x.double()) ** 2
        return err.reshape(*shape[:2], -1, G, shape[3]).sum(3) if axis == "token" else err.reshape(*shape[:3], -1, G).sum(4)

    assert bool((group_sq_err(clipped) <= group_sq_err(plain) * (1 + 1e-6) + 1e-12).all())
    only_full = quantize(x, bits, G, axis, levels=levels, scale_dtype=scale_dtype, clip=(1.0,))
    assert torch.equal(only_full.packed, plain.packed) and torch.equal(only_full.scale.float(), plain.scale.float())


def test_a_clip_search_lowers_the_error_of_gaussian_groups_with_outliers():
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    x[..., 0] *= 4  # one heavy channel: the range of every value group is set by it
    for bits in (2, 3):
        plain = (dequantize(quantize(x, bits, 64, "channel", levels="nf")) - x).pow(2).mean()
        clip = (dequantize(quantize(x, bits, 64, "channel", levels="nf", clip=(1.0, 0.9, 0.8, 0.7))) - x).pow(2).mean()
        assert clip < 0.9 * plain, (bits, float(clip / plain))


def test_option_arguments_are_checked():
    x = torch.randn(1, 1, 8, 8)
    with pytest.raises(ValueError, match=r"levels='lloyd' is not supported; allowed: \['uniform', 'nf'\]"):
        quantize(x, 3, 8, "token", levels="lloyd")
    with pytest.raises(ValueError, match="levels='nf' is not supported with bits=8"):
        quantize(x, 8, 8, "token", levels="nf")
    with pytest.raises(ValueError, match="scale_dtype=torch.int8 is not supported"):
        quantize(x, 3, 8, "token", scale_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"clip=\(1.0, 1.5\) is not allowed: ratios in \(0, 1\]"):
        quantize(x, 3, 8, "token", clip=(1.0, 1.5))


def test_container_helpers_with_options():
    x = torch.randn(2, 2, 32, 16, generator=torch.Generator().manual_seed(3))
    q = quantize(x, 3, 8, "token", levels="nf", scale_dtype=torch.bfloat16)
    full = dequantize(q)
    a, b = q.slice_tokens(0, 16), q.slice_tokens(16, 32)
    assert a.packed.shape == (2, 2, 6, 16)  # 16 tokens of 3-bit codes: 6 bytes per channel
    assert torch.equal(dequantize(b), full[:, :, 16:])
    assert torch.equal(dequantize(QuantizedGroups.cat_tokens([a, b])), full)
    assert torch.equal(dequantize(q.index_select(torch.tensor([1]))), full[1:])
    with pytest.raises(ValueError, match="levels/dtypes"):
        QuantizedGroups.cat_tokens([a, quantize(x[:, :, :16], 3, 8, "token")])
    assert not q.plain and quantize(x, 4, 8, "token").plain


def test_triton_dispatch_falls_back_to_torch_for_options(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("triton path used")

    monkeypatch.setattr(qp, "quantize_triton", boom)
    monkeypatch.setenv("KVSTACK_KERNELS", "triton")
    x = torch.randn(1, 1, 8, 8)
    quantize(x, 3, 8, "token")
    quantize(x, 4, 8, "token", levels="nf")
    quantize(x, 4, 8, "token", scale_dtype=torch.bfloat16)
    quantize(x, 4, 8, "token", clip=(1.0, 0.9))
    with pytest.raises(AssertionError, match="triton path used"):
        quantize(x, 4, 8, "token", scale_dtype=torch.float32)  # the data dtype: the plain kernel's layout


@needs_triton
def test_triton_kernel_refuses_three_bits():
    with pytest.raises(ValueError, match=r"bits=3 is not supported by the Triton kernel"):
        qp.quantize_triton(torch.randn(1, 1, 8, 8), 3, 8, "token")
