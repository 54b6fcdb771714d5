"""PNG charts of a benchmark report, written next to its JSON (``--plot``).

They read the report dict exactly as the benchmark writes it (or as ``json.load`` gives it back),
so charts can also be drawn later from a saved JSON::

    plot_single(json.load(open("bench.json")), "bench.json")   # bench.decode_speed.png, ...

matplotlib draws on its Agg canvas directly (no pyplot, no display, no global backend switch).
"""

from __future__ import annotations

import math
import re
import statistics
import textwrap
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rag_lookahead.bench.methods import baselines
from rag_lookahead.output_files import PathTaken, check_output_file, is_chart, is_chart_of, save_chart

__all__ = [
    "ALL_CHARTS",
    "BATCH_CHARTS",
    "SINGLE_CHARTS",
    "chart_path",
    "check_chart",
    "plot_batch",
    "plot_single",
    "remove_undrawn",
]

#: the charts each benchmark may draw, by name (``bench.<name>.png``)
SINGLE_CHARTS = ("decode_speed", "accepted_per_step", "speedup_vs_copied")
BATCH_CHARTS = ("concurrency",)
ALL_CHARTS = SINGLE_CHARTS + BATCH_CHARTS


def chart_path(json_path: str | Path, name: str) -> Path:
    """``bench.json`` -> ``bench.<name>.png`` in the same folder."""
    path = Path(json_path)
    return path.with_name(f"{path.stem}.{name}.png")


def check_chart(path: Path, json_path: str | Path, option: str) -> None:
    """Refuse ``path`` for a chart of the report at ``json_path`` unless it is free or holds a chart
    we drew for that very report (see ``check_output_file``): reports whose names share a stem
    (``bench.h100`` and ``bench.a100``, ``results.json`` and ``results.txt``) share chart names, and
    a run to one replaced the other's charts, unsaid."""
    try:
        check_output_file(path, option, ours=lambda chart: is_chart_of(chart, json_path))
    except PathTaken:
        if path.is_symlink() or not path.is_file() or not is_chart(path):
            raise
        raise PathTaken(
            f"{option} {str(path)!r} is a chart of another report whose name shares the stem "
            f"{Path(json_path).stem!r} (its charts have the same names); give --json a name with a stem of its "
            "own, or remove that chart (nothing was changed)",
            path,
        ) from None


#: the decode-speed chart widens with its prompts up to this many inches, and labels at most this many
WIDEST, MOST_LABELS = 19.2, 40
#: inches a title's character is given: DejaVu Sans at the title's 12 pt takes 0.09-0.10 a character
#: of a model id or prose, 0.16 for W or M
TITLE_INCHES_PER_CHARACTER = 0.12


def _figure(panels: int = 1, width: float = 6.4):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width * panels, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, [figure.add_subplot(1, panels, i + 1) for i in range(panels)]


def _save(figure, path: Path, json_path: str | Path) -> Path:
    """Atomically, and never over a file we did not draw for this report (a user's file, a symlink,
    another report's chart): ConfigError."""
    check_chart(path, json_path, "chart")
    return save_chart(figure, path, json_path)


def _model_label(report: dict[str, Any]) -> str:
    """The model and the dtype that ran, as a chart's title names them: a local folder by its last
    part (its whole path ran off the chart), a hub id (``Qwen/Qwen2.5-0.5B-Instruct``) whole."""
    model = str(report.get("model", ""))
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model:
        model = re.split(r"[\\/]", model.rstrip("/\\"))[-1] or model
    return f"{model} {report.get('dtype', '')}".strip()


def _set_title(axes, *lines: str) -> None:
    """The axes' title of ``lines`` (empty ones left out), each wrapped to its panel's width: the
    model, its dtype and what the chart shows on one line ran past the image's edge for ordinary
    hub ids (``Qwen/Qwen2.5-Coder-0.5B-Instruct bf16 (auto), batch 1: decode speed per pr``)."""
    panel_inches = axes.get_figure().get_figwidth() / axes.get_subplotspec().get_gridspec().ncols
    characters = max(int(panel_inches / TITLE_INCHES_PER_CHARACTER), 16)
    axes.set_title("\n".join(textwrap.fill(line, characters) for line in lines if line))


def _method_names(rows: Iterable[dict]) -> list[str]:
    """The methods of per-prompt rows, in report order (every key that holds a method's figures)."""
    names: dict[str, None] = {}
    for row in rows:
        names.update((key, None) for key, value in row.items() if isinstance(value, dict))
    return list(names)


# ---------------------------------------------------------------- the batch-1 benchmark


def plot_single(report: dict[str, Any], json_path: str | Path) -> list[Path]:
    """Decode speed per method and prompt, accepted tokens per step, speedup against copying.

    The histogram is left out when no method ran our loop (only our loop counts accepted tokens
    per step); the speedup chart when greedy (or sampling's baseline) did not run; all three when
    the report holds no prompt's figures (a hand-made or cut-down report; it stopped with a ValueError).
    """
    rows = report["per_prompt"]
    methods = _method_names(rows)
    histograms = _accepted_histograms(rows, methods)
    points = _speedup_points(rows, methods)
    drawn = [name for name, wanted in zip(SINGLE_CHARTS, (methods, histograms, points), strict=True) if wanted]
    for name in drawn:  # all before the first is drawn: a refusal leaves every chart as it was
        check_chart(chart_path(json_path, name), json_path, "chart")
    written = [_decode_speed_chart(report, rows, methods, json_path)] if methods else []
    if histograms:
        written.append(_accepted_chart(histograms, json_path))
    if points:
        written.append(_speedup_chart(report, points, json_path))
    remove_undrawn(json_path, written)
    return written


def remove_undrawn(json_path: str | Path, drawn: Iterable[Path] = ()) -> None:
    """Remove the charts of ours (any benchmark's) an earlier run left beside this report that this
    run did not draw: a rerun without greedy kept the old speedup chart, a rerun without --plot or
    another benchmark's report at the path kept all of them, next to a report they no longer
    described. Only a regular file carrying our chart mark for this very report goes: ``bench.h100``
    and ``bench.a100`` share chart names, and a run to one removed the other's."""
    drawn = set(drawn)
    for name in ALL_CHARTS:
        path = chart_path(json_path, name)
        if path not in drawn and not path.is_symlink() and path.is_file() and is_chart_of(path, json_path):
            path.unlink()


def _decode_speed_chart(report: dict, rows: list[dict], methods: list[str], json_path: str | Path) -> Path:
    """Grouped bars: decode tokens/s per prompt (mean over the repeats), one bar per method."""
    prompts = list(dict.fromkeys(str(r["id"]) for r in rows))
    speeds: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        for m in methods:
            value = (row.get(m) or {}).get("decode_tokens_per_second")
            if value is not None:
                speeds[str(row["id"]), m].append(value)
    # 60 prompts' bars and labels ran together at the usual width: wider, and every k-th label
    figure, (axes,) = _figure(width=min(6.4 + 0.2 * max(len(prompts) - 10, 0), WIDEST))
    width = 0.8 / max(len(methods), 1)
    for k, m in enumerate(methods):
        heights = [statistics.mean(speeds[p, m]) if speeds[p, m] else 0.0 for p in prompts]
        axes.bar([i + (k - (len(methods) - 1) / 2) * width for i in range(len(prompts))], heights, width, label=m)
    step = -(-len(prompts) // MOST_LABELS)
    axes.set_xticks(range(0, len(prompts), step), prompts[::step], rotation=30 if step == 1 else 60, ha="right")
    axes.set_ylabel("decode tokens/s")
    _set_title(axes, "batch 1: decode speed per prompt", _model_label(report))
    axes.legend(fontsize="small")
    return _save(figure, chart_path(json_path, "decode_speed"), json_path)


def _accepted_histograms(rows: list[dict], methods: list[str]) -> dict[str, dict[int, int]]:
    """Per method that ran our loop: tokens gained in one step -> steps, over every prompt run."""
    summed: dict[str, dict[int, int]] = {}
    for m in methods:
        for row in rows:
            histogram = (row.get(m) or {}).get("accepted_histogram")
            for tokens, steps in (histogram or {}).items():  # JSON keys come back as strings
                counts = summed.setdefault(m, {})
                counts[int(tokens)] = counts.get(int(tokens), 0) + int(steps)
    return summed


def _accepted_chart(histograms: dict[str, dict[int, int]], json_path: str | Path) -> Path:
    """Share of decode steps that gained k tokens, one bar group per k."""
    figure, (axes,) = _figure()
    top = max(max(h) for h in histograms.values())
    width = 0.8 / len(histograms)
    for j, (m, counts) in enumerate(histograms.items()):
        steps = sum(counts.values()) or 1
        xs = [k + (j - (len(histograms) - 1) / 2) * width for k in range(1, top + 1)]
        axes.bar(xs, [counts.get(k, 0) / steps for k in range(1, top + 1)], width, label=m)
    axes.set_xlabel("tokens accepted in one decode step")
    axes.set_ylabel("share of steps")
    axes.set_title("accepted tokens per step")
    axes.legend(fontsize="small")
    return _save(figure, chart_path(json_path, "accepted_per_step"), json_path)


def _speedup_points(rows: list[dict], methods: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Per method: (share of greedy's answer copied from the passage, decode speedup over its baseline)."""
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        for m in methods:
            base = baselines(m)[0]
            ours, theirs = (row.get(m) or {}), (row.get(base) or {})
            if m == base or not ours.get("decode_tokens_per_second") or not theirs.get("decode_tokens_per_second"):
                continue
            if row.get("copied_from_context") is None:  # greedy did not run: no share to plot against
                continue
            points[m].append(
                (row["copied_from_context"], ours["decode_tokens_per_second"] / theirs["decode_tokens_per_second"])
            )
    return dict(points)


def _speedup_chart(report: dict, points: dict[str, list[tuple[float, float]]], json_path: str | Path) -> Path:
    figure, (axes,) = _figure()
    for m, xy in points.items():
        axes.scatter([x for x, _ in xy], [y for _, y in xy], label=m, alpha=0.8)
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.set_xlabel("share of greedy's answer copied from the passage")
    axes.set_ylabel("decode speedup over greedy (sampling: over sampling)")
    axes.set_title(f"speedup against copying ({report.get('seed_mode', 'prompt')} context)")
    axes.legend(fontsize="small")
    return _save(figure, chart_path(json_path, "speedup_vs_copied"), json_path)


# ---------------------------------------------------------------- the throughput benchmark


def plot_batch(report: dict[str, Any], json_path: str | Path) -> list[Path]:
    """Throughput, and p50/p95 latency, against concurrency, one line per method (mean over passes)."""
    by_method: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in report["results"]:
        by_method[row["method"]][int(row["concurrency"])].append(row)
    figure, (throughput, latency) = _figure(panels=2)
    for method, levels in by_method.items():
        xs = sorted(levels)

        def mean(key: str, levels=levels, xs=xs) -> list[float]:
            """Per level, the mean over the passes that have the figure; NaN (a gap in the line) where
            none has it (a null p95 stopped the chart with a TypeError)."""
            values = [[r[key] for r in levels[x] if r.get(key) is not None] for x in xs]
            return [statistics.mean(v) if v else math.nan for v in values]

        (line,) = throughput.plot(xs, mean("tokens_per_second"), marker="o", label=method)
        latency.plot(xs, mean("p50_latency_s"), marker="o", color=line.get_color(), label=f"{method} p50")
        latency.plot(
            xs, mean("p95_latency_s"), marker="^", linestyle="--", color=line.get_color(), label=f"{method} p95"
        )
    levels = sorted({level for by_level in by_method.values() for level in by_level})
    for axes in (throughput, latency):
        axes.set_xscale("log", base=2)
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.minorticks_off()
        axes.set_xlabel("concurrency (requests in flight)")
        axes.legend(fontsize="small")
    throughput.set_ylabel("tokens/s")
    _set_title(throughput, "throughput", _model_label(report))
    latency.set_ylabel("latency, s (request start to last token)")
    latency.set_title("p50 / p95 latency")
    written = [_save(figure, chart_path(json_path, "concurrency"), json_path)]
    remove_undrawn(json_path, written)
    return written


if __name__ == "__main__":  # it printed nothing and exited 0, as if it had drawn something
    raise SystemExit(
        "rag_lookahead.bench.plots is not a command: the benchmarks draw their charts with --json FILE --plot"
    )
