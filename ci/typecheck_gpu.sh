#!/usr/bin/env bash
# Type-check the cuDF backend against the real pylibcudf / cudf / rmm stubs.
# cudf, pylibcudf and rmm install without a GPU (about 5 GB), so a wrong
# function name or argument is caught on any machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-gpu/bin/python ]; then
    python3.11 -m venv .venv-gpu
fi
.venv-gpu/bin/pip install -q -e '.[gpu]' mypy pandas-stubs
.venv-gpu/bin/mypy --python-executable .venv-gpu/bin/python --no-incremental \
    gpushuffle/backends/cudf.py
