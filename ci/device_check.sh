#!/usr/bin/env bash
# The GPU parts that run without cuDF (the store's device tier with cupy
# buffers, device -> host -> disk and back, throughput against copy
# bandwidth), as one short script for a lent GPU machine.  That machine has
# cupy but no package index: the Python dependencies it lacks come either
# from the GPU kit, already installed into /tmp/site by ci/gpu_run.sh (or by
# `bash ci/gpu_kit_assemble.sh install /tmp/site`), or as wheels in .whl/
# (see the device tool's README), installed here first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${GPUKIT_SITE:-/tmp/site}
if [[ ":${PYTHONPATH:-}:" == *":$SITE:"* ]]; then
    : # ci/gpu_run.sh set it up
elif [ -f "$SITE/.gpukit-installed" ]; then
    export PYTHONPATH=$PWD:$SITE
elif [ -d .whl ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
    export PYTHONPATH=$SITE:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
timeout "${DEVICE_CHECK_TIMEOUT:-300}" "$PYTHON" -m benchmarks.device_check --mib "${MIB:-512}"
