#!/usr/bin/env bash
# Set up .venv with the package (editable) and its test, bench and docs extras. Idempotent: a second run
# with an unchanged pyproject.toml installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv" >&2
    "$python" -m venv "$venv"
fi
# This machine's pip config lists local indexes that lack most packages; pip warns once per
# package about that. Drop only those lines; pip's exit status still counts (pipefail).
pip_install() {
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2
}

# torch first and pinned: left to the resolver, the bare `torch` dependency would pull a
# multi-GB CUDA build; 2.13.0 resolves to the CPU wheel this machine kind keeps on disk.
if ! "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (first run: a few minutes)" >&2
    pip_install torch==2.13.0
fi

# Re-install the package only when pyproject.toml changed (its hash is the stamp).
stamp="$venv/.hybrid-transfer-setup"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing hybrid-transfer[test,bench,docs] (editable)" >&2
    pip_install -e '.[test,bench,docs]'
    echo "$want" > "$stamp"
fi
