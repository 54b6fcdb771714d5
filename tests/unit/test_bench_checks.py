"""The benchmarks' checks of their options and inputs (before any model loads), their file output,
and the figures they report where a baseline did not run."""

import importlib
import importlib.util
import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rag_lookahead.bench import common
from rag_lookahead.bench.retrieval import Item
from rag_lookahead.errors import ConfigError, InputError, ModelLoadError

# ---------------------------------------------------------------- bad options stop before the model loads

_NO_FLASH_ATTENTION = importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("kernels") is None
NO_METHOD = 2  # typer's usage error (the options' own checks: --methods, --temperatures)
BELOW = "must be an integer >= 1, got"
FOLDER = "error: --json '{dir}' is a folder; give a file path"
KEPT = "remove it or give another path (nothing was changed)"
NO_FILE = "is empty (an unset variable?): name a file or a shipped set, or leave the option out for the bundled prompts"
PROMPT_SETS = "bundled, realistic-zh, realistic-en, seeding"
NO_SET = "no such file, and no prompt set shipped with the package has that name (" + PROMPT_SETS + ")"
NO_INDEX = "is empty (an unset variable?): name an index, or leave the option out"
NO_DATASET = "is empty (an unset variable?): name a dataset or a file, or leave the option out"
BAD_OPTIONS = [  # (benchmark, argv, what it exits with: a one-line error, or a usage error's code)
    ("single", ["--limit", "0"], f"error: --limit {BELOW} 0"),
    ("single", ["--limit", "-2"], f"error: --limit {BELOW} -2"),
    ("single", ["--repeats", "0"], f"error: --repeats {BELOW} 0"),
    ("single", ["--max-new-tokens", "0"], f"error: --max-new-tokens {BELOW} 0"),
    ("single", ["--ids", ","], "error: --ids ',' names no prompt id (give ids separated by commas)"),
    ("single", ["--methods", ""], NO_METHOD),
    ("single", ["--methods", "greedy,greedy"], NO_METHOD),
    ("single", ["--temperatures", "nan"], NO_METHOD),
    ("single", ["--methods", "greedy,sample", "--temperatures", " "], NO_METHOD),  # ran no sampling, exit 0
    ("single", ["--json", "{file}"], "error: --json '{file}' exists and this command did not write it; " + KEPT),
    ("single", ["--branch-length", "0"], "error: branch_length must be an integer from 1 to 256, got 0"),
    ("single", ["--seed", str(2**64)], NO_METHOD),  # torch.manual_seed's overflow, after the model loaded
    ("single", ["--seed", "-1"], NO_METHOD),
    ("single", ["--copying-threshold", "2"], NO_METHOD),  # a share no answer can reach: summed up nothing
    ("single", ["--prompts", "{fifo}"], "error: cannot read the prompts file '{fifo}': not a regular file"),
    ("single", ["--prompts", "/dev/zero"], "error: cannot read the prompts file '/dev/zero': not a regular file"),
    ("single", ["--prompts", ""], f"error: --prompts '' {NO_FILE}"),  # ran the bundled set
    ("batch", ["--prompts", ""], f"error: --prompts '' {NO_FILE}"),
    ("replay", ["--prompts", ""], f"error: --prompts '' {NO_FILE}"),
    # neither a file nor the name of a shipped set: the names, said before the model loads
    *[
        (module, ["--prompts", "realistic-fr"], f"error: cannot read the prompts file 'realistic-fr': {NO_SET}")
        for module in ("single", "batch", "step_profile", "replay", "interference")
    ],
    # a value given twice ran its methods twice (or merged them) where a method named twice is refused
    ("single", ["--methods", "sample", "--temperatures", "0.7,0.70"], NO_METHOD),
    ("single", ["--methods", "lookahead", "--extra-branch-length", "12,12"], NO_METHOD),
    ("single", ["--methods", "lookahead", "--extra-branch-length", "48"], NO_METHOD),  # lookahead's own
    ("batch", ["--extra-branch-length", "24,24"], NO_METHOD),
    ("batch", ["--methods", "lookahead", "--branch-length", "24", "--extra-branch-length", "24"], NO_METHOD),
    ("batch", ["--concurrency", "2,2"], "error: --concurrency names the level 2 twice: '2,2'"),
    ("batch", ["--prompts", "{fifo}"], "error: cannot read the prompts file '{fifo}': not a regular file"),
    ("single", ["--top-p", "5"], "error: top_p must be a number >= 0.0 and <= 1.0, got 5.0"),
    ("single", ["--extra-branch-length", "0"], "error: branch_length must be an integer from 1 to 256, got 0"),
    ("single", ["--json", "{dir}"], FOLDER),
    ("single", ["--json", "{deep}"], "error: --json '{deep}' exists and this command did not write it; " + KEPT),
    ("single", ["--json", "{file}/r.json"], "error: --json '{file}/r.json': its folder '{file}' is not a folder"),
    ("batch", ["--concurrency", "0"], f"error: --concurrency {BELOW} 0"),
    ("batch", ["--concurrency", "4,-1"], f"error: --concurrency {BELOW} -1"),
    ("batch", ["--concurrency", "x"], "error: --concurrency takes integers >= 1 separated by commas, not 'x'"),
    ("batch", ["--requests", "0"], f"error: --requests {BELOW} 0"),
    ("batch", ["--methods", ""], NO_METHOD),
    ("batch", ["--branch-length", "300"], "error: branch_length must be an integer from 1 to 256, got 300"),
    ("batch", ["--json", "{dir}/no/b.json"], "error: --json '{dir}/no/b.json': its folder '{dir}/no' does not exist"),
    ("step_profile", ["--limit", "0"], f"error: --limit {BELOW} 0"),
    ("replay", ["--max-new-tokens", "0"], f"error: --max-new-tokens {BELOW} 0"),
    ("replay", ["--json", "{dir}"], FOLDER),
    # a folder to be: Path() dropped the "/", and the report became a file named "results"
    ("replay", ["--json", "{dir}/results/"], "error: --json '{dir}/results/' is a folder; give a file path"),
    ("interference", ["--long-requests", "0"], f"error: --long-requests {BELOW} 0"),
    ("interference", ["--short-max-new-tokens", "0"], f"error: --short-max-new-tokens {BELOW} 0"),
    ("interference", ["--tiny", "--json", "{dir}"], FOLDER),
    ("interference", ["--tiny", "--prompts", "{file}"], NO_METHOD),  # ignored before
    # each ran the tiny model's fp32 CPU smoke run all the same, unsaid
    ("interference", ["--tiny", "--model", "quality"], NO_METHOD),
    ("interference", ["--tiny", "--dtype", "bf16"], NO_METHOD),
    ("interference", ["--tiny", "--device", "cuda"], NO_METHOD),
    # a tiny random model has no code of its own to trust: the flag would have been ignored
    ("interference", ["--tiny", "--trust-remote-code"], NO_METHOD),
    # ZeroDivisionError in costs.allocate after the greedy answers were decoded
    (
        "replay",
        ["--cost-curve", "1:1e-200,2:1e-200"],
        "error: --cost-curve '1:1e-200,2:1e-200': each point is TOKENS:MS, a whole number of tokens >= 1 and"
        " a time from 0.001 to 100000 milliseconds (bad point: '1:1e-200')",
    ),
    ("gpu_check", ["--device", "cpu", "--tiny-only", "--attn", "bogus"], NO_METHOD),  # every section failed
    ("gpu_check", ["--device", "cpu", "--tiny-only", "--trust-remote-code"], NO_METHOD),  # loads no model
    # a device torch does not see: every section failed with a traceback, then a table "GPU check: ? (?)"
    (
        "gpu_check",
        ["--device", "meta", "--small", "--tiny-only"],
        "error: device 'meta' holds shapes, not weights: nothing can be decoded on it; use cpu or a GPU",
    ),
    *(
        [
            (
                "gpu_check",
                ["--device", "cuda", "--small", "--tiny-only"],
                f"error: device 'cuda' asked for, but torch {torch.__version__} sees no CUDA GPU",
            )
        ]
        if not torch.cuda.is_available()
        else []
    ),
    ("gpu_check", ["--device", "cpu", "--dtype", "fp8"], NO_METHOD),  # failed in the model section, a traceback
    # without flash-attn (or kernels) every section failed
    *([("gpu_check", ["--device", "cpu", "--attn", "flash_attention_2"], NO_METHOD)] if _NO_FLASH_ATTENTION else []),
    ("interference", ["--tiny", "--arrival-steps", "0"], f"error: --arrival-steps {BELOW} 0"),  # ran as 1
    ("rag", ["--json", "{dir}"], FOLDER),
    ("session", ["--json", "{dir}"], FOLDER),
    # checked after the model had loaded (and, for session, after the whole set was embedded)
    ("rag", ["--k-prompt", "0"], f"error: --k-prompt {BELOW} 0"),
    ("rag", ["--k-prompt", "4", "--k-seed", "2"], "error: --k-seed must be an integer >= --k-prompt (4), got 2"),
    (
        "rag",
        ["--index-dir", "{dir}/none"],
        "error: no index at {dir}/none: build one with `rag_lookahead index DIR --index-dir {dir}/none`",
    ),
    (  # loaded the model first, then said there was no index
        "session",
        ["--index-dir", "{dir}/none"],
        "error: no index at {dir}/none: build one with `rag_lookahead index DIR --index-dir {dir}/none`",
    ),
    # a blank path (an unset variable): --index-dir ran on the temporary index of the bundled
    # corpus, --json said "'' is a folder"
    ("rag", ["--index-dir", ""], f"error: --index-dir '' {NO_INDEX}"),
    ("session", ["--index-dir", " "], f"error: --index-dir ' ' {NO_INDEX}"),
    ("session", ["--dataset", ""], f"error: --dataset '' {NO_DATASET}"),
    ("single", ["--json", ""], "error: --json '' is empty (an unset variable?): give a path"),
    ("session", ["--k-prompt", "0"], f"error: --k-prompt {BELOW} 0"),
    ("session", ["--k-seed", "1"], "error: --k-seed must be an integer >= --k-prompt (3), got 1"),
    (
        "quality",
        ["--models", "default", "--k-prompt", "4", "--k-seed", "2"],
        "error: --k-seed must be an integer >= --k-prompt (4), got 2",
    ),
]


@pytest.mark.parametrize(("module", "argv", "expected"), BAD_OPTIONS)
def test_a_bad_option_stops_a_benchmark_before_the_model_loads(tmp_path, monkeypatch, module, argv, expected):
    """The real entry points: one line (exit 1) or a usage error (exit 2), and no model was asked for."""
    (tmp_path / "a_file").write_text("x", encoding="utf-8")
    os.mkfifo(tmp_path / "a_fifo")  # no writer: a plain read waited for one for good
    (tmp_path / "deep.json").write_text("[" * 200_000, encoding="utf-8")  # a RecursionError's traceback
    paths = {
        "dir": str(tmp_path),
        "file": str(tmp_path / "a_file"),
        "fifo": str(tmp_path / "a_fifo"),
        "deep": str(tmp_path / "deep.json"),
    }
    bench = importlib.import_module(f"rag_lookahead.bench.{module}")
    loads = []
    for owner in (bench, common):  # a benchmark loads the model itself or through common's helper
        monkeypatch.setattr(owner, "load_bench_model", lambda *a, **k: loads.append(a), raising=False)
    if module == "interference":  # --tiny builds its model here
        monkeypatch.setattr(bench, "tiny_mix", lambda *a, **k: loads.append(a))
    if module == "gpu_check":  # it builds its models section by section
        monkeypatch.setattr(bench, "run_check", lambda *a, **k: loads.append(a))
    with pytest.raises(SystemExit) as done:
        bench.main([arg.format(**paths) for arg in argv])
    assert done.value.code == (expected.format(**paths) if isinstance(expected, str) else expected)
    assert loads == []


@pytest.mark.parametrize("module", ["single", "batch", "step_profile", "replay", "interference"])
def test_the_help_of_each_benchmark_taking_prompts_names_the_shipped_sets(module, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps the help to the terminal's width
    bench = importlib.import_module(f"rag_lookahead.bench.{module}")
    assert bench.main(["--help"]) == 0
    assert f"({PROMPT_SETS}; default: bundled)" in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() == 0, reason="root searches any folder")
def test_a_prompts_file_in_a_folder_one_may_not_search_says_so_not_no_such_file(tmp_path):
    """Only a path with nothing at it gets the shipped sets' names: a folder one may not search
    said "no such file" too (a check that reads any error as missing)."""
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "p.jsonl").write_text('{"context": "c", "question": "q"}\n', encoding="utf-8")
    (tmp_path / "locked").chmod(0)
    try:
        with pytest.raises(InputError, match="Permission denied") as refused:
            common.load_prompts(str(tmp_path / "locked" / "p.jsonl"))
    finally:
        (tmp_path / "locked").chmod(stat.S_IRWXU)
    assert "no such file" not in str(refused.value)


NO_GPU = "error: device 'cuda' asked for, but torch {torch} sees no CUDA GPU"
BAD_DTYPE = "error: unknown dtype 'bf17'; use one of bf16, bfloat16, fp32, float32, fp16, float16, half, auto or"
INDEX_FIRST = [  # (benchmark, argv, the error's start): each was said only after 23-45 s of indexing
    ("rag", ["--dtype", "bf17"], BAD_DTYPE),
    ("rag", ["--device", "cuda"], NO_GPU),
    ("session", ["--dtype", "bf17", "--dataset", "bundled"], BAD_DTYPE),
    ("quality", ["--models", "default", "--device", "cuda"], NO_GPU),
    # checked only after the default model had answered every question (minutes), with no report
    (
        "quality",
        ["--models", "default,{dir}/no-model", "--max-new-tokens", "1"],
        "error: model folder '{dir}/no-model'",
    ),
    # a hub id neither cached nor fetchable (HF_HUB_OFFLINE, set below): the same, after the run
    (
        "quality",
        ["--models", "default,no-such-org/no-such-model", "--max-new-tokens", "1"],
        "error: model 'no-such-org/no-such-model' is neither a local folder nor in the Hugging Face cache",
    ),
    ("rag", ["--model", "no-such-org/no-such-model"], "error: model 'no-such-org/no-such-model' is neither"),
]


@pytest.mark.parametrize(("module", "argv", "expected"), INDEX_FIRST)
def test_a_bad_model_option_is_refused_before_the_index_is_built(tmp_path, monkeypatch, module, argv, expected):
    """The real entry points, with nothing replaced: temporary folders go to one that does not exist,
    so a benchmark that starts building its temporary index before checking the model options fails
    there at once (FileNotFoundError) instead of saying, minutes later, what was wrong."""
    import tempfile

    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-temp-folder"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bench = importlib.import_module(f"rag_lookahead.bench.{module}")
    with pytest.raises(SystemExit) as done:
        bench.main([arg.format(dir=tmp_path) for arg in argv])
    assert str(done.value.code).startswith(expected.format(dir=tmp_path, torch=torch.__version__))


class _Reached(Exception):
    """Raised where a benchmark would load its model (or, for gpu_check, run its sections)."""


def _stop_at_the_model(monkeypatch, tmp_path, module: str):
    """The benchmark ``module``, where loading a model raises :class:`_Reached` and a temporary
    index cannot be built (its folder does not exist)."""
    import tempfile

    def reached(*args, **kwargs):
        raise _Reached

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-temp-folder"))
    bench = importlib.import_module(f"rag_lookahead.bench.{module}")
    for owner in (bench, common):
        monkeypatch.setattr(owner, "load_bench_model", reached, raising=False)
    for name in ("tiny_mix", "run_check"):  # interference --tiny's model, gpu_check's sections
        monkeypatch.setattr(bench, name, reached, raising=False)
    return bench


@pytest.mark.parametrize(
    ("module", "argv", "refused"),
    [
        ("gpu_check", ["--tiny-only", "--model", "quality"], "--model"),
        ("gpu_check", ["--tiny-only", "--device-map", "auto"], "--device-map"),
        ("gpu_check", ["--tiny-only", "--device-map", "cpu"], "--device-map"),
        ("gpu_check", ["--tiny-only", "--trust-remote-code"], "--trust-remote-code"),
        ("interference", ["--tiny", "--model", "quality"], "--model"),
        ("interference", ["--tiny", "--device", "cuda"], "--device"),
    ],
)
def test_an_option_a_tiny_run_replaces_is_refused_by_name(tmp_path, monkeypatch, capsys, module, argv, refused):
    """gpu_check --tiny-only ignored --model and --device-map: it ran the tiny models to the end, exit 0,
    the report's settings naming a model that never ran. It shares bench.interference --tiny's
    refusal (a usage error before anything runs), each naming its own flag."""
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps the usage error to the terminal's width
    bench = _stop_at_the_model(monkeypatch, tmp_path, module)
    with pytest.raises(SystemExit) as done:
        bench.main(["--device", "cpu", *argv] if module == "gpu_check" else argv)
    assert done.value.code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert refused in said and f"does not apply with {argv[0]}" in said


def test_gpu_check_tiny_only_takes_the_default_model_and_a_device_it_sees(tmp_path, monkeypatch):
    """What the tiny run uses anyway is not refused: it goes on to the sections."""
    bench = _stop_at_the_model(monkeypatch, tmp_path, "gpu_check")
    with pytest.raises(_Reached):
        bench.main(["--device", "cpu", "--small", "--tiny-only", "--model", "default"])


RECALIBRATE_READERS = [  # (benchmark, argv): each decodes with budget="auto", which reads the variable
    ("single", []),
    ("single", ["--methods", "greedy,lookahead_sample"]),
    ("single", ["--methods", "greedy", "--extra-branch-length", "8"]),
    ("batch", []),
    ("rag", []),
    ("session", ["--dataset", "bundled"]),
    ("quality", ["--models", "default"]),
    ("replay", []),
    ("step_profile", []),
    ("interference", []),
    ("interference", ["--tiny"]),
    ("gpu_check", ["--device", "cpu"]),
    ("gpu_check", ["--device", "cpu", "--small", "--tiny-only"]),
]


@pytest.mark.parametrize(("module", "argv"), RECALIBRATE_READERS)
def test_a_bad_recalibrate_value_stops_a_benchmark_before_its_model_or_index(tmp_path, monkeypatch, module, argv):
    """ask and serve said it as they started; the benchmarks raised it at their first lookahead
    decode, after the index was built (bench.rag, bench.session) and the model had loaded
    (gpu_check: as a traceback in each of its last three sections)."""
    monkeypatch.setenv("RAG_LOOKAHEAD_RECALIBRATE", "y")
    bench = _stop_at_the_model(monkeypatch, tmp_path, module)
    with pytest.raises(SystemExit) as done:
        bench.main(argv)
    assert done.value.code == (
        "error: RAG_LOOKAHEAD_RECALIBRATE must be 1, true, yes or on (measure the cost curve again) "
        "or 0, false, no or off, got 'y'"
    )


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("single", ["--budget", "fixed"]),
        # transformers' methods and prompt_lookup_ours (budget fixed) never read it, nor batch's plain
        ("single", ["--methods", "greedy,prompt_lookup"]),
        ("single", ["--methods", "greedy,prompt_lookup_ours,sample,greedy_stock"]),
        ("batch", ["--methods", "hf_greedy,plain"]),
        ("interference", ["--tiny", "--no-lookahead"]),
    ],
)
def test_a_benchmark_that_does_not_read_recalibrate_does_not_refuse_it(tmp_path, monkeypatch, module, argv):
    monkeypatch.setenv("RAG_LOOKAHEAD_RECALIBRATE", "y")
    bench = _stop_at_the_model(monkeypatch, tmp_path, module)
    with pytest.raises(_Reached):
        bench.main(argv)


def test_input_files_that_never_end_are_refused_at_once(tmp_path):
    """A FIFO hung the benchmarks and batch_answers for good, /dev/zero grew them until killed."""
    from rag_lookahead.bench.retrieval import load_dataset
    from rag_lookahead.rag.corpus import read_input_text

    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "fifo", Path("/dev/zero"), tmp_path):
        with pytest.raises(ValueError, match="not a regular file"):
            read_input_text(path)
        with pytest.raises(InputError, match="not a regular file"):
            load_dataset(str(path))
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (2 * 2**20 + 1))
    with pytest.raises(ValueError, match="over the 2 MB limit$"):
        read_input_text(big, max_mb=2)
    (tmp_path / "ok.jsonl").write_text('{"q": "好"}\n', encoding="utf-8")
    assert read_input_text(tmp_path / "ok.jsonl") == '{"q": "好"}\n'


def test_check_output_path_accepts_a_new_file_or_a_report_of_ours_only(tmp_path, monkeypatch):
    """The measured bug: ``--json`` replaced any file, the run's own ``--prompts`` file too."""
    from rag_lookahead.bench.common import check_output_path
    from rag_lookahead.output_files import save_report

    check_output_path(None)
    check_output_path(str(tmp_path / "new.json"))
    save_report(tmp_path / "old.json", {"summary": {}})
    check_output_path(str(tmp_path / "old.json"))  # a rerun replaces its own report
    for name, text in (
        ("mine.json", "{}"),
        ("notes.txt", "user notes"),
        ("prompts.jsonl", '{"question": "q"}\n'),
        ("theirs.json", '{"written_by": "someone else"}'),  # our mark's key, another's name
    ):
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError, match="this command did not write it"):
            check_output_path(str(tmp_path / name))
        assert (tmp_path / name).read_text(encoding="utf-8") == text
    (tmp_path / "link.json").symlink_to(tmp_path / "old.json")  # even to a report of ours
    with pytest.raises(ConfigError, match="did not write it"):
        check_output_path(str(tmp_path / "link.json"))
    with pytest.raises(ConfigError, match="is this run's input"):
        check_output_path(str(tmp_path / "old.json"), inputs=[str(tmp_path / "old.json")])
    monkeypatch.chdir(tmp_path)
    check_output_path("here.json")  # the current folder
    with pytest.raises(ConfigError, match="--plot 'sub' is a folder"):
        (tmp_path / "sub").mkdir()
        check_output_path("sub", "--plot")


def test_a_report_path_taken_during_the_run_is_kept_and_the_report_goes_beside_it(tmp_path, capsys):
    """The path is checked before a run of many minutes; a file a user (or another tool) put there
    meanwhile was replaced by the report at the end."""
    from rag_lookahead.output_files import is_report, save_report

    assert save_report(tmp_path / "run.json", {"summary": 1, "prompt": "怎么设置？"}) == tmp_path / "run.json"
    assert '"prompt": "怎么设置？"' in (tmp_path / "run.json").read_text(encoding="utf-8")  # as written, not \u escapes
    assert save_report(tmp_path / "run.json", {"summary": 2}) == tmp_path / "run.json"  # a rerun: its own
    (tmp_path / "taken.json").write_text("user notes", encoding="utf-8")
    (tmp_path / "taken.1.json").write_text("more notes", encoding="utf-8")
    written = save_report(tmp_path / "taken.json", {"summary": 3})
    assert written == tmp_path / "taken.2.json" and is_report(written)
    assert json.loads(written.read_text(encoding="utf-8"))["summary"] == 3
    assert (tmp_path / "taken.json").read_text(encoding="utf-8") == "user notes"
    assert (tmp_path / "taken.1.json").read_text(encoding="utf-8") == "more notes"
    assert "taken.json appeared or changed during the run, not by this command" in capsys.readouterr().err
    (tmp_path / "link.json").symlink_to(tmp_path / "run.json")  # a symlink, even to a report of ours
    assert save_report(tmp_path / "link.json", {"summary": 4}) == tmp_path / "link.1.json"
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "run.json").read_text())["summary"] == 2


def test_a_report_of_ours_written_at_the_path_during_the_run_is_kept(tmp_path, capsys):
    """Two runs to one --json: the later one replaced the report the other saved meanwhile (any
    report of ours passed the check at the end); what the check before the run found decides. A
    report removed during the run is no file taken: the report goes back at its path, not beside it."""
    from rag_lookahead.bench.common import check_output_path, write_report

    path = tmp_path / "run.json"
    assert check_output_path(None) is ...
    seen = check_output_path(str(path))
    assert seen is None  # nothing there yet
    write_report(path, {"summary": "an earlier run's"}, seen=seen)
    seen = check_output_path(str(path))  # this run's own earlier report: it is replaced
    assert write_report(path, {"summary": "mine"}, seen=seen) == path
    seen = check_output_path(str(path))
    write_report(path, {"summary": "the other run's"}, seen=check_output_path(str(path)))  # meanwhile
    assert write_report(path, {"summary": "mine"}, seen=seen) == tmp_path / "run.1.json"
    assert json.loads(path.read_text(encoding="utf-8"))["summary"] == "the other run's"
    assert "run.json appeared or changed during the run, not by this command" in capsys.readouterr().err
    # a report of ours removed during the run left the path free: written back there, nothing said
    seen = check_output_path(str(path))
    path.unlink()
    assert write_report(path, {"summary": "mine again"}, seen=seen) == path
    assert json.loads(path.read_text(encoding="utf-8"))["summary"] == "mine again"
    assert "appeared or changed" not in capsys.readouterr().err


def test_a_temperature_or_branch_length_given_twice_is_refused_naming_the_option():
    """0.7 and 0.70 ran the sampling methods twice a prompt; 12,12 merged without a word, and an
    extra 48 beside lookahead at --branch-length 48 ran lookahead twice under two names."""
    import typer

    from rag_lookahead.bench.common import extra_depth_methods
    from rag_lookahead.bench.single import expand_methods

    with pytest.raises(typer.BadParameter, match="names a temperature twice: '0.7,0.70'"):
        expand_methods("sample", "0.7,0.70", {}, 48)
    with pytest.raises(typer.BadParameter, match="names a temperature twice"):  # one method name, sample_t0.7
        expand_methods("sample", "0.7,0.7000001", {}, 48)
    with pytest.raises(typer.BadParameter, match="names a branch length twice: '48,12,12'"):
        extra_depth_methods("48,12,12")
    with pytest.raises(typer.BadParameter, match="48 is --branch-length, which the method lookahead runs already"):
        expand_methods("greedy,lookahead", "0.7", extra_depth_methods("48,12"), 48)
    assert expand_methods("greedy", "0.7,1", extra_depth_methods("48"), 48) == (["greedy", "lookahead_b48"], [0.7, 1])


def test_concurrency_levels_are_integers_of_at_least_one():
    from rag_lookahead.bench.batch import concurrency_levels

    assert concurrency_levels("1,4, 16") == [1, 4, 16]
    for bad in ("0", "-3", "", "1,,2", "2.5", "2,2", "1,4,01"):  # a level twice: run twice, vs itself
        with pytest.raises(ConfigError, match="--concurrency"):
            concurrency_levels(bad)


# ---------------------------------------------------------------- identical: only where the baseline ran


def test_a_method_is_never_called_identical_to_a_greedy_that_did_not_run():
    """Without greedy, lookahead's row says None for identical and for the share copied (it used to
    be compared with itself: always identical)."""
    from types import SimpleNamespace

    from rag_lookahead.bench.methods import MethodTotals, Run, summarize
    from rag_lookahead.bench.single import Measured, prompt_row

    runner = SimpleNamespace(
        eos=[2], context_ids=lambda prompt: [5, 6, 7, 8], settings=SimpleNamespace(copying_threshold=0.5)
    )
    measured = Measured({"lookahead": MethodTotals()}, {"lookahead": MethodTotals()}, [])
    runs = {"lookahead": Run([5, 6, 7, 8, 2], 1.0, 0.5)}
    row = prompt_row(runner, {"id": "p"}, 0, runs, measured)
    assert row["copied_from_context"] is None
    assert row["lookahead"]["identical_to_greedy"] is None
    assert summarize(measured.totals)["lookahead"]["identical_to_greedy"] is None
    runs["greedy"] = Run([5, 6, 7, 8, 2, 9], 1.0, 0.5)  # the same answer: cut after its EOS
    measured.totals["greedy"] = measured.copying["greedy"] = MethodTotals()
    row = prompt_row(runner, {"id": "p"}, 1, runs, measured)
    assert row["copied_from_context"] == 0.8 and row["lookahead"]["identical_to_greedy"] is True
    summary = summarize(measured.totals)
    assert summary["lookahead"]["identical_to_greedy"] == "1/1"  # of its 2 runs, 1 had greedy beside it
    assert row["greedy"]["identical_to_greedy"] is None  # a baseline is not "identical" to itself
    assert summary["greedy"]["identical_to_greedy"] is None


def test_mean_accepted_is_tokens_per_decode_forward_over_all_runs():
    """The column was the mean of each run's own ratio: a short copying answer weighed as much as a
    long paraphrase (the README's 8-prompt table: 12.43 reported, ~3.8 tokens per forward pooled)."""
    from rag_lookahead.bench.methods import MethodTotals, Run, summarize

    totals = MethodTotals()
    totals.add(Run(list(range(21)), 1.0, 0.1, forwards=1, mean_accepted=20.0), None)  # copied: 20 in one step
    totals.add(Run(list(range(101)), 5.0, 0.1, forwards=50, mean_accepted=2.0), None)  # paraphrased
    row = summarize({"lookahead": totals})["lookahead"]
    assert row["mean_accepted"] == round(120 / 51, 3)
    assert row["mean_accepted_per_run"] == 11.0


def test_batch_rows_are_compared_with_transformers_greedy_alone_or_not_at_all():
    from rag_lookahead.bench.batch import Workload, measure
    from rag_lookahead.decoding.config import LookaheadConfig
    from tests.tiny_models import tiny_model

    requests = [[3, 4, 5, 3, 4, 5, 3], [7, 8, 9, 10]]
    work = Workload(tiny_model("qwen2"), [], 0, requests, LookaheadConfig(), {}, 6)
    # no transformers run alone among the timed ones (the README's --concurrency 4,16): decoded after, untimed
    rows, single = measure(work, ["lookahead"], [2], 1)
    assert rows[0]["identical_to_single"] == "2/2" and len(single) == 2
    rows, single = measure(work, ["lookahead", "hf_greedy"], [1], 1)  # the reference runs after lookahead
    assert [r["identical_to_single"] for r in rows] == ["2/2", None]  # the reference is not "identical" to itself
    assert len(single) == 2 and all(len(out) == 6 for out in single.values())


def test_batch_runs_start_from_the_same_acceptance_prior():
    """Each lookahead run inherited the rates the run before it (another level, depth or pass) had
    learned in the model's profile, which favoured the later ones."""
    from rag_lookahead.bench.batch import Workload
    from rag_lookahead.decoding.config import LookaheadConfig
    from rag_lookahead.decoding.draft import DraftTree
    from rag_lookahead.decoding.profile import profile_of
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen2")
    work = Workload(model, [], 0, [[3, 4, 5, 3, 4, 5, 3]], LookaheadConfig(budget="fixed"), {}, 6)
    work.run("lookahead", 1)
    after_one = repr(profile_of(model).drafts_met)
    rejected = DraftTree(tokens=[1], parents=[-1], depths=[1], probs=[1.0])
    for _ in range(20):  # as if an earlier run had learned that drafts fail
        profile_of(model).drafts_met["TrieDrafter"].observe(rejected, [])
    assert repr(profile_of(model).drafts_met) != after_one
    work.run("lookahead", 1)
    assert repr(profile_of(model).drafts_met) == after_one


def test_rag_bench_pools_mean_accepted_and_does_not_compare_off_with_itself():
    """The summary averaged each answer's own ratio (a 1-token answer counted 0.0) and showed "off"
    identical to itself."""
    from rag_lookahead.bench.rag import MODES, summarize_modes

    long, short = {"new_tokens": 101, "forward_passes": 20, "decode_seconds": 2.0}, {"new_tokens": 1}
    per_mode = {
        mode: [(long, None if mode == "off" else True), (short, None if mode == "off" else False)] for mode in MODES
    }
    rows = {row["mode"]: row for row in summarize_modes(per_mode)}
    assert rows["seeded"]["mean accepted"] == 5.0  # 100 tokens after the first over 20 forwards
    assert rows["seeded"]["decode tok/s"] == 50.0  # the same 100 tokens over 2 s, pooled over every question
    assert rows["off"]["identical to off"] == "-" and rows["seeded"]["identical to off"] == "1/2"


class _FakeChains:
    """Stands in for ``build_rag_chain`` (and ``LookaheadLLM``): a chain answers the same text, with
    as many tokens as the passages it seeds (``k_seed``), from ``sources``."""

    def __init__(self, monkeypatch, sources=()):
        from rag_lookahead.langchain import llm
        from rag_lookahead.rag import chains

        self.sources = list(sources)
        self.on_invoke = lambda: None
        monkeypatch.setattr(llm, "LookaheadLLM", lambda **kwargs: SimpleNamespace(output_pool=SimpleNamespace(nodes=0)))
        monkeypatch.setattr(chains, "build_rag_chain", self.build)

    def build(self, language_model, index, k_prompt, k_seed):
        sources, fakes = self.sources, self

        class Chain:
            def invoke(self, question):
                fakes.on_invoke()
                stats = {"new_tokens": k_seed, "forward_passes": 1, "decode_seconds": 1.0, "mean_accepted": 1.0}
                return {"answer": "the same", "stats": stats, "sources": sources}

        return Chain()


def test_rag_bench_seeds_k_seed_passages_and_leaves_off_uncompared(monkeypatch, capsys):
    """The "seeded" and "session" modes seed ``k_seed`` passages, "off" and "prompt" ``k_prompt``; the
    "off" row is not compared with itself (None, not true)."""
    from tiny_models import build_tiny_model

    from rag_lookahead.bench import rag

    _FakeChains(monkeypatch)
    rows, per_mode = rag.ask_every_way(build_tiny_model("qwen2", seed=21), None, None, "m", 2, 5, 16)
    assert len(rows) == len(rag.QUESTIONS)
    for row in rows:
        assert {mode: row[mode]["new_tokens"] for mode in rag.MODES} == {
            "off": 2,
            "prompt": 2,
            "seeded": 5,
            "session": 5,
        }
        assert row["off"]["identical_to_off"] is None
        assert row["prompt"]["identical_to_off"] is True and row["seeded"]["identical_to_off"] is False
    assert all(same is None for _, same in per_mode["off"])


def test_the_session_control_runs_from_the_sessions_learned_rates(monkeypatch, capsys):
    """The empty-pool control differs from the session in its pool only: it starts from the rates
    the session learned (not a new process's prior), and leaves them as they were."""
    from tiny_models import build_tiny_model

    from rag_lookahead.bench.session import ask_session
    from rag_lookahead.decoding.acceptance import AcceptanceRates
    from rag_lookahead.decoding.profile import profile_of

    model = build_tiny_model("qwen2", seed=21)
    met = profile_of(model).drafts_met
    met["trie"] = AcceptanceRates()
    fakes, seen = _FakeChains(monkeypatch), []

    def learn() -> None:  # each call sees the rates as they are, then learns one of its own
        seen.append(list(met))
        met[f"call{len(seen) - 1}"] = AcceptanceRates()

    fakes.on_invoke = learn
    records = ask_session(
        model, None, None, ["q1", "q2"], model_name="m", k_prompt=2, k_seed=4, max_new_tokens=8, control_every=1
    )
    assert all("fresh" in r for r in records)
    # the warm-up, q1's session then control, q2's control (every other one first) then session:
    # the controls start from what the session learned and what they learn is gone after them
    learned = ["trie", "call0", "call1"]
    assert seen == [["trie"], ["trie", "call0"], learned, learned, learned]


def test_quality_gold_retrieved_is_whether_the_gold_file_was_shown(monkeypatch, capsys):
    from rag_lookahead.bench import quality

    sources = [{"source": "/corpora/en/quickstart.md", "in_prompt": True}, {"source": "tuning.md", "in_prompt": False}]
    _FakeChains(monkeypatch, sources)
    rows = quality.ask_all(None, None, None, "default", 16, 2, 4)
    gold = {q.text: q.gold for q in quality.QUESTIONS}
    assert {r["question"]: r["gold retrieved"] for r in rows} == {t: g == "quickstart.md" for t, g in gold.items()}
    assert any(r["gold retrieved"] for r in rows) and not all(r["gold retrieved"] for r in rows)


def test_an_answer_holding_one_key_term_in_any_case_is_grounded():
    from rag_lookahead.bench.quality import Question, grounded, terms_found

    question = Question("What drafts?", "a.md", ("Trie", "output pool", "n-gram"))
    assert grounded("It uses a trie.", question) and grounded("uses a TRIE", question)
    assert terms_found("the TRIE and the `Output   Pool`", question) == 2
    assert not grounded("It guesses.", question) and terms_found("It guesses.", question) == 0


def test_session_questions_are_distinct_and_a_repeat_is_warned_of(capsys):
    from rag_lookahead.bench.retrieval import Item
    from rag_lookahead.bench.session import session_questions

    items = [Item("a", "zh", "p1", ["q1", "q2"]), Item("b", "zh", "p2", ["q1", "q3"])]  # q1 twice in the data
    assert sorted(session_questions(items, 3)) == ["q1", "q2", "q3"] and capsys.readouterr().err == ""
    assert len(set(session_questions(items, 4))) == 3 and "3 distinct questions" in capsys.readouterr().err


def test_session_blocks_count_decode_tokens_after_the_first_and_end_at_the_blocks_pool():
    from rag_lookahead.bench.session import summarize_blocks

    records = [{"new_tokens": 5, "decode_seconds": 1.0, "steps": 2, "pool_nodes": n} for n in (10, 20, 30, 40)]
    blocks = summarize_blocks(records, 3)
    assert [b["questions"] for b in blocks] == ["1-3", "4-4"]
    assert [b["decode tok/s"] for b in blocks] == [4.0, 4.0]  # 4 tokens after each answer's first, a second
    assert [b["pool nodes"] for b in blocks] == [30, 40]  # the pool as the block leaves it


def test_quality_totals_pool_decode_tokens_and_the_table_keeps_its_columns():
    from rag_lookahead.bench.quality import markdown, summarize

    row = {"model": "m", "question": "q", "grounded": True, "key terms": "1/1", "gold retrieved": True}
    rows = [
        {**row, "new tokens": 1, "decode tok/s": 0.0, "mean accepted": 0.0, "decode forwards": 0},  # no decode
        {**row, "new tokens": 41, "decode tok/s": 10.0, "mean accepted": 4.0, "decode forwards": 10},
    ]
    summary = summarize(rows)
    assert summary["decode tok/s"] == 10.0 and summary["mean accepted"] == 4.0
    table = markdown(rows[1:], {"m": {**summary, "load seconds": 1.0, "peak rss gb": 0.5}}).splitlines()
    head = [c.strip() for c in table[0].split("|")]
    cells = [c.strip() for c in table[2].split("|")]
    assert dict(zip(head, cells, strict=True))["decode tok/s"] == "10.0"
    assert dict(zip(head, cells, strict=True))["mean accepted"] == "4.0"


class _TimedEmbedder:
    """Takes ``cost`` seconds a text on the clock it is given."""

    def __init__(self, clock, cost):
        self.clock, self.cost = clock, cost

    def embed_documents(self, texts, progress=False):
        self.clock[0] += self.cost * len(texts)


def test_retrieval_speed_is_chunks_over_every_round_and_ratios_are_over_the_first(monkeypatch):
    from types import SimpleNamespace

    from rag_lookahead.bench import retrieval

    clock = [0.0]
    monkeypatch.setattr(retrieval, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    embedders = {"fast": _TimedEmbedder(clock, 0.01), "slow": _TimedEmbedder(clock, 0.02)}
    cps = retrieval.speed(embedders, ["x"] * 10, 3)
    assert cps == {"fast": pytest.approx(100.0), "slow": pytest.approx(50.0)}
    monkeypatch.setattr(retrieval, "load_embedders", lambda names: embedders)
    out = retrieval.run(["fast", "slow"], speed_chunks=4, rounds=2, recall_too=False)
    assert out["speed"]["ratio_to_first"] == {"fast": 1.0, "slow": pytest.approx(0.5)}


def test_tuning_lists_the_fusion_settings_best_first():
    import numpy as np

    from rag_lookahead.bench import retrieval

    items = [
        Item(str(i), "en", f"passage {i} about topic{i} word{i}", [f"what about topic{i}?", f"word{i}?"])
        for i in range(6)
    ]
    ds = retrieval.chunk_dataset("toy", items)
    rng = np.random.default_rng(1)
    dense = [list(rng.permutation(len(ds.chunks))) for _ in ds.questions]
    bm25 = retrieval.bm25_rankings(retrieval.BM25Index(ds.chunks), ds.questions, len(ds.chunks))
    objectives = [row["objective_A"] for row in retrieval.tune([retrieval.Ranked(ds, bm25, {"e": dense}, {})], "e")]
    assert objectives == sorted(objectives, reverse=True) and objectives[0] > objectives[-1]


# ---------------------------------------------------------------- JSONL lines end at "\n" only


def test_jsonl_lines_keep_unicode_line_separators_inside_strings(tmp_path):
    from rag_lookahead.bench.common import load_prompts
    from rag_lookahead.bench.retrieval import load_dataset

    odd = "a\u2028b\u0085c\fd\u2029e\x1cf"
    rows = [{"id": "x", "context": odd, "question": "q?"}, {"id": "y", "context": "p", "question": odd}]
    text = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n\n"
    path = tmp_path / "odd.jsonl"
    path.write_bytes(text.encode("utf-8"))  # no newline translation: the file keeps its \r\n
    prompts = load_prompts(str(path))
    assert [(p["id"], p["context"], p["question"]) for p in prompts] == [("x", odd, "q?"), ("y", "p", odd)]
    items = load_dataset(path)
    assert [(it.id, it.passage, it.questions) for it in items] == [("x", odd, ["q?"]), ("y", "p", [odd])]


# ---------------------------------------------------------------- output files and folders


def test_session_corpus_files_are_named_by_position_never_by_id(tmp_path):
    from rag_lookahead.bench.session import write_corpus

    ids = ["../../escaped", "same", "same", "a/b", ""]
    items = [Item(i, "zh", f"passage {n}", ["q"]) for n, i in enumerate(ids)]
    corpus = tmp_path / "run" / "corpus"
    paths = write_corpus(items, corpus)
    assert sorted(p.name for p in corpus.iterdir()) == [f"{n:05d}.txt" for n in range(5)]
    assert [p.read_text(encoding="utf-8") for p in paths] == [f"passage {n}" for n in range(5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing climbed out


def test_the_temporary_index_folders_are_removed_when_the_run_ends(tmp_path, monkeypatch):
    """Building a real index loads the embedder (seconds): here the build writes a file instead, and
    the folder it wrote into must be gone after the block, as after a real run."""
    import tempfile

    from rag_lookahead.bench import rag, session
    from rag_lookahead.rag import index

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(index, "build_index", lambda corpus, folder, **k: (Path(folder) / "manifest.json").touch())
    monkeypatch.setattr(index, "load_index", lambda folder: sorted(p.name for p in Path(folder).iterdir()))
    with rag.open_index(None) as opened:
        assert opened == ["manifest.json"] and len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(session, "index_items", lambda items, folder: write_and_list(items, folder))
    with session.session_index([Item("a", "zh", "p", ["q"])], None) as opened:
        assert opened == ["00000.txt"] and len(list(tmp_path.iterdir())) == 1
    assert list(tmp_path.iterdir()) == []


def write_and_list(items, folder: Path) -> list[str]:
    from rag_lookahead.bench.session import write_corpus

    return [p.name for p in write_corpus(items, folder / "corpus")]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_an_atomic_write_gives_a_new_file_the_usual_mode_and_keeps_a_replaced_files(tmp_path, umask_022):
    from rag_lookahead.atomic import write_json_atomic, write_text_atomic

    new = tmp_path / "new.json"
    write_json_atomic(new, {"a": 1})
    assert stat.S_IMODE(new.stat().st_mode) == 0o644 and json.loads(new.read_text()) == {"a": 1}
    shared = tmp_path / "shared.txt"
    shared.write_text("old", encoding="utf-8")
    shared.chmod(0o664)  # group-writable: more than the umask lets a new file have
    write_text_atomic(shared, "new")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o664 and shared.read_text() == "new"
    private = tmp_path / "private.txt"
    private.write_text("old", encoding="utf-8")
    private.chmod(0o600)
    write_text_atomic(private, "new")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    write_text_atomic(shared, "document text", private=True)  # what holds a user's text: owner only
    write_json_atomic(new, {"b": 2}, private=True)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o600 and stat.S_IMODE(new.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "private.txt", "shared.txt"]  # no temp left


def test_build_realistic_refuses_a_holdout_folder_over_shipped_or_just_written_files(tmp_path):
    from rag_lookahead.data import build_realistic

    shipped = {p.name: p.read_bytes() for p in build_realistic.OUT_DIR.iterdir() if p.is_file()}
    with pytest.raises(SystemExit, match=r"^error: --holdout-out .* ships with the package"):
        build_realistic.main(["--out", str(tmp_path / "out"), "--holdout-out", str(build_realistic.OUT_DIR)])
    with pytest.raises(SystemExit, match=r"^error: --holdout-out .* ships with the package"):
        build_realistic.main(["--out", str(tmp_path / "out"), "--holdout-out", str(build_realistic.DATA_DIR)])
    with pytest.raises(SystemExit, match=r"^error: --holdout-out .* is the --out folder"):
        build_realistic.main(["--out", str(tmp_path / "o"), "--holdout-out", str(tmp_path / "x" / ".." / "o")])
    assert list(tmp_path.iterdir()) == []  # nothing built or written
    assert {p.name: p.read_bytes() for p in build_realistic.OUT_DIR.iterdir() if p.is_file()} == shipped


# ---------------------------------------------------------------- retrieval


def test_recall_of_no_questions_is_null_in_json_and_a_dash_in_the_table(capsys):
    from rag_lookahead.bench.retrieval import print_results, recall

    assert recall([[0, 1]], [1], 1) == 0.0 and recall([[0, 1]], [1], 5) == 1.0
    empty = recall([], [], 5)
    assert empty is None
    out = {"datasets": {"d": {"passages": 1, "chunks": 1, "questions": 0, "generic_questions": 0}}}
    out["datasets"]["d"]["methods"] = {"bm25": {"r@1": empty, "r@5": 0.5, "n": 0}}
    assert '"r@1": null' in json.dumps(out)
    print_results(out)
    assert "bm25" in (line := capsys.readouterr().out.splitlines()[-1]) and line.split()[1:] == ["-", "0.500", "0"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "error: --rounds must be an integer >= 1, got 0"),
        (["--speed", "-1"], "error: --speed must be an integer >= 0, got -1"),
        (["--speed-only"], "error: --speed-only skips the recall runs to time embedding: give --speed N too"),
        (["--embedders", "e5-smal"], "error: embedder 'e5-smal' is not one of ours"),
        # ran twice, the second table replacing the first
        (["--dataset", "bundled", "--dataset", "bundled"], "error: --dataset names 'bundled' twice"),
        (["--embedders", "e5-small,use,e5-small"], "error: --embedders names 'e5-small' twice"),
        (["--embedders", "e5-small, e5-small"], "error: --embedders names 'e5-small' twice"),  # ran twice
        # it "tuned" over no recall runs: NaN in every row, exit 0
        (["--tune", "--speed", "5", "--speed-only"], "error: --tune searches the fusion weights on the recall runs"),
    ],
)
def test_bad_retrieval_options_and_a_misspelled_embedder_are_errors(argv, message):
    from rag_lookahead.bench.retrieval import main

    if "e5-smal" in argv and importlib.util.find_spec("sentence_transformers") is not None:
        pytest.skip("with sentence-transformers installed the name would be looked up on the hub")
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert str(done.value.code).startswith(message)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--embedders", "", "--tune"], "error: --tune needs an embedder, but --embedders names none"),
        (["--embedders", ",", "--speed", "5", "--speed-only"], "error: --speed needs an embedder, but --embedders"),
        (
            ["--embedders", "st:some/model", "--speed", "5", "--tune"],
            "error: --speed and --tune need an embedder, but none of --embedders 'st:some/model' could be loaded",
        ),
    ],
)
def test_retrieval_exits_nonzero_when_nothing_asked_for_can_be_measured(argv, message):
    """It exited 0 having timed or tuned nothing (an extra not installed, or no embedder named)."""
    from rag_lookahead.bench.retrieval import main

    if "st:some/model" in argv and importlib.util.find_spec("sentence_transformers") is not None:
        pytest.skip("with sentence-transformers installed the name would be looked up on the hub")
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert str(done.value.code).startswith(message) and str(done.value.code).endswith(": nothing was measured")


@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is not None, reason="the st extra is installed")
def test_an_embedder_of_an_extra_not_installed_is_skipped_naming_the_extra(capsys):
    from rag_lookahead.bench.retrieval import load_embedders

    assert load_embedders(["st:some/model"]) == {}
    assert "skipping st:some/model: needs the 'st' extra (pip install 'rag-lookahead[st]')" in capsys.readouterr().err


# ---------------------------------------------------------------- quality, tables


def test_quality_checks_every_model_before_the_first_runs(monkeypatch):
    from rag_lookahead.bench import quality

    with pytest.raises(ConfigError, match="names a model twice"):
        quality.model_names("default, default")
    with pytest.raises(ConfigError, match="names no model"):
        quality.model_names(" , ")
    assert quality.model_names("default") == ["default"]
    try:
        quality.model_names("quality")
        pytest.skip("the quality extra is installed")
    except ModelLoadError:
        pass
    loads = []
    monkeypatch.setattr(quality, "load_bench_model", lambda *a, **k: loads.append(a))
    monkeypatch.setattr(quality, "open_index", lambda *a: loads.append(a))
    with pytest.raises(SystemExit) as done:
        quality.main(["--models", "default,quality"])
    assert str(done.value.code).startswith("error: the embedded quality model is not installed")
    assert loads == []


def test_a_table_has_a_column_for_every_key_of_any_row(capsys):
    from rag_lookahead.bench.common import print_rows

    print_rows(
        "t", [{"block": "1-5", "speed": 1.5}, {"block": "6-10", "speed": 2.0, "identical": "1/1"}, {"speed": None}]
    )
    header = next(line for line in capsys.readouterr().out.splitlines() if "block" in line)
    assert "speed" in header and "identical" in header


def test_rag_benchmarks_call_answers_identical_by_text_and_token_count():
    """A chain hands back text, not ids: the same text from another number of tokens is another
    token sequence, so it is not called identical."""
    from rag_lookahead.bench.common import same_answer

    a = {"answer": "the budget", "stats": {"new_tokens": 3}}
    assert same_answer(a, {"answer": "the budget", "stats": {"new_tokens": 3}})
    assert not same_answer(a, {"answer": "the budget", "stats": {"new_tokens": 4}})
    assert not same_answer(a, {"answer": "the budgets", "stats": {"new_tokens": 3}})


def test_quality_key_terms_are_in_their_gold_passage_and_defaults_match_the_code():
    """The measured bug: the branch_length question's key term was still "24" (the old default), so
    the right answer "48" was graded ungrounded."""
    from rag_lookahead.bench.quality import QUESTIONS, terms_found
    from rag_lookahead.decoding.config import LookaheadConfig
    from rag_lookahead.rag.corpus import read_text_file

    corpora = Path(__file__).resolve().parents[2] / "corpora"
    for question in QUESTIONS:
        (gold,) = list(corpora.rglob(question.gold))
        assert terms_found(read_text_file(gold.read_bytes()), question) > 0, question
    defaults = {"decoding_length": LookaheadConfig().decoding_length, "branch_length": LookaheadConfig().branch_length}
    for name, value in defaults.items():
        (question,) = [q for q in QUESTIONS if name in q.text and ("default" in q.text or "默认" in q.text)]
        assert question.key_terms == (str(value),)


def test_transformers_batched_greedy_is_plain_greedy_whatever_the_generation_config():
    """A repetition penalty in the model's generation config (hub Qwen2.5 ships 1.05-1.1) stayed on
    in transformers' side only: "greedy" that was not, against the engine's plain greedy rows."""
    from rag_lookahead.bench.batch import run_continuous
    from rag_lookahead.bench.common import hf_batched
    from rag_lookahead.decoding.config import LookaheadConfig
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen2")
    model.generation_config.repetition_penalty = 1.5
    requests = [[3, 4, 5, 3, 4, 5, 3], [7, 8, 9, 10]]
    ours, _, _ = run_continuous(model, requests, 2, 12, [], 0, LookaheadConfig())
    assert hf_batched(model, requests, 12, [], 0) == ours


def test_retrieval_table_splits_each_embedders_hybrid_under_its_own_name(capsys):
    """The specific/generic rows had one key for every embedder: the last embedder's split was
    printed under the first one's rows, and the others had none. Their keys began with the printed
    table's indentation, which --json carried too."""
    from rag_lookahead.bench.retrieval import (
        CANDIDATES,
        Ranked,
        bm25_rankings,
        chunk_dataset,
        load_dataset,
        method_table,
        print_results,
    )
    from rag_lookahead.rag.lexical import BM25Index

    ds = chunk_dataset("bundled", load_dataset())
    depth = min(CANDIDATES, len(ds.chunks))
    bm25 = bm25_rankings(BM25Index(ds.chunks), ds.questions, depth)
    # two rankings as two embedders would give: BM25's own, and a poor one (BM25's reversed)
    dense = {"good": bm25, "poor": [list(reversed(r)) for r in bm25]}
    rows = method_table(Ranked(ds, bm25, dense, {"good": 0.0, "poor": 0.0}))
    for name in dense:
        split = [rows[f"hybrid {name} (default), {kind} questions"] for kind in ("specific", "generic")]
        whole = rows[next(key for key in rows if key.startswith(f"hybrid {name} (default"))]
        assert sum(part["n"] for part in split) == whole["n"]
        pooled = sum((part["r@5"] or 0.0) * part["n"] for part in split) / whole["n"]
        assert abs(pooled - whole["r@5"]) < 1e-9, (name, split, whole)  # the split is of this embedder's hybrid
    assert all(key == key.strip() for key in rows)  # --json keys carry no table indentation
    print_results(
        {"datasets": {"d": {"passages": 1, "chunks": 1, "questions": 1, "generic_questions": 0, "methods": rows}}}
    )
    printed = capsys.readouterr().out.splitlines()
    assert "    hybrid poor (default), generic questions" in printed[-1]  # indented under its hybrid row
    assert printed[-3].startswith("  hybrid poor (previous: ")  # the rows it does not split are not


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_retrieval_json_to_a_full_stdout_is_one_line(tmp_path):
    """``bench.retrieval --json > /dev/full``: its report is stdout, and the failed write ended in
    a traceback (the other benchmarks said one line, as their shared guard does)."""
    import subprocess
    import sys

    data = tmp_path / "tiny.jsonl"
    data.write_text(
        '{"passage": "The warranty covers defects for two years.", "question": "How long is the warranty?"}\n'
        '{"passage": "Bake the bread for forty minutes at 200 degrees.", "question": "How long to bake the bread?"}\n',
        encoding="utf-8",
    )
    command = [sys.executable, "-m", "rag_lookahead.bench.retrieval", "--dataset", str(data), "--json"]
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-1500:]
    assert done.stderr.strip().splitlines()[-1] == "error: cannot write the results to stdout: No space left on device"
