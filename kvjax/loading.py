"""``kvjax.load`` and ``kvjax.load_tokenizer``: one entry point for every checkpoint source.

A source is a registry name (``kvjax.checkpoint.registry.REGISTRY``), a ``.gguf`` file, a Hugging
Face directory (``config.json`` + safetensors), a Hugging Face model id found through
``huggingface_hub``, a converted kvjax checkpoint directory, or ``random:<shape>``: a named shape
with random weights (``kvjax.checkpoint.random_model``). GGUF and HF sources are converted
once into ``<checkpoint dir>/<name>/`` (Orbax) and later loads reuse that conversion. The checkpoint
dir: ``checkpoint_root``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax.checkpoint import hub, random_model, store
from kvjax.checkpoint.errors import CheckpointError
from kvjax.checkpoint.registry import REGISTRY
from kvjax.model.params import Params

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
CONVERTER_VERSION = 2  # bump when conversion changes, so stale conversions are redone (2: wqkv)


def checkpoint_root() -> str:
    """Where kvjax writes: converted models, the compilation cache (``jax-cache/``) and contexts
    saved by name (``contexts/``). ``$KVJAX_CHECKPOINTS`` if set; else, when kvjax runs from a
    development checkout (its folder beside the ``pyproject.toml`` of kvjax), the checkout's
    ``checkpoints/``; else the user's cache directory, ``$XDG_CACHE_HOME/kvjax`` or
    ``~/.cache/kvjax`` — never the installed package's folder."""
    if chosen := os.environ.get("KVJAX_CHECKPOINTS"):
        return chosen
    checkout = Path(__file__).resolve().parent.parent
    project = checkout / "pyproject.toml"
    if project.is_file() and 'name = "kvjax"' in project.read_text(encoding="utf-8"):
        return str(checkout / "checkpoints")
    cache = os.environ.get("XDG_CACHE_HOME", "")
    return str((Path(cache) if os.path.isabs(cache) else Path.home() / ".cache") / "kvjax")


def _fingerprint(path: str) -> dict:
    """Identity of a conversion's source: path, sizes and modification times of its files."""
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".json"))
        )
    )
    return {
        "converter": CONVERTER_VERSION,
        "source": os.path.abspath(path),
        "files": [
            [os.path.basename(f), os.path.getsize(f), int(os.stat(f).st_mtime)] for f in files
        ],
    }


def _resolve(source: str) -> tuple[str, str, str | None]:
    """``(kind, source path, checkpoint dir)`` with kind in {"checkpoint", "gguf", "hf"}."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a registry name or a path, got {type(source).__name__}")
    source = os.fspath(source)
    if source in REGISTRY:
        return "gguf", REGISTRY[source].path(), os.path.join(checkpoint_root(), source)
    if os.path.isdir(source) and store.is_checkpoint(source):
        return "checkpoint", source, None
    if os.path.isfile(source) and source.endswith(".gguf"):
        return "gguf", source, os.path.join(checkpoint_root(), Path(source).stem)
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "config.json")):
        tag = hashlib.sha1(os.path.abspath(source).encode()).hexdigest()[:8]
        return "hf", source, os.path.join(checkpoint_root(), f"{Path(source).resolve().name}-{tag}")
    if os.path.exists(source):
        raise CheckpointError(
            f"source={source!r} exists but is neither a .gguf file, a Hugging Face directory "
            f"(with config.json) nor a kvjax checkpoint (with {store.CONFIG_FILE})"
        )
    if hub.REPO_ID.fullmatch(source) and not source.endswith(".gguf"):
        path = hub.snapshot(source)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(
                f"source={source!r}: its Hugging Face files ({path}) hold no config.json"
            )
        return "hf", path, os.path.join(checkpoint_root(), source.replace("/", "--"))
    raise CheckpointError(
        f"source={source!r} is not a registry name (known: {sorted(REGISTRY)}), an existing "
        "file or directory, a Hugging Face model id (owner/name), nor a random shape "
        f"({', '.join(random_model.PREFIX + name for name in random_model.SHAPES)})"
    )


def _tokenizer_from_source(kind: str, path: str):
    from transformers import AutoTokenizer

    if kind == "gguf":
        from kvjax.checkpoint.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(path)  # not transformers' GGUF reader: it needs torch
    return AutoTokenizer.from_pretrained(path)


def _ensure_converted(source: str) -> str:
    """Path of a kvjax checkpoint for ``source``, converting it first if needed."""
    kind, path, target = _resolve(source)
    if kind == "checkpoint":
        return path
    fingerprint = _fingerprint(path)
    if store.is_checkpoint(target) and store.read_source(target) == fingerprint:
        return target
    from kvjax.checkpoint.gguf_file import read_gguf
    from kvjax.checkpoint.hf_dir import read_hf_dir

    root = os.path.dirname(target)
    os.makedirs(root, exist_ok=True)
    # the checkpoint directory, locked: processes loading at once convert once
    lock = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if store.is_checkpoint(target) and store.read_source(target) == fingerprint:
            return target
        start = time.perf_counter()
        cfg, flat = (read_gguf if kind == "gguf" else read_hf_dir)(path)
        try:
            tokenizer = _tokenizer_from_source(kind, path)
        except (OSError, ValueError):  # a bare weights directory without tokenizer files
            tokenizer = None
        store.write_checkpoint(target, cfg, flat, tokenizer, fingerprint)
    finally:
        os.close(lock)  # releases the lock
    print(
        f"kvjax: converted {source} -> {target} in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    return target


def load(source: str, dtype="float32") -> Params:
    """Params (carrying their ``ModelConfig``) from a registry name, GGUF, HF directory or kvjax
    checkpoint.

    dtype: "float32" or "bfloat16" (or the jnp dtype).
    """
    key = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if key not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    if isinstance(source, str) and source.startswith(random_model.PREFIX):
        return random_model.random_params(source, DTYPES[key])
    return store.read_checkpoint(_ensure_converted(source), np.dtype(DTYPES[key]))


def load_tokenizer(source: str):
    """The ``transformers`` tokenizer of a source (converting a registry/GGUF/HF source if
    needed)."""
    from transformers import AutoTokenizer

    if isinstance(source, str) and source.startswith(random_model.PREFIX):
        return random_model.random_tokenizer(source)
    kind, path, _ = _resolve(source)
    directory = _ensure_converted(source) if kind != "hf" else path
    tok_dir = os.path.join(directory, "tokenizer") if kind != "hf" else directory
    if not os.path.isdir(tok_dir):
        raise CheckpointError(f"source={source!r} has no tokenizer ({tok_dir} is missing)")
    return AutoTokenizer.from_pretrained(tok_dir)


def chat_tokens(tokenizer, message: str | list[dict], system: str | None = None) -> list[int]:
    """Token ids of a chat prompt (one user message or a list of messages) ending with the assistant
    turn."""
    messages = [{"role": "user", "content": message}] if isinstance(message, str) else list(message)
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def chat_parts(
    tokenizer, before: str, after: str, answer_prefix: str = "", system: str | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of a one-turn chat prompt whose user message is ``before + after``, cut between the
    two: the template's head with ``before`` (a context to compress once), then ``after``
    (a question), the end of the user turn, the assistant header and ``answer_prefix``."""
    marker = "\x00SPLIT\x00"
    messages = [{"role": "user", "content": before + marker + after}]
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    head, tail = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ).split(marker)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(head), encode(tail + answer_prefix)
