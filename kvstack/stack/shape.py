"""The few facts about a model that the stack needs, and the rule that decides whether kvstack can hold its cache.

Support is detected from the model itself, not looked up by name (:func:`support_problem`):

* **config** — causal self-attention only: no encoder-decoder, no cross-attention layers, no multi-head latent
  attention (``kv_lora_rank``), every layer ``full_attention`` or ``sliding_attention`` (no linear-attention,
  recurrent, state-space, chunked or indexed layers), no KV sharing between layers, no bidirectional attention, no
  ALiBi bias added to the mask (``alibi``);
* **modules** — every decoder layer has exactly one attention module that stores its keys/values with
  ``cache.update(..., layer_idx)`` and then calls transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``),
  with no argument kvstack's attention would ignore (attention sinks ``s_aux``, a relative position bias, sparse
  ``indices``), causal (``module.is_causal``), and the model builds its masks with ``transformers.masking_utils``.

The facts (heads, head_dim, per-layer sliding windows, partial rotary) come from the config, with each attention
module's own ``head_dim`` / ``sliding_window`` attributes taking precedence when it has them (they are what the
module passes to the attention function).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from .errors import UnsupportedModelError

#: model_type -> family name of the architectures covered by the identity-exactness tests (``tests/test_identity.py``,
#: ``tests/test_any_arch.py``). Informational: support is detected from the model (:func:`support_problem`), so
#: architectures not listed here work too when they pass the detection.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "phi3": "Phi3",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3",
    "olmo": "OLMo",
    "olmo2": "OLMo2",
    "olmo3": "OLMo3",
    "granite": "Granite",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3-MoE",
    "cohere": "Cohere",
    "cohere2": "Cohere2",
    "stablelm": "StableLM",
    "starcoder2": "Starcoder2",
    "gpt_neox": "GPT-NeoX",
    "gpt2": "GPT-2",
    "gemma": "Gemma",
    "phi": "Phi",
    "smollm3": "SmolLM3",
    "glm": "GLM",
    "falcon": "Falcon (rotary; transformers >= 5.25)",
}

#: layer types whose cache is per-token keys/values under a causal (optionally sliding-window) mask
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

#: keyword arguments of the attention-interface call that kvstack's attention honours or that carry no semantics
#: for it (flash-attention varlen bookkeeping, position ids, the request for attention weights)
ACCEPTED_ATTENTION_KWARGS = frozenset(
    {
        "dropout", "scaling", "softcap", "sliding_window", "attention_mask", "is_causal", "position_ids",
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "output_attentions", "layer_idx",
    }
)

#: attention-interface arguments that change the attention result in a way kvstack's attention does not reproduce
_REFUSED_ATTENTION_KWARGS = {
    "s_aux": "attention sinks (a learned per-head logit added to the softmax denominator)",
    "sinks": "attention sinks (a learned per-head logit added to the softmax denominator)",
    "position_bias": "a relative position bias added to the attention logits",
    "indices": "sparse attention over indexer-selected keys",
    "block_indices": "block-sparse attention over selected key blocks",
}

_MASK_BUILDERS = (
    "create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate",
)


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
    #: the transformers config the shape was read from (None for hand-built shapes), for stages that need more than
    #: these dimensions (pre-RoPE key quantization reads the RoPE frequencies); not part of equality
    config: Any = field(default=None, compare=False, repr=False)
    #: a weak reference to the model the shape was read from (None for shapes from a config), for stages that derive
    #: constants from its weights (transform coding's bases); not part of equality
    model: Any = field(default=None, compare=False, repr=False)

    @property
    def value_dim(self) -> int:
        return self.head_dim

    @classmethod
    def from_config(cls, config, dtype: torch.dtype | None = None) -> "ModelShape":
        """The shape from a config alone (memory bounds, validation). Refuses configs kvstack cannot hold
        (:func:`config_problem`); the module checks need the model (:meth:`from_model`)."""
        problem = config_problem(config)
        if problem is not None:
            raise UnsupportedModelError(_refusal(config, problem))
        return cls._build(config, dtype)

    @classmethod
    def from_model(cls, model) -> "ModelShape":
        """The shape of a model's cache, after checking the model (config and attention modules) can be held."""
        check_supported(model)
        param = next(model.parameters(), None)
        dtype = param.dtype if param is not None else None
        modules = caching_attention_modules(model)
        head_dims = {m.head_dim for m in modules.values() if isinstance(getattr(m, "head_dim", None), int)}
        windows = {i: m.sliding_window for i, m in modules.items() if _is_window(getattr(m, "sliding_window", 0))}
        shape = cls._build(model.config, dtype, head_dim=head_dims.pop() if len(head_dims) == 1 else None,
                           module_windows=windows)
        return dataclasses.replace(shape, model=weakref.ref(model))

    @classmethod
    def _build(cls, config, dtype, head_dim: int | None = None, module_windows: dict | None = None) -> "ModelShape":
        text = _text_config(config)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = head_dim or _config_head_dim(text)
        layers = text.num_hidden_layers
        windows = list(config_windows(text))
        for i, window in (module_windows or {}).items():
            if 0 <= i < layers:
                windows[i] = window or None
        return cls(
            model_type=getattr(config, "model_type", None) or getattr(text, "model_type", None),
            num_layers=layers,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype or _config_dtype(config) or torch.float32,
            layer_windows=tuple(windows),
            rope_dim=_rope_dim(text, head_dim),
            config=config,
        )


# ----------------------------------------------------------------------------------------------- config facts
def _text_config(config):
    """The decoder's config (a multimodal config's text config; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except Exception:  # pragma: no cover - configs with unusual sub-configs
        return config


def _config_head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _config_dtype(config):
    cfg_dtype = getattr(config, "dtype", None)
    if cfg_dtype is None and "dtype" not in dir(config):  # transformers < 5 named it torch_dtype
        cfg_dtype = getattr(config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = getattr(torch, cfg_dtype, None)
    return cfg_dtype if isinstance(cfg_dtype, torch.dtype) else None


def _rope_dim(text, head_dim: int) -> int | None:
    """Channels rotated by RoPE when only part of the head is (partial rotary), else None."""
    rope = getattr(text, "rope_parameters", None)
    factor = getattr(text, "partial_rotary_factor", None)
    if factor is None and isinstance(rope, dict):
        # per-layer-type rope parameters ({"sliding_attention": {...}, ...}) or one dict
        inner = [v for v in rope.values() if isinstance(v, dict)] or [rope]
        factors = {p.get("partial_rotary_factor") for p in inner} - {None}
        factor = factors.pop() if len(factors) == 1 else None
    if factor is None:
        factor = getattr(text, "rotary_pct", None)
    if factor is not None and factor != 1.0:
        return int(head_dim * factor)
    rotary_dim = getattr(text, "rotary_dim", None)  # GPT-J / CodeGen: an absolute channel count
    if isinstance(rotary_dim, int) and 0 < rotary_dim < head_dim:
        return rotary_dim
    return None


def _is_window(window) -> bool:
    return window is None or (isinstance(window, int) and not isinstance(window, bool) and window > 0)


def _layer_configs(text) -> list:
    """One config per layer: the per-layer views of a heterogeneous config, else the config itself."""
    layers = text.num_hidden_layers
    if getattr(text, "is_heterogeneous", False):
        return list(text.per_layer_config)[:layers]
    return [text] * layers


def config_layer_types(text) -> list[str]:
    """Per-layer attention type the way transformers' ``DynamicCache`` reads it (``layer_types``, else sliding when
    ``sliding_window`` is set, chunked when ``attention_chunk_size`` is)."""
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)[: text.num_hidden_layers]
    types = []
    for layer in _layer_configs(text):
        if getattr(layer, "sliding_window", None) is not None:
            types.append("sliding_attention")
        elif getattr(layer, "attention_chunk_size", None) is not None:
            types.append("chunked_attention")
        else:
            types.append("full_attention")
    return types


def config_windows(text) -> tuple[int | None, ...]:
    """Sliding window per layer from the config (None: full attention)."""
    return tuple(
        getattr(layer, "sliding_window", None) if t == "sliding_attention" else None
        for t, layer in zip(config_layer_types(text), _layer_configs(text))
    )


# ----------------------------------------------------------------------------------------------- the support rule
def _refusal(config, problem: str) -> str:
    model_type = getattr(config, "model_type", None)
    return f"kvstack cannot hold the KV cache of model_type={model_type!r}: {problem}"


def check_supported(model) -> None:
    """Raise :class:`UnsupportedModelError` saying why when kvstack cannot hold ``model``'s cache."""
    problem = support_problem(model)
    if problem is not None:
        raise UnsupportedModelError(_refusal(model.config, problem))


def support_problem(model) -> str | None:
    """Why kvstack cannot hold ``model``'s KV cache, or None when it can (config, then attention modules)."""
    return config_problem(model.config) or module_problem(model)


def _layer_type_problem(index: int, layer_type: str) -> str:
    t = layer_type.lower()
    if any(w in t for w in ("linear", "mamba", "recurr", "ssm", "conv", "delta", "rwkv", "hybrid", "lightning")):
        return (
            f"layer {index} is {layer_type!r}: a linear-attention / recurrent / state-space layer keeps a running "
            "state instead of per-token keys and values, so there is nothing for kvstack's tiers to hold "
            "(hybrid models are not supported)"
        )
    if "chunk" in t:
        return (
            f"layer {index} is {layer_type!r}: chunked local attention (attention_chunk_size) masks by chunk, "
            "kvstack's attention builds only causal and sliding-window masks"
        )
    if any(w in t for w in ("index", "sparse", "compress")):
        return (
            f"layer {index} is {layer_type!r}: sparse/compressed attention selects or compresses keys itself, "
            "kvstack's attention attends to every stored token"
        )
    if t in ("moe", "mlp", "dense", "dummy"):
        return f"layer {index} is {layer_type!r}: a layer without attention (kvstack needs one KV cache per layer)"
    return (
        f"layer {index} is {layer_type!r}, not causal full or sliding-window attention "
        f"(supported layer types: {', '.join(ATTENTION_LAYER_TYPES)})"
    )


def config_problem(config) -> str | None:
    """Why the config describes a model kvstack cannot hold, or None (see the module docstring)."""
    if getattr(config, "is_encoder_decoder", False):
        return (
            "an encoder-decoder model: its decoder's cross-attention reads the encoder's keys/values (an "
            "EncoderDecoderCache); kvstack holds only the causal self-attention cache of decoder-only models"
        )
    text = _text_config(config)
    cross = getattr(text, "cross_attention_layers", None)
    if cross:
        return (
            f"cross-attention layers {list(cross)} attend to vision/encoder states, not to decoded tokens; kvstack "
            "holds only causal self-attention caches"
        )
    if getattr(text, "add_cross_attention", False):
        return (
            "add_cross_attention=True: cross-attention to encoder states; kvstack holds only causal self-attention "
            "caches"
        )
    if getattr(text, "kv_lora_rank", None):
        return (
            f"multi-head latent attention (kv_lora_rank={text.kv_lora_rank}): keys (qk_nope_head_dim + "
            "qk_rope_head_dim channels, RoPE on a part) and values (v_head_dim) have different widths and come from a "
            "shared latent; kvstack's tiers hold keys and values of one head_dim per KV head"
        )
    for index, layer_type in enumerate(config_layer_types(text)):
        if layer_type not in ATTENTION_LAYER_TYPES:
            return _layer_type_problem(index, layer_type)
    if getattr(text, "num_attention_heads", None) is None:
        return (
            "the config has no attention heads (num_attention_heads): a state-space / recurrent model keeps a "
            "running state, not per-token keys and values"
        )
    if getattr(text, "hybrid_override_pattern", None):
        pattern = text.hybrid_override_pattern
        if isinstance(pattern, str) and set(pattern) - {"*"}:
            return (
                f"hybrid_override_pattern={pattern!r}: layers other than attention (mamba / MLP blocks) have no "
                "per-token keys and values (hybrid models are not supported)"
            )
    if getattr(text, "alibi", False):
        return (
            "ALiBi (alibi=True): a per-head linear position bias the model adds to its attention mask; kvstack's "
            "attention takes a padding mask and adds no position bias"
        )
    if getattr(text, "attention_chunk_size", None) is not None:
        return (
            f"chunked local attention (attention_chunk_size={text.attention_chunk_size}) masks by chunk; kvstack's "
            "attention builds only causal and sliding-window masks"
        )
    if getattr(text, "is_causal", True) is False or getattr(text, "use_bidirectional_attention", False):
        return "bidirectional (non-causal) attention: kvstack's cache and masks are for causal decoding"
    if getattr(text, "num_kv_shared_layers", 0) or "reuse" in (getattr(text, "kv_sharing_modes", None) or ()):
        return (
            "layers reuse the keys/values of other layers (KV sharing): a compressed layer would change what the "
            "sharing layers read"
        )
    if getattr(text, "is_heterogeneous", False):
        per_layer = set(text.per_layer_attributes or ())
        varying = sorted({"num_attention_heads", "num_key_value_heads", "head_dim"} & per_layer)
        if varying:
            return (
                f"a heterogeneous config whose layers differ in {', '.join(varying)} (per_layer_config): kvstack needs "
                "the same KV heads and head_dim in every layer"
            )
    return None


@dataclass(frozen=True)
class _ClassSource:
    """What the source of an ``nn.Module`` class's ``forward`` (and the methods it calls) says about its attention."""

    name: str
    readable: bool
    uses_interface: bool  # calls transformers' attention interface (ALL_ATTENTION_FUNCTIONS)
    updates_cache: bool  # stores keys/values with cache.update(..., layer_idx)
    interface_kwargs: frozenset[str]  # keyword names of the attention-interface calls
    non_causal_call: bool  # an attention-interface call with is_causal=False


@lru_cache(maxsize=None)
def _module_tree(module_name: str):
    module = sys.modules.get(module_name)
    if module is None:
        return None, ""
    try:
        source = inspect.getsource(module)
        return ast.parse(source), source
    except (OSError, TypeError, SyntaxError):
        return None, ""


def _class_node(klass):
    tree, _ = _module_tree(klass.__module__)
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                return node
    try:  # a class defined elsewhere than at the top of its module (a notebook, a factory)
        return ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


def _interface_calls(node: ast.AST) -> tuple[bool, list[ast.Call]]:
    """Calls of transformers' attention interface in ``node``: a name bound to ``ALL_ATTENTION_FUNCTIONS[...]`` /
    ``.get_interface(...)`` (or the module's ``eager_attention_forward``) and called, or a direct call."""
    names = {"eager_attention_forward"}
    uses = False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "ALL_ATTENTION_FUNCTIONS":
            uses = True
        if isinstance(sub, (ast.Assign, ast.AnnAssign)) and sub.value is not None:
            if "ALL_ATTENTION_FUNCTIONS" in ast.unparse(sub.value):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    calls = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Name) and func.id in names:
                calls.append(sub)
            elif not isinstance(func, ast.Name) and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(func):
                calls.append(sub)
    return uses, calls


def _is_cache_update(call: ast.Call) -> bool:
    """``<cache>.update(key_states, value_states, self.layer_idx, ...)`` (not a ``dict.update``)."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "update"):
        return False
    by_keyword = any(k.arg == "layer_idx" for k in call.keywords)
    if len(call.args) < 2 or (len(call.args) < 3 and not by_keyword):
        return False
    return "layer_idx" in ast.unparse(call)


def _own_code(klass) -> bool:
    """A class whose source says how a model computes attention: a model file of transformers, or user code
    (torch's modules and transformers' shared base classes say nothing about it)."""
    module = klass.__module__ or ""
    if klass in (torch.nn.Module, object) or module == "torch" or module.startswith("torch."):
        return False
    shared = module == "transformers" or module.startswith("transformers.")  # not remote code (transformers_modules)
    return module.startswith("transformers.models.") or not shared


def _is_super_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _forward_functions(klass) -> list[ast.FunctionDef] | None:
    """The source of ``klass.forward`` and of every method it reaches through ``self.name(...)`` or
    ``super().name(...)``, resolved along the MRO as Python would; None when that source cannot be read."""
    mro = [k for k in klass.__mro__ if _own_code(k)]
    nodes: dict[type, ast.ClassDef | None] = {}

    def lookup(name: str, start: int = 0):
        for i in range(start, len(klass.__mro__)):
            owner = klass.__mro__[i]
            if name not in vars(owner):
                continue
            if owner not in mro:  # torch's or transformers' shared code: nothing about attention
                return None
            if owner not in nodes:
                nodes[owner] = _class_node(owner)
            node = nodes[owner]
            if node is None:
                raise LookupError(owner.__name__)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return i, item
            return None  # an attribute assigned in the class body, not a def
        return None

    try:
        first = lookup("forward")
        found, todo, seen = [], [first] if first else [], set()
        while todo:
            index, function = todo.pop()
            if id(function) in seen:
                continue
            seen.add(id(function))
            found.append(function)
            for sub in ast.walk(function):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                    target = sub.func.value
                    if isinstance(target, ast.Name) and target.id == "self":
                        reached = lookup(sub.func.attr)
                    elif _is_super_call(target):
                        reached = lookup(sub.func.attr, index + 1)
                    else:
                        continue
                    if reached is not None:
                        todo.append(reached)
    except LookupError:
        return None
    return found


@lru_cache(maxsize=None)
def _class_source(klass) -> _ClassSource:
    """What ``klass.forward`` (and the methods it calls) does: attention interface, cache update, call keywords."""
    functions = _forward_functions(klass)
    uses_interface, updates_cache, non_causal = False, False, False
    kwargs: set[str] = set()
    for function in functions or ():
        uses, calls = _interface_calls(function)
        uses_interface |= uses
        for call in calls:
            for keyword in call.keywords:
                if keyword.arg is None:
                    continue
                kwargs.add(keyword.arg)
                value = keyword.value
                if keyword.arg == "is_causal" and isinstance(value, ast.Constant) and value.value is False:
                    non_causal = True
        updates_cache |= any(isinstance(s, ast.Call) and _is_cache_update(s) for s in ast.walk(function))
    return _ClassSource(klass.__name__, functions is not None, uses_interface, updates_cache, frozenset(kwargs),
                        non_causal)


def _is_pretrained(module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def _inspected(module) -> bool:
    """Modules whose class may compute attention: not torch's, not a whole (pre-trained) model."""
    return _own_code(type(module)) and not _is_pretrained(module)


def _mask_source(model) -> str:
    """The source files of the ``forward`` of every (sub-)model: where a model builds its attention masks."""
    files: dict[str, str] = {}
    for module in model.modules():
        if _is_pretrained(module):
            owner = next((k for k in type(module).__mro__ if "forward" in vars(k)), None)
            if owner is not None and owner.__module__ not in files:
                files[owner.__module__] = _module_tree(owner.__module__)[1]
    return "\n".join(files.values())


def caching_attention_modules(model) -> dict[int, torch.nn.Module]:
    """layer index -> the attention module that stores that layer's keys/values with ``cache.update``."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        if not _inspected(module):
            continue
        source = _class_source(type(module))
        layer_idx = getattr(module, "layer_idx", None)
        if source.updates_cache and isinstance(layer_idx, int):
            found.setdefault(layer_idx, module)
    return found


def module_problem(model) -> str | None:
    """Why the model's attention modules cannot run on kvstack's cache and attention, or None."""
    text = _text_config(model.config)
    layers = text.num_hidden_layers
    caching: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        if not _inspected(module):
            continue
        klass = type(module)
        source = _class_source(klass)
        name = klass.__name__
        if not source.updates_cache:
            if "Attention" in name and "layer_idx" in vars(module) and not source.readable:
                return f"cannot read the source of {name} to check how it computes attention"
            continue
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int):
            return f"{name} writes the cache but has no integer layer_idx"
        if not source.uses_interface:
            return (
                f"{name} computes attention itself instead of calling transformers' attention interface "
                "(ALL_ATTENTION_FUNCTIONS), so kvstack's attention could not read the compressed cache"
            )
        if getattr(module, "kv_lora_rank", None):
            return (
                f"{name} (layer {layer_idx}) is multi-head latent attention (kv_lora_rank={module.kv_lora_rank}): keys "
                "and values of different widths from a shared latent; kvstack's tiers hold one head_dim per KV head"
            )
        if getattr(module, "is_cross_attention", False) or "CrossAttention" in name:
            return f"{name} (layer {layer_idx}) is cross-attention; kvstack holds only causal self-attention caches"
        if getattr(module, "is_causal", True) is False or source.non_causal_call:
            return f"{name} (layer {layer_idx}) is not causal (is_causal=False); kvstack's cache is for causal decoding"
        refused = sorted(set(source.interface_kwargs) & set(_REFUSED_ATTENTION_KWARGS))
        if refused:
            return (
                f"{name} passes {refused[0]}= to the attention function: {_REFUSED_ATTENTION_KWARGS[refused[0]]}, "
                "which kvstack's attention does not compute"
            )
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            return f"{name} has attention sinks (module.sinks), which kvstack's attention does not compute"
        unknown = sorted(set(source.interface_kwargs) - ACCEPTED_ATTENTION_KWARGS)
        if unknown:
            return (
                f"{name} passes {', '.join(k + '=' for k in unknown)} to the attention function; kvstack's attention "
                f"honours only {', '.join(sorted(ACCEPTED_ATTENTION_KWARGS))}"
            )
        caching.setdefault(layer_idx, []).append(module)
    if not caching:
        return (
            "no attention module stores keys/values with cache.update(..., layer_idx) and calls transformers' "
            "attention interface"
        )
    doubled = sorted(i for i, mods in caching.items() if len(mods) > 1)
    if doubled:
        i = doubled[0]
        names = ", ".join(type(m).__name__ for m in caching[i])
        return f"layer {i} has {len(caching[i])} modules writing the cache ({names})"
    missing = sorted(set(range(layers)) - set(caching))
    if missing:
        return (
            f"layers {missing} have no attention module storing keys/values through cache.update (recurrent or "
            "linear-attention layers?): kvstack needs per-token keys and values in every layer"
        )
    extra = sorted(set(caching) - set(range(layers)))
    if extra:
        return f"attention modules with layer_idx {extra} beyond num_hidden_layers={layers}"
    windows = config_windows(text)
    for i, mods in caching.items():
        module = mods[0]
        window = getattr(module, "sliding_window", windows[i])
        if not _is_window(window):
            window = windows[i]
        if window is not None and "sliding_window" not in _class_source(type(module)).interface_kwargs:
            return (
                f"layer {i} has a sliding window ({window}) that {type(module).__name__} does not pass to the "
                "attention function (it would live only in the model's mask, which kvstack rebuilds from positions)"
            )
    head_dims = {m.head_dim for mods in caching.values() for m in mods if isinstance(getattr(m, "head_dim", None), int)}
    if len(head_dims) > 1:
        return f"layers have different head_dim {sorted(head_dims)}; kvstack needs one head_dim in every layer"
    mask_source = _mask_source(model)
    if mask_source and not any(builder in mask_source for builder in _MASK_BUILDERS):
        return (
            "the model builds its attention masks itself, not with transformers.masking_utils "
            "(create_causal_mask / create_sliding_window_causal_mask), so kvstack cannot build them from positions"
        )
    return None
