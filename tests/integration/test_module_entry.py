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


def test_ask_json_prints_one_json_line_and_nothing_else(bundled_index_dir):
    """What a script piping ``ask --json`` gets, in a real process with the real default model:
    the JSON on stdout, and on stderr none of transformers' "Loading weights" bar. (It reads the
    session's index of the bundled corpus.)"""
    import json

    index = bundled_index_dir
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "rag_lookahead.ask", "What does the budget option do?", "--json"]
        + ["--index-dir", str(index), "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["answer"]
    assert "Loading weights" not in done.stderr, done.stderr


def test_help_keeps_the_extras_in_brackets():
    """rich reads "[quality]" as markup and dropped it: the help said to pip install "rag-lookahead"."""
    ask, serve = run_module("ask", "--help"), run_module("serve", "--help")
    assert 'rag-lookahead[quality]"' in ask.stdout.replace("\n", "").replace("│", "").replace(" ", "")
    assert "rag-lookahead[ray]" in serve.stdout.replace("\n", "").replace("│", "").replace(" ", "")
    assert "$XDG_DATA_HOME" in ask.stdout
