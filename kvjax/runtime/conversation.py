"""A multi-turn chat in one budgeted context: each user message and answer are appended to the same
cache and evicted under its scorer (``kvjax.extend``), never prefilled again from the start; and
what a context keeps.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from kvjax.cache.full import cache_bytes
from kvjax.model.params import Params
from kvjax.runtime.context import Context, extend
from kvjax.runtime.prefilled import prefill
from kvjax.sharding import to_host


@dataclasses.dataclass(frozen=True)
class Stats:
    """What a context holds.

    Fields:
        seen: tokens fed so far (row 0).
        kept: tokens kept per layer and KV head (mean).
        budget: the configured budget.
        kv_bytes: bytes of its keys and values.
        full_bytes: what a full cache of ``seen`` tokens would take.
    """

    seen: int
    kept: float
    budget: int
    kv_bytes: int
    full_bytes: int

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"{self.seen} tokens seen, {self.kept:.0f} kept per layer and KV head "
            f"({self.kept / self.seen:.0%}; budget {self.budget}); "
            f"KV cache {self.kv_bytes / mib:.1f} MiB vs {self.full_bytes / mib:.1f} MiB "
            f"for the full cache"
        )


def context_stats(params: Params, context: Context) -> Stats:
    cfg = params.config
    per_token = (
        2
        * cfg.n_layers
        * cfg.n_kv_heads
        * cfg.head_dim
        * np.dtype(context.cache.kv[0].dtype).itemsize
    )
    rows = len(context.lengths)
    kept = (to_host(context.cache.pos) >= 0).sum() / (cfg.n_layers * cfg.n_kv_heads * rows)
    seen = int(context.lengths[0])
    return Stats(
        seen=seen,
        kept=float(kept),
        budget=context.ev.policy.budget,
        kv_bytes=cache_bytes(context.cache, kv_only=True),
        full_bytes=per_token * int(context.lengths.sum()),
    )


class Conversation:
    """Turns of a chat kept in one budgeted context.

    Fields:
        eviction: the keywords of ``kvjax.EvictionOptions`` (a budget is required).
        sampling: max_new_tokens, temperature, top_k, top_p, seed (as ``kvjax.decode``).

    The first turn prefills the chat template's head and the message under the eviction protocol;
    each later turn feeds only what the template adds after the previous answer (its end of turn,
    the new user message and the assistant header), so the cache never holds more than the budget
    between turns."""

    def __init__(self, params: Params, tokenizer, *, system: str | None = None, **options):
        sampling = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
        self.sampling = {k: options.pop(k) for k in sampling if k in options}
        if options.get("budget") is None:
            raise ValueError(
                "budget=None: a conversation keeps its cache within a budget; give one (tokens)"
            )
        self.params, self.tokenizer, self.system, self.eviction = params, tokenizer, system, options
        self.stop_ids = tuple(params.config.eos_token_ids)
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the next one starts a new context)."""
        self.messages: list[dict] = (
            [] if self.system is None else [{"role": "system", "content": self.system}]
        )
        self.context: Context | None = None
        # whether the last answer ended with a stop id (then the cache holds it)
        self.stopped = True
        self.prefills = 0

    def _template(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=False
        )

    def turn_tokens(self, message: str) -> list[int]:
        """Token ids to feed for ``message``: the whole prompt on the first turn, else what the chat
        template adds after the last answer (which the cache already holds)."""
        messages = self.messages + [{"role": "user", "content": message}]
        text = self._template(messages, True)
        if self.context is None:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        before = self._template(self.messages, False)
        end = self.tokenizer.decode(list(self.stop_ids[:1]))
        cut = before.rfind(end)
        if not text.startswith(before) or cut < 0:
            raise ValueError(
                "this model's chat template cannot be continued turn by turn (a new turn rewrites "
                "earlier ones); use kvjax.generate with the whole conversation"
            )
        added = ("" if self.stopped else end) + before[cut + len(end) :] + text[len(before) :]
        return self.tokenizer(added, add_special_tokens=False)["input_ids"]

    def say(self, message: str, on_text: Callable[[str], None] | None = None) -> str:
        """The answer to ``message`` (greedy unless sampling was set); ``on_text`` receives it as it
        grows."""
        ids = self.turn_tokens(message)
        answer: list[int] = []
        printed = ""

        def on_tokens(rows):
            nonlocal printed
            answer.extend(int(t) for t in rows[0])
            text = self.tokenizer.decode(answer, skip_special_tokens=True)
            on_text(text[len(printed) :])
            printed = text

        stream = None if on_text is None else on_tokens
        if self.context is None:
            self.context = prefill(self.params, ids, **self.eviction)
            self.prefills += 1
            ids = None
        out, self.context = extend(
            self.params,
            self.context,
            ids,
            on_tokens=stream,
            stop_ids=self.stop_ids,
            **self.sampling,
        )
        out = [int(t) for t in out]
        self.stopped = bool(out) and out[-1] in self.stop_ids
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        self.messages += [
            {"role": "user", "content": message},
            {"role": "assistant", "content": text},
        ]
        return text

    def stats(self) -> Stats | None:
        return None if self.context is None else context_stats(self.params, self.context)
