#!/usr/bin/env bash
# The real RAPIDS stack without a GPU: what of the cuDF path needs no device.
# cudf, pylibcudf, rmm, dask-cudf and dask-cuda install and import on a CPU
# machine (RAPIDS_NO_INITIALIZE=1); cudf ships no type information, so a
# misspelt, moved or renamed RAPIDS name would otherwise fail first on a GPU.
#   1. every RAPIDS name the package uses resolves (ci/rapids_names.py);
#   2. the device-free logic against real RAPIDS objects (tests/test_rapids_stack.py);
#   3. every test module collects with the real cudf (pytest -m gpu --collect-only):
#      an import error in a GPU test module shows here, not on the first GPU.
# In CI's GPU-extra environment (.venv-gpu, as ci/gpu_env.sh builds it),
# or with PYTHON set, in that Python's (the GPU machine's kit: ci/gpu_run.sh).
#   --optional: if the GPU extra cannot be installed (no network, no disk),
#   say so and exit 0; a failing check still fails.
set -uo pipefail
cd "$(dirname "$0")/.."
optional=false
[ "${1:-}" = "--optional" ] && optional=true
if [ -z "${PYTHON:-}" ]; then
    if ! bash ci/gpu_env.sh; then
        if $optional; then
            echo "test_rapids: could not install the gpu extra; RAPIDS checks skipped" >&2
            exit 0
        fi
        exit 1
    fi
    PYTHON=.venv-gpu/bin/python
fi
export RAPIDS_NO_INITIALIZE=1 GPUSHUFFLE_REQUIRE_RAPIDS=1
"$PYTHON" ci/rapids_names.py || exit 1
"$PYTHON" -m pytest -p no:cacheprovider -q -m rapids tests/test_rapids_stack.py || exit 1
out=$("$PYTHON" -m pytest -p no:cacheprovider -q -m gpu --collect-only tests 2>&1)
rc=$?
selected=$(grep -oE '^[0-9]+(/[0-9]+)? tests? collected' <<<"$out" | grep -oE '^[0-9]+')
if [ $rc != 0 ] || [ "${selected:-0}" -eq 0 ]; then
    echo "$out" | tail -n 30 >&2
    echo "test_rapids: the GPU tests did not collect under the real stack (exit $rc, ${selected:-0} selected)" >&2
    exit 1
fi
echo "test_rapids: every RAPIDS name resolves, the device-free checks pass, ${selected} GPU tests collect"
