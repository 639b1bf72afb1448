"""kvstack — compose KV-cache compression techniques into one Hugging Face transformers cache.

    import kvstack
    kvstack.apply(model, "streaming")          # one call: generate now uses the composed cache
    out = model.generate(ids, max_new_tokens=64)
"""

from kvstack.context import CompressedContext, ContextError, KVStackPipeline, compress_context, register_pipeline
from kvstack.stack.apply import applied, apply, cache_for, remove
from kvstack.stack.base import Budget, Stage, StageSpec
from kvstack.stack.budget import BudgetError
from kvstack.stack.cache import KVStackCache
from kvstack.stack.errors import CacheUsageError, KVStackError, SpecError, UnsupportedModelError
from kvstack.stack.memory import full_cache_bytes
from kvstack.stack.registry import register_stage, stage_specs
from kvstack.stack.shape import SUPPORTED_MODEL_TYPES, ModelShape
from kvstack.stack.spec import StackSpec, list_presets, preset_names
from kvstack.stages.scorers import Scorer, ScorerParams, register_scorer, scorer_names, tier_keys_values

__version__ = "0.1.0"

register_pipeline()  # pipeline("kvstack-text-generation", ...) works after `import kvstack` (kvstack/context.py)

__all__ = [
    "Budget",
    "BudgetError",
    "CacheUsageError",
    "CompressedContext",
    "ContextError",
    "KVStackCache",
    "KVStackError",
    "KVStackPipeline",
    "ModelShape",
    "SUPPORTED_MODEL_TYPES",
    "SpecError",
    "StackSpec",
    "Scorer",
    "ScorerParams",
    "Stage",
    "StageSpec",
    "UnsupportedModelError",
    "applied",
    "apply",
    "cache_for",
    "compress_context",
    "full_cache_bytes",
    "list_presets",
    "preset_names",
    "register_pipeline",
    "register_scorer",
    "register_stage",
    "remove",
    "scorer_names",
    "stage_specs",
    "tier_keys_values",
]
