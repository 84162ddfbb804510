"""``/v1/completions`` and ``/v1/chat/completions`` (each optionally on a stored context)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi import Request as HTTPRequest

from kvjax.loading import chat_tokens
from kvjax.serving.api.bodies import ChatBody, CompletionBody, plain
from kvjax.serving.api.errors import APIError
from kvjax.serving.api.service import Service, service

COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionBody, http: HTTPRequest, s: Service = Depends(service)):
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
        _, stored_context = await s.stored(body.context_id)
    if isinstance(prompt, str):
        ids = s.tokenizer(prompt, add_special_tokens=body.context_id is None)["input_ids"]
    else:
        ids = list(prompt)
    max_tokens = body.max_tokens or COMPLETION_MAX_TOKENS
    return await s.respond(http, body, ids, "prompt", max_tokens, False, stored_context)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, http: HTTPRequest, s: Service = Depends(service)):
    messages = plain(body.messages)
    stored_context, before = None, 0
    if body.context_id is not None:
        record, stored_context = await s.stored(body.context_id)
    try:
        if body.context_id is None:
            ids = chat_tokens(s.tokenizer, messages)
        else:
            ids, before = s.contexts.question_tokens(record, messages), record.n_tokens
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - the chat template rejects the conversation
        raise APIError(
            400, f"messages: the chat template rejects them: {e}", param="messages"
        ) from None
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:  # OpenAI's default: as many as fit
        limit = s.runner_for(body, stored_context).engine.max_new_tokens
        max_tokens = max(1, min(limit, s.context_length - before - len(ids)))
    return await s.respond(http, body, ids, "messages", max_tokens, True, stored_context)
