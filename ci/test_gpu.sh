#!/usr/bin/env bash
# For GPU CI runners: install the GPU and UCX extras and run the GPU tests
# (cuDF backend, dask-cuda workers over TCP and UCX).  Where no CUDA
# allocation succeeds they fail, saying so (GPUSHUFFLE_REQUIRE_GPU): on a GPU
# runner a run that skipped them would be a false green.
#   PYTHON      the interpreter for .venv-gpu (default python3, 3.11 or newer)
#   GPU_EXTRAS  the extras to install (default: gpu-cu13,ucx-cu13 where nvidia-smi
#               shows a CUDA 13 driver, else gpu,ucx, the CUDA 12 wheels)
# For the whole set of GPU checks with results in one folder, see ci/gpu_run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${GPU_EXTRAS:-}
if [ -z "$extras" ]; then
    smi=$(nvidia-smi 2>/dev/null || true)
    cuda=12
    [[ $smi =~ CUDA\ Version:\ *([0-9]+) ]] && cuda=${BASH_REMATCH[1]}
    if [ "$cuda" -ge 13 ]; then extras=gpu-cu13,ucx-cu13; else extras=gpu,ucx; fi
fi
"${PYTHON:-python3}" -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e ".[$extras,test]"
GPUSHUFFLE_REQUIRE_GPU=1 .venv-gpu/bin/python -m pytest -m gpu -rs "$@"
