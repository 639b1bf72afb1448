"""The feature-map variants of ``kvstack.bench.random_features`` are unbiased estimators of exp(q.k)."""

from __future__ import annotations

import math

import pytest
import torch

from kvstack.bench.random_features import VariantFeatures
from kvstack.kernels.lowrank_update import draw_features


@pytest.mark.parametrize("options", [{}, {"a": -0.5}, {"a": 0.05}, {"balance": 0.8}, {"centre_tokens": 3}])
def test_variants_estimate_the_softmax_kernel_without_bias(options):
    g = torch.Generator().manual_seed(0)
    q = 0.5 * torch.randn(1, 1, 4, 6, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(1, 1, 5, 6, generator=g, dtype=torch.float64)
    scaling = 0.7
    maps = VariantFeatures(draw_features(6, 60000, seed=1, dtype=torch.float64), **options)
    lk, lq = maps.log_key(k, scaling), maps.log_query(q, scaling)
    estimate = torch.logsumexp(lq[..., :, None, :] + lk[..., None, :, :], dim=-1)  # log phi(q).phi(k)
    exact = (q @ k.transpose(-1, -2)) * scaling
    torch.testing.assert_close(estimate, exact, rtol=0, atol=0.05)
    assert math.isfinite(float(estimate.sum()))
