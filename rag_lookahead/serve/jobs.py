"""One generation request as the engine sees it: prompt ids in, text events out.

A handler (asyncio) makes a :class:`Job`, submits it and reads its ``channel``; the engine
thread feeds the channel with ``loop.call_soon_threadsafe``. Events, in order:
``("piece", Piece)`` any number of times, then exactly one ``("done", Answer)`` or
``("error", ApiError)``. A request that asks for log-probabilities gets them with its pieces
and its answer (the job attaches them as it sends its events, see :mod:`.logprobs`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_lookahead.tokens import TextTracker

if TYPE_CHECKING:
    from rag_lookahead.decoding.results import TokenLogprob
    from rag_lookahead.serve.logprobs import AnswerLogprobs

__all__ = ["Answer", "Job", "Piece", "RequestOutcome"]


@dataclass(frozen=True)
class Piece:
    """New answer text, with the log-probabilities of the tokens accepted since the last piece
    (empty unless the request asked for them)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Answer:
    """What a finished job sends last (the text, why it ended, the counts for usage and stats)."""

    text: str
    rest: str  # the text not streamed yet (held back in case it began a stop string)
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    forward_passes: int  # decode steps after the prefill
    mean_accepted: float
    seconds: float
    lookahead: bool
    logprobs: tuple[TokenLogprob, ...] | None = None  # per answer token, when asked (no EOS, none past a stop)
    unsent_logprobs: tuple[TokenLogprob, ...] = ()  # those of ``logprobs`` that no piece carried


class RequestOutcome:
    """How the choices (jobs) of one HTTP request ended, so that the metrics count the request once:
    "completed" when every choice was answered in full, else "failed" when a choice failed (its
    siblings are then cancelled), else "cancelled" (the client left). Counted per choice, an
    ``n=4`` request added 4 completed requests, and one whose client left after its first choice
    was done counted as completed and cancelled both."""

    def __init__(self, choices: int = 1) -> None:
        self._left, self._seen, self._seconds = choices, set(), 0.0
        self._lock = threading.Lock()  # the engine thread and the handlers' cancels both settle choices

    def settle(self, outcome: str, seconds: float = 0.0) -> tuple[str, float] | None:
        """One choice ended so; the request's outcome and seconds once its last choice has ended."""
        with self._lock:
            self._left -= 1
            self._seen.add(outcome)
            self._seconds = max(self._seconds, seconds)
            if self._left:
                return None
        return next(o for o in ("failed", "cancelled", "completed") if o in self._seen), self._seconds


class Job:
    """One generation request inside the engine (one of its ``n`` choices); ``pool_key`` picks its
    output pool and batch."""

    def __init__(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        stop: list[str],
        references: list[list[int]],
        tracker: TextTracker,
        pool_key: str = "",
        sampling=None,
        owner: str = "",
    ) -> None:
        from rag_lookahead.decoding.sampling import SamplingParams

        self.id = uuid.uuid4().hex
        self.sampling = sampling or SamplingParams()  # greedy unless the request samples
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.stop = stop
        self.references = references
        self.tracker = tracker
        self.pool_key = pool_key  # requests with the same key share an output pool and a batch
        self.owner = owner  # the API key's id ("" without keys): the queue's turns go by owner (serve.fair_queue)
        self.loop = asyncio.get_running_loop()
        self.channel: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # the client left
        self.ended = False  # the engine sent the last event (done or error)
        self.finished = False  # the handler saw the last event
        self.steps = 0  # blocks accepted (the prefill's first token is one)
        self.submitted = time.perf_counter()
        self.logprobs: AnswerLogprobs | None = None  # the decode loop's recorder, when the request asks
        self.outcome = RequestOutcome()  # shared with its sibling choices once submitted together

    def emit(self, event: tuple) -> None:
        """Send ``event`` to the handler; a piece's text goes as a :class:`Piece`."""
        if event[0] == "piece" and isinstance(event[1], str):
            event = ("piece", Piece(event[1], self.logprobs.for_piece(self.tracker) if self.logprobs else ()))
        try:
            self.loop.call_soon_threadsafe(self.channel.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def end(self, event: tuple) -> None:
        """Send the last event (once)."""
        if not self.ended:
            self.ended = True
            if event[0] == "done" and self.logprobs is not None:
                event = ("done", self.logprobs.complete(event[1], self.tracker))
            self.emit(event)

    @property
    def live(self) -> bool:
        """Still worth decoding: nobody cancelled or ended it."""
        return not (self.cancelled or self.ended)
