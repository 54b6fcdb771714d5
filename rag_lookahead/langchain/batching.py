"""``ChatLookahead.batch``: every input through ``invoke`` in its own thread, all decoded in one ``generate``.

LangChain's ``batch`` runs ``invoke`` per input in a thread pool, which would decode the inputs one
by one. Here each worker thread holds a :class:`Seat` at one :class:`Gather`; its ``_generate``
hands its row over (:meth:`Gather.submit`) and waits, and the last row to arrive decodes them all
together, one ``generate`` per group of identical settings (:func:`settings_key`). Callbacks,
tracing and caching still run per input, as LangChain does them. The seat belongs to the one
``invoke`` the worker was started for (its run id): another model's call made in that thread
meanwhile (a callback's) decodes on its own engine, as it would anywhere else.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from asyncio import CancelledError
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.utils.uuid import uuid7

from rag_lookahead.errors import ConfigError
from rag_lookahead.langchain.engine import Engine, EngineRun, RowRequest

__all__ = [
    "BatchCall",
    "Gather",
    "Seat",
    "decode_together",
    "gather_of_this_thread",
    "run_wave",
    "settings_key",
    "wave_width",
]


def wave_width(max_concurrency: Any, count: int) -> int:
    """How many of a batch's ``count`` inputs decode together: ``max_concurrency``, or all of them
    where it is None or 0. Anything but an integer >= 0 is refused: a negative one made no wave
    at all, and the batch answered ``[]``."""
    if max_concurrency is None or (max_concurrency == 0 and type(max_concurrency) is int):
        return count
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be an integer >= 1 (or None: no limit), got {max_concurrency!r}")
    return max_concurrency


@dataclass
class BatchCall:
    """One row's request inside a batch: what to decode and how, and where its result goes."""

    request: RowRequest
    settings: dict
    key: tuple
    on_block: Callable[[list[int], str], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    run: EngineRun | None = None
    row: int = 0
    error: BaseException | None = None


class Gather:
    """The rows of one ``batch()`` call, met from their worker threads and decoded together.

    Each worker either hands its row over (:meth:`submit`, from ``_generate``) or says it has
    none (:meth:`leave`: a cache hit, an error, a streamed row). When every worker has done one
    or the other, the last to arrive decodes all the rows in one ``generate`` per group of
    identical settings, and the others wake up with their results.
    """

    def __init__(self, engine: Engine, size: int, cancel: threading.Event | None = None) -> None:
        self.engine = engine
        self.size = size
        self.cancel = cancel
        self.calls: list[BatchCall] = []
        self.left = 0
        self.fired = False
        self.lock = threading.Lock()

    def submit(self, call: BatchCall) -> None:
        with self.lock:
            late = self.fired
            if not late:
                self.calls.append(call)
            leader = not late and self._ready()
        if late and self.cancel is not None and self.cancel.is_set():  # the caller gave up: no prefill for it
            call.error = CancelledError()
            call.done.set()
        elif late:
            decode_together(self.engine, [call], self.cancel)
        elif leader:
            self._decode_all()
        call.done.wait()

    def leave(self) -> None:
        with self.lock:
            self.left += 1
            leader = self._ready()
        if leader:
            self._decode_all()

    def abandon(self, error: BaseException) -> None:
        """The batch's caller gave up (Ctrl-C): rows waiting for workers that will never come get
        ``error`` now (they waited forever); a decode already running ends at its next block
        through ``cancel``."""
        with self.lock:
            if self.fired:
                return
            self.fired = True
            waiting = list(self.calls)
        for call in waiting:
            call.error = error
            call.done.set()

    def _ready(self) -> bool:
        if self.fired or len(self.calls) + self.left < self.size:
            return False
        self.fired = True
        return True

    def _decode_all(self) -> None:
        groups: dict[tuple, list[BatchCall]] = {}
        for call in self.calls:
            groups.setdefault(call.key, []).append(call)
        for calls in groups.values():
            decode_together(self.engine, calls, self.cancel)


def decode_together(engine: Engine, calls: list[BatchCall], cancel: threading.Event | None = None) -> None:
    """One ``generate`` for ``calls`` (same settings); each gets its run and row, or the error.

    A row whose own callback raises (a handler with ``raise_error``) ends there with that error;
    the other rows decode on, as they would in LangChain's own per-input batch. ``cancel`` ends
    every row at its next block (an ``abatch`` whose caller was cancelled)."""

    def on_block(row: int, tokens: list[int], piece: str) -> bool:
        call = calls[row]
        if call.on_block is not None and call.error is None:
            try:
                call.on_block(tokens, piece)
            except Exception as err:
                call.error = err
        return call.error is not None

    timeouts = [c.settings["timeout"] for c in calls if c.settings["timeout"] is not None]
    settings = calls[0].settings | {"timeout": min(timeouts) if timeouts else None}
    if cancel is not None:
        settings["cancel"] = cancel
    try:
        run = engine.run([c.request for c in calls], on_block=on_block, **settings)
        for row, call in enumerate(calls):
            call.run, call.row = run, row
    except BaseException as err:  # every waiting row gets it
        for call in calls:
            call.error = err
    finally:
        for call in calls:
            call.done.set()


@dataclass
class Seat:
    """A batch worker's ticket, for the ``invoke`` run ``run_id`` it was started for: used once, to
    submit a row or to leave."""

    gather: Gather
    run_id: UUID
    used: bool = False

    def take(self) -> Gather | None:
        if self.used:
            return None
        self.used = True
        return self.gather


_SEAT: contextvars.ContextVar[Seat | None] = contextvars.ContextVar("rag_lookahead_batch_seat", default=None)


def gather_of_this_thread(run_id: UUID | None) -> Gather | None:
    """The :class:`Gather` the call of run ``run_id`` may use, once: ``None`` outside a batch, once
    used, and for any call but the worker's own ``invoke``. A callback of that ``invoke`` calling
    another model in this thread took the seat, and that call was decoded with the batch's model."""
    seat = _SEAT.get()
    if seat is None or run_id is None or seat.run_id != run_id:
        return None
    return seat.take()


def settings_key(settings: dict) -> tuple:
    """Rows decode together only under identical settings (generate takes one of each); rows
    with a timeout go apart from rows without one."""
    sampling = tuple(sorted(settings["sampling"].items()))
    return (settings["max_new_tokens"], repr(settings["config"]), sampling, settings["timeout"] is None)


#: numbers each wave's worker threads apart
_WAVES = itertools.count()


def _join_workers(name: str) -> None:
    """Wait for every worker thread of the wave ``name``, those the pool never recorded too: a
    Ctrl-C landing in a worker's ``Thread.start`` (which waits for the thread to run) left a thread
    running that ``shutdown(wait=True)`` did not know of, decoding on after ``batch`` had raised.
    The pool's shutdown and the cancelled gather have told it to end."""
    for thread in threading.enumerate():
        if thread.name.startswith(f"{name}_") and thread is not threading.current_thread():
            thread.join()


def run_wave(
    engine: Engine,
    invoke: Callable[..., Any],
    inputs: Sequence,
    configs: Sequence,
    return_exceptions: bool,
    kwargs,
    cancel: threading.Event | None = None,
) -> list:
    """``invoke(input, config, **kwargs)`` for every input, each in its own thread with a seat at one gather.

    A Ctrl-C (or a cancelled task) in the calling thread, or workers that could not all be
    started, end the decode at its next block and free the workers: it hung for good when that
    came while the workers were being started (the rows handed over waited for the rest), and
    otherwise waited for every row's token limit. A row's own error leaves the other rows to
    finish (as LangChain's batch does) unless a Ctrl-C comes while they do."""
    cancel = cancel if cancel is not None else threading.Event()
    gather = Gather(engine, len(inputs), cancel)

    def one(i: int) -> Any:
        config = {
            **configs[i],
            "run_id": configs[i].get("run_id") or uuid7(),
        }  # names the seat's own call, as LangChain would
        seat = Seat(gather, config["run_id"])
        _SEAT.set(seat)
        try:
            return invoke(inputs[i], config, **kwargs)
        except Exception as err:
            if return_exceptions:
                return err
            raise
        finally:
            if seat.take() is not None:
                gather.leave()

    def stop() -> None:
        cancel.set()
        gather.abandon(CancelledError())  # the workers' own: the caller's traceback stays its own

    name = f"lookahead-batch-{next(_WAVES)}"
    pool = ThreadPoolExecutor(max_workers=len(inputs), thread_name_prefix=name)
    futures: list = []
    try:
        for i in range(len(inputs)):
            futures.append(pool.submit(contextvars.copy_context().run, one, i))
        return [f.result() for f in futures]
    except BaseException as err:
        if not isinstance(err, Exception) or len(futures) < len(inputs):  # not a row's own error
            stop()
        raise
    finally:
        try:
            pool.shutdown(wait=True)
        except BaseException:  # a Ctrl-C while the other rows finish: they stop too
            stop()
            pool.shutdown(wait=True)
            raise
        finally:
            _join_workers(name)
