"""The command line: presets, show, validate, schema, generate, and bench's devices and Hub ids."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvstack.bench.protocol import model_path
from kvstack.cli import app

runner = CliRunner()


def test_presets_lists_names_ratios_and_descriptions():
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0, result.output
    table = result.output.split("\n\n")[0]  # the footnote follows a blank line
    lines = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert "identity" in lines and "streaming" in lines
    assert float(lines["identity"].split()[1]) > 1.0  # positions cost a little
    assert float(lines["streaming"].split()[1]) < 0.05  # 132 of 4096 tokens


def test_show_prints_round_trippable_yaml():
    result = runner.invoke(app, ["show", "streaming"])
    assert result.exit_code == 0
    assert "kind: evict" in result.output and "n_sink: 4" in result.output


def test_validate_good_and_bad_files(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("name: mine\nbudget: {tokens: 64}\nstages:\n  - kind: evict\n    n_sink: 2\n")
    result = runner.invoke(app, ["validate", str(good)])
    assert result.exit_code == 0 and "ok: mine" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: mine\nstages:\n  - kind: evict\n    budget: {tokens: 1}\n    n_sink: 4\n")
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2
    assert "budget.tokens=1" in result.output


def test_schema_is_json(tmp_path):
    out = tmp_path / "schema.json"
    assert runner.invoke(app, ["schema", "--out", str(out)]).exit_code == 0
    assert json.loads(out.read_text())["title"] == "kvstack stack spec"


def test_generate_prints_text_and_memory(real_model_and_tokenizer):
    result = runner.invoke(
        app,
        ["generate", "--model", str(model_path()), "--preset", "streaming", "--prompt", "Once upon a time",
         "--max-new-tokens", "150"],
    )
    assert result.exit_code == 0, result.output
    assert "Once upon a time" in result.output
    memory = result.output.strip().splitlines()[-1]
    assert memory.startswith("memory:") and "ratio" in memory
    ratio = float(memory.rsplit("ratio", 1)[1].strip(" )"))
    assert ratio < 0.9  # 132 kept of 155 tokens seen, positions included


# ------------------------------------------------------------------ generate: devices, Hub ids, prompts, sampling, JSON
PROMPT = "Once upon a time"


def _flat(output: str) -> str:
    """Output with rich's box drawing and line wrapping removed, for substring checks."""
    for ch in "│╭╮╰╯─":
        output = output.replace(ch, " ")
    return " ".join(output.split())


def _generate(*args: str, **invoke):
    return runner.invoke(app, ["generate", "--model", str(model_path()), *args], **invoke)


def _json(*args: str, **invoke) -> dict:
    result = _generate("--json", *args, **invoke)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stdout holds the one JSON object and nothing else


def test_generate_json_reports_text_speed_peak_and_cache_bytes(real_model_and_tokenizer):
    report = _json("--preset", "streaming", "--prompt", PROMPT, "--max-new-tokens", "150", "--device", "cpu")
    assert report["text"].startswith(PROMPT) and report["text"].endswith(report["completion"]) and report["completion"]
    assert report["prompt_tokens"] == 5 and 0 < report["new_tokens"] <= 150
    assert report["tokens_seen"] == report["prompt_tokens"] + report["new_tokens"] - 1  # the last token is not fed
    assert report["tokens_per_s"] > 0 and report["seconds"] > 0
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["preset"] == "streaming"
    assert report["peak_memory_bytes"] == report["peak_rss_bytes"] > 10 * 2**20  # torch alone takes more
    assert report["cuda_max_allocated_bytes"] is None
    assert report["cache_bytes"] < report["full_cache_bytes"]  # 132 tokens kept of 154
    assert report["ratio"] == pytest.approx(report["cache_bytes"] / report["full_cache_bytes"])


def test_generate_text_output_names_device_and_peak(real_model_and_tokenizer):
    result = _generate("--prompt", PROMPT, "--max-new-tokens", "4", "--device", "cpu")
    assert result.exit_code == 0, result.output
    speed = next(line for line in result.output.splitlines() if line.startswith("speed:"))
    assert "float32 on cpu" in speed and "peak RSS" in speed


def test_generate_reads_the_prompt_from_a_file_or_stdin(real_model_and_tokenizer, tmp_path):
    direct = _json("--prompt", PROMPT, "--max-new-tokens", "8")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT + "\n")  # an editor's trailing newline is not part of the prompt
    from_file = _json("--prompt-file", str(prompt_file), "--max-new-tokens", "8")
    assert (from_file["text"], from_file["prompt_tokens"]) == (direct["text"], direct["prompt_tokens"])
    piped = _json("--prompt", "-", "--max-new-tokens", "8", input=PROMPT + "\n")
    assert (piped["text"], piped["prompt_tokens"]) == (direct["text"], direct["prompt_tokens"])


def test_generate_prompt_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        ([], "a prompt is required: --prompt TEXT, --prompt - (read stdin) or --prompt-file PATH"),
        (["--prompt", "x", "--prompt-file", str(empty)], "--prompt and --prompt-file are exclusive"),
        (["--prompt-file", str(tmp_path / "missing.txt")], "missing.txt' is not a file"),
        (["--prompt-file", str(empty)], "empty.txt' is empty"),
        (["--prompt-file", str(latin)], "latin1.txt' is not UTF-8 text"),
        (["--prompt", "  "], "--prompt is empty"),
    ]
    for args, message in cases:
        result = _generate(*args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    result = _generate("--prompt", "-", input="\n")
    assert result.exit_code == 2 and "--prompt - (stdin) is empty" in result.output


def test_generate_sampling_flags(real_model_and_tokenizer):
    args = ("--prompt", PROMPT, "--max-new-tokens", "20")
    greedy = _json(*args)["completion"]
    assert _json(*args, "--greedy")["completion"] == greedy
    first = _json(*args, "--do-sample", "--seed", "1")
    assert first["do_sample"] is True and first["seed"] == 1
    assert _json(*args, "--do-sample", "--seed", "1")["completion"] == first["completion"]  # the seed reproduces
    assert _json(*args, "--do-sample", "--seed", "2")["completion"] != first["completion"]
    assert first["completion"] != greedy
    # a temperature near 0 and top-k 1 are greedy again: the flags reach generate
    assert _json(*args, "--do-sample", "--seed", "1", "--top-k", "1")["completion"] == greedy
    assert _json(*args, "--do-sample", "--seed", "1", "--temperature", "0.01", "--top-p", "0.5")["completion"] == greedy


def test_generate_sampling_flag_errors():
    cases = [
        (["--temperature", "0.7"], "--temperature needs --do-sample"),
        (["--top-p", "0.9", "--top-k", "5"], "--top-p, --top-k need --do-sample"),
        (["--do-sample", "--temperature", "0"], "--temperature 0 is not allowed: > 0"),
        (["--do-sample", "--top-p", "1.5"], "--top-p 1.5 is not allowed: in (0, 1]"),
        (["--do-sample", "--top-k", "-1"], "Invalid value for '--top-k'"),
        (["--seed", "-3"], "Invalid value for '--seed'"),
    ]
    for args, message in cases:
        result = _generate("--prompt", PROMPT, *args)
        assert result.exit_code == 2 and message in _flat(result.output), (args, result.output)


def test_generate_device_choices(real_model_and_tokenizer):
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert _json("--prompt", PROMPT, "--max-new-tokens", "2", "--device", "auto")["device"] == expected
    result = _generate("--prompt", PROMPT, "--device", "tpu")
    assert result.exit_code == 2
    message = "Invalid value for '--device': Value error, 'tpu' is not one of 'auto', 'cpu', 'cuda'"
    assert message in _flat(result.output)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_generate_cuda_without_cuda_is_a_clear_error():
    result = _generate("--prompt", PROMPT, "--device", "cuda")
    assert result.exit_code == 2
    assert "--device cuda is not available: torch" in result.output and "use --device cpu (or auto)" in result.output


def test_generate_hub_id_offline_is_a_clear_error():
    result = runner.invoke(app, ["generate", "--model", "kvstack-tests/no-such-model", "--prompt", PROMPT],
                           env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 2, result.output
    message = _flat(result.output)
    assert "--model: model 'kvstack-tests/no-such-model' is not a local path" in message and "offline" in message
    assert "a local Hugging Face directory or a .gguf file works offline" in message
    # something path-like that does not exist is a missing path, not a Hub id
    result = runner.invoke(app, ["generate", "--model", "../no/such/dir", "--prompt", PROMPT],
                           env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 2 and "'../no/such/dir' does not exist" in result.output


def test_generate_help_lists_the_choices():
    result = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    help_text = _flat(result.output)
    for choices in ("auto|cpu|cuda", "float32|bfloat16|float16", "--do-sample --greedy", "--prompt-file", "--json",
                    "--temperature", "--top-p", "--top-k", "--seed", "--max-new-tokens"):
        assert choices in help_text, choices


def test_schema_format_is_a_choice(tmp_path):
    out = tmp_path / "ref.md"
    assert runner.invoke(app, ["schema", "--format", "markdown", "--out", str(out)]).exit_code == 0
    assert out.read_text().startswith("#")
    result = runner.invoke(app, ["schema", "--format", "xml"])
    assert result.exit_code == 2 and "'xml' is not one of 'json', 'markdown'" in _flat(result.output)


# ------------------------------------------------------------------------------------- bench: devices and Hub ids
def _bench(tmp_path, model: str, *args: str, **invoke):
    data = tmp_path / "passages.jsonl"
    data.write_text(json.dumps({"text": "Once upon a time there was a girl."}) + "\n")
    base = ["bench", "--model", model, "--data", str(data), "--presets", "identity", "--out", str(tmp_path / "out"),
            "--passages", "1", "--no-progress"]
    return runner.invoke(app, base + list(args), **invoke)


@pytest.mark.parametrize("protocol", ["prefill", "code-kl"])
def test_bench_hub_id_offline_is_a_clear_error(tmp_path, protocol):
    result = _bench(tmp_path, "kvstack-tests/no-such-model", "--protocol", protocol, env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 2, result.output
    message = _flat(result.output)
    assert "--model: model 'kvstack-tests/no-such-model' is not a local path and the Hugging Face Hub is offline " \
        "(HF_HUB_OFFLINE=1), with no copy of it in the Hub cache" in message
    assert "a local Hugging Face directory or a .gguf file works offline" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("protocol", ["decode", "code-kl"])
def test_bench_hub_id_without_a_reachable_hub_fails_at_once(tmp_path, monkeypatch, protocol):
    """No hub answers (a closed local port stands for it): the cache is tried, then a clear error, without the hub
    client's minute of retries."""
    import time

    from huggingface_hub import constants

    from kvstack.bench import models

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    for name in models.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not models.hub_reachable()
    start = time.perf_counter()
    result = _bench(tmp_path, "kvstack-tests/no-such-model", "--protocol", protocol, "--prefix", "8",
                    "--decode-prefill", "4")
    assert result.exit_code == 2, result.output
    assert "--model: model 'kvstack-tests/no-such-model' is not a local path and the Hugging Face Hub " \
        "(http://127.0.0.1:9) could not be reached, with no copy of it in the Hub cache" in _flat(result.output)
    assert time.perf_counter() - start < 30


def test_bench_device_is_resolved_before_loading_and_passed_on(tmp_path, monkeypatch):
    from kvstack import cli

    seen = {}
    monkeypatch.setattr(cli, "_run_bench", lambda *args, **kwargs: seen.update(kwargs))
    assert _bench(tmp_path, str(model_path()), "--device", "auto").exit_code == 0
    assert seen["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert _bench(tmp_path, str(model_path()), "--device", "CPU").exit_code == 0 and seen["device"] == "cpu"
    result = _bench(tmp_path, str(model_path()), "--device", "tpu")
    assert result.exit_code == 2 and "'tpu' is not one of 'auto', 'cpu', 'cuda'" in _flat(result.output)
    help_text = _flat(runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).output)
    assert "--device <auto|cpu|cuda>" in help_text and "Hugging Face Hub model id" in help_text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_bench_cuda_without_cuda_is_a_clear_error(tmp_path):
    result = _bench(tmp_path, str(model_path()), "--device", "cuda")
    assert result.exit_code == 2
    assert "--device cuda is not available: torch" in result.output and "use --device cpu (or auto)" in result.output
    assert not (tmp_path / "out").exists()


def test_bench_runs_on_the_device_it_is_given(real_model_and_tokenizer, tmp_path):
    """The model and the passages go to --device (cpu here; the GPU check runs the same command with cuda)."""
    result = _bench(tmp_path, str(model_path()), "--device", "cpu", "--prefix", "6", "--ratios", "",
                    "--max-len", "9")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["metadata"]["device"] == "cpu" and data["metadata"]["model_format"] == "hf"
    identity = next(row for row in data["rows"] if row["name"] == "identity")
    assert identity["kl"] < 1e-9


# ------------------------------------------------------------------ memory: where a stack's bytes go
def _memory(*args: str, **invoke):
    return runner.invoke(app, ["memory", *args, "--model", str(model_path())], **invoke)


def test_memory_reports_each_layer_as_the_filled_cache_holds_it(real_model_and_tokenizer):
    """The JSON is what a cache filled with the same random prompt holds: bytes, limits and tokens, layer by layer."""
    import kvstack
    from kvstack.stack.apply import cache_kwarg

    result = _memory("transform-budget", "--tokens", "64,300", "--seed", "3", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["stack"] == "transform-budget" and report["dtype"] == "float32"
    model, _ = real_model_and_tokenizer
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(3))
    with kvstack.applied(model, "transform-budget"), torch.no_grad():
        for run, n in zip(report["runs"], (64, 300), strict=True):
            cache = kvstack.cache_for(model)
            model(ids[:, :n], **{cache_kwarg(model): cache})
            layers = run["layers"]
            assert run["tokens_seen"] == n and run["total_bytes"] == cache.memory_bytes()
            assert [row["bytes"] for row in layers] == [layer.memory_bytes() for layer in cache.layers]
            assert [row["bytes_by_tier"] for row in layers] == [layer.memory_report() for layer in cache.layers]
            assert [row["limit_bytes"] for row in layers] == [layer.limit_bytes() for layer in cache.layers]
            assert [sum(row["tokens"].values()) for row in layers] == [int(k.max()) for k in cache.kept_tokens()]
            assert run["total_bytes"] <= run["budget_bytes"] == sum(row["limit_bytes"] for row in layers)
            assert run["budget_bytes"] <= 0.25 * run["full_cache_bytes"] and run["budget"] == "ratio: 0.25"
    # 300 tokens: every one kept, the newest at 16 bits; 64: the coder's fixed bytes leave room for a few at 16 bits
    assert set(report["runs"][1]["layers"][0]["tokens"]) == {"full", "quantized-k4v3"}
    assert sum(report["runs"][1]["layers"][0]["tokens"].values()) == 300
    assert report["runs"][0]["layers"][0]["tokens"]["quantized-k4v3"] == 0


def test_memory_counts_real_tokens_not_slots(real_model_and_tokenizer):
    """A KIVI level stores whole key groups: at 128 tokens obcache-kivi's 4-bit level holds a few tokens per KV head
    in 32 slots, and the command reports the tokens."""
    import kvstack
    from kvstack.stack.apply import cache_kwarg

    result = _memory("obcache-kivi", "--tokens", "128", "--layers", "0", "--json")
    assert result.exit_code == 0, result.output
    tokens = json.loads(result.stdout)["runs"][0]["layers"][0]["tokens"]
    model, _ = real_model_and_tokenizer
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    with kvstack.applied(model, "obcache-kivi"), torch.no_grad():
        cache = kvstack.cache_for(model)
        model(ids, **{cache_kwarg(model): cache})
        tiers = {tier.name: tier for tier in cache.layers[0].tiers}
    coded = tiers["quantized4"]
    assert 0 < tokens["quantized4"] == int(coded.valid().sum(-1).max()) < coded.num_tokens  # holes are not tokens
    assert sum(tokens.values()) == int(cache.kept_tokens()[0].max())


def test_memory_lists_the_layers_asked_for_with_their_share(real_model_and_tokenizer):
    result = _memory("streaming", "--tokens", "200", "--layers", "3,1")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()  # the tables; model loading reports on stderr
    assert lines[0].startswith("streaming on ") and lines[0].endswith("budget: tokens: 128")
    start = lines.index("layer   held  limit  tokens per tier") + 1
    rows = [line.split(maxsplit=3) for line in lines[start:start + 3]]
    assert [row[0] for row in rows[:2]] == ["3", "1"] and rows[2] == []  # those two layers, in the order asked
    for _, held, limit, tokens in rows[:2]:
        assert limit == "0.640" and float(held) <= 0.640  # 128 of 200 tokens' bytes, positions included
        assert tokens.startswith("full ") and int(tokens.split()[1]) <= 128


def test_memory_holds_the_stack_to_the_ratio_asked_for(real_model_and_tokenizer):
    """--ratio replaces the stack's budget as bench --ratios does: the limit and what is held follow the new ratio."""
    runs = {}
    for args in ((), ("--ratio", "0.5")):
        result = _memory("transform-budget", "--tokens", "300", "--layers", "0", "--json", *args)
        assert result.exit_code == 0, result.output
        runs[args] = json.loads(result.stdout)["runs"][0]
    own, half = runs[()], runs[("--ratio", "0.5")]
    assert own["budget"] == "ratio: 0.25" and half["budget"] == "ratio: 0.5"
    assert own["full_cache_bytes"] == half["full_cache_bytes"] and own["budget_bytes"] <= 0.25 * own["full_cache_bytes"]
    assert 0.49 * half["full_cache_bytes"] < half["budget_bytes"] <= 0.5 * half["full_cache_bytes"]
    assert own["total_bytes"] <= own["budget_bytes"] < half["total_bytes"] <= half["budget_bytes"]
    # every token is kept either way; the bytes the larger budget leaves go to more tokens at 16 bits
    own_tokens, half_tokens = own["layers"][0]["tokens"], half["layers"][0]["tokens"]
    assert sum(own_tokens.values()) == sum(half_tokens.values()) == 300 and half_tokens["full"] > own_tokens["full"]


def test_memory_rejects_bad_options_by_name(real_model_and_tokenizer, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        (["streaming", "--tokens", "0"], "--tokens '0' is not allowed: comma-separated integers >= 1"),
        (["streaming", "--tokens", "1k"], "--tokens '1k' is not allowed: comma-separated integers >= 1"),
        (["streaming", "--layers", "5"], "--layers '5' is not allowed: comma-separated integers from 0 to 4"),
        (["streaming", "--prompt-file", str(tmp_path / "none.txt")], "none.txt' is not a file"),
        (["streaming", "--prompt-file", str(short), "--tokens", "64"], "short.txt' has 5 tokens: --tokens asks for 64"),
        (["streaming", "--prompt-file", str(latin)], "latin1.txt' is not UTF-8 text"),
        (["no-such-preset"], "no-such-preset"),
        (["streaming", "--ratio", "1.5"], "--ratio 1.5 is not allowed: a number in (0, 1]"),
        (["streaming", "--ratio", "0"], "--ratio 0 is not allowed: a number in (0, 1]"),
        (["kivi-4", "--ratio", "0.25"], "--ratio 0.25 is not allowed for kivi-4: it takes no budget"),
    ]
    for args, message in cases:
        result = _memory(*args)
        assert result.exit_code == 2 and message in _flat(result.output), (args, result.output)
