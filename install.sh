#!/usr/bin/env bash
# Set up rag_lookahead in ./.venv (or in the active virtual environment) with everything the
# CLI, the server and the tests need. A torch that is already importable is kept (bring your
# own CUDA build); otherwise the CPU build torch==2.13.0 is installed.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
    PY=.venv/bin/python
else
    PY="$VIRTUAL_ENV/bin/python"
    # the README's commands run .venv/bin/python: let .venv name the active environment
    if [ ! -e .venv ]; then
        ln -s "$VIRTUAL_ENV" .venv
    elif [ "$(cd .venv && pwd -P)" != "$(cd "$VIRTUAL_ENV" && pwd -P)" ]; then
        echo "note: installing into the active environment $VIRTUAL_ENV; ./.venv is another one" >&2
    fi
fi
"$PY" -m pip install --quiet --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "installing torch 2.13.0 (CPU build on machines that have it locally)"
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test]"
echo "rag_lookahead installed in $("$PY" -c 'import sys; print(sys.prefix)')"
