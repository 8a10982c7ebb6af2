#!/usr/bin/env bash
# Build the docs site (docs/, Sphinx with MyST) with warnings as errors.
# Expects .venv from the README's test command; adds the docs extra to it.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pip install -q -e '.[docs]'
rm -rf docs/_build
.venv/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html
echo "docs: docs/_build/html/index.html"
