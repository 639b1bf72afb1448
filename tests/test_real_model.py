"""SmolLM2-135M-Instruct (GGUF) in kvstack: the loader and its cache, identity exactness on the real model, the
code_kl and needle protocols end to end on tiny settings, and `kvstack generate --chat` on the GGUF file.

The first run converts the GGUF once into KVSTACK_CACHE_DIR (~30 s); every later load reads that copy (~1 s)."""

from __future__ import annotations

import json
import os
from dataclasses import fields

import pytest
import torch
from typer.testing import CliRunner
from transformers import DynamicCache

import kvstack
from kvstack.bench import models, real_model
from kvstack.bench.real_model import CodeKLRow, NeedleRow, _standard_error
from kvstack.cli import app

PROMPT = 64  # tokens of the identity check
PREFIX, MAX_LEN = 96, 120  # code_kl: 23 one-token steps on a truncated passage


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    """(model, tokenizer) in the default dtype (bfloat16). Tests leave it unmodified (kvstack.remove)."""
    return models.load_causal_lm(smollm2_source)


@pytest.fixture(scope="module")
def code_ids(smollm2, smollm2_data):
    _, tokenizer = smollm2
    text = real_model.load_code_passages(smollm2_data[0], n=1)[0]
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_loader_resolves_the_gguf_and_keeps_one_converted_copy(smollm2, smollm2_source):
    model, tokenizer = smollm2
    from_dir = models.resolve_source(smollm2_source)
    assert from_dir.format == "gguf" and from_dir.path.suffix == ".gguf"
    assert models.resolve_source(from_dir.path) == from_dir
    converted = models.ensure_hf_dir(from_dir.path)
    assert converted == models.converted_dir(from_dir.path) and (converted / models.MARKER).is_file()
    assert converted.resolve().is_relative_to(models.cache_root().resolve())
    assert models.ensure_hf_dir(converted) == converted  # the copy is itself an HF directory
    assert models.model_dtype(model) == torch.bfloat16  # the GGUF default
    assert getattr(model.config, "quantization_config", None) is None
    shape = kvstack.ModelShape.from_model(model)
    assert (shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert tokenizer.chat_template


def test_loader_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(models.ModelLoadError, match="does not exist"):
        models.load_causal_lm(tmp_path / "missing")
    with pytest.raises(models.ModelLoadError, match="neither a config.json"):
        models.load_causal_lm(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(models.ModelLoadError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        models.resolve_source(tmp_path)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"")
    with pytest.raises(models.ModelLoadError, match="not a .gguf file"):
        models.resolve_source(not_gguf)
    # without the packages, a GGUF that is not converted yet says what to install (before reading the file)
    monkeypatch.setenv("KVSTACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "missing_gguf_packages", lambda: ["gguf"])
    with pytest.raises(models.ModelLoadError, match=r"pip install -e '\.\[gguf\]'"):
        models.load_causal_lm(tmp_path / "a.gguf")
    with pytest.raises(models.ModelLoadError, match="dtype='int8' is not allowed"):
        models.parse_dtype("int8")
    assert isinstance(models.ModelLoadError("x"), kvstack.KVStackError)


def test_converted_copy_is_keyed_by_content_and_replaces_copies_of_earlier_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTACK_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"first version")
    first = models.converted_dir(gguf)
    os.utime(gguf, ns=(1, 1))  # touched or copied: the same bytes keep their copy
    assert models.converted_dir(gguf) == first
    gguf.write_bytes(b"second version")
    second = models.converted_dir(gguf)
    assert second != first and second.parent == first.parent == models.cache_root() / "gguf"
    other = tmp_path / "elsewhere" / "m.gguf"  # the same name in another folder is another file
    other.parent.mkdir()
    other.write_bytes(b"first version")
    cache = first.parent
    copies = {first: gguf, second: gguf, cache / "m-old-layout": gguf, cache / "m-other": other}
    for copy, source in copies.items():
        copy.mkdir(parents=True)
        (copy / models.MARKER).write_text(json.dumps({"gguf_path": str(source.resolve())}))
    (cache / "m-unmarked").mkdir()
    removed = models.remove_stale_copies(gguf, keep=second)
    assert sorted(p.name for p in removed) == sorted([first.name, "m-old-layout"])
    assert sorted(p.name for p in cache.iterdir()) == sorted([second.name, "m-other", "m-unmarked"])


def _identity_vs_uncompressed(model, ids: torch.Tensor):
    """Logits of the unmodified model (one forward; then a DynamicCache decode) and of the identity stack."""
    split = PROMPT - 16

    def decode(cache):
        rows = [model(ids[None, :split], cache=cache).logits[0]]
        for p in range(split, PROMPT):
            rows.append(model(ids[None, p : p + 1], position_ids=torch.tensor([[p]]), cache=cache).logits[0])
        return torch.cat(rows)

    with torch.inference_mode():
        full = model(ids[None, :PROMPT]).logits[0]
        dynamic = decode(DynamicCache(config=model.config))
        with kvstack.applied(model, "identity"):
            prompt = model(ids[None, :PROMPT], cache=kvstack.cache_for(model)).logits[0]
            stepped = decode(kvstack.cache_for(model))
    return full, prompt, dynamic, stepped


def test_identity_reproduces_the_uncompressed_logits_bf16(smollm2, code_ids):
    model, _ = smollm2
    full, prompt, dynamic, stepped = _identity_vs_uncompressed(model, code_ids)
    torch.testing.assert_close(prompt, full, atol=1e-2, rtol=0)  # the prompt's forward: the same SDPA
    # token by token, bf16 rounding differs between attention implementations: compare the distributions
    ref, got = torch.log_softmax(dynamic.double(), -1), torch.log_softmax(stepped.double(), -1)
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert float(kl.max()) < 0.02 and float(kl.mean()) < 2e-3
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.95


def test_identity_reproduces_the_uncompressed_logits_fp32(smollm2_source, code_ids):
    model, _ = models.load_causal_lm(smollm2_source, dtype="float32")
    assert models.model_dtype(model) == torch.float32
    full, prompt, dynamic, stepped = _identity_vs_uncompressed(model, code_ids)
    torch.testing.assert_close(prompt, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(stepped, dynamic, atol=1e-4, rtol=0)


def test_code_kl_end_to_end_through_the_cli(smollm2_source, smollm2_data, tmp_path):
    out = tmp_path / "code-kl"
    args = [
        "bench", "--protocol", "code-kl", "--model", str(smollm2_source), "--data", str(smollm2_data[0]),
        "--presets", "identity,streaming", "--ratios", "0.5", "--passages", "1", "--prefix", str(PREFIX),
        "--max-len", str(MAX_LEN), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "| streaming@0.5 |" in result.output and str(out / real_model.CODE_KL_FILE) in result.output
    data = json.loads((out / real_model.CODE_KL_FILE).read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["full-cache", "identity", "streaming@0.5"]
    expected = {f.name for f in fields(CodeKLRow)}
    for row in rows.values():
        assert set(row) == expected
        assert row["positions"] == MAX_LEN - PREFIX and row["decode_steps"] == MAX_LEN - PREFIX - 1
        assert row["memory_ratio"] == pytest.approx(row["memory_bytes"] / row["full_bytes"])
        assert row["memory_ratio_max"] >= row["memory_ratio"] and row["memory_bytes_max"] >= row["memory_bytes"]
        assert row["decode_seconds"] > 0 and len(row["wall_seconds"]) == 1
        assert row["kl_se"] is None  # one passage: no spread to report
    assert rows["full-cache"]["decode_time_ratio"] == 1.0 and rows["full-cache"]["memory_ratio"] == 1.0
    identity, streaming = rows["identity"], rows["streaming@0.5"]
    assert 1.0 < identity["memory_ratio"] < 1.01  # one int32 position per token on top of the bf16 keys/values
    assert identity["kl"] < 0.02 and identity["top1"] > 0.9  # bf16 rounding only
    assert streaming["memory_ratio"] <= 0.5 + 0.01 and streaming["ratio_target"] == 0.5
    assert streaming["kl"] > identity["kl"] and streaming["spec"]["budget"] == {"ratio": 0.5}
    assert 8 / 24 <= streaming["kl_worst_share"] < 1  # the 8 worst of 24 positions carry at least their share
    meta = data["metadata"]
    assert (meta["protocol"], meta["prefix"], meta["max_len"], meta["model_dtype"]) == ("code-kl", PREFIX, MAX_LEN,
                                                                                        "bfloat16")
    assert meta["passages"] == 1 and meta["ratios"] == [0.5] and meta["model"].endswith(".gguf")
    assert (out / real_model.CODE_KL_PLOT).is_file()  # matplotlib is in the dev extra


def test_needle_end_to_end_and_json(smollm2_source, smollm2_data, tmp_path):
    out = tmp_path / "needle"
    result = real_model.needle(
        smollm2_source, smollm2_data[1], ["identity"], out, tasks_per_length=1, lengths=(1024,), ratios=(),
        max_new_tokens=12, progress=False,
    )
    data = json.loads((out / real_model.NEEDLE_FILE).read_text())
    assert [r["name"] for r in data["rows"]] == ["full-cache", "identity"]
    expected = {f.name for f in fields(NeedleRow)}
    for row in data["rows"]:
        assert set(row) == expected
        assert set(row["accuracy_by_length"]) == {"1024"} and row["tasks_by_length"] == {"1024": 1}
        (task,) = row["tasks"]
        assert task["correct"] == (task["answer"] in task["reply"])
        assert task["prefill_tokens"] > 1024 and task["question_tokens"] > 10
        assert row["memory_ratio"] == pytest.approx(task["memory_bytes"] / task["full_bytes"])
    assert data["rows"][1]["full_accuracy_by_length"] == data["rows"][0]["accuracy_by_length"]
    assert data["metadata"]["model"].endswith(".gguf") and data["metadata"]["lengths"] == [1024]
    assert result.files["plot"] is None or (out / real_model.NEEDLE_PLOT).is_file()
    with pytest.raises(ValueError, match="include_8k"):
        real_model.needle(smollm2_source, smollm2_data[1], ["identity"], out, lengths=(8000,))


def test_needle_task_indices_pick_those_tasks_of_each_length(tmp_path):
    """``task_indices`` (CLI ``--task-ids``) runs the tasks at those positions of each length, in file order."""
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"context_tokens": n, "answer": f"{n}-{i}"}) + "\n"
                            for i in range(3) for n in (1024, 2048)))
    picked = real_model.load_needle_tasks(data, None, (1024, 2048), indices=[2, 0])
    assert [t["answer"] for t in picked] == ["1024-2", "1024-0", "2048-2", "2048-0"]
    with pytest.raises(ValueError, match=r"task index 3 is not allowed at context_tokens=1024: 0..2"):
        real_model.load_needle_tasks(data, None, (1024,), indices=[3])


def test_needle_prompt_splits_at_the_end_of_the_context(smollm2, smollm2_data):
    _, tokenizer = smollm2
    task = real_model.load_needle_tasks(smollm2_data[1], per_length=1, lengths=(1024,))[0]
    context, question = real_model.needle_prompt(tokenizer, task)
    assert tokenizer.decode(context).endswith(task["context"])
    tail = tokenizer.decode(question)
    assert tail.startswith("\n\n" + task["question"]) and tail.endswith("<|im_start|>assistant\n")


def test_cli_generate_chat_on_the_gguf_prints_reply_speed_and_bytes(smollm2, smollm2_source):
    gguf = models.resolve_source(smollm2_source).path
    result = CliRunner().invoke(
        app, ["generate", "--model", str(gguf), "--chat", "--prompt", "What is the capital of France?",
              "--max-new-tokens", "12"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert "Paris" in result.output
    speed, memory = lines[-2], lines[-1]
    assert speed.startswith("speed:") and "tokens/s" in speed and "bfloat16" in speed
    assert memory.startswith("memory:") and "bytes held vs" in memory and "for the full cache" in memory
    assert "<|im_start|>" not in result.output and "system" not in lines[-3]


def test_cli_bench_rejects_bad_real_model_options(tmp_path):
    base = ["bench", "--model", str(tmp_path), "--presets", "identity", "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, base + ["--protocol", "code-kl", "--dtype", "float16", "--fp32"])
    assert result.exit_code == 2 and "contradict" in result.output
    result = CliRunner().invoke(app, base + ["--protocol", "prefill", "--dtype", "bfloat16"])
    assert result.exit_code == 2 and "runs in float32" in result.output
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"context": "x", "question": "y"}) + "\n")
    result = CliRunner().invoke(app, base + ["--protocol", "needle", "--data", str(data)])
    assert result.exit_code == 2 and "lacks context_tokens, answer" in result.output
    for bad in ("4,x", "-1", ","):
        result = CliRunner().invoke(app, base + ["--protocol", "needle", "--task-ids", bad])
        assert result.exit_code == 2 and f"--task-ids {bad!r} is not allowed: comma-separated task positions >= 0" \
            in " ".join(result.output.split()), result.output
    for bad in ("1024,x", "0", ""):
        result = CliRunner().invoke(app, base + ["--protocol", "needle", "--lengths", bad])
        assert result.exit_code == 2 and f"--lengths {bad!r} is not allowed: comma-separated context lengths" \
            in " ".join(result.output.split()), result.output
    data.write_text(json.dumps({"text": "x"}) + "\n")
    result = CliRunner().invoke(app, base + ["--protocol", "code-kl", "--data", str(data)])
    assert result.exit_code == 2 and "neither a config.json" in result.output  # the model is checked last
    assert not (tmp_path / "o").exists()


def test_the_kl_standard_error_is_that_of_the_per_passage_mean():
    assert _standard_error([0.01]) is None
    assert _standard_error([0.01, 0.01]) == 0.0
    assert _standard_error([0.01, 0.02, 0.03, 0.06]) == pytest.approx(0.0216025 / 2, rel=1e-5)  # sample std / sqrt(4)
