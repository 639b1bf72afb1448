"""Tiny random-weight causal LMs for seven architectures, for exactness tests.

Import from tests as ``from archs import tiny_model`` (pytest's default
``prepend`` import mode puts ``tests/`` on ``sys.path`` because ``tests/`` has
no ``__init__.py``) or as ``from tests.archs import tiny_model`` from the repo
root (``tests`` then resolves as a namespace package).

Every model is a ``*ForCausalLM`` in eval mode, built from its Config (no
download), with every Linear/Embedding weight re-drawn from N(0, std=0.3) by a
private ``torch.Generator`` seeded with ``seed``; the global RNG state is left
untouched. The large std makes attention far from uniform, so a slightly wrong
mask or position changes the logits measurably. Norm weights keep their
defaults (ones for RMSNorm, zeros for Gemma's ``1 + w`` RMSNorm).

Notes per arch (transformers 5.x):

* llama / qwen2 / qwen3 / phi3: plain causal attention, no sliding window.
  qwen2 has q/k/v biases (re-drawn too); qwen3 has q_norm/k_norm.
* phi3: fused ``qkv_proj``, head_dim = hidden // heads = 16,
  ``partial_rotary_factor=0.5`` (rotary on the first 8 of 16 dims).
* mistral: ``sliding_window=8`` on every layer.
* gemma2: layers alternate sliding(8)/full, ``attn_logit_softcapping=5.0``,
  ``final_logit_softcapping=8.0``, ``query_pre_attn_scalar=32`` (so the
  attention scale 32**-0.5 differs from head_dim**-0.5). Gemma2 does not
  support SDPA (softcap), so ``attn_implementation="sdpa"`` falls back to
  ``"eager"`` for it.
* gemma3 (Gemma3ForCausalLM / Gemma3TextConfig): 4 layers
  [sliding, sliding, full, sliding] with ``sliding_window=8``,
  ``query_pre_attn_scalar=32``, per-layer-type rope (local theta 1e4, global
  theta 1e6), ``final_logit_softcapping=8.0``.
"""

from __future__ import annotations

import torch
from torch import nn

ARCHS: list[str] = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]

#: arches whose configs contain a sliding window that the model actually uses
SLIDING_ARCHS: list[str] = ["mistral", "gemma2", "gemma3"]

SLIDING_WINDOW = 8
INIT_STD = 0.3
BIAS_STD = 0.1

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _config(arch: str, attn_implementation: str):
    """Build the Config for ``arch`` (no model yet)."""
    c = dict(_COMMON)
    if arch == "llama":
        from transformers import LlamaConfig as Cfg

        c.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "mistral":
        from transformers import MistralConfig as Cfg

        c.update(
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif arch == "qwen2":
        from transformers import Qwen2Config as Cfg

        # Qwen2Config has no head_dim field; head_dim = hidden // heads = 16.
        c.update(use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "qwen3":
        from transformers import Qwen3Config as Cfg

        c.update(
            head_dim=16,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif arch == "phi3":
        from transformers import Phi3Config as Cfg

        # head_dim is derived: hidden // heads = 16.
        c.update(
            original_max_position_embeddings=256,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    elif arch == "gemma2":
        from transformers import Gemma2Config as Cfg

        c.update(
            head_dim=16,
            query_pre_attn_scalar=32,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        if attn_implementation == "sdpa":  # Gemma2 declares _supports_sdpa = False (softcap)
            attn_implementation = "eager"
    elif arch == "gemma3":
        from transformers import Gemma3TextConfig as Cfg

        c.update(
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=32,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=8.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    cfg = Cfg(**c)
    cfg._attn_implementation = attn_implementation
    return cfg


def _model_class(arch: str):
    import transformers as tf

    return {
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "phi3": tf.Phi3ForCausalLM,
        "gemma2": tf.Gemma2ForCausalLM,
        "gemma3": tf.Gemma3ForCausalLM,
    }[arch]


@torch.no_grad()
def _reinit(model: nn.Module, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    seen: set[int] = set()  # tied weights (gemma lm_head/embed) are drawn once
    for _, mod in sorted(model.named_modules(), key=lambda kv: kv[0]):
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            w = mod.weight
            if id(w) not in seen:
                seen.add(id(w))
                w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float32) * INIT_STD)
            b = getattr(mod, "bias", None)
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float32) * BIAS_STD)


def tiny_model(
    arch: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **config_overrides,
):
    """Return an eval-mode tiny ``*ForCausalLM`` for ``arch`` with seeded random weights.

    ``config_overrides`` are set as attributes on the config before the model is
    built (e.g. ``sliding_window=10_000`` to disable the window); weights do not
    depend on them as long as shapes are unchanged.
    """
    cfg = _config(arch, attn_implementation)
    for k, v in config_overrides.items():
        setattr(cfg, k, v)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(arch)(cfg)
    _reinit(model, seed)
    model = model.to(dtype)
    model.eval()
    return model
