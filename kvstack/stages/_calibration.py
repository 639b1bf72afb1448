"""Calibration data and model access shared by the stages that prepare the model (``gqa``, static ``channel_prune``,
``key_basis: calibrated`` of transform-coded keys).

**Calibration** (the ``calibration=`` argument of ``kvstack.apply``) is token ids: a list of 1-D (or ``[1, T]``)
integer tensors, one per text, or a 2-D ``[N, T]`` tensor of unpadded rows. Tokenize texts yourself, e.g.
``[torch.tensor(tok(t).input_ids[:512]) for t in texts]``. Calibration text must not be the evaluation text.

Surgery stages need each decoder layer's attention module with separate ``q_proj``/``k_proj``/``v_proj``/``o_proj``
(Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3); fused projections (Phi3's ``qkv_proj``) are rejected by model type
before anything is touched.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstack.stack.base import spec_error
from kvstack.stack.errors import SpecError, UnsupportedModelError

#: model types whose attention fuses the projections; surgery cannot address K/V heads separately
FUSED_QKV = {"phi3": "Phi3 (fused qkv_proj)"}


def reject_fused(stage: str, model_type: str) -> None:
    if model_type in FUSED_QKV:
        raise UnsupportedModelError(
            f"{stage}: model_type={model_type!r} is not supported: {FUSED_QKV[model_type]}; model surgery needs "
            "separate q_proj/k_proj/v_proj/o_proj (Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3)"
        )


def attention_modules(model) -> list[Any]:
    """The self-attention module of every decoder layer, in layer order."""
    mods = [m for m in model.modules() if all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    mods = [m for m in mods if hasattr(m, "layer_idx")]
    if len(mods) != model.config.num_hidden_layers:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found {len(mods)} attention modules with separate q/k/v/o projections for "
            f"{model.config.num_hidden_layers} layers; model surgery cannot address this architecture"
        )
    return sorted(mods, key=lambda m: m.layer_idx)


def calibration_sequences(calibration: Any, stage: str) -> list[torch.Tensor]:
    """Normalise calibration to a list of [1, T] int64 tensors (see the module docstring)."""
    if calibration is None:
        raise SpecError(
            f"{stage} needs calibration: kvstack.apply(model, spec, calibration=[token-id tensors]) "
            "(texts tokenized by you, not the evaluation texts)"
        )
    if isinstance(calibration, torch.Tensor):
        calibration = list(calibration) if calibration.ndim == 2 else [calibration]
    seqs = []
    for i, ids in enumerate(calibration):
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.numel() == 0:
            raise spec_error(f"calibration[{i}]", type(ids).__name__, "a non-empty integer tensor of token ids")
        seqs.append(ids.reshape(1, -1).long())
    if not seqs:
        raise spec_error("calibration", calibration, "at least one token-id tensor")
    return seqs


@torch.no_grad()
def sampled_sequences(model, sequences: int, tokens: int, seed: int, stage: str) -> list[torch.Tensor]:
    """Calibration drawn from the model itself: ``sequences`` rows of ``tokens`` tokens (at most the model's context)
    sampled from its BOS token (temperature 1, no top-k/top-p, EOS not allowed to end a row early), seeded without
    touching the global RNG."""
    bos = getattr(model.generation_config, "bos_token_id", None)
    bos = bos if bos is not None else getattr(model.config, "bos_token_id", None)
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    if bos is None:
        raise SpecError(
            f"{stage} samples its calibration from the model's BOS token and this model has none: pass "
            "kvstack.apply(model, spec, calibration=[token-id tensors]) (texts tokenized by you, not the evaluation "
            "texts)"
        )
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit:
        tokens = min(tokens, int(limit) - 1)  # rows stay within the model's context
    device = next(model.parameters()).device
    start = torch.full((sequences, 1), int(bos), dtype=torch.long, device=device)
    pad = getattr(model.generation_config, "pad_token_id", None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        rows = model.generate(
            start, attention_mask=torch.ones_like(start), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=int(bos) if pad is None else pad,
        )
    return [row[None] for row in rows]


@torch.no_grad()
def attention_inputs(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the hidden states entering self-attention (after the input norm), all tokens stacked:
    [tokens, hidden] in float64."""
    mods = attention_modules(model)
    store: list[list[torch.Tensor]] = [[] for _ in mods]

    def hook(idx):
        def grab(_module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            store[idx].append(x.reshape(-1, x.shape[-1]).double())

        return grab

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(mods)]
    try:
        device = next(model.parameters()).device
        for ids in seqs:
            model(ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(s) for s in store]


def project(linear: torch.nn.Linear, x: torch.Tensor, heads: int) -> torch.Tensor:
    """x [T, hidden] (float64) -> per-head projections [heads, T, D] in float64."""
    w = linear.weight.double()
    y = x @ w.T
    if linear.bias is not None:
        y = y + linear.bias.double()
    return y.reshape(x.shape[0], heads, -1).transpose(0, 1)


@torch.no_grad()
def calibration_logprobs(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    return [torch.log_softmax(model(ids.to(device), use_cache=False).logits[0].double(), -1) for ids in seqs]


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """KL(reference || other) in nats per token over all calibration tokens."""
    total = sum(float((r.exp() * (r - o)).sum()) for r, o in zip(reference, other))
    return total / sum(r.shape[0] for r in reference)


def new_linear(weight: torch.Tensor, bias: torch.Tensor | None, like: torch.nn.Linear) -> torch.nn.Linear:
    """A Linear holding ``weight`` [out, in] (and ``bias``) in the dtype/device of ``like``."""
    ref = like.weight
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight.to(ref.dtype))
        if bias is not None:
            lin.bias.copy_(bias.to(ref.dtype))
    return lin
