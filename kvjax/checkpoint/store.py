"""The converted-checkpoint directory: Orbax params, kvjax config, tokenizer, provenance; written
atomically.

Layout of ``<dir>/``: ``kvjax_config.json`` (``ModelConfig``), ``params/`` (Orbax, float32),
``files.json`` (the size and CRC-32 of every file under ``params/``, checked before Orbax reads
them), ``tokenizer/`` (``save_pretrained`` output, optional), ``source.json`` (what it was
converted from).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zlib

import jax
import numpy as np

from kvjax.checkpoint.errors import CheckpointError
from kvjax.model.config import ModelConfig
from kvjax.model.params import (
    FUSED,
    Params,
    abstract_flat,
    params_from_flat,
    shape_mismatches,
)

CONFIG_FILE = "kvjax_config.json"
SOURCE_FILE = "source.json"
FILES_FILE = "files.json"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_source(path: str) -> dict | None:
    try:
        with open(os.path.join(path, SOURCE_FILE)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _nest(flat: dict) -> dict:
    """``{"layers.wqkv": x}`` -> ``{"layers": {"wqkv": x}}`` (Orbax keys may not contain dots)."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: str, sub: str) -> list[str]:
    top = os.path.join(root, sub)
    return sorted(
        os.path.relpath(os.path.join(d, name), root)
        for d, _, names in os.walk(top)
        for name in names
    )


def record_files(root: str, sub: str) -> None:
    """Write ``root/files.json``: the size and CRC-32 of every file under ``root/sub`` (an Orbax
    directory), for ``damage``."""
    listing = {
        rel: [os.path.getsize(os.path.join(root, rel)), _crc32(os.path.join(root, rel))]
        for rel in _files(root, sub)
    }
    with open(os.path.join(root, FILES_FILE), "w") as f:
        json.dump(listing, f, indent=0)


def damage(root: str) -> str | None:
    """What differs from ``root/files.json`` (a file missing, of another size or CRC-32), or None.
    Checked before Orbax reads a directory: Orbax reading a damaged file fails deep inside
    tensorstore, whose threads then print tracebacks after the error. A directory written before
    kvjax recorded its files has nothing to check (None)."""
    try:
        with open(os.path.join(root, FILES_FILE)) as f:
            listing = {str(rel): (int(size), int(crc)) for rel, (size, crc) in json.load(f).items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        return f"{FILES_FILE} is unreadable ({e})"
    for rel, (size, crc) in listing.items():
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if (found := os.path.getsize(path)) != size:
            return f"{rel} holds {found} bytes, {size} when written"
        if _crc32(path) != crc:
            return f"{rel} changed since it was written (its CRC-32 differs)"
    return None


@contextlib.contextmanager
def atomic_directory(path: str):
    """Yields a temporary sibling directory to fill; when the block ends without an error it is
    renamed to ``path`` (replacing a directory there), otherwise removed: ``path`` is never left
    half-written."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(
        prefix=f".{os.path.basename(os.path.abspath(path))}.", suffix=".tmp", dir=parent
    )
    try:
        yield tmp
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_checkpoint(
    path: str,
    cfg: ModelConfig,
    flat: dict[str, np.ndarray],
    tokenizer=None,
    source: dict | None = None,
) -> None:
    """Write atomically (``atomic_directory``); a stale conversion there (its source changed) is
    replaced."""
    import orbax.checkpoint as ocp

    with atomic_directory(path) as tmp:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(
                os.path.join(tmp, "params"),
                _nest({k: np.asarray(v, np.float32) for k, v in flat.items()}),
            )
            ckpt.wait_until_finished()
        record_files(tmp, "params")
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump(source or {}, f, indent=1)
        # written last: marks a complete checkpoint
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(cfg.to_json())


def read_config(path: str) -> ModelConfig:
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            return ModelConfig.from_json(f.read())
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}/{CONFIG_FILE} is missing or corrupt: {e}") from e


def read_checkpoint(path: str, dtype) -> Params:
    """Restore params (cast to ``dtype``) after checking every stored shape against the config."""
    import orbax.checkpoint as ocp

    cfg = read_config(path)
    params_dir = os.path.join(path, "params")
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{path} has no params/ directory")
    if problem := damage(path):
        raise CheckpointError(f"{params_dir} is corrupt: {problem}; delete {path} to convert again")
    with ocp.StandardCheckpointer() as ckpt:
        try:
            stored = _flatten(ckpt.metadata(params_dir).item_metadata.tree)
        except Exception as e:
            raise CheckpointError(f"{params_dir} is corrupt: cannot read its metadata ({e})") from e
        if problems := shape_mismatches(cfg, {k: tuple(m.shape) for k, m in stored.items()}):
            apart = any(part in stored for parts in FUSED.values() for part in parts)
            raise CheckpointError(
                f"{path} does not match its config ({len(problems)} problems):\n  "
                + "\n  ".join(problems)
                + (
                    "\nIts query, key and value projections are stored apart: an older kvjax "
                    "converted it (kvjax fuses them into layers.wqkv); convert its source again."
                    if apart
                    else ""
                )
            )
        try:
            tree = ckpt.restore(params_dir, _nest(abstract_flat(cfg, np.float32)))
        except Exception as e:
            raise CheckpointError(f"{params_dir} is corrupt: {type(e).__name__}: {e}") from e
    flat = _flatten(tree)
    return params_from_flat(
        cfg, {k: jax.device_put(np.asarray(v).astype(dtype)) for k, v in flat.items()}
    )
