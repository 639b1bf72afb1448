"""The few facts about a model that the stack needs, read once from its config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UnsupportedModelError

#: model_type -> family name; every family here is covered by the identity-exactness tests.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "phi3": "Phi3",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3",
}


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the KV cache of one model: what stages validate against and size themselves by."""

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layer_windows: tuple[int | None, ...]  # sliding window per layer (None: full attention)
    rope_dim: int | None = None  # channels rotated by RoPE (partial rotary), None when all

    @property
    def value_dim(self) -> int:
        return self.head_dim

    @classmethod
    def from_config(cls, config, dtype: torch.dtype | None = None) -> "ModelShape":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_MODEL_TYPES.items())
            raise UnsupportedModelError(
                f"kvstack does not support model_type={model_type!r}; supported architectures: {supported}"
            )
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types[:layers])
        else:
            windows = (window,) * layers if window else (None,) * layers
        partial = getattr(config, "partial_rotary_factor", None)
        rope_dim = int(head_dim * partial) if partial not in (None, 1.0) else None
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = getattr(torch, cfg_dtype)
        return cls(
            model_type=model_type,
            num_layers=layers,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype or cfg_dtype or torch.float32,
            layer_windows=windows,
            rope_dim=rope_dim,
        )

    @classmethod
    def from_model(cls, model) -> "ModelShape":
        param = next(model.parameters(), None)
        return cls.from_config(model.config, dtype=param.dtype if param is not None else None)
