"""Shared fixtures. The real model and passages are data under ../shared (paths overridable with KVSTACK_MODEL /
KVSTACK_DATA). Outside CI a missing model skips its tests; under CI=true it FAILS them."""

from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter on CPU-only machines; this must be set before triton is first imported.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kvstack.bench.protocol import data_path, load_model, load_passages, model_path  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _require(path) -> None:
    if not path.exists():
        message = f"real test data missing: {path} (set KVSTACK_MODEL / KVSTACK_DATA)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def real_model_and_tokenizer():
    """(model, tokenizer) of stories260K in float32, eval mode. Tests must leave it unmodified (kvstack.remove)."""
    _require(model_path())
    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="session")
def dev_passages():
    _require(data_path())
    return load_passages(n=None)
