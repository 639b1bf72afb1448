"""Load a causal LM for kvstack's benchmarks and CLI: a Hugging Face directory, a GGUF file (or a directory holding
exactly one ``.gguf``), or a Hugging Face Hub model id (downloaded when a hub is reachable, read from the Hub cache
only under ``HF_HUB_OFFLINE=1``, a clear :class:`ModelLoadError` otherwise).

GGUF goes through transformers' own GGUF support (the PyPI packages ``gguf`` and ``accelerate``:
``pip install -e '.[gguf]'``), which dequantizes every weight — slow (10-30 s on 2 CPU cores). So that happens ONCE:
the dequantized model is written, in float32 (the exact dequantized values), with its tokenizer, as an HF-format
directory in a cache outside the repository (``KVSTACK_CACHE_DIR``, default ``~/.cache/kvstack``), keyed by the
file's name and a hash of its bytes; every later load reads that copy (about a second), and needs neither package.
A conversion removes the copies made from earlier versions of the same file, so the cache holds one per file.

Default dtype: bfloat16 for a GGUF model (its weights are 4-8-bit blocks, so bfloat16 loses little, and on CPUs with
bf16 matmuls it prefills ~2.5x faster than float32), the config's ``dtype`` for an HF directory. ``dtype=`` overrides
either (``torch.float32``, or a name: ``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstack.stack.errors import KVStackError

DEFAULT_CACHE_DIR = "~/.cache/kvstack"
GGUF_DTYPE = torch.bfloat16  # default dtype of a model that comes from a GGUF file
MARKER = "kvstack-source.json"  # written into a converted directory: where it came from, its default dtype
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip
GGUF_PACKAGES = ("gguf", "accelerate")
INSTALL_HINT = "pip install -e '.[gguf]'"


class ModelLoadError(KVStackError, ValueError):
    """A model path that cannot be loaded: missing, ambiguous, or needing packages that are not installed."""


@dataclass(frozen=True)
class ModelSource:
    """What a path points at: ``format`` is ``"hf"`` (``path``: the directory) or ``"gguf"`` (``path``: the file)."""

    format: str
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def describe(self) -> dict:
        info = {"model": self.name, "model_path": str(self.path), "model_format": self.format}
        if self.format == "gguf":
            info["converted_dir"] = converted_dir(self.path).name  # the name only: no machine paths in results
        return info


def cache_root() -> Path:
    return Path(os.environ.get("KVSTACK_CACHE_DIR", DEFAULT_CACHE_DIR)).expanduser()


def resolve_source(source: str | Path) -> ModelSource:
    """Classify ``source`` without loading anything; raises :class:`ModelLoadError` with what to pass instead."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {str(source)!r} does not exist (a Hugging Face directory or a .gguf file)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model {str(source)!r} is a file but not a .gguf file: give a .gguf file or a Hugging Face directory"
            )
        return ModelSource("gguf", path)
    if (path / "config.json").is_file():
        return ModelSource("hf", path)
    ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(
            f"model {str(source)!r} holds {len(ggufs)} .gguf files ({names}): give the file to load"
        )
    raise ModelLoadError(
        f"model {str(source)!r} is a directory with neither a config.json (Hugging Face model) nor a .gguf file"
    )


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(dtype, "value", dtype)  # an Enum member (the CLI's choices)
    key = str(value).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ModelLoadError(f"dtype={dtype!r} is not allowed: one of float32, bfloat16, float16")
    return DTYPES[key]


def converted_dir(gguf: Path) -> Path:
    """Where the HF-format copy of ``gguf`` lives: keyed by its name and a hash of its bytes, so a file that is copied
    or touched (a new modification time, the same bytes) keeps its copy, and a changed file gets a new one."""
    stat = gguf.stat()
    digest = _content_digest(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)
    return cache_root() / "gguf" / f"{gguf.stem}-{digest}"


@functools.lru_cache(maxsize=8)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """The first 16 hex digits of the file's SHA-256 (about 0.2 s for 100 MB); size and time key the memo only."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()[:16]


def remove_stale_copies(gguf: Path, keep: Path) -> list[Path]:
    """Delete the converted copies, other than ``keep``, whose marker names ``gguf``'s path: copies of earlier
    versions of the same file, which no load reads again. Returns what was deleted."""
    source = str(gguf.resolve())
    stale = []
    for copy in keep.parent.glob(f"{gguf.stem}-*"):
        marker = copy / MARKER
        if copy == keep or not marker.is_file():
            continue
        try:
            recorded = json.loads(marker.read_text()).get("gguf_path")
        except (OSError, ValueError):  # unreadable: not ours to judge
            continue
        if recorded == source:
            shutil.rmtree(copy, ignore_errors=True)
            stale.append(copy)
    return stale


def missing_gguf_packages() -> list[str]:
    return [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]


def ensure_hf_dir(source: str | Path) -> Path:
    """An HF-format directory for ``source``: the directory itself, or the converted copy of a GGUF file (made on the
    first call; later calls return at once)."""
    resolved = resolve_source(source)
    if resolved.format == "hf":
        return resolved.path
    target = converted_dir(resolved.path)
    if (target / MARKER).is_file():
        return target
    return convert_gguf(resolved.path, target)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize ``gguf`` with transformers (float32) and save model + tokenizer as an HF directory at ``target``.

    Follows the model's SOURCE.md: the loaded model keeps a ``quantization_config`` marker and refuses
    ``save_pretrained`` until it is deleted and ``hf_quantizer`` is unset. Written to a temporary directory next to
    ``target`` and renamed, so an interrupted conversion never leaves a half-written copy that later loads trust."""
    missing = missing_gguf_packages()
    if missing:
        raise ModelLoadError(
            f"loading {gguf.name} (GGUF) needs the packages {', '.join(missing)}: {INSTALL_HINT} "
            f"(or pip install {' '.join(GGUF_PACKAGES)})"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = gguf.parent, gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except Exception as err:  # a corrupt file or an architecture transformers cannot read from GGUF
        raise ModelLoadError(f"transformers could not load {str(gguf)!r} as GGUF: {type(err).__name__}: {err}") from err
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stat = gguf.stat()
        marker = {
            "gguf_file": name,
            "gguf_path": str(gguf.resolve()),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "saved_dtype": "float32",
            "default_dtype": str(GGUF_DTYPE).removeprefix("torch."),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            tmp.rename(target)
        except OSError:  # another process converted the same file meanwhile: keep theirs
            if not (target / MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    remove_stale_copies(gguf, keep=target)
    return target


def default_dtype(hf_dir: Path) -> torch.dtype | str:
    """bfloat16 for a converted GGUF directory; otherwise ``"auto"`` (transformers reads the config's dtype)."""
    marker = hf_dir / MARKER
    if marker.is_file():
        return parse_dtype(json.loads(marker.read_text()).get("default_dtype", "bfloat16"))
    return "auto"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE as set now (huggingface_hub reads them once, at its import)."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(str(f).upper() in ("1", "ON", "YES", "TRUE") for f in flags if f)


def hub_id(source: str | Path) -> str | None:
    """``source`` as a Hugging Face Hub model id: it names no local path, does not look like one (``./``, ``/``,
    ``~``, ``.gguf``) and has the form ``name`` or ``namespace/name``; else None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    model = str(source)
    if Path(model).expanduser().exists() or model.startswith((".", "/", "~")) or model.lower().endswith(".gguf"):
        return None
    try:
        validate_repo_id(model)
    except HFValidationError:
        return None
    return model


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub's endpoint opens within ``timeout`` seconds (assumed True behind a proxy,
    which a direct connection cannot test). An unreachable Hub then fails at once, instead of after the hub
    client's retries (about a minute)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return True
    url = urlsplit(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), timeout):
            return True
    except OSError:
        return False


def load_hub_model(model_id: str, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer) from the Hub, or from its local cache only when the Hub is offline
    (``HF_HUB_OFFLINE=1``) or cannot be reached; :class:`ModelLoadError` naming the id and the offline ways when
    that fails."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = parse_dtype(dtype)
    offline = hub_offline()
    reachable = not offline and hub_reachable()
    options = {} if reachable else {"local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id, **options)
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype or "auto", **options)
    except Exception as err:  # OSError from the hub client, ValueError for an unknown architecture, ...
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        ways = "a local Hugging Face directory or a .gguf file works offline"
        if offline:
            raise ModelLoadError(
                f"model {model_id!r} is not a local path and the Hugging Face Hub is offline (HF_HUB_OFFLINE=1), with "
                f"no copy of it in the Hub cache: {ways}, or unset HF_HUB_OFFLINE to download it"
            ) from err
        if not reachable:
            raise ModelLoadError(
                f"model {model_id!r} is not a local path and the Hugging Face Hub ({constants.ENDPOINT}) could not be "
                f"reached, with no copy of it in the Hub cache: {ways}"
            ) from err
        if "connect" in detail.lower() or "offline" in detail.lower():
            raise ModelLoadError(
                f"model {model_id!r} is not a local path and the Hugging Face Hub could not be reached ({detail}): "
                f"{ways}"
            ) from err
        raise ModelLoadError(
            f"model {model_id!r} is not a local path, and loading it from the Hugging Face Hub failed: "
            f"{type(err).__name__}: {detail}"
        ) from err
    return model.to(device).eval(), tokenizer


def describe_source(source: str | Path) -> dict:
    """What a run's metadata says about its model: the Hub id, or the local source (:meth:`ModelSource.describe`)."""
    model_id = hub_id(source)
    if model_id is not None:
        return {"model": model_id, "model_format": "hub"}
    return resolve_source(source).describe()


def load_causal_lm(source: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"):
    """(model in eval mode on ``device``, tokenizer) from an HF directory, a ``.gguf`` file, a directory holding one
    ``.gguf``, or a Hub model id (:func:`hub_id`, :func:`load_hub_model`).

    A GGUF file is converted once into the cache (see the module docstring); ``dtype`` defaults to bfloat16 for it
    and to the config's dtype for an HF directory or a Hub model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_id = hub_id(source)
    if model_id is not None:
        return load_hub_model(model_id, dtype, device)
    dtype = parse_dtype(dtype)
    hf_dir = ensure_hf_dir(source)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype or default_dtype(hf_dir))
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    return model.to(device).eval(), tokenizer


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype
