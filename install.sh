#!/usr/bin/env bash
# Set up rag_lookahead in ./.venv (or in the active virtual environment) with everything the
# CLI, the server and the tests need. A torch that is already importable is kept (bring your
# own CUDA build); otherwise the CPU build torch==2.13.0 is installed.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
runs() { [ -x "$1" ] && "$1" -c '' 2>/dev/null; }
if [ -n "${VIRTUAL_ENV:-}" ] && ! runs "$VIRTUAL_ENV/bin/python"; then
    echo "note: the active environment $VIRTUAL_ENV has no working python (removed?); using ./.venv" >&2
    VIRTUAL_ENV=
fi
if [ -L .venv ] && [ ! -e .venv ]; then # a link to an environment since removed (one we linked)
    echo "note: ./.venv linked to $(readlink .venv), which is gone; replacing the link" >&2
    rm .venv
fi
if [ -z "${VIRTUAL_ENV:-}" ]; then
    runs .venv/bin/python || "$PYTHON" -m venv .venv || true # also repairs one whose bin/ lost its links
    if [ ! -e .venv ]; then
        echo "error: could not make ./.venv with $PYTHON (set PYTHON=python3.11 or newer)" >&2
        exit 1
    elif ! runs .venv/bin/python; then
        echo "error: ./.venv does not run (was the python it was made with removed or upgraded?);" \
            "remove it (rm -rf .venv) and run ./install.sh again" >&2
        exit 1
    fi
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
if ! "$PY" -m pip --version >/dev/null 2>&1; then # uv venv, venv --without-pip
    "$PY" -m ensurepip --upgrade >/dev/null ||
        { echo "error: $PY has no pip and ensurepip could not add it: install pip there first" >&2; exit 1; }
fi
"$PY" -m pip install --quiet --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "installing torch 2.13.0 (CPU build on machines that have it locally)"
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test]"
echo "rag_lookahead installed in $("$PY" -c 'import sys; print(sys.prefix)')"
