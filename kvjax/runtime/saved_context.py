"""A compressed context on disk: ``save_context`` / ``load_context``, so a later process asks more
questions without compressing again.

Layout of ``<dir>/``: ``cache/`` (Orbax: the cache's arrays and the next-token logits),
``files.json`` (the size and CRC-32 of every file under ``cache/``, checked before Orbax reads
them) and ``kvjax_context.json`` (the model's config, the eviction settings it was compressed
with, the rows' lengths, the dtype and the cache kind; written last). The directory is written
under a temporary sibling name and renamed into place, so a crash never leaves a half-written
context under ``<dir>``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from flax.serialization import from_state_dict, register_serialization_state, to_state_dict

from kvjax.cache.dense import BudgetCache
from kvjax.cache.paged import PagedCache
from kvjax.checkpoint.errors import CheckpointError
from kvjax.checkpoint.store import atomic_directory, damage, record_files
from kvjax.eviction import Policy
from kvjax.kernels.quantized import Quantized
from kvjax.model.config import ModelConfig
from kvjax.model.params import Params
from kvjax.runtime.context import Context
from kvjax.runtime.protocol import Eviction
from kvjax.sharding import to_host

META_FILE = "kvjax_context.json"
CONTEXTS = "contexts"  # the folder of contexts saved by name, in kvjax.loading.checkpoint_root()
# 2: Expected Attention's state holds each slot's log ‖v‖ (``Base.token_state``); 3: a state of
# one value per KV head where the policy folds its query heads (``Policy.state_groups``)
FORMAT = 3
CACHE_KINDS = {"budget": BudgetCache, "paged": PagedCache}

# quantized keys and values (kv_dtype) are saved as their codes and scales
register_serialization_state(
    Quantized,
    lambda q: {"data": q.data, "scale": q.scale},
    lambda q, state: Quantized(state["data"], state["scale"], q.kind, q.dtype),
)


def _eviction_to_json(ev: Eviction) -> dict:
    return dataclasses.asdict(ev)


# in the policy of contexts saved before ScoringData: what compressed them, which a compressed
# context no longer needs
SCORING_DATA = ("repeat_prompt", "head_scores", "head_budgets")


def _eviction_from_json(raw: dict) -> Eviction:
    policy = {k: v for k, v in raw["policy"].items() if k not in SCORING_DATA}
    return Eviction(**(raw | {"policy": Policy(**policy)}))


def context_path(name_or_path: str) -> str:
    """Where a context given on the command line lives: a bare NAME (no path separator, not starting
    with "." or "~") in ``contexts/`` of the kvjax directory (``kvjax.loading.checkpoint_root``),
    anything else the path it names."""
    from kvjax.loading import checkpoint_root

    if (
        os.sep in name_or_path
        or (os.altsep and os.altsep in name_or_path)
        or name_or_path.startswith((".", "~"))
    ):
        return os.path.expanduser(name_or_path)
    return os.path.join(checkpoint_root(), CONTEXTS, name_or_path)


def save_context(path: str, context: Context, params: Params) -> None:
    """Write ``context`` (compressed for ``params``' model) to the directory ``path``, replacing one
    there."""
    import orbax.checkpoint as ocp

    kind = next(name for name, cls in CACHE_KINDS.items() if isinstance(context.cache, cls))
    meta = {
        "format": FORMAT,
        "config": json.loads(params.config.to_json()),
        "dtype": np.dtype(params.dtype).name,
        "cache": kind,
        "eviction": _eviction_to_json(context.ev),
        "lengths": [int(n) for n in context.lengths],
        "batched": context.batched,
    }
    # saved without a decoding's buffers (the statistics settled): the form ``load_context`` reads
    cache = context.cache.replace(
        stats=context.ev.policy.scorer.fit_stats(context.cache.stats, False)
    )
    cache = _without_empty(to_state_dict(jax.tree.map(to_host, cache)))
    arrays = {"cache": cache, "logits": to_host(context.logits)}
    with atomic_directory(path) as tmp:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(os.path.join(tmp, "cache"), arrays)
            ckpt.wait_until_finished()
        record_files(tmp, "cache")
        # written last: marks a complete context
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)


def _without_empty(tree):
    """A cache's state dict without its zero-size arrays (moments without sums), which orbax
    cannot write."""
    if not isinstance(tree, dict):
        return tree
    return {k: _without_empty(v) for k, v in tree.items() if getattr(v, "size", 1) > 0}


def _with_empty(stored, template):
    """A restored state dict with the zero-size arrays of ``template`` (the abstract cache's state
    dict) put back."""
    if not isinstance(template, dict) or not isinstance(stored, dict):
        return stored
    empty = {
        k: np.zeros(t.shape, t.dtype)
        for k, t in template.items()
        if k not in stored and getattr(t, "size", 1) == 0
    }
    return {k: _with_empty(v, template.get(k)) for k, v in stored.items()} | empty


def read_meta(path: str) -> dict:
    """The metadata of a saved context (CheckpointError if missing, corrupt or of another
    format)."""
    try:
        with open(os.path.join(path, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path} is not a saved kvjax context: {META_FILE} is missing or corrupt ({e})"
        ) from e
    if meta.get("format") not in range(1, FORMAT + 1):
        raise CheckpointError(
            f"{path}: saved context format {meta.get('format')!r}, this kvjax reads 1 to {FORMAT}"
        )
    return meta


def load_context(path: str, params: Params) -> Context:
    """The context saved in ``path`` (on one device), checked against ``params``: the same model
    config and dtype, else a CheckpointError naming the differences."""
    import orbax.checkpoint as ocp

    meta = read_meta(path)
    saved = ModelConfig.from_json(json.dumps(meta["config"]))
    if saved != params.config:
        diff = [
            f"{f.name}: saved {getattr(saved, f.name)!r}, model {getattr(params.config, f.name)!r}"
            for f in dataclasses.fields(saved)
            if getattr(saved, f.name) != getattr(params.config, f.name)
        ]
        raise CheckpointError(f"{path} was compressed for another model: " + "; ".join(diff))
    dtype = np.dtype(params.dtype).name
    if meta["dtype"] != dtype:
        raise CheckpointError(
            f"{path} was compressed with dtype={meta['dtype']}; load the model with that "
            f"dtype (got {dtype})"
        )
    ev = _eviction_from_json(meta["eviction"])
    if (
        meta["format"] == 1
        and ev.policy.scorer.token_state(np.ones((1, 1), np.float32)) is not None
    ):
        raise CheckpointError(
            f"{path} was saved in format 1, without the per-slot state of scorer="
            f"{ev.policy.name!r} (each value's norm); compress the context again"
        )
    lengths = np.asarray(meta["lengths"], np.int32)
    template = jax.eval_shape(
        lambda: ev.empty_cache(params.config, len(lengths), ev.decode_spare(0), params.dtype)
    )
    if type(template) is not CACHE_KINDS[meta["cache"]]:
        raise CheckpointError(
            f"{path}: a {meta['cache']} cache does not match its eviction settings"
        )
    if problem := damage(path):
        raise CheckpointError(f"{path}/cache is corrupt: {problem}; compress the context again")
    with ocp.StandardCheckpointer() as ckpt:
        try:
            stored = ckpt.restore(os.path.join(path, "cache"))
        except Exception as e:
            raise CheckpointError(f"{path}/cache is corrupt: {type(e).__name__}: {e}") from e
    try:
        cache = from_state_dict(template, _with_empty(stored["cache"], to_state_dict(template)))
        if meta["format"] < 3:  # one state per query head: folded as this kvjax keeps it
            cache = cache.replace(state=ev.policy.fold(cache.state))
        cache = jax.device_put(cache)
        logits = jax.device_put(stored["logits"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/cache does not hold a {meta['cache']} cache: {e}") from e
    want, got = template.kv[0], cache.kv[0]
    if (got.ndim, got.shape[-1], got.dtype) != (
        want.ndim,
        want.shape[-1],
        want.dtype,
    ) or logits.shape != (len(lengths), params.config.vocab_size):
        raise CheckpointError(
            f"{path}/cache: keys {got.shape} {got.dtype} and logits {logits.shape} do not "
            f"match its metadata"
        )
    return Context(cache=cache, lengths=lengths, logits=logits, ev=ev, batched=meta["batched"])
