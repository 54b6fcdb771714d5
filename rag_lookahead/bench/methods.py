"""How each batch-1 method is run and timed, and how its runs add up to tokens/s and speedups.

The side-by-side benchmark (:mod:`.single`) and the GPU check's speed section both time
methods this way, so their figures mean the same.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rag_lookahead.bench.kernels import transformers_kernels
from rag_lookahead.decoding.drafter import Drafter, PromptLookupDrafter
from rag_lookahead.decoding.loop import generate
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.decoding.verify import input_device

METHODS = (
    "greedy",
    "prompt_lookup",
    "prompt_lookup_ours",
    "lookahead",
    "lookahead_full_head",
    "lookahead_warm",
    "lookahead_unseeded",
    "greedy_stock",
    "prompt_lookup_stock",
)
#: sampling methods, run once per --temperatures value as ``<method>_t<T>``; each run starts from
#: the same ``torch.manual_seed``, so in fp32 ``sample`` and ``lookahead_sample`` give the same
#: tokens; ``prompt_lookup_sample`` (transformers' prompt lookup, sampling) draws differently, so its
#: tokens match theirs only sometimes (its law is still the model's)
SAMPLING_METHODS = ("sample", "prompt_lookup_sample", "lookahead_sample")
#: transformers' prompt lookup: draft tokens per step (its max_matching_ngram_size stays at its default)
PROMPT_LOOKUP_TOKENS = 10
#: transformers' greedy and prompt lookup on torch's stock kernels (``transformers_kernels``; the model as plain
#: transformers runs it); "greedy" and "prompt_lookup" run on the layout ``load_model`` gives the
#: model, as our loop does (the conservative comparison, and the one the bars are judged by)
STOCK_METHODS = {"greedy_stock": None, "prompt_lookup_stock": PROMPT_LOOKUP_TOKENS}


def prompt_lookup_drafter() -> PromptLookupDrafter:
    """transformers' prompt lookup (its default n-gram size, our token count) as a drafter of our loop."""
    return PromptLookupDrafter(num_pred_tokens=PROMPT_LOOKUP_TOKENS)


def sampling_name(base: str, temperature: float) -> str:
    """``lookahead_sample_t0.7``: a sampling method's name in the tables and the report. The name
    is a label, its temperature as ``:g`` writes it (6 significant digits): runs take the exact
    temperature from the settings (``sampling_runs``), not from the name (0.123456789 ran 0.123457)."""
    return f"{base}_t{temperature:g}"


def sampling_runs(temperatures: Iterable[float]) -> dict[str, tuple[str, float]]:
    """Each sampling method's name at each temperature -> (the method, the exact temperature)."""
    return {sampling_name(base, t): (base, t) for t in temperatures for base in SAMPLING_METHODS}


def sampling_method(method: str) -> tuple[str, float] | None:
    """``("lookahead_sample", 0.7)`` for ``lookahead_sample_t0.7``; None for a greedy method. The
    temperature is the name's, rounded as ``sampling_name`` writes it: enough to name the baselines,
    never the one to sample at (``sampling_runs``)."""
    base, _, temperature = method.rpartition("_t")
    if base in SAMPLING_METHODS:
        return base, float(temperature)
    return None


def baselines(method: str) -> tuple[str, str]:
    """What a method's speed is compared with: transformers' plain decoding and its prompt lookup,
    greedy for greedy methods, sampling at the same temperature for sampling methods."""
    sampled = sampling_method(method)
    if sampled is None:
        return "greedy", "prompt_lookup"
    return sampling_name("sample", sampled[1]), sampling_name("prompt_lookup_sample", sampled[1])


@dataclass
class Run:
    tokens: list[int]
    seconds: float  # end to end, prefill included
    first_token_seconds: float  # until the first new token exists
    forwards: int | None = None  # decode forwards after the prefill (our loop only)
    mean_accepted: float | None = None
    accepted_histogram: dict[int, int] | None = None  # tokens gained in one decode step -> steps (our loop only)
    # tokens that came with the first forward (transformers' prompt lookup may verify drafts there)
    first_tokens: int = 1

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.first_token_seconds


@dataclass
class MethodTotals:
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    identical: int = 0
    compared: int = 0  # runs whose baseline ran (identical counts among them)
    runs: int = 0
    accepted: list[float] = field(default_factory=list)  # per run: tokens per decode forward
    loop_decode_tokens: int = 0  # decode tokens of runs that counted their forwards
    loop_forwards: int = 0

    def add(self, run: Run, identical: bool | None) -> None:
        """One run; ``identical``: its tokens equal its baseline's (None: the baseline did not run)."""
        self.tokens += len(run.tokens)
        self.seconds += run.seconds
        # tokens that arrived with the first forward were paid for by the time before first_token_seconds
        self.decode_tokens += max(len(run.tokens) - run.first_tokens, 0)
        self.decode_seconds += run.decode_seconds
        if identical is not None:
            self.identical += identical
            self.compared += 1
        self.runs += 1
        if run.mean_accepted is not None:
            self.accepted.append(run.mean_accepted)
        if run.forwards:
            self.loop_decode_tokens += max(len(run.tokens) - 1, 0)
            self.loop_forwards += run.forwards

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None
        self.first_tokens = 1

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call carries the prompt
            self.first = time.perf_counter()
            # assisted generation may accept drafts in its prefill forward
            self.first_tokens = max(int(value.numel()), 1)

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf(
    model,
    ids: list[int],
    max_new_tokens: int,
    eos,
    pad,
    prompt_lookup: int | None,
    sampling: dict | None = None,
    stock: bool = False,
) -> Run:
    """transformers' greedy (or, with ``sampling``, its sampling) generate, prompt lookup optional;
    ``stock``: on torch's own kernels (``transformers_kernels``)."""
    x = torch.tensor([ids], device=input_device(model))  # model.device is meta for an offloaded embedding
    clock = FirstTokenClock()
    kwargs = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    kwargs.update(sampling or {"do_sample": False})
    with transformers_kernels(model, stock):
        start = time.perf_counter()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            streamer=clock,
            **kwargs,
        )
        seconds = time.perf_counter() - start
    first = (clock.first or time.perf_counter()) - start
    return Run(out[0, len(ids) :].tolist(), seconds, first, first_tokens=clock.first_tokens)


def run_lookahead(
    model,
    ids,
    max_new_tokens,
    eos,
    pad,
    config,
    references=None,
    pool=None,
    sampling: dict | None = None,
    drafter: Drafter | None = None,
) -> Run:
    """Our loop on one prompt. ``pool``: the output pool to draft from; None gives a fresh one (no
    earlier answers). ``references``: one passage's ids that seed the trie besides the prompt.
    ``drafter``: another drafter than lookahead's tries (``prompt_lookup_ours``)."""
    if drafter is None:
        pool = pool or OutputPool(config.pool_depth)
    start = time.perf_counter()
    result = generate(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        config=config,
        references=[[references]] if references else None,  # one row, one passage
        eos_token_id=eos,
        pad_token_id=pad,
        output_pool=pool,
        drafter=drafter,
        **(sampling or {"do_sample": False}),
    )
    seconds = time.perf_counter() - start
    s = result.stats
    tokens = result.sequences[0, len(ids) :].tolist()
    return Run(tokens, seconds, s.prefill_seconds, s.forward_passes, s.mean_accepted, dict(s.accepted_histogram))


def summarize(totals: dict[str, MethodTotals]) -> dict[str, dict]:
    """Per method: tokens/s, and decode speedups over transformers' plain decoding and its prompt
    lookup (greedy, or sampling at the method's temperature) where they ran."""

    def ratio(t: MethodTotals, base: MethodTotals | None, decode: bool) -> float | None:
        if base is None or not base.runs:
            return None
        if decode:
            ours, theirs = t.decode_tokens_per_second, base.decode_tokens_per_second
        else:
            ours, theirs = t.tokens_per_second, base.tokens_per_second
        return round(ours / theirs, 3) if theirs else None

    return {
        m: {
            "tokens_per_second": round(t.tokens_per_second, 3),
            "decode_tokens_per_second": round(t.decode_tokens_per_second, 3),
            "speedup_e2e": ratio(t, totals.get(baselines(m)[0]), decode=False),
            "speedup_decode": ratio(t, totals.get(baselines(m)[0]), decode=True),
            "vs_prompt_lookup_decode": ratio(t, totals.get(baselines(m)[1]), decode=True),
            "vs_prompt_lookup_stock_decode": ratio(  # the stock baseline is greedy prompt lookup
                t, totals.get("prompt_lookup_stock") if sampling_method(m) is None else None, decode=True
            ),
            # tokens per decode forward over all runs (ratio of sums), as the batch benchmark counts it;
            # the unweighted mean of the runs' own ratios is kept apart: short answers weigh as much as long ones
            "mean_accepted": round(t.loop_decode_tokens / t.loop_forwards, 3) if t.loop_forwards else None,
            "mean_accepted_per_run": round(statistics.mean(t.accepted), 3) if t.accepted else None,
            "identical_to_greedy": f"{t.identical}/{t.compared}" if t.compared else None,
            "new_tokens": t.tokens,
        }
        for m, t in totals.items()
        if t.runs
    }
