r"""Online softmax: the one merge every attention path of kvstack uses (tiers, key blocks, the low-rank state).

Softmax attention over a union of key sets is a log-sum-exp merge of partial results (Milakov & Gimelshein,
"Online normalizer calculation for softmax", arXiv 1805.02867; FlashAttention, arXiv 2205.14135). For one query
row and a set of keys with logits ``l_i`` and values ``v_i`` the partial result is

    peak = max_i l_i        mass = sum_i exp(l_i - peak)        acc = sum_i exp(l_i - peak) v_i

and two partials over disjoint key sets merge exactly:

    peak = max(peak_a, peak_b)
    mass = mass_a exp(peak_a - peak) + mass_b exp(peak_b - peak)       (acc likewise)

so ``out = acc / mass`` and ``lse = peak + log(mass)`` equal the softmax over the union. A term that is not a set
of keys — the low-rank state's share of the denominator, ``exp(log_den)``, with value readout ``u`` — is the
partial ``(log_den, 1, u)``. Masked logits are ``-inf``; a row that sees nothing has ``peak = -inf`` and
``mass = 0`` and finishes as ``out = 0``, ``lse = -inf`` (never NaN).

Shapes: any leading dims ``[..., M]`` (M query rows) for ``peak`` / ``mass`` and ``[..., M, Dv]`` for ``acc``.
The torch reference of the fused kernel (``tiered_attention.tiered_attention_reference``) and the stack's tiled
engine (``kvstack/stack/engine.py``) both merge with these functions; the Triton kernel implements the same update
in registers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SoftmaxPartial", "finish", "log_term_partial", "logits_partial", "merge"]


@dataclass
class SoftmaxPartial:
    """Unnormalised softmax attention of M query rows over some keys: ``peak`` / ``mass`` [..., M], ``acc``
    [..., M, Dv] (see the module docstring)."""

    peak: torch.Tensor
    mass: torch.Tensor
    acc: torch.Tensor


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def logits_partial(logits: torch.Tensor, values: torch.Tensor) -> SoftmaxPartial:
    """Partial of masked ``logits`` [..., M, T] (``-inf`` = invisible) over ``values`` [..., T, Dv]."""
    peak = logits.amax(-1)
    weights = torch.exp(logits - _finite_or_zero(peak)[..., None])
    return SoftmaxPartial(peak, weights.sum(-1), torch.matmul(weights, values))


def log_term_partial(log_weight: torch.Tensor, value: torch.Tensor) -> SoftmaxPartial:
    """Partial of one term per row with weight ``exp(log_weight)`` [..., M] and value ``value`` [..., M, Dv]
    (``-inf``: no term)."""
    present = torch.isfinite(log_weight)
    return SoftmaxPartial(
        log_weight, present.to(value.dtype), torch.where(present[..., None], value, torch.zeros_like(value))
    )


def merge(a: SoftmaxPartial | None, b: SoftmaxPartial | None) -> SoftmaxPartial | None:
    """The partial over the union of two disjoint key sets (None: nothing yet)."""
    if a is None or b is None:
        return b if a is None else a
    peak = torch.maximum(a.peak, b.peak)
    ref = _finite_or_zero(peak)
    scale_a, scale_b = torch.exp(a.peak - ref), torch.exp(b.peak - ref)
    return SoftmaxPartial(
        peak,
        a.mass * scale_a + b.mass * scale_b,
        a.acc * scale_a[..., None] + b.acc * scale_b[..., None],
    )


def finish(p: SoftmaxPartial) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [..., M, Dv], lse [..., M]): the normalised attention output and the log of its denominator; rows that
    saw nothing give ``out = 0`` and ``lse = -inf``."""
    seen = p.mass > 0
    safe = torch.where(seen, p.mass, torch.ones_like(p.mass))
    out = torch.where(seen[..., None], p.acc / safe[..., None], torch.zeros_like(p.acc))
    lse = torch.where(seen, p.peak + torch.log(safe), torch.full_like(p.peak, -math.inf))
    return out, lse
