#!/usr/bin/env bash
# Here, before a device call: the wheels of what the image lacks, for its Python 3.12, into .whl/ at the
# repository's root (ignored by git). Name .whl in the call's carry; device.sh installs them (--no-deps).
# - the "server" part (`kvjax serve`): fastapi, starlette, uvicorn, pydantic and theirs;
# - the "kvpress" part: kvpress 0.5.5 (pure Python) and cachetools, which kvpress's __init__ runs at import
#   (DuoAttentionPress's and LUKVPress's module-level caches). kvpress's other requirements: torch,
#   transformers, numpy, huggingface_hub, tqdm, safetensors are the image's (transformers needs them);
#   accelerate, peft, pandas are imported by no kvpress module; datasets, fire and requests only by
#   presses peer_kvpress.py does not run (DuoAttention, ExpectedAttentionStats, LUKV): stubbed there if absent.
set -euo pipefail
cd "$(dirname "$0")/../.."
PLATFORMS=()
for n in 2014 1; do PLATFORMS+=(--platform "manylinux${n}_x86_64"); done
for n in 17 27 28 34; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 \
  kvpress==0.5.5 cachetools==5.5.2
ls .whl
