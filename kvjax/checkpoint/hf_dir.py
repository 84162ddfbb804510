"""Read a Hugging Face model directory: ``config.json`` plus one or many ``*.safetensors`` files."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from kvjax.checkpoint.errors import CheckpointError
from kvjax.checkpoint.layout import HF, convert
from kvjax.model.config import ModelConfig

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def read_safetensors_index(path: str) -> dict[str, tuple[str, dict]]:
    """``name -> (file, header entry)`` for one safetensors file, validating its header and
    extent."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(
                f"{path} is corrupt: header length {n} exceeds the file size {size}"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} is corrupt: unreadable safetensors header ({e})") from e
    header.pop("__metadata__", None)
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if 8 + n + end > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name} ends at byte {8 + n + end} of {size}"
            )
        entry["start"] = 8 + n
    return {name: (path, entry) for name, entry in header.items()}


def _read_tensor(path: str, entry: dict) -> np.ndarray:
    if entry["dtype"] not in _DTYPES:
        raise CheckpointError(
            f"{path}: tensor dtype {entry['dtype']} is not supported ({sorted(_DTYPES)})"
        )
    begin, end = entry["data_offsets"]
    buf = np.memmap(path, np.uint8, "r", offset=entry["start"] + begin, shape=(end - begin,))
    arr = np.frombuffer(buf, _DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return np.asarray(arr, np.float32)


def read_hf_dir(path: str) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and flat float32 kvjax arrays of a Hugging Face directory (shows a progress bar)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{path} has no config.json")
    try:
        with open(config_path) as f:
            cfg = ModelConfig.from_hf(json.load(f))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is corrupt: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{config_path} lacks the field {e}") from e
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            wanted = set(json.load(f)["weight_map"].values())
        if missing := sorted(wanted - set(files)):
            raise CheckpointError(f"{path}: shards listed in the index are missing: {missing}")
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors files")
    index = {}
    for file in files:
        index |= read_safetensors_index(os.path.join(path, file))
    skip = ["lm_head.weight"] if cfg.tie_embeddings else []
    return cfg, convert(
        cfg,
        index,
        lambda name: _read_tensor(*index[name]),
        HF,
        skip=skip,
        desc=f"reading {os.path.basename(os.path.abspath(path))}",
    )
