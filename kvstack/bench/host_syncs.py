"""Host-device synchronisations of one decode step, per preset (they block CUDA graphs and stall the GPU queue).

    python -m kvstack.bench.host_syncs [--presets identity,streaming,...] [--context 256]

A synchronisation is any call that needs a tensor's value on the host: ``bool()``, ``int()``, ``float()``,
``.item()``, ``.tolist()``, ``nonzero`` / ``masked_select`` / ``unique`` (data-dependent shapes) and indexing with a
boolean tensor. They are counted with a ``TorchFunctionMode`` (so the count is the same on CPU and CUDA) over one
decode step of a 2-layer tiny Llama after a ``--context``-token prompt, on the torch path; the first column is per
layer (the step divided by the layers), the second is what the forward outside kvstack adds. Prints a markdown
table; docs/architecture.md shows it.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

SYNC_FUNCTIONS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero", "masked_select",
                  "unique", "argwhere"}


class HostSyncCounter(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host, by function name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_FUNCTIONS:
            self.counts[name] += 1
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _has_bool_index(args[1]):
            self.counts[f"{name}[bool]"] += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=layers, vocab_size=128, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def decode_step_syncs(preset: str, context: int = 256, warm_steps: int = 40) -> tuple[Counter, Counter]:
    """(syncs of one decode step with the stack, syncs of the same step with DynamicCache) after ``context``
    tokens and ``warm_steps`` decode steps (so periodic work, e.g. a KIVI flush, is not the step measured)."""
    import kvstack
    from kvstack.stack.apply import cache_kwarg
    from transformers import DynamicCache

    model = tiny_llama()
    name = cache_kwarg(model)
    ids = torch.randint(3, 128, (1, context + warm_steps + 1), generator=torch.Generator().manual_seed(0))
    counts = []
    for stack in (preset, None):
        if stack is not None:
            kvstack.apply(model, stack)
            cache = kvstack.cache_for(model)
        else:
            cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :context], **{name: cache})
            for t in range(context, context + warm_steps):
                model(ids[:, t : t + 1], **{name: cache})
            with HostSyncCounter() as counter:
                model(ids[:, -1:], **{name: cache})
        counts.append(counter.counts)
        if stack is not None:
            kvstack.remove(model)
    return counts[0], counts[1]


def markdown_table(presets, context: int = 256) -> str:
    lines = ["| preset | host syncs per layer per decode step | outside kvstack | what syncs |",
             "| --- | ---: | ---: | --- |"]
    for preset in presets:
        stack, plain = decode_step_syncs(preset, context)
        extra = stack - plain
        per_layer = sum(extra.values()) / 2
        what = ", ".join(f"{k} x{v / 2:g}" for k, v in sorted(extra.items())) or "none"
        lines.append(f"| {preset} | {per_layer:g} | {sum(plain.values())} | {what} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    import kvstack

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=None, help="Comma-separated presets (default: every preset).")
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args(argv)
    presets = args.presets.split(",") if args.presets else [p for p in kvstack.preset_names() if p != "less-learned"]
    print(markdown_table(presets, args.context))


if __name__ == "__main__":
    main()
