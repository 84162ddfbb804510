"""``Service``: what every route of the server shares (the driver, the model's name and tokenizer,
the contexts) and what they have in common: the checks of a request and ``respond``, which queues
it and answers it whole or as server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from kvjax.runtime.options import NOT_FLAGS
from kvjax.serving.api.bodies import Sampling
from kvjax.serving.api.errors import APIError
from kvjax.serving.api.replies import Reply, Text, pieces
from kvjax.serving.contexts import ContextRecord, ContextService
from kvjax.serving.driver import Closed, Driver, QueueFull

MAX_STOP_STRINGS = 4  # as OpenAI's API


@dataclasses.dataclass
class Service:
    """The server's state, in ``app.state.service`` (``service`` gives it to a route).

    Fields:
        driver: the slots of ordinary requests.
        model_name: the name clients ask for.
        tokenizer: the model's.
        contexts: compressed contexts and their slots, or None.
    """

    driver: Driver
    model_name: str
    tokenizer: object
    contexts: ContextService | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def context_length(self) -> int:
        return self.driver.engine.params.config.max_seq_len

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def need_contexts(self) -> ContextService:
        if self.contexts is None:
            raise APIError(
                404,
                "this server keeps no contexts (start it with --context-slots)",
                code="not_found",
            )
        return self.contexts

    def context_card(self, record: ContextRecord) -> dict:
        eviction = {k: v for k, v in record.eviction.items() if k not in NOT_FLAGS}
        return {
            "id": record.id,
            "object": "context",
            "created": int(record.created),
            "model": self.model_name,
            "kind": "document" if record.messages is None else "messages",
            "tokens": record.n_tokens,
            "kept_slots": record.kept,
            "bytes": record.bytes,
            "seconds": round(record.seconds, 3),
            "eviction": eviction,
        }

    def record(self, id: str) -> ContextRecord:
        """The card's record of context ``id`` (404 for none)."""
        try:
            return self.need_contexts().store.record(id)
        except KeyError:
            raise missing(id) from None

    async def stored(self, id: str) -> tuple[ContextRecord, object]:
        """The record and the context of ``id`` (loaded from disk if it left memory; 404)."""
        record = self.record(id)
        try:
            return record, await asyncio.to_thread(self.contexts.store.get, id)
        except KeyError:  # deleted meanwhile
            raise missing(id) from None

    def runner_for(self, body: Sampling, stored_context) -> Driver:
        """The driver of a request: the contexts' (evicting or not, ``context_evict``) for one on a
        context, else the server's."""
        if stored_context is None:
            if body.context_evict:
                raise APIError(
                    400,
                    "context_evict: applies to a question on a context (context_id)",
                    param="context_evict",
                )
            return self.driver
        try:
            return self.contexts.driver_for(stored_context, body.context_evict)
        except ValueError as e:
            raise APIError(400, str(e), param="context_evict") from None

    def check_request(
        self, body: Sampling, ids: list[int], prompt_param: str, max_tokens: int, runner: Driver
    ) -> list[str]:
        """The request's stop strings, once its settings are checked against the engine (400)."""
        engine = runner.engine
        if body.n != 1:
            raise APIError(
                400, f"n={body.n}: this server returns one choice per request", param="n"
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS or not all(stop):
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        if not ids:
            raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
        context = self.context_length
        if len(ids) > engine.max_prompt or len(ids) + max_tokens > context:
            raise APIError(
                400,
                f"{prompt_param}: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed the "
                f"limits: prompts up to {engine.max_prompt} tokens, {context} tokens in all",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens > engine.max_new_tokens:
            raise APIError(
                400,
                f"max_tokens={max_tokens} must be in [1, {engine.max_new_tokens}] "
                "(the server's limit)",
                param="max_tokens",
            )
        return stop

    async def respond(
        self,
        http: HTTPRequest,
        body: Sampling,
        ids: list[int],
        prompt_param: str,
        max_tokens: int,
        chat: bool,
        stored_context=None,
    ):
        """Queue one request, on the contexts' driver when it continues ``stored_context``, and
        answer it whole or as server-sent events."""
        self.check_model(body.model)
        runner = self.runner_for(body, stored_context)
        stop = self.check_request(body, ids, prompt_param, max_tokens, runner)
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()
        try:
            request = runner.submit(
                ids,
                context=stored_context,
                on_update=lambda *u: loop.call_soon_threadsafe(updates.put_nowait, u),
                max_new_tokens=max_tokens,
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                seed=0 if body.seed is None else body.seed,
                stop_ids=() if body.ignore_eos else None,
            )
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is busy: {e}; retry later",
                code="queue_full",
                type="rate_limit_error",
            ) from None
        except Closed as e:
            raise APIError(503, str(e), code="unavailable", type="server_error") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        parts = pieces(request, updates, Text(self.tokenizer, stop), None if body.stream else http)
        reply = Reply(self.model_name, chat, len(ids), request)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            # The background task also cancels a request whose client left before its stream
            # started.
            return StreamingResponse(
                reply.events(parts, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(request.cancel),
            )
        text, reason = "", None
        async for delta, reason in parts:
            text += delta
        if reason is None:  # the client went away
            return JSONResponse({}, status_code=499)
        if reason == "error":
            raise APIError(500, f"the engine failed: {request.error}", type="server_error")
        return reply.whole(text, reason)


def missing(id: str) -> APIError:
    return APIError(404, f"no context {id!r}", param="context_id", code="context_not_found")


def service(http: HTTPRequest) -> Service:
    """The app's ``Service`` (a route's dependency)."""
    return http.app.state.service
