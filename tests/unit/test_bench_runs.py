"""Benchmarks run end to end on a tiny model: prompts that do not fit the model's context
are refused before any timed run, and the --json report is saved when stdout fails."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
from file_limits import files_limited_to
from tiny_models import build_tiny_model
from tiny_tokenizer import tiny_tokenizer

from rag_lookahead.bench import common

CONTEXT = 64  # the tiny model's positions: prompt and answer together


@pytest.fixture(scope="module")
def tiny():
    """The tiny random Qwen2 with a 64-position context, and the tiny tokenizer."""
    return build_tiny_model("qwen2", max_positions=CONTEXT), tiny_tokenizer()


def loading_tiny(monkeypatch, tiny, module: str):
    """The benchmark ``module``, whose model loader hands out the tiny model whatever ``--model`` says
    (a saved folder would load the tiny tokenizer as Qwen2's, which splits its words otherwise)."""
    bench = importlib.import_module(f"rag_lookahead.bench.{module}")
    for owner in (bench, common):  # a benchmark loads the model itself or through common's helper
        monkeypatch.setattr(owner, "load_bench_model", lambda *a, **k: tiny, raising=False)
    return bench


def words(count: int, first: int = 5) -> str:
    """``count`` words of the tiny tokenizer, one token each."""
    return " ".join(f"t{first + n % 40}" for n in range(count))


def prompts_file(tmp_path, *prompts: dict) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    return str(path)


def chat_length(prompt: dict) -> int:
    """Its tokens as the benchmarks build them: the passage and question as the chat's user turn."""
    return len(common.chat_ids(tiny_tokenizer(), prompt))


RUNS = {  # benchmark -> its options for a short run on the tiny model
    "single": ["--methods", "greedy,lookahead"],
    "batch": ["--requests", "2", "--concurrency", "1", "--methods", "hf_greedy,lookahead"],
    "replay": [],
    "step_profile": [],
}


@pytest.mark.parametrize("module", RUNS)
def test_a_prompt_past_the_context_is_refused_before_any_timed_run(tiny, monkeypatch, tmp_path, capsys, module):
    """lookahead stopped mid-run at such a prompt, after the others were measured, naming none and
    writing no report; transformers' greedy alone decoded past the context and exited 0."""
    short = {"id": "short", "context": words(4), "question": "t9 t10"}
    long = {"id": "long", "context": words(CONTEXT), "question": "t9 t10"}
    path = prompts_file(tmp_path, short, long)
    report = tmp_path / "r.json"
    bench = loading_tiny(monkeypatch, tiny, module)
    argv = ["--prompts", path, "--max-new-tokens", "4"]
    with pytest.raises(SystemExit) as done:
        bench.main([*argv, *RUNS[module], "--json", str(report)])
    assert done.value.code == (
        f"error: prompt 'long' is {chat_length(long)} tokens with the chat template, and the model's context holds "
        f"{CONTEXT}, prompt and answer together: no room is left for an answer; drop the prompt"
    )
    assert capsys.readouterr().out == "" and not report.exists()  # nothing was measured


def test_an_answer_past_the_context_is_refused_naming_the_max_new_tokens_that_fit(tiny, monkeypatch, tmp_path):
    """A prompt that fits but not with its answer: transformers' greedy decoded past the context
    where our loop stops at it, and the table compared the unequal answers ("identical 0/1")."""
    mid = {"id": "mid", "context": words(30), "question": "t9 t10"}
    room = CONTEXT - chat_length(mid)
    argv = ["--prompts", prompts_file(tmp_path, mid), "--methods", "greedy,lookahead"]
    main = loading_tiny(monkeypatch, tiny, "single").main
    with pytest.raises(SystemExit) as done:
        main([*argv, "--max-new-tokens", str(room + 1)])
    assert done.value.code == (
        f"error: prompt 'mid' is {CONTEXT - room} tokens with the chat template, and the model's context holds "
        f"{CONTEXT}, prompt and answer together: an answer of --max-new-tokens {room + 1} does not fit; lower it "
        f"to {room} or drop the prompt"
    )
    report = main([*argv, "--max-new-tokens", str(room)])  # what the error advised: both end at the context
    assert [report["summary"][m]["new_tokens"] for m in ("greedy", "lookahead")] == [room, room]
    assert report["summary"]["lookahead"]["identical_to_greedy"] == "1/1"


def full_stdout():
    return open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115 (closed by the test)


def left_pipe():
    """The write end of a pipe whose reader left (``| head -1``)."""
    read, write = os.pipe()
    os.close(read)
    return open(write, "w", encoding="utf-8")  # noqa: SIM115 (closed by the test)


@pytest.mark.parametrize("stdout", [full_stdout, left_pipe])
@pytest.mark.parametrize("module", RUNS)
def test_the_report_is_saved_when_stdout_fails(tiny, tmp_path, monkeypatch, module, stdout):
    """``> /dev/full`` ended the run with an OSError traceback, ``| head -1`` with a silent exit 1
    at the next print: neither wrote the --json report."""
    if not os.path.exists("/dev/full") and stdout is full_stdout:
        pytest.skip("no /dev/full here")
    prompts = [{"id": f"p{n}", "context": words(6, 5 + n), "question": "t9 t10"} for n in range(2)]
    report = tmp_path / "r.json"
    argv = ["--prompts", prompts_file(tmp_path, *prompts), *RUNS[module], "--max-new-tokens", "4"]
    argv += ["--json", str(report)]
    bench = loading_tiny(monkeypatch, tiny, module)
    stream = stdout()
    monkeypatch.setattr(sys, "stdout", stream)
    try:
        with pytest.raises(SystemExit) as done:
            bench.main(argv)
    finally:
        stream.close()
    if stdout is full_stdout:
        assert done.value.code == (
            "error: cannot write the results to stdout: No space left on device; the report was saved all the same "
            f"(as {report})"
        )
    else:
        assert done.value.code == 1  # quietly, as the CLI leaves a reader that left
    saved = json.loads(report.read_text(encoding="utf-8"))
    if module == "single":  # the whole run, not what came before the first failed print
        assert [row["id"] for row in saved["per_prompt"]] == ["p0", "p1"]


def test_without_a_report_a_failed_stdout_ends_the_run_with_one_line(tiny, tmp_path, monkeypatch):
    """No report to save: the run stops at the failed write, with one line and no traceback."""
    main = loading_tiny(monkeypatch, tiny, "single").main
    argv = ["--methods", "greedy", "--max-new-tokens", "2"]
    path = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9"})
    stream = full_stdout()
    monkeypatch.setattr(sys, "stdout", stream)
    try:
        with pytest.raises(SystemExit) as done:
            main([*argv, "--prompts", path])
    finally:
        stream.close()
    assert done.value.code == "error: cannot write the results to stdout: No space left on device"


def test_interference_refuses_long_requests_past_the_context_before_any_timed_run(tiny, monkeypatch, tmp_path, capsys):
    """Its long requests are built to --long-tokens from the passages; past the context they
    stopped the run after the short streams were measured."""
    prompts = [{"id": f"p{n}", "context": words(12, first=5 + n), "question": "t9 t10"} for n in range(3)]
    main = loading_tiny(monkeypatch, tiny, "interference").main
    argv = ["--prompts", prompts_file(tmp_path, *prompts), "--long-requests", "1", "--arrival-steps", "1"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--long-tokens", str(CONTEXT), "--long-max-new-tokens", "2"])
    assert str(done.value.code).startswith(f"error: --long-tokens {CONTEXT} built a ")
    assert done.value.code.endswith(
        f"passes the model's context ({CONTEXT}, prompt and answer together): lower --long-tokens"
    )
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit) as done:  # a short request past the context names its own option
        main([*argv, "--long-tokens", "30", "--short-max-new-tokens", str(CONTEXT)])
    assert "an answer of --short-max-new-tokens 64 does not fit; lower it to " in done.value.code
    report = main([*argv, "--long-tokens", "30", "--long-max-new-tokens", "2", "--short-max-new-tokens", "4"])
    assert all(n + 2 <= CONTEXT for n in report["long_prompt_tokens"])
    assert [row["identical"] for row in report["results"]] == ["4/4", "4/4"]  # 3 short requests and the long one


def test_a_report_written_to_a_path_takes_the_charts_it_did_not_draw_with_the_old_report(tiny, monkeypatch, tmp_path):
    """A rerun without --plot, or bench.batch's report at the path of bench's, left the earlier
    charts beside a report they did not describe; a chart name holding a user's file is left alone."""
    pytest.importorskip("matplotlib")
    from rag_lookahead.bench.plots import chart_path

    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9 t10"})
    report = tmp_path / "r.json"
    argv = ["--prompts", prompts, "--max-new-tokens", "4", "--json", str(report)]
    single = loading_tiny(monkeypatch, tiny, "single").main
    batch = loading_tiny(monkeypatch, tiny, "batch").main

    def charts():
        return sorted(p.name.removeprefix("r.") for p in tmp_path.glob("r.*.png"))

    single([*argv, "--methods", "greedy,lookahead", "--plot"])
    assert charts() == ["accepted_per_step.png", "decode_speed.png", "speedup_vs_copied.png"]
    batch([*argv, *RUNS["batch"], "--plot"])  # another benchmark's report at the path: its chart only
    assert charts() == ["concurrency.png"]
    single([*argv, "--methods", "greedy,lookahead"])  # no --plot: no chart describes this report
    assert charts() == []
    theirs = chart_path(report, "decode_speed")
    theirs.write_bytes(b"\x89PNG\r\n\x1a\n a user's picture")
    single([*argv, "--methods", "greedy"])
    assert theirs.read_bytes() == b"\x89PNG\r\n\x1a\n a user's picture"


def test_a_report_moved_to_a_free_name_takes_one_whose_charts_are_free(tiny, monkeypatch, tmp_path, capsys):
    """The report moved to r.1.json when a user's file took r.json during the run, but its charts'
    paths were never checked: a user's PNG at r.1.speedup_vs_copied.png stopped the run after the
    report and two charts were written, saying "(nothing was changed)", and that chart was lost."""
    pytest.importorskip("matplotlib")
    from rag_lookahead.output_files import is_chart

    theirs = {"r.json": b"a user's file\n", "r.1.speedup_vs_copied.png": b"\x89PNG\r\n\x1a\n a user's picture"}
    single = loading_tiny(monkeypatch, tiny, "single")

    def load_while_a_user_writes(*args, **kwargs):
        for name, data in theirs.items():
            (tmp_path / name).write_bytes(data)
        return tiny

    monkeypatch.setattr(single, "load_bench_model", load_while_a_user_writes)
    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9 t10"})
    argv = ["--prompts", prompts, "--max-new-tokens", "4", "--methods", "greedy,lookahead"]
    single.main([*argv, "--json", str(tmp_path / "r.json"), "--plot"])
    assert "r.json appeared or changed during the run, not by this command: writing " in capsys.readouterr().err
    for name, data in theirs.items():
        assert (tmp_path / name).read_bytes() == data
    charts = [tmp_path / f"r.2.{name}.png" for name in ("decode_speed", "accepted_per_step", "speedup_vs_copied")]
    assert all(is_chart(path) for path in charts) and (tmp_path / "r.2.json").is_file()


def another_run_ends_while_the_model_loads(monkeypatch, tiny, module: str, report):
    """The bench ``module``, on the tiny model, whose model load is when another run saves its
    report at ``report``."""
    from rag_lookahead.output_files import save_report

    bench = loading_tiny(monkeypatch, tiny, module)

    def load_while_another_run_ends(*args, **kwargs):
        save_report(report, {"by": "the other run"})
        return tiny

    for owner in (bench, common):
        monkeypatch.setattr(owner, "load_bench_model", load_while_another_run_ends, raising=False)
    return bench


@pytest.mark.parametrize(("module", "options"), [("single", ["--methods", "greedy"]), ("replay", [])])
def test_a_report_another_run_saved_at_the_path_meanwhile_is_kept(tiny, monkeypatch, tmp_path, capsys, module, options):
    """Two runs to one --json: the one that ended first saved its report, and the later one replaced
    it unsaid (the path was checked again at the end, but any report of ours passed). ``replay``
    checks its path in prompts_then_model, ``single`` itself."""
    from rag_lookahead.output_files import is_report, save_report

    report = tmp_path / "r.json"
    save_report(report, {"by": "an earlier run"})  # a rerun to its path is allowed
    bench = another_run_ends_while_the_model_loads(monkeypatch, tiny, module, report)
    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9 t10"})
    bench.main(["--prompts", prompts, "--max-new-tokens", "2", *options, "--json", str(report)])
    assert json.loads(report.read_text(encoding="utf-8"))["by"] == "the other run"
    assert is_report(tmp_path / "r.1.json") and "by" not in json.loads((tmp_path / "r.1.json").read_text())
    assert f"{report} appeared or changed during the run, not by this command: writing " in capsys.readouterr().err


def test_a_failed_stdout_names_where_a_moved_report_went(tiny, monkeypatch, tmp_path):
    """``> /dev/full`` while another run saved its report at the path: this run's report went to
    r.1.json, and the last line said it was saved "(--json r.json)", where the other run's report was."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    report = tmp_path / "r.json"
    bench = another_run_ends_while_the_model_loads(monkeypatch, tiny, "single", report)
    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9 t10"})
    stream = full_stdout()
    monkeypatch.setattr(sys, "stdout", stream)
    try:
        with pytest.raises(SystemExit) as done:
            bench.main(["--prompts", prompts, "--max-new-tokens", "2", "--methods", "greedy", "--json", str(report)])
    finally:
        stream.close()
    assert str(done.value.code).endswith(f"the report was saved all the same (as {tmp_path / 'r.1.json'})")
    assert json.loads(report.read_text(encoding="utf-8"))["by"] == "the other run"


def test_a_chart_path_taken_after_the_report_is_saved_is_said_truthfully(tmp_path):
    """Something takes a chart's path between the report's save and the drawing: the error said
    "(nothing was changed)" with the report and the charts before it written."""
    pytest.importorskip("matplotlib")
    from rag_lookahead.bench import plots
    from rag_lookahead.errors import ConfigError
    from tests.unit.test_bench_plots import PNG_SIGNATURE, single_report

    json_path = tmp_path / "r.json"
    theirs = plots.chart_path(json_path, "speedup_vs_copied")

    def draw_as_a_user_writes(report, path):
        theirs.write_bytes(PNG_SIGNATURE + b"a user's picture")
        return plots.plot_single(report, path)

    with pytest.raises(ConfigError) as refused:
        common.write_report(json_path, single_report(), draw_as_a_user_writes, seen=None)
    assert str(refused.value) == (
        f"{theirs} appeared during the run and this command did not write it: it was left as it is and no chart "
        f"was drawn; the report is saved as {json_path}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.speedup_vs_copied.png"]
    assert theirs.read_bytes() == PNG_SIGNATURE + b"a user's picture"


def test_quality_pools_mean_accepted_records_the_dtype_that_ran_and_prints_json_lines(monkeypatch, tmp_path, capsys):
    """Its "mean accepted" averaged each answer's own ratio, a 1-token answer counted 0 (bench and
    bench.rag pool it); its report's "dtype" said "auto", not what ran; its per-question rows went to
    stdout as Python dicts (``default: {'model': ...}``) where bench, bench.batch and bench.rag print
    JSON lines."""
    roomy = build_tiny_model("qwen2", max_positions=512), tiny_tokenizer()  # the RAG prompts are longer than 64
    quality = loading_tiny(monkeypatch, roomy, "quality")
    rows = [  # 1 token (no decode forward), then 41 tokens in 10 forwards: 40 / 10 pooled
        {"grounded": True, "key terms": "1/1", "new tokens": 1, "gold retrieved": True, "decode tok/s": 0.0,
         "mean accepted": 0.0, "decode forwards": 0},
        {"grounded": True, "key terms": "1/1", "new tokens": 41, "gold retrieved": True, "decode tok/s": 10.0,
         "mean accepted": 4.0, "decode forwards": 10},
    ]  # fmt: skip
    assert quality.summarize(rows)["mean accepted"] == 4.0
    report = quality.main(["--models", "default", "--max-new-tokens", "3", "--json", str(tmp_path / "q.json")])
    assert report["dtype"] == "fp32 (auto)" == report["summary"]["default"]["dtype"]
    assert all(row["decode forwards"] >= 1 for row in report["questions"])  # tiny's answers run to 3 tokens
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("{", "default:"))]
    assert [json.loads(line) for line in printed] == report["questions"]
    chinese = next(row["question"] for row in report["questions"] if not row["question"].isascii())
    assert any(chinese in line for line in printed)  # as is, not \u escapes


def test_batch_prints_json_lines_and_writes_null_where_a_figure_is_missing(tiny, monkeypatch, tmp_path, capsys):
    """Its rows went to stdout as Python dict reprs (bench prints JSON lines), and its JSON said "-"
    for transformers' mean accepted and for the reference's identity where bench writes null."""
    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9 t10"})
    batch = loading_tiny(monkeypatch, tiny, "batch").main
    batch(["--prompts", prompts, "--max-new-tokens", "4", *RUNS["batch"], "--json", str(tmp_path / "b.json")])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    saved = json.loads((tmp_path / "b.json").read_text(encoding="utf-8"))["results"]
    assert [row["method"] for row in printed] == [row["method"] for row in saved] == ["hf_greedy", "lookahead"]
    hf, ours = saved
    assert hf["mean_accepted"] is None and hf["identical_to_single"] is None  # the reference: not itself
    assert ours["mean_accepted"] >= 1 and ours["identical_to_single"] == "2/2"


def test_sampling_runs_at_the_temperature_asked_not_the_one_its_name_rounds_to(tiny, monkeypatch, tmp_path):
    """``--temperatures 0.123456789`` sampled at 0.123457, the temperature read back from the
    method's name (``lookahead_sample_t0.123457``), while the report recorded 0.123456789."""
    import inspect

    single = loading_tiny(monkeypatch, tiny, "single")
    sampled_at = []
    for name in ("run_hf", "run_lookahead"):  # the real runs, noting the sampling options each was given
        real = getattr(single, name)

        def noting(*args, real=real, **kwargs):
            sampling = inspect.signature(real).bind(*args, **kwargs).arguments.get("sampling")
            sampled_at.append(sampling and sampling["temperature"])
            return real(*args, **kwargs)

        monkeypatch.setattr(single, name, noting)
    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9 t10"})
    methods = "sample,prompt_lookup_sample,lookahead_sample"
    argv = ["--prompts", prompts, "--max-new-tokens", "4", "--methods", methods, "--temperatures", "0.123456789"]
    report = single.main(argv)
    assert len(sampled_at) == 6 and set(sampled_at) == {0.123456789}  # warm-up and timed run, three methods
    assert report["sampling"]["temperatures"] == [0.123456789]
    assert list(report["summary"]) == [
        "sample_t0.123457",
        "prompt_lookup_sample_t0.123457",
        "lookahead_sample_t0.123457",
    ]
    assert report["summary"]["lookahead_sample_t0.123457"]["identical_to_greedy"] == "1/1"  # against sample_t0.123457


def test_rag_prints_json_lines(monkeypatch, capsys, shared_embedder, bundled_index_dir):
    """bench.rag printed its per-question rows as Python dicts (``{'question': ...}``), where bench,
    bench.batch and bench.session print JSON lines."""
    roomy = build_tiny_model("qwen2", max_positions=512), tiny_tokenizer()  # the RAG prompts are longer than 64
    rag = loading_tiny(monkeypatch, roomy, "rag")
    report = rag.main(["--max-new-tokens", "3", "--index-dir", str(bundled_index_dir)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in lines] == report["questions"]
    assert lines[0].startswith('{"question": "decoding_length 应该怎么设置？"')  # as written, not \u-escaped


def report_printed(out: str) -> dict:
    """The report a benchmark printed on stdout after its tables (``json.dumps(..., indent=2)``)."""
    return json.loads(out[out.rindex("\n{\n") + 1 :])


def test_a_report_the_disk_cannot_take_is_one_line_and_goes_to_stdout(tiny, tmp_path, monkeypatch, capsys):
    """On a full disk the report's write ended the run in a 40-line OSError traceback, and the
    report, all the run was for, was lost. The kernel refuses the write here as on a full disk."""
    main = loading_tiny(monkeypatch, tiny, "single").main
    report = tmp_path / "r.json"
    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9"})
    argv = ["--prompts", prompts, "--methods", "greedy", "--max-new-tokens", "2", "--json", str(report)]
    with files_limited_to(0), pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == f"error: cannot write {report}: File too large; the report went to stdout instead"
    printed = report_printed(capsys.readouterr().out)
    assert [row["id"] for row in printed["per_prompt"]] == ["a"] and printed["written_by"] == "rag_lookahead.bench"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]  # nor a temporary file left


def test_a_report_printed_in_its_place_is_utf8_whatever_stdout_encodes(tmp_path, monkeypatch, capsys):
    """Through a Latin-1 stdout (LANG=de_DE.ISO-8859-1) a report holding Chinese could not be
    encoded and was said lost; it is printed in UTF-8, as the file would have held it, after a line
    on stderr saying it follows (it comes after the run's tables and JSON rows)."""
    import io

    from rag_lookahead.errors import RagLookaheadError
    from rag_lookahead.output_files import save_or_print

    raw = io.BytesIO()
    latin = io.TextIOWrapper(raw, encoding="latin-1")
    monkeypatch.setattr(sys, "stdout", latin)
    print("a table row printed before")
    text = json.dumps({"question": "借款合同的月利率是多少？"}, ensure_ascii=False) + "\n"
    with files_limited_to(0), pytest.raises(RagLookaheadError, match="the report went to stdout instead"):
        save_or_print(tmp_path / "r.json", text, "the report")
    assert raw.getvalue().decode("utf-8") == "a table row printed before\n" + text
    assert "printing the report on stdout instead" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_report_neither_the_disk_nor_stdout_takes_is_said_lost(tiny, tmp_path, monkeypatch):
    """``> /dev/full`` as well: the line must not claim the report was printed."""
    main = loading_tiny(monkeypatch, tiny, "single").main
    report = tmp_path / "r.json"
    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9"})
    argv = ["--prompts", prompts, "--methods", "greedy", "--max-new-tokens", "2", "--json", str(report)]
    stream = full_stdout()
    monkeypatch.setattr(sys, "stdout", stream)
    try:
        with files_limited_to(0), pytest.raises(SystemExit) as done:
            main(argv)
    finally:
        stream.close()
    assert (
        done.value.code
        == f"error: cannot write {report}: File too large; stdout could not take the report either: lost"
    )


def test_a_chart_the_disk_cannot_take_is_one_line_naming_it_and_the_saved_report(tiny, tmp_path, monkeypatch):
    """``--plot`` on a disk with room for the report (a few KB) but not for a chart (tens of KB):
    the chart's write was a traceback too."""
    pytest.importorskip("matplotlib")
    main = loading_tiny(monkeypatch, tiny, "single").main
    report = tmp_path / "r.json"
    prompts = prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9"})
    argv = ["--prompts", prompts, "--methods", "greedy", "--max-new-tokens", "2", "--json", str(report), "--plot"]
    room = 12_000
    with files_limited_to(room), pytest.raises(SystemExit) as done:
        main(argv)
    chart = tmp_path / "r.decode_speed.png"  # the first chart drawn
    assert done.value.code == (
        f"error: cannot write {chart}: File too large; the report is saved (as {report}), its charts are not"
    )
    assert json.loads(report.read_text(encoding="utf-8"))["per_prompt"][0]["id"] == "a"
    assert report.stat().st_size < room and sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "r.json"]


def test_a_tilde_in_the_report_and_prompts_paths_is_the_home_folder(tiny, tmp_path, monkeypatch):
    """``--json=~/r.json`` (the shell expands no ``~`` after "=") was refused ("its folder '~' does
    not exist") where ``--index-dir``, the corpus and ``--model`` take it; ``--prompts ~/p.jsonl``
    "does not exist"."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("HOME", str(tmp_path))
    main = loading_tiny(monkeypatch, tiny, "single").main
    prompts_file(tmp_path, {"id": "a", "context": words(6), "question": "t9"})
    argv = ["--prompts", "~/prompts.jsonl", "--methods", "greedy", "--max-new-tokens", "2"]
    main([*argv, "--json", "~/r.json", "--plot"])
    assert json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["per_prompt"][0]["id"] == "a"
    assert (tmp_path / "r.decode_speed.png").is_file()
    with pytest.raises(SystemExit) as done:  # the run's own input, named two ways, is still refused
        main([*argv, "--json", str(tmp_path / "prompts.jsonl")])
    assert "is this run's input" in done.value.code


def test_prompts_names_a_shipped_set_from_any_folder(monkeypatch, tmp_path):
    """``--prompts rag_lookahead/data/realistic/bench_en.jsonl``, as the README wrote it, worked only
    in a checkout of the repository; from anywhere else (an installed wheel) it was "cannot read the
    prompts file". The sets' names work from any folder, as ``bench.retrieval --dataset`` takes them,
    and a report named like a set is no clash with the run's input (the set is no file of its)."""
    monkeypatch.chdir(tmp_path)
    roomy = build_tiny_model("qwen2", max_positions=512), tiny_tokenizer()  # the realistic prompts are longer than 64
    main = loading_tiny(monkeypatch, roomy, "single").main
    argv = ["--prompts", "realistic-en", "--limit", "2", "--methods", "greedy", "--max-new-tokens", "2"]
    report = main([*argv, "--json", "r.json"])
    assert [row["id"] for row in report["per_prompt"]] == ["en-squad2-150", "en-squad2-154"]
    main([*argv, "--json", "realistic-en"])
    saved = json.loads((tmp_path / "realistic-en").read_text(encoding="utf-8"))
    assert [row["id"] for row in saved["per_prompt"]] == ["en-squad2-150", "en-squad2-154"]
