"""Orthogonal rotations along the last axis: the fast Walsh-Hadamard transform and seeded random rotations.

Used to rotate keys and values along ``head_dim`` before quantization (QuaRot, Ashkboos et al., arXiv 2404.00456;
TurboQuant, Zandieh et al., arXiv 2504.19874): an orthogonal ``R`` keeps dot products, ``(Rq).(Rk) = q.k``, and spreads
an outlier channel over every channel, so per-group min-max ranges shrink.

* :func:`fwht` — normalised Walsh-Hadamard transform ``x H_n / sqrt(n)`` for a power-of-two ``n`` (Sylvester order:
  ``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``). :func:`fwht_butterfly` is the fast transform proper:
  ``log2 n`` butterfly passes ``(a, b) -> (a + b, a - b)``, ``O(n log n)`` per row, no matrix. For head dims
  (``n <= DENSE_MAX``) one matrix product with the exact ``+-1`` matrix (cached per size, dtype and device; scaled
  after the product) is far faster in eager torch — 20-40x at ``n = 64`` on a CPU, where each butterfly pass is a
  separate kernel launch over the whole tensor — so :func:`fwht` uses it there and the butterflies above.
  ``H_n / sqrt(n)`` is symmetric and orthogonal, so :func:`fwht` is its own inverse. Reference:
  :func:`fwht_reference` (the explicit matrix, float64).
* :func:`random_orthogonal` — a Haar-random orthogonal ``[n, n]`` matrix from a seed (QR of a Gaussian matrix with
  the signs of ``R``'s diagonal folded in), float64, deterministic for a seed on every device (drawn on the CPU).
  Apply with ``x @ Q`` and undo with ``x @ Q.T``; reference: the float64 product.

Plain torch: the transforms are a few tensor ops per call (no Triton kernel).
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "DENSE_MAX", "is_power_of_two", "hadamard_matrix", "fwht", "fwht_butterfly", "fwht_reference", "random_orthogonal",
]

#: largest length :func:`fwht` transforms by one product with the +-1 matrix (butterflies above)
DENSE_MAX = 512


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def _check_length(n: int) -> None:
    if not is_power_of_two(n):
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two length; got {n}")


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix ``H_n / sqrt(n)`` ``[n, n]`` (symmetric, orthogonal)."""
    _check_length(n)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=32)
def _signs(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return (hadamard_matrix(n) * n**0.5).round().to(dtype=dtype, device=device)  # exact +-1 entries


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform along the last axis (same dtype; float32/float64 recommended).

    ``fwht(x) == x @ hadamard_matrix(n)`` up to rounding, and ``fwht(fwht(x)) == x``."""
    n = x.shape[-1]
    _check_length(n)
    if n > DENSE_MAX:
        return fwht_butterfly(x)
    return (x @ _signs(n, x.dtype, x.device)) * (n**-0.5)


def fwht_butterfly(x: torch.Tensor) -> torch.Tensor:
    """The ``O(n log n)`` fast Walsh-Hadamard transform (normalised), ``log2 n`` butterfly passes."""
    n = x.shape[-1]
    _check_length(n)
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:  # butterflies of span h: (a, b) -> (a + b, a - b)
        v = y.reshape(-1, n // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n)
        h *= 2
    return y.reshape(*lead, n) * (n**-0.5)


def fwht_reference(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_n / sqrt(n)`` in float64 (the reference of :func:`fwht`)."""
    return x.double() @ hadamard_matrix(x.shape[-1], device=x.device)


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A Haar-distributed random orthogonal matrix ``[n, n]`` (float64, CPU) drawn from ``seed``."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive int")
    gen = torch.Generator().manual_seed(int(seed))
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(n, dtype=torch.float64))
