"""Continuous batching: a thread that owns an ``Engine`` and its state, admits waiting requests
into its prompt rows (each reserving a free slot), feeds every prompt row a chunk per step,
together with a decode step of the running slots (``Engine.mixed``: a running slot waits for one
chunk at most, never a whole prompt), moves a row whose prompt is done into its slot, streams each
slot's new tokens to its request, and frees the slot on a stop id, the token limit or
``Request.cancel``.

``Driver.submit`` validates a request (ValueError), puts it in a bounded queue (``QueueFull`` when
full) and returns at once; ``Driver.stop`` finishes every accepted request, then ends the thread.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable

from kvjax.serving.engine import Engine, Inputs
from kvjax.sharding import to_host


class QueueFull(Exception):
    """The driver's queue of waiting requests is full."""


class Closed(Exception):
    """The driver is stopping (or has failed) and accepts no new requests."""


@dataclasses.dataclass(eq=False)
class Request:
    """One request and, as it runs, its output. on_update(tokens, finish_reason) is called from the
    driver's thread with each decode step's new tokens (a list of ints) and, on the last call, the
    finish reason: "stop" (a stop id, included in the tokens), "length" (the token limit),
    "cancelled" or "error". context: the ``kvjax.Context`` the prompt continues (an engine of
    contexts), or None."""

    inputs: Inputs
    stop_ids: frozenset[int]
    on_update: Callable[[list[int], str | None], None] | None = None
    context: object = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    _finished: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (a no-op once finished): the slot is freed before the next decode
        step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> list[int]:
        """Wait for the request to finish; returns its tokens (raises its error, or
        TimeoutError)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.tokens

    def _emit(
        self,
        tokens: list[int],
        finish_reason: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.tokens.extend(tokens)
        if finish_reason is not None:
            self.finish_reason, self.error = finish_reason, error
        if self.on_update is not None:
            try:
                self.on_update(tokens, finish_reason)
            except Exception:  # noqa: BLE001
                self.cancel()  # a listener that is gone (e.g. its event loop closed) cancels
        if finish_reason is not None:
            self._finished.set()


class Driver:
    """The serving loop of one engine. queue_size: requests that may wait for a slot (1 or more)."""

    def __init__(self, engine: Engine, queue_size: int = 64):
        if not (isinstance(queue_size, int) and queue_size >= 1):
            raise ValueError(f"queue_size={queue_size!r} must be an integer >= 1")
        self.engine = engine
        self._queue: queue.Queue[Request] = queue.Queue(queue_size)
        # a slot holds the request it decodes, or the one a prompt row prefills for it
        self._slots: list[Request | None] = [None] * engine.slots
        # per prompt row: None, or [request, its slot, prompt tokens fed]
        self._rows: list[list | None] = [None] * engine.prefill_rows
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvjax-driver", daemon=True)
        self.error: BaseException | None = None
        self.counts = {
            "admitted": 0,
            "stop": 0,
            "length": 0,
            "cancelled": 0,
            "error": 0,
            "steps": 0,
            "chunks": 0,
        }

    def start(self) -> Driver:
        self._thread.start()
        return self

    def submit(
        self,
        tokens,
        *,
        on_update: Callable[[list[int], str | None], None] | None = None,
        context=None,
        **sampling,
    ) -> Request:
        """Queue a prompt (1-D token ids); ``sampling``: the keywords of ``Engine.inputs``
        (max_new_tokens, temperature, top_k, top_p, seed, stop_ids); ``context``: the
        ``kvjax.Context`` it continues (an engine of contexts). Raises ValueError for a bad
        request, QueueFull, Closed."""
        if self._closing or self.error is not None:
            raise Closed(
                "the server is shutting down"
                if self.error is None
                else f"the engine failed: {self.error}"
            )
        inputs = self.engine.inputs(tokens, **sampling)
        if context is not None or self.engine.contexts is not None:
            self.engine.check_context(context, inputs)
        stops = frozenset(int(t) for t in inputs.stop[0] if t >= 0)
        request = Request(inputs, stops, on_update, context=context)
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            raise QueueFull(
                f"{self._queue.maxsize} requests are already waiting for a slot"
            ) from None
        self._wake.set()
        return request

    def stop(self, timeout: float | None = None) -> None:
        """Accept nothing more, finish the accepted requests, then end the thread
        (if it was started)."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._closing

    @property
    def active(self) -> int:
        """Slots in use: decoding, or reserved by a prompt being prefilled."""
        return sum(r is not None for r in self._slots)

    @property
    def prefilling(self) -> int:
        return sum(r is not None for r in self._rows)

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        try:
            state, filling = self.engine.init_state()
            while True:
                self._wake.clear()
                self._drop_cancelled()
                filling = self._admit(filling)
                if not self.active:
                    if self._closing and self._queue.empty():
                        return
                    self._wake.wait()
                    continue
                decoding = self.active - self.prefilling
                promoted = set()
                if self.prefilling:
                    rows = [None if r is None else (r[0].inputs, r[2]) for r in self._rows]
                    chunk = self.engine.chunk(rows)
                    if decoding:
                        state, filling, tokens, logits = self.engine.mixed(state, filling, chunk)
                    else:
                        filling, logits = self.engine.fill(filling, chunk)
                    self.counts["chunks"] += 1
                    state, promoted = self._promote(filling, chunk, logits, state)
                else:
                    state, tokens = self.engine.generate(state)
                if not decoding:
                    continue
                # [S, n] new tokens a slot (a mixed step's are [S]), on the host: an eager
                # reshape of the device array would compile after warm-up
                tokens = to_host(tokens).reshape(len(self._slots), -1)
                done = to_host(state.done)
                self.counts["steps"] += 1
                prefilling = {r[1] for r in self._rows if r is not None}
                for i, r in enumerate(self._slots):
                    # a slot promoted during this step decoded its previous occupant's row (one
                    # cancelled mid-decode is still running): its own tokens start next step
                    if r is None or i in prefilling or i in promoted:
                        continue
                    new = [int(t) for t in tokens[i] if t >= 0]
                    if not new and not done[i]:
                        continue
                    if done[i]:
                        self._free(
                            i,
                            "stop"
                            if r.tokens + new and (r.tokens + new)[-1] in r.stop_ids
                            else "length",
                            new,
                        )
                    else:
                        r._emit(new)
        except BaseException as e:
            # the engine failed: fail everything accepted, accept nothing more
            self.error = e
            self._rows = [None] * len(self._rows)
            for i, r in enumerate(self._slots):
                if r is not None:
                    self._free(i, "error", error=e)
            while not self._queue.empty():
                self._queue.get_nowait()._emit([], "error", e)
            raise

    def _drop_cancelled(self) -> None:
        """Free the slots (and prompt rows) of cancelled requests."""
        for j, row in enumerate(self._rows):
            if row is not None and row[0].cancelled:
                self._rows[j] = None
        for i, r in enumerate(self._slots):
            if r is not None and r.cancelled:
                self._free(i, "cancelled")

    def _admit(self, filling):
        """Start waiting requests in free prompt rows, each reserving a free slot (a request whose
        context fails to load finishes with its error)."""
        while None in self._rows and None in self._slots:
            try:
                r = self._queue.get_nowait()
            except queue.Empty:
                break
            if r.cancelled:
                self.counts["cancelled"] += 1
                r._emit([], "cancelled")
                continue
            j = self._rows.index(None)
            try:
                filling = self.engine.begin(filling, j, r.context)
            except Exception as e:  # noqa: BLE001 - the request's own failure, reported to it
                self.counts["error"] += 1
                r._emit([], "error", e)
                continue
            i = self._slots.index(None)
            self._slots[i], self._rows[j] = r, [r, i, 0]
            self.counts["admitted"] += 1
        return filling

    def _promote(self, filling, chunk, logits, state):
        """After a chunk: advance each prompt row, and move a row whose prompt is done into its
        slot. Returns the state and the slots promoted."""
        promoted = set()
        for j, row in enumerate(self._rows):
            if row is None:
                continue
            row[2] += int(chunk.n[j])
            if chunk.final[j]:
                state = self.engine.promote(filling, j, logits, state, row[1], row[0].inputs)
                promoted.add(row[1])
                self._rows[j] = None
        return state, promoted

    def _free(
        self, i: int, reason: str, tokens: list[int] = (), error: BaseException | None = None
    ) -> None:
        r, self._slots[i] = self._slots[i], None
        self.counts[reason] += 1
        r._emit(list(tokens), reason, error)
