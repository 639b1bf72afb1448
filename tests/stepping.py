"""Run a spec the way decoding does: one prefill forward, then one token per forward.

Import from tests as ``from stepping import run`` (the tests folder is on ``sys.path``, as for ``archs``).
"""

from __future__ import annotations

import torch

import kvstack


def run(model, spec, ids, prefill):
    """Prefill ``prefill`` tokens, then one token per forward; returns (cache, logits of every position)."""
    with kvstack.applied(model, spec), torch.no_grad():
        cache = kvstack.cache_for(model)
        logits = [model(ids[:, :prefill], cache=cache).logits]
        logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(prefill, ids.shape[1])]
    return cache, torch.cat(logits, 1)
