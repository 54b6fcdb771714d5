"""What `rag_lookahead ask` prints when the terminal is not a plain UTF-8 one: argv bytes that are
not UTF-8, an ASCII stdout, a pipe closed mid-stream, and text that rich would read as emoji codes.

The answers come from a real LookaheadLLM over a tiny random-weight model (the failures are in
reading the question and printing, not in decoding), with a real index and the real embedder
(loaded once per session: ``shared_embedder``).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from tiny_models import tiny_model
from tiny_tokenizer import tiny_tokenizer
from typer.testing import CliRunner

from rag_lookahead.cli import app
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.rag.index import build_index

pytestmark = pytest.mark.usefixtures("shared_embedder")

PASSAGE = "branch_length 是草稿树的最大深度，默认值为 48。Redis keys look like user:id:42 and ratios a:b:c."


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, e5_embedder):
    root = tmp_path_factory.mktemp("ask_frontend")
    (root / "docs").mkdir()
    (root / "docs" / "tuning.md").write_text(PASSAGE + "\n", encoding="utf-8")
    build_index(root / "docs", root / "index", e5_embedder, progress=False)
    return root / "index"


@pytest.fixture
def tiny_llm(monkeypatch):
    """`ask` loads the model by name (``models.load_model``): here it gets the tiny qwen2 model.
    (It patched ``LookaheadLLM.from_model_id``, which `ask` no longer calls: the tests loaded the
    default model, and the forward counts below counted a model nobody ran.)"""
    from rag_lookahead import models

    model, tokenizer = tiny_model("qwen2"), tiny_tokenizer()
    monkeypatch.setattr(models, "load_model", lambda name, **options: (model, tokenizer))
    return model


def one_error_line(result) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_question_with_argv_bytes_that_are_not_utf8_is_one_error_line(index_dir, tiny_llm):
    """`ask $'branch \\xff'`: Python passes such argv bytes on as lone surrogates, and the e5
    tokenizer died on them with a TypeError traceback, after the model had loaded."""
    result = CliRunner().invoke(app, ["ask", "branch \udcff\udcfe", "--index-dir", str(index_dir)])
    assert "not valid UTF-8" in one_error_line(result)


@pytest.mark.parametrize("as_json", [True, False])
def test_an_ascii_stdout_gets_the_answer_not_a_traceback(index_dir, tiny_llm, as_json):
    """PYTHONIOENCODING=ascii: the Chinese question and sources raised UnicodeEncodeError after the
    whole decode, and --json printed no JSON at all."""
    question = "branch_length 默认是多少？"
    args = ["ask", question, "--index-dir", str(index_dir), "--max-new-tokens", "4"] + (["--json"] if as_json else [])
    result = CliRunner(charset="ascii").invoke(app, args)
    assert result.exit_code == 0, (result.exception, result.stderr)
    if as_json:
        out = json.loads(result.stdout)  # \u escapes: valid JSON, and nothing lost
        assert out["question"] == question and isinstance(out["answer"], str)
    else:
        assert "tuning.md" in result.stdout


def test_json_holds_the_question_stripped_the_sources_without_their_text_and_cjk_as_written(index_dir, tiny_llm):
    """--json on a UTF-8 stdout: the question as asked less its blanks, each source's snippet but
    not the whole passage, Chinese as it is (not \\u escapes), and the stats of the decode that ran:
    --no-lookahead decodes without drafts."""
    question = "branch_length 默认是多少？"
    args = ["ask", f"  {question}  ", "--index-dir", str(index_dir), "--max-new-tokens", "4", "--json"]
    ran = {}
    for flags in ([], ["--no-lookahead"]):
        result = CliRunner().invoke(app, [*args, *flags])
        assert result.exit_code == 0, (result.exception, result.stderr)
        out = json.loads(result.stdout)
        assert out["question"] == question
        assert out["sources"] and all("text" not in s and s["snippet"] for s in out["sources"]), out["sources"]
        assert question in result.stdout and "默认值为 48" in result.stdout  # the question, a snippet
        ran[tuple(flags)] = out["stats"]["lookahead"]
    assert ran == {(): True, ("--no-lookahead",): False}


def test_a_sampled_answer_with_seed_0_is_the_seeded_sample(index_dir, tiny_llm):
    """--seed 0 is a seed: the answer is the chain's own sample drawn with seed 0, from the command
    and from ``answer()``, with lookahead on or off."""
    from rag_lookahead.ask import answer
    from rag_lookahead.rag.chains import build_rag_chain
    from rag_lookahead.rag.index import load_index

    question = "What do Redis keys look like?"
    llm = LookaheadLLM(model=tiny_llm, tokenizer=tiny_tokenizer(), model_name="tiny")
    chain = build_rag_chain(llm, load_index(index_dir), k_prompt=3, k_seed=8)
    sampled = {"question": question, "max_new_tokens": 16, "temperature": 1.0, "seed": 0}
    expected = chain.invoke(sampled | {"enable_lookahead": False})["answer"]
    assert chain.invoke(sampled | {"enable_lookahead": False, "seed": 1})["answer"] != expected  # the seed matters
    args = ["ask", question, "--index-dir", str(index_dir), "--max-new-tokens", "16", "--json"]
    for flags in ([], ["--no-lookahead"]):
        result = CliRunner().invoke(app, [*args, "--temperature", "1", "--seed", "0", *flags])
        assert result.exit_code == 0, (result.exception, result.stderr)
        assert json.loads(result.stdout)["answer"] == expected, flags
    got = answer(question, index_dir=index_dir, llm=llm, lookahead=False, max_new_tokens=16, temperature=1.0, seed=0)
    assert got["answer"] == expected and got["stats"]["lookahead"] is False


def test_sources_are_printed_as_the_passage_says_not_as_emoji(index_dir, tiny_llm):
    """rich turned ':id:' into U+1F194 and ':b:' into U+1F171 in the printed snippet (and file
    names), so the sources shown did not match the passage the model read."""
    args = ["ask", "What do Redis keys look like?", "--index-dir", str(index_dir), "--max-new-tokens", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "user:id:42" in result.stdout and "a:b:c" in result.stdout, result.stdout


class ClosedPipe:
    """A stdout whose reader went away (`ask ... --stream | head -c 10`)."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("no fileno")


def test_streaming_into_a_closed_pipe_stops_the_decode_quietly(index_dir, tiny_llm, monkeypatch, capsys):
    """LangChain logs and swallows a callback's exception: the printer's BrokenPipeError left the
    model decoding to --max-new-tokens with nobody reading, and logged an error for every block."""
    import logging

    forwards = []
    hook = tiny_llm.register_forward_hook(lambda *args: forwards.append(1))
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    keep = Keep()
    logging.getLogger().addHandler(keep)
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    from rag_lookahead.ask import main

    try:
        with pytest.raises(SystemExit) as exit_info:
            main(
                ["What do Redis keys look like?", "--index-dir", str(index_dir), "--stream", "--max-new-tokens", "120"]
            )
    finally:
        logging.getLogger().removeHandler(keep)
        hook.remove()
    assert exit_info.value.code == 1
    assert len(forwards) <= 3, f"{len(forwards)} forwards: the decode went on after stdout closed"
    assert not [m for m in logged if "BrokenPipe" in m], logged[:3]
    err = capsys.readouterr().err
    assert "Traceback" not in err and not err.strip(), err


class FullDisk(ClosedPipe):
    """A stdout on a full disk (`ask ... > /dev/full`)."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("mode", ["print", "json", "stream"])
def test_a_stdout_that_cannot_be_written_is_one_error_line(index_dir, tiny_llm, monkeypatch, capsys, mode):
    """`> /dev/full` ended in a traceback after the whole decode (streamed: LangChain logged the
    callback's OSError for every block and the decode went on to --max-new-tokens)."""
    forwards = []
    hook = tiny_llm.register_forward_hook(lambda *args: forwards.append(1))
    monkeypatch.setattr(sys, "stdout", FullDisk())
    from rag_lookahead.ask import main

    flags = {"print": [], "json": ["--json"], "stream": ["--stream"]}[mode]
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["What do Redis keys look like?", "--index-dir", str(index_dir), "--max-new-tokens", "120", *flags])
    finally:
        hook.remove()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cannot write the answer to stdout: No space left on device"], err
    if mode == "stream":
        assert len(forwards) <= 3, f"{len(forwards)} forwards: the decode went on after stdout failed"


def test_a_closed_stdout_is_refused_before_anything_loads(index_dir, tiny_llm, monkeypatch, capsys):
    """`ask ... >&-`: Python's stdout is None, and the answer's print raised AttributeError."""
    forwards = []
    hook = tiny_llm.register_forward_hook(lambda *args: forwards.append(1))
    monkeypatch.setattr(sys, "stdout", None)
    from rag_lookahead.ask import main

    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["What do Redis keys look like?", "--index-dir", str(index_dir)])
    finally:
        hook.remove()
    assert exit_info.value.code == 1 and not forwards
    assert capsys.readouterr().err.strip() == "error: stdout is closed: there is nowhere to write the answer"


def test_a_long_question_gets_a_note_before_the_silent_read(index_dir, tiny_llm, monkeypatch):
    """A 51,000-character question sat 5.5 minutes with nothing printed after the weights loaded."""
    from rag_lookahead.ask import LONG_QUESTION_TOKENS

    monkeypatch.setattr(tiny_llm.config, "max_position_embeddings", 8192)  # room for it (the tiny model holds 256)

    def ask(tokens: int, *flags: str):  # a word is a token of the tiny tokenizer
        args = ["ask", "branch_length " * tokens, "--index-dir", str(index_dir), "--max-new-tokens", "2", *flags]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, (result.exception, result.stderr)
        return result

    said = ask(LONG_QUESTION_TOKENS).stderr
    assert said.startswith(f"note: a {LONG_QUESTION_TOKENS:,}-token question; the model reads all of it"), said
    assert "note:" not in ask(LONG_QUESTION_TOKENS - 1).stderr
    long_json = ask(LONG_QUESTION_TOKENS, "--json")
    assert "note:" not in long_json.stderr and "answer" in json.loads(long_json.stdout)  # --json: the JSON alone


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_a_question_the_context_cannot_hold_is_refused_in_one_line(index_dir, tiny_llm, flags):
    """Three lines came, the refusal last: transformers' "sequence length is longer" warning and our
    note that reading the question "can take minutes", for a question that was never read."""
    question = "branch_length " * 3000  # 3,000 tokens; the tiny model holds 256
    result = CliRunner().invoke(app, ["ask", question, "--index-dir", str(index_dir), *flags])
    line = one_error_line(result)
    assert "the input has 3000 tokens but the model's context holds" in line, line


@pytest.mark.parametrize(
    "kind", ["file", "folder of other files", "broken link", "missing", "empty folder", "our leftover lock"]
)
def test_no_index_advice_works_where_it_is_followed(tmp_path, tiny_llm, kind):
    """``ask --index-dir notes/`` advised `rag_lookahead index YOUR_DOCS --index-dir notes/`, which
    `index` then refused (a file, or a folder holding the user's files)."""
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("mine", encoding="utf-8")
    elif kind == "folder of other files":
        target.mkdir()
        (target / "notes.txt").write_text("mine", encoding="utf-8")
    elif kind == "empty folder":
        target.mkdir()
    elif kind == "broken link":
        target.symlink_to(tmp_path / "gone")
    elif kind == "our leftover lock":  # an interrupted first build's: index builds there
        target.mkdir()
        (target / ".rag_lookahead.lock").write_text("", encoding="utf-8")
    line = one_error_line(CliRunner().invoke(app, ["ask", "What is budget?", "--index-dir", str(target)]))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("budget sets how many draft tokens a step verifies.", encoding="utf-8")
    if kind in ("file", "folder of other files", "broken link"):
        assert f"--index-dir {target}" not in line, line  # the advice names another folder
        built = CliRunner().invoke(app, ["index", str(docs), "--index-dir", str(target), "--no-progress"])
        assert built.exit_code == 1, built.output  # as the old advice was refused
    else:
        assert f"--index-dir {target}`" in line, line
        built = CliRunner().invoke(app, ["index", str(docs), "--index-dir", str(target), "--no-progress"])
        assert built.exit_code == 0, built.output


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_index_dir_is_refused_not_read_as_the_working_folder(index_dir, tiny_llm, monkeypatch, blank):
    """`ask --index-dir "$IDX"` with $IDX unset: typer read "" as Path("."), and the answer came
    from whatever index the working folder held."""
    monkeypatch.chdir(index_dir)
    line = one_error_line(CliRunner().invoke(app, ["ask", "What is branch_length?", "--index-dir", blank]))
    assert line == f"error: --index-dir {blank!r} is empty (an unset variable?): give a path"


#: five files of one ~50-token passage each (word-level tiny tokenizer): the prompt holds 3 of them
#: in the tiny model's 256 tokens, not 5
TOPICS = ("budget", "branch", "window", "trie", "cache")


@pytest.fixture(scope="module")
def five_passage_index(tmp_path_factory, e5_embedder):
    root = tmp_path_factory.mktemp("ask_passages")
    (root / "docs").mkdir()
    for topic in TOPICS:
        text = " ".join(f"{topic} setting {i} changes the {topic} speed." for i in range(8))
        (root / "docs" / f"{topic}.md").write_text(text + "\n", encoding="utf-8")
    report = build_index(root / "docs", root / "index", e5_embedder, progress=False)
    assert report.chunks == len(TOPICS)  # one passage a file: --k 5 shows five
    return root / "index"


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_a_prompt_that_k_passages_make_too_long_names_k_before_decoding(five_passage_index, tiny_llm, flags):
    """`ask --k 5`: the question fits, its five passages do not. The refusal was the model's own,
    "the input has 3xx tokens but the model's context holds 256": nothing said that the passages
    were the cause, or that --k makes room."""
    forwards = []
    hook = tiny_llm.register_forward_hook(lambda *args: forwards.append(1))
    try:
        args = ["ask", "What does the budget setting change?", "--index-dir", str(five_passage_index)]
        line = one_error_line(CliRunner().invoke(app, [*args, "--k", "5", *flags]))
        refused_forwards = len(forwards)
        fits = CliRunner().invoke(app, [*args, "--k", "2", "--max-new-tokens", "2", *flags])
    finally:
        hook.remove()
    assert re.fullmatch(
        r"error: the prompt built from the question and its 5 passage\(s\) has \d+ tokens but the model's context"
        r" holds 256, prompt and answer together: no room is left for an answer; ask with a smaller --k or a"
        r" shorter question",
        line,
    ), line
    assert fits.exit_code == 0, (fits.exception, fits.stderr)  # the same question with fewer passages is answered
    assert refused_forwards == 0 and len(forwards) > 0  # the refused one ran none; the second decoded


def test_a_prompt_that_even_one_passage_makes_too_long_advises_no_smaller_k(five_passage_index, tiny_llm, monkeypatch):
    """`ask --k 5` where the question with its first passage alone overflows the context: the
    refusal advised "a smaller --k", and `--k 1` was refused too. No --k helps, so it says so and
    what does, still counting the prompt it refused (its five passages)."""
    args = ["ask", "What does the budget setting change?", "--index-dir", str(five_passage_index), "--k", "5"]
    counted = re.search(r"its 5 passage\(s\) has (\d+) tokens", one_error_line(CliRunner().invoke(app, args)))
    monkeypatch.setattr(tiny_llm.config, "max_position_embeddings", 80)  # the question fits, with a passage not
    line = one_error_line(CliRunner().invoke(app, args))
    assert line == (
        f"error: the prompt built from the question and its 5 passage(s) has {counted.group(1)} tokens but the"
        " model's context holds 80, prompt and answer together: no room is left for an answer; even with one"
        " passage it is too long, so no smaller --k helps: ask a shorter question, index the documents in smaller"
        " chunks (a smaller chunk size), or use a model with a longer context"
    ), line
    assert "its 1 passage(s)" in one_error_line(CliRunner().invoke(app, [*args[:-1], "1"]))  # as --k 1 is refused


def test_a_prompt_that_one_passage_makes_too_long_advises_chunks_or_context(five_passage_index, tiny_llm, monkeypatch):
    """With one passage --k is at its least: a smaller --k cannot be the advice."""
    monkeypatch.setattr(tiny_llm.config, "max_position_embeddings", 80)  # the question fits, with a passage not
    args = ["ask", "What does the budget setting change?", "--index-dir", str(five_passage_index), "--k", "1"]
    line = one_error_line(CliRunner().invoke(app, args))
    assert "its 1 passage(s) has" in line and "holds 80" in line, line
    assert line.endswith(
        "; ask a shorter question, index the documents in smaller chunks (a smaller chunk size), or use a model"
        " with a longer context"
    ), line
    assert "--k" not in line
