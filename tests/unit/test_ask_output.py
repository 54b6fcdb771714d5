"""What ``ask`` prints when its output goes to a pipe or a file: the answer as the model wrote it."""

from __future__ import annotations

import pytest

from rag_lookahead.ask import print_result

LONG = "The budget option sizes each draft tree from the measured cost curve, " * 6 + "[bold]not markup[/bold]"


def _result(answer: str) -> dict:
    return {
        "answer": answer,
        "sources": [{"source": "en/tuning.md", "snippet": "budget: " + "x" * 150, "in_prompt": True}],
        "stats": {"new_tokens": 120, "tokens_per_second": 9.5, "mean_accepted": 3.2, "forward_passes": 40},
    }


def test_a_long_answer_is_printed_unbroken_and_unstyled(capsys):
    print_result(_result(LONG), streamed=False)
    out = capsys.readouterr().out
    assert out.startswith(LONG + "\n")  # not broken at 80 columns, markup-like text kept as text
    assert "forward passes" in out and "forward \npasses" not in out
    assert ("budget: " + "x" * 150) in out


def test_a_streamed_answer_is_not_printed_twice(capsys):
    print_result(_result(LONG), streamed=True)
    out = capsys.readouterr().out
    assert LONG not in out and out.startswith("\n")


@pytest.mark.parametrize(("lookahead", "said"), [(False, "off"), (True, "on")])
def test_the_stats_line_says_each_count_and_whether_lookahead_ran(capsys, lookahead, said):
    result = _result("x")
    result["stats"] |= {"lookahead": lookahead}
    print_result(result, streamed=False)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        f"Stats 120 tokens, 9.50 tok/s, mean accepted 3.20 tokens/forward, 40 forward passes, lookahead {said}"
    ), last


def test_sampling_settings_are_checked_before_anything_loads(tmp_path, monkeypatch):
    """--top-p 0 passed the option parser and failed after the model had loaded (~25 s); --seed or
    --top-p without --temperature were silently ignored by greedy decoding."""
    from typer.testing import CliRunner

    from rag_lookahead import ask
    from rag_lookahead.cli import app

    def no_loading(*args, **kwargs):
        raise AssertionError("an index or a model was loaded before the settings were checked")

    monkeypatch.setattr(ask, "ensure_index", no_loading)
    base = ["ask", "what?", "--index-dir", str(tmp_path / "none")]
    cases = {
        ("--temperature", "1e-7"): "temperature must be at least 1e-05 to sample",
        ("--temperature", "0.7", "--seed", str(2**63)): "seed must be an integer from 0 to 2**63-1",
        ("--seed", "3"): "--seed applies only when sampling; greedy decoding (--temperature 0, the default) "
        "would ignore it:",
        ("--top-p", "0.9", "--seed", "3"): "--top-p and --seed apply only when sampling; greedy decoding "
        "(--temperature 0, the default) would ignore them:",
        ("--json", "--stream"): "--stream and --json do not go together",  # --stream was ignored
    }
    for extra, message in cases.items():
        result = CliRunner().invoke(app, base + list(extra))
        assert result.exit_code == 1, (extra, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (extra, result.stderr)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--device", "cuda"], "error: device 'cuda' asked for, but torch {torch} sees no CUDA GPU"),
        (["--dtype", "bogus"], "error: unknown dtype 'bogus'; use one of bf16, bfloat16, fp32, float32, fp16,"),
        (["--model", "{tmp}/nonexistent_model"], "error: model folder '{tmp}/nonexistent_model' does not exist"),
        (["--model", "{tmp}/no_model"], "error: '{tmp}/no_model' is not a model folder: it has no config.json"),
        (["--model", "bad id with spaces"], "error: model 'bad id with spaces' is neither an embedded model"),
        (["--model", "DEFAULT"], "error: no model named 'DEFAULT': did you mean 'default'?"),
        # neither cached nor fetchable (HF_HUB_OFFLINE, set below)
        (["--model", "no-such-org/no-such-model"], "error: model 'no-such-org/no-such-model' is neither a local"),
    ],
)
def test_a_bad_model_option_is_refused_before_the_sample_index_is_built(tmp_path, monkeypatch, options, said):
    """On a machine with no index yet, `ask --device cuda` (no GPU), `--dtype bogus` or `--model
    /no/such/folder` indexed the bundled corpus first (25-76 s, the index left written) and only then
    refused the option. Now nothing is built: the refusal comes before ``ensure_index``."""
    import torch
    from typer.testing import CliRunner

    from rag_lookahead.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine too has no GPU here
    monkeypatch.setenv("RAG_LOOKAHEAD_HOME", str(tmp_path / "home"))  # no default index yet
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "no_model").mkdir()
    argv = [option.format(tmp=tmp_path) for option in options]
    result = CliRunner().invoke(app, ["ask", "what is decoding_length", *argv])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(said.format(tmp=tmp_path, torch=torch.__version__)), line
    assert not (tmp_path / "home").exists()  # no sample index was started


@pytest.mark.parametrize(
    ("env", "said"),
    [
        # read at the first decode: after the sample index (25-76 s) and the model (~40 s here)
        ({"RAG_LOOKAHEAD_RECALIBRATE": "y"}, "error: RAG_LOOKAHEAD_RECALIBRATE must be 1, true, yes or on"),
        # huggingface_hub's import as the model loaded, after the index: a ValueError traceback
        ({"HF_ENDPOINT": "http://[bad"}, "error: $HF_ENDPOINT 'http://[bad' is not a URL: invalid IPv6 URL"),
    ],
)
def test_a_bad_variable_is_refused_before_the_sample_index_is_built(tmp_path, monkeypatch, env, said):
    from typer.testing import CliRunner

    from rag_lookahead.cli import app

    monkeypatch.setenv("RAG_LOOKAHEAD_HOME", str(tmp_path / "home"))  # no default index yet
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["ask", "what is decoding_length"])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(said), line
    assert not (tmp_path / "home").exists()  # no sample index was started


def test_a_default_folder_holding_user_files_gets_asks_own_advice(tmp_path, monkeypatch):
    """`index`'s advice ("choose a new or empty folder with --index-dir") sent the user to a flag
    that, for `ask`, needs an index already built; the user's file stays as it was."""
    from typer.testing import CliRunner

    from rag_lookahead.cli import app

    monkeypatch.setenv("RAG_LOOKAHEAD_HOME", str(tmp_path))
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "notes.txt").write_text("mine", encoding="utf-8")
    result = CliRunner().invoke(app, ["ask", "what?"])
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert (
        "refusing" in line and "rag_lookahead index YOUR_DOCS --index-dir DIR" in line and "RAG_LOOKAHEAD_HOME" in line
    )
    assert "choose a new or empty folder" not in line
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == ["notes.txt"]


def test_a_source_or_snippet_ending_in_a_backslash_is_printed_as_written(capsys):
    """rich's escape() doubles a trailing backslash (for markup that would follow): `C:\\Tools\\`
    was shown as `C:\\Tools\\\\` in the Sources list."""
    result = _result("x")
    result["sources"] = [{"source": "win\\", "snippet": "installed in C:\\Tools\\", "in_prompt": False}]
    print_result(result, streamed=False)
    out = capsys.readouterr().out
    assert "  [1] win\\ (seed only): installed in C:\\Tools\\\n" in out, out


@pytest.mark.parametrize(
    "question",
    ["".join(chr(0x20000 + i) for i in range(1000)), "\U0001d160" * 500],
    ids=["extension-b", "nfc-grows"],
)
def test_a_question_of_few_characters_but_many_tokens_gets_the_long_question_note(question, capsys):
    """The note was skipped for any question under 2,048 characters, but a byte-level BPE token
    can be a third of a character: 1,000 CJK Extension-B characters are about 3,000 tokens. Bytes
    bound nothing either: the tokenizer's NFC makes U+1D160 (4 bytes) three characters, 3 tokens."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rag_lookahead.ask import LONG_QUESTION_TOKENS, _check_a_long_question
    from rag_lookahead.models import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokens = len(tokenizer.encode(question, add_special_tokens=False))
    assert len(question) < LONG_QUESTION_TOKENS <= tokens  # the cases the old shortcuts got wrong
    _check_a_long_question(SimpleNamespace(tokenizer=tokenizer, model=None), question, note=True)
    assert f"note: a {tokens:,}-token question" in capsys.readouterr().err


class _FullDisk:
    """A stderr on a full disk (``2>/dev/full``): every write fails."""

    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("stderr", [_FullDisk(), None], ids=["full", "closed"])
def test_a_status_line_that_cannot_be_written_costs_neither_the_answer_nor_stdout(stderr, monkeypatch, capsys):
    """ask's status lines (the long-question note, "indexing the bundled corpus") went through
    print(): on a full stderr the OSError ended ask with exit 1 and no answer; with stderr closed
    (``2>&-``, sys.stderr is None) print() wrote them into the answer on stdout."""
    import sys
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rag_lookahead.ask import _check_a_long_question
    from rag_lookahead.models import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    monkeypatch.setattr(sys, "stderr", stderr)
    _check_a_long_question(SimpleNamespace(tokenizer=tokenizer, model=None), "word " * 2100, note=True)
    assert capsys.readouterr().out == ""
