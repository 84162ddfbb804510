"""Models by Hugging Face id (``"HuggingFaceTB/SmolLM2-135M-Instruct"``): found in the local Hugging
Face cache through ``huggingface_hub``, downloaded there when it is not and a network is
reachable."""

from __future__ import annotations

import os
import re

from kvjax.checkpoint.errors import CheckpointError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# what kvjax reads of a model repository: config, safetensors weights (and their index),
# tokenizer files
PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def cache_dir() -> str | None:
    """The hub cache to read, taken from the environment when called (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``; None: huggingface_hub's default)."""
    if chosen := os.environ.get("HF_HUB_CACHE"):
        return chosen
    home = os.environ.get("HF_HOME")
    return os.path.join(home, "hub") if home else None


def snapshot(repo_id: str) -> str:
    """The local directory of ``repo_id``'s files: from the cache, else downloaded into it (a
    CheckpointError saying where it looked when neither works)."""
    from huggingface_hub import snapshot_download

    cache = cache_dir()
    try:
        return snapshot_download(
            repo_id, allow_patterns=PATTERNS, cache_dir=cache, local_files_only=True
        )
    except Exception:  # noqa: BLE001
        pass  # not in the cache (the library's errors differ by version): try downloading
    try:
        return snapshot_download(repo_id, allow_patterns=PATTERNS, cache_dir=cache)
    except Exception as e:  # noqa: BLE001 - offline, unreachable, unknown or gated repository
        where = cache or "huggingface_hub's default cache (~/.cache/huggingface/hub)"
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        raise CheckpointError(
            f"source={repo_id!r} is no existing file or directory, and as a Hugging Face model id "
            f"it is not in the local cache ({where}) and could not be downloaded ({reason}). "
            f"Download it where a network is reachable (`hf download {repo_id}`; HF_HUB_CACHE or "
            "HF_HOME choose the cache), or pass its directory"
        ) from None
