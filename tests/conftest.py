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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models gain
    nothing from more, and on a shared 2-core machine spinning workers make each step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _require_real(path, variable: str) -> None:
    """Like ``_require``, naming the variable that overrides ``path`` (the SmolLM2 model and its data)."""
    if not path.exists():
        message = f"real test data missing: {path} (set {variable})"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def smollm2_source():
    """Path of SmolLM2-135M-Instruct (its directory with one GGUF; ``KVSTACK_REAL_MODEL``). The first load converts
    it once into ``KVSTACK_CACHE_DIR`` (~30 s); later loads read that copy."""
    from kvstack.bench.real_model import model_path as real_model_path

    _require_real(real_model_path(), "KVSTACK_REAL_MODEL")
    return real_model_path()


@pytest.fixture(scope="session")
def smollm2_data():
    """(code passages path, needle tasks path) for SmolLM2 (``KVSTACK_CODE_DATA`` / ``KVSTACK_NEEDLE_DATA``)."""
    from kvstack.bench.real_model import code_data_path, needle_data_path

    _require_real(code_data_path(), "KVSTACK_CODE_DATA")
    _require_real(needle_data_path(), "KVSTACK_NEEDLE_DATA")
    return code_data_path(), needle_data_path()
