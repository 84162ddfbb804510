"""An OpenAI-compatible HTTP server over a ``Driver``: ``/v1/completions`` and
``/v1/chat/completions`` (with ``stream: true`` as server-sent events in OpenAI's chunk format,
ending with ``data: [DONE]``), ``/v1/models`` and ``/health``; with a ``ContextService``, also
``/v1/contexts`` (POST a document to compress once; GET one or all; DELETE) and ``context_id`` on
both completion routes (passed with the official client's ``extra_body``), which continues a
stored context in the contexts' own slots without eviction, as ``kvjax.decode(..., evict=False)``,
or with ``context_evict: true`` in slots that evict under the context's budget, as
``kvjax.decode(..., evict=True)``.

Every error is a 4xx or 5xx with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:
400 for JSON that does not parse and for values the engine rejects (prompt beyond ``max_prompt`` or
the context, ``max_tokens`` above the engine's limit, ``n`` other than 1, bad stop strings), 422 for
a body that does not fit the schema (missing, wrong-typed or unsupported fields, sampling values out
of range), 404 for an unknown model, route or context, 429 when the driver's queue is full, 503
while shutting down. A client that disconnects cancels its request, which frees its slot.
"""

from __future__ import annotations

import threading
import time

from fastapi import FastAPI

from kvjax.serving.api import completions, models
from kvjax.serving.api import contexts as context_routes
from kvjax.serving.api.errors import install_handlers
from kvjax.serving.api.service import Service
from kvjax.serving.contexts import ContextService
from kvjax.serving.driver import Driver


def create_app(
    driver: Driver, model_name: str, tokenizer, contexts: ContextService | None = None
) -> FastAPI:
    """The FastAPI app serving ``driver`` (started and stopped by the caller) as model
    ``model_name``; ``contexts``: compressed contexts and the slots that answer questions on them
    (``/v1/contexts``, ``context_id``), or None for none. The routes live in
    ``kvjax.serving.api`` (models, completions, contexts), sharing a ``Service``."""
    app = FastAPI(title="kvjax", description="OpenAI-compatible serving of a kvjax engine")
    app.state.service = Service(driver, model_name, tokenizer, contexts)
    install_handlers(app)
    for router in (models.router, completions.router, context_routes.router):
        app.include_router(router)
    return app


class ServerThread:
    """uvicorn serving an app from a background thread on ``host``:``port`` (0: a free port), for
    tests, notebooks and benchmarks: ``with ServerThread(app) as server: ... server.url``. Leaving
    it shuts uvicorn down gracefully (the requests in flight finish first)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.host = host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="kvjax-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
