"""Haystack texts for needle retrieval and perplexity: generated filler and real English text.

``filler``: RULER's noise haystack, the same five sentences repeated. ``pydoc``: the prose of the Python
Language Reference's help topics (``pydoc_data.topics``, shipped inside every CPython installation), with
the code examples and grammar blocks removed: real English text that needs no download.
"""

from __future__ import annotations

import functools
import re

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("filler", "pydoc")
MAX_SENTENCE = 600  # characters; longer run-ons (tables flattened into one line) are left out


@functools.cache
def pydoc_prose() -> str:
    """The help topics' prose paragraphs in a fixed order (sorted topic names), joined by blank lines."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "\t", ">>>")) for line in lines):
                continue  # code examples, interactive sessions, grammar rules and indented tables
            if re.fullmatch(r"[*=\-]+", lines[-1].strip()) or len(block) < 80:
                continue  # headings and fragments
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


@functools.cache
def sentences(haystack: str) -> tuple[str, ...]:
    """The haystack as sentences in reading order (each ends with its punctuation)."""
    if haystack == "filler":
        return tuple(s.strip() for s in re.findall(r"[^.]+\.", FILLER)) * 2000
    if haystack == "pydoc":
        return tuple(s for paragraph in pydoc_prose().split("\n\n")
                     for s in re.split(r"(?<=[.!?:])\s+", paragraph) if 0 < len(s) <= MAX_SENTENCE)
    raise ValueError(f"haystack={haystack!r} must be one of {HAYSTACKS}")
