"""The FastAPI app and the uvicorn server that runs it.

    rag_lookahead serve --port 8000 --index-dir ~/my_index
    curl -N 127.0.0.1:8000/v1/chat/completions -d '{"messages":[{"role":"user","content":"hi"}],"stream":true}'

Decoding is lossless: a request's text is what a single-request ``generate`` gives for the same
prompt (greedy when ``temperature`` is 0 or absent; a sample of the model's own distribution
otherwise, the same text for the same ``seed`` whatever else is in the batch), in fp32 with TF32
off; in bf16/fp16 kernels change with the batch shape and near-ties can flip.

Every error is OpenAI's ``{"error": {...}}`` body: a request its model refuses gets 400 with one
message naming the field (not FastAPI's 422), an unknown path 404, an unexpected exception 500
with an error id (the details go to the log). The schema is served at ``/docs``.

Shutdown (SIGTERM, SIGINT): new requests get 503 at once while the accepted ones may finish
for ``drain_seconds``; what is left then gets an error, and the connections close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

import rag_lookahead
from rag_lookahead.serve.api_error import ApiError, internal_error
from rag_lookahead.serve.config import ServerConfig
from rag_lookahead.serve.engine import Engine
from rag_lookahead.serve.gate import CountResponses, Gate
from rag_lookahead.serve.protocol import INVALID_REQUEST
from rag_lookahead.serve.routes import generation, status
from rag_lookahead.serve.streaming import ClientGone

__all__ = ["CLOSE_GRACE_SECONDS", "create_app", "drain", "make_server"]

log = logging.getLogger(__name__)

#: Seconds uvicorn waits for connections to close after the drain (slow readers, idle keep-alives).
CLOSE_GRACE_SECONDS = 5.0


def create_app(engine_or_config: Engine | ServerConfig | None = None) -> FastAPI:
    """The FastAPI app. Given a config it loads the model; the engine thread starts with the app
    (lifespan) and stops with it, after draining for ``drain_seconds``."""
    if engine_or_config is None:
        engine_or_config = ServerConfig()
    engine = engine_or_config if isinstance(engine_or_config, Engine) else Engine.from_config(engine_or_config)
    app = FastAPI(
        title="rag_lookahead",
        summary="OpenAI-compatible server with continuous batching and lossless lookahead decoding.",
        version=rag_lookahead.__version__,
        lifespan=_lifespan,
        redoc_url=None,
    )
    app.state.engine = engine
    app.add_middleware(Gate, config=engine.config)
    app.add_middleware(CountResponses, metrics=engine.metrics)  # outermost: counts the gate's refusals too
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(generation)
    app.include_router(status)
    app.openapi = lambda: _openapi_without_422(app)  # type: ignore[method-assign]
    return app


def _openapi_without_422(app: FastAPI) -> dict:
    """The schema FastAPI draws, less its 422 answers: a refused body is a 400 here (ErrorResponse)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
    return app.openapi_schema


@asynccontextmanager
async def _lifespan(app: FastAPI):
    engine: Engine = app.state.engine
    engine.start()
    try:
        yield
    finally:
        await run_in_threadpool(engine.stop, engine.config.drain_seconds)


# ---------------------------------------------------------------- errors as OpenAI's error body


async def _api_error(request: Request, err: ApiError) -> Response:
    # a streamed (chunked) body past the limit has no declared end to discard up to: close
    headers = {**err.headers, "Connection": "close"} if err.status == 413 else err.headers
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)


async def _client_gone(request: Request, err: ClientGone) -> Response:
    return Response(status_code=499)


async def _http_error(request: Request, err: HTTPException) -> Response:
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    message = {404: "no such endpoint", 405: "this endpoint does not take that method"}.get(
        err.status_code, "invalid request"
    )
    return JSONResponse(ApiError(err.status_code, message, kind).body(), status_code=err.status_code)


async def _invalid_request(request: Request, err: RequestValidationError) -> Response:
    """The request models word their first error themselves (``protocol.explain``): 400 with it."""
    errors = err.errors()
    first = errors[0] if errors else {}
    if first.get("type") == INVALID_REQUEST:
        error = ApiError(400, first["ctx"]["message"], param=first["ctx"]["param"])
    else:
        error = ApiError(400, "invalid request")
    return JSONResponse(error.body(), status_code=400)


async def _internal_error(request: Request, err: Exception) -> Response:
    return JSONResponse(internal_error(500, "internal error", err).body(), status_code=500)


# ---------------------------------------------------------------- running it


async def drain(engine: Engine, seconds: float, cut_short: Callable[[], bool] = lambda: False) -> None:
    """Stop admitting; wait until the accepted requests are answered or ``seconds`` pass (then the
    engine fails the rest, and their handlers answer at once; uvicorn's own shutdown then waits
    for those responses to go out). Once ``cut_short()`` (a second Ctrl-C) the rest fail at once."""
    engine.begin_drain(seconds)
    deadline = time.monotonic() + seconds + CLOSE_GRACE_SECONDS
    while engine.alive and not engine.idle and time.monotonic() < deadline:
        if cut_short():
            log.info("second interrupt: ending the requests still running now")
            engine.begin_drain(0)
            deadline = min(deadline, time.monotonic() + CLOSE_GRACE_SECONDS)
            cut_short = lambda: False  # noqa: E731 (once)
        await asyncio.sleep(0.05)


#: the largest request line + headers accepted (uvicorn answers 431-style errors beyond)
MAX_HEAD_BYTES = 64 * 1024


def make_server(app: FastAPI, engine: Engine, **uvicorn_options):
    """A ``uvicorn.Server`` for ``app`` whose shutdown (SIGTERM, SIGINT) first drains ``engine`` for
    its ``drain_seconds`` while new requests get 503, then closes the connections. A request head
    gets ``head_timeout`` seconds, and at most ``max_connections`` are open at once
    (:mod:`rag_lookahead.serve.head`)."""
    import uvicorn

    from rag_lookahead.serve.head import h11_with_limits

    config = engine.config

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            log.info("shutting down: draining for up to %g s", config.drain_seconds)
            await drain(engine, config.drain_seconds, cut_short=lambda: self.force_exit)  # uvicorn: a second Ctrl-C
            # what ran has ended: shut down in order (uvicorn's forced exit skips the app's shutdown
            # and logs a CancelledError traceback)
            self.force_exit = False
            await super().shutdown(sockets)

    options = dict(
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=CLOSE_GRACE_SECONDS,
        # h11 caps a request head (httptools read a 160 MiB header unbounded, stalling the loop for seconds);
        # its protocol here also times a head out (uvicorn's never does: slowloris)
        http=h11_with_limits(config.head_timeout, config.max_connections, engine.metrics.connection_closed),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
    options.update(uvicorn_options)
    return DrainingServer(uvicorn.Config(app, **options))
