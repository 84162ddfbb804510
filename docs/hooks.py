"""MkDocs hooks: the tables generated from the code (``kvjax.runtime.options.options_table``,
``kvjax.eviction.scorer_table``, ``kvjax.eviction.allocation_table``) put in place of their markers
when the site is built, so they are never out of date."""

from __future__ import annotations

MARKERS = {
    "<!-- kvjax:options -->": ("kvjax.runtime.options", "options_table"),
    "<!-- kvjax:scorers -->": ("kvjax.eviction", "scorer_table"),
    "<!-- kvjax:allocations -->": ("kvjax.eviction", "allocation_table"),
}


def render_tables(markdown: str) -> str:
    """``markdown`` with every marker replaced by its table."""
    import importlib

    for marker, (module, name) in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, getattr(importlib.import_module(module), name)())
    return markdown


def on_page_markdown(markdown, **_):
    return render_tables(markdown)
