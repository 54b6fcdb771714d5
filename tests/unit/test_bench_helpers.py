"""The benchmarks' pure helpers (the benchmarks themselves are run by hand, not timed in tests)."""

from types import SimpleNamespace

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st

from rag_lookahead.bench.common import copied_fraction, cut_at_eos
from rag_lookahead.bench.methods import MethodTotals, Run, summarize

tokens = st.lists(st.integers(0, 20), min_size=0, max_size=60)


@given(tokens)
def test_an_answer_quoting_its_whole_source_is_fully_copied(source):
    assert copied_fraction(source, source) == (1.0 if len(source) >= 4 else 0.0)


@given(tokens, tokens)
def test_copied_fraction_counts_only_runs_found_in_the_source(answer, source):
    shifted = [t + 100 for t in answer]  # no token in common with the source
    assert copied_fraction(shifted, source) == 0.0
    value = copied_fraction(answer + source, source)
    assert 0.0 <= value <= 1.0
    if len(source) >= 4:
        assert value >= len(source) / (len(answer) + len(source))


def test_copied_fraction_example():
    source = [1, 2, 3, 4, 5, 6]
    assert copied_fraction([9, 1, 2, 3, 4, 9, 9, 9], source) == 0.5  # tokens 1..4 of 8
    assert copied_fraction([1, 2, 3, 9, 4, 5, 6, 9], source) == 0.0  # runs of 3 are too short


def test_cut_at_eos_keeps_the_eos_and_drops_padding():
    assert cut_at_eos([5, 6, 2, 2, 2], {2}) == [5, 6, 2]
    assert cut_at_eos([5, 6], {2}) == [5, 6]


def test_summary_ratios_are_decode_speeds_over_greedy_and_over_prompt_lookup():
    def totals(*runs):
        t = MethodTotals()
        for tokens, seconds, first in runs:
            t.add(Run(list(range(tokens)), seconds, first), identical=True)
        return t

    # decode: 100 tokens in 10 s (greedy), in 4 s (lookup), in 2 s (ours, two prompts summed)
    summary = summarize(
        {
            "greedy": totals((101, 11.0, 1.0)),
            "prompt_lookup": totals((101, 5.0, 1.0)),
            "prompt_lookup_stock": totals((101, 6.0, 1.0)),  # transformers on stock kernels: 5 s
            "lookahead": totals((51, 2.0, 1.0), (51, 2.0, 1.0)),
        }
    )
    assert summary["lookahead"]["speedup_decode"] == 5.0
    # end to end the prefill counts too: 102 tokens in 4 s over greedy's 101 in 11 s, not the 5x of decode
    assert summary["lookahead"]["speedup_e2e"] == round((102 / 4.0) / (101 / 11.0), 3)
    assert summary["lookahead"]["vs_prompt_lookup_decode"] == 2.0
    assert summary["lookahead"]["vs_prompt_lookup_stock_decode"] == 2.5
    assert summary["prompt_lookup"]["speedup_decode"] == 2.5
    assert summary["greedy"]["vs_prompt_lookup_decode"] == 0.4
    alone = summarize({"lookahead": totals((11, 2.0, 1.0)), "greedy": MethodTotals()})  # greedy never ran
    assert list(alone) == ["lookahead"] and alone["lookahead"]["speedup_decode"] is None


def test_sampling_methods_are_compared_with_transformers_sampling_at_their_temperature():
    from rag_lookahead.bench.methods import baselines, sampling_method

    assert sampling_method("lookahead_sample_t0.7") == ("lookahead_sample", 0.7)
    assert sampling_method("prompt_lookup_sample_t1") == ("prompt_lookup_sample", 1.0)
    assert sampling_method("lookahead") is None
    assert baselines("lookahead_sample_t0.3") == ("sample_t0.3", "prompt_lookup_sample_t0.3")
    assert baselines("lookahead") == ("greedy", "prompt_lookup")
    fast, slow = MethodTotals(), MethodTotals()
    fast.add(Run(list(range(11)), 1.0, 0.0), True)
    slow.add(Run(list(range(11)), 2.0, 0.0), True)
    summary = summarize({"sample_t0.7": slow, "lookahead_sample_t0.7": fast, "prompt_lookup_stock": slow})
    assert summary["lookahead_sample_t0.7"]["speedup_decode"] == 2.0
    # the stock baseline is greedy prompt lookup: a sampling method was "2x" over it
    assert summary["lookahead_sample_t0.7"]["vs_prompt_lookup_stock_decode"] is None


def test_batch_speedups_over_transformers_on_the_layout_and_on_stock_kernels():
    from rag_lookahead.bench.batch import STOCK_METHOD, add_speedups, parse_methods

    rows = [
        {"pass": 0, "concurrency": 4, "method": method, "tokens_per_second": tps}
        for method, tps in ((STOCK_METHOD, 10.0), ("hf_greedy", 20.0), ("lookahead", 30.0))
    ]
    add_speedups(rows)
    ours = rows[-1]
    assert ours["speedup_vs_hf"] == 1.5 and ours["speedup_vs_hf_stock"] == 3.0
    # each pass over its own pass's transformers at that level, not the first pass's
    two = [
        {"pass": p, "concurrency": 4, "method": m, "tokens_per_second": tps}
        for p, m, tps in (
            (0, "hf_greedy", 10.0),
            (0, "lookahead", 20.0),
            (1, "hf_greedy", 20.0),
            (1, "lookahead", 30.0),
        )
    ]
    add_speedups(two)
    assert [r["speedup_vs_hf"] for r in two] == [1.0, 2.0, 1.0, 1.5]
    assert parse_methods(f"{STOCK_METHOD},lookahead", "", 48)[0] == [STOCK_METHOD, "lookahead"]
    with pytest.raises(typer.BadParameter, match=STOCK_METHOD):  # named among the choices
        parse_methods("nonsense", "", 48)


# ---------------------------------------------------------------- --prompts files

SURROGATE = "line {line} holds '{char}', an unpaired UTF-16 surrogate, which is no character"
ID_LINES = '{{"id": {a}, "context": "p", "question": "q"}}\n{{"id": {b}, "context": "p2", "question": "q2"}}\n'


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_prompts_file_is_read_with_ids_for_lines_without_one(tmp_path):
    from rag_lookahead.bench.common import load_prompts

    text = (
        '{"id": "a", "context": "p", "question": "q"}\n\n{"context": "", "question": "only a question", "x": 1}\n'
        '{"passage": "from a retrieval set", "question": "q2"}\n'
    )
    prompts = load_prompts(_write(tmp_path, "ok.jsonl", text))
    assert [p["id"] for p in prompts] == ["a", "line-3", "line-4"]
    assert prompts[2]["context"] == "from a retrieval set"
    assert prompts[1]["question"] == "only a question" and prompts[1]["x"] == 1
    assert [p["id"] for p in load_prompts(_write(tmp_path, "ok2.jsonl", text), "line-3")] == ["line-3"]
    numbered = load_prompts(_write(tmp_path, "ok3.jsonl", ID_LINES.format(a="1", b="2")))  # as files had them
    assert [p["id"] for p in numbered] == ["1", "2"]
    deep = '{"context": "p", "question": "q", "notes": ' + "[" * 500 + "]" * 500 + "}\n"
    assert load_prompts(_write(tmp_path, "deep.jsonl", deep))[0]["question"] == "q"  # no recursion error


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"context": "p", "question": "q"}\n{broken\n', "line 2 is not JSON"),
        ("[1, 2]\n", "line 1 is not a JSON object"),
        ('{"text": "p", "question": "q"}\n', "line 1 needs 'context' as a string (its keys: question, text)"),
        ('{"context": "p", "question": "  "}\n', "line 1 needs 'question' as a non-empty string"),
        ('{"context": 3, "question": "q"}\n', "line 1 needs 'context'"),
        ("\n \n", "no prompts"),
        # an escaped unpaired surrogate: the run died printing or saving it, after the model loaded
        (r'{"id": "\ud800", "context": "p", "question": "q"}' "\n", SURROGATE.format(line=1, char=r"\ud800")),
        (
            '{"context": "p", "question": "q"}\n' r'{"context": "p", "question": "what \udfff is"}',
            SURROGATE.format(line=2, char=r"\udfff"),
        ),
        (r'{"context": "a \ud83d b", "question": "q"}' "\n", SURROGATE.format(line=1, char=r"\ud83d")),
        (r'{"context": "p", "question": "q", "notes": ["\ud800"]}' "\n", SURROGATE.format(line=1, char=r"\ud800")),
        # ids: reports and charts group by id, so two prompts under one id were merged
        (ID_LINES.format(a='"a"', b='"a"'), "line 2: the prompt id 'a' is line 1's too"),
        (ID_LINES.format(a="1", b='"1"'), "line 2: the prompt id '1' is line 1's too"),
        (ID_LINES.format(a='{"k": 1}', b='"b"'), 'line 1: the id must be a string or an integer, not {"k": 1}'),
        (ID_LINES.format(a="true", b='"b"'), "line 1: the id must be a string or an integer, not true"),
        # a given id and the line-N name of a line without one, either way round
        (ID_LINES.format(a="null", b='"line-1"'), "line 2: the prompt id 'line-1' is line 1's too"),
        (
            '{"id": "line-2", "context": "p", "question": "q"}\n{"context": "p", "question": "q"}\n',
            "line 2: the prompt id 'line-2' is line 1's too",
        ),
        # ids --ids can never name (it splits at commas and trims): such a prompt ran only with all the others
        (ID_LINES.format(a='"a"', b='"a,b"'), "line 2: the prompt id 'a,b' could never be chosen with --ids"),
        (ID_LINES.format(a='" c"', b='"b"'), "line 1: the prompt id ' c' could never be chosen with --ids"),
        (ID_LINES.format(a='"c\\t"', b='"b"'), "line 1: the prompt id 'c\\t' could never be chosen with --ids"),
        (ID_LINES.format(a='""', b='"b"'), "line 1: the prompt id '' could never be chosen with --ids (ids separated"),
        (ID_LINES.format(a='"a\\u0000b"', b='"b"'), "line 1: the prompt id 'a\\x00b' could never be chosen with --ids"),
    ],
)
def test_a_bad_prompts_file_names_its_first_bad_line(tmp_path, text, message):
    from rag_lookahead.bench.common import load_prompts
    from rag_lookahead.errors import InputError

    with pytest.raises(InputError, match="bad.jsonl") as caught:
        load_prompts(_write(tmp_path, "bad.jsonl", text))
    assert message in str(caught.value)


def test_unreadable_prompts_and_unknown_ids_are_input_errors(tmp_path):
    from rag_lookahead.bench.common import load_prompts
    from rag_lookahead.errors import ConfigError, InputError

    with pytest.raises(InputError, match="cannot read the prompts file"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "latin1.jsonl").write_bytes('{"context": "caf\xe9", "question": "q"}\n'.encode("latin-1"))
    with pytest.raises(InputError, match="cannot read the prompts file"):
        load_prompts(str(tmp_path / "latin1.jsonl"))
    with pytest.raises(InputError, match="unknown prompt ids: nope"):
        load_prompts(None, "nope")
    for empty in ("", " "):  # ran the bundled set as if no file had been named
        with pytest.raises(ConfigError, match=rf"^--prompts {empty!r} is empty \(an unset variable\?\)"):
            load_prompts(empty)


def test_a_paired_surrogate_escape_is_one_character():
    from rag_lookahead.bench.common import jsonl_object

    assert jsonl_object(r'{"q": "\ud83d\ude00"}', "x: line 1", "q") == {"q": "\U0001f600"}


BAD_FILES = [  # (a --prompts file, the error after the path)
    ('{"context": "p"}\n', "line 1 needs 'question' as a non-empty string (its keys: context)"),
    (
        '{"id": "ok", "context": "c", "question": "q"}\n' r'{"id": "s", "context": "c", "question": "what \ud800 is"}',
        "line 2 holds '\\ud800', an unpaired UTF-16 surrogate, which is no character (write the character itself,"
        " or both halves of its pair)",
    ),
    (
        ID_LINES.format(a='"a"', b='"a"'),
        "line 2: the prompt id 'a' is line 1's too (a line without an id is named line-N); give each prompt an id "
        "of its own",
    ),
    (  # a RecursionError's traceback
        '{"context": "c", "question": "q", "e": ' + "[" * 3000 + "]" * 3000 + "}\n",
        "line 1 is nested too deeply to read (context, question)",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES, ids=["no question", "surrogate", "id twice", "deep"])
@pytest.mark.parametrize("module", ["single", "batch", "step_profile", "replay"])
def test_a_bad_prompts_file_stops_a_benchmark_with_one_line_before_the_model_loads(
    tmp_path, monkeypatch, module, text, message
):
    """The real entry points: the error is one line (exit 1), and no model was asked for."""
    import importlib

    from rag_lookahead.bench import common

    bench = importlib.import_module(f"rag_lookahead.bench.{module}")
    loads = []
    for owner in (bench, common):  # a benchmark loads the model itself or through common's helper
        monkeypatch.setattr(owner, "load_bench_model", lambda *a, **k: loads.append(a), raising=False)
    path = _write(tmp_path, "bad.jsonl", text)
    with pytest.raises(SystemExit) as done:
        bench.main(["--prompts", path])
    assert done.value.code == f"error: {path}: {message}"
    assert loads == []  # the file was checked first


def test_reports_say_whether_the_drafts_were_trees_or_single_chains():
    """A GPU run whose probe failed drafted chains without a word in the tables (2026-12-04)."""
    from tiny_models import build_tiny_model

    from rag_lookahead.bench.common import chains_note, draft_shape
    from rag_lookahead.decoding.profile import profile_of
    from rag_lookahead.decoding.verify import supports_tree_mask

    model = build_tiny_model("qwen2", seed=21)
    assert draft_shape(model) == "not probed" and chains_note("not probed") == ""
    assert supports_tree_mask(model) and draft_shape(model) == "trees" and chains_note("trees") == ""
    profile = profile_of(model)
    profile.tree_mask, profile.tree_mask_reason = (
        False,
        "attention ignores the tree mask (relative logit error 0.051 > 0.05)",
    )
    shape = draft_shape(model)
    assert shape == "single chains (attention ignores the tree mask (relative logit error 0.051 > 0.05))"
    assert chains_note(shape) == f", drafts: {shape}"


def test_reports_name_the_dtype_that_ran():
    """A report said "auto" where the loader chose: bf16 only on CPUs with AMX, so the figures' dtype was unknown."""
    import torch
    from tiny_models import build_tiny_model

    from rag_lookahead.bench.common import dtype_label

    model = build_tiny_model("qwen2", seed=21)
    assert dtype_label(model, "auto") == "fp32 (auto)" and dtype_label(model, "fp32") == "fp32"
    assert dtype_label(model.to(torch.bfloat16), "bf16") == "bf16"


def test_a_control_starts_from_the_learned_rates_and_leaves_them():
    """bench.session's empty-pool control ran from a new process's prior, so its column mixed
    the pool's effect with the rates'; it now starts from the session's rates and puts them back."""
    from tiny_models import build_tiny_model

    from rag_lookahead.bench.common import fresh_acceptance
    from rag_lookahead.decoding.acceptance import AcceptanceRates
    from rag_lookahead.decoding.profile import profile_of

    model = build_tiny_model("qwen2", seed=21)
    met = profile_of(model).drafts_met
    met["trie"] = AcceptanceRates()
    learned = repr(met["trie"])
    with fresh_acceptance(model, clear=False):
        assert repr(met["trie"]) == learned
        met["trie"] = AcceptanceRates(AcceptanceRates(), decay=0.1)  # what the control learns
        met["other"] = AcceptanceRates()
    assert list(met) == ["trie"] and repr(met["trie"]) == learned
    with fresh_acceptance(model):
        assert not met
    assert repr(met["trie"]) == learned


def test_a_wide_table_prints_its_names_whole(capsys):
    """At a fixed 160 columns bench.batch's table cut its names: "hf_greedy_s…", and two columns
    both read "speedup_vs_…" (``speedup_vs_hf`` and ``speedup_vs_hf_stock``)."""
    from rag_lookahead.bench.common import print_rows

    row = {"method": "hf_greedy_stock", "speedup_vs_hf": 1.2, "speedup_vs_hf_stock": 1.5}
    row |= {f"a_long_column_name_{i}": i for i in range(9)}
    print_rows("batch", [row])
    printed = capsys.readouterr().out
    assert "…" not in printed
    assert all(name in printed for name in row) and "hf_greedy_stock" in printed


def _methods_help(command) -> str:
    """The --methods help line of a benchmark's --help, as printed (one line: no wrapping at 5000 columns)."""
    import io
    from contextlib import redirect_stdout

    from rag_lookahead.bench.common import run_command

    printed = io.StringIO()
    with redirect_stdout(printed), pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", "5000")
        assert run_command(command, ["--help"], "bench") == 0
    return next(line for line in printed.getvalue().splitlines() if "--methods " in line)


def test_the_help_of_bench_and_bench_batch_lists_every_method_they_take():
    """bench's --methods help left out sample, prompt_lookup_sample and lookahead_sample; bench.batch's
    listed no method (only its error named them)."""
    import re

    from rag_lookahead.bench import batch, methods, single

    names = {*methods.METHODS, *methods.SAMPLING_METHODS, *methods.STOCK_METHODS, *batch.BASE_METHODS}
    names.add(batch.STOCK_METHOD)

    def taken(check, name: str) -> bool:
        try:
            check(name)
        except typer.BadParameter:
            return False
        return True

    for command, check, expected in (
        (single.bench, lambda m: single.expand_methods(m, "0.7", {}, 48), {"sample", "lookahead_sample"}),
        (batch.batch, lambda m: batch.parse_methods(m, "", 48), {"hf_greedy_stock", "plain"}),
    ):
        accepted = {name for name in names if taken(check, name)}
        assert expected <= accepted
        listed = set(re.findall(r"[a-z_]+", _methods_help(command)))
        assert accepted <= listed, sorted(accepted - listed)


class FixedLatencies:
    """A batch workload whose requests took the given seconds, by default 1..20 s (the run is not what is checked)."""

    def __init__(self, latencies=tuple(range(20, 0, -1))):
        self.latencies = [float(s) for s in latencies]
        self.requests = list(range(len(self.latencies)))

    def run(self, method, level):
        return [[1]] * len(self.latencies), self.latencies, None


def test_p95_is_the_nearest_rank(capsys):
    """bench.batch, bench.interference and gpu-check took ``sorted[int(0.95 * n)]``: one rank too
    high where 0.95 * n is whole, p95 of 1..20 s was 20 s (the slowest), not 19."""
    from rag_lookahead.bench.batch import timed_run
    from rag_lookahead.bench.interference import Trace, summary

    row, _ = timed_run(FixedLatencies(), "hf_greedy", 1, 0)
    assert row["p95_latency_s"] == 19.0
    assert row["p50_latency_s"] == 10.5  # the median of 1..20 s, whatever order they came in
    skewed, _ = timed_run(FixedLatencies([10, 1, 1]), "hf_greedy", 1, 0)
    assert (skewed["p50_latency_s"], skewed["p95_latency_s"]) == (1.0, 10.0)  # a median, not the mean (4.0)
    assert summary("one forward", 0, Trace(gaps=[s / 1e3 for s in range(1, 21)]))["p95_itl_ms"] == 19.0
    from rag_lookahead.bench.percentile import nearest_rank  # the one rule they share

    assert nearest_rank(range(1, 21), 0.95) == 19 and nearest_rank(range(1, 22), 0.95) == 20
    assert nearest_rank([5.0], 0.95) == 5.0 and nearest_rank(range(1, 101), 0.95) == 95
    assert nearest_rank(range(1, 101), 0.07) == 7  # 0.07 * 100 is 7.000000000000001: ceil alone gave 8
    with pytest.raises(ValueError):
        nearest_rank([], 0.95)
    with pytest.raises(ValueError):  # no rank holds a share of none of them
        nearest_rank([1, 2, 3], 0)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=200), st.sampled_from([0.5, 0.9, 0.95, 0.99, 1.0]))
def test_the_nearest_rank_is_the_smallest_value_that_share_of_them_do_not_exceed(values, share):
    from rag_lookahead.bench.percentile import nearest_rank

    p = nearest_rank(values, share)
    assert p in values
    assert sum(v <= p for v in values) >= share * len(values) - 1e-9
    assert sum(v < p for v in values) < share * len(values) - 1e-9


def test_a_wave_of_transformers_requests_all_wait_for_the_whole_wave(monkeypatch):
    """Each row of a padded batch comes back when the batch does: its latency is the wave's time."""
    from rag_lookahead.bench import batch

    ticks = iter(range(100))  # each wave takes 1 s on this clock
    monkeypatch.setattr(batch, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(batch, "hf_batched", lambda model, rows, *args: [[1]] * len(rows))
    outputs, latencies, accepted = batch.run_hf_waves(None, [[1]] * 6, 4, 8, [], 0)
    assert len(outputs) == 6 and accepted is None
    assert latencies == [1.0] * 6  # waves of 4 and of 2 rows


def test_batch_mean_accepted_is_none_where_no_decode_step_ran():
    """With one new token the prefill gives the whole answer: no step ran, so there is no mean
    accepted (the table's "-"), not 0.0 tokens a step."""
    from tiny_models import tiny_model

    from rag_lookahead.bench.batch import run_continuous
    from rag_lookahead.decoding.config import LookaheadConfig

    model, requests = tiny_model("qwen2"), [[5, 6, 7, 8, 9] * 4, [3, 4, 3, 4, 3]]
    outputs, latencies, accepted = run_continuous(model, requests, 2, 1, [], 0, LookaheadConfig())
    assert [len(o) for o in outputs] == [1, 1] and len(latencies) == 2
    assert accepted is None
    outputs, _, accepted = run_continuous(model, requests, 2, 6, [], 0, LookaheadConfig())
    assert accepted is not None and accepted >= 1.0


def test_the_single_reference_is_transformers_greedy_at_concurrency_one():
    from rag_lookahead.bench.batch import single_reference

    rows = [{"method": "hf_greedy", "concurrency": 4}, {"method": "lookahead", "concurrency": 1}]
    assert single_reference(rows + [{"method": "hf_greedy", "concurrency": 1}]) == 2
    assert single_reference(rows) is None


def test_decode_figures_leave_out_the_tokens_of_the_first_forward(monkeypatch):
    """The first answer token comes with the prefill (several, where the first forward accepted
    drafts): decode tok/s counts the tokens after them over the time after them."""
    from rag_lookahead.bench.common import decode_speed, peak_rss_gb, times

    totals = MethodTotals()
    totals.add(Run(list(range(11)), 2.0, 1.0, first_tokens=3), None)
    assert totals.decode_tokens_per_second == 8.0  # 8 tokens after the first forward's 3, in 1 s
    assert decode_speed([{"new_tokens": 11, "decode_seconds": 1.0}, {"new_tokens": 1}]) == 10.0
    assert times(0.0) == "-" and times(None) == "-" and times(1.5) == "1.50x"  # 0: its baseline measured 0
    from rag_lookahead.bench import common

    monkeypatch.setattr(common.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=2**20))  # KiB
    assert peak_rss_gb() == 1.0


def _row_runner(threshold):
    context = [5, 6, 7, 8, 9]
    return SimpleNamespace(
        eos=[2], context_ids=lambda prompt: context, settings=SimpleNamespace(copying_threshold=threshold)
    )


def test_a_prompt_row_counts_decode_tokens_as_the_totals_do_and_a_copy_at_the_threshold_as_copying():
    import torch

    from rag_lookahead.bench.single import Measured, build_report, prompt_row

    methods = ["greedy", "prompt_lookup"]
    measured = Measured({m: MethodTotals() for m in methods}, {m: MethodTotals() for m in methods}, [])
    runs = {"greedy": Run([5, 6, 7, 8, 9], 2.0, 1.0), "prompt_lookup": Run([5, 6, 7, 8, 9], 1.5, 1.0, first_tokens=3)}
    row = prompt_row(_row_runner(1.0), {"id": "p"}, 0, runs, measured)  # the answer copies all of the context
    assert row["copied_from_context"] == 1.0
    assert row["prompt_lookup"]["decode_tokens_per_second"] == 4.0  # 2 tokens after the first 3, in 0.5 s
    assert measured.copying["greedy"].runs == 1 and measured.copying["prompt_lookup"].runs == 1

    class Model:
        dtype, device = torch.float32, "cpu"

    settings = SimpleNamespace(
        model="m", dtype="fp32", repeats=1, max_new_tokens=4, seed_mode="prompt", temperatures=(), top_p=0.9,
        seed=0, copying_threshold=0.8,
    )  # fmt: skip
    config = SimpleNamespace(decoding_length=64, branch_length=48, budget="auto")
    copied = Measured({}, {}, [{"copied_from_context": 0.8}, {"copied_from_context": 0.5}])
    assert build_report(settings, Model(), config, [{}, {}], copied)["copying_runs"] == 1


def test_each_pass_turns_the_methods_order_and_samples_from_its_own_seed(monkeypatch, capsys):
    import torch

    from rag_lookahead.bench import single

    order, passes = [], []

    class Runner:
        settings = SimpleNamespace(repeats=2, copying_threshold=0.8)
        prompts = [{"id": "a"}, {"id": "b"}]
        eos = [2]

        def new_pass(self):  # lookahead_warm's pool, emptied before each pass
            passes.append(len(order))

        def context_ids(self, prompt):
            return [1]

        def run(self, method, prompt, repeat=-1):
            if repeat >= 0:  # not the warm-up
                order.append((repeat, prompt["id"], method))
            return Run([1, 2], 1.0, 0.5)

    single.measure(Runner(), ["greedy", "lookahead"])
    first = {(repeat, pid): m for repeat, pid, m in order[::2]}
    assert first[(0, "a")] != first[(1, "a")] and first[(0, "b")] != first[(1, "b")]
    assert passes == [0, 4]  # a new pool at the start of each pass of 2 prompts x 2 methods

    seeds = []
    monkeypatch.setattr(torch, "manual_seed", seeds.append)
    monkeypatch.setattr(single, "run_hf", lambda *args, **kwargs: Run([1], 1.0, 0.5))
    runner = single.MethodRunner.__new__(single.MethodRunner)
    runner.settings = SimpleNamespace(top_p=0.9, seed=7, max_new_tokens=4, seed_mode="prompt")
    runner.prompts = [{"id": "a"}, {"id": "b"}]
    runner.model = runner.eos = runner.pad = None
    for repeat in (-1, 0, 1):  # the warm-up, then two passes: seed + 1000 * (repeat + 1) + the prompt's index
        runner._sample("sample", 0.7, runner.prompts[1], [1], repeat)
    assert seeds == [8, 1008, 2008]


def test_lookahead_unseeded_gets_no_references_where_the_others_are_seeded(monkeypatch):
    """Under --seed-mode references every lookahead variant drafts from the passage but
    ``lookahead_unseeded``, the control that shows what the seeding gains."""
    from tiny_models import build_tiny_model

    from rag_lookahead.bench import single

    seeded = {}
    monkeypatch.setattr(single, "chat_ids", lambda tokenizer, prompt, with_context=True: [1])
    # run_lookahead's config (the method's name here) and references
    monkeypatch.setattr(single, "run_lookahead", lambda *args: seeded.setdefault(args[5], args[6]))
    runner = single.MethodRunner.__new__(single.MethodRunner)
    runner.settings = SimpleNamespace(max_new_tokens=4, seed_mode="references")
    runner.model = build_tiny_model("qwen2", seed=21)
    runner.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [7, 8, 9])
    runner.eos = runner.pad = None
    runner.sampling = {}
    runner.configs = {m: m for m in ("lookahead", "lookahead_unseeded")}
    for method in runner.configs:
        runner.run(method, {"context": "the passage"})
    assert seeded == {"lookahead": [7, 8, 9], "lookahead_unseeded": None}


def test_the_summary_table_shows_each_speedup_under_its_own_name(capsys):
    from rag_lookahead.bench.single import print_summary

    greedy, ours = MethodTotals(), MethodTotals()
    greedy.add(Run(list(range(101)), 11.0, 1.0), None)
    ours.add(Run(list(range(101)), 6.0, 4.0), None)  # a slow prefill: 1.83x end to end, 5x decoding
    report = {
        "summary": summarize({"greedy": greedy, "lookahead": ours}), "summary_copying": {}, "prompts": 1,
        "repeats": 1, "copying_runs": 0, "copying_threshold": 0.8, "per_prompt": [{}],
        "mean_copied_from_context": None, "model": "m", "dtype": "fp32", "device": "cpu", "seed_mode": "prompt",
        "drafts": "trees",
    }  # fmt: skip
    print_summary(report)
    lines = capsys.readouterr().out.splitlines()
    head = [c.strip() for c in next(line for line in lines if "speedup e2e" in line).split("\u2503")]
    cells = [c.strip() for c in next(line for line in lines if " lookahead " in line).split("\u2502")]
    row = dict(zip(head, cells, strict=True))
    assert row["speedup e2e"] == "1.83x" and row["speedup decode"] == "5.00x"


def test_run_hf_times_its_first_token_apart_from_the_prompt():
    """transformers' streamer is handed the prompt first, then the first answer token."""
    from tiny_models import tiny_model

    from rag_lookahead.bench.methods import run_hf

    run = run_hf(tiny_model("qwen2"), list(range(3, 23)), 8, [], 0, None)
    assert len(run.tokens) == 8 and run.first_tokens == 1
    assert 0 < run.first_token_seconds < run.seconds


def test_interference_reports_off_over_on_and_compares_the_requests_both_finished(monkeypatch, capsys):
    """p95_itl_reduction is the p95 gap without chunking over the one with it (2.0: halved), and
    ``identical`` counts over the requests both runs finished."""
    from rag_lookahead.bench import interference
    from rag_lookahead.decoding.config import LookaheadConfig

    class Run:
        def __init__(self, model, config, eos, pad, mix, chunk):
            self.chunk = chunk

        def run(self):
            if self.chunk == 0:
                return interference.Trace(outputs={"x": [1], "y": [2], "z": [3]}, gaps=[0.02])
            return interference.Trace(outputs={"x": [1], "y": [2]}, gaps=[0.01])

    monkeypatch.setattr(interference, "Runner", Run)
    monkeypatch.setattr(interference, "tiny_mix", lambda settings: (None, [], 0, [[1]], [[1] * 4], LookaheadConfig()))
    report = interference.main(["--tiny"])
    assert report["p95_itl_reduction"] == 2.0
    assert [r["identical"] for r in report["results"]] == ["2/2", "2/2"]
    assert interference.identical({"x": [1], "y": [2], "z": [3]}, {"x": [1], "y": [9]}) == "1/2"


def test_a_long_request_is_refused_when_its_answer_would_pass_the_context():
    from tiny_models import build_tiny_model

    from rag_lookahead.bench.interference import check_long_fits
    from rag_lookahead.errors import InputError

    model = build_tiny_model("qwen2", seed=21, max_positions=128)
    settings = {"long_prompt_tokens": 126, "long_max_new_tokens": 8}
    with pytest.raises(InputError, match="--long-max-new-tokens 8"):
        check_long_fits(model, [[1] * 120, [1] * 126], settings)
    check_long_fits(model, [[1] * 120], settings)  # 120 + 8 fits


@pytest.mark.parametrize("chunk", [0, 16])
def test_interference_streams_run_alone_first_and_gaps_count_only_while_a_long_request_is_in_flight(chunk):
    """The long requests arrive every ``arrival_steps`` decode steps, the first after the streams ran
    alone that long; the gaps measured are those of streams sharing the batch with a long request
    (the streams still finishing after the last long one was answered add none)."""
    from rag_lookahead.bench.interference import Mix, Runner, tiny_mix

    model, eos, pad, shorts, longs, config = tiny_mix({"long_prompt_tokens": 48, "long_requests": 2})
    mix = Mix(shorts, longs, short_slots=2, short_tokens=24, long_tokens=4, arrival_steps=3)
    runner = Runner(model, config.replace(budget="fixed"), eos, pad, mix, chunk)
    arrivals, outside = [], []
    add, delivered = runner._add, runner._delivered

    def on_add(key, ids, max_new_tokens):
        if key.startswith("long"):
            arrivals.append(runner.trace.steps)
        add(key, ids, max_new_tokens)

    def on_delivered(key, tokens):
        before, in_flight = len(runner.trace.gaps), runner.longs_in_flight
        delivered(key, tokens)
        if not in_flight:
            outside.append(len(runner.trace.gaps) - before)

    runner._add, runner._delivered = on_add, on_delivered
    trace = runner.run()
    assert arrivals == [3, 6]
    assert sorted(trace.outputs) == ["long0", "long1", *(f"short{n}" for n in range(runner.short_count))]
    assert trace.gaps and outside and not any(outside)  # deliveries after the long ones added no gap
