"""``python -m rag_lookahead`` runs the same typer app as the ``rag_lookahead`` console script."""

from __future__ import annotations

import os
import subprocess
import sys


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rag_lookahead", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_help_lists_the_commands():
    done = run_module("--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: rag_lookahead" in done.stdout
    for command in ("ask", "index", "bench", "serve"):
        assert f"│ {command} " in done.stdout


def test_errors_are_one_line_with_exit_code_1(tmp_path):
    done = run_module("index", str(tmp_path / "missing"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"error: corpus folder not found: {tmp_path / 'missing'}"]
