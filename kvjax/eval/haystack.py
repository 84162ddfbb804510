"""Haystack texts for needle retrieval and perplexity: generated filler and real English text.

``filler``: RULER's noise haystack, the same five sentences repeated. ``pydoc``: the prose of the
Python Language Reference's help topics (``pydoc_data.topics``, shipped inside every CPython
installation), with the code examples and grammar blocks removed: real English text that needs no
download. ``licenses``: the free-software licenses of Debian's ``/usr/share/common-licenses`` (GPL,
LGPL, GFDL, MPL, Apache, Artistic, CC0): real English legal prose of another register, present on
every Debian or Ubuntu system.
"""

from __future__ import annotations

import functools
import re

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("filler", "pydoc", "licenses")
LICENSES_DIR = "/usr/share/common-licenses"
LICENSES = (
    "GPL-3",
    "GPL-2",
    "LGPL-2.1",
    "GFDL-1.3",
    "MPL-2.0",
    "Apache-2.0",
    "Artistic",
    "CC0-1.0",
)
MAX_SENTENCE = 600  # characters; longer run-ons (tables flattened into one line) are left out


@functools.cache
def pydoc_prose() -> str:
    """The help topics' prose paragraphs in a fixed order (sorted topic names), joined by blank
    lines."""
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
def licenses_prose() -> str:
    """The paragraphs of ``LICENSES`` (in that order) with lines joined, headings and short
    fragments left out."""
    paragraphs = []
    for name in LICENSES:
        path = f"{LICENSES_DIR}/{name}"
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as e:
            raise ValueError(
                f"haystack='licenses' reads {path} (Debian's base-files), which is missing here: "
                f"{e.strerror}; use haystack 'pydoc'"
            ) from e
        for block in re.split(r"\n\s*\n", text):
            paragraph = " ".join(line.strip() for line in block.splitlines())
            if len(paragraph) >= 80 and not re.search(r"https?://|<.*>|_{3,}", paragraph):
                paragraphs.append(paragraph)
    return "\n\n".join(paragraphs)


@functools.cache
def sentences(haystack: str) -> tuple[str, ...]:
    """The haystack as sentences in reading order (each ends with its punctuation)."""
    if haystack == "filler":
        return tuple(s.strip() for s in re.findall(r"[^.]+\.", FILLER)) * 2000
    if haystack in ("pydoc", "licenses"):
        prose = pydoc_prose() if haystack == "pydoc" else licenses_prose()
        return tuple(
            s
            for paragraph in prose.split("\n\n")
            for s in re.split(r"(?<=[.!?:])\s+", paragraph)
            if 0 < len(s) <= MAX_SENTENCE
        )
    raise ValueError(f"haystack={haystack!r} must be one of {HAYSTACKS}")
