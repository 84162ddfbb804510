"""The request bodies (OpenAI's names and defaults, with kvjax's extensions marked)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvjax.serving.engine import MAX_SEED


class Strict(BaseModel):
    """Unknown fields are refused, types are not coerced, and null stands for the default
    (as in OpenAI's API)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
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
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    user: str | None = None
    context_id: str | None = None  # an extension: continue a stored context (/v1/contexts)
    context_evict: bool = False  # an extension: evict the question under its context's budget
    ignore_eos: bool = False  # an extension (vLLM's): decode past the model's EOS ids


class CompletionBody(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(Sampling):
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


def plain(messages: list[Message]) -> list[dict]:
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
