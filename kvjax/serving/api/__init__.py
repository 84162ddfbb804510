"""The OpenAI-compatible routes of ``kvjax.serving.server``, one router per resource."""
