"""What the server sends back: the text of the tokens so far (``Text``), the pieces of an answer as
the driver delivers them (``pieces``) and OpenAI's response objects, whole or as server-sent
events (``Reply``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request as HTTPRequest

from kvjax.serving.api.errors import APIError
from kvjax.serving.driver import Request

POLL_SECONDS = 0.25  # how often a non-streaming request checks that its client is still connected


class Text:
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


async def pieces(
    request: Request, updates: asyncio.Queue, text: Text, http: HTTPRequest | None
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


class Reply:
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
