#!/usr/bin/env bash
# Type-check the package against the real pylibcudf / cudf / rmm stubs, with
# strict stubs of our own for cupy (ci/stubs: cupy ships no types).  cudf,
# pylibcudf and rmm install without a GPU (about 5 GB), so a wrong function
# name or argument is caught on any machine.  Then ci/typecheck_gpu_canary.py,
# which holds a defect the cuDF path once had, must be rejected: a check that
# accepts it would accept the defect again.
#   --optional: if the GPU extra cannot be installed (no network, no disk),
#   say so and exit 0; a type error still fails.
set -uo pipefail
cd "$(dirname "$0")/.."
optional=false
[ "${1:-}" = "--optional" ] && optional=true
if ! bash ci/gpu_env.sh; then
    if $optional; then
        echo "typecheck_gpu: could not install the gpu extra; cuDF type check skipped" >&2
        exit 0
    fi
    exit 1
fi
export MYPYPATH=ci/stubs
mypy=(.venv-gpu/bin/mypy --python-executable .venv-gpu/bin/python --no-incremental)
"${mypy[@]}" gpushuffle/backends/cudf.py gpushuffle/engine/join.py || exit 1
out=$("${mypy[@]}" ci/typecheck_gpu_canary.py 2>&1)
if ! grep -q 'Argument 1 to "asarray" has incompatible type "Column"' <<<"$out"; then
    echo "typecheck_gpu: the canary's cupy.asarray(pylibcudf Column) was not rejected:" >&2
    echo "$out" >&2
    exit 1
fi
echo "typecheck_gpu: the canary's defect is rejected, as it must be"
