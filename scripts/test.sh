#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint with ruff, build the docs strictly, run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict  # broken links, anchors or docstrings fail
.venv/bin/python -m pytest -q "$@"
