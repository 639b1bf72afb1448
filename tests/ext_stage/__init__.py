"""A stage defined outside kvstack/ (as a user's package would): keeps only the newest ``keep`` tokens per layer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvstack import Stage, StageSpec, register_stage


class KeepNewestStage(Stage):
    def after_attention(self, layer, stats) -> None:
        pos = layer.full.positions
        if layer.full.num_tokens > self.spec.keep:
            layer.retain(layer.full, pos >= layer.seen - self.spec.keep)


@register_stage
class KeepNewestSpec(StageSpec):
    """Keep the newest ``keep`` tokens of the full tier."""

    kind: Literal["keep_newest"] = "keep_newest"
    keep: int = Field(default=8, ge=1, description="Tokens kept.")

    def build(self, shape, stack_budget):
        return KeepNewestStage(self, shape, stack_budget)
