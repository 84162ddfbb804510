"""The command line: ``python -m kvjax`` (generate, ask, chat, serve, eval, kvzip-heads)."""
