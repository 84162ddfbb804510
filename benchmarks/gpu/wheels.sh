#!/usr/bin/env bash
# Here, before a device call that runs the "server" part: the wheels of what `kvjax serve` needs and the device's
# image lacks (fastapi, starlette, uvicorn, pydantic and theirs), for its Python 3.12, into .whl/ at the
# repository's root (ignored by git). Name .whl in the call's carry; device.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
PLATFORMS=()
for n in 2014 1; do PLATFORMS+=(--platform "manylinux${n}_x86_64"); done
for n in 17 27 28 34; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
ls .whl
