"""Print the identity-exactness figures quoted in the closing notes (not a test; the tests assert the bounds).

    python tests/exactness_report.py

For each architecture and dtype: max |logit difference| of the identity stack vs transformers' DynamicCache, one
prompt fed as prefill + 5-token continuation + single tokens, and for a left-padded batch vs each row run alone.
"""

from __future__ import annotations

import torch
from archs import ARCHS, tiny_model
from test_identity import run_pieces
from transformers import DynamicCache

import kvstack


def single(model) -> float:
    ids = torch.randint(3, 128, (1, 30))
    pos = torch.arange(30)[None]
    ref = run_pieces(model, ids, None, pos, DynamicCache(config=model.config))
    with kvstack.applied(model, "identity"):
        ours = run_pieces(model, ids, None, pos, kvstack.cache_for(model))
    return (ours - ref).abs().max().item()


def padded(model) -> float:
    ids = torch.randint(3, 128, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with kvstack.applied(model, "identity"):
        ours = run_pieces(model, ids, mask, pos, kvstack.cache_for(model))
    worst = 0.0
    for row, pad in ((0, 0), (1, 9)):
        alone = ids[row : row + 1, pad:]
        p = torch.arange(alone.shape[1])[None]
        ref = run_pieces(model, alone, None, p, DynamicCache(config=model.config), cuts=(20 - pad, 25 - pad))
        worst = max(worst, (ours[row, pad:] - ref[0]).abs().max().item())
    return worst


print("| arch | fp32 single | fp32 padded | fp64 single | fp64 padded |")
print("| --- | --- | --- | --- | --- |")
for arch in ARCHS:
    cells = []
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(1)
        model = tiny_model(arch, dtype=dtype)
        cells += [f"{single(model):.1e}", f"{padded(model):.1e}"]
    print(f"| {arch} | " + " | ".join(cells) + " |")
