"""Interference benchmark: short streams' inter-token latency while long-prompt requests keep arriving.

A few short requests (the bundled questions, without their passages) stream in continuous
batching, as in the server; every ``--arrival-steps`` decode steps a long RAG-like request
(several bundled passages joined to about ``--long-tokens`` tokens, then a question) joins the
batch. Without chunked prefill its whole prompt runs in one forward between two decode steps,
and every stream waits for it; with ``--prefill-chunk`` it enters a chunk per step, inside the
streams' own steps (``decoding.prefill``). The same requests run both ways; the report gives
the p50/p95/max gap between a short stream's successive deliveries while long requests are in
flight, the long requests' time to first token, and whether the texts are identical.

    python -m rag_lookahead.bench.interference --model default --json interference.json
    python -m rag_lookahead.bench.interference --tiny          # a tiny random model: a smoke run
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import torch
import typer

from rag_lookahead.bench.common import (
    DeviceOption,
    DtypeOption,
    JsonOption,
    ModelOption,
    PromptsOption,
    TrustRemoteCodeOption,
    chat_ids,
    check_output_path,
    check_positive,
    context_fitted_ids,
    dtype_label,
    eos_pad,
    keeps_report_despite_stdout,
    load_bench_model,
    load_prompts,
    print_rows,
    prompts_file,
    refuse_with_tiny,
    run_command,
    write_report,
)
from rag_lookahead.bench.percentile import nearest_rank
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import recalibrate_asked
from rag_lookahead.decoding.inputs import context_limit, limit_words
from rag_lookahead.decoding.loop import DecodeBatch, left_pad
from rag_lookahead.errors import InputError

PROG = "python -m rag_lookahead.bench.interference"
DEFAULT_CHUNK = 512  # the server's default --prefill-chunk


@dataclass
class Mix:
    """The requests of one run: short streams (refilled while long ones are pending) and long ones."""

    shorts: list[list[int]]
    longs: list[list[int]]
    short_slots: int
    short_tokens: int
    long_tokens: int
    arrival_steps: int


@dataclass
class Trace:
    """What one run saw."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)  # seconds between a short stream's deliveries
    first_token: dict[str, float] = field(default_factory=dict)  # long request -> seconds to its first token
    seconds: float = 0.0
    steps: int = 0


class Runner:
    """One run of a mix through one ``DecodeBatch`` (prefill chunked or not)."""

    def __init__(self, model, config: LookaheadConfig, eos: Sequence[int], pad: int, mix: Mix, chunk: int) -> None:
        self.batch = DecodeBatch(model, config, frozenset(eos), None, prefill_chunk=chunk)
        self.mix, self.pad = mix, pad
        self.trace = Trace()
        self.longs = collections.deque(enumerate(mix.longs))
        self.arrived: dict[str, float] = {}  # long key -> when it arrived
        self.last: dict[str, float] = {}  # short key -> time of its last delivery
        self.short_count = 0
        self.next_arrival = mix.arrival_steps  # the streams run alone for the first steps

    @property
    def longs_in_flight(self) -> bool:
        return bool(self.longs) or any(key not in self.trace.outputs for key in self.arrived)

    def run(self) -> Trace:
        """Until every long request is answered and the streams running then have finished."""
        start = time.perf_counter()
        while self.batch.size or self.longs:
            self._retire()
            while self.longs_in_flight and self._shorts_running() < self.mix.short_slots:
                ids = self.mix.shorts[self.short_count % len(self.mix.shorts)]
                self._add(f"short{self.short_count}", ids, self.mix.short_tokens)
                self.short_count += 1
            # the streams first, or the first long request came into an empty batch at step 0
            if self.longs and (self.trace.steps >= self.next_arrival or not self.batch.size):
                index, ids = self.longs.popleft()
                self.next_arrival = self.trace.steps + self.mix.arrival_steps
                self._add(f"long{index}", ids, self.mix.long_tokens)
            if self.batch.size:
                self._step()
        self.trace.seconds = time.perf_counter() - start
        return self.trace

    def _shorts_running(self) -> int:
        waiting = self.batch.prefill.waiting if self.batch.prefill is not None else ()
        return sum(str(row.index).startswith("short") for row in [*self.batch.rows, *waiting])

    def _add(self, key: str, ids: list[int], max_new_tokens: int) -> None:
        if key.startswith("long"):
            self.arrived[key] = time.perf_counter()
        rows = self.batch.add(*left_pad([ids], self.pad), None, max_new_tokens, keys=[key])
        self._delivered(key, rows[0].generated)  # unchunked: the prefill gave the first token

    def _step(self) -> None:
        gained = self.batch.verify_and_accept(self.batch.propose())
        self.batch.raise_row_failure()
        self.trace.steps += 1
        for row, tokens in zip(self.batch.rows, gained):
            self._delivered(row.index, tokens)

    def _delivered(self, key: str, tokens: list[int]) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        if key.startswith("long"):
            self.trace.first_token.setdefault(key, now - self.arrived[key])
        elif key in self.last and self.longs_in_flight:
            self.trace.gaps.append(now - self.last[key])
        self.last[key] = now

    def _retire(self) -> None:
        for row in self.batch.retire():
            self.trace.outputs[row.index] = row.generated


def summary(name: str, chunk: int, trace: Trace) -> dict:
    return {
        "prefill": name,
        "prefill_chunk": chunk,
        "p50_itl_ms": round(1e3 * statistics.median(trace.gaps), 1) if trace.gaps else None,
        "p95_itl_ms": round(1e3 * nearest_rank(trace.gaps, 0.95), 1) if trace.gaps else None,
        "max_itl_ms": round(1e3 * max(trace.gaps), 1) if trace.gaps else None,
        "gaps": len(trace.gaps),
        "long_ttft_s": round(statistics.mean(trace.first_token.values()), 3) if trace.first_token else None,
        "steps": trace.steps,
        "seconds": round(trace.seconds, 2),
    }


def identical(a: dict[str, list[int]], b: dict[str, list[int]]) -> str:
    """How many requests both runs finished gave the same tokens."""
    both = sorted(set(a) & set(b))
    return f"{sum(a[k] == b[k] for k in both)}/{len(both)}"


def real_mix(model: str, dtype: str, device: str | None, trust_remote_code: bool, prompts: str | None, settings: dict):
    """The named model and a mix built from the prompt set: questions alone as the short requests,
    passages joined to about ``long_tokens`` tokens (then a question) as the long ones."""
    prompt_set = load_prompts(prompts)  # a bad file fails before the model loads
    loaded, tokenizer = load_bench_model(model, dtype, device, None, trust_remote_code)
    eos, pad = eos_pad(loaded, tokenizer)
    shorts = context_fitted_ids(
        loaded,
        tokenizer,
        prompt_set,
        settings["short_max_new_tokens"],
        with_context=False,
        flag="--short-max-new-tokens",
    )
    longs = []
    for i in range(settings["long_requests"]):
        contexts, n = [], i
        while True:
            contexts.append(prompt_set[n % len(prompt_set)]["context"])
            n += 1
            joined = {"context": "\n\n".join(contexts), "question": prompt_set[i % len(prompt_set)]["question"]}
            ids = chat_ids(tokenizer, joined)
            if len(ids) >= settings["long_prompt_tokens"] or n - i > 50 * len(prompt_set):
                break
        longs.append(ids)
    check_long_fits(loaded, longs, settings)
    config = LookaheadConfig().with_tokenizer(tokenizer)
    return loaded, eos, pad, shorts, longs, config


def check_long_fits(model, longs: list[list[int]], settings: dict) -> None:
    """Refuse long requests that with their answers pass the model's context, before any timed run
    (the run would stop at the first one, after the short streams were measured)."""
    limit, longest = context_limit(model), max(map(len, longs))
    if limit is not None and longest + settings["long_max_new_tokens"] > limit:
        raise InputError(
            f"--long-tokens {settings['long_prompt_tokens']} built a {longest}-token request; with "
            f"--long-max-new-tokens {settings['long_max_new_tokens']} it passes the model's context "
            f"({limit_words(model, limit)}, prompt and answer together): lower --long-tokens"
        )


def tiny_mix(settings: dict):
    """A tiny random qwen2 (fp32, no tokenizer) and random-token prompts of the same sizes."""
    from rag_lookahead.tiny import VOCAB, build_tiny_model

    model = build_tiny_model("qwen2", max_positions=settings["long_prompt_tokens"] + 1024)
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(1, VOCAB, (count,), generator=generator).tolist()

    shorts = [tokens(20 + 5 * i) for i in range(4)]
    longs = [tokens(settings["long_prompt_tokens"]) for _ in range(settings["long_requests"])]
    return model, [], 0, shorts, longs, LookaheadConfig()


@keeps_report_despite_stdout
def interference(
    model: ModelOption = "default",
    dtype: DtypeOption = "auto",
    device: DeviceOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    prompts: PromptsOption = None,
    tiny: Annotated[
        bool, typer.Option("--tiny", help="a tiny random fp32 model on the CPU, random-token prompts (a smoke run)")
    ] = False,
    short_streams: Annotated[int, typer.Option(help="short requests decoding at any time")] = 3,
    short_max_new_tokens: int = 32,
    long_requests: int = 2,
    long_tokens: Annotated[int, typer.Option(help="about this many prompt tokens per long request")] = 2500,
    long_max_new_tokens: int = 8,
    arrival_steps: Annotated[int, typer.Option(help="a long request arrives every this many decode steps")] = 6,
    prefill_chunk: Annotated[int, typer.Option(help="prompt tokens per step with chunking on")] = DEFAULT_CHUNK,
    no_lookahead: Annotated[bool, typer.Option("--no-lookahead", help="decode one token a step")] = False,
    json_path: JsonOption = None,
) -> dict:
    """Short streams' inter-token latency while long prompts arrive, chunked prefill off and on."""
    check_positive(
        {
            "--short-streams": short_streams,
            "--short-max-new-tokens": short_max_new_tokens,
            "--long-requests": long_requests,
            "--long-tokens": long_tokens,
            "--long-max-new-tokens": long_max_new_tokens,
            "--prefill-chunk": prefill_chunk,
            "--arrival-steps": arrival_steps,  # 0 or below ran as 1, unsaid
        }
    )
    if tiny:
        refuse_with_tiny(
            "--tiny", prompts=prompts, model=model, dtype=dtype, device=device, trust_remote_code=trust_remote_code
        )
    seen = check_output_path(json_path, inputs=[prompts_file(prompts)])
    if not no_lookahead:  # a bad value, said now: the warm-up read it, after the model loaded
        recalibrate_asked()
    settings = {
        "long_requests": long_requests,
        "long_prompt_tokens": long_tokens,
        "long_max_new_tokens": long_max_new_tokens,
        "short_max_new_tokens": short_max_new_tokens,
    }
    loaded, eos, pad, shorts, longs, config = (
        tiny_mix(settings) if tiny else real_mix(model, dtype, device, trust_remote_code, prompts, settings)
    )
    config = config.replace(enabled=not no_lookahead)
    mix = Mix(shorts, longs, short_streams, short_max_new_tokens, long_max_new_tokens, arrival_steps)
    warm = Mix(shorts[:1], [longs[0][:64]], 1, 4, 2, 1)
    Runner(loaded, config, eos, pad, warm, prefill_chunk).run()  # warm-up: kernels, tree-mask probe, costs
    traces = {
        name: Runner(loaded, config, eos, pad, mix, chunk).run() for name, chunk in (("off", 0), ("on", prefill_chunk))
    }
    rows = [summary(name, chunk, traces[name]) for name, chunk in (("off", 0), ("on", prefill_chunk))]
    same = identical(traces["off"].outputs, traces["on"].outputs)
    for row in rows:
        row["identical"] = same
    off, on = rows[0]["p95_itl_ms"], rows[1]["p95_itl_ms"]
    report = {
        "model": "tiny-qwen2" if tiny else model,
        "dtype": "fp32" if tiny else dtype_label(loaded, dtype),  # what ran, not the option ("auto")
        "threads": torch.get_num_threads(),
        "long_prompt_tokens": [len(ids) for ids in longs],
        "short_streams": short_streams,
        "lookahead": config.enabled,
        "p95_itl_reduction": round(off / on, 2) if off and on else None,
        "results": rows,
    }
    print_rows(
        f"{report['model']}: {len(longs)} long prompts of ~{long_tokens} tokens among {short_streams} streams", rows
    )
    print(f"p95 inter-token latency {off} ms -> {on} ms ({report['p95_itl_reduction']}x); texts identical: {same}")
    if json_path:
        write_report(json_path, report, seen=seen)
    return report


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench.interference [options]``: the report (an exit code for --help)."""
    return run_command(interference, argv, PROG)


if __name__ == "__main__":
    main()
