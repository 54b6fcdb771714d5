"""One command that says whether rag_lookahead works on this machine's accelerator, and how fast.

    python -m rag_lookahead.bench.gpu_check --json gpu_check.json         # on a GPU: every section, a few minutes
    python -m rag_lookahead.bench.gpu_check --device cpu --small --tiny-only --json out.json   # what CI runs

Sections (each runs on its own: one that fails is reported and the others still run):
  environment  device name and memory, native bf16, TF32 switches, attention kernels installed
  exactness    fp32 with TF32 off: tiny random models of seven architectures (and the default
               model unless --small/--tiny-only) at batch 1 and as a left-padded batch of 8,
               token-identical to transformers' greedy decoding of each prompt alone
  speed        batch 1 in --dtype: transformers greedy, its prompt lookup, lookahead
  concurrency  16 requests at once: transformers batched greedy vs our continuous batching
  stress       16 rows x 4k-token prompts decoded together: step time p50/p95, peak memory,
               and the same prompts one row at a time for comparison

Prints one table and writes the figures as JSON; exits 1 when an output differs where it must
not (fp32 exactness) or a section failed. The sections themselves are in :mod:`.gpu_sections`.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Annotated, Any

import torch
import typer

from rag_lookahead.attention_choice import check_attn_implementation
from rag_lookahead.bench.common import (
    TrustRemoteCodeOption,
    chat_ids,
    check_bench_model,
    check_output_path,
    eos_pad,
    keeps_report_despite_stdout,
    load_bench_model,
    load_prompts,
    refuse_with_tiny,
    run_command,
    times,
    write_report,
)
from rag_lookahead.bench.gpu_sections import (
    TINY_PAD,
    Sizes,
    concurrency,
    environment,
    exactness_model,
    exactness_tiny,
    long_prompts,
    speed_batch1,
    stress,
    synthetic_prompts,
)
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import model_devices, recalibrate_asked
from rag_lookahead.decoding.verify import supports_tree_mask
from rag_lookahead.errors import ConfigError, first_line
from rag_lookahead.models import placement, resolve_dtype
from rag_lookahead.tiny import build_tiny_model

PROG = "python -m rag_lookahead.bench.gpu_check"


@dataclass(frozen=True)
class CheckSettings:
    """The options, as the report's ``settings`` shows them (``--json`` aside)."""

    device: str | None = None
    device_map: str | None = None
    dtype: str | None = None
    attn: str = "sdpa"
    model: str = "default"
    small: bool = False
    tiny_only: bool = False
    trust_remote_code: bool = False


@dataclass
class Workload:
    """The model (in --dtype) and the prompts of the timed sections."""

    model: Any
    label: str
    speed: list[list[int]]
    requests: list[list[int]]
    stress: list[list[int]]
    eos: list[int]
    pad: int
    config: LookaheadConfig


def run_section(report: dict, name: str, run: Callable[[], Any]) -> None:
    """Run one section into ``report[name]``; a failure is recorded (one line and a traceback) and the check goes on."""
    print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        report[name] = run()
    except Exception as err:  # report it and go on: a first GPU run should say as much as it can
        report[name] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
        traceback.print_exc(file=sys.stderr)
    report.setdefault("section_seconds", {})[name] = round(time.perf_counter() - start, 1)
    print(f"gpu_check: {name} done in {report['section_seconds'][name]} s", file=sys.stderr, flush=True)


def run_check(settings: CheckSettings) -> dict:
    """Every section in turn; ``report["ok"]`` says whether all of them held."""
    from rag_lookahead.models import _resolve_device

    device = _resolve_device(settings.device)
    sizes = Sizes.small() if settings.small else Sizes()
    report: dict[str, Any] = {"settings": {**asdict(settings), "sizes": asdict(sizes)}}
    started = time.perf_counter()
    run_section(report, "environment", lambda: environment(device))
    run_section(report, "exactness", lambda: exactness_tiny(device, sizes, settings.attn))

    def load(dtype=None):
        dtype = dtype if dtype is not None else settings.dtype
        return load_bench_model(
            settings.model,
            dtype,
            device,
            settings.device_map,
            settings.trust_remote_code,
            attn_implementation=settings.attn,
        )

    if not (settings.small or settings.tiny_only):
        run_section(report, "exactness_model", lambda: exactness_model(load, settings.model, load_prompts(None), sizes))
    work = prepared_workload(settings, device, sizes, load, report)
    if work is not None:
        eos, pad, config = work.eos, work.pad, work.config
        speed = (work.model, work.speed, sizes.speed_new_tokens, eos, pad, config)
        run_section(report, "speed_batch1", lambda: speed_batch1(*speed))
        requests = (work.model, work.requests, sizes.concurrency_new_tokens, eos, pad, config)
        run_section(report, "concurrency", lambda: concurrency(*requests))
        run_section(report, "stress", lambda: stress(work.model, work.stress, sizes.stress_new_tokens, pad, config))
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["ok"] = all_ok(report)
    return report


def prepared_workload(
    settings: CheckSettings, device: torch.device, sizes: Sizes, load, report: dict
) -> Workload | None:
    """The real model and the bundled prompts, or with --tiny-only a tiny qwen2 and synthetic
    prompts; loaded inside the "model" section (None when that failed)."""

    def prepare() -> Workload:
        if settings.tiny_only:
            stress_positions = sizes.stress_context + sizes.stress_new_tokens + 64
            model = build_tiny_model(
                "qwen2", settings.attn, seed=7, device=device, max_positions=max(256, stress_positions)
            )
            speed = synthetic_prompts(sizes.speed_prompts, 48, seed=1)
            requests = synthetic_prompts(sizes.requests, 40, seed=2)
            long = synthetic_prompts(sizes.stress_rows, sizes.stress_context, seed=3)
            if settings.dtype is not None:  # it ran in fp32 whatever --dtype said, and the report said fp16
                asked = None if settings.dtype.strip().lower() == "auto" else settings.dtype  # auto: the device's
                model = model.to(resolve_dtype(asked, device, None))
            label = f"tiny qwen2 {model.dtype}".replace("torch.", "")
            return Workload(model, label, speed, requests, long, [], TINY_PAD, LookaheadConfig())
        model, tokenizer = load()
        prompts = load_prompts(None)
        chats = [chat_ids(tokenizer, p) for p in prompts]
        requests = [chats[i % len(chats)] for i in range(sizes.requests)]
        long = long_prompts(tokenizer, prompts, sizes.stress_rows, sizes.stress_context)
        label = f"{settings.model} {model.dtype}".replace("torch.", "")
        config = LookaheadConfig().with_tokenizer(tokenizer)
        return Workload(model, label, chats[: sizes.speed_prompts], requests, long, *eos_pad(model, tokenizer), config)

    loaded: list[Workload] = []
    run_section(report, "model", lambda: loaded.append(prepare()) or model_report(loaded[0].model, loaded[0].label))
    return loaded[0] if loaded else None


def model_report(model, label: str) -> dict:
    return {
        "label": label,
        "attn_implementation": model.config._attn_implementation,
        "tree_mask": supports_tree_mask(model),
        "devices": [str(d) for d in model_devices(model)],
        "device_map": getattr(model, "hf_device_map", None),
    }


def all_ok(report: dict) -> bool:
    """No section failed, and every fp32 row equals transformers' greedy (the tiny models at least ran)."""
    failed = any(isinstance(v, dict) and "error" in v for v in report.values())
    rows = exact_rows(report)
    return not failed and bool(rows) and all(r["identical"] == r["rows"] for r in rows)


def exact_rows(report: dict) -> list[dict]:
    return [r for name in ("exactness", "exactness_model") if isinstance(report.get(name), list) for r in report[name]]


# ---------------------------------------------------------------- the table

TableRow = tuple[str, str, str, bool | None]  # section, case, result, ok (None: no verdict)


def print_table(report: dict) -> None:
    """One table: a line per figure that matters."""
    from rich.console import Console
    from rich.table import Table

    env = report.get("environment", {})
    table = Table(title=f"GPU check: {env.get('device', '?')} ({env.get('device_name', '?')}), {report['seconds']} s")
    for column in ("section", "case", "result", "ok"):
        table.add_column(column)
    for section, case, result, ok in table_rows(report):
        table.add_row(section, case, result, {True: "yes", False: "NO", None: ""}[ok])
    Console(width=160).print(table)


def table_rows(report: dict) -> Iterator[TableRow]:
    yield from _environment_rows(report.get("environment", {}))
    for name in ("environment", "exactness", "exactness_model", "model", "speed_batch1", "concurrency", "stress"):
        value = report.get(name)
        if isinstance(value, dict) and "error" in value:
            yield name, "failed", value["error"], False
    for r in exact_rows(report):
        yield (
            "exactness fp32",
            f"{r['model']} batch {r['batch']}",
            f"{r['identical']}/{r['rows']} identical, mean accepted {r['mean_accepted']}, tree mask {r['tree_mask']}",
            r["identical"] == r["rows"],
        )
    model = report.get("model", {})
    if "label" in model:
        devices = ", ".join(model["devices"])
        result = f"attention {model['attn_implementation']}, tree mask {model['tree_mask']}, on {devices}"
        yield "model", model["label"], result, None
    for method, s in report.get("speed_batch1", {}).get("summary", {}).items():
        # greedy is the reference, compared with nothing: its row said "None identical"
        identical = "" if s["identical_to_greedy"] is None else f", {s['identical_to_greedy']} identical"
        result = (
            f"{s['decode_tokens_per_second']} tok/s decode, {times(s['speedup_decode'])} greedy, "
            f"{times(s['vs_prompt_lookup_decode'])} prompt lookup{identical}"
        )
        yield "speed batch 1", method, result, None
    yield from _concurrency_rows(report.get("concurrency", {}))
    yield from _stress_rows(report.get("stress", {}))


def _environment_rows(env: dict) -> Iterator[TableRow]:
    if "error" in env:
        return
    extra = (
        f", capability {env['compute_capability']}, {env['memory_gb']} GB, native bf16 {env['native_bf16']}"
        if "compute_capability" in env
        else ""
    )
    yield (
        "environment",
        f"torch {env['torch']}, transformers {env['transformers']}",
        f"fp32 matmuls rounded (TF32) {env['fp32_matmuls_rounded']}, flash_attn {env['flash_attn_installed']}{extra}",
        None,
    )


def _concurrency_rows(conc: dict) -> Iterator[TableRow]:
    if "hf_batched" not in conc:
        return
    section = f"concurrency {conc['requests']}"
    yield section, "hf batched greedy", f"{conc['hf_batched']['tokens_per_second']} tok/s", None
    for method in ("plain", "lookahead"):
        c = conc[method]
        result = (
            f"{c['tokens_per_second']} tok/s, {times(c['speedup_vs_hf'])} hf, "
            f"{c['identical']}/{conc['requests']} identical to hf, mean accepted {c['mean_accepted']}"
        )
        yield section, method, result, None


def _stress_rows(st: dict) -> Iterator[TableRow]:
    if "skipped" in st:
        yield "stress", "skipped", st["skipped"], None
    if "steps" not in st:
        return
    memory = (
        f"peak GPU {st['peak_gpu_memory_gb']} GB"
        if "peak_gpu_memory_gb" in st
        else f"peak host RSS {st['peak_host_rss_gb']} GB"
    )
    yield (
        "stress",
        f"{st['rows']} rows, {st['prompt_tokens']} prompt tokens",
        f"step p50 {st['step_ms_p50']} ms, p95 {st['step_ms_p95']} ms, {memory}, "
        f"{st['decode_tokens_per_second']} tok/s",
        None,
    )
    yield (
        "stress",
        "one row alone",
        f"step p50 {st['one_row_step_ms_p50']} ms, {st['one_row_tokens_per_second']} tok/s, "
        f"packed/row-by-row {times(st.get('packed_vs_row_by_row'))}",
        None,
    )


# ---------------------------------------------------------------- the command


@keeps_report_despite_stdout
def gpu_check(
    device: Annotated[
        str | None, typer.Option(help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    ] = None,
    device_map: Annotated[
        str | None,
        typer.Option(help='for the real model: handed to from_pretrained, e.g. "auto" (spreads it over all GPUs)'),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="speed, concurrency and stress: bf16, fp16, fp32 "
            "(default: bf16 where native, else fp16; CPU: bf16 only with AMX)"
        ),
    ] = None,
    attn: Annotated[
        str, typer.Option(help="attn_implementation: sdpa, eager, flash_attention_2 (refused tree masks: chains)")
    ] = "sdpa",
    model: Annotated[str, typer.Option(help='"default" (embedded), a hub id or a local folder')] = "default",
    trust_remote_code: TrustRemoteCodeOption = False,
    small: Annotated[bool, typer.Option("--small", help="small sizes (CI on a CPU)")] = False,
    tiny_only: Annotated[
        bool, typer.Option("--tiny-only", help="only the tiny random models (no download, no conversion)")
    ] = False,
    json_path: Annotated[str | None, typer.Option("--json", help="write the report here")] = None,
) -> None:
    """One command that says whether rag_lookahead works on this machine's accelerator, and how fast.

    Exits 1 when an output differs where it must not (fp32 exactness) or a section failed.
    """
    if tiny_only:  # no real model loads: --model and --device-map were ignored, unsaid, the report recording them
        refuse_with_tiny("--tiny-only", model=model, device_map=device_map, trust_remote_code=trust_remote_code)
    seen = check_output_path(json_path)
    check_attention(attn)
    if dtype is not None:  # refused now: it failed in the model section, after the tiny ones had run
        try:
            resolve_dtype(dtype, "cpu", None)
        except ConfigError as err:
            raise typer.BadParameter(first_line(err), param_hint="--dtype") from None
    if tiny_only:
        recalibrate_asked()  # a bad RAG_LOOKAHEAD_RECALIBRATE failed the last three sections, each with a traceback
        # a device torch does not see (--device cuda without a GPU), said in one line as load_model says it:
        # every section failed with a traceback ("Torch not compiled with CUDA enabled")
        placement(device, None)
    else:  # a model that will not load, said in one line now: it failed the "model" section with a traceback,
        # after the environment and tiny sections had run (a bad RAG_LOOKAHEAD_RECALIBRATE too)
        check_bench_model(model, dtype, device, device_map, trust_remote_code)
    report = run_check(CheckSettings(device, device_map, dtype, attn, model, small, tiny_only, trust_remote_code))
    print_table(report)
    if json_path:
        write_report(json_path, report, seen=seen)
    raise typer.Exit(0 if report["ok"] else 1)


def check_attention(attn: str) -> None:
    """Refuse an ``--attn`` transformers does not know, or a flash attention whose package is missing
    (each section failed with a traceback), as :func:`load_model` refuses it."""
    try:
        check_attn_implementation(attn)
    except ConfigError as err:
        raise typer.BadParameter(first_line(err), param_hint="--attn") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check, print the table, write the JSON; 0 when everything held, else 1."""
    return run_command(gpu_check, argv, PROG)


if __name__ == "__main__":
    raise SystemExit(main())
