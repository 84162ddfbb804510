"""Compress a document once, answer many questions on it: a store of compressed contexts by id.

Each context lives on disk as ``<root>/<id>/`` (the saved-context format of
``kvjax.runtime.saved_context``) with its record beside it in ``<root>/<id>.json``; the most
recently used ones are also kept in memory, up to a byte limit. The id is a content hash of the
tokens, the settings the eviction options resolve to and the model, so adding the same document
twice compresses it once.

A context is complete once its record is written (last, by a rename); one server owns a root at a
time. What a killed process leaves (temporaries named ``.<id>...``, a context directory without its
record) is removed when a store opens the root, so a cut write is absent, never half-read.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from kvjax.checkpoint.errors import CheckpointError
from kvjax.loading import chat_parts
from kvjax.model.params import Params
from kvjax.runtime.context import Context
from kvjax.runtime.kvzip_pass import config_fingerprint
from kvjax.runtime.options import EvictionOptions, eviction_from, with_tokenizer
from kvjax.runtime.prefilled import prefill
from kvjax.runtime.saved_context import load_context, read_meta, save_context

log = logging.getLogger(__name__)
ID = re.compile(r"[0-9a-f]{24}")
# what a write cut by a kill leaves: atomic_directory's ".<id>.<random>.tmp" and the record's
# ".<id>.json.tmp<pid>"
CUT_WRITE = re.compile(r"\.[0-9a-f]{24}\.(json\.tmp\d+|.+\.tmp)")


@dataclasses.dataclass(frozen=True)
class ContextRecord:
    """What the store knows of one compressed context, without loading it.

    Fields:
        id: the content hash (24 hex digits) naming it.
        n_tokens: tokens of the document it was compressed from.
        kept: valid slots of the compressed cache, over every layer and KV head.
        bytes: bytes of its cache arrays and next-token logits.
        seconds: wall time of the compression.
        created: when it was compressed (unix time).
        eviction: the eviction keywords it was compressed with, as JSON (a RepeatPrompt as a dict).
        messages: the chat messages it holds, or None for a document (what a question appended to
            it is rendered after).
    """

    id: str
    n_tokens: int
    kept: int
    bytes: int
    seconds: float
    created: float
    eviction: dict
    messages: list | None = None


def _as_json(value):
    """``json.dumps`` fallback: dataclasses (RepeatPrompt) as dicts, NumPy scalars as numbers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"eviction option {value!r} is not JSON-serializable")


def context_bytes(context: Context) -> int:
    """Bytes of a context's cache arrays and its logits."""
    leaves = jax.tree.leaves(context.cache) + [context.logits]
    return sum(int(x.nbytes) for x in leaves if isinstance(x, (jax.Array, np.ndarray)))


class ContextStore:
    """Compressed contexts of one model under ``root``, the recently used ones in memory.

    Thread-safe: one lock guards the records and the memory (loads from disk run under it); one
    compression runs at a time, while ``get`` of other contexts goes on.
    """

    def __init__(self, params: Params, root: str, memory_bytes: int):
        """params: the model every context is compressed for; root: the directory of the contexts
        (created if missing; contexts already there are listed, from their metadata only);
        memory_bytes: the most bytes of contexts kept in memory."""
        if memory_bytes < 0:
            raise ValueError(
                f"memory_bytes (--context-memory-mb) must be >= 0, got {memory_bytes} bytes"
            )
        self.params = params
        self.root = root
        self.memory_bytes = memory_bytes
        self._config = json.loads(params.config.to_json())
        self._dtype = np.dtype(params.dtype).name
        self._lock = threading.Lock()
        self._compressing = threading.Lock()
        self._records: dict[str, ContextRecord] = {}
        self._memory: collections.OrderedDict[str, tuple[Context, int]] = collections.OrderedDict()
        self._loads = 0  # contexts read back from disk since this store opened
        os.makedirs(root, exist_ok=True)
        names = sorted(os.listdir(root))
        for name in names:
            path = os.path.join(root, name)
            if CUT_WRITE.fullmatch(name) or (
                ID.fullmatch(name) and os.path.isdir(path) and f"{name}.json" not in names
            ):
                log.warning("removing %s: a write cut before it completed", path)
                _remove(path)
            elif not name.startswith(".") and os.path.isdir(path):
                self._list(name, path)

    def _list(self, name: str, path: str) -> None:
        """Adds the record of the saved context ``path`` (a restart); skips (and logs) one that is
        not a complete context of this model and dtype."""
        try:
            meta = read_meta(path)
            if meta["config"] != self._config or meta["dtype"] != self._dtype:
                log.warning("skipping %s: compressed for another model config or dtype", path)
                return
            with open(self._record_path(name)) as f:
                self._records[name] = ContextRecord(**json.load(f))
        except (CheckpointError, OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            log.warning("skipping %s: not a stored context (%s: %s)", path, type(e).__name__, e)

    def _record_path(self, id: str) -> str:
        return os.path.join(self.root, f"{id}.json")

    def context_id(self, tokens: np.ndarray, eviction: dict) -> str:
        """The id of ``tokens`` [T] compressed under ``eviction`` for this store's model: sha256 of
        the token ids, the settings the options resolve to (so defaults spelled out or left out
        give one id), their scoring data, the model config's fingerprint and the dtype."""
        options = EvictionOptions.of(**eviction)
        h = hashlib.sha256(np.asarray(tokens, np.int64).tobytes())
        for part in (
            repr(options.resolve(len(tokens), self.params)),
            repr(options.scoring_data(self.params.config).key()),
            config_fingerprint(self.params.config),
            self._dtype,
        ):
            h.update(b"\0" + part.encode())
        return h.hexdigest()[:24]

    def add(
        self, tokens: np.ndarray, messages: list | None = None, **eviction
    ) -> tuple[ContextRecord, bool]:
        """Compress ``tokens`` [T] (one document) under ``eviction`` (the keywords of
        ``kvjax.prefill``; a budget is required), save it and keep it in memory. Returns its record
        and True, or, when that id is already stored, its record and False (nothing compressed).
        ``messages``: the chat messages the tokens render, kept in the record. Errors of
        ``kvjax.prefill`` (a document longer than the model's context, bad options) propagate."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D (one document), got shape {tokens.shape}")
        id = self.context_id(tokens, eviction)
        with self._compressing:
            with self._lock:
                if id in self._records:
                    return self._records[id], False
            start = time.time()
            context = prefill(self.params, tokens, **eviction)
            jax.block_until_ready(context.logits)
            seconds = time.time() - start
            save_context(os.path.join(self.root, id), context, self.params)
            record = ContextRecord(
                id=id,
                n_tokens=len(tokens),
                kept=int((np.asarray(context.cache.pos) >= 0).sum()),
                bytes=context_bytes(context),
                seconds=seconds,
                created=time.time(),
                eviction=json.loads(json.dumps(eviction, default=_as_json)),
                messages=messages,
            )
            tmp = os.path.join(self.root, f".{id}.json.tmp{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(record), f, indent=1)
            os.replace(tmp, self._record_path(id))  # written last: marks a complete context
            with self._lock:
                self._records[id] = record
                self._keep(id, context, record.bytes)
        return record, True

    def get(self, id: str) -> Context:
        """The context ``id``: from memory, else loaded from disk and kept in memory (unless larger
        than the whole limit: then it is served but not kept). KeyError for an unknown id."""
        with self._lock:
            if id not in self._records:
                raise KeyError(id)
            if id in self._memory:
                self._memory.move_to_end(id)
                return self._memory[id][0]
            context = load_context(os.path.join(self.root, id), self.params)
            self._loads += 1
            self._keep(id, context, self._records[id].bytes)
            return context

    def _keep(self, id: str, context: Context, nbytes: int) -> None:
        """Keeps ``context`` in memory (the lock held), moving the least recently used ones out of
        memory (not off disk) to stay within ``memory_bytes``; one larger than that is not kept."""
        if nbytes > self.memory_bytes:
            return
        while sum(n for _, n in self._memory.values()) + nbytes > self.memory_bytes:
            self._memory.popitem(last=False)
        self._memory[id] = (context, nbytes)

    def usage(self) -> dict:
        """Contexts stored and in memory, the bytes these hold against ``memory_bytes``, and how
        many times a context was read back from disk since the store opened."""
        with self._lock:
            return {
                "stored": len(self._records),
                "in_memory": len(self._memory),
                "memory_bytes": sum(n for _, n in self._memory.values()),
                "memory_limit": self.memory_bytes,
                "loads_from_disk": self._loads,
            }

    def in_memory(self) -> list[str]:
        """The ids held in memory, least recently used first."""
        with self._lock:
            return list(self._memory)

    def records(self) -> list[ContextRecord]:
        """Every stored context's record, oldest first."""
        with self._lock:
            return sorted(self._records.values(), key=lambda r: (r.created, r.id))

    def record(self, id: str) -> ContextRecord:
        """The record of ``id``; KeyError for an unknown id."""
        with self._lock:
            if id not in self._records:
                raise KeyError(id)
            return self._records[id]

    def delete(self, id: str) -> None:
        """Remove ``id`` from memory and disk; afterwards it is unknown (KeyError). A Context
        already returned by ``get`` is an ordinary object and stays usable by whoever holds it."""
        with self._lock:
            if id not in self._records:
                raise KeyError(id)
            del self._records[id]
            self._memory.pop(id, None)
            os.remove(self._record_path(id))  # first: a crash leaves no listed half-deleted context
            shutil.rmtree(os.path.join(self.root, id), ignore_errors=True)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)


class ContextService:
    """The server's contexts: their store, the engine of contexts answering questions on them (a
    driver thread of its own), and one worker that compresses documents off both decode loops.

    Args:
        store: where the contexts live.
        driver: a ``Driver`` over an ``Engine`` made with ``contexts=`` (whose slot geometry every
            context must have); started and stopped by the caller.
        tokenizer: the model's (chat template, KVzip's repeat prompt).
        eviction: the keywords a posted context defaults to (budget and scorer at least).
        evict_driver: a ``Driver`` over an ``Engine`` made with ``contexts=`` and ``evict=True``,
            for questions that ask to be evicted under their context's budget, or None for none;
            started and stopped by the caller.
    """

    def __init__(self, store: ContextStore, driver, tokenizer, eviction: dict, evict_driver=None):
        self.store, self.driver, self.tokenizer, self.eviction = store, driver, tokenizer, eviction
        self.evict_driver = evict_driver
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvjax-compress")

    def driver_for(self, context: Context, evict: bool):
        """The driver that continues ``context`` as ``kvjax.decode(..., evict=evict)`` does: the
        evicting slots when ``evict`` and the context's scorer evicts as it continues, else the
        slots without eviction. ValueError when that needs evicting slots and there are none."""
        if not evict or context.ev.policy.scorer.scoring_pass is not None:
            return self.driver
        if self.evict_driver is None:
            raise ValueError(
                "context_evict: this server has no slots that evict under a context's budget "
                "(start it with --context-evict-slots)"
            )
        return self.evict_driver

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )

    def document_tokens(self, document: str, system: str | None = None) -> list[int]:
        """A document's context, as ``kvjax ask`` makes it: the chat template's head and the start
        of a user turn holding the document (``kvjax.loading.chat_parts``)."""
        return chat_parts(self.tokenizer, document + "\n\n", "", system=system)[0]

    def messages_tokens(self, messages: list[dict]) -> list[int]:
        """A conversation's context: its messages in the chat template, no generation prompt."""
        return self._encode(self._render(messages, False))

    def question_tokens(self, record: ContextRecord, messages: list[dict]) -> list[int]:
        """What a chat request appends to a context: for a document, the rest of its user turn (one
        user message, as ``kvjax ask``); for a conversation, the new messages in the chat template
        and the assistant header. ValueError for messages that cannot continue it."""
        if record.messages is None:
            if len(messages) != 1 or messages[0]["role"] != "user":
                raise ValueError(
                    "messages: a question on a document context is one user message "
                    "(the document is the start of its user turn)"
                )
            return chat_parts(self.tokenizer, "", messages[0]["content"])[1]
        before = self._render(record.messages, False)
        after = self._render(record.messages + messages, True)
        if not after.startswith(before):
            raise ValueError(
                "messages: the chat template renders the context's messages differently once "
                "these follow; they cannot continue it"
            )
        return self._encode(after[len(before) :])

    def options(self, given: dict, n_tokens: int) -> dict:
        """The eviction keywords of a posted context: ``given`` over the server's defaults, with
        KVzip's repeat prompt made from the tokenizer, validated, and of the slots' geometry
        (ValueError or TypeError naming what is wrong)."""
        options = with_tokenizer(self.tokenizer, **(self.eviction | given))
        ev = eviction_from(context=n_tokens, model=self.store.params, **options)
        if ev is None:
            raise ValueError("budget=None: a context is compressed under a budget")
        self.driver.engine.check_geometry(ev)
        return options

    def compress(self, tokens: list[int], messages: list | None, options: dict) -> Future:
        """Compress in the worker (``ContextStore.add``); the future's result: (record, created)."""
        tokens = np.asarray(tokens, np.int32)
        return self._worker.submit(self.store.add, tokens, messages, **options)

    def close(self) -> None:
        """Wait for the compression under way, then end the worker."""
        self._worker.shutdown(wait=True)
