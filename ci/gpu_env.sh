#!/usr/bin/env bash
# .venv-gpu: the GPU extra (cudf, pylibcudf, rmm, dask-cudf, dask-cuda;
# about 5 GB, installable without a GPU) with the test and ucx extras, for
# ci/typecheck_gpu.sh and ci/test_rapids.sh.  Installing again into a ready
# .venv-gpu takes seconds (.ci/run installs it while dask's tests run).
# Exits non-zero if it cannot be installed (no network, no disk); the callers
# decide whether that fails CI (their --optional).
set -uo pipefail
cd "$(dirname "$0")/.."
{ [ -x .venv-gpu/bin/python ] || python3.11 -m venv .venv-gpu; } &&
    .venv-gpu/bin/pip install -q -e '.[gpu,test,ucx]'
