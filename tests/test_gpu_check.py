"""The native-GPU check script runs its kernel comparisons (here under the Triton interpreter, tiny sizes)."""

from __future__ import annotations

import torch

from kvstack.bench import gpu_check


def test_tiered_cases_agree_under_the_interpreter():
    rows = gpu_check.check_tiered(torch.device("cpu"), sizes=((0, 5), (32, 3)), dims=(1, 1, 2, 32))
    assert len(rows) == 18 and all(r["ok"] for r in rows)


def test_without_cuda_it_says_so_and_succeeds(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
