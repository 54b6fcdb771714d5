"""The decoding engine shared by the LangChain wrappers (:class:`LookaheadLLM`, :class:`ChatLookahead`).

Everything between "text in" and "text out" that both need lives here once: EOS and pad ids
(read from the model and tokenizer, never written into the caller's tokenizer), prompt encoding
through the chat template (with tools where the template takes them), passages registered
ahead as draft seeds, sampling and draft settings per call, stop strings over accepted token
blocks (:class:`TextTracker`), one batched :func:`rag_lookahead.generate.generate` call with
per-block callbacks, streaming from a worker thread, and the per-row stats. An
:class:`Engine` owns the output pool, so wrappers that share an engine share what earlier
answers taught the drafter.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from .config import LookaheadConfig
from .errors import ConfigError, InputError
from .trie import OutputPool

__all__ = [
    "SAMPLING_FIELDS",
    "Block",
    "BlockStream",
    "Engine",
    "EngineRun",
    "RowRequest",
    "TextTracker",
    "chat_template_text",
    "cut_at_stop",
    "eos_ids",
    "pad_id",
    "resolve_config",
    "sampling_options",
    "settings_error",
]

REPLACEMENT = "\ufffd"
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
SEED_SLOTS = 256


# ---------------------------------------------------------------- text from accepted blocks


class TextTracker:
    """Turns a row's accepted token blocks into stable text pieces, honouring stop strings.

    The whole answer so far is decoded each time and only the new suffix is emitted, so a
    multi-byte character split over tokens is never emitted half (a trailing U+FFFD is held
    back), and text that might be the start of a stop string is held back until it is decided.

    ``prefix``: answer text the prompt already holds (a forced opening such as ``<tool_call>``);
    it is part of the text but never searched for stop strings. ``hold``: markers from which
    on nothing is emitted while decoding goes on (a tool call is handed over whole, at the end).
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] | None,
        eos: frozenset[int],
        *,
        prefix: str = "",
        hold: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.eos = eos
        self.prefix = prefix
        self.hold = [h for h in hold if h]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def text(self) -> str:
        ids = [t for t in self.ids if t not in self.eos]
        return self.prefix + self.tokenizer.decode(ids, skip_special_tokens=True)

    def final_text(self) -> str:
        text = self.text()
        return self.prefix + cut_at_stop(text[len(self.prefix) :], self.stop)

    def add(self, tokens: Sequence[int]) -> str:
        """Take a block of accepted tokens; return the newly stable text (may be "")."""
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in tokens)
        text = self.text()
        answer = text[len(self.prefix) :]
        cut = cut_at_stop(answer, self.stop)
        if len(cut) < len(answer):
            self.stopped = True
            stable = self.prefix + cut
        else:
            stable = text.rstrip(REPLACEMENT)
            stable = stable[: len(stable) - held_back(stable[len(self.prefix) :], self.stop)]
        stable = _before_hold(stable, self.hold)
        if not stable.startswith(self.emitted) or len(stable) <= len(self.emitted):
            return ""
        piece = stable[len(self.emitted) :]
        self.emitted = stable
        return piece

    def rest(self) -> str:
        """What is left to emit once the row is done: the final text minus what was emitted."""
        final = self.final_text()
        piece = final[len(self.emitted) :] if final.startswith(self.emitted) else ""
        self.emitted = final
        return piece


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first stop string in it (all of it when none occurs)."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


def held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _before_hold(text: str, hold: Sequence[str]) -> str:
    """``text`` up to the first hold marker, less a suffix that may be the start of one."""
    if not hold:
        return text
    text = cut_at_stop(text, hold)
    return text[: len(text) - held_back(text, hold)]


# ---------------------------------------------------------------- token plumbing


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends an answer: the model's generation config and the tokenizer's EOS."""
    ids: set[int] = set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen, int):
        ids.add(gen)
    elif gen is not None:
        ids.update(int(t) for t in gen)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def pad_id(model, tokenizer, eos: frozenset[int] | set[int]) -> int:
    """The id to left-pad batches with, read without setting ``tokenizer.pad_token``.

    Padded positions are masked out, so any id in the vocabulary serves; the tokenizer's pad,
    then the model's, then an EOS id.
    """
    for candidate in (tokenizer.pad_token_id, getattr(getattr(model, "generation_config", None), "pad_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return min(eos) if eos else 0


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template source ("" without one; named templates joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def encode_messages(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    answer_prefix: str = "",
) -> list[int]:
    """Prompt ids for chat ``messages`` (role/content dicts) through the chat template.

    ``tools`` go to the template (a template that never reads them is refused, not ignored);
    ``answer_prefix`` is text the assistant's turn starts with. A tokenizer without a chat
    template gets the contents joined by blank lines.
    """
    template = chat_template_text(tokenizer)
    if not template:
        if tools:
            raise ConfigError("this tokenizer has no chat template, so it cannot be given tools")
        text = "\n\n".join(str(m.get("content") or "") for m in messages)
        return list(tokenizer(text + answer_prefix)["input_ids"])
    if tools and "tools" not in template:
        raise ConfigError("this model's chat template does not take tools: bind tools only to a model whose template does")
    extra = {"tools": list(tools)} if tools else {}
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **extra)
    except Exception as err:  # jinja's TemplateError and friends: say what the template refused
        raise InputError(f"the chat template refused these messages: {err}") from None
    return list(tokenizer(text + answer_prefix, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------- per-call settings


def resolve_config(default: LookaheadConfig, kwargs: dict) -> LookaheadConfig:
    """The draft settings of one call: ``lookahead=`` and ``enable_lookahead=`` (popped) over ``default``."""
    enable = kwargs.pop("enable_lookahead", None)
    config = kwargs.pop("lookahead", None) or default
    if not isinstance(config, LookaheadConfig):
        raise ConfigError("lookahead must be a LookaheadConfig")
    if enable is not None:
        config = config.replace(enabled=bool(enable))
    return config


def sampling_options(model, values: Mapping[str, Any]) -> dict:
    """``generate``'s sampling keywords from our fields (temperature None or 0: greedy).

    Bad values raise :class:`ConfigError` here, before any decoding.
    """
    from .sampling import resolve_sampling

    values = dict(values)
    temperature = values.pop("temperature", None)
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0):
        raise ConfigError(f"temperature must be a number >= 0, got {temperature!r}")
    sample = bool(temperature)
    seed = values.pop("seed", None)
    options = {"do_sample": sample, "temperature": temperature if sample else None, **values}
    resolve_sampling(model, **options)  # raises ConfigError on a bad value
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    return options | {"seed": seed}


def settings_error(owner: str, err: Exception) -> Exception:
    """Our own error back out of pydantic's wrapping, or a one-line :class:`ConfigError`.

    Pydantic wraps a ``ValueError`` raised while a model is built (our ``ConfigError`` is one)
    into a multi-line ``ValidationError``; callers should get the error we raised.
    """
    details = err.errors() if hasattr(err, "errors") else []
    for detail in details:
        original = (detail.get("ctx") or {}).get("error")
        if isinstance(original, (ConfigError, InputError)):
            return original
    if details:
        where = ".".join(str(part) for part in details[0].get("loc", ())) or "settings"
        return ConfigError(f"invalid {owner} setting {where}: {details[0].get('msg', err)}")
    return err


def check_max_tokens(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


# ---------------------------------------------------------------- seeds registered ahead


class SeedRegistry:
    """Passages keyed by the texts (anchors) of the prompt they belong to, newest first.

    For chains that cannot pass ``references`` per call (``RetrievalQA``, an LCEL prompt piped
    into the model): the retrieval step registers the passages it kept out of the prompt, keyed
    by the ones it put in, and the engine finds them again in the prompt.
    """

    def __init__(self, slots: int = SEED_SLOTS) -> None:
        self.slots = slots
        self._seeds: OrderedDict[tuple[str, ...], list[str]] = OrderedDict()
        self._lock = threading.Lock()

    def register(self, anchors: Sequence[str], passages: Sequence[str]) -> None:
        anchors = tuple(a for a in anchors if a)
        passages = [p for p in passages if p]
        if not anchors or not passages:
            return
        with self._lock:
            self._seeds[anchors] = passages
            self._seeds.move_to_end(anchors)
            while len(self._seeds) > self.slots:
                self._seeds.popitem(last=False)

    def lookup(self, prompt: str) -> list[str]:
        with self._lock:
            for anchors in reversed(self._seeds):
                if all(a in prompt for a in anchors):
                    return list(self._seeds[anchors])
        return []


# ---------------------------------------------------------------- the engine


@dataclass
class RowRequest:
    """One prompt of a batched run."""

    ids: list[int]
    stop: Sequence[str] | None = None
    references: list[list[int]] = field(default_factory=list)
    answer_prefix: str = ""  # already at the end of ``ids``; part of the answer text
    hold: Sequence[str] = ()  # markers after which no text is streamed (see TextTracker)


@dataclass
class Block:
    """Tokens one row gained in one step, and the text that became stable with them."""

    row: int
    tokens: list[int]
    piece: str


@dataclass
class EngineRun:
    """What a batched run left: each row's tracker and step count, and generate's result."""

    trackers: list[TextTracker]
    steps: list[int]
    result: Any  # GenerationResult
    lookahead: bool
    prompt_tokens: list[int]
    eos: frozenset[int]
    timed_out: list[bool]

    def stopped_by(self, row: int) -> str:
        tracker = self.trackers[row]
        if tracker.stopped:
            return "stop"
        if self.timed_out[row]:
            return "timeout"
        return "eos" if tracker.ids and tracker.ids[-1] in self.eos else "length"

    def info(self, row: int) -> dict:
        """The row's stats, as LookaheadLLM's ``generation_info`` has always given them."""
        tracker, stats = self.trackers[row], self.result.stats
        tokens = len(tracker.ids)
        decode_steps = max(self.steps[row] - 1, 0)  # the first block comes from the prefill
        return {
            "new_tokens": tokens,
            "forward_passes": decode_steps,
            "mean_accepted": round((tokens - 1) / decode_steps, 4) if decode_steps else 0.0,
            "tokens_per_second": round(stats.decode_tokens_per_second, 3),
            "prefill_seconds": round(stats.prefill_seconds, 4),
            "decode_seconds": round(stats.decode_seconds, 4),
            "batch_size": stats.rows,
            "stopped_by": self.stopped_by(row),
            "lookahead": self.lookahead,
        }


OnBlock = Callable[[int, list[int], str], None]


class Engine:
    """A model, its tokenizer and an output pool: what LookaheadLLM and ChatLookahead decode with.

    One decode runs at a time (calls from other threads wait their turn): the output pool and the
    step-cost estimates are shared state, and rows that should run together go into one batched
    call (``batch``) instead.
    """

    def __init__(self, model, tokenizer, config: LookaheadConfig | None = None) -> None:
        if model is None or tokenizer is None:
            raise ConfigError("the engine needs a model and a tokenizer")
        config = config or LookaheadConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_ids(model, tokenizer))
        self.pad = pad_id(model, tokenizer, self.eos)
        self.output_pool = OutputPool(config.branch_length + config.max_key_length, config.output_pool_nodes)
        self.seeds = SeedRegistry()
        self._decoding = threading.Lock()

    def passages(self, passages: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer.encode(p, add_special_tokens=False) for p in passages if p]

    def run(
        self,
        rows: Sequence[RowRequest],
        *,
        max_new_tokens: int,
        config: LookaheadConfig,
        sampling: Mapping[str, Any],
        on_block: OnBlock | None = None,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
    ) -> EngineRun:
        """One batched ``generate`` over ``rows``; ``on_block(row, tokens, piece)`` sees each accepted block.

        ``cancel`` ends every row at its next block; ``deadline`` (``time.monotonic()``) ends
        the rows still running then, marked ``stopped_by="timeout"``.
        """
        from .generate import generate, left_pad

        trackers = [
            TextTracker(self.tokenizer, r.stop, self.eos, prefix=r.answer_prefix, hold=r.hold) for r in rows
        ]
        steps = [0] * len(rows)
        timed_out = [False] * len(rows)

        def on_tokens(row: int, tokens: list[int]) -> bool:
            steps[row] += 1
            tracker = trackers[row]
            piece = tracker.add(tokens)
            if on_block is not None:
                on_block(row, tokens, piece)
            if deadline is not None and time.monotonic() >= deadline:
                timed_out[row] = True
                return True
            return tracker.stopped or (cancel is not None and cancel.is_set())

        ids, mask = left_pad([r.ids for r in rows], self.pad)
        references = [r.references for r in rows]
        with self._decoding:
            result = generate(
                self.model,
                ids,
                mask,
                max_new_tokens=max_new_tokens,
                config=config,
                references=references if any(references) else None,
                eos_token_id=sorted(self.eos),
                pad_token_id=self.pad,
                output_pool=self.output_pool,
                on_tokens=on_tokens,
                **sampling,
            )
        timed_out = [t and not trackers[i].stopped and not _ended(trackers[i], self.eos) for i, t in enumerate(timed_out)]
        return EngineRun(trackers, steps, result, config.enabled, [len(r.ids) for r in rows], self.eos, timed_out)

    def stream(self, rows: Sequence[RowRequest], **run_options: Any) -> "BlockStream":
        """Like :meth:`run`, decoding in a worker thread while the caller iterates the blocks."""
        return BlockStream(lambda on_block, cancel: self.run(rows, on_block=on_block, cancel=cancel, **run_options))


def _ended(tracker: TextTracker, eos: frozenset[int]) -> bool:
    return bool(tracker.ids) and tracker.ids[-1] in eos


class BlockStream:
    """Iterate the accepted blocks of a run decoding in a worker thread; ``.run`` holds the outcome.

    Leaving the loop early (``break``, an exception, a closed generator) cancels the decode
    at its next block and waits for the worker, so no thread outlives the iteration.
    """

    def __init__(self, start: Callable[[OnBlock, threading.Event], EngineRun]) -> None:
        self._start = start
        self.run: EngineRun | None = None

    def __iter__(self) -> Iterator[Block]:
        cancel = threading.Event()
        feed: queue.Queue = queue.Queue()
        box: dict = {}

        def on_block(row: int, tokens: list[int], piece: str) -> None:
            feed.put(Block(row, list(tokens), piece))

        def work() -> None:
            try:
                box["run"] = self._start(on_block, cancel)
            except BaseException as e:  # handed to the consumer
                box["error"] = e
            finally:
                feed.put(None)

        worker = threading.Thread(target=work, name="lookahead-stream", daemon=True)
        worker.start()
        try:
            while (block := feed.get()) is not None:
                yield block
        finally:
            cancel.set()
            worker.join()
        if "error" in box:
            raise box["error"]
        self.run = box["run"]
