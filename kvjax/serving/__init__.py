"""Serving: a slot engine with jitted prefill / insert / generate (``engine``), continuous batching
in a driver thread (``driver``) and an OpenAI-compatible HTTP server (``server``, needs the
``serve`` extra)."""

from kvjax.serving.driver import Closed, Driver, QueueFull, Request
from kvjax.serving.engine import Engine, Prefix, Slots

__all__ = ["Closed", "Driver", "Engine", "Prefix", "QueueFull", "Request", "Slots"]
