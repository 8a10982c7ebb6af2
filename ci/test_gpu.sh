#!/usr/bin/env bash
# For GPU CI runners: install the GPU and UCX extras and run the GPU tests
# (cuDF backend, LocalCUDACluster over UCX).  They skip, naming the reason,
# where no CUDA allocation succeeds.
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e '.[gpu,ucx,test]'
.venv-gpu/bin/python -m pytest -m gpu -rs "$@"
