"""KVzip's scorers: ``kvzip`` (a repeat pass scores every context token) and its repeat prompt.

The pass itself runs the model and lives in ``kvjax.runtime.kvzip_pass``; this module holds what the
scorer is: its engine settings, its repeat prompt (``RepeatPrompt``, ``kvzip_prompt``) and their
forms.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import struct

from kvjax.eviction.base import Base

TRAIL = 8  # tokens of the previous chunk that start a later repeat prompt
FORMS = ("paper", "kvpress")
DEFAULT_FORM = "kvpress"  # docs/results.md ("KVzip on prose") compares the two forms
# KVzipPress's n_sink: the first tokens in every score's softmax (and never evicted)
KVPRESS_SINKS = 4


@struct.dataclass
class RepeatPrompt:
    """Token ids of KVzip's repeat prompt (a pytree: the ids are its leaves).

    Fields:
        first: the ids before chunk 1.
        later: the ids before each later chunk, followed by the previous chunk's last ``TRAIL``
            tokens and ``colon``.
        colon: the ids after those trailing tokens.
        skip: the context's first tokens (a chat template's head), neither repeated nor scored
            (score 0).
        sinks: the context's first tokens that join every score's softmax beside the chunk and the
            repeat input.
        form: the ``FORMS`` entry ``kvzip_prompt`` made it from ("" for one built by hand).
    """

    first: tuple[int, ...]
    later: tuple[int, ...]
    colon: tuple[int, ...]
    skip: int = struct.field(pytree_node=False, default=0)
    sinks: int = struct.field(pytree_node=False, default=0)
    form: str = struct.field(pytree_node=False, default="")

    def input_for(self, context: np.ndarray, start: int, stop: int) -> np.ndarray:
        """The repeat input of the chunk ``context[start:stop]``."""
        if start == self.skip:
            head = self.first
        else:
            head = (
                self.later
                + tuple(int(t) for t in context[max(0, start - TRAIL) : start])
                + self.colon
            )
        return np.concatenate([np.asarray(head, np.int32), context[start:stop].astype(np.int32)])


def kvzip_prompt(tokenizer, form: str = DEFAULT_FORM) -> RepeatPrompt:
    """KVzip's repeat prompt in ``tokenizer``'s ids.

    "paper": the official code's wording after two newlines, "Repeat the previous context:" (later
    chunks: "... starting with" + the last 8 tokens + ":"), over the whole context. "kvpress":
    NVIDIA kvpress's ``KVzipPress``: "Repeat the previous context exactly." (later chunks: "Repeat
    the part of the previous context exactly, starting with" + the last 8 tokens), each followed by
    the chat template's end of the user turn and assistant header, so the model repeats as the
    assistant; the template's head (system prompt and user header, ``skip``) is not repeated, and
    the first 4 tokens join every score's softmax."""
    if form not in FORMS:
        raise ValueError(f"repeat={form!r} must be one of {FORMS}")
    ids = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    if form == "paper":
        return RepeatPrompt(
            first=ids("\n\nRepeat the previous context:"),
            later=ids("\n\nRepeat the previous context starting with"),
            colon=ids(":"),
            form=form,
        )
    skip, suffix = 0, ids("\n")
    # kvpress's split of the template around a dummy message
    if getattr(tokenizer, "chat_template", None):
        dummy, marker = "dummy context", "\n" + "#" * len("dummy context")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": dummy + marker}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        head, tail = text.split(marker)
        skip, suffix = len(ids(head.split(dummy)[0])), ids(tail)
    return RepeatPrompt(
        first=ids("\n\nRepeat the previous context exactly.") + suffix,
        later=ids("\n\nRepeat the part of the previous context exactly, starting with"),
        colon=suffix,
        skip=skip,
        sinks=KVPRESS_SINKS,
        form=form,
    )


@dataclasses.dataclass(frozen=True)
class KVzip(Base):
    name = "kvzip"
    description = (
        "KVzip: the most attention a token receives while the model repeats the context (a "
        "scoring pass after the prefill; needs `repeat_prompt`); top scores over every layer and "
        "KV head (kvpress's `KVzipPress()`; `adakv+kvzip`: over each layer's KV heads)"
    )
    replace = True
    scoring_pass = "kvzip"
    # kvpress's default, one threshold over every layer and KV head: at least as good as each
    # layer's heads sharing their budget in every cell of docs/results.md ("KVzip's global mode")
    default_allocation = "global"
    default_floor = 0.0  # kvpress's layerwise=True (adakv+kvzip) has no floor
    modifiers = ("caote", "fastcaote", "momentkv", "momentkv-mi", "momentkv-nc", "momentkv-zeroth")
