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
# pair: CI stays under an hour on 2 cores.  Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    rapids) install=('.[test,ucx]' 'pandas>=3.0,<3.1') ;;
    cpu) install=('.[test]' 'pandas>=2.2,<2.3') ;;
    *) echo "usage: $0 rapids|cpu [pytest arguments]" >&2; exit 2 ;;
esac
venv=".venv-env-$1"
mode=$1
shift
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q -e "${install[@]}"
"$venv/bin/python" - "$mode" <<'PY'
import sys
import dask, distributed, pandas

print("pandas", pandas.__version__, "dask", dask.__version__, "distributed", distributed.__version__)
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
    -m "not scale and not hosts and not notebook and not recovery" "$@"
