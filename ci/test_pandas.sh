#!/usr/bin/env bash
# The test suite once more on another pandas, in a virtual environment of
# its own (.venv stays as the README's command builds it, with the newest
# pandas):
#   ci/test_pandas.sh rapids   pandas 3.0: cudf 26.10 requires >=3.0,<3.1, so
#                              every GPU user's environment has it
#   ci/test_pandas.sh oldest   pandas 2.2, the oldest pyproject.toml allows
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    rapids) spec='pandas>=3.0,<3.1' ;;
    oldest) spec='pandas>=2.2,<2.3' ;;
    *) echo "usage: $0 rapids|oldest [pytest arguments]" >&2; exit 2 ;;
esac
venv=".venv-pandas-$1"
shift
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q -e '.[test,ucx]' "$spec"
"$venv/bin/python" -c 'import pandas; print("pandas", pandas.__version__)'
# The scale tests (gigabytes through small workers) and the rig of hosts
# (tests/test_hosts.py) run once, in the main suite.
bash ci/pytest_crash_report.sh "$venv/bin/python" -m pytest -p no:cacheprovider \
    -m "not scale and not hosts" "$@"
