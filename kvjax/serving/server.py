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

import asyncio
import json
import threading
import time
import uuid
from typing import AsyncIterator, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from kvjax.loading import chat_tokens
from kvjax.runtime.options import NAMES, NOT_FLAGS
from kvjax.serving.contexts import ContextRecord, ContextService
from kvjax.serving.driver import Closed, Driver, QueueFull, Request

MAX_STOP_STRINGS = 4  # as OpenAI's API
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
CONTEXT_OPTIONS = tuple(n for n in NAMES if n not in NOT_FLAGS + ("head_scores",))
POLL_SECONDS = 0.25  # how often a non-streaming request checks that its client is still connected


class APIError(Exception):
    """An error answered with OpenAI's body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class _Strict(BaseModel):
    """Unknown fields are refused, types are not coerced, and null stands for the default
    (as in OpenAI's API)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints take (OpenAI's names and defaults; ``top_k`` is an extension, as in
    vLLM)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    context_id: str | None = None  # an extension: continue a stored context (/v1/contexts)
    context_evict: bool = False  # an extension: evict the question under its context's budget
    ignore_eos: bool = False  # an extension (vLLM's): decode past the model's EOS ids


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class ContextBody(BaseModel):
    """``POST /v1/contexts``: a document (or chat messages) and its eviction keywords
    (``kvjax.EvictionOptions``' names as extra fields; the server's defaults for the others)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    document: str | None = None
    system: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)


class _Text:
    """Incremental detokenization: the text of the tokens so far, cut at the first stop string,
    without a trailing incomplete character or what could still become a stop string
    (unless final)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop, self.ids, self.sent = tokenizer, stop, [], ""

    def add(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        """The new text to send and whether a stop string was reached."""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        elif not final:
            text = text.rstrip("\ufffd")
            if self.stop:
                text = text[: len(text) - max(map(len, self.stop)) + 1]
        delta = text[len(self.sent) :]
        self.sent += delta
        return delta, cut >= 0


def create_app(
    driver: Driver, model_name: str, tokenizer, contexts: ContextService | None = None
) -> FastAPI:
    """The FastAPI app serving ``driver`` (started and stopped by the caller) as model
    ``model_name``; ``contexts``: compressed contexts and the slots that answer questions on them
    (``/v1/contexts``, ``context_id``), or None for none."""
    app = FastAPI(title="kvjax", description="OpenAI-compatible serving of a kvjax engine")
    engine, created = driver.engine, int(time.time())
    context = engine.params.config.max_seq_len

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            return APIError(
                400,
                f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}",
                code="invalid_json",
            ).response()
        loc = [str(part) for part in error["loc"][1:]]
        message = "unsupported field" if error["type"] == "extra_forbidden" else error["msg"]
        return APIError(
            422,
            f"{'.'.join(loc) or 'body'}: {message}",
            param=loc[0] if loc else None,
            code=error["type"],
        ).response()

    @app.exception_handler(HTTPException)
    async def _http(http: HTTPRequest, e: HTTPException):
        return APIError(
            e.status_code,
            f"{http.method} {http.url.path}: {e.detail}",
            code="not_found" if e.status_code == 404 else None,
        ).response()

    @app.get("/health")
    async def health():
        body = {
            "status": "ok" if driver.running else "unavailable",
            "slots": engine.slots,
            "active": driver.active,
            "waiting": driver.waiting,
        }
        return JSONResponse(body, status_code=200 if driver.running else 503)

    def model_card():
        return {"id": model_name, "object": "model", "created": created, "owned_by": "kvjax"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )

    def need_contexts() -> ContextService:
        if contexts is None:
            raise APIError(
                404,
                "this server keeps no contexts (start it with --context-slots)",
                code="not_found",
            )
        return contexts

    def context_card(record: ContextRecord) -> dict:
        eviction = {k: v for k, v in record.eviction.items() if k not in NOT_FLAGS}
        return {
            "id": record.id,
            "object": "context",
            "created": int(record.created),
            "model": model_name,
            "kind": "document" if record.messages is None else "messages",
            "tokens": record.n_tokens,
            "kept_slots": record.kept,
            "bytes": record.bytes,
            "seconds": round(record.seconds, 3),
            "eviction": eviction,
        }

    def missing(id: str) -> APIError:
        return APIError(404, f"no context {id!r}", param="context_id", code="context_not_found")

    def context_record(id: str) -> ContextRecord:
        try:
            return need_contexts().store.record(id)
        except KeyError:
            raise missing(id) from None

    @app.post("/v1/contexts")
    async def create_context(body: ContextBody):
        service = need_contexts()
        check_model(body.model)
        given = dict(body.model_extra or {})
        if unknown := sorted(set(given) - set(CONTEXT_OPTIONS)):
            raise APIError(
                400,
                f"{', '.join(unknown)}: not eviction options of a context "
                f"(those are {', '.join(CONTEXT_OPTIONS)})",
                param=unknown[0],
            )
        if (body.document is None) == (body.messages is None):
            raise APIError(400, "give the document or the messages (one of them)", param="document")
        if body.messages is not None and body.system is not None:
            raise APIError(400, "system: goes with a document; put it in the messages", "system")
        messages = None if body.messages is None else _plain(body.messages)
        try:
            tokens = (
                service.document_tokens(body.document, body.system)
                if messages is None
                else service.messages_tokens(messages)
            )
        except Exception as e:  # noqa: BLE001 - the chat template rejects the conversation
            raise APIError(
                400, f"messages: the chat template rejects them: {e}", "messages"
            ) from None
        param = "document" if messages is None else "messages"
        if len(tokens) > context:
            raise APIError(
                400,
                f"{param}: {len(tokens)} tokens exceed the model's context of {context}",
                param=param,
                code="context_length_exceeded",
            )
        try:
            options = service.options(given, len(tokens))
            record, created = await asyncio.wrap_future(service.compress(tokens, messages, options))
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        return JSONResponse(context_card(record), status_code=201 if created else 200)

    @app.get("/v1/contexts")
    async def list_contexts():
        return {
            "object": "list",
            "data": [context_card(r) for r in need_contexts().store.records()],
        }

    @app.get("/v1/contexts/{id}")
    async def get_context(id: str):
        return context_card(context_record(id))

    @app.delete("/v1/contexts/{id}")
    async def delete_context(id: str):
        try:
            need_contexts().store.delete(id)
        except KeyError:
            raise missing(id) from None
        return {"id": id, "object": "context.deleted", "deleted": True}

    async def stored(id: str) -> tuple[ContextRecord, object]:
        """The record and the context of ``id`` (loaded from disk if it left memory; 404)."""
        record = context_record(id)
        try:
            return record, await asyncio.to_thread(contexts.store.get, id)
        except KeyError:  # deleted meanwhile
            raise missing(id) from None

    def runner_for(body: _Sampling, stored_context) -> Driver:
        """The driver of a request: the contexts' (evicting or not, ``context_evict``) for one on a
        context, else the server's."""
        if stored_context is None:
            if body.context_evict:
                raise APIError(
                    400,
                    "context_evict: applies to a question on a context (context_id)",
                    param="context_evict",
                )
            return driver
        try:
            return contexts.driver_for(stored_context, body.context_evict)
        except ValueError as e:
            raise APIError(400, str(e), param="context_evict") from None

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    f"prompt: a batch of {len(prompt)} prompts; this server takes one per request",
                    param="prompt",
                )
            prompt = prompt[0]
        stored_context = None
        if body.context_id is not None:  # appended to the context: no second BOS
            _, stored_context = await stored(body.context_id)
            ids = (
                tokenizer(prompt, add_special_tokens=False)["input_ids"]
                if isinstance(prompt, str)
                else list(prompt)
            )
        else:
            ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        max_tokens = body.max_tokens or COMPLETION_MAX_TOKENS
        return await respond(http, body, ids, "prompt", max_tokens, False, stored_context)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        messages = _plain(body.messages)
        stored_context, before = None, 0
        if body.context_id is not None:
            record, stored_context = await stored(body.context_id)
        try:
            if body.context_id is None:
                ids = chat_tokens(tokenizer, messages)
            else:
                ids, before = contexts.question_tokens(record, messages), record.n_tokens
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - the chat template rejects the conversation
            raise APIError(
                400, f"messages: the chat template rejects them: {e}", param="messages"
            ) from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI's default: as many as fit
            limit = runner_for(body, stored_context).engine.max_new_tokens
            max_tokens = max(1, min(limit, context - before - len(ids)))
        return await respond(http, body, ids, "messages", max_tokens, True, stored_context)

    async def respond(
        http: HTTPRequest,
        body: _Sampling,
        ids: list[int],
        prompt_param: str,
        max_tokens: int,
        chat: bool,
        stored_context=None,
    ):
        """Queue one request, on the contexts' driver when it continues ``stored_context``, and
        answer it whole or as server-sent events."""
        check_model(body.model)
        runner = runner_for(body, stored_context)
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
        pieces = _pieces(request, updates, _Text(tokenizer, stop), None if body.stream else http)
        reply = _Reply(model_name, chat, len(ids), request)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            # The background task also cancels a request whose client left before its stream
            # started.
            return StreamingResponse(
                reply.events(pieces, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(request.cancel),
            )
        text, reason = "", None
        async for delta, reason in pieces:
            text += delta
        if reason is None:  # the client went away
            return JSONResponse({}, status_code=499)
        if reason == "error":
            raise APIError(500, f"the engine failed: {request.error}", type="server_error")
        return reply.whole(text, reason)

    return app


def _plain(messages: list[Message]) -> list[dict]:
    """Chat messages as the chat template takes them (text parts joined; developer = system)."""
    return [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.content
            if isinstance(m.content, str)
            else "".join(p.text for p in m.content),
        }
        for m in messages
    ]


async def _pieces(
    request: Request, updates: asyncio.Queue, text: _Text, http: HTTPRequest | None
) -> AsyncIterator[tuple[str, str | None]]:
    """(new text, finish reason) as the driver delivers tokens; the last has a reason. ``http``: the
    request to poll for a disconnect (streaming responses are cancelled by Starlette instead).
    Whatever ends it early cancels the engine request."""
    try:
        while True:
            try:
                tokens, reason = await asyncio.wait_for(updates.get(), POLL_SECONDS)
            except TimeoutError:
                tokens, reason = [], None
            if http is not None and await http.is_disconnected():
                return
            delta, stopped = text.add(tokens, final=reason is not None)
            reason = "stop" if stopped else reason
            if delta or reason:
                yield delta, reason
            if reason is not None:
                return
    finally:
        request.cancel()


class _Reply:
    """OpenAI's response objects for one request: whole, or as server-sent event chunks."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int, request: Request):
        self.model, self.chat, self.prompt_tokens, self.request = (
            model,
            chat,
            prompt_tokens,
            request,
        )
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self) -> dict:
        n = len(self.request.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
        }

    def head(self, stream: bool) -> dict:
        kind = (
            ("chat.completion.chunk" if stream else "chat.completion")
            if self.chat
            else "text_completion"
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, reason: str) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self.head(False) | {"choices": [choice], "usage": self.usage()}

    def chunk(self, text: str, reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | (
                {"content": text} if text or role else {}
            )
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self.head(True) | {"choices": [choice]}

    async def events(
        self, pieces: AsyncIterator[tuple[str, str | None]], usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: (chat: a first chunk with the role) a chunk per piece of text, one
        with the finish reason, (``usage``: one with the usage), then ``[DONE]``."""

        def event(data) -> str:
            return f"data: {json.dumps(data)}\n\n"

        if self.chat:
            yield event(self.chunk("", role=True))
        async for delta, reason in pieces:
            if reason == "error":
                yield event(
                    APIError(
                        500, f"the engine failed: {self.request.error}", type="server_error"
                    ).body()
                )
                break
            if delta:
                yield event(self.chunk(delta))
            if reason is not None:
                yield event(self.chunk("", reason))
                if usage:
                    yield event(self.head(True) | {"choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"


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
