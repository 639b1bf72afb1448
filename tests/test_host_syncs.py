"""The decode step's host synchronisations stay what docs/long-context.md says (a new sync in the hot path fails)."""

from __future__ import annotations

import pytest
import torch

from kvstack.bench.host_syncs import HostSyncCounter, decode_step_syncs

#: per layer and decode step, steady state (docs/long-context.md); 2 layers in the probe model
DOCUMENTED = {"identity": 0, "kivi-4": 0, "obcache-kivi": 0, "snapkv": 0, "streaming": 1, "h2o": 1}


@pytest.mark.parametrize("preset", sorted(DOCUMENTED))
def test_decode_step_syncs_are_as_documented(preset):
    stack, plain = decode_step_syncs(preset)  # the documented setting: 256-token prompt, 40 warm steps
    assert sum((stack - plain).values()) == 2 * DOCUMENTED[preset], dict(stack - plain)


def test_the_counter_sees_every_kind_of_sync():
    x = torch.ones(4)
    with HostSyncCounter() as counter:
        bool(x.all())
        int(x.sum())
        x.tolist()
        x.max().item()
        torch.nonzero(x)
        x[x > 0]
        x.sum()  # not a sync
    assert counter.counts == {"__bool__": 1, "__int__": 1, "tolist": 1, "item": 1, "nonzero": 1, "__getitem__[bool]": 1}
