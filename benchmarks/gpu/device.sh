#!/usr/bin/env bash
# On the device machine: kvjax over the image's own JAX, flax and transformers (no dependencies installed, no
# network), then the GPU script with the arguments given. Its files go to $OUT (the device tool's folder).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvjax-gpu}
mkdir -p "$OUT"
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile . 2>"$OUT/pip.txt"; then
  # no build backend there: the package laid out by hand (kvjax.kernels is the top-level kernels/ folder)
  mkdir -p /tmp/kvjax-src && cp -r kvjax /tmp/kvjax-src/ && cp -r kernels /tmp/kvjax-src/kvjax/kernels
  export PYTHONPATH=/tmp/kvjax-src
  echo "pip install failed (see pip.txt); using PYTHONPATH=$PYTHONPATH"
fi
rm -f "$OUT/pip.txt"
if [ -d .whl ]; then  # the server part's packages the image lacks (benchmarks/gpu/wheels.sh, carried)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
export PYTHONUNBUFFERED=1
python3 benchmarks/gpu/run.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
