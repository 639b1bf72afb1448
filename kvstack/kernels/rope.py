"""Rotary position embedding (RoPE) of cached keys, forwards and backwards, in the ``rotate_half`` layout.

Used for pre-RoPE key quantization (KVQuant, Hooper et al., arXiv 2401.18079): the cache receives post-RoPE keys;
rotating them back by their positions gives the pre-RoPE keys, whose per-channel statistics do not rotate with the
position (so per-channel groups are tighter); after dequantization the rotation is re-applied.

Layout (every architecture kvstack supports, as transformers' ``apply_rotary_pos_emb``): the first ``R`` channels
(``R = head_dim``, or ``head_dim * partial_rotary_factor``) rotate, channel ``i < R/2`` paired with ``i + R/2`` by
the angle ``p * inv_freq[i]``; channels ``R..`` pass through. With ``c = cos``, ``s = sin`` of
``cat(p * inv_freq, p * inv_freq)``::

    rope(x)   = x * c + rotate_half(x) * s        rotate_half([x1, x2]) = [-x2, x1]
    unrope(y) = y * c - rotate_half(y) * s        (rotation by -angle: the inverse, since each pair's map is a rotation)

transformers multiplies ``c`` and ``s`` by the RoPE type's ``attention_scaling`` (YaRN's mscale; 1 otherwise):
``rope_model(x) = a * rope(x)``. The scalar commutes with the rotations, so ``rope(unrope(a rope(x))) = a rope(x)``:
pure rotations both ways round-trip exactly what the model produced, and ``a`` is never needed here.

Angles are computed as transformers does (``positions.float() * inv_freq`` in float32, then ``cos``/``sin``), so the
angle of a position is the one the model used; the rotation itself runs in the input's dtype (float32 or float64).
Reference: :func:`rope_reference` (explicit 2x2 rotations per channel pair in float64).
"""

from __future__ import annotations

import torch

__all__ = ["rope_angles", "apply_rope", "rope_reference", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (int) ``[...]``, inv_freq ``[R/2]`` -> (cos, sin) ``[..., R]`` float32, as transformers builds them
    (before its ``attention_scaling`` and its cast to the model dtype)."""
    freqs = positions.float()[..., None] * inv_freq.float().to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the first ``R = cos.shape[-1]`` channels of ``x`` [..., T, D] (``cos``/``sin`` broadcast to
    [..., T, R]); ``inverse``: by the negative angles. Runs in ``x``'s dtype."""
    r = cos.shape[-1]
    if r % 2 or r > x.shape[-1]:
        raise ValueError(f"rotary width {r} must be even and at most the head_dim {x.shape[-1]}")
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = x[..., :r]
    turned = rotate_half(rot) * sin
    out = rot * cos - turned if inverse else rot * cos + turned
    if r == x.shape[-1]:
        return out
    return torch.cat((out, x[..., r:]), dim=-1)


def rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False):
    """float64 reference: channel ``i < R/2`` and ``i + R/2`` of token ``t`` rotated by ``+-positions[t] *
    inv_freq[i]`` (``x`` [..., T, D], ``positions`` broadcastable to [..., T]). The angle is the float32 product the
    model uses; the rotation is in float64."""
    x = x.double()
    half = inv_freq.shape[-1]
    angle = (positions.float()[..., None] * inv_freq.float().to(x.device)).double()  # [..., T, R/2]
    if inverse:
        angle = -angle
    c, s = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half : 2 * half]
    out = x.clone()
    out[..., :half] = a * c - b * s
    out[..., half : 2 * half] = b * c + a * s
    return out
