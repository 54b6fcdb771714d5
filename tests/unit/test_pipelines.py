"""The example pipelines: a named ``--index-dir`` that holds no index is an error, not the sample.

The measured bug: a mistyped ``--index-dir`` was filled with the bundled sample corpus, which then
answered the question (``ask`` refused the same thing). Each script stops before any model loads,
with one line and exit 1, and creates nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rag_lookahead.errors import ConfigError, InputError

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


BAD_BATCH_ARGS = [  # (arguments after the script, the one error line's start); {d}: the test's folder
    (["{d}/missing.jsonl", "{d}/out.jsonl"], "error: cannot read the questions file"),
    (["{d}/utf16.jsonl", "{d}/out.jsonl"], "error: cannot read the questions file"),
    (["{d}/q.jsonl", "{d}/out.jsonl", "--batch-size", "0"], "error: --batch-size must be an integer >= 1"),
    (["{d}/q.jsonl", "{d}/out.jsonl", "--batch-size", "-1"], "error: --batch-size must be an integer >= 1"),
    (["{d}/q.jsonl", "{d}/out.jsonl", "--k", "-1"], "error: --k must be an integer >= 1"),
    (["{d}/q.jsonl", "{d}/out.jsonl", "--k", "5", "--k-seed", "2"], "error: --k-seed must be an integer >= --k"),
    (["{d}/q.jsonl", "{d}/no/such/out.jsonl"], "error: answers '{d}/no/such/out.jsonl': its folder"),
    (["{d}/q.jsonl", "{d}/notes.txt"], "error: answers '{d}/notes.txt' exists and this command did not write it"),
    (["{d}/q.jsonl", "{d}/q.jsonl"], "error: answers '{d}/q.jsonl' is this run's input"),
    (["{d}/q.jsonl", "{d}"], "error: answers '{d}' is a folder"),
    (["{d}/q.jsonl", "/proc/answers.jsonl"], "error: answers '/proc/answers.jsonl': cannot write in its folder"),
    (["{d}/blank.jsonl", "{d}/out.jsonl"], "error: {d}/blank.jsonl holds no questions"),
    (["{d}/number.jsonl", "{d}/out.jsonl"], "error: {d}/number.jsonl:1: the question must be a string, got int"),
    (["{d}/spaces.jsonl", "{d}/out.jsonl"], "error: {d}/spaces.jsonl:2: the question is empty"),
    (["{d}/dots.jsonl", "{d}/out.jsonl"], "error: {d}/dots.jsonl:2: the question has no letters or digits"),
    (["{d}/lone.jsonl", "{d}/out.jsonl"], "error: {d}/lone.jsonl:2: the question is not valid Unicode"),
    # a traceback (RecursionError) for a line nested past Python's limit, in the input or a user's output
    (["{d}/deep.jsonl", "{d}/out.jsonl"], "error: {d}/deep.jsonl:2: expected a JSON object with a 'question'"),
    (["{d}/q.jsonl", "{d}/deep.jsonl"], "error: answers '{d}/deep.jsonl' exists and this command did not write it"),
    # a name a few bytes short of the limit passed the check and failed the save after the whole run
    # (and one 3 bytes shorter: the name beside it, answers.NN.jsonl, when the file changed meanwhile)
    (["{d}/q.jsonl", "{d}/" + "a" * 241 + ".jsonl"], "error: answers '{d}/" + "a" * 241 + ".jsonl': cannot write"),
    (["{d}/q.jsonl", "{d}/out.jsonl", "--index-dir=~/no-such-index-here"], "error: no index at " + str(Path.home())),
    # a blank path (an unset variable) read as ".", the working folder
    (["", "{d}/out.jsonl"], "error: questions '' is empty (an unset variable?): give a path"),
    (["{d}/q.jsonl", " "], "error: answers ' ' is empty (an unset variable?): give a path"),
    (["{d}/q.jsonl", "{d}/out.jsonl", "--index-dir", ""], "error: --index-dir '' is empty (an unset variable?)"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD_BATCH_ARGS)
def test_batch_answers_refuses_bad_arguments_in_one_line_and_changes_nothing(tmp_path, argv, expected):
    """The measured bugs: tracebacks for a missing or non-UTF-8 questions file and --batch-size 0 (after
    the model loaded), an empty answers file for --batch-size -1, unchecked --k, a missing output folder
    created, and the user's file (or the questions file itself) overwritten by the answers."""
    (tmp_path / "q.jsonl").write_text('{"question": "What does budget do?"}\n', encoding="utf-8")
    (tmp_path / "utf16.jsonl").write_bytes('{"question": "q"}\n'.encode("utf-16"))
    (tmp_path / "notes.txt").write_text("my notes", encoding="utf-8")
    (tmp_path / "blank.jsonl").write_text("\n  \n", encoding="utf-8")  # wrote an empty answers file its rerun refused
    (tmp_path / "number.jsonl").write_text('{"question": 5}\n', encoding="utf-8")
    (tmp_path / "spaces.jsonl").write_text('{"question": "ok?"}\n{"question": " \\t "}\n', encoding="utf-8")
    (tmp_path / "dots.jsonl").write_text('{"question": "ok?"}\n{"question": "…"}\n', encoding="utf-8")  # failed mid-run
    (tmp_path / "lone.jsonl").write_text('{"question": "ok?"}\n{"question": "caf\\udce9?"}\n', encoding="utf-8")
    (tmp_path / "deep.jsonl").write_text('{"question": "ok?"}\n' + "[" * 200_000 + "\n", encoding="utf-8")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out = subprocess.run(
        [sys.executable, str(PIPELINES / "batch_answers.py"), *(a.format(d=tmp_path) for a in argv)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "RAG_LOOKAHEAD_HOME": str(tmp_path / "home")},  # no index is built anywhere
    )
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "Traceback" not in out.stderr
    assert out.stderr.startswith(expected.format(d=tmp_path)), out.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize(
    ("lines", "ours"),
    [
        (['{"question": "Q?", "answer": "A", "sources": [], "stats": {}}'], True),  # what batch_answers writes
        (['{"question": "Q?", "answer": "the gold answer", "sources": ["doc1.md"]}'], False),  # a user's Q&A set
        (['{"question": "Q?", "answer": "A", "sources": [], "stats": {}, "gold": "B"}'], False),  # ours and more
        (["", "  "], False),  # an empty file: nothing says it is ours
    ],
)
def test_only_our_own_answers_file_may_be_replaced(tmp_path, monkeypatch, lines, ours):
    monkeypatch.syspath_prepend(str(PIPELINES))
    import batch_answers
    from batch_answers import is_answers_file

    path = tmp_path / "answers.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert is_answers_file(path) is ours
    # read line by line: a cap on the whole file refused our own answers to ~10k questions (64 MB)
    monkeypatch.setattr(batch_answers, "MOST_BYTES_READ", 4 * max(len(line) for line in lines) + 4)
    path.write_text("\n".join(lines * 50) + "\n", encoding="utf-8")
    assert is_answers_file(path) is ours


def test_a_pipeline_interrupted_or_cut_off_by_its_reader_ends_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C printed a 30-line KeyboardInterrupt traceback, `chat_stream.py | head` a BrokenPipeError."""
    monkeypatch.syspath_prepend(str(PIPELINES))
    import rag_args

    monkeypatch.setattr(rag_args, "silence_stdout", lambda: None)

    def raising(error):
        def main():
            raise error

        return main

    for error, code, said in (
        (KeyboardInterrupt(), 130, "interrupted"),
        (BrokenPipeError(), 1, ""),
        (OSError(28, "No space left on device"), 1, "error: [Errno 28] No space left on device"),
    ):
        with pytest.raises(SystemExit) as exit_:
            rag_args.run(raising(error))
        assert exit_.value.code == code and capsys.readouterr().err.strip() == said


def test_an_input_file_with_a_byte_order_mark_reads_as_its_text(tmp_path):
    from rag_lookahead.rag.corpus import read_input_text

    (tmp_path / "q.jsonl").write_bytes(b"\xef\xbb\xbf" + '{"question": "问题"}\n'.encode())
    assert read_input_text(tmp_path / "q.jsonl") == '{"question": "问题"}\n'


@pytest.mark.parametrize(
    ("script", "argv", "expected"),
    [
        ("retrieval_qa.py", ["  "], "error: the question is empty"),
        ("lcel_chain.py", [""], "error: the question is empty"),
        ("chat_stream.py", ["first?", " "], "error: the question is empty"),
        ("retrieval_qa.py", ["q", "--k", "0"], "error: --k must be an integer >= 1"),
        ("chat_stream.py", ["q", "--k", "4", "--k-seed", "2"], "error: --k-seed must be an integer >= --k (4)"),
        ("lcel_chain.py", ["q", "--max-tokens", "0"], "error: --max-tokens/--max-new-tokens must be an integer >= 1"),
        ("retrieval_qa.py", ["？！"], "error: the question has no letters or digits to search for"),
        ("retrieval_qa.py", ["q", "--index-dir", " "], "error: --index-dir ' ' is empty (an unset variable?)"),
        # said after the sample index was built, where ask says it before
        ("lcel_chain.py", ["q", "--model", "quality"], "error: the embedded quality model is not installed"),
        (
            "retrieval_qa.py",
            ["q", "--model", "./no-such-model"],
            "error: model folder './no-such-model' does not exist",
        ),
        ("chat_stream.py", ["q", "--model", "DEFAULT"], "error: no model named 'DEFAULT': did you mean 'default'?"),
    ],
)
def test_the_question_and_flags_are_checked_before_the_model_loads(tmp_path, script, argv, expected):
    if "quality" in argv and _quality_installed():
        pytest.skip("the quality model is installed here")
    """These were refused after the model had loaded (~30 s), naming k_prompt for --k."""
    out = subprocess.run(
        [sys.executable, str(PIPELINES / script), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "RAG_LOOKAHEAD_HOME": str(tmp_path / "home")},
    )
    assert out.returncode == 1 and out.stderr.startswith(expected) and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "home").exists() and out.stdout == ""  # no index, no ">>> " before the error


RECALIBRATE_Y = "error: RAG_LOOKAHEAD_RECALIBRATE must be 1, true, yes or on (measure the cost curve again)"


@pytest.mark.parametrize(
    ("script", "argv", "expected"),
    [
        ("retrieval_qa.py", ["q"], RECALIBRATE_Y),
        ("lcel_chain.py", ["q"], RECALIBRATE_Y),
        ("chat_stream.py", ["q"], RECALIBRATE_Y),
        ("batch_answers.py", ["{d}/q.jsonl", "{d}/out.jsonl"], RECALIBRATE_Y),
        # lookahead off: the variable is never read, so the next check speaks (still before the index)
        (
            "lcel_chain.py",
            ["q", "--no-lookahead", "--model", "./no-such-model"],
            "error: model folder './no-such-model'",
        ),
    ],
)
def test_a_bad_recalibrate_value_is_refused_before_the_index_and_model(tmp_path, script, argv, expected):
    """It was refused at the first lookahead decode: after the sample index was built and the model loaded."""
    (tmp_path / "q.jsonl").write_text('{"question": "What does budget do?"}\n', encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(PIPELINES / script), *(arg.format(d=tmp_path) for arg in argv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "RAG_LOOKAHEAD_HOME": str(tmp_path / "home"), "RAG_LOOKAHEAD_RECALIBRATE": "y"},
    )
    assert out.returncode == 1 and out.stderr.startswith(expected) and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "home").exists() and not (tmp_path / "out.jsonl").exists()


def _quality_installed() -> bool:
    from rag_lookahead.errors import ModelLoadError
    from rag_lookahead.models import check_embedded_installed

    try:
        check_embedded_installed("quality")
    except ModelLoadError:
        return False
    return True


def test_k_alone_raises_the_default_k_seed_and_an_explicit_lower_one_is_refused(tmp_path):
    """``--k 10`` alone was refused by the pipelines (the default --k-seed 8 is below it), while
    ``ask --k 5 --k-seed 2`` was taken and quietly retrieved 5."""
    sys.path.insert(0, str(PIPELINES))
    try:
        from rag_args import rag_parser
    finally:
        sys.path.remove(str(PIPELINES))
    parser = rag_parser("test")
    assert parser.parse_args([]).k == 3  # the default the docstrings and README give
    assert parser.parse_args(["--k", "10"]).k_seed == 10
    assert parser.parse_args(["--k", "2"]).k_seed == 8
    assert parser.parse_args(["--k", "2", "--k-seed", "3"]).k_seed == 3
    out = subprocess.run(
        [sys.executable, "-m", "rag_lookahead.ask", "q", "--k", "5", "--k-seed", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "RAG_LOOKAHEAD_HOME": str(tmp_path / "home")},
    )
    assert out.returncode == 1 and out.stderr.startswith("error: --k-seed must be an integer >= --k (5)"), out.stderr
    assert not (tmp_path / "home").exists()


def test_questions_hold_any_character_json_allows_in_a_line(tmp_path, monkeypatch):
    """str.splitlines() cut a line at a raw U+2028 or U+0085 inside a JSON string (json.dumps with
    ensure_ascii=False writes them raw), and the line was refused as bad JSON."""
    import json

    monkeypatch.syspath_prepend(str(PIPELINES))
    from batch_answers import is_answers_file, read_questions

    asked = ["first\u2028line?", "next\x85one?", "third?"]
    path = tmp_path / "q.jsonl"
    path.write_bytes("\r\n".join(json.dumps({"question": q}, ensure_ascii=False) for q in asked).encode())
    assert read_questions(path) == [(1, asked[0]), (2, asked[1]), (3, asked[2])]
    path.write_text('{"question": "  padded?\\t "}\n', encoding="utf-8")
    assert read_questions(path) == [(1, "padded?")]  # as the answers file's "question", which --resume compares
    ours = tmp_path / "a.jsonl"
    record = {"question": asked[0], "answer": "a\u2028b", "sources": [], "stats": {}}
    ours.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    assert is_answers_file(ours)  # a rerun may replace what this pipeline wrote


@pytest.mark.parametrize("script", ["retrieval_qa.py", "lcel_chain.py", "chat_stream.py"])
def test_a_pipeline_started_with_stdout_closed_does_no_work(tmp_path, script):
    """print() to a closed stdout (sys.stdout is None) did nothing: the whole answer was decoded
    for nobody and the run exited 0."""
    out = subprocess.run(
        [sys.executable, str(PIPELINES / script), "--index-dir", str(tmp_path / "none"), "What does budget do?"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        pass_fds=(),
        preexec_fn=lambda: os.close(1),
    )
    assert out.returncode == 1 and out.stderr.strip() == "error: stdout is closed: there is nowhere to write the answer"


def test_the_index_command_suggested_for_a_missing_index_can_be_pasted(tmp_path):
    """The folder went into the suggested command unquoted: pasted, a path with a space was two arguments."""
    import shlex

    from rag_lookahead.ask import ensure_index
    from rag_lookahead.errors import IndexLoadError

    folder = tmp_path / "my docs" / "索引"
    with pytest.raises(IndexLoadError) as err:
        ensure_index(folder, build_bundled=False)
    command = str(err.value).split("`")[1]
    assert shlex.split(command)[-2:] == ["--index-dir", str(folder)]


def test_ask_says_what_a_damaged_index_of_ours_is_missing(tmp_path):
    """``ask --index-dir`` on an index of ours whose manifest is gone (its data still there) said
    "no index at ...: build one", where ``load_index`` and ``serve`` say what is missing."""
    from rag_lookahead.ask import ensure_index
    from rag_lookahead.errors import IndexLoadError
    from rag_lookahead.rag.store import DATA_MARK

    folder = tmp_path / "index"
    (folder / "data-abcd1234").mkdir(parents=True)
    (folder / "data-abcd1234" / DATA_MARK).write_text("", encoding="utf-8")
    with pytest.raises(IndexLoadError, match="is incomplete: manifest.json is missing"):
        ensure_index(folder, build_bundled=False)
    assert sorted(p.name for p in folder.rglob("*")) == sorted(["data-abcd1234", DATA_MARK])  # nothing written


@pytest.mark.parametrize("script", ["retrieval_qa.py", "lcel_chain.py", "chat_stream.py"])
@pytest.mark.parametrize("flag", ["--max-tokens", "--max-new-tokens"])
def test_each_answering_pipeline_takes_both_spellings_of_the_length_flag(tmp_path, script, flag):
    """Two scripts took only --max-tokens and two only --max-new-tokens (exit 2 for the other)."""
    out = subprocess.run(
        [sys.executable, str(PIPELINES / script), flag, "0", "What does budget do?"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 1 and "must be an integer >= 1" in out.stderr, out.stderr


def test_batch_answers_runs_with_stdout_closed(tmp_path):
    """It writes its answers to a file: refusing a closed stdout (right for the scripts that print
    answers) stopped `nohup batch_answers.py ... >&- &` runs."""
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "What does budget do?"}\n', encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(PIPELINES / "batch_answers.py"), str(questions), str(tmp_path / "a.jsonl")]
        + ["--index-dir", str(tmp_path / "none")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.close(1),
    )
    assert out.returncode == 1 and out.stderr.startswith("error: no index at"), out.stderr  # got past the start


@pytest.mark.parametrize("script", ["retrieval_qa.py", "lcel_chain.py", "chat_stream.py", "batch_answers.py"])
def test_ctrl_c_while_a_pipeline_starts_exits_130_without_a_traceback(tmp_path, script):
    """The pipelines import torch and LangChain before run() handles a Ctrl-C: one in the first
    seconds printed a 20-line traceback through those imports and died of SIGINT.

    The Ctrl-C is sent once rag_args has taken SIGINT over (no program can before its first line
    runs: Python's own start-up and site imports take ~0.1 s here, and on a loaded machine they
    passed the fixed 0.4 s this test slept, a traceback from inside ``site`` or ``signal``): the
    child runs with ``-X importtime``, which notes each import as it ends on stderr, and the first
    import ended after ``rag_lookahead.interrupts`` is one begun after rag_args' handler was in place."""
    import signal
    import threading
    import time

    args = ["What does budget do?"]
    if script == "batch_answers.py":
        (tmp_path / "q.jsonl").write_text('{"question": "What does budget do?"}\n', encoding="utf-8")
        args = [str(tmp_path / "q.jsonl"), str(tmp_path / "answers.jsonl")]
    env = {**os.environ, "RAG_LOOKAHEAD_HOME": str(tmp_path / "home")}
    for delay in (0.0, 0.4, 1.0):  # at once in the imports (torch, LangChain still to come), and later on
        started = subprocess.Popen(
            [sys.executable, "-X", "importtime", str(PIPELINES / script), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            said, deadline = b"", time.monotonic() + 120
            while not re.search(rb"\| +rag_lookahead\.interrupts\n(.*\n)", said):
                chunk = started.stderr.read1(65536)
                if not chunk or time.monotonic() > deadline:
                    started.kill()
                    pytest.fail(f"rag_args never took SIGINT over: {(said + started.stderr.read()).decode()[-2000:]}")
                said += chunk
            rest: list[bytes] = []  # read on meanwhile: the import notes would fill the pipe and stall it
            reader = threading.Thread(target=lambda rest=rest, run=started: rest.append(run.stderr.read()), daemon=True)
            reader.start()
            time.sleep(delay)
            started.send_signal(signal.SIGINT)
            started.wait(timeout=120)
            reader.join(timeout=60)
            assert not reader.is_alive(), "the child's stderr never closed"
        finally:
            started.kill()  # no-op once it has ended; never left running by a failed wait
        lines = (said + b"".join(rest)).decode(errors="replace").splitlines()
        text = "\n".join(line for line in lines if not line.startswith("import time:"))
        # past the imports on a quick machine the first run's progress notes come first: no traceback
        assert started.returncode == 130 and "Traceback" not in text and "KeyboardInterrupt" not in text, (delay, text)


def _tiny_rag(folder: Path, embedder, texts: tuple[str, ...] = ("t5 t6 t7 t8 t9 t10.",)) -> tuple[Path, Path]:
    """``(index folder, model folder)`` in ``folder``: a real index of ``texts`` (one file each) and a
    tiny random-weight qwen2 model with its word-level tokenizer saved to a folder."""
    from tiny_models import build_tiny_model
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.rag.index import build_index

    (folder / "docs").mkdir()
    for n, text in enumerate(texts):
        (folder / "docs" / f"{chr(ord('a') + n)}.txt").write_text(text, encoding="utf-8")
    build_index(folder / "docs", folder / "index", embedder, progress=False)
    build_tiny_model("qwen2").save_pretrained(folder / "tiny")
    tiny_tokenizer().save_pretrained(folder / "tiny")
    return folder / "index", folder / "tiny"


@pytest.fixture
def long_batch_run(tmp_path, shared_embedder) -> tuple[list[str], Path, list[str]]:
    """``(argv, answers file, questions)`` of a batch_answers run of 200 questions, one a batch, on
    a tiny random-weight model saved to a folder: long enough to be stopped part way."""
    import json

    index, model = _tiny_rag(tmp_path, shared_embedder)
    asked = [f"t5 t6 {n}?" for n in range(200)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in asked), encoding="utf-8")
    answers = tmp_path / "a.jsonl"
    argv = [str(PIPELINES / "batch_answers.py"), str(tmp_path / "q.jsonl"), str(answers)]
    argv += ["--index-dir", str(index), "--model", str(model), "--k", "1"]
    return argv + ["--batch-size", "1", "--max-new-tokens", "96"], answers, asked


def _answering(argv: list[str]) -> tuple[subprocess.Popen, Callable[[], str]]:
    """batch_answers started and past its first answer ("answered 1/" on stderr), with a function
    that waits for it to end and returns all it wrote on stderr."""
    import threading
    import time

    run = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    said, deadline = b"", time.monotonic() + 600  # the model and embedder load on a loaded machine
    while b"answered 1/" not in said:
        chunk = run.stderr.read1(65536)
        if not chunk or time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"no first answer: {(said + run.stderr.read()).decode(errors='replace')}")
        said += chunk
    rest: list[bytes] = []
    reader = threading.Thread(target=lambda: rest.append(run.stderr.read()), daemon=True)
    reader.start()

    def ended() -> str:
        run.wait(timeout=300)
        reader.join(timeout=60)
        return (said + b"".join(rest)).decode(errors="replace").replace("\r", "\n")

    return run, ended


def _kept(err: str, answers: Path, asked: list[str]) -> None:
    """The run said it stopped and wrote the answers it made, of the first questions in order."""
    import json

    kept = [json.loads(line)["question"] for line in answers.read_text(encoding="utf-8").splitlines()]
    assert 1 <= len(kept) < len(asked) and kept == asked[: len(kept)], err
    stopped = f"stopped: wrote the {len(kept)} answers made of {len(asked)} to {answers}; rerun with --resume"
    assert stopped in err and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize(
    ("stop", "status", "said"), [("SIGTERM", 143, "terminated (SIGTERM)"), ("SIGHUP", 129, "hung up (SIGHUP)")]
)
def test_sigterm_or_sighup_keeps_the_answers_made_as_ctrl_c_does(long_batch_run, stop, status, said):
    """SIGTERM (``timeout``, ``kill``, systemd, ``docker stop``) or SIGHUP killed a batch run at
    once: every answer it had made was lost, unsaid. They stop it as Ctrl-C does: the answers made
    are written for ``--resume``, one line says what stopped it, exit 128 + the signal's number."""
    import signal

    argv, answers, asked = long_batch_run
    run, ended = _answering(argv)
    run.send_signal(getattr(signal, stop))
    err = ended()
    assert run.returncode == status, err
    _kept(err, answers, asked)
    assert err.strip().splitlines()[-1] == said, err


def test_ctrl_c_again_while_the_answers_are_saved_waits_until_they_are(long_batch_run):
    """A second Ctrl-C that landed in the save of the answers made (at its fsync) lost them all
    ("interrupted", no file), and one during the exit printed "Exception ignored ... KeyboardInterrupt"
    tracebacks. Here Ctrl-C comes every millisecond until the process has ended: the answers are
    written, and it ends as after one Ctrl-C. (One kind of signal: ones pending together are taken
    in the order of their numbers, not of their sending.)"""
    import signal
    import time

    argv, answers, asked = long_batch_run
    run, ended = _answering(argv)
    deadline = time.monotonic() + 300
    while run.poll() is None and time.monotonic() < deadline:
        run.send_signal(signal.SIGINT)
        time.sleep(0.001)
    err = ended()
    assert run.returncode == 130, err
    _kept(err, answers, asked)
    assert err.strip().splitlines()[-1] == "interrupted" and "KeyboardInterrupt" not in err, err


def test_an_answers_file_another_run_wrote_meanwhile_is_kept(tmp_path, monkeypatch, capsys):
    """Two runs writing the same answers file: the later one replaced the other's answers unsaid,
    though the README says a file taken during the run stays and the output goes beside it."""
    monkeypatch.syspath_prepend(str(PIPELINES))
    from batch_answers import is_answers_file

    from rag_lookahead.output_files import check_output_file, output_target

    record = '{"question": "Q?", "answer": "A", "sources": [], "stats": {}}\n'
    path = tmp_path / "answers.jsonl"
    seen = check_output_file(path, "answers", ours=is_answers_file)
    assert output_target(path, is_answers_file, seen) == path  # nothing came meanwhile
    path.write_text(record, encoding="utf-8")  # the other run's answers, written during this run
    assert output_target(path, is_answers_file, seen) == tmp_path / "answers.1.jsonl"
    assert "appeared or changed during the run" in capsys.readouterr().err
    seen = check_output_file(path, "answers", ours=is_answers_file)  # a rerun over our own earlier file
    assert output_target(path, is_answers_file, seen) == path


def test_answers_the_disk_cannot_take_are_one_line_naming_the_file_and_go_to_stdout(
    tmp_path, monkeypatch, capsys, shared_embedder
):
    """On a full disk batch_answers said "error: [Errno 28] No space left on device": no file named,
    and every answer of the run lost. The script runs in this process, as its ``__main__`` line
    runs it, on a tiny random-weight model saved to a folder; the kernel refuses the write as on a
    full disk."""
    import json

    from file_limits import files_limited_to

    _, model = _tiny_rag(tmp_path, shared_embedder)
    (tmp_path / "q.jsonl").write_text('{"question": "t5 t6?"}\n', encoding="utf-8")
    answers = tmp_path / "a.jsonl"
    monkeypatch.syspath_prepend(str(PIPELINES))
    import rag_args

    import batch_answers

    argv = [str(tmp_path / "q.jsonl"), str(answers), "--index-dir", str(tmp_path / "index"), "--model", str(model)]
    monkeypatch.setattr(sys, "argv", ["batch_answers.py", *argv, "--k", "1", "--max-new-tokens", "2"])
    with files_limited_to(0), pytest.raises(SystemExit) as done:
        rag_args.run(batch_answers.main, prints_answers=False)  # the script's own ``__main__`` line
    out, err = capsys.readouterr()
    assert done.value.code == 1
    assert f"cannot write {answers}: File too large: printing the answers on stdout instead\n" in err, err
    assert (
        err.strip().splitlines()[-1]
        == f"error: cannot write {answers}: File too large; the answers went to stdout instead"
    )
    assert [json.loads(line)["question"] for line in out.splitlines()] == ["t5 t6?"]
    assert not answers.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["docs", "index", "q.jsonl", "tiny"]


def test_a_tilde_in_the_questions_and_answers_paths_is_the_home_folder(tmp_path, monkeypatch):
    """``~`` was expanded for --index-dir and --model but not for the questions and answers files
    (``questions.jsonl=~/q.jsonl`` style, or a path quoted in a script): "does not exist" / "its
    folder '~' does not exist". Both are read and checked in the shared places every command uses."""
    monkeypatch.syspath_prepend(str(PIPELINES))
    from batch_answers import is_answers_file, read_questions

    from rag_lookahead.output_files import check_output_file, output_target

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "q.jsonl").write_text('{"question": "What does budget do?"}\n', encoding="utf-8")
    assert read_questions("~/q.jsonl") == [(1, "What does budget do?")]
    seen = check_output_file("~/a.jsonl", "answers", ours=is_answers_file, inputs=["~/q.jsonl"])
    assert output_target("~/a.jsonl", is_answers_file, seen) == tmp_path / "a.jsonl"
    with pytest.raises(ConfigError, match="is this run's input"):
        check_output_file("~/q.jsonl", "answers", ours=is_answers_file, inputs=[str(tmp_path / "q.jsonl")])


def test_resuming_a_complete_answers_file_finds_every_question_answered(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(PIPELINES))
    from batch_answers import answered_before

    records = [{"question": q, "answer": "A", "sources": [], "stats": {}} for q in ("a?", "b?")]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert answered_before(str(path), ["a?", "b?"]) == records  # main then says "all 2 questions are answered"
    with pytest.raises(InputError, match="holds 2 answers, more than the 1 questions"):
        answered_before(str(path), ["a?"])


@pytest.mark.parametrize(
    ("resume", "partial", "written"),
    [
        (False, False, "a.jsonl"),  # a whole rerun replaces our earlier answers file
        (False, True, "a.1.jsonl"),  # a stopped rerun goes beside it, never over it
        (True, True, "a.jsonl"),  # a stopped --resume run adds to the file it resumed
        (True, False, "a.jsonl"),
    ],
)
def test_the_answers_replace_an_earlier_file_unless_a_stopped_rerun_would_lose_it(
    tmp_path, monkeypatch, resume, partial, written
):
    import argparse

    monkeypatch.syspath_prepend(str(PIPELINES))
    from batch_answers import is_answers_file, save_answers

    from rag_lookahead.output_files import check_output_file

    earlier = '{"question": "Q?", "answer": "old", "sources": [], "stats": {}}\n'
    answers = tmp_path / "a.jsonl"
    answers.write_text(earlier, encoding="utf-8")
    seen = check_output_file(answers, "answers", ours=is_answers_file)
    rows = [{"question": "Q?", "answer": "new", "sources": [], "stats": {}}]
    args = argparse.Namespace(answers=str(answers), resume=resume)
    assert save_answers(args, rows, seen, partial=partial) == tmp_path / written
    assert json.loads((tmp_path / written).read_text(encoding="utf-8"))["answer"] == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"a.jsonl", written})


def test_an_answer_record_marks_the_first_k_sources_as_in_the_prompt(monkeypatch):
    import argparse

    from langchain_core.documents import Document
    from langchain_core.outputs import Generation, LLMResult

    monkeypatch.syspath_prepend(str(PIPELINES))
    from batch_answers import answer_records

    docs = [
        Document(f"t{n}  text\n{n}", metadata={"source": f"{n}.md", "chunk_id": n, "score": 1 - n / 10})
        for n in range(4)
    ]
    result = LLMResult(generations=[[Generation(text="  the answer \n", generation_info={"tokens": 3})]])
    [record] = answer_records(argparse.Namespace(k=2), ["Q?"], [docs], result)
    assert record == {
        "question": "Q?",
        "answer": "the answer",
        "sources": [
            {"source": f"{n}.md", "chunk_id": n, "score": 1 - n / 10, "in_prompt": n < 2, "snippet": f"t{n} text {n}"}
            for n in range(4)
        ],
        "stats": {"tokens": 3},
    }


PASSAGES = ("t5 t6 t7.", "t5 t8 t9.", "t6 t10 t11.", "t7 t12 t13.", "t14 t15 t16.")  # one chunk each


@pytest.fixture(scope="module")
def tiny_rag(tmp_path_factory, e5_embedder) -> tuple[Path, Path]:
    """``(index folder, model folder)``: a real index of the five PASSAGES and a tiny random-weight
    model, for the pipelines run in this process (tests add ``shared_embedder`` to open the index)."""
    return _tiny_rag(tmp_path_factory.mktemp("tiny_rag"), e5_embedder, PASSAGES)


def _run_pipeline(monkeypatch, script: str, argv: list[str]) -> int:
    """Run ``script``'s ``main`` in this process as its ``__main__`` line does, with ``argv``; the exit status."""
    import importlib

    monkeypatch.syspath_prepend(str(PIPELINES))
    rag_args = importlib.import_module("rag_args")
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", [script, *argv])
    try:
        rag_args.run(module.main, prints_answers=script != "batch_answers.py")
    except SystemExit as done:
        return done.code
    return 0


def _spy(monkeypatch, owner, name: str, calls: list, effect: Callable | None = None, results: list | None = None):
    """Wrap ``owner.name``: each call's arguments are appended to ``calls`` (``effect`` is called with
    them first), then the real one runs (its result appended to ``results``)."""
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        if effect is not None:
            effect(args, kwargs)
        result = real(*args, **kwargs)
        if results is not None:
            results.append(result)
        return result

    monkeypatch.setattr(owner, name, spy)


@pytest.mark.parametrize("flags", [[], ["--no-lookahead"]])
def test_batch_answers_prompts_k_passages_seeds_the_rest_and_batches_four(
    tmp_path, monkeypatch, shared_embedder, tiny_rag, flags
):
    monkeypatch.syspath_prepend(str(PIPELINES))
    import batch_answers

    from rag_lookahead.langchain.llm import LookaheadLLM
    from rag_lookahead.rag.chains import make_prompt

    index, model = tiny_rag
    asked = ["t5 t6?", "t7 t8?", "t9 t10?", "t11 t12?", "t13 t14?"]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in asked), encoding="utf-8")
    found: list = []  # what the real retrieve found, for the expected prompts
    _spy(monkeypatch, batch_answers, "retrieve", [], results=found)
    generated: list = []
    _spy(monkeypatch, LookaheadLLM, "generate", generated)
    argv = [str(tmp_path / "q.jsonl"), str(tmp_path / "a.jsonl"), "--index-dir", str(index), "--model", str(model)]
    assert (
        _run_pipeline(
            monkeypatch, "batch_answers.py", [*argv, "--k", "2", "--k-seed", "4", "--max-tokens", "2", *flags]
        )
        == 0
    )
    assert [len(d) for d in found] == [4] * 5
    assert [len(prompts) for (_, prompts), _ in generated] == [4, 1]  # the default --batch-size 4
    assert [p for (_, prompts), _ in generated for p in prompts] == [
        make_prompt(q, d[:2]) for q, d in zip(asked, found)
    ]
    assert [r for _, kwargs in generated for r in kwargs["references"]] == [
        [x.page_content for x in d[2:]] for d in found
    ]
    assert all(kwargs["enable_lookahead"] is (not flags) for _, kwargs in generated)
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["question"] for r in records] == asked


def test_ctrl_c_in_the_first_batch_writes_no_answers_file(tmp_path, monkeypatch, capsys, shared_embedder, tiny_rag):
    """No answer was made: an empty answers file would be one its own --resume rerun refuses."""
    monkeypatch.syspath_prepend(str(PIPELINES))
    from rag_lookahead.langchain.llm import LookaheadLLM

    index, model = tiny_rag
    (tmp_path / "q.jsonl").write_text('{"question": "t5 t6?"}\n{"question": "t7?"}\n', encoding="utf-8")

    def ctrl_c(args, kwargs):
        raise KeyboardInterrupt

    _spy(monkeypatch, LookaheadLLM, "generate", [], ctrl_c)
    argv = [str(tmp_path / "q.jsonl"), str(tmp_path / "a.jsonl"), "--index-dir", str(index), "--model", str(model)]
    assert _run_pipeline(monkeypatch, "batch_answers.py", [*argv, "--batch-size", "1"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl"]


@pytest.mark.parametrize("flags", [[], ["--no-lookahead"]])
def test_chat_stream_prompts_k_passages_labels_the_seeds_and_binds_no_lookahead(
    monkeypatch, capsys, shared_embedder, tiny_rag, flags
):
    monkeypatch.syspath_prepend(str(PIPELINES))
    import chat_stream

    from rag_lookahead.langchain.chat_model import ChatLookahead

    index, model = tiny_rag
    built: list = []
    _spy(monkeypatch, chat_stream, "build_chat_rag_chain", built)
    argv = ["t5 t6?", "--index-dir", str(index), "--model", str(model), "--k", "2", "--k-seed", "3"]
    assert _run_pipeline(monkeypatch, "chat_stream.py", [*argv, "--max-tokens", "2", *flags]) == 0
    [((chat, _), kwargs)] = built
    assert (kwargs["k_prompt"], kwargs["k_seed"]) == (2, 3)
    if flags:
        assert chat.kwargs == {"enable_lookahead": False} and isinstance(chat.bound, ChatLookahead)
    else:
        assert isinstance(chat, ChatLookahead)
    out = capsys.readouterr().out
    assert [line.split("]")[0] for line in out.splitlines() if line.startswith("  [")] == [
        "  [prompt",
        "  [prompt",
        "  [seed only",
    ], out


@pytest.mark.parametrize("flags", [[], ["--no-lookahead"]])
def test_lcel_chain_retrieves_k_and_passes_the_lookahead_flag_to_the_model(
    monkeypatch, capsys, shared_embedder, tiny_rag, flags
):
    monkeypatch.syspath_prepend(str(PIPELINES))
    import lcel_chain

    from rag_lookahead.langchain.chat_model import ChatLookahead

    index, model = tiny_rag
    retrievers: list = []
    _spy(monkeypatch, lcel_chain, "as_retriever", retrievers)
    streamed: list = []
    _spy(monkeypatch, ChatLookahead, "_stream", streamed)
    argv = ["  t5 t6? \n", "--index-dir", str(index), "--model", str(model), "--k", "2", "--max-tokens", "2"]
    assert _run_pipeline(monkeypatch, "lcel_chain.py", [*argv, *flags]) == 0
    [((_, k), _)] = retrievers
    assert k == 2
    [((_, messages), kwargs)] = streamed
    assert kwargs["enable_lookahead"] is (not flags)
    assert messages[-1].content.endswith("Question / 问题: t5 t6?")  # the question stripped
    assert messages[-1].content.count("[") == 2, messages[-1].content  # two passages, each headed by its label


def test_retrieval_qa_prompts_k_seeds_k_seed_and_prints_the_answer_stripped(
    monkeypatch, capsys, shared_embedder, tiny_rag
):
    monkeypatch.syspath_prepend(str(PIPELINES))
    import retrieval_qa

    from rag_lookahead.langchain.llm import LookaheadLLM

    index, model = tiny_rag
    built: list = []
    _spy(monkeypatch, retrieval_qa, "build_retrieval_qa", built)
    answers: list = []
    real_generate = LookaheadLLM._generate

    def padded(self, *args, **kwargs):  # the real answer, with the blank a model may put around it
        result = real_generate(self, *args, **kwargs)
        for gens in result.generations:
            gens[0].text = f"\n  {gens[0].text} \n"
            answers.append(gens[0].text)
        return result

    monkeypatch.setattr(LookaheadLLM, "_generate", padded)
    prompts: list = []
    _spy(monkeypatch, LookaheadLLM, "_generate", prompts)
    argv = ["  t5 t6? \n", "--index-dir", str(index), "--model", str(model), "--k", "2", "--k-seed", "3"]
    assert _run_pipeline(monkeypatch, "retrieval_qa.py", [*argv, "--max-new-tokens", "2"]) == 0
    [(_, kwargs)] = built
    assert (kwargs["k_prompt"], kwargs["k_seed"]) == (2, 3)
    [((_, [prompt]), _)] = prompts
    assert prompt.endswith("Question / 问题: t5 t6?") and prompt.count("[") == 2, prompt  # k passages
    out = capsys.readouterr().out
    [answer] = answers
    assert out.startswith(answer.strip() + "\n\n- "), (answer, out)
