"""The example pipelines: a named ``--index-dir`` that holds no index is an error, not the sample.

The measured bug: a mistyped ``--index-dir`` was filled with the bundled sample corpus, which then
answered the question (``ask`` refused the same thing). Each script stops before any model loads,
with one line and exit 1, and creates nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


@pytest.mark.parametrize("script", ["retrieval_qa.py", "lcel_chain.py", "chat_stream.py", "batch_answers.py"])
def test_a_named_index_folder_without_an_index_is_refused(tmp_path, script):
    missing = tmp_path / "my_indx"  # a typo of the user's folder
    question = ["What does budget do?"]
    if script == "batch_answers.py":
        (tmp_path / "q.jsonl").write_text('{"question": "What does budget do?"}\n', encoding="utf-8")
        question = [str(tmp_path / "q.jsonl"), str(tmp_path / "answers.jsonl")]
    out = subprocess.run(
        [sys.executable, str(PIPELINES / script), "--index-dir", str(missing), *question],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"error: no index at {missing}")
    assert not missing.exists() and not (tmp_path / "answers.jsonl").exists()
