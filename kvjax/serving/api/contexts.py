"""``/v1/contexts``: documents (or conversations) compressed once, listed, read and deleted."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from kvjax.runtime.options import NAMES, NOT_FLAGS
from kvjax.serving.api.bodies import ContextBody, plain
from kvjax.serving.api.errors import APIError
from kvjax.serving.api.service import Service, missing, service

CONTEXT_OPTIONS = tuple(n for n in NAMES if n not in NOT_FLAGS + ("head_scores",))

router = APIRouter()


@router.post("/v1/contexts")
async def create_context(body: ContextBody, s: Service = Depends(service)):
    contexts = s.need_contexts()
    s.check_model(body.model)
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
    messages = None if body.messages is None else plain(body.messages)
    check_text(body.document, body.system, messages)
    try:
        tokens = (
            contexts.document_tokens(body.document, body.system)
            if messages is None
            else contexts.messages_tokens(messages)
        )
    except Exception as e:  # noqa: BLE001 - the chat template rejects the conversation
        raise APIError(400, f"messages: the chat template rejects them: {e}", "messages") from None
    param = "document" if messages is None else "messages"
    if len(tokens) > s.context_length:
        raise APIError(
            400,
            f"{param}: {len(tokens)} tokens exceed the model's context of {s.context_length}",
            param=param,
            code="context_length_exceeded",
        )
    try:
        options = contexts.options(given, len(tokens))
        record, created = await asyncio.wrap_future(contexts.compress(tokens, messages, options))
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=named(str(e))) from None
    return JSONResponse(s.context_card(record), status_code=201 if created else 200)


def check_text(document: str | None, system: str | None, messages: list[dict] | None) -> None:
    """A 400 for a document (or messages) with no text, or with text that is not Unicode (a lone
    surrogate, which JSON's escapes can carry)."""
    param = "document" if messages is None else "messages"
    texts = [document, system] if messages is None else [m["content"] for m in messages]
    if not "".join(t for t in texts if t).strip():
        raise APIError(400, f"{param}: empty (no text to compress)", param=param)
    for text in texts:
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400,
                f"{param}: not valid Unicode (a lone surrogate at character {e.start})",
                param=param,
            ) from None


def named(message: str) -> str | None:
    """The eviction option an error message starts with (``budget=0 must ...``), if any."""
    name = message.split("=", 1)[0]
    return name if name in CONTEXT_OPTIONS else None


@router.get("/v1/contexts")
async def list_contexts(s: Service = Depends(service)):
    return {
        "object": "list",
        "data": [s.context_card(r) for r in s.need_contexts().store.records()],
    }


@router.get("/v1/contexts/{id}")
async def get_context(id: str, s: Service = Depends(service)):
    return s.context_card(s.record(id))


@router.delete("/v1/contexts/{id}")
async def delete_context(id: str, s: Service = Depends(service)):
    try:
        s.need_contexts().store.delete(id)
    except KeyError:
        raise missing(id) from None
    return {"id": id, "object": "context.deleted", "deleted": True}
