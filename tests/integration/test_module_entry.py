"""``python -m rag_lookahead`` runs the same typer app as the ``rag_lookahead`` console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


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


def test_a_path_holding_a_line_break_is_named_whole_in_the_error(tmp_path):
    """An error prints its first line only: a corpus folder named "docs<LF>old" was said as
    "corpus folder not found: .../docs", a folder that exists, and ``ask --index-dir`` cut the same
    way. Now the line break is escaped, and the advice's ``$'...'`` names the folder when pasted."""
    (tmp_path / "docs").mkdir()
    done = run_module("index", str(tmp_path / "docs\nold"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"error: corpus folder not found: {tmp_path}/docs\\nold"]
    missing = tmp_path / "no\x1b[31msuch"
    done = run_module("ask", "hi", "--index-dir", str(missing))
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: no index at {tmp_path}/no\\x1b[31msuch: build one with "), line
    word = line.split("--index-dir ", 1)[1].split("`", 1)[0]
    pasted = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, text=True, timeout=60)
    assert pasted.stdout == str(missing)


def test_the_index_summary_escapes_the_index_folder():
    """``-> {index_dir}`` was printed as it is: a folder named with ESC sequences coloured the
    terminal, and one with a line break printed a line of its own."""
    from rag_lookahead.rag.build import IndexReport

    report = IndexReport(index_dir=Path("o\x1b[32mgreen\nfake line"), embedding_model="e5", added=1, chunks=1)
    assert report.summary().splitlines() == [
        "indexed 1 files (1 added, 0 updated, 0 unchanged, 0 removed), 1 chunks (0 embedded) with e5 in 0.0s"
        " -> o\\x1b[32mgreen\\nfake line"
    ]


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
