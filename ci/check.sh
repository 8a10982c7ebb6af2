#!/usr/bin/env bash
# Static checks: formatting, lint, types.  Expects .venv from the test command.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff format --check gpushuffle tests benchmarks ci
.venv/bin/ruff check gpushuffle tests benchmarks ci
.venv/bin/mypy
