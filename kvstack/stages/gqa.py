"""``kind: gqa`` — convert a model to fewer KV heads (GQA; ``kv_heads: 1`` is MQA): the cache shrinks by the ratio.

Model surgery done by ``kvstack.apply(model, spec, calibration=...)`` and undone by ``kvstack.remove``. Each new KV
head replaces a group of ``m = old_kv_heads / kv_heads`` old heads; ``k_proj``/``v_proj`` are rebuilt with
``kv_heads * head_dim`` rows (biases too), ``config.num_key_value_heads`` and every attention module's
``num_key_value_groups`` are updated, so the converted model is an ordinary transformers model:
``model.save_pretrained`` writes it and it reloads without kvstack.

Methods (training-free; the papers uptrain afterwards, we do not):

* ``mean`` — Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
  Checkpoints", EMNLP 2023 (arXiv 2305.13245): mean-pool the K and V projection rows of the heads of each
  contiguous group (the grouping transformers' ``repeat_kv`` order implies). Keys: RoPE is applied after the
  projection and is linear per position, so pooling the projections pools the post-RoPE keys.
* ``align`` — calibrated, after "Align Attention Heads Before Merging Them" (arXiv 2412.20677). Three function-
  preserving reparametrisations before pooling, all exact before merging:
  1. grouping: KV heads (with the query heads that read them) may be permuted; heads are grouped greedily by
     their aligned similarity on calibration data (head 0 of the remaining ones takes its ``m - 1`` most similar);
  2. values: each head's value space is rotated by an orthogonal ``R`` (generalised Procrustes towards the group's
     mean value on calibration tokens): ``v_proj`` rows become ``Rᵀ W_v`` and the ``o_proj`` columns of every
     query head reading that KV head become ``W_o R``, so the attention output is unchanged;
  3. keys: each RoPE plane (channels ``i, i + d/2``) of a head is rotated by its own 2-D rotation (Kabsch, det +1),
     applied to ``k_proj`` and to the ``q_proj`` rows of the query heads reading it. 2-D rotations in RoPE's own
     planes commute with RoPE, so every ``q·k`` is unchanged. Skipped for models with query/key norms (Qwen3,
     Gemma3, Cohere, StableLM), whose per-channel norm weights do not commute with the rotation.
  Then the aligned heads are mean-pooled as in ``mean``.

Query/key norms (``q_norm``/``k_norm``, StableLM's ``q_layernorm``/``k_layernorm``) follow their heads: one weight
shared by every head (Qwen3, Gemma3) stays; per-head weights (Cohere's ``[heads, head_dim]`` LayerNorm, StableLM's
one LayerNorm per head) are regrouped with their heads and mean-pooled like the projections (exact when the merged
heads are identical). A norm over the whole projection (OLMo2, OLMo3: one RMS statistic over every KV head's
channels) is refused when heads merge: each head is divided by a statistic of all of them, so no per-group pooling
reproduces it. The converted model runs one two-token forward into a ``DynamicCache`` before ``apply`` returns: a
conversion that does not run, or stores other than ``kv_heads`` heads, is refused there, with the model restored.

Parameters: ``kv_heads`` (must divide the model's KV-head count), ``method`` (``mean`` | ``align``; ``align``
needs ``calibration``, see ``kvstack/stages/_calibration.py`` for its format).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import ClassVar, Literal

import torch
from pydantic import Field

from kvstack.stack.base import StageSpec, spec_error
from kvstack.stack.errors import UnsupportedModelError
from kvstack.stack.memory import full_tier_bytes
from kvstack.stack.registry import register_stage

from ._calibration import attention_inputs, attention_modules, calibration_sequences, new_linear, project, reject_fused

PROCRUSTES_ITERATIONS = 3


@register_stage
class GQASpec(StageSpec):
    """Share KV heads: convert the model to ``kv_heads`` KV heads."""

    kind: Literal["gqa"] = "gqa"
    modifies_model: ClassVar[bool] = True
    kv_heads: int = Field(ge=1, description="KV heads after conversion (divides the model's count; 1 = MQA).")
    method: Literal["mean", "align"] = Field(
        default="mean", description="mean: pool projections; align: calibrated grouping + rotations, then pool."
    )

    def validate_in_stack(self, position: int, stages) -> None:
        if position:
            raise spec_error(
                "kind",
                self.kind,
                f"the first stage only (it is stages.{position}): it changes the model's KV heads, which every later "
                "stage's tiers and memory bound are priced with",
            )

    def validate_for(self, shape, stack_budget) -> None:
        reject_fused("gqa", shape.model_type)
        if shape.num_kv_heads % self.kv_heads:
            divisors = [d for d in range(1, shape.num_kv_heads + 1) if shape.num_kv_heads % d == 0]
            raise spec_error(
                "kv_heads",
                self.kv_heads,
                f"a divisor of the model's {shape.num_kv_heads} KV heads ({shape.num_q_heads} query heads, "
                f"head_dim {shape.head_dim}): one of {divisors}",
            )

    def plan_memory(self, plan, stack_budget) -> None:
        if plan.shape.num_kv_heads == self.kv_heads:
            return  # already converted (or nothing to do)
        plan.shape = dataclasses.replace(plan.shape, num_kv_heads=self.kv_heads)
        for layer in plan.layers:
            for tier in layer.tiers:
                if tier.name == "full":
                    tier.bytes_for = full_tier_bytes(plan.shape, plan.dtype)

    def prepare_model(self, model, calibration=None):
        mods = attention_modules(model)
        config = model.config
        old_kv = config.num_key_value_heads
        for m in mods:  # refusals before anything is touched
            check_convertible(m, config.num_attention_heads, old_kv, self.kv_heads)
        inputs = None
        if self.method == "align":
            inputs = attention_inputs(model, calibration_sequences(calibration, "gqa method=align"))
        saved = [(m, {name: getattr(m, name) for name in SURGERY_ATTRS if hasattr(m, name)}) for m in mods]

        def undo() -> None:
            for m, attrs in saved:
                for name, value in attrs.items():
                    setattr(m, name, value)
            config.num_key_value_heads = old_kv

        try:
            for i, m in enumerate(mods):
                convert_layer(m, config.num_attention_heads, old_kv, self.kv_heads, None if inputs is None else inputs[i])
            config.num_key_value_heads = self.kv_heads
            dry_run(model, self.kv_heads)
        except BaseException:
            undo()
            raise
        return undo


#: attention-module attributes the conversion replaces (and ``undo`` puts back)
SURGERY_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "num_key_value_groups", "num_key_value_heads", "q_norm",
                 "k_norm", "q_layernorm", "k_layernorm")
#: (query norm, key norm) attribute names of the attention modules transformers ships
QK_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"))


def head_norms(attn) -> tuple:
    """The attention module's (query norm, key norm) modules, each None when absent."""
    for q_name, k_name in QK_NORMS:
        q_norm, k_norm = getattr(attn, q_name, None), getattr(attn, k_name, None)
        if q_norm is not None or k_norm is not None:
            return q_norm, k_norm
    return None, None


def norm_layout(norm, heads: int, d: int) -> str:
    """How a query/key norm treats heads: ``shared`` (one ``[d]`` weight, or none, applied per head), ``per_head``
    (weights ``[heads, d]``), ``list`` (one norm module per head), ``whole`` (one norm over all ``heads * d``
    channels: its statistic mixes heads) or ``unknown``."""
    norms = getattr(norm, "norms", None)
    if isinstance(norms, torch.nn.ModuleList):
        return "list" if len(norms) == heads and all(norm_layout(n, 1, d) == "shared" for n in norms) else "unknown"
    shapes = {tuple(p.shape) for p in norm.parameters(recurse=False)}
    if any(True for _ in norm.children()):
        return "unknown"
    if not shapes or shapes == {(d,)}:
        return "shared"
    if shapes == {(heads, d)}:
        return "per_head"
    if shapes == {(heads * d,)}:
        return "whole"
    return "unknown"


def check_convertible(attn, q_heads: int, old_kv: int, new_kv: int) -> None:
    """Refuse, before any change, an attention module this conversion would break: a key norm over the whole
    projection when heads merge, a norm of a layout it does not know, or parameters it would not convert."""
    if new_kv == old_kv:
        return
    where = f"gqa: layer {attn.layer_idx}"
    d = attn.head_dim
    own = {"q_proj", "k_proj", "v_proj", "o_proj", *(n for pair in QK_NORMS for n in pair)}
    for name, child in attn.named_children():
        if name not in own and any(True for _ in child.parameters()):
            raise UnsupportedModelError(
                f"{where}'s attention holds {name!r} ({type(child).__name__}) with parameters; the conversion only "
                "knows q/k/v/o projections and query/key norms, so it cannot merge its heads"
            )
    q_norm, k_norm = head_norms(attn)
    for label, norm, heads in (("query", q_norm, q_heads), ("key", k_norm, old_kv)):
        if norm is None:
            continue
        layout = norm_layout(norm, heads, d)
        if layout == "whole" and label == "key":
            raise UnsupportedModelError(
                f"{where}: its key norm ({type(norm).__name__}) normalises all {heads} KV heads together, one "
                f"statistic over {heads} x {d} channels (as OLMo2 and OLMo3 do): every head is divided by a "
                f"statistic of all of them, so merging heads by groups cannot reproduce it; kv_heads={new_kv} is "
                f"not allowed for this model, only its own {old_kv} (no merging)"
            )
        if layout == "unknown":
            shapes = [tuple(p.shape) for p in norm.parameters()]
            raise UnsupportedModelError(
                f"{where}: its {label} norm ({type(norm).__name__}, parameters {shapes}) has a layout the conversion "
                f"does not know (one weight of {d}, per-head weights [{heads}, {d}], or one norm per head)"
            )


def regrouped_norm(norm, heads: int, d: int, order: list[list[int]]):
    """A copy of a query/key norm for the heads of ``order``: new head i is the mean of old heads ``order[i]`` (one
    head each: a permutation). Shared norms are returned as they are."""
    layout = norm_layout(norm, heads, d)
    if layout == "shared":
        return norm
    new = copy.deepcopy(norm)
    if layout == "list":
        merged = []
        for members in order:
            head = copy.deepcopy(norm.norms[members[0]])
            for name, p in head.named_parameters(recurse=False):
                mean = torch.stack([getattr(norm.norms[a], name).detach() for a in members]).mean(0)
                setattr(head, name, torch.nn.Parameter(mean, requires_grad=p.requires_grad))
            merged.append(head)
        new.norms = torch.nn.ModuleList(merged)
        if hasattr(new, "num_heads"):
            new.num_heads = len(order)
        return new
    for name, p in list(new.named_parameters(recurse=False)):  # per_head [heads, d], or whole [heads * d]
        blocks = p.detach().reshape(heads, d)
        rows = torch.stack([blocks[members].mean(0) for members in order])
        setattr(new, name, torch.nn.Parameter(rows.reshape(-1) if p.ndim == 1 else rows, requires_grad=p.requires_grad))
    return new


@torch.no_grad()
def dry_run(model, kv_heads: int) -> None:
    """One two-token forward of the converted model (its own attention) into a ``DynamicCache``: a conversion that
    fails to run, or stores other than ``kv_heads`` KV heads, is refused at ``apply`` instead of failing at the first
    generate."""
    from transformers import DynamicCache

    from kvstack.stack.apply import cache_kwarg

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    try:
        model(torch.zeros(1, 2, dtype=torch.long, device=device), **{cache_kwarg(model): cache})
    except Exception as err:
        raise UnsupportedModelError(
            f"gqa: {type(model).__name__} does not run after its KV heads were converted ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); the model is restored"
        ) from err
    for i, layer in enumerate(cache.layers):
        stored = (layer.keys.shape[1], layer.values.shape[1])
        if stored != (kv_heads, kv_heads):
            raise UnsupportedModelError(
                f"gqa: after the conversion to {kv_heads} KV heads, layer {i} of {type(model).__name__} stores keys of "
                f"{stored[0]} and values of {stored[1]} heads; the model is restored"
            )


@torch.no_grad()
def convert_layer(attn, q_heads: int, old_kv: int, new_kv: int, x: torch.Tensor | None, pool: bool = True) -> None:
    """Replace one attention module's projections. ``x``: calibration inputs [T, hidden] for ``align``, else None.
    ``pool=False`` stops before merging: heads are regrouped and rotated but all kept (the function is unchanged)."""
    d = attn.head_dim
    group = q_heads // old_kv  # query heads per old KV head
    m = old_kv // new_kv
    eye = torch.eye(d, dtype=torch.float64)
    rot_k = [eye] * old_kv
    rot_v = [eye] * old_kv
    groups = [list(range(n * m, (n + 1) * m)) for n in range(new_kv)]
    if x is not None and m > 1:
        keys = project(attn.k_proj, x, old_kv)
        values = project(attn.v_proj, x, old_kv)
        rotate_keys = head_norms(attn) == (None, None)  # a norm's per-channel weights do not commute with it
        groups = group_heads(keys, values, m, rotate_keys)
        for members in groups:
            for a, r in zip(members, procrustes_group([values[a] for a in members], value_rotation)):
                rot_v[a] = r
            if rotate_keys:
                for a, r in zip(members, procrustes_group([keys[a] for a in members], rope_plane_rotation)):
                    rot_k[a] = r

    def heads(linear):
        w = linear.weight.double().reshape(-1, d, linear.weight.shape[1])
        b = None if linear.bias is None else linear.bias.double().reshape(-1, d)
        return w, b

    wk, bk = heads(attn.k_proj)
    wv, bv = heads(attn.v_proj)
    wq, bq = heads(attn.q_proj)
    wo = attn.o_proj.weight.double().reshape(attn.o_proj.weight.shape[0], q_heads, d)

    def merge(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(rows).mean(0) if pool else torch.cat(rows)

    new_k, new_v, new_bk, new_bv, q_rows, q_bias, o_cols = [], [], [], [], [], [], []
    for members in groups:
        new_k.append(merge([rot_k[a].T @ wk[a] for a in members]))
        new_v.append(merge([rot_v[a].T @ wv[a] for a in members]))
        if bk is not None:
            new_bk.append(merge([bk[a] @ rot_k[a] for a in members]))
        if bv is not None:
            new_bv.append(merge([bv[a] @ rot_v[a] for a in members]))
        for a in members:  # query heads follow their KV head (permutation + key rotation)
            for h in range(a * group, (a + 1) * group):
                q_rows.append(rot_k[a].T @ wq[h])
                if bq is not None:
                    q_bias.append(bq[h] @ rot_k[a])
                o_cols.append(wo[:, h] @ rot_v[a])

    def flat(rows):
        return torch.cat(rows) if rows else None

    attn.k_proj = new_linear(flat(new_k), flat(new_bk), attn.k_proj)
    attn.v_proj = new_linear(flat(new_v), flat(new_bv), attn.v_proj)
    attn.q_proj = new_linear(flat(q_rows), flat(q_bias), attn.q_proj)
    o_bias = attn.o_proj.bias.double() if attn.o_proj.bias is not None else None
    attn.o_proj = new_linear(torch.cat(o_cols, dim=1), o_bias, attn.o_proj)
    kept = new_kv if pool else old_kv
    attn.num_key_value_groups = q_heads // kept
    if hasattr(attn, "num_key_value_heads"):  # StableLM reshapes its keys with it
        attn.num_key_value_heads = kept
    key_order = groups if pool else [[a] for members in groups for a in members]
    query_order = [[h] for members in groups for a in members for h in range(a * group, (a + 1) * group)]
    for q_name, k_name in QK_NORMS:  # the norms follow their heads
        if getattr(attn, k_name, None) is not None:
            setattr(attn, k_name, regrouped_norm(getattr(attn, k_name), old_kv, d, key_order))
        if getattr(attn, q_name, None) is not None:
            setattr(attn, q_name, regrouped_norm(getattr(attn, q_name), q_heads, d, query_order))


def value_rotation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Orthogonal R minimising ||a R - b|| (a, b [T, D]): R = U Vᵀ from the SVD of aᵀ b."""
    u, _, vt = torch.linalg.svd(a.T @ b)
    return u @ vt


def rope_plane_rotation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Block rotation R (one proper 2-D rotation per RoPE plane i, i + D/2) minimising ||a R - b||."""
    d = a.shape[1]
    half = d // 2
    r = torch.zeros(d, d, dtype=a.dtype)
    for i in range(half):
        idx = [i, i + half]
        u, _, vt = torch.linalg.svd(a[:, idx].T @ b[:, idx])
        sign = torch.sign(torch.linalg.det(u @ vt))
        block = u @ torch.diag(torch.stack([torch.ones((), dtype=a.dtype), sign])) @ vt
        r[i, i], r[i, i + half], r[i + half, i], r[i + half, i + half] = block[0, 0], block[0, 1], block[1, 0], block[1, 1]
    return r


def procrustes_group(acts: list[torch.Tensor], solve) -> list[torch.Tensor]:
    """Generalised Procrustes: rotations aligning every member's activations to the group's (aligned) mean."""
    target = acts[0]
    rots = [torch.eye(acts[0].shape[1], dtype=acts[0].dtype) for _ in acts]
    for _ in range(PROCRUSTES_ITERATIONS):
        rots = [solve(a, target) for a in acts]
        target = torch.stack([a @ r for a, r in zip(acts, rots)]).mean(0)
    return rots


def aligned_distance(a: torch.Tensor, b: torch.Tensor, solve) -> float:
    """Relative residual of a aligned to b: ||a R - b||² / (||a||² + ||b||²)."""
    r = solve(a, b)
    return float(((a @ r - b) ** 2).sum() / ((a**2).sum() + (b**2).sum()).clamp_min(1e-30))


def group_heads(keys: torch.Tensor, values: torch.Tensor, m: int, rotate_keys: bool) -> list[list[int]]:
    """Greedy grouping of KV heads into groups of m by aligned key + value distance on calibration data."""
    n = keys.shape[0]
    plain = lambda a, b: torch.eye(a.shape[1], dtype=a.dtype)  # noqa: E731 (no key rotation: raw distance)
    key_solve = rope_plane_rotation if rotate_keys else plain
    cost = torch.zeros(n, n, dtype=torch.float64)
    for a in range(n):
        for b in range(a + 1, n):
            c = aligned_distance(values[a], values[b], value_rotation) + aligned_distance(keys[a], keys[b], key_solve)
            cost[a, b] = cost[b, a] = c
    remaining = list(range(n))
    groups = []
    while remaining:
        head = remaining[0]
        partners = sorted(remaining[1:], key=lambda o: float(cost[head, o]))[: m - 1]
        members = sorted([head, *partners])
        groups.append(members)
        remaining = [h for h in remaining if h not in members]
    return groups
