#!/usr/bin/env bash
# Type-check the cuDF backend against the real pylibcudf / cudf / rmm stubs.
# cudf, pylibcudf and rmm install without a GPU (about 5 GB), so a wrong
# function name or argument is caught on any machine.
#   --optional: if the GPU extra cannot be installed (no network, no disk),
#   say so and exit 0; a type error still fails.
set -uo pipefail
cd "$(dirname "$0")/.."
optional=false
[ "${1:-}" = "--optional" ] && optional=true
if ! { [ -x .venv-gpu/bin/python ] || python3.11 -m venv .venv-gpu; } ||
   ! .venv-gpu/bin/pip install -q -e '.[gpu]' mypy pandas-stubs; then
    if $optional; then
        echo "typecheck_gpu: could not install the gpu extra; cuDF type check skipped" >&2
        exit 0
    fi
    exit 1
fi
.venv-gpu/bin/mypy --python-executable .venv-gpu/bin/python --no-incremental \
    gpushuffle/backends/cudf.py
