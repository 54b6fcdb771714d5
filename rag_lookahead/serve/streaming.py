"""Reading a job's events in a handler: the whole answer, or server-sent events as they come.

No client waits forever and no job is decoded for nobody: while waiting, a handler looks every
``CLIENT_CHECK_SECONDS`` whether its client left (the job is then cancelled) and, after
``POLL_SECONDS`` without an event, whether the engine thread is gone (an error event). Under
ASGI 2.4 servers Starlette no longer listens for the disconnect itself, hence the polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import StreamingResponse

from rag_lookahead.serve.api_error import engine_stopped
from rag_lookahead.serve.jobs import Answer, Job, Piece

if TYPE_CHECKING:
    from rag_lookahead.serve.engine import Engine

__all__ = ["CLIENT_CHECK_SECONDS", "POLL_SECONDS", "ClientGone", "EngineStream", "collect", "stream"]

#: How long a handler waits for its next event before it looks whether the engine thread died.
POLL_SECONDS = 0.25
#: How often a handler looks whether its client left, events flowing or not.
CLIENT_CHECK_SECONDS = 0.25

DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client hung up; the app answers 499 (nobody reads it) and counts it so."""


class StreamShape(Protocol):
    """How an endpoint shapes its events (see :mod:`rag_lookahead.serve.responses`)."""

    def opening(self) -> list[dict]: ...

    def piece(self, piece: Piece) -> dict: ...

    def closing(self, answer: Answer, include_usage: bool) -> list[dict]: ...


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def events(job: Job, engine: Engine, http_request: Request | None = None) -> AsyncIterator[tuple]:
    """The job's events, the last one "done" or "error".

    With ``http_request`` it raises :class:`ClientGone` (after cancelling the job) once the client
    has left. One pending ``get`` is kept across polls, so no event is lost to a timeout.
    """
    getter: asyncio.Future | None = None
    looked = time.monotonic()
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(job.channel.get())
            done, _ = await asyncio.wait((getter,), timeout=min(POLL_SECONDS, CLIENT_CHECK_SECONDS))
            if http_request is not None and time.monotonic() - looked >= CLIENT_CHECK_SECONDS:
                looked = time.monotonic()
                if await http_request.is_disconnected():
                    engine.cancel(job)
                    raise ClientGone()
            if not done:
                if not engine.alive and job.channel.empty():
                    job.finished = True
                    yield ("error", engine_stopped())
                    return
                continue
            event, getter = getter.result(), None
            if event[0] != "piece":
                job.finished = True
            yield event
            if event[0] != "piece":
                return
    finally:
        if getter is not None:
            getter.cancel()


async def collect(job: Job, http_request: Request, engine: Engine) -> Answer:
    """Wait for the whole answer (raises the job's error, or :class:`ClientGone`)."""
    try:
        async with contextlib.aclosing(events(job, engine, http_request)) as job_events:
            async for kind, value in job_events:
                if kind == "done":
                    return value
                if kind == "error":
                    raise value
        raise engine_stopped()  # unreachable: the events end with done or error
    finally:
        if not job.finished:
            engine.cancel(job)


async def stream(
    job: Job, http_request: Request, engine: Engine, shape: StreamShape, include_usage: bool = False
) -> AsyncIterator[str]:
    """Server-sent events in ``shape``, ending with ``data: [DONE]`` (after an error event too)."""
    try:
        for payload in shape.opening():
            yield sse(payload)
        async with contextlib.aclosing(events(job, engine, http_request)) as job_events:
            async for kind, value in job_events:
                if kind == "piece":
                    yield sse(shape.piece(value))
                elif kind == "done":
                    for payload in shape.closing(value, include_usage):
                        yield sse(payload)
                    yield DONE
                else:
                    yield sse(value.body())
                    yield DONE
    except ClientGone:
        return
    finally:  # the client left (the generator was cancelled or closed) or we are done
        if not job.finished:
            engine.cancel(job)


class EngineStream(StreamingResponse):
    """A stream that cancels its job however the response ends, even when the client left
    before the stream's first chunk (then the generator never runs, so its own cleanup cannot)."""

    def __init__(self, content: AsyncIterator[str], engine: Engine, job: Job) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.engine, self.job = engine, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.job.finished:
                self.engine.cancel(self.job)
