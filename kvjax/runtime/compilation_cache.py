"""JAX's persistent compilation cache for the command line and the server: a second run of the same
command compiles nothing it compiled before.

The cache directory is ``$KVJAX_COMPILATION_CACHE`` if set (``off`` disables it), else
``jax-cache/`` in the checkpoint dir (``kvjax.loading.checkpoint_root``: the user's cache directory,
or a checkout's git-ignored ``checkpoints/``). Every compilation is stored, however short: the CLI's
cold start is many small programs.
"""

from __future__ import annotations

import os

import jax

from kvjax.loading import checkpoint_root


def cache_dir() -> str | None:
    """Where compiled programs are cached (None: disabled by ``KVJAX_COMPILATION_CACHE=off``)."""
    chosen = os.environ.get("KVJAX_COMPILATION_CACHE")
    if chosen is not None and chosen.strip().lower() in ("off", "0", "none", ""):
        return None
    return chosen or os.path.join(checkpoint_root(), "jax-cache")


def enable() -> str | None:
    """Turn the persistent cache on (idempotent); returns its directory, or None when disabled."""
    path = cache_dir()
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
