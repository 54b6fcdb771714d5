"""Reading a POST body before FastAPI validates it against the endpoint's request model.

:class:`JsonBodyRoute` first asks the engine whether it can take the request at all (503, or 429
before any work when the queue or the KV budget is full; a body of at most
``JUDGED_WHEN_FULL_BYTES`` is still read then, so that the handler can answer a request that could
never fit with its 400, not a 429 to retry), then reads the body counting bytes as they stream in (413 past
``max_body_bytes``; a declared Content-Length was already checked by the gate) and parses it
strictly (NaN, lone surrogates, deep nesting: 400); a body still incomplete after ``body_timeout``
seconds gets 408. FastAPI then validates the parsed object.
The body is JSON whatever its Content-Type says (``curl -d`` sends form-urlencoded).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from rag_lookahead.serve.api_error import ApiError, body_timed_out, too_large
from rag_lookahead.serve.streaming import ClientGone

__all__ = ["JsonBodyRoute", "parse_json", "read_json"]

#: Bodies larger than this are parsed in a worker thread, off the event loop.
PARSE_IN_THREAD_BYTES = 65536
#: While the server is full, a body declaring at most this many bytes is read anyway: its handler
#: judges it again once its n is known (a 400 for choices that can never fit, or the 429). Larger
#: ones, or ones of no declared length, get the 429 unread: a flood of big bodies costs no reading.
JUDGED_WHEN_FULL_BYTES = PARSE_IN_THREAD_BYTES


class JsonBodyRoute(APIRoute):
    """A route whose body is read and parsed by :func:`read_json`; see the module docstring."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        validate_and_run = super().get_route_handler()

        async def read_then_validate(request: Request) -> Response:
            engine = request.app.state.engine
            try:
                engine.check_capacity()  # 429/503 before reading, parsing or tokenizing anything
            except ApiError as refusal:
                if refusal.status != 429 or not judged_when_full(request):
                    raise
                # read on: the handler checks capacity again once it knows the request's n
            raw, data = await read_json(request, engine.config.max_body_bytes, engine.config.body_timeout)
            return await validate_and_run(ParsedRequest(request, raw, data))

        return read_then_validate


def judged_when_full(request: Request) -> bool:
    """Whether the body is small enough to be read while the server is full (see ``JUDGED_WHEN_FULL_BYTES``)."""
    length = request.headers.get("content-length", "").strip()  # the gate refused one not a number
    return length.isdigit() and int(length) <= JUDGED_WHEN_FULL_BYTES


class ParsedRequest(Request):
    """``request`` with its body already read: FastAPI gets the parsed object as JSON."""

    def __init__(self, request: Request, raw: bytes, parsed: Any) -> None:
        headers = [(name, value) for name, value in request.scope["headers"] if name != b"content-type"]
        scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
        super().__init__(scope, request.receive)
        self._raw_body, self._parsed_body = raw, parsed

    async def body(self) -> bytes:
        return self._raw_body

    async def json(self) -> Any:
        return self._parsed_body


async def read_json(request: Request, limit: int, timeout: float | None = None) -> tuple[bytes, dict]:
    """The body and the JSON object in it, counted as it streams in (413 past ``limit``, 408 if it
    has not all arrived within ``timeout`` seconds)."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    except TimeoutError:
        raise body_timed_out(timeout) from None
    raw = b"".join(chunks)
    parsed = await run_in_threadpool(parse_json, raw) if len(raw) > PARSE_IN_THREAD_BYTES else parse_json(raw)
    return raw, parsed


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; a clear 400 for anything else (NaN, lone surrogates, deep nesting)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:  # strings with lone surrogates (\\ud800) cannot be tokenized or sent back
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body holds invalid Unicode (a lone surrogate escape)") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    return body
