"""The decoding engine shared by the LangChain wrappers (:class:`LookaheadLLM`, :class:`ChatLookahead`).

Everything between "token ids in" and "text out" that both need lives here once: EOS and pad ids
(read from the model and tokenizer, never written into the caller's tokenizer), passages registered
ahead as draft seeds, stop strings over accepted token blocks (:class:`TextTracker`), one batched
:func:`rag_lookahead.decoding.loop.generate` call with per-block callbacks, streaming from a worker
thread, and the per-row stats. An :class:`Engine` owns the output pool, so wrappers that share an
engine share what earlier answers taught the drafter. The settings of a call (sampling fields,
draft settings) are read in :mod:`.sampling_fields`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rag_lookahead.checks import is_unicode, unicode_text
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.errors import ConfigError
from rag_lookahead.tokens import TextTracker, chat_template_text, eos_ids, pad_id

__all__ = [
    "Block",
    "BlockStream",
    "Engine",
    "EngineRun",
    "RowRequest",
    "SeedRegistry",
    "CancellableAsync",
    "EngineAccess",
    "prompt_format",
    "weights_digest",
]

SEED_SLOTS = 256


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
        passages = [p for p in passages if p and is_unicode(p)]  # a lone surrogate failed every later call
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


def check_loaded(model, tokenizer) -> None:
    """A loaded model and its tokenizer, not names: ``LookaheadLLM(model="default", tokenizer=...)``
    was taken, then every call failed with "'str' object has no attribute 'config'" (a tokenizer
    given as text: "'add_special_tokens' is an invalid keyword argument for encode()")."""
    if isinstance(model, (str, bytes, os.PathLike)) or not (hasattr(model, "config") and callable(model)):
        raise ConfigError(
            f"model must be a loaded model (a transformers PreTrainedModel), got {type(model).__name__}: for a"
            " model id or folder use LookaheadLLM.from_model_id(...) or ChatLookahead(model=...) without a tokenizer"
        )
    if isinstance(tokenizer, (str, bytes, os.PathLike)) or not all(
        callable(getattr(tokenizer, name, None)) for name in ("encode", "decode")
    ):
        raise ConfigError(
            f"tokenizer must be the model's loaded tokenizer (e.g. AutoTokenizer.from_pretrained(...)),"
            f" got {type(tokenizer).__name__}"
        )


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
        return "eos" if _ended(tracker, self.eos) else "length"

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


OnBlock = Callable[[int, list[int], str], "bool | None"]

#: the runs (Engine._current) that the current context decodes inside: their token callbacks, and
#: threads or tasks those start with a copy of the context, see them (Engine._check_not_nested)
#: how often a call waiting for the engine looks at its cancel (the wait itself ends at once)
_CANCEL_POLL_S = 0.05

_DECODING: contextvars.ContextVar[frozenset] = contextvars.ContextVar("rag_lookahead_decoding", default=frozenset())


def pool_shape(config: LookaheadConfig) -> tuple[int, int]:
    """The output pool's (depth, max_nodes) for ``config``."""
    return config.pool_depth, config.output_pool_nodes


class Engine:
    """A model, its tokenizer and an output pool: what LookaheadLLM and ChatLookahead decode with.

    One decode runs at a time (calls from other threads wait their turn): the output pool and the
    step-cost estimates are shared state, and rows that should run together go into one batched
    call (``batch``) instead.
    """

    def __init__(
        self, model, tokenizer, config: LookaheadConfig | None = None, output_pool: OutputPool | None = None
    ) -> None:
        if model is None or tokenizer is None:
            raise ConfigError("the engine needs a model and a tokenizer")
        check_loaded(model, tokenizer)
        config = config or LookaheadConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_ids(model, tokenizer))
        self.pad = pad_id(model, tokenizer, self.eos)
        self.output_pool = output_pool if output_pool is not None else OutputPool(*pool_shape(config))
        self.seeds = SeedRegistry()
        self._decoding = threading.Lock()
        self._current: object | None = None  # the run holding ``_decoding``, for _check_not_nested

    def passages(self, passages: Sequence[str]) -> list[list[int]]:
        """Draft seeds in tokens. They change the speed, never the text: one that is not valid
        Unicode (a lone surrogate; the tokenizer raised a bare TypeError) is left out."""
        return [self.token_ids(p) for p in passages if p and is_unicode(p)]

    def token_ids(self, text: str) -> list[int]:
        """``text`` in this model's tokens (no special tokens added). A passage past the context is no
        error (it only seeds drafts; prompts are judged by decoding.inputs): no transformers warning."""
        return list(self.tokenizer.encode(unicode_text(text, "the text is"), add_special_tokens=False, verbose=False))

    @property
    def fingerprint(self) -> str:
        """:func:`weights_digest` of the model as it is now: taken once, an answer cached before the
        weights were edited in place (a merged adapter) was served after it."""
        return weights_digest(self.model)

    def run(
        self,
        rows: Sequence[RowRequest],
        *,
        max_new_tokens: int,
        config: LookaheadConfig,
        sampling: Mapping[str, Any],
        on_block: OnBlock | None = None,
        cancel: threading.Event | None = None,
        timeout: float | None = None,
    ) -> EngineRun:
        """One batched ``generate`` over ``rows``; ``on_block(row, tokens, piece)`` sees each accepted block
        (a true return ends that row there).

        ``cancel`` ends every row at its next block; set by the time this run holds the engine (its
        caller was cancelled while it waited for another decode), it ends the run there with
        ``CancelledError``, before any forward: the cancelled call ran its whole prefill first (a
        minute for a long prompt on a CPU), holding up every call after it. ``timeout`` (seconds,
        counted from when this run holds the engine, not while it waits) ends the rows still
        running then, marked ``stopped_by="timeout"``.
        """
        from rag_lookahead.decoding.loop import generate, left_pad

        trackers = [TextTracker(self.tokenizer, r.stop, self.eos, prefix=r.answer_prefix, hold=r.hold) for r in rows]
        steps = [0] * len(rows)
        timed_out = [False] * len(rows)
        deadline: float | None = None

        def on_tokens(row: int, tokens: list[int]) -> bool:
            steps[row] += 1
            tracker = trackers[row]
            piece = tracker.add(tokens)
            if on_block is not None and on_block(row, tokens, piece):
                return True  # the row's caller is done with it (its callback failed)
            if deadline is not None and time.monotonic() >= deadline:
                timed_out[row] = True
                return True
            return tracker.stopped or (cancel is not None and cancel.is_set())

        def stop_check(row: int, drawn: list[int]) -> bool:  # the row ends at a stop string: no draw past it
            return trackers[row].would_stop(drawn)

        ids, mask = left_pad([r.ids for r in rows], self.pad)
        references = [r.references for r in rows]
        self._check_not_nested()
        this_run = object()
        with self._held(cancel):
            self._current = this_run
            inside = _DECODING.set(_DECODING.get() | {this_run})
            try:
                if timeout is not None:
                    deadline = time.monotonic() + timeout
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
                    stop_check=stop_check if any(t.stop for t in trackers) else None,
                    **sampling,
                )
            finally:
                _DECODING.reset(inside)
                self._current = None
        timed_out = [
            t and not trackers[i].stopped and not _ended(trackers[i], self.eos) for i, t in enumerate(timed_out)
        ]
        return EngineRun(trackers, steps, result, config.enabled, [len(r.ids) for r in rows], self.eos, timed_out)

    def _check_not_nested(self) -> None:
        """Refuse a decode asked for from inside this engine's running decode (a token callback that
        calls a model on this engine, in its own thread or in a thread or task started with its
        context): it would wait for the engine forever. Letting it decode there instead is not safe
        (some models keep state between calls; the output pool and step-cost estimates assume one decode at a time)."""
        if self._current is not None and self._current in _DECODING.get():
            raise ConfigError(
                "a model cannot be called from its own token callback (on_llm_new_token) while it decodes: "
                "it would wait for itself forever; call it after invoke() returns, or use stream() (whose "
                "callbacks run in the caller's thread)"
            )

    @contextlib.contextmanager
    def _held(self, cancel: threading.Event | None) -> Iterator[None]:
        """The engine, once the decode before this one ends. A caller cancelled meanwhile (its
        ``cancel`` set) stops waiting then and there with ``CancelledError``, before any forward: it
        ran its whole prefill once it had the engine (a minute for a long prompt on a CPU), and
        until then kept a worker thread of the event loop's executor waiting for nothing."""
        if cancel is None:
            self._decoding.acquire()
        else:
            while not self._decoding.acquire(timeout=_CANCEL_POLL_S):
                if cancel.is_set():
                    raise asyncio.CancelledError()
            if cancel.is_set():
                self._decoding.release()
                raise asyncio.CancelledError()  # its caller is gone: no answer to build
        try:
            yield
        finally:
            self._decoding.release()

    def stream(
        self, rows: Sequence[RowRequest], cancel: threading.Event | None = None, **run_options: Any
    ) -> BlockStream:
        """Like :meth:`run`, decoding in a worker thread while the caller iterates the blocks
        (``cancel``: see :class:`BlockStream`)."""
        return BlockStream(
            lambda on_block, cancel: self.run(rows, on_block=on_block, cancel=cancel, **run_options), cancel
        )


#: values sampled from each parameter for :func:`weights_digest`, spread over the whole tensor
DIGEST_SAMPLE = 64


def weights_digest(model) -> str:
    """A short digest of a model's config and a sample of every one of its weights. LangChain's
    cache keys an answer by the model's identifying params, and two loaded models may report the
    same name ("custom", or two folders both called "final"): the digest tells them apart. Every
    parameter counts (three of them did: a LoRA merged into the attention's values and the MLPs
    shared the base model's answers), ``DIGEST_SAMPLE`` values each, spread over its rows and columns,
    so a dense edit (a merged adapter, a rescaled layer) changes it; ~3 ms for the default model.
    A weight offloaded to ``meta`` counts by its shape only."""
    import torch

    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    digest.update((config.to_json_string() if hasattr(config, "to_json_string") else repr(config)).encode())
    params = list(model.parameters()) if hasattr(model, "parameters") else []  # a tied weight once
    spots: dict[torch.Size, tuple] = {}
    samples: dict[object, list] = {}  # by device: one copy to the host each, not one per weight (a GPU sync)
    for param in params:
        digest.update(f"{tuple(param.shape)}:{param.dtype}".encode())
        if param.device.type == "meta":  # offloaded (accelerate's hooks bring it in): its shape only
            continue
        # spread over the flat index, so over rows and columns (a stride of numel // 64 kept to
        # column 0 where the rows are a multiple of 64); gathered where they lie, without a copy
        # of a non-contiguous weight
        if param.shape not in spots:  # the same shapes recur layer after layer
            flat = torch.linspace(0, max(param.numel() - 1, 0), min(DIGEST_SAMPLE, param.numel())).round().long()
            spots[param.shape] = torch.unravel_index(flat, param.shape) if param.dim() else ()
        samples.setdefault(param.device, []).append(param.detach()[spots[param.shape]].reshape(-1))
    for device_samples in samples.values():
        digest.update(torch.cat([v.float() for v in device_samples]).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def prompt_format(tokenizer) -> str:
    """A short digest of what, besides the weights, turns a text into prompt ids: the tokenizer's
    kind, source, vocabulary size, special tokens and chat template. For the cache keys: two models
    on the same weights with another template or tokenizer shared answers."""
    parts = (
        type(tokenizer).__name__,
        str(getattr(tokenizer, "name_or_path", "")),
        str(len(tokenizer)) if hasattr(tokenizer, "__len__") else "",
        repr(sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())),
        chat_template_text(tokenizer) or "",
    )
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


class CancellableAsync:
    """LangChain's ``_agenerate`` and ``_astream`` for both models: their ``_decode(inputs, stop,
    run_manager, kwargs, cancel)`` in a worker thread, and each ``next()`` of their
    ``_decode_stream(inputs, stop, run_manager, kwargs, cancel)`` there. LangChain's defaults run
    ``_generate`` and ``_stream`` there too, but a cancelled caller (``asyncio.wait_for``, a client
    gone) left the decode running to its token limit while it held the engine; here ``cancel`` is
    set and the decode ends at its next block (before any forward if it still waits for the engine)."""

    async def _agenerate(self, inputs: list, stop: list[str] | None = None, run_manager=None, **kwargs: Any):
        manager = run_manager.get_sync() if run_manager is not None else None
        return await in_worker_cancellable(self._decode, inputs, stop, manager, kwargs)

    async def _astream(self, inputs: Any, stop: list[str] | None = None, run_manager=None, **kwargs: Any):
        """The chunks of ``_decode_stream``, each ``next()`` in a worker thread as LangChain's default
        does. That default set the stream's cancel only once the ``next()`` under way returned: a
        consumer cancelled while the call still waited for another decode ran its whole prefill and a
        step once it had the engine (a minute for a long prompt on a CPU), holding up every call after
        it. Here a cancelled consumer, or one that leaves the loop, sets ``cancel`` at once."""
        manager = run_manager.get_sync() if run_manager is not None else None
        cancel = threading.Event()
        chunks = self._decode_stream(inputs, stop, manager, kwargs, cancel)
        done = object()
        try:
            while (chunk := await in_worker(next, chunks, done, cancel=cancel)) is not done:
                yield chunk
        finally:
            cancel.set()  # a consumer gone between chunks: the decode ends at its next block

    async def abatch_as_completed(
        self, inputs: Sequence, config=None, *, return_exceptions: bool = False, **kwargs: Any
    ) -> AsyncIterator[tuple[int, Any]]:
        """LangChain's: ``ainvoke`` on every input (at most ``max_concurrency`` at a time), each
        ``(index, answer)`` yielded as it comes. A consumer that is cancelled or leaves the loop
        cancels the calls not yet answered, so their decodes end at the next block as a cancelled
        ``ainvoke``'s does; LangChain's left them running, each to its token limit, holding the engine."""
        from langchain_core.runnables.config import get_config_list

        if not inputs:
            return
        configs = get_config_list(config, len(inputs))
        limit = configs[0].get("max_concurrency")
        gate = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()

        async def answer(i: int) -> tuple[int, Any]:
            async with gate:
                try:
                    return i, await self.ainvoke(inputs[i], configs[i], **kwargs)
                except Exception as err:
                    if not return_exceptions:
                        raise
                    return i, err

        calls = [asyncio.ensure_future(answer(i)) for i in range(len(inputs))]
        try:
            for call in asyncio.as_completed(calls):
                yield await call
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)  # a failed call's error was seen, not left unread


async def in_worker_cancellable(work: Callable[..., Any], *args: Any) -> Any:
    """``work(*args, cancel)`` in a worker thread; a cancelled caller sets ``cancel``, so the
    decode it runs ends at its next block instead of running on, holding the engine."""
    cancel = threading.Event()
    return await in_worker(work, *args, cancel, cancel=cancel)


async def in_worker(work: Callable[..., Any], *args: Any, cancel: threading.Event) -> Any:
    """``work(*args)`` in a worker thread (LangChain's executor, with the caller's context); a
    cancelled caller sets ``cancel``, which the decode ``work`` runs or waits for looks at."""
    from langchain_core.runnables.config import run_in_executor

    try:
        return await run_in_executor(None, work, *args)
    except asyncio.CancelledError:
        cancel.set()
        raise


class EngineAccess:
    """What both models hand out of their engine (``self._engine``): token ids, the output pool,
    and seeds registered ahead."""

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids by this model's tokenizer (LangChain's fallback fetches GPT-2's from the hub), or
        by ``custom_get_token_ids`` where one is given, as LangChain's own models count."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self._engine.token_ids(text)

    @property
    def output_pool(self) -> OutputPool:
        return self._engine.output_pool

    def register_seeds(self, anchors: Sequence[str], passages: Sequence[str]) -> None:
        """Seed any later prompt that contains every string in ``anchors`` (a chat model's: its
        messages) with ``passages``.

        Used when the chain cannot pass ``references`` to the model (``RetrievalQA``): the retriever
        registers the passages it kept out of the prompt, keyed by the ones it put in (see
        :class:`rag_lookahead.rag.chains.SeedingRetriever`).
        """
        self._engine.seeds.register(anchors, passages)


class NotPickled:
    """Both models refuse ``pickle``, ``copy.deepcopy`` and ``model_copy(deep=True)`` at once: they
    hold a loaded model and its engine (locks, output pool), and pickle wrote every weight (1.27 GB
    for the default model) before failing on a lock, with no word of why."""

    def __reduce__(self):
        raise TypeError(
            f"{type(self).__name__} does not pickle or deep-copy: it holds a loaded model and its decoding engine "
            "(locks, output pool). Share the object (it is thread-safe), use model_copy() for a shallow copy with "
            "other settings, or build another on the same loaded model in the other process"
        )

    def __deepcopy__(self, memo=None):
        self.__reduce__()


def _ended(tracker: TextTracker, eos: frozenset[int]) -> bool:
    return bool(tracker.ids) and tracker.ids[-1] in eos


class BlockStream:
    """Iterate the accepted blocks of a run decoding in a worker thread; ``.run`` holds the outcome.

    Closing the generator early (an exception in the loop, ``close()``, or a ``break`` out of a
    loop over a stream held nowhere else, which Python then closes) cancels the decode at its next
    block and waits for the worker, so no thread outlives the iteration. A stream kept in a
    variable is not closed by a ``break``: its worker decodes on, holding the engine, until it is
    closed or collected. ``cancel``
    (one of the caller's own) lets another thread end the decode while the consumer waits for a
    block: ``astream``'s cancelled consumer, while the run still waits for the engine.
    """

    def __init__(
        self, start: Callable[[OnBlock, threading.Event], EngineRun], cancel: threading.Event | None = None
    ) -> None:
        self._start = start
        self._cancel = cancel
        self.run: EngineRun | None = None

    def __iter__(self) -> Iterator[Block]:
        cancel = self._cancel if self._cancel is not None else threading.Event()
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

        # the caller's context: a stream started from a token callback is refused, not left waiting
        worker = threading.Thread(
            target=contextvars.copy_context().run, args=(work,), name="lookahead-stream", daemon=True
        )
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
