#!/usr/bin/env bash
# The test suite once more in another environment, in a virtual environment
# of its own (.venv stays as the README's command builds it: `.[test,ucx]`,
# the newest pandas, dask and distributed at RAPIDS' pin):
#   ci/test_env.sh rapids   a GPU user's: pandas 3.0 (cudf 26.10 requires
#                           >=3.0,<3.1), dask/distributed 2026.7.1 (RAPIDS'
#                           pin, through the ucx extra), UCX
#   ci/test_env.sh cpu      a CPU user's `pip install -e '.[test]'`: the newest
#                           dask and distributed pyproject.toml allows (no ucx
#                           extra, so no RAPIDS pin; the UCX tests skip), on
#                           the oldest pandas it allows (2.2)
# Each axis is at both ends in some run (pandas 3.1 in .venv, 3.0 here, 2.2
# here; dask 2026.7.1 in .venv and here, the newest here) without a run per
# pair: CI stays under an hour on 2 cores.  Further arguments go to pytest;
# --install-only (after the mode) installs the environment and stops (.ci/run
# installs both while dask's tests run; installing again takes seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
# The rapids environment differs from .venv in pandas alone (3.0 against
# 3.1; the same extras and pins, so the same dask, distributed and UCX: the
# check below holds it to the same dask and distributed), so it leaves out
# the modules that test the engine on live clusters (faults, memory, the CLI
# and benchmarks, same-host reads, containers, the GPU kit): they would run
# the same code on the same distributed as in .venv.  The modules that meet
# pandas (backends, shuffles, joins, operations, dask's semantics, bad
# input, compression, UCX) run.  The cpu environment changes dask and
# distributed too, and runs them all.
cluster_modules=(cli comm_faults containers dashboard faults gpu_run join_faults memory samehost soak)
ignore=()
case "${1:-}" in
    rapids)
        install=('.[test,ucx]' 'pandas>=3.0,<3.1')
        for module in "${cluster_modules[@]}"; do ignore+=("--ignore=tests/test_$module.py"); done
        ;;
    cpu) install=('.[test]' 'pandas>=2.2,<2.3') ;;
    *) echo "usage: $0 rapids|cpu [--install-only | pytest arguments]" >&2; exit 2 ;;
esac
venv=".venv-env-$1"
mode=$1
shift
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q -e "${install[@]}"
if [ "${1:-}" = "--install-only" ]; then
    exit 0
fi
main_versions=
if [ -x .venv/bin/python ]; then
    main_versions=$(.venv/bin/python -c \
        'import dask, distributed; print(dask.__version__, distributed.__version__)')
fi
"$venv/bin/python" - "$mode" "$main_versions" <<'PY'
import sys
import dask, distributed, pandas

print("pandas", pandas.__version__, "dask", dask.__version__, "distributed", distributed.__version__)
if sys.argv[1] == "rapids":
    # The modules left out here run in .venv, which must have the same dask
    # and distributed for that to stand in (README's command builds .venv).
    mine = f"{dask.__version__} {distributed.__version__}"
    if not sys.argv[2]:
        print("no .venv to compare with: the cluster modules left out here are not run", file=sys.stderr)
    elif sys.argv[2] != mine:
        sys.exit(f"the rapids environment has dask and distributed {mine}, .venv {sys.argv[2]}: "
                 "the cluster modules it leaves out would go untested on them")
if sys.argv[1] == "cpu":
    # This run stands for the newest dask: one resolved to RAPIDS' pin (some
    # extra pulling rapids-dask-dependency in) would test nothing new.
    from packaging.version import Version

    rapids_pin = Version("2026.7.1")
    if Version(dask.__version__) <= rapids_pin or Version(distributed.__version__) <= rapids_pin:
        sys.exit("the cpu environment resolved to RAPIDS' dask pin, not the newest dask")
PY
# The scale tests (gigabytes through small workers), the rig of hosts
# (tests/test_hosts.py) and the notebooks (also executed by the docs build)
# run once, in the main suite.
bash ci/pytest_crash_report.sh "$venv/bin/python" -m pytest -p no:cacheprovider \
    -m "not scale and not hosts and not notebook and not recovery" "${ignore[@]}" "$@"
