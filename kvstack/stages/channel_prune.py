"""``kind: channel_prune`` — store fewer key (and value) channels per token: the head_dim dimension of the cache.

Two modes; both keep pruned tokens in a :class:`ChannelPrunedTier` (``_channel_tier.py``) that stores ONLY the kept
channels plus their index, so ``memory_bytes`` really shrinks; attention slices the query the same way.

* ``dynamic`` — ThinK (Xu et al., ICLR 2025, arXiv 2407.21018). At the first forward (the prompt, or its first
  piece under chunked prefill), per batch row and KV head, keep the ``D - round(ratio * D)`` post-RoPE key
  channels j with the largest ``||Q_obs[:, j]||² · ||K[:, j]||²``, where ``Q_obs`` are the last ``window``
  queries of every query head reading that KV head and ``K`` the prompt's keys (ThinK's greedy solution of
  ``min ||Q Kᵀ - Q_S K_Sᵀ||``). Tokens older than the newest ``recent`` move to the pruned tier; the newest
  ``recent`` keep every channel in the full tier and are moved (pruned with the same index) as they age, after
  every forward, so the full tier never holds more than ``recent`` tokens. Values are untouched.
* ``static`` — calibrated structured pruning after KVPruner (arXiv 2409.11057), training-free (KVPruner's LoRA
  recovery is not done). Model surgery by ``kvstack.apply(model, spec, calibration=...)``:
  key channels are pruned in RoPE pairs ``(i, i + D/2)`` (RoPE rotates within a pair, so a pair is the unit that
  can be removed before RoPE), value channels one by one. Importance on calibration data per layer and KV head:
  pair ``p``: ``||K[:, p]||² · Σ_{query heads of the group} ||Q[:, p]||²`` (pair norms are RoPE-invariant);
  value channel ``j``: ``||V[:, j]||² · Σ_{query heads of the group} ||W_o[:, j]||²``. Per-layer counts come from
  sensitivity: each layer alone is pruned at several levels, KL(original || pruned) is measured on the
  calibration text, and a dynamic program picks per-layer counts with minimal summed KL whose total is the global
  ``ratio`` (``value_ratio``) of all layers' pairs (channels); every head keeps at least one pair / channel.
  Surgery: the pruned ``k_proj`` rows (and bias) and ``v_proj`` rows (and bias) and the matching ``o_proj``
  input columns are set to ZERO. Weights keep their shapes because transformers' attention reshapes q/k/v with
  one ``head_dim`` and RoPE's cos/sin (shared by all layers) have that width; per-head channel sets cannot be
  expressed as smaller tensors there. Pruned key/value channels are therefore exactly zero in every token, and
  the cache drops them losslessly: every token goes to the pruned tier after each forward. The stack equals the
  surgically pruned model run with a full cache (tested); ``kvstack.remove`` restores the original weights.
  For models with ``k_norm`` (Qwen3, Gemma3) zeroed channels also change the norm's RMS of the kept ones — that
  is part of the pruned model's function and included in the measured sensitivity.

With quantization (ThinK on KIVI, preset ``think-kivi``): put ``channel_prune`` AFTER a ``quantize`` stage. The
first forward then chooses the channels from every key the layer holds (the quantize stage has already moved most of
the prompt to its tier; ThinK's score reads those keys dequantized, once) and narrows the quantized tier in place:
KIVI groups keys per channel, so dropping a channel drops whole columns of codes, scales and zero points — exact, no
re-quantization — and tokens quantized later are stored narrowed too (``QuantizedTier.keep_key_channels``). No
channel-pruned tier is created: the quantize residual plays the role of ``recent`` (which must stay unset), values
and the full-precision residual keep every channel. Static mode narrows the quantized keys the same way (its pruned
value channels are not removed from quantized values: KIVI groups values per token across channels). The fused CUDA
decode kernel reads every key channel, so a narrowed tier takes the torch attention path. ``quantized_prune`` is not
supported together with channel pruning (a clear error).

Parameters: ``ratio`` — fraction of key channels removed, ``0 <= ratio < 1`` (0: nothing removed, the identity;
a ratio that rounds to zero channels, or to no channel left, is an error); ``value_ratio`` (static only) —
fraction of value channels removed; ``window``, ``recent`` (dynamic only; ThinK's 32 and 32).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, PrivateAttr

from kvstack.stack.stats import StatsRequest
from kvstack.stack.base import Stage, StageSpec, spec_error
from kvstack.stack.errors import CacheUsageError
from kvstack.stack.memory import TierPlan, _itemsize
from kvstack.stack.registry import register_stage

from ._calibration import (
    attention_inputs,
    attention_modules,
    calibration_logprobs,
    calibration_sequences,
    mean_kl,
    new_linear,
    project,
    reject_fused,
)
from ._channel_tier import INDEX_BYTES, ChannelPrunedTier

THINK_WINDOW = THINK_RECENT = 32  # ThinK's observation window and recent tokens

#: most pruning levels measured per layer for the sensitivity curve (linear interpolation between them)
SENSITIVITY_LEVELS = 8


@register_stage
class ChannelPruneSpec(StageSpec):
    """Prune key (static mode: also value) channels of the cache."""

    kind: Literal["channel_prune"] = "channel_prune"
    mode: Literal["dynamic", "static"] = Field(
        default="dynamic", description="dynamic: ThinK at prefill; static: calibrated model surgery (KVPruner-style)."
    )
    ratio: float = Field(ge=0.0, lt=1.0, description="Fraction of key channels removed (0 <= ratio < 1).")
    value_ratio: float = Field(default=0.0, ge=0.0, lt=1.0, description="static: fraction of value channels removed.")
    window: int | None = Field(
        default=None,
        ge=1,
        description=f"dynamic: last queries of the prompt that score channels (default {THINK_WINDOW}).",
    )
    recent: int | None = Field(
        default=None,
        ge=0,
        description=f"dynamic: newest tokens that keep every channel (default {THINK_RECENT}; unset after quantize, "
        "whose residual plays this role).",
    )

    #: static mode, set by prepare_model: per layer (key_index [Hkv, Dk'], value_index [Hkv, Dv'] or None)
    _channels: list[tuple[torch.Tensor, torch.Tensor | None]] | None = PrivateAttr(default=None)

    @property
    def recent_tokens(self) -> int:
        return THINK_RECENT if self.recent is None else self.recent

    @property
    def modifies_model(self) -> bool:  # type: ignore[override]
        return self.mode == "static"

    # ------------------------------------------------------------------ validation
    def validate_with(self, stack_budget) -> None:
        if self.mode == "dynamic" and self.value_ratio:
            raise spec_error("value_ratio", self.value_ratio, "0 in mode 'dynamic' (ThinK prunes keys only)")
        if self.mode == "static":
            for name in ("window", "recent"):
                if getattr(self, name) is not None:
                    raise spec_error(name, getattr(self, name), "unset in mode 'static' (every token is pruned)")

    def validate_in_stack(self, position: int, stages) -> None:
        quantizers = [(i, s) for i, s in enumerate(stages) if s.kind == "quantize" and s.bits != 16]
        if any(s.kind == "quantized_prune" for s in stages):
            raise spec_error(
                "kind", self.kind, "a stack without quantized_prune (compose channel pruning with kind: quantize)"
            )
        later = [i for i, _ in quantizers if i > position]
        if later:
            raise spec_error(
                "kind",
                self.kind,
                f"a place after the quantize stage at stages.{later[0]}: channel pruning narrows the keys of the "
                "quantized tier, which must exist first (ThinK on KIVI)",
            )
        if quantizers and self.recent is not None:
            raise spec_error(
                "recent", self.recent, "unset after a quantize stage (its residual keeps every channel)"
            )

    def validate_for(self, shape, stack_budget) -> None:
        self.validate_with(stack_budget)
        d = shape.head_dim
        if self.mode == "dynamic":
            self.dynamic_kept(d)
            return
        reject_fused("channel_prune mode=static", shape.model_type)
        if shape.rope_dim is not None or d % 2:
            raise spec_error(
                "mode",
                "static",
                f"RoPE pairs (i, i + head_dim/2) over the whole head; this model has head_dim {d} with "
                f"{shape.rope_dim or d} rotary channels (use mode 'dynamic')",
            )
        self.static_totals(shape.num_layers, d)

    def dynamic_kept(self, head_dim: int) -> int:
        pruned = round(self.ratio * head_dim)
        if self.ratio and pruned == 0:
            raise spec_error(
                "ratio", self.ratio, f"0 or at least {0.5 / head_dim:.4g}: it removes no channel of head_dim {head_dim}"
            )
        if pruned >= head_dim:
            raise spec_error(
                "ratio", self.ratio, f"a ratio that leaves at least one of head_dim {head_dim} key channels"
            )
        return head_dim - pruned

    def static_totals(self, layers: int, d: int) -> tuple[int, int]:
        """(key pairs, value channels) removed per KV head, summed over the layers."""
        out = []
        for field, ratio, units in (("ratio", self.ratio, d // 2), ("value_ratio", self.value_ratio, d)):
            total = round(ratio * layers * units)
            unit = "RoPE pairs" if field == "ratio" else "value channels"
            if ratio and total == 0:
                raise spec_error(
                    field, ratio, f"0 or large enough to remove one of the {layers} x {units} {unit} (head_dim {d})"
                )
            if total > layers * (units - 1):
                raise spec_error(
                    field,
                    ratio,
                    f"at most {(units - 1) / units:.4g}: every head keeps at least one of its {units} {unit} "
                    f"(head_dim {d}, {layers} layers)",
                )
            out.append(total)
        return out[0], out[1]

    # --------------------------------------------------------------------- memory
    def plan_memory(self, plan, stack_budget) -> None:
        shape, heads = plan.shape, plan.shape.num_kv_heads
        d, item = shape.head_dim, _itemsize(plan.dtype)
        if self.mode == "dynamic":
            dropped = [(d - self.dynamic_kept(d), 0)] * len(plan.layers)
        else:
            dropped = self.static_counts(shape)
        for layer, (k_drop, v_drop) in zip(plan.layers, dropped):
            full = layer.tier("full")
            if full is None:
                continue
            narrowed = [t for t in layer.tiers if t.without_key_channels is not None]
            if narrowed:  # the quantized tiers hold the pruned tokens (keys only), each with its own index
                for tier in narrowed:
                    tier.bytes_for = tier.without_key_channels(k_drop)
                if plan.seq_len:
                    layer.state_bytes += len(narrowed) * heads * (d - k_drop) * INDEX_BYTES
                continue
            moved = full.tokens if self.mode == "static" else max(0, full.tokens - self.recent_tokens)
            full.tokens -= moved
            full_cost = full.bytes_for
            saved = heads * (k_drop + v_drop) * item

            def cost(n: int, full_cost=full_cost, saved=saved) -> int:
                return full_cost(n) - n * saved

            layer.tiers.append(TierPlan("channel_pruned", moved, cost))
            if plan.seq_len:
                value_index = heads * (d - v_drop) if self.mode == "static" and self.value_ratio else 0
                layer.state_bytes += (heads * (d - k_drop) + value_index) * INDEX_BYTES

    def static_counts(self, shape) -> list[tuple[int, int]]:
        """Per layer (key channels, value channels) removed per head: the calibrated allocation when known, else an
        even spread with the same totals."""
        if self._channels is not None:
            return [(shape.head_dim - k.shape[-1], 0 if v is None else shape.head_dim - v.shape[-1]) for k, v in self._channels]
        n = shape.num_layers
        pairs, values = self.static_totals(n, shape.head_dim)
        return [(2 * (pairs // n + (i < pairs % n)), values // n + (i < values % n)) for i in range(n)]

    # -------------------------------------------------------------------- surgery
    def prepare_model(self, model, calibration=None):
        if self.mode != "static":
            return None
        seqs = calibration_sequences(calibration, "channel_prune mode=static")
        mods = attention_modules(model)
        config = model.config
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        d = mods[0].head_dim
        saved = [(m, m.k_proj, m.v_proj, m.o_proj) for m in mods]

        def undo() -> None:
            for m, k, v, o in saved:
                m.k_proj, m.v_proj, m.o_proj = k, v, o
            self._channels = None

        try:
            inputs = attention_inputs(model, seqs)
            key_order, value_order = zip(*(importance_order(m, x, heads, kv) for m, x in zip(mods, inputs)))
            reference = calibration_logprobs(model, seqs)
            pairs, values = self.static_totals(len(mods), d)

            def measure(kind: str, orders, units: int) -> list[int]:
                curves = []
                for m, order in zip(mods, orders):
                    original = (m.k_proj, m.v_proj, m.o_proj)
                    points = {}
                    for level in sensitivity_levels(units):
                        zero_units(m, kind, order[:, :level], d, heads // kv)
                        points[level] = mean_kl(reference, calibration_logprobs(model, seqs))
                        m.k_proj, m.v_proj, m.o_proj = original
                    curves.append(interpolate(points, units))
                return curves

            key_counts = allocate(measure("key", key_order, d // 2), pairs) if pairs else [0] * len(mods)
            value_counts = allocate(measure("value", value_order, d), values) if values else [0] * len(mods)
            channels = []
            for m, ko, vo, kc, vc in zip(mods, key_order, value_order, key_counts, value_counts):
                zero_units(m, "key", ko[:, :kc], d, heads // kv)
                if vc:
                    zero_units(m, "value", vo[:, :vc], d, heads // kv)
                kept_pairs = ko[:, kc:].sort(-1).values
                key_index = torch.cat([kept_pairs, kept_pairs + d // 2], -1).sort(-1).values
                value_index = vo[:, vc:].sort(-1).values if self.value_ratio else None
                channels.append((key_index, value_index))
            self._channels = channels
        except BaseException:
            undo()
            raise
        return undo

    def build(self, shape, stack_budget) -> "ChannelPruneStage":
        if self.mode == "static" and self._channels is None:
            raise CacheUsageError(
                "channel_prune mode=static has no calibrated channels: prepare the model with "
                "kvstack.apply(model, spec, calibration=...) and use that spec's cache (kvstack.cache_for(model))"
            )
        return ChannelPruneStage(self, shape, stack_budget)


# ------------------------------------------------------------------------ static helpers
@torch.no_grad()
def importance_order(attn, x: torch.Tensor, heads: int, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, key RoPE pairs [Hkv, D/2] and value channels [Hkv, D], least important first."""
    d = attn.head_dim
    group = heads // kv
    q = project(attn.q_proj, x, heads)
    k = project(attn.k_proj, x, kv)
    v = project(attn.v_proj, x, kv)
    for name, t in (("q_norm", q), ("k_norm", k)):  # Qwen3/Gemma3 normalise per head before RoPE
        norm = getattr(attn, name, None)
        if norm is not None:
            t.copy_(norm(t.to(norm.weight.dtype)).double())
    half = d // 2
    energy = lambda t: (t**2).sum(1)  # noqa: E731  [H, D] over tokens
    pair = lambda e: e[..., :half] + e[..., half:]  # noqa: E731  RoPE-invariant pair energy
    q_pairs = pair(energy(q)).reshape(kv, group, half).sum(1)
    key_score = pair(energy(k)) * q_pairs
    o_cols = (attn.o_proj.weight.double() ** 2).sum(0).reshape(kv, group, d).sum(1)
    value_score = energy(v) * o_cols
    return key_score.argsort(-1), value_score.argsort(-1)


@torch.no_grad()
def _zero_output_rows(linear, rows: torch.Tensor):
    """A copy of ``linear`` whose output rows ``rows`` (weight and bias) are zero."""
    w = linear.weight.detach().clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    w[rows] = 0
    if b is not None:
        b[rows] = 0
    return new_linear(w, b, linear)


def zero_units(attn, kind: str, units: torch.Tensor, d: int, group: int) -> None:
    """Replace the module's projections by copies with ``units`` [Hkv, n] zeroed (key pairs or value channels)."""
    kv = units.shape[0]
    if kind == "key":
        channels = torch.cat([units, units + d // 2], -1)
        rows = (channels + torch.arange(kv)[:, None] * d).flatten()
        attn.k_proj = _zero_output_rows(attn.k_proj, rows)
        return
    rows = (units + torch.arange(kv)[:, None] * d).flatten()
    attn.v_proj = _zero_output_rows(attn.v_proj, rows)
    # the o_proj columns that read those channels, for every query head of the group
    q_heads = (torch.arange(kv)[:, None] * group + torch.arange(group)[None, :]).flatten()
    cols = (units.repeat_interleave(group, 0) + q_heads[:, None] * d).flatten()
    o = attn.o_proj.weight.detach().clone()
    o[:, cols] = 0
    ob = None if attn.o_proj.bias is None else attn.o_proj.bias.detach().clone()
    attn.o_proj = new_linear(o, ob, attn.o_proj)


def sensitivity_levels(units: int) -> list[int]:
    """Pruning levels (units removed per head) measured per layer: every level up to units-1, or a spread."""
    top = units - 1
    if top <= SENSITIVITY_LEVELS:
        return list(range(1, top + 1))
    return sorted({round(1 + i * (top - 1) / (SENSITIVITY_LEVELS - 1)) for i in range(SENSITIVITY_LEVELS)})


def interpolate(points: dict[int, float], units: int) -> list[float]:
    """cost[c] for c = 0..units-1 (cost[0] = 0), linear between measured levels."""
    xs = [0, *sorted(points)]
    ys = [0.0, *(points[x] for x in sorted(points))]
    out = []
    for c in range(units):
        j = max(i for i, x in enumerate(xs) if x <= c)
        if xs[j] == c or j == len(xs) - 1:
            out.append(ys[j])
        else:
            t = (c - xs[j]) / (xs[j + 1] - xs[j])
            out.append(ys[j] + t * (ys[j + 1] - ys[j]))
    return out


def allocate(curves: list[list[float]], total: int) -> list[int]:
    """Per-layer counts c_l (0 <= c_l < len(curve)) with sum c_l = total minimising sum curve_l[c_l] (exact DP)."""
    best = {0: (0.0, [])}
    for curve in curves:
        nxt: dict[int, tuple[float, list[int]]] = {}
        for used, (cost, picks) in best.items():
            for c, kl in enumerate(curve):
                if used + c > total:
                    break
                cand = (cost + kl, picks + [c])
                if used + c not in nxt or cand[0] < nxt[used + c][0]:
                    nxt[used + c] = cand
        best = nxt
    return best[total][1]


# ------------------------------------------------------------------------------ runtime
class ChannelPruneStage(Stage):
    spec: ChannelPruneSpec

    def __init__(self, spec, shape, stack_budget) -> None:
        super().__init__(spec, shape, stack_budget)
        self.kept = spec.dynamic_kept(shape.head_dim) if spec.mode == "dynamic" else None
        self.key = f"channel_prune:{id(self)}"  # in layer.scratch once the layer's channels are chosen

    @staticmethod
    def tier(layer) -> ChannelPrunedTier | None:
        return next((t for t in layer.tiers if isinstance(t, ChannelPrunedTier)), None)

    def attention_request(self, layer, query_length):
        if self.spec.mode == "dynamic" and self.key not in layer.scratch:
            return StatsRequest(keep_query=True)
        return None

    def after_attention(self, layer, stats) -> None:
        if self.key not in layer.scratch:  # the first forward chooses the channels
            layer.scratch[self.key] = True
            if self.spec.mode == "dynamic":
                key_index, value_index = self.dynamic_channels(layer, stats)
            else:
                key_index, value_index = self.static_channels(layer)
            narrowed = False
            for other in layer.tiers:
                if other is not layer.full:
                    narrowed |= other.keep_key_channels(key_index, self.shape.head_dim)
            if not narrowed:  # no quantized tier to narrow: pruned tokens get a tier of their own
                layer.tiers.append(ChannelPrunedTier(key_index, value_index, self.shape.head_dim, layer.full.keys))
        tier = self.tier(layer)
        if tier is None:
            return
        full = layer.full
        if not full.num_tokens:
            return
        move = full.positions >= 0
        if self.spec.mode == "dynamic":
            move = move & (full.positions < layer.seen - self.spec.recent_tokens)
        layer.demote(full, move, tier)

    def dynamic_channels(self, layer, stats) -> tuple[torch.Tensor, None]:
        """ThinK's key channels per (row, KV head) from every key the layer holds (other stages, e.g. quantize,
        may already have moved some of the prompt out of the full tier)."""
        dtype = torch.float64 if layer.full.keys.dtype == torch.float64 else torch.float32
        energy = 0
        for tier in layer.tiers:
            if tier.num_tokens:
                slots = torch.arange(tier.num_tokens, device=tier.positions.device)
                keys = tier.gather(slots.expand(tier.positions.shape[0], 1, -1))[0].to(dtype)
                valid = tier.valid()[..., None].to(dtype)  # [B, Hp, T, 1]
                energy = energy + ((keys * valid) ** 2).sum(-2)  # [B, Hkv, D]
        b, h, d = energy.shape
        query = stats.query[:, :, -(self.spec.window or THINK_WINDOW) :, :].to(dtype)  # [B, Hq, w, D]
        query = query.reshape(b, h, -1, d)  # query head h*G+g reads KV head h
        score = (query**2).sum(-2) * energy
        return score.topk(self.kept, dim=-1).indices.sort(-1).values, None

    def static_channels(self, layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        key_index, value_index = self.spec._channels[layer.layer_idx]
        keys = layer.full.keys
        b = keys.shape[0]
        expand = lambda i: None if i is None else i.to(keys.device)[None].expand(b, -1, -1).contiguous()  # noqa: E731
        return expand(key_index), expand(value_index)
