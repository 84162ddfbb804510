"""The optional parts of kvjax and the extra that installs each: a path that needs one says which is
missing."""

from __future__ import annotations

import importlib

# extra -> the modules its paths import
EXTRAS = {"serve": ("fastapi", "uvicorn"), "eval": ("matplotlib",)}


def require(extra: str, what: str) -> None:
    """Raise an ImportError naming ``extra`` when a module it installs cannot be imported (``what``:
    the path that needs it, e.g. "kvjax serve")."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            raise ImportError(
                f"{what} needs the {extra!r} extra ({module} is not installed): "
                f"pip install 'kvjax[{extra}]'"
            ) from None
