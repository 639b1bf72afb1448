"""The stack's attention function: one softmax over every tier of a layer, masks from stored positions.

For the queries of one forward (``Q`` tokens, ``G`` query heads per KV head) and each exact tier ``t`` with logits
``l_t = s * q.k`` (softcapped when the model asks), masked where a stored position is empty, in the future, or outside
the sliding window, and the state tier's log-denominator ``l_s = log(phi(q)^T z)`` with value readout ``u_s``:

    m   = max(max_t max l_t, l_s)                       (one stabiliser for everything)
    den = sum_t sum exp(l_t - m) + exp(l_s - m)
    out = (sum_t exp(l_t - m) @ V_t + exp(l_s - m) * u_s) / den

i.e. an exact log-sum-exp merge of the tiers under ONE normaliser. Queries whose every key is masked (left padding)
get a zero output, never NaN. The function also hands the normalised per-key weights to the stages that score with
attention (H2O, TOVA, SnapKV, OBCache) through :class:`AttentionStats` — no stage ever switches the model to eager
attention or builds its own attention matrix.

Registered with transformers as ``"kvstack"`` in ``AttentionInterface`` and, as a mask function, in
``AttentionMaskInterface``: the mask function does not build a mask at all, it passes the 2-D padding mask through
(:class:`StackMask`), because positions, not lengths, decide visibility.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvstack.kernels.dispatch import use_triton
from kvstack.kernels.tiered_attention import FullTierData, QuantTierData, mass_selector, tiered_attention

from .cache import ACTIVE_LAYER, StackLayer
from .errors import CacheUsageError

ATTN_NAME = "kvstack"


@dataclass(frozen=True)
class StackMask:
    """What the mask interface hands to the attention function: the 2-D padding mask ([B, tokens seen], True = real
    token) or None. Causality and windows come from stored positions."""

    padding: torch.Tensor | None


def stack_mask(*, attention_mask=None, **_ignored) -> StackMask:
    if attention_mask is not None and attention_mask.ndim != 2:
        raise CacheUsageError(
            f"kvstack needs a 2-D padding attention_mask [batch, tokens seen]; got shape {tuple(attention_mask.shape)}"
        )
    return StackMask(None if attention_mask is None else attention_mask.to(torch.bool))


@dataclass(frozen=True)
class StatsRequest:
    """What a stage wants from the attention of the current forward.

    ``mass_windows``: for each entry w, the attention weight every stored key received, summed over the last w
    queries of the forward (None: all of them), per query head.
    ``saliency``: (w, mode) pairs — OBCache's output-change saliency of every stored key over the last w queries,
    mode ``value`` (a_i ||v_i||), ``key`` (a_i ||v_i - o||) or ``joint`` (a_i ||v_i - o|| / (1 - a_i)); see
    ``kvstack/stages/scorers/obcache.py`` for the derivation.
    """

    mass_windows: tuple[int | None, ...] = ()
    keep_query: bool = False
    saliency: tuple[tuple[int | None, str], ...] = ()


@dataclass
class AttentionStats:
    """By-products of one layer's attention, for the stages' ``after_attention``.

    ``weights[i]`` are the normalised attention weights on exact tier i, [B, Hkv, G, Q, T_i] (the torch path keeps
    them only when a stage asked); ``mass(i, w)`` reduces them; ``query`` is the post-RoPE query [B, Hq, Q, D] when
    asked; ``query_positions`` [Q] the absolute positions of the queries; ``key_positions[i]`` the positions of tier
    i when attention ran (stages that run earlier in ``finish_forward`` may move tokens: align by position);
    ``saliency[(w, mode)][i]`` [B, Hq, T_i] when asked.
    """

    query_positions: torch.Tensor
    num_queries: int
    weights: list[torch.Tensor | None] = field(default_factory=list)
    query: torch.Tensor | None = None
    output: torch.Tensor | None = None
    key_positions: list[torch.Tensor | None] = field(default_factory=list)
    saliency: dict[tuple[int | None, str], list[torch.Tensor | None]] = field(default_factory=dict)

    masses: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def mass(self, tier_index: int, window: int | None = None) -> torch.Tensor:
        """[B, Hq, T_i]: weight each key of tier ``tier_index`` received, summed over the last ``window`` queries."""
        if (tier_index, window) in self.masses:  # reduced inside the fused kernel
            return self.masses[(tier_index, window)]
        w = self.weights[tier_index] if tier_index < len(self.weights) else None
        if w is None:
            raise CacheUsageError("attention weights were not kept: the stage must ask for them in attention_request")
        if window is not None:
            w = w[..., -window:, :]
        b, h, g, _, t = w.shape
        return w.sum(-2).reshape(b, h * g, t)


def _merge_requests(layer: StackLayer, query_length: int) -> StatsRequest:
    windows: set[int | None] = set()
    saliency: set[tuple[int | None, str]] = set()
    keep_query = False
    for stage in layer.stages:
        req = stage.attention_request(layer, query_length)
        if req is not None:
            windows.update(req.mass_windows)
            saliency.update(req.saliency)
            keep_query = keep_query or req.keep_query
    return StatsRequest(tuple(windows), keep_query, tuple(saliency))


def _new_token_validity(mask, layer: StackLayer, q_len: int) -> torch.Tensor | None:
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        raise CacheUsageError(
            "kvstack attention received a prepared tensor mask; pass a 2-D attention_mask (or none) so kvstack can "
            "build masks from token positions (custom 4-D masks are not supported)"
        )
    padding = mask.padding
    if padding is None:
        return None
    if padding.shape[-1] != layer.seen:
        raise CacheUsageError(
            f"attention_mask has {padding.shape[-1]} columns but layer {layer.layer_idx} has seen {layer.seen} "
            "tokens including this call; pass the mask of every token seen so far (as generate does)"
        )
    new_valid = padding[:, -q_len:]
    return None if bool(new_valid.all()) else new_valid


def stack_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    layer = ACTIVE_LAYER.get()
    layer_idx = getattr(module, "layer_idx", None)
    if layer is None or not layer.awaiting_attention or layer.layer_idx != layer_idx:
        raise CacheUsageError(
            f"kvstack attention on layer {layer_idx} found no KVStackCache update for it: run the model with "
            "use_cache and a KVStackCache (kvstack.apply makes generate do this; kvstack.cache_for(model) for "
            "manual loops)"
        )
    ACTIVE_LAYER.set(None)
    if dropout and module.training:
        raise CacheUsageError("kvstack attention is for inference: attention dropout must be 0 (call model.eval())")

    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if q_heads % kv_heads:
        raise CacheUsageError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    group = q_heads // kv_heads  # from the shapes, not the module: GQA conversion changes it
    scaling = head_dim**-0.5 if scaling is None else scaling

    new_valid = _new_token_validity(attention_mask, layer, q_len)
    if new_valid is not None:
        layer.mark_padding(new_valid)
    request = _merge_requests(layer, q_len)

    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    # [B, Hq, Q, D] -> [B, Hkv, G*Q, D]: query head h*G+g reads KV head h (transformers' repeat_kv order)
    q = query.to(compute).reshape(batch, kv_heads, group * q_len, head_dim)
    q_pos = torch.arange(layer.seen - q_len, layer.seen, device=query.device)
    q_pos_rows = q_pos.repeat(group)  # [G*Q] matching q's row order

    fused = _fused_attention(layer, q, q_pos_rows, scaling, softcap, sliding_window, request, group, q_len)
    if fused is not None:
        out, stats = fused
        stats.query_positions, stats.num_queries = q_pos, q_len
        if request.keep_query:
            stats.query, stats.output = query, out.reshape(batch, q_heads, q_len, -1)
        layer.finish_forward(stats)
        return out.reshape(batch, q_heads, q_len, -1).transpose(1, 2).contiguous().to(query.dtype), None

    logits: list[torch.Tensor | None] = []
    for tier in layer.tiers:
        if tier.num_tokens == 0:
            logits.append(None)
            continue
        lg = tier.logits(q, scaling)
        if softcap:
            lg = torch.tanh(lg / softcap) * softcap
        pos = tier.positions[:, :, None, :]  # [B, Hp, 1, T]
        visible = (pos >= 0) & (pos <= q_pos_rows[None, None, :, None])
        if sliding_window:
            visible = visible & (pos > q_pos_rows[None, None, :, None] - sliding_window)
        logits.append(lg.masked_fill(~visible, -math.inf))

    state_part = layer.state.readout(q, scaling) if layer.state is not None else None

    maxima = [lg.amax(-1) for lg in logits if lg is not None]
    if state_part is not None:
        maxima.append(state_part[0])
    if not maxima:
        raise CacheUsageError(f"layer {layer.layer_idx} holds no tokens to attend to")
    m = torch.stack(maxima).amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # fully masked rows

    numerator = q.new_zeros(batch, kv_heads, group * q_len, value.shape[-1])
    denominator = q.new_zeros(batch, kv_heads, group * q_len)
    exps: list[torch.Tensor | None] = []
    for tier, lg in zip(layer.tiers, logits):
        if lg is None:
            exps.append(None)
            continue
        e = torch.exp(lg - m[..., None])
        denominator = denominator + e.sum(-1)
        numerator = numerator + tier.mix(e)
        exps.append(e)
    if state_part is not None:
        log_den, readout = state_part
        e_state = torch.exp(log_den - m)
        denominator = denominator + e_state
        numerator = numerator + e_state[..., None] * readout.to(compute)

    safe = denominator.clamp_min(torch.finfo(compute).tiny)
    out = torch.where(denominator[..., None] > 0, numerator / safe[..., None], torch.zeros_like(numerator))

    stats = AttentionStats(query_positions=q_pos, num_queries=q_len)
    stats.key_positions = [t.positions if t.num_tokens else None for t in layer.tiers]
    for window, mode in request.saliency:
        stats.saliency[(window, mode)] = [
            None if e is None else _saliency(tier, e / safe[..., None], out, group, q_len, window, mode)
            for tier, e in zip(layer.tiers, exps)
        ]
    if request.mass_windows:
        for e in exps:
            stats.weights.append(
                None if e is None else (e / safe[..., None]).reshape(batch, kv_heads, group, q_len, e.shape[-1])
            )
    if request.keep_query:
        stats.query = query
        stats.output = out.reshape(batch, q_heads, q_len, -1)
    layer.finish_forward(stats)

    # [B, Hkv, G*Q, Dv] -> [B, Q, Hq, Dv] as transformers expects
    out = out.reshape(batch, q_heads, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)
    return out, None


#: the fused kernel is a decode kernel: longer query blocks (prefill) take the torch path
FUSED_MAX_QUERIES = 16


def _fused_attention(layer, q, q_pos_rows, scaling, softcap, sliding_window, request, group, q_len):
    """The Triton path (CUDA, or KVSTACK_KERNELS=triton): one fused pass over the full tier, at most one packed
    quantized tier and the low-rank state, with per-key masses reduced in the kernel. Returns None when the layer
    or the request is outside what the kernel covers (then the torch path below runs)."""
    if q_len > FUSED_MAX_QUERIES or request.saliency or not use_triton(q):
        return None
    full, quant, slot = None, None, {}  # slot: tier index -> "full" | "quant"
    for i, tier in enumerate(layer.tiers):
        if not tier.num_tokens:
            continue
        data = tier.kernel_data()
        if isinstance(data, FullTierData) and full is None:
            full, slot[i] = data, "full"
        elif isinstance(data, QuantTierData) and quant is None:
            quant, slot[i] = data, "quant"
        else:
            return None
    state = None
    if layer.state is not None:
        state = layer.state.kernel_data(q, scaling)
        if state is False:
            return None
    windows = tuple(request.mass_windows)
    rows = mass_selector(group, q_len, windows, device=q.device) if windows else None
    res = tiered_attention(
        q, q_pos_rows.to(torch.int32), scaling, full=full, quant=quant, state=state, softcap=softcap,
        sliding_window=sliding_window, mass_rows=rows,
    )
    stats = AttentionStats(query_positions=q_pos_rows, num_queries=q_len)
    stats.key_positions = [t.positions if t.num_tokens else None for t in layer.tiers]
    if windows:
        b, h = q.shape[:2]
        for i, which in slot.items():
            mass = res.mass_full if which == "full" else res.mass_quant
            for j, window in enumerate(windows):
                stats.masses[(i, window)] = mass[:, :, j * group : (j + 1) * group].reshape(b, h * group, -1)
    return res.out.to(q.dtype), stats


def _saliency(tier, weights, out, group: int, q_len: int, window: int | None, mode: str) -> torch.Tensor:
    """[B, Hq, T]: sum over the last ``window`` queries of the output change when each key is removed (OBCache)."""
    b, h, _, t = weights.shape
    w = weights.reshape(b, h, group, q_len, t)
    o = out.reshape(b, h, group, q_len, -1)
    if window is not None:
        w, o = w[..., -window:, :], o[..., -window:, :]
    index = torch.arange(t, device=weights.device).expand(b, 1, t)
    v = tier.gather(index)[1].to(w.dtype)  # [B, Hkv, T, Dv], dequantized by the tier
    v_sq = (v * v).sum(-1)[:, :, None, None, :]
    if mode == "value":
        return (w * v_sq.sqrt()).sum(-2).reshape(b, h * group, t)
    o_sq = (o * o).sum(-1, keepdim=True)
    cross = torch.einsum("bhgqd,bhtd->bhgqt", o, v)
    dist = (v_sq + o_sq - 2 * cross).clamp_min(0).sqrt()  # ||v_i - o_q||
    score = w * dist
    if mode == "joint":
        score = score / (1 - w).clamp_min(1e-6)
    return score.sum(-2).reshape(b, h * group, t)


def register() -> None:
    """Register the attention and mask functions under the name ``"kvstack"`` (idempotent)."""
    AttentionInterface.register(ATTN_NAME, stack_attention)
    AttentionMaskInterface.register(ATTN_NAME, stack_mask)
