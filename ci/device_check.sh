#!/usr/bin/env bash
# The GPU parts that run without cuDF (the store's device tier with cupy
# buffers, device -> host -> disk and back, throughput against copy
# bandwidth), as one short script for a lent GPU machine.  That machine has
# cupy but no package index: Python dependencies it lacks travel as wheels
# in .whl/ (see the device tool's README) and are installed here first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
timeout 300 python3 -m benchmarks.device_check --mib "${MIB:-512}"
