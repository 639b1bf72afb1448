"""Tiny random-weight causal LMs for the exactness tests: seven core architectures (``ARCHS``, the ones every other test
file runs over) and more decoders (``MORE_ARCHS``, the any-architecture matrix of ``tests/test_any_arch.py``), plus
tiny models of the families kvstack refuses (``refused_model``).

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

More decoders (``MORE_ARCHS``; same 2 layers, hidden 64, 4 query heads / 2 KV heads of 16 unless noted):

* olmo: non-parametric LayerNorm, ``clip_qkv=3.0``. olmo2: q_norm/k_norm over the whole projection (not per head).
* olmo3: layers [sliding(8), full]. cohere2: layers [sliding(8), full], the full layer without RoPE.
* granite: ``attention_multiplier=0.2`` (the attention scale, not head_dim**-0.5), embedding/residual/logit scaling.
* mixtral (MoE, 4 experts, top 2) with ``sliding_window=8``; qwen3_moe (MoE, 4 experts, top 2).
* cohere: interleaved RoPE, per-head qk LayerNorm, ``logit_scale``. stablelm: partial rotary (0.25), qk LayerNorm,
  q/k/v biases. phi: partial rotary (0.5), qk LayerNorm, parallel attention/MLP, MHA (4 KV heads).
* starcoder2: ``sliding_window=8``, biases. gpt_neox: fused query_key_value, partial rotary (0.25), MHA.
* gpt2: learned absolute positions, fused c_attn (Conv1D), MHA. gemma: ``1 + w`` RMSNorm, GeLU.
* smollm3: the second layer without RoPE (``no_rope_layers``). glm: partial rotary (0.5), interleaved halves.
* falcon (transformers >= 5.25, which moved it onto the attention interface): the new decoder architecture
  (Falcon-40B/180B's), 2 KV heads, fused query_key_value, parallel attention/MLP, rotary. The multi-query variant
  (Falcon-7B's) is tested for exactness in ``tests/test_any_arch.py``; ALiBi Falcon is refused (``REFUSED``).
* MoE archs (``MOE_ARCHS``) build with ``experts_implementation="eager"`` (the default grouped_mm kernel has no
  float64 CPU kernel).
"""

from __future__ import annotations

import torch
from torch import nn

ARCHS: list[str] = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]

#: arches whose configs contain a sliding window that the model actually uses
SLIDING_ARCHS: list[str] = ["mistral", "gemma2", "gemma3"]

#: more decoder architectures, supported by detection (not by name); see tests/test_any_arch.py
MORE_ARCHS: list[str] = [
    "olmo", "olmo2", "olmo3", "granite", "mixtral", "cohere", "cohere2", "stablelm", "starcoder2", "qwen3_moe",
    "gpt_neox", "gpt2", "gemma", "phi", "smollm3", "glm",
]


def falcon_uses_attention_interface() -> bool:
    """transformers 5.25 moved Falcon onto the attention interface; before, it computed attention itself."""
    import inspect

    from transformers.models.falcon import modeling_falcon

    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(modeling_falcon)


if falcon_uses_attention_interface():
    MORE_ARCHS.append("falcon")
ALL_ARCHS: list[str] = ARCHS + MORE_ARCHS
#: mixture-of-experts archs
MOE_ARCHS: list[str] = ["mixtral", "qwen3_moe"]

SLIDING_WINDOW = 8
INIT_STD = 0.3
BIAS_STD = 0.1

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

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
    elif arch == "olmo":
        from transformers import OlmoConfig as Cfg

        c.update(clip_qkv=3.0, rope_parameters=dict(_ROPE))
    elif arch == "olmo2":
        from transformers import Olmo2Config as Cfg

        c.update(rope_parameters=dict(_ROPE))
    elif arch == "olmo3":
        from transformers import Olmo3Config as Cfg

        c.update(
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(_ROPE),
        )
    elif arch == "granite":
        from transformers import GraniteConfig as Cfg

        c.update(
            attention_multiplier=0.2,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            rope_parameters=dict(_ROPE),
        )
    elif arch == "mixtral":
        from transformers import MixtralConfig as Cfg

        c.update(
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            rope_parameters=dict(_ROPE),
        )
    elif arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig as Cfg

        c.update(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            rope_parameters=dict(_ROPE),
        )
    elif arch == "cohere":
        from transformers import CohereConfig as Cfg

        c.update(use_qk_norm=True, logit_scale=0.5, rope_parameters=dict(_ROPE))
    elif arch == "cohere2":
        from transformers import Cohere2Config as Cfg

        c.update(
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            logit_scale=0.5,
            rope_parameters=dict(_ROPE),
        )
    elif arch == "stablelm":
        from transformers import StableLmConfig as Cfg

        c.update(
            qk_layernorm=True,
            use_qkv_bias=True,
            rope_parameters=dict(_ROPE, partial_rotary_factor=0.25),
        )
    elif arch == "starcoder2":
        from transformers import Starcoder2Config as Cfg

        c.update(sliding_window=SLIDING_WINDOW, use_bias=True, rope_parameters=dict(_ROPE))
    elif arch == "gpt_neox":
        from transformers import GPTNeoXConfig as Cfg

        c.pop("num_key_value_heads")
        c.update(rope_parameters=dict(_ROPE, partial_rotary_factor=0.25))
    elif arch == "gpt2":
        from transformers import GPT2Config as Cfg

        c.pop("num_key_value_heads")
        c.pop("max_position_embeddings")
        c.update(n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif arch == "gemma":
        from transformers import GemmaConfig as Cfg

        c.update(head_dim=16, rope_parameters=dict(_ROPE))
    elif arch == "phi":
        from transformers import PhiConfig as Cfg

        c.update(num_key_value_heads=4, qk_layernorm=True, rope_parameters=dict(_ROPE, partial_rotary_factor=0.5))
    elif arch == "smollm3":
        from transformers import SmolLM3Config as Cfg

        c.update(no_rope_layers=[1, 0], rope_parameters=dict(_ROPE))
    elif arch == "glm":
        from transformers import GlmConfig as Cfg

        c.update(head_dim=16, rope_parameters=dict(_ROPE, partial_rotary_factor=0.5))
    elif arch == "falcon":
        from transformers import FalconConfig as Cfg

        kv_heads = c.pop("num_key_value_heads")
        c.update(ffn_hidden_size=c.pop("intermediate_size"), new_decoder_architecture=True, num_kv_heads=kv_heads, rope_parameters=dict(_ROPE))
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ALL_ARCHS}")
    cfg = Cfg(**c)
    cfg._attn_implementation = attn_implementation
    if arch in MOE_ARCHS:
        cfg._experts_implementation = "eager"
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
        "olmo": tf.OlmoForCausalLM,
        "olmo2": tf.Olmo2ForCausalLM,
        "olmo3": tf.Olmo3ForCausalLM,
        "granite": tf.GraniteForCausalLM,
        "mixtral": tf.MixtralForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "cohere": tf.CohereForCausalLM,
        "cohere2": tf.Cohere2ForCausalLM,
        "stablelm": tf.StableLmForCausalLM,
        "starcoder2": tf.Starcoder2ForCausalLM,
        "gpt_neox": tf.GPTNeoXForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
        "gemma": tf.GemmaForCausalLM,
        "phi": tf.PhiForCausalLM,
        "smollm3": tf.SmolLM3ForCausalLM,
        "glm": tf.GlmForCausalLM,
        "falcon": tf.FalconForCausalLM,
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
    # matrices outside Linear/Embedding (GPT-2's Conv1D, MoE expert banks and routers) are drawn afterwards, so the
    # seven core archs (which have none) keep the weights they always had
    for name, w in sorted(model.named_parameters(remove_duplicate=False), key=lambda kv: kv[0]):
        if w.ndim >= 2 and id(w) not in seen:
            seen.add(id(w))
            w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float32) * INIT_STD)


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


# --------------------------------------------------------------------------------------------- refused families
#: families kvstack refuses, each with a regex of the reason its UnsupportedModelError must give
REFUSED: dict[str, str] = {
    "t5": "encoder-decoder",
    "mllama": "cross-attention",
    "gpt2_cross_attention": "cross-attention",
    "deepseek_v3": "multi-head latent attention",
    "mamba": "linear-attention / recurrent / state-space",
    "recurrent_gemma": "linear-attention / recurrent / state-space",
    "qwen3_next": "linear-attention / recurrent / state-space",
    "bloom": "computes attention itself",
    "gpt_oss": "attention sinks",
    "llama4": "chunked local attention",
    "gemma3_bidirectional": "bidirectional",
    "falcon_alibi": "ALiBi",
}
if not falcon_uses_attention_interface():
    REFUSED["falcon"] = "computes attention itself"


def refused_model(family: str, seed: int = 0):
    """A tiny eval-mode model of a family in ``REFUSED`` (random weights, float32)."""
    import transformers as tf

    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    small.update(ids)
    if family == "t5":
        model = tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
        )
    elif family == "mllama":
        model = tf.MllamaForCausalLM(
            tf.MllamaTextConfig(**small, num_key_value_heads=2, cross_attention_layers=[1])
        )
    elif family == "gpt2_cross_attention":
        model = tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, add_cross_attention=True, **ids
            )
        )
    elif family == "deepseek_v3":
        model = tf.DeepseekV3ForCausalLM(
            tf.DeepseekV3Config(
                **small, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                moe_intermediate_size=32, first_k_dense_replace=1,
            )
        )
    elif family == "mamba":
        model = tf.MambaForCausalLM(
            tf.MambaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=4, **ids)
        )
    elif family == "recurrent_gemma":
        model = tf.RecurrentGemmaForCausalLM(
            tf.RecurrentGemmaConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=1, lru_width=64, attention_window_size=8, **ids,
            )
        )
    elif family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(
            tf.Qwen3NextConfig(
                **small, num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            )
        )
    elif family == "falcon":
        model = tf.FalconForCausalLM(
            tf.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **ids)
        )
    elif family == "falcon_alibi":
        model = tf.FalconForCausalLM(
            tf.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True, **ids)
        )
    elif family == "bloom":
        model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, **ids))
    elif family == "gpt_oss":
        model = tf.GptOssForCausalLM(
            tf.GptOssConfig(
                **small, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            )
        )
    elif family == "llama4":
        model = tf.Llama4ForCausalLM(
            tf.Llama4TextConfig(
                **small, intermediate_size_mlp=128, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                attention_chunk_size=8, layer_types=["chunked_attention", "full_attention"],
            )
        )
    elif family == "gemma3_bidirectional":
        return tiny_model("gemma3", seed=seed, use_bidirectional_attention=True)
    else:
        raise ValueError(f"unknown refused family {family!r}; expected one of {list(REFUSED)}")
    model.eval()
    return model


def smollm2_shape(dtype=torch.bfloat16):
    """SmolLM2-135M's cache dimensions (its GGUF's metadata: 30 layers, 9 query / 3 KV heads of 64 channels, RoPE
    base 1e5), for sizing and validating specs without the model's weights."""
    from transformers import LlamaConfig

    from kvstack.stack.shape import ModelShape

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0)
    return ModelShape.from_config(config, dtype=dtype)
