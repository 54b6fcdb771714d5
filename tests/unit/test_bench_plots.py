"""``--plot``: the chart functions draw valid PNG files from a report shaped like the ones the
benchmarks write (tiny fake figures; no benchmark runs here)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from rag_lookahead.bench.plots import chart_path, plot_batch, plot_single

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _method(tps, mean_accepted=None, histogram=None, new_tokens=40):
    figures = {
        "new_tokens": new_tokens,
        "seconds": 1.0,
        "decode_tokens_per_second": tps,
        "identical_to_greedy": True,
        "mean_accepted": mean_accepted,
    }
    if histogram is not None:
        figures["accepted_histogram"] = histogram
    return figures


def single_report() -> dict:
    rows = []
    for repeat in range(2):
        for i, (pid, copied) in enumerate((("zh-law", 0.9), ("en-wiki", 0.4), ("zh-medical", 0.0))):
            rows.append(
                {
                    "id": pid,
                    "repeat": repeat,
                    "copied_from_context": copied,
                    "greedy": _method(10.0 + i),
                    "prompt_lookup": _method(14.0 + i),
                    "lookahead": _method(20.0 + 5 * copied, 2.5, {1: 5, 2: 3, 7: 1 + i}),
                    "sample_t0.7": _method(9.0),
                    "lookahead_sample_t0.7": _method(12.0, 1.4, {1: 8, 3: 2}),
                }
            )
    return {"model": "default", "dtype": "bf16", "seed_mode": "prompt", "per_prompt": rows}


def batch_report() -> dict:
    results = [
        {
            "pass": p,
            "concurrency": level,
            "method": method,
            "requests_per_second": 0.5 * level,
            "tokens_per_second": base * level**0.7 + p,
            "p50_latency_s": 2.0 + level / base,
            "p95_latency_s": 3.0 + level / base,
            "identical_to_single": "4/4",
            "mean_accepted": None if method == "hf_greedy" else 1.8,
        }
        for p in range(2)
        for level in (1, 4, 16)
        for method, base in (("hf_greedy", 8.0), ("plain", 9.0), ("lookahead", 15.0))
    ]
    return {"model": "default", "dtype": "bf16", "requests": 4, "results": results}


def _assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > len(PNG_SIGNATURE)


def test_single_charts_are_pngs_next_to_the_json(tmp_path):
    json_path = tmp_path / "bench.json"
    written = plot_single(single_report(), json_path)
    assert written == [
        chart_path(json_path, "decode_speed"),
        chart_path(json_path, "accepted_per_step"),
        chart_path(json_path, "speedup_vs_copied"),
    ]
    assert [p.name for p in written] == [
        "bench.decode_speed.png",
        "bench.accepted_per_step.png",
        "bench.speedup_vs_copied.png",
    ]
    for path in written:
        _assert_png(path)


def test_single_charts_read_a_report_back_from_json(tmp_path):
    """A saved report has string keys in its histograms and may lack our loop's methods."""
    report = json.loads(json.dumps(single_report()))
    assert plot_single(report, tmp_path / "again.json")
    hf_only = {
        **report,
        "per_prompt": [{k: v for k, v in r.items() if "lookahead" not in k} for r in report["per_prompt"]],
    }
    written = plot_single(hf_only, tmp_path / "hf.json")
    assert [p.name for p in written] == ["hf.decode_speed.png", "hf.speedup_vs_copied.png"]  # no per-step counts
    for path in written:
        _assert_png(path)


def test_batch_chart_is_a_png_next_to_the_json(tmp_path):
    written = plot_batch(batch_report(), tmp_path / "batch.json")
    assert [p.name for p in written] == ["batch.concurrency.png"]
    _assert_png(written[0])


def test_a_chart_never_replaces_a_file_we_did_not_draw(tmp_path):
    """The measured bug: ``--plot`` wrote through a symlink into the user's notes and replaced a
    user's PNG of the same name; now those are refused and left as they were, our own charts are
    replaced, and each is written whole (atomically)."""
    from rag_lookahead.errors import ConfigError
    from rag_lookahead.output_files import is_chart

    json_path = tmp_path / "bench.json"
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes", encoding="utf-8")
    chart_path(json_path, "decode_speed").symlink_to(notes)
    with pytest.raises(ConfigError, match="did not write it"):
        plot_single(single_report(), json_path)
    assert notes.read_text(encoding="utf-8") == "my notes"
    chart_path(json_path, "decode_speed").unlink()
    theirs = chart_path(json_path, "accepted_per_step")
    theirs.write_bytes(PNG_SIGNATURE + b"a user's own picture")
    with pytest.raises(ConfigError, match="did not write it"):
        plot_single(single_report(), json_path)
    assert theirs.read_bytes() == PNG_SIGNATURE + b"a user's own picture"
    theirs.unlink()
    first = plot_single(single_report(), json_path)
    assert all(is_chart(path) for path in first)
    assert plot_single(single_report(), json_path) == first  # a rerun replaces its own charts
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in first) + ["notes.txt"]


def test_running_the_plots_module_says_it_is_not_a_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rag_lookahead.bench.plots"], capture_output=True, text=True)
    assert done.returncode == 1 and "--plot" in done.stderr and not done.stdout


def test_a_rerun_removes_the_charts_of_ours_it_did_not_draw(tmp_path):
    """Rerun without greedy, the old speedup chart stayed beside a report it no longer described."""
    json_path = tmp_path / "r.json"
    assert len(plot_single(single_report(), json_path)) == 3
    mine = tmp_path / "r.notes.png"  # a user's file beside it, and one at a chart's name that is not ours
    mine.write_bytes(PNG_SIGNATURE + b"my own")
    report = single_report()
    for row in report["per_prompt"]:
        del row["greedy"], row["sample_t0.7"]
    drawn = plot_single(report, json_path)
    assert chart_path(json_path, "speedup_vs_copied") not in drawn
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(p.name for p in drawn), "r.notes.png"])
    chart_path(json_path, "speedup_vs_copied").write_bytes(PNG_SIGNATURE + b"not drawn by us")
    plot_single(report, json_path)
    assert chart_path(json_path, "speedup_vs_copied").read_bytes() == PNG_SIGNATURE + b"not drawn by us"


def test_labels_the_font_cannot_draw_are_said_in_one_line(tmp_path, capsys):
    """Chinese prompt ids (a user's --prompts) flooded stderr with two matplotlib warnings per
    character: 88 lines for 8 ids of 6 characters."""
    import warnings

    from matplotlib.font_manager import FontProperties, findfont
    from matplotlib.ft2font import FT2Font

    if FT2Font(findfont(FontProperties())).get_char_index(ord("合")):
        pytest.skip("the default font here has Chinese glyphs")
    report = single_report()
    ids = {"zh-law": "合同第十二条", "en-wiki": "en-wiki", "zh-medical": "医疗保险报销"}
    for row in report["per_prompt"]:
        row["id"] = ids[row["id"]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = plot_single(report, tmp_path / "zh.json")
    assert [str(w.message) for w in caught] == []
    assert capsys.readouterr().err.splitlines() == [
        f"{written[0]}: the chart's font has no glyphs for 12 characters; these labels show boxes: "
        "'合同第十二条', '医疗保险报销'"
    ]


def test_the_decode_speed_chart_widens_with_its_prompts_up_to_a_cap(tmp_path):
    """60 prompts' bars and labels ran together in the usual 6.4 inches (704 pixels at 110 dpi)."""
    row = single_report()["per_prompt"][0]

    def width(prompts: int) -> int:
        report = {**single_report(), "per_prompt": [{**row, "id": f"zh-cail2019-{n:03d}"} for n in range(prompts)]}
        png = plot_single(report, tmp_path / f"n{prompts}.json")[0].read_bytes()
        return int.from_bytes(png[16:20], "big")  # the IHDR chunk's width

    assert width(8) == 704
    assert 704 < width(60) < width(90) == width(200) == round(19.2 * 110)


def test_a_report_removes_only_its_own_charts_not_those_of_a_report_sharing_their_names(tmp_path):
    """``bench.h100`` and ``bench.a100`` share chart names (``bench.decode_speed.png``...): a run to
    ``bench.a100`` without --plot removed the charts that described ``bench.h100``."""
    from rag_lookahead.bench import plots
    from rag_lookahead.bench.common import write_report

    write_report(tmp_path / "bench.h100", single_report(), plots.plot_single, plots.SINGLE_CHARTS, seen=...)
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == ["bench.accepted_per_step.png", "bench.decode_speed.png", "bench.speedup_vs_copied.png"]
    write_report(tmp_path / "bench.a100", {"model": "x", "per_prompt": []}, seen=...)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == drawn
    write_report(tmp_path / "bench.h100", {"model": "x", "per_prompt": []}, seen=...)  # its own report again: they go
    assert sorted(p.name for p in tmp_path.glob("*.png")) == []
    from rag_lookahead.output_files import CHART_SOFTWARE

    figure, _ = plots._figure()  # a chart drawn before charts named their report: the report's beside it
    old = tmp_path / "bench.decode_speed.png"
    figure.savefig(old, format="png", metadata={"Software": CHART_SOFTWARE})
    write_report(tmp_path / "bench.a100", {"model": "x", "per_prompt": []}, seen=...)
    assert not old.exists()


def test_a_report_never_replaces_the_charts_of_a_report_sharing_their_names(tmp_path, monkeypatch):
    """``bench.h100`` and ``bench.a100`` (``results.json`` and ``results.txt``) share chart names:
    a --plot run to one silently replaced the other's charts (any chart of ours passed the checks).
    Now it stops before the model loads, as at a report path held by another file; a chart that
    appears during the run sends the report and its charts to a free name."""
    import importlib

    from rag_lookahead.bench import common, plots
    from rag_lookahead.errors import ConfigError
    from rag_lookahead.output_files import is_chart_of

    h100 = tmp_path / "bench.h100"
    theirs = common.write_report(h100, single_report(), plot_single, plots.SINGLE_CHARTS, seen=None)
    before = {p: p.read_bytes() for p in tmp_path.glob("*.png")}
    assert len(before) == 3 and all(is_chart_of(p, theirs) for p in before)
    a100 = tmp_path / "bench.a100"
    single = importlib.import_module("rag_lookahead.bench.single")
    loads = []
    for owner in (single, common):
        monkeypatch.setattr(owner, "load_bench_model", lambda *a, **k: loads.append(a), raising=False)
    with pytest.raises(SystemExit) as done:
        single.main(["--json", str(a100), "--plot"])
    assert done.value.code == (
        f"error: --plot '{chart_path(a100, 'decode_speed')}' is a chart of another report whose name shares the "
        "stem 'bench' (its charts have the same names); give --json a name with a stem of its own, or remove that "
        "chart (nothing was changed)"
    )
    assert loads == []
    with pytest.raises(ConfigError, match="is a chart of another report"):
        plot_single(single_report(), a100)  # drawn without the CLI's check
    written = common.write_report(a100, single_report(), plot_single, plots.SINGLE_CHARTS, seen=None)  # at the end
    assert written == tmp_path / "bench.1.a100" and is_chart_of(chart_path(written, "decode_speed"), written)
    assert {p: p.read_bytes() for p in before} == before and h100.is_file()


def test_matplotlib_3_8s_missing_glyph_wording_is_caught_too():
    """matplotlib 3.8 (which the ``plot`` extra allows) says "missing from current font."."""
    from rag_lookahead.output_files import _MISSING_GLYPH

    for message in (
        "Glyph 21512 (\\N{CJK UNIFIED IDEOGRAPH-5408}) missing from current font.",
        "Glyph 21512 (\\N{CJK UNIFIED IDEOGRAPH-5408}) missing from font(s) DejaVu Sans.",
    ):
        assert _MISSING_GLYPH.search(message)[1] == "21512"


def drawn_figures(monkeypatch) -> list:
    """The figures the chart functions save, as they were drawn (each is still saved as usual)."""
    from rag_lookahead.bench import plots

    figures, save = [], plots._save

    def noting(figure, path, json_path):
        figures.append(figure)
        return save(figure, path, json_path)

    monkeypatch.setattr(plots, "_save", noting)
    return figures


@pytest.mark.parametrize(
    ("model", "shown"),
    [
        ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct bf16 (auto)"),
        ("/home/user/checkpoints/2026-12/qwen2.5-coder-0.5b-instruct-rag-v3/", "qwen2.5-coder-0.5b-instruct-rag-v3"),
        ("org/" + "a-very-long-model-name" * 4, "bf16 (auto)"),
    ],
)
def test_chart_titles_fit_in_the_image(tmp_path, monkeypatch, model, shown):
    """The decode-speed chart's title (model, dtype and what it shows on one line) ran past the
    image's edge for an ordinary hub id, and the throughput panel's for a local folder's path."""
    figures = drawn_figures(monkeypatch)
    plot_single({**single_report(), "model": model, "dtype": "bf16 (auto)"}, tmp_path / "s.json")
    plot_batch({**batch_report(), "model": model, "dtype": "bf16 (auto)"}, tmp_path / "b.json")
    decode_speed, batch = figures[0], figures[-1]
    for figure in (decode_speed, batch):
        renderer = figure.canvas.get_renderer()
        title = figure.axes[0].title
        assert shown in title.get_text().replace("\n", " ")
        assert "/home/user" not in title.get_text()  # a local folder by its last part
        extent = title.get_window_extent(renderer)
        assert figure.bbox.x0 <= extent.x0 and extent.x1 <= figure.bbox.x1, (title.get_text(), extent)


def test_reports_without_a_figure_draw_what_they_can(tmp_path):
    """plot_single on a report with no per-prompt rows stopped with "range() arg 3 must not be zero",
    and plot_batch on a row whose p95 is null with a TypeError."""
    assert plot_single({**single_report(), "per_prompt": []}, tmp_path / "none.json") == []
    report = batch_report()
    report["results"][0]["p95_latency_s"] = None  # that level's other pass still has one
    for row in report["results"]:
        if row["method"] == "plain" and row["concurrency"] == 4:
            row["p95_latency_s"] = None  # no pass has one: a gap in the line
    written = plot_batch(report, tmp_path / "gap.json")
    assert [p.name for p in written] == ["gap.concurrency.png"]
    _assert_png(written[0])


def test_the_speedup_points_are_ours_over_the_baseline_at_the_share_copied():
    from rag_lookahead.bench.plots import _speedup_points

    row = {
        "copied_from_context": 0.9,
        "greedy": {"decode_tokens_per_second": 10.0},
        "lookahead": {"decode_tokens_per_second": 25.0},
    }
    assert _speedup_points([row], ["greedy", "lookahead"]) == {"lookahead": [(0.9, 2.5)]}


def test_the_batch_chart_draws_p50_and_p95_latencies_from_their_own_figures(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = {}
    plot = matplotlib.axes.Axes.plot

    def noting(self, *args, **kwargs):
        drawn[kwargs.get("label")] = list(args[1])
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", noting)
    row = {"method": "lookahead", "concurrency": 4, "tokens_per_second": 50.0, "p50_latency_s": 1.0}
    plot_batch({"model": "m", "dtype": "fp32", "results": [{**row, "p95_latency_s": 3.0}]}, tmp_path / "b.json")
    assert drawn["lookahead p50"] == [1.0] and drawn["lookahead p95"] == [3.0]
