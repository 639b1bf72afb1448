"""``kind: quantized_prune`` — precision by importance: an eviction scorer ranks tokens, tiers give them bits.

Zhang et al., "More Tokens, Lower Precision: Towards the Optimal Token-Precision Trade-off in KV Cache Compression"
(arXiv 2412.12706): at equal memory, more tokens at lower precision can beat fewer tokens at 16 bit. Generalised
here to precision tiers by importance. Quantization is KIVI's (``kvstack/stages/quantize.py``, arXiv 2402.02750) at 2, 3,
4 or 8 bits, with the precision options of ``quantize`` (:class:`QuantOptions`, ``kvstack/stages/_quant_options.py``):
``rotate`` (hadamard | random), ``key_rope: pre``, ``codebook: nf`` and ``scale_dtype``. They apply to every quantized
level of a layer alike (one codec per layer, shared by its levels; a ``random`` rotation's matrix is held once per
layer and counted); the 16-bit level stores tokens as the model gives them.

Two forms:

* ``tiers``: a list from most to least important, strictly decreasing ``bits`` (16 = the full-precision tier), each
  with a ``fraction`` of the kept tokens, the last one may be ``rest: true``. E.g. ``[{fraction: 0.2, bits: 16},
  {fraction: 0.3, bits: 4}, {rest: true, bits: 2}]``. Without a budget every token is kept (and fractions that do not
  sum to 1 without a ``rest`` entry evict the remainder); with a budget (own or the stack's) the kept count ``N``
  comes from the budget and the fractions split it. A first tier with ``fill: true`` is sized by bytes instead: the
  tiers below keep every token they can hold, and the fill tier takes the best-ranked of them as far as the bytes
  left allow (``[{fill: true, bits: 16}, {rest: true, bits: 3}]`` with ``scorer: window``: KIVI's full-precision
  residual sized to the budget; preset ``kivi-3-budget``). The protected tokens (sinks, ``recent``, the scorer's
  window) are the fill tier's first: the tiers below keep only as many tokens as leave room for them.
* ``bits`` with a budget: tokens that eviction to that budget would keep stay in full precision, the tokens it would
  drop are demoted to ``bits`` instead (nothing is evicted).

``layer_bits: {layer index: bits}`` changes the bits of the one quantized level in the layers listed (mixed precision
by layer, after KVTuner, Li et al., arXiv 2502.04420: layers differ in how much their KV error costs). With a budget,
each layer's share of the stack's total follows what its quantized tokens cost (``layer_scale``: a 4-bit layer
among 3-bit ones may hold more bytes, the others less; the shares sum to the number of layers, so the total is the
budget's). ``key_bits`` on a quantized tier stores its keys at other bits than its values, and ``layer_key_bits:
{layer index: bits}`` does so for the one quantized level in the layers listed (after ``layer_bits``; shares as
above): on SmolLM2 the keys' 3-bit error, not the values', carries most of the KL, and it sits in a few layers.
``layer_prompt_axes: {layer index: axes}`` sets ``prompt_axes`` in the layers listed, so that the reflectors' fixed
bytes are spent where the keys' precision pays for them (e.g. only in the layers that retrieve).
``layer_weights: {layer index: weight}`` moves budget between layers on top of that (a listed layer gets weight x an
unlisted one's share; the total stays the budget's): on SmolLM2 a third of the layers retrieve the needle, and with
the whole context at 4 bits in them an eighth of the cache finds most needles (docs/budgets.md). With
``spill_unused: true`` no layer's share exceeds what it can use after the tokens seen (``layer_need``: every one kept,
the protected ones at 16 bits, or the ``spill_full_tokens`` best-ranked ones in the fill tier if more), and the rest
goes to the other layers (``budget.SpilledShares``): a layer that retrieves keeps every token coded and a 16-bit
core of fixed size, and what its share adds as the context grows goes to the others.

Budgets are promises (docs/budgets.md) and are met by choosing ``N`` in bytes: the largest ``N`` whose levels — each
quantized level in whole key groups (``group_size`` slots: codes — 3 bits pack 8 codes in 3 bytes —, scales and zero
points in ``scale_dtype``, positions, records), the 16-bit level per token — fit in the layer's limit (``r * seen``
uncompressed tokens for ``ratio: r``, ``n`` for ``tokens: n``, of which ``N`` is also at most ``n``) less the state, less
the ``random`` rotation's matrix, and less the ``every - 1`` tokens that arrive in
full precision before the next assignment (their cost less the budget's growth meanwhile, at most a quarter of the
limit: a layer over its limit before the period ends is re-assigned then). Lower bits buy
proportionally more tokens. (For the ``bits`` form, ``N`` is the 16-bit count eviction would keep and every other token
is demoted, so memory grows with the tokens seen: its budget is a selection rule, not a promise — set it on the stage;
a stack budget over it alone is refused by ``kvstack.apply``.)

Each forward of the prompt, and every ``every`` decode steps (default ``group_size``, so demotions move whole key
groups), the scorer ranks every token of the full tier and of this stage's quantized tiers (protected sinks and
recent tokens first), the ranks are cut into the tiers' counts and tokens move between tiers with
``StackLayer.demote`` or leave with ``StackLayer.retain`` (folded into the low-rank state when the stack has one).
Tokens never move up (:func:`levels_without_promotion`): a quantized token keeps its error at a higher level, so its
band goes to the best-ranked token that still holds that precision.
"""

from __future__ import annotations

import math
from typing import Annotated, Callable, Literal

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from kvstack.kernels.quant_pack import PACK_UNIT
from kvstack.kernels.transform_code import MAX_BITS
from kvstack.stack.base import Budget, Stage, StageSpec, spec_error
from kvstack.stack.budget import (
    LayerPromise, LayerWeights, Share, check_layer_indices, reference_bytes_per_token,
)
from kvstack.stack.memory import TierPlan, _itemsize, full_tier_bytes
from kvstack.stack.registry import register_stage

from ._quant_options import QuantOptions
from ._transform_tier import calibrate_bases, coder_bytes, key_code_bits, transform_tier, transform_token_bytes
from .quantize import (
    QuantizedTier, check_quant_params, check_quant_shape, quantized_slot_bytes, quantized_token_bytes, value_group_for,
)
from .scorers import ScorerOptions, get_scorer, keep_order, union_scores

LEVEL_RECORD = "quantized_prune.level"  # transient per-token record: the tier a token is moving to


#: steps of a fractional key width (``coding: transform`` spends ``key_bits x C`` bits per token over its components)
KEY_BITS_STEP = 0.25
#: widths of a quantized level's keys go up to the coder's widest code of one component
KEY_WIDTHS = [k * KEY_BITS_STEP for k in range(1, int(MAX_BITS / KEY_BITS_STEP) + 1)]


def _key_width(value: float) -> float | int:
    """A key or transform-coded value width: an integral one as an int (``4``, not ``4.0``: tier names and messages
    read ``k4v3``), others as given."""
    if value != value or not KEY_BITS_STEP <= value <= MAX_BITS or (value / KEY_BITS_STEP) % 1:
        raise ValueError(
            f"{value:g} bits per element is not a multiple of {KEY_BITS_STEP} in [{KEY_BITS_STEP}, {MAX_BITS}] "
            "(integers 1-8; KIVI-coded keys 2, 3, 4 or 8)"
        )
    return int(value) if float(value).is_integer() else float(value)


#: the keys' (or transform-coded values') bits per element: an integer, or (``coding: transform``) a multiple of
#: :data:`KEY_BITS_STEP`
KeyBits = Annotated[float, AfterValidator(_key_width)]


class PrecisionTier(BaseModel):
    """One precision level: a ``fraction`` of the kept tokens, the ``rest``, or (first tier only) what ``fill``s the
    budget, stored at ``bits``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    bits: Literal[2, 3, 4, 8, 16] = Field(
        description="Bits per element (16: the full-precision tier; 3: 8 codes in 3 bytes, group sizes multiples of 8)."
    )
    key_bits: KeyBits | None = Field(
        default=None,
        description="The keys' bits when they differ from the values' (default: bits; quantized levels only): 2, 3, 4 "
        "or 8 with coding: kivi; with coding: transform the average per element, a multiple of 0.25 from 0.25 to 8 "
        "whose total per token (key_bits x num_kv_heads x head_dim) is a multiple of 8 bits.",
    )
    value_bits: KeyBits | None = Field(
        default=None,
        description="value_coding: transform only — the values' average bits per element when they differ from "
        "bits, a multiple of 0.25 from 0.25 to 8 whose total per token (value_bits x num_kv_heads x value_dim) is a "
        "multiple of 8 bits.",
    )
    fraction: float | None = Field(default=None, gt=0.0, le=1.0, description="Share of the kept tokens.")
    rest: bool = Field(default=False, description="Every kept token the tiers above do not take (last tier only).")
    fill: bool = Field(
        default=False,
        description="First tier only, with a budget: the best-ranked tokens, as many as the bytes the other tiers "
        "leave fit (they keep every token they can hold first).",
    )

    @model_validator(mode="after")
    def _one_size(self) -> "PrecisionTier":
        if sum([self.fraction is not None, self.rest, self.fill]) != 1:
            raise ValueError(
                f"a tier sets exactly one of 'fraction', 'rest: true' or 'fill: true'; got {self.model_dump()}"
            )
        for name in ("key_bits", "value_bits"):
            if self.bits == 16 and getattr(self, name) is not None:
                raise ValueError(
                    f"{name}={getattr(self, name)} on a 16-bit tier: {name} is for quantized tiers (bits 2-8)"
                )
        return self

    @property
    def keys(self) -> float:
        """The keys' bits (fractional only with coding: transform)."""
        return self.bits if self.key_bits is None else self.key_bits

    @property
    def values(self) -> float:
        """The values' bits (fractional only with value_coding: transform)."""
        return self.bits if self.value_bits is None else self.value_bits

    @property
    def tier_name(self) -> str:
        """The name of the layer tier that holds this level (``quantized3``; ``quantized-k4v3`` with other key or
        value bits)."""
        if self.keys == self.bits == self.values:
            return f"quantized{self.bits}"
        return f"quantized-k{self.keys}v{self.values}"


@register_stage
class QuantizedPruneSpec(ScorerOptions, LayerWeights, StageSpec, QuantOptions):
    """Rank tokens with an eviction scorer and store them at a precision that depends on their rank (the quantized
    levels with ``quantize``'s precision options)."""

    kind: Literal["quantized_prune"] = "quantized_prune"
    scorer: str = Field(default="h2o", description="Scoring policy that ranks tokens (see docs/eviction.md).")
    tiers: list[PrecisionTier] | None = Field(default=None, description="Precision tiers, most important first.")
    bits: Literal[2, 3, 4, 8] | None = Field(
        default=None, description="Short form: tokens eviction to the budget would drop are stored at these bits."
    )
    budget: Budget | None = Field(default=None, description="Own budget; defaults to the stack's budget.")
    group_size: int = Field(default=32, ge=1, description="Tokens per key group of the quantized tiers.")
    value_group_size: int | Literal["head_dim"] | None = Field(
        default=None, description="Channels per value group (default group_size; head_dim: one group per token)."
    )
    every: int | None = Field(
        default=None, ge=1, description="Re-assign tiers every N decode steps (default group_size)."
    )
    n_sink: int = Field(default=0, ge=0, description="First real tokens of each row, always in the top tier.")
    recent: int = Field(default=0, ge=0, description="Newest positions, always in the top tier.")
    layer_bits: dict[int, Literal[2, 3, 4, 8]] | None = Field(
        default=None,
        description="{layer index: bits}: the quantized level's bits in those layers (one quantized level; the other "
        "layers keep its bits). With a budget, each layer's share follows what its quantized tokens cost.",
    )
    layer_key_bits: dict[int, KeyBits] | None = Field(
        default=None,
        description="{layer index: bits}: the keys' bits of the quantized level in those layers (after layer_bits; "
        "the values keep theirs; widths as for tiers' key_bits). Shares as for layer_bits.",
    )
    layer_prompt_axes: dict[int, NonNegativeInt] | None = Field(
        default=None,
        description="coding: transform — {layer index: axes}: prompt_axes in those layers (the other layers keep "
        "prompt_axes), so the reflectors' fixed bytes go where the keys' precision pays for them. Shares do not "
        "change; a layer's limit holds its own reflectors.",
    )

    spill_full_tokens: NonNegativeInt = Field(
        default=0,
        description="spill_unused with a fill tier: what a layer can use counts this many of its best-ranked tokens "
        "in the fill tier (not only the protected ones), so a layer that keeps every token holds that many at the "
        "fill tier's precision and, as the context grows, spills the rest of its share to the other layers.",
    )

    def inactive_options(self) -> set[str]:
        inactive = super().inactive_options() | self.quant_option_fields_inactive(self.quantized_bits())
        return inactive | {"layer_prompt_axes"} if "prompt_axes" in inactive else inactive

    @property
    def modifies_model(self) -> bool:  # type: ignore[override]
        return self.calibrates(self.quantized_bits())

    def prepare_model(self, model, calibration=None):
        return calibrate_bases(model, calibration, "quantized_prune key_basis=calibrated")

    def keeps_budget(self) -> bool:
        """The ``tiers`` form sizes its levels to the budget in bytes; the ``bits`` short form keeps every token
        (its budget only says which stay at 16 bits), so it cannot promise memory."""
        return self.tiers is not None

    # ------------------------------------------------------------------------------------ validation
    def effective_budget(self, stack_budget: Budget | None) -> Budget | None:
        return self.budget or stack_budget

    def levels(self, layer_idx: int | None = None) -> list[PrecisionTier]:
        """The tiers, the ``bits`` short form expanded (its 16-bit count comes from the budget); with ``layer_idx``,
        that layer's (``layer_bits``)."""
        if self.tiers is not None:
            levels = list(self.tiers)
        elif self.bits is None:  # neither form (validate_with refuses it)
            return []
        else:
            levels = [PrecisionTier(bits=16, fraction=1.0), PrecisionTier(bits=self.bits, rest=True)]
        update = {}
        bits = (self.layer_bits or {}).get(layer_idx)
        if bits is not None:  # keys and values
            update = {"bits": bits, "key_bits": None, "value_bits": None}
        key_bits = (self.layer_key_bits or {}).get(layer_idx)
        if key_bits is not None:
            update["key_bits"] = key_bits
        if not update:
            return levels
        return [level if level.bits == 16 else level.model_copy(update=update) for level in levels]

    def axes_in(self, layer_idx: int | None) -> int:
        """The prompt axes of layer ``layer_idx`` (``layer_prompt_axes``, else ``prompt_axes``)."""
        return (self.layer_prompt_axes or {}).get(layer_idx, self.prompt_axes)

    def bit_widths(self) -> tuple[set[int], set[int]]:
        """(the keys' widths, the values' widths) of the quantized levels in any layer."""
        quantized = [level for level in self.levels() if level.bits != 16]
        by_layer = set((self.layer_bits or {}).values())
        keys = {level.keys for level in quantized} | by_layer | set((self.layer_key_bits or {}).values())
        return keys, {level.bits for level in quantized} | by_layer

    def quantized_bits(self) -> list[int]:
        """Widths of the quantized levels' keys and values in any layer (the precision options act on these)."""
        widths = [level.bits for level in self.levels() if level.bits != 16]
        return widths + sorted(set.union(*self.bit_widths()) - set(widths))

    def _per_layer(self) -> dict[str, dict[int, int]]:
        """The per-layer bit fields that are set: {field name: {layer: bits}}."""
        return {n: v for n, v in (("layer_bits", self.layer_bits), ("layer_key_bits", self.layer_key_bits)) if v}

    def _by_layer(self) -> dict[str, dict[int, int]]:
        """Every per-layer field that is set (bits and prompt axes): {field name: {layer: value}}."""
        axes = {"layer_prompt_axes": self.layer_prompt_axes} if self.layer_prompt_axes else {}
        return self._per_layer() | axes

    def prompt_axes_fields(self) -> dict[str, tuple[object, int]]:
        fields = super().prompt_axes_fields()
        if self.layer_prompt_axes:
            fields["layer_prompt_axes"] = (self.layer_prompt_axes, max(self.layer_prompt_axes.values()))
        return fields

    def validate_with(self, stack_budget) -> None:
        if (self.tiers is None) == (self.bits is None):
            raise spec_error("tiers", self.tiers, "exactly one of 'tiers' (a list) or 'bits' (the short form)")
        budget = self.effective_budget(stack_budget)
        if self.tiers is None and budget is None:
            raise spec_error("budget", None, "a budget (on the stage or the stack) for the short form 'bits'")
        if self.tiers is not None:
            if not self.tiers:
                raise spec_error("tiers", [], "at least one tier")
            bits = [t.bits for t in self.tiers]
            if any(a <= b for a, b in zip(bits, bits[1:])):
                raise spec_error("tiers.bits", bits, "strictly decreasing bits, most important tier first")
            if any(t.rest for t in self.tiers[:-1]):
                raise spec_error("tiers.rest", True, "only on the last tier")
            if any(t.fill for t in self.tiers[1:]):
                raise spec_error("tiers.fill", True, "only on the first tier")
            if self.tiers[0].fill and (budget is None or len(self.tiers) == 1):
                raise spec_error(
                    "tiers.fill", True,
                    "a budget (on the stage or the stack) and a tier below it: it takes the bytes they leave",
                )
            total = sum(t.fraction or 0.0 for t in self.tiers)
            if total > 1 + 1e-9:
                raise spec_error("tiers.fraction", total, "fractions summing to at most 1")
            if budget is not None and not self.tiers[-1].rest and abs(total - 1) > 1e-9:
                raise spec_error(
                    "tiers.fraction", total, "fractions summing to 1 (or a last tier with rest: true) with a budget"
                )
        for name, per_layer in self._per_layer().items():
            quantized = [level.bits for level in self.levels() if level.bits != 16]
            if len(quantized) != 1:
                raise spec_error(
                    name, per_layer,
                    f"none with {len(quantized)} quantized levels (tiers bits {quantized}): per-layer bits replace "
                    "the bits of a stage's one quantized level",
                )
        if self.spill_full_tokens and not (self.spill_unused and self.tiers and self.tiers[0].fill):
            raise spec_error(
                "spill_full_tokens", self.spill_full_tokens,
                "0 unless spill_unused: true and the first tier has fill: true (it counts fill-tier tokens in what "
                "a layer can use before its share spills)",
            )
        if self.layer_prompt_axes and not self.transform_coded:
            raise spec_error("layer_prompt_axes", self.layer_prompt_axes,
                             f"none with coding: {self.coding} (prompt axes lead a transform-coded key basis)")
        for name, per_layer in self._by_layer().items():
            if min(per_layer) < 0:
                raise spec_error(name, per_layer, "layer indices from 0")
        value_group = self.value_group_size
        if isinstance(value_group, int) and value_group < 1:
            raise spec_error("value_group_size", value_group, "a positive int or 'head_dim'")
        keys, values = self.bit_widths()
        if not self.transform_coded:  # transform-coded keys have no groups to pack, and any width
            odd = sorted(keys - set(PACK_UNIT))
            if odd:
                field = "tiers.key_bits" if any(t.key_bits in odd for t in self.tiers or []) else "layer_key_bits"
                raise spec_error(
                    field, odd[0], "2, 3, 4 or 8 with coding: kivi (multiples of 0.25 up to 8 with coding: transform)"
                )
            for bits in keys:
                check_quant_params(bits, self.group_size, None, None)
        for bits in values:
            check_quant_params(bits, None, value_group, None)
        coded_values = [t.value_bits for t in self.tiers or [] if t.value_bits is not None]
        if coded_values and not self.values_coded:
            raise spec_error(
                "tiers.value_bits", coded_values[0],
                "none with value_coding: kivi (fractional value widths are for value_coding: transform; KIVI values "
                "take the tier's bits)",
            )
        self.check_quant_options(self.quantized_bits())

    def validate_in_stack(self, position, stages) -> None:
        if self.quantized_bits():
            self.check_quant_options_in_stack(stages)

    def validate_for(self, shape, stack_budget) -> None:
        self.validate_with(stack_budget)
        value_group = value_group_for(self.value_group_size, self.group_size, shape)
        for bits in self.bit_widths()[1]:
            check_quant_shape(shape, bits, value_group)
        self.check_quant_options_for(shape, self.quantized_bits())
        if self.transform_coded:
            for bits in sorted(self.bit_widths()[0]):
                if key_code_bits(shape, bits) is None:
                    field = "tiers.key_bits" if any(t.keys == bits for t in self.tiers or []) else "layer_key_bits"
                    c = shape.num_kv_heads * shape.head_dim
                    steps = [k for k in KEY_WIDTHS if key_code_bits(shape, k)]
                    raise spec_error(
                        field, bits,
                        f"a width whose bits per token, key_bits x {c} key components (num_kv_heads x head_dim), "
                        f"are a multiple of 8 on this model: {', '.join(f'{_key_width(k)}' for k in steps[:6])}, ...",
                    )
        if self.values_coded:
            for level in self.levels():
                if level.bits != 16 and key_code_bits(shape, level.values, shape.value_dim) is None:
                    c = shape.num_kv_heads * shape.value_dim
                    steps = [k for k in KEY_WIDTHS if key_code_bits(shape, k, shape.value_dim)]
                    raise spec_error(
                        "tiers.value_bits" if level.value_bits is not None else "tiers.bits", level.values,
                        f"a width whose bits per token, value_bits x {c} value components (num_kv_heads x "
                        f"value_dim), are a multiple of 8 on this model: "
                        f"{', '.join(f'{_key_width(k)}' for k in steps[:6])}, ...",
                    )
        for name, per_layer in self._by_layer().items():
            check_layer_indices(name, per_layer, shape)
        self.check_layer_weights(shape)

    # --------------------------------------------------------------------------------------- sizing
    @property
    def period(self) -> int:
        return self.every or self.group_size

    def per_token_extra(self, shape) -> int:
        """Positions (per head when head-wise) and scorer records of one token."""
        pos = full_tier_bytes(shape, shape.dtype, positions_per_head=self.is_head_wise, key_dim=0, value_dim=0)(1)
        return pos + get_scorer(self.scorer)(self, shape).record_bytes_per_token(shape)

    def fixed_bytes(self, shape, dtype=None, layer_idx: int | None = None) -> int:
        """Bytes per layer besides the tokens: the codec's (one ``random`` rotation matrix, shared by the levels), or
        with ``coding: transform`` the coders of each quantized level of layer ``layer_idx``."""
        if not self.quantized_bits():
            return 0
        coders = 0
        if self.transform_coded:
            coders = sum(coder_bytes(shape, level.keys, dtype or shape.dtype, self.key_scale,
                                     self.coded_value_bits(level), self.axes_in(layer_idx))
                         for level in self.levels(layer_idx) if level.bits != 16)
        return QuantOptions.fixed_bytes(self, shape) + coders

    def layer_scale(self, layer_idx: int, shape) -> float:
        """The layer's share of the budget relative to the mean: with per-layer bits, what its quantized tokens cost
        (1 without them), times its ``layer_weights``."""
        listed = {i for layers in self._per_layer().values() for i in layers}
        usual = self.level_costs(shape, shape.dtype)[-1] if listed else 1.0

        def cost(i: int) -> float:  # the one quantized level's token
            return self.level_costs(shape, shape.dtype, i)[-1] if i in listed else usual

        return self.weighted_scale(layer_idx, shape, cost)

    def level_costs(self, shape, dtype, layer_idx: int | None = None) -> list[float]:
        """Amortised bytes of one token per batch row in each level of layer ``layer_idx`` (codes, scales and zero
        points in ``scale_dtype``, positions, records; the per-layer ``fixed_bytes`` aside)."""
        full = shape.num_kv_heads * (shape.head_dim + shape.value_dim) * _itemsize(dtype)
        vg = value_group_for(self.value_group_size, self.group_size, shape)
        extra = self.per_token_extra(shape)
        sdt = self.scale_torch_dtype()
        if self.transform_coded:  # every part per token: the amortised cost is the exact one
            return [full + extra if level.bits == 16 else self.slot_bytes(shape, dtype, level, extra)(1)
                    for level in self.levels(layer_idx)]
        return [
            full + extra if level.bits == 16
            else quantized_token_bytes(
                shape, dtype, level.bits, self.group_size, vg, extra, scale_dtype=sdt, key_bits=level.keys
            )
            for level in self.levels(layer_idx)
        ]

    def level_split(self, shape, dtype, stack_budget, reference=None, layer_idx: int | None = None,
                    share: Share | None = None) -> "LevelSplit":
        """How the kept tokens of layer ``layer_idx`` split into levels, as a function of the tokens seen and held
        (worked out once per cache, dtype and layer bits; ``reference``: the shape the budget is against, default
        ``shape``; ``share``: the layer's share of the budget, default ``layer_share``)."""
        budget = self.effective_budget(stack_budget)
        if share is None:
            share = 1.0 if layer_idx is None else self.layer_share(layer_idx, shape, dtype, budget, reference)
        fill = bool(self.tiers) and self.tiers[0].fill
        levels = self.levels(layer_idx)
        cumulative, acc = [], 0.0
        for level in levels[1 if fill else 0:]:  # a fill tier is sized by bytes, not by a share
            acc += level.fraction or 0.0
            cumulative.append(None if level.rest else acc)
        vg = value_group_for(self.value_group_size, self.group_size, shape)
        extra = self.per_token_extra(shape)
        full = shape.num_kv_heads * (shape.head_dim + shape.value_dim) * _itemsize(dtype) + extra
        costs = []
        for level in levels[: 1 if self.tiers is None else None]:  # short form: the 16-bit count is sized
            if level.bits == 16:
                costs.append(lambda n, c=full: n * c)
            else:  # transform-coded: codes per token; KIVI: whole key groups (a tier's holes never add up to one)
                costs.append(self.slot_bytes(shape, dtype, level, extra))
        slack = self.period - 1 if self.keeps_budget() else 0  # the short form's budget is a selection rule
        return LevelSplit(
            budget, reference_bytes_per_token(reference or shape, dtype), costs, full, slack,
            cumulative if self.tiers is not None else None,
            # the rotation matrix is per layer, not per row: reserving it in every row's share over-counts for
            # batches > 1, never under-counts
            fixed=self.fixed_bytes(shape, dtype, layer_idx), fill=fill,
            group=1 if self.transform_coded else self.group_size,
            scale=share, protected=self.n_sink + self.protected_recent(shape),
        )

    def layer_need(self, layer_idx, shape, dtype, budget, reference) -> Callable[[int], int]:
        """``spill_unused``: every token seen kept in the levels (the protected ones, or ``spill_full_tokens`` if
        more, in the fill tier), the codec's tensors and the arrivals before the next assignment."""
        split = self.level_split(shape, dtype, budget, reference, layer_idx, share=1.0)
        return lambda seen: split.need(seen, self.spill_full_tokens)

    def protected_recent(self, shape) -> int:
        """Newest positions always in the top tier: ``recent``, or the scorer's own window when it is larger."""
        return max(self.recent, get_scorer(self.scorer)(self, shape).protected_recent())

    def coded_value_bits(self, level: PrecisionTier) -> float | None:
        """The values' bits of a quantized level when transform-coded (``value_coding: transform``); None: KIVI."""
        return level.values if self.values_coded else None

    def slot_bytes(self, shape, dtype, level: PrecisionTier, extra: int):
        """Exact cost of ``n`` slots of one quantized level per batch row (``quantized_slot_bytes`` with the options;
        with ``coding: transform`` its codes per token)."""
        vg = value_group_for(self.value_group_size, self.group_size, shape)
        if self.transform_coded:
            e = _itemsize(self.scale_torch_dtype() or dtype)
            per_token = round(transform_token_bytes(shape, level.keys, level.bits, vg, e, extra, self.key_scale,
                                                    self.coded_value_bits(level)))
            return lambda n: n * per_token
        return quantized_slot_bytes(
            shape, dtype, level.bits, self.group_size, vg, extra, scale_dtype=self.scale_torch_dtype(),
            key_bits=level.keys,
        )

    def level_counts(
        self, shape, dtype, stack_budget, seen: int, held: int, layer_idx: int | None = None
    ) -> list[int]:
        """Tokens per level (per row and KV head) of layer ``layer_idx``; tokens beyond their sum are evicted."""
        return self.level_split(shape, dtype, stack_budget, layer_idx=layer_idx).level_counts(seen, held)

    def plan_memory(self, plan, stack_budget) -> None:
        shape = plan.shape
        extra = self.per_token_extra(shape)
        full_cost = full_tier_bytes(shape, plan.dtype, positions_per_head=self.is_head_wise)
        records = get_scorer(self.scorer)(self, shape).record_bytes_per_token(shape)
        for i, layer in enumerate(plan.layers):
            full = layer.tier("full")
            split = self.level_split(shape, plan.dtype, stack_budget, layer_idx=i)
            counts = split.level_counts(plan.seq_len, full.tokens)
            if plan.batch > 1:  # a shorter (padded) row can hold a level's spare token: the tensors hold the most
                counts = [count + spare for count, spare in zip(counts, split.spare)]
            full.bytes_for = lambda n, base=full_cost: base(n) + n * records
            quantized = 0
            levels = self.levels(i)
            for level, count in zip(levels, counts):
                if level.bits == 16:
                    full.tokens = min(full.tokens, count + self.period - 1)
                else:
                    cost = self.slot_bytes(shape, plan.dtype, level, extra)
                    layer.tiers.append(TierPlan(level.tier_name, count, cost))
                    quantized += count
            if all(level.bits != 16 for level in levels):
                full.tokens = min(full.tokens, self.period - 1)
            if quantized:  # a random rotation's matrix, or the transform coders, exist from the first quantized token
                layer.fixed_bytes += self.fixed_bytes(shape, plan.dtype, i)

    def build(self, shape, stack_budget) -> "QuantizedPruneStage":
        return QuantizedPruneStage(self, shape, stack_budget)


class LevelSplit:
    """Level bounds of one stage. ``cap(seen, reserved)`` is the kept count ``N``: without a budget every held token;
    with one, the largest ``N`` whose levels cost (``costs[i](count_i + spare_i)`` bytes per row; ``spare_i`` is 1 for a
    level between two fractions, whose count a shorter row of a batch can exceed by one) at most the layer's limit
    (``scale`` — the layer's share, ``layer_scale`` — times ``budget`` against ``reference`` bytes per
    uncompressed token) less ``reserved`` bytes and the ``slack`` tokens
    that arrive at ``full`` bytes each before the next assignment (less the budget's growth meanwhile), and at most
    ``tokens``. Level i takes ranks ``[bound_{i-1}, bound_i)`` with ``bound_i = floor(cumulative_i * N)`` (``None``:
    the rest, ``N``). The short form (``cumulative`` None) keeps ``N`` at 16 bits and demotes the rest. ``fixed``:
    bytes the layer holds whatever ``N`` (the codec's tensors), taken from every limit.

    With a ``fill`` tier (level 0), ``N`` is the most tokens the levels below hold within the limit (the fill tier
    gives up its room to the tokens that arrive before the next assignment), and ``fill_count`` is how many of the
    best-ranked of them the bytes left — less that ``slack`` — keep at the fill tier's precision; the levels below
    split the other ``N - fill`` by their fractions. The ``protected`` best-ranked tokens (the sinks and the recent
    window, ranked first) are the fill tier's before the levels below or the arrivals take any room: ``N`` is the
    most tokens whose cost with them at the fill tier's precision fits.

    The ``fixed`` bytes exist only while a quantized level holds a token (the stage releases them when the levels
    empty). So with a fill tier a layer may keep its tokens at the fill tier's precision alone, without them
    (``alone``): it does whenever that keeps at least as many tokens as coding does (a layer whose share barely
    exceeds the coders' bytes keeps more 16-bit tokens in their place)."""

    def __init__(self, budget, reference: int, costs, full: int, slack: int, cumulative, fixed: int = 0,
                 fill: bool = False, group: int = 1, scale: float = 1.0, protected: int = 0):
        self.budget, self.reference, self.costs = budget, reference, costs
        self.promise = None if budget is None else LayerPromise(budget, scale, reference)  # the layer's limit
        self.full, self.slack, self.cumulative, self.fixed = full, slack, cumulative, fixed
        self.fill, self.group = fill, group  # a fill tier; the key group of the quantized levels
        self.protected = protected if fill else 0  # tokens the fill tier holds first
        # a level between two fractions (floor(C_i x) - floor(C_(i-1) x)) can hold one token more for fewer kept
        # tokens, and a batch's tensors hold every row at its fullest one's count: such a level is charged that token
        middle = [] if cumulative is None else [int(i > 0 and c is not None) for i, c in enumerate(cumulative)]
        self.spare = [0] * (len(costs) - len(middle)) + middle
        self._cache: dict[tuple, int] = {}

    def counts(self, n: int, fill: int = 0) -> list[int]:
        if self.cumulative is None:
            return [n]
        top = min(fill, n) if self.fill else 0
        rest = n - top
        bounds = [rest if c is None else min(rest, math.floor(rest * c + 1e-9)) for c in self.cumulative]
        below = [b - a for a, b in zip([0] + bounds[:-1], bounds)]
        return [top, *below] if self.fill else below

    def cost(self, n: int, fill: int = 0) -> int:
        return sum(cost(count + spare) for cost, count, spare in zip(self.costs, self.counts(n, fill), self.spare))

    def level_counts(self, seen: int, held: int) -> list[int]:
        """Tokens per level (per row and KV head) once ``held`` of ``seen`` tokens are assigned (one row)."""
        cap = self.cap(seen)
        fill = self.fill_count(seen, 0, min(cap, held)) if self.fill else 0
        bounds = self.bounds(cap, torch.tensor([held]), fill)[0].tolist()
        return [b - a for a, b in zip([0] + bounds[:-1], bounds)]

    def _limit(self, seen: int, reserved: int) -> int:
        return self.promise.limit(seen) - reserved - self.fixed

    def _slack_bytes(self, seen: int, limit: int) -> int:
        """Room for the tokens that arrive in full precision before the next assignment (net of the budget's growth
        meanwhile; at most a quarter of the limit: beyond that the stage re-assigns early, when the layer is over
        its limit)."""
        growth = 0 if self.budget.ratio is None else self.promise.share(seen) * self.budget.ratio * self.reference
        return min(math.ceil(self.slack * max(self.full - growth, 0)), limit // 4)

    def need(self, seen: int, full: int = 0) -> int:
        """Bytes per row that keep all ``seen`` tokens (the protected ones, or ``full`` if more, at the fill tier's
        precision), the fixed bytes and the arrivals before the next assignment (at full precision: an upper bound, a
        few tokens' worth over what the fill tier leaves them): what this layer can use (``spill_unused``). A
        low-rank state is not counted; a layer holding one keeps that much less."""
        top = min(max(self.protected, full if self.fill else 0), seen)
        return self.fixed + self.cost(seen, top) + self.slack * self.full

    def fill_count(self, seen: int, reserved: int, n: int) -> int:
        """Tokens of the fill tier among ``n`` kept ones (0 without a fill tier): the most whose bytes, with the other
        ``n - fill`` in the levels below, stay within the limit less the slack."""
        if not self.fill or self.budget is None or n <= 0:
            return 0
        if self.alone(seen, reserved) is not None:
            return n
        key = ("fill", seen, reserved, n)
        if key not in self._cache:
            whole = self._limit(seen, reserved)
            limit = whole - self._slack_bytes(seen, whole)
            # each pass gives the fill tier what the levels below leave; they cost no more with fewer tokens, so
            # every x found stays within the limit as it grows. The levels below shrink a key group at a time, so
            # past a fixed point one more group's worth of candidates is tried before stopping. The protected
            # tokens start it, before the room for arrivals (``cap`` left room for them whenever it could; a layer
            # that goes over its limit before the next assignment is re-assigned then).
            x = min(self.protected, n)
            if self.cost(n, x) > whole:
                x = 0
            while True:
                room = limit - (self.cost(n, x) - self.costs[0](x))
                grown = _most(self.costs[0], room, n)
                if grown > x:
                    x = grown
                    continue
                ahead = [y for y in range(x + 1, min(n, x + self.group) + 1) if self.cost(n, y) <= limit]
                if not ahead:
                    break
                x = ahead[-1]
            self._remember(key, x)
        return self._cache[key]

    def _remember(self, key, value: int) -> None:
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = value

    def alone(self, seen: int, reserved: int = 0) -> int | None:
        """The tokens the fill tier keeps by itself, without the ``fixed`` bytes (within the limit less the
        arrivals' room, at most ``seen``), when that is at least what coding keeps; None: code (or no fill tier, no
        fixed bytes, no budget)."""
        if not (self.fill and self.fixed and self.budget is not None):
            return None
        key = ("alone", seen, reserved)
        if key not in self._cache:
            whole = self.promise.limit(seen) - reserved  # no fixed bytes
            top = seen if self.budget.tokens is None else min(seen, self.budget.tokens)
            kept = _most(self.costs[0], whole - self._slack_bytes(seen, whole), top) if whole > 0 else 0
            self._remember(key, kept if kept >= min(self.coded_cap(seen, reserved), seen) else None)
        return self._cache[key]

    def cap(self, seen: int, reserved: int = 0) -> int | None:
        """The kept count N after ``seen`` tokens (None without a budget: keep every held token)."""
        if self.budget is None:
            return None
        alone = self.alone(seen, reserved)
        return self.coded_cap(seen, reserved) if alone is None else alone

    def coded_cap(self, seen: int, reserved: int) -> int:
        """N with the quantized levels (and their fixed bytes) in use."""
        key = (seen, reserved)
        if key not in self._cache:
            # the codec's tensors are reserved whatever N: until the limit exceeds them nothing is kept (N = 0, so
            # nothing quantized and no matrix held)
            limit = self._limit(seen, reserved)
            if limit <= 0:
                self._cache[key] = 0
                return 0
            if not self.fill:  # a fill tier gives its room to the tokens that arrive meanwhile
                limit -= self._slack_bytes(seen, limit)
            protected = self.protected
            top = None if self.budget.tokens is None else self.budget.tokens + 1

            def fits(n: int) -> bool:  # monotone in n
                return self.cost(n, min(protected, n)) <= limit

            lo, hi = 0, 1
            while fits(hi) and (top is None or hi < top):
                lo, hi = hi, 2 * hi
            if top is not None:
                hi = min(hi, top)
            while hi - lo > 1:  # the largest n that fits
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            self._remember(key, lo)
        return self._cache[key]

    def bounds(self, cap: int | None, held: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """held [...] tokens per (row, head) -> cumulative level bounds [..., L] (int64, no host sync). ``fill``: the
        fill tier's count for ``cap`` kept tokens (``fill_count``; fewer kept tokens cost no more with it)."""
        held = held.long()
        n = held if cap is None else held.clamp_max(cap)
        if self.cumulative is None:
            return torch.stack([n, held], -1)
        top = n.clamp_max(fill) if self.fill else torch.zeros_like(n)
        rest = n - top
        columns = [top + (rest if c is None else torch.minimum(rest, (rest.double() * c + 1e-9).floor().long()))
                   for c in self.cumulative]
        return torch.stack([top, *columns] if self.fill else columns, -1)


def _most(cost, room: int, top: int) -> int:
    """The largest ``n <= top`` with ``cost(n) <= room`` (``cost`` nondecreasing, ``cost(0) == 0``)."""
    if room < 0:
        return 0
    lo, hi = 0, top + 1  # cost(lo) fits; hi is out of range or does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= room else (lo, mid)
    return lo


class QuantizedPruneStage(Stage):
    spec: QuantizedPruneSpec

    def __init__(self, spec, shape, stack_budget) -> None:
        super().__init__(spec, shape, stack_budget)
        self.scorer = get_scorer(spec.scorer)(spec, shape)
        self.recent = spec.protected_recent(shape)
        self.value_group = value_group_for(spec.value_group_size, spec.group_size, shape)
        self.key = f"quantized_prune:{id(self)}"
        self._splits: dict[tuple, LevelSplit] = {}

    def split_for(self, layer) -> LevelSplit:
        # once per dtype held (a model cast after apply holds another dtype), per layer bits, weight and axes
        i, spec = layer.layer_idx, self.spec
        key = (layer.full.keys.dtype, (spec.layer_bits or {}).get(i), (spec.layer_key_bits or {}).get(i),
               (spec.layer_weights or {}).get(i), spec.axes_in(i))
        if key not in self._splits:
            self._splits[key] = self.spec.level_split(
                self.shape, key[0], self.stack_budget, layer.reference, layer.layer_idx
            )
        return self._splits[key]

    def init_layer(self, layer) -> None:
        tiers = []
        codec = self.spec.codec(self.shape, layer.layer_idx)  # one per layer: the levels share its rotation
        holder = True  # the first quantized level holds (and counts) the codec's tensors
        for level in self.spec.levels(layer.layer_idx):
            if level.bits == 16:
                tiers.append(layer.full)
                continue
            label = f"layer {layer.layer_idx}, quantized_prune"
            if self.spec.transform_coded:
                tier = transform_tier(self.shape, layer.layer_idx, level.keys, level.bits, self.value_group, label,
                                      level.tier_name, codec, holder, basis=self.spec.key_basis,
                                      key_scale=self.spec.key_scale, value_bits=self.spec.coded_value_bits(level),
                                      prompt_axes=self.spec.axes_in(layer.layer_idx))
            else:
                tier = QuantizedTier(
                    level.bits, self.spec.group_size, self.value_group, self.shape.dtype, label=label,
                    name=level.tier_name, key_bits=level.keys, codec=codec, holds_codec_tensors=holder,
                )
            holder = False
            layer.tiers.append(tier)
            tiers.append(tier)
        layer.scratch[self.key] = tiers

    def attention_request(self, layer, query_length):
        return self.scorer.request(layer, query_length)

    def after_attention(self, layer, stats) -> None:
        self.scorer.observe(layer, stats)
        prompt = stats.num_queries > 1 or layer.seen == stats.num_queries
        if not prompt and layer.seen % self.spec.period:
            limit = layer.limit_bytes()
            if limit is None or layer.memory_bytes() <= limit:  # tensor shapes: no host sync
                return
        self.reassign(layer, stats, self.split_for(layer).cap(layer.seen, layer.reserved_bytes()))

    def keep_at_most(self, layer, stats, cap: int) -> None:
        self.reassign(layer, stats, cap)

    def reassign(self, layer, stats, cap: int | None) -> None:
        """Rank every token of this stage's tiers and move each to its level for a kept count ``cap``."""
        levels: list = layer.scratch[self.key]
        own = list(dict.fromkeys(levels))  # full tier once even when no level is 16-bit
        if layer.full not in own:
            own.insert(0, layer.full)
        tiers = [(layer.tiers.index(t), t) for t in own if t.num_tokens]
        if not tiers:
            return
        target = self.assign(layer, tiers, stats, cap)
        for (_, tier), level in zip(tiers, target):
            tier.token_data[LEVEL_RECORD] = level
        evicted = len(levels)
        for _, tier in tiers:
            level = tier.token_data[LEVEL_RECORD]
            if bool(((level == evicted) & tier.valid()).any()):
                layer.retain(tier, level < evicted)
            for index, dst in enumerate(levels):
                if dst is not tier and tier.num_tokens:
                    layer.demote(tier, tier.token_data[LEVEL_RECORD] == index, dst)
        for tier in own:
            tier.token_data.pop(LEVEL_RECORD, None)
        quantized = [t for t in levels if t is not layer.full]
        if not any(t.num_tokens for t in quantized):  # nothing coded: the codec's tensors go (``LevelSplit.alone``)
            for tier in quantized:
                tier.release()
        if layer.full.num_tokens:  # moves made per head leave empty slots in rows that received fewer tokens
            layer.retain(layer.full, layer.full.valid(), absorb=False)

    def assign(self, layer, tiers, stats, cap: int | None) -> list[torch.Tensor]:
        """Target level of every slot of each tier ([B, W, T_i] int; ``len(levels)`` = evict)."""
        _, score, pos, valid = union_scores(self.scorer, self.spec.is_head_wise, layer, stats, tiers)
        score = keep_order(score, pos, valid, layer.seen, self.spec.n_sink, self.recent)
        split = self.split_for(layer)
        # sized for the most tokens a row can hold (``seen``: no host sync); rows holding fewer cost no more
        fill = split.fill_count(layer.seen, layer.reserved_bytes(), min(cap, layer.seen)) if split.fill else 0
        bounds = split.bounds(cap, valid.sum(-1), fill)  # [B, W, L]
        levels = layer.scratch[self.key]
        width = score.shape[1]
        current = torch.cat([  # the level each slot holds now (-1: the full tier when it is not a level)
            torch.full_like(t.positions, levels.index(t) if t in levels else -1).expand(-1, width, -1)
            for _, t in tiers
        ], dim=-1)
        level = levels_without_promotion(score, valid, bounds, current)
        return list(level.split([t.num_tokens for _, t in tiers], dim=-1))


def levels_without_promotion(
    score: torch.Tensor, valid: torch.Tensor, bounds: torch.Tensor, current: torch.Tensor
) -> torch.Tensor:
    """Target level of each slot ([B, W, T] int64; ``L`` = evicted) for cumulative bounds [B, W, L]: level ``j``
    takes the best-scored slots not placed yet whose precision allows it (``current <= j``: a quantized token keeps
    its error when it moves up, so it would spend a higher level's bytes for nothing), until ``bounds[..., j]``
    slots hold levels ``<= j``. Without quantized slots this is the plain cut of the ranking at the bounds."""
    num_levels = bounds.shape[-1]
    level = torch.full_like(current, num_levels, dtype=torch.long)
    open_ = valid.clone()
    placed = torch.zeros_like(bounds[..., :1])
    slots = torch.arange(score.shape[-1], device=score.device).expand_as(score)
    for j in range(num_levels):
        eligible = open_ & (current <= j)
        order = torch.where(eligible, score, torch.full_like(score, -math.inf)).argsort(
            dim=-1, descending=True, stable=True
        )
        rank = torch.empty_like(order).scatter_(-1, order, slots)
        take = eligible & (rank < bounds[..., j : j + 1] - placed)
        level = torch.where(take, torch.full_like(level, j), level)
        open_ &= ~take
        placed = placed + take.sum(-1, keepdim=True)
    return level

