"""Choose between Triton kernels and plain-torch reference implementations.

The choice is controlled by the environment variable ``KVSTACK_KERNELS``:

* ``auto`` (default, also when unset or empty): Triton for CUDA tensors when
  Triton is importable, torch otherwise.
* ``torch``: always the torch reference.
* ``triton``: always Triton. On CPU this only works together with
  ``TRITON_INTERPRET=1`` (Triton's interpreter); tests use it that way.

The variable is read on every call (not cached) so tests can flip it with
``monkeypatch.setenv``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

ENV_VAR = "KVSTACK_KERNELS"
MODES = ("auto", "torch", "triton")


def kernel_mode() -> str:
    """Return the validated value of ``KVSTACK_KERNELS`` (lower-cased)."""
    raw = os.environ.get(ENV_VAR, "")
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(
            f"environment variable {ENV_VAR}={raw!r} is not valid; allowed values: "
            + ", ".join(repr(m) for m in MODES)
        )
    return mode


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op on tensor ``t`` should run the Triton kernel."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        if not triton_available():
            raise ValueError(
                f"{ENV_VAR}=triton was requested but the 'triton' package is not installed"
            )
        return True
    return bool(t.is_cuda) and triton_available()
