"""The OpenAI-compatible server: continuous batching over the lossless lookahead loop.

    from rag_lookahead.serve import Engine, ServerConfig, create_app, make_server

Modules, from the outside in: ``command`` (the ``serve`` command line), ``app`` (the FastAPI app,
its error handlers, the draining uvicorn server), ``gate`` (Host, Origin, API key and size
checks; counting), ``routes`` (the endpoints), ``body`` (reading a POST body), ``protocol`` (the
request models), ``limits`` (the server's own limits on a request), ``responses`` (the response
models and their shapes), ``streaming`` (events and server-sent events), ``engine`` (the engine
thread and its queue), ``batches`` (admit, step, retire), ``jobs`` (one request in the engine),
``metrics`` (Prometheus), ``config`` (:class:`ServerConfig`), ``api_error`` (the error body).

The names here load lazily, so ``rag_lookahead serve --help`` does not import FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rag_lookahead.serve.app import create_app, make_server
    from rag_lookahead.serve.config import ServerConfig
    from rag_lookahead.serve.engine import Engine

__all__ = ["Engine", "ServerConfig", "create_app", "make_server"]

_HOMES = {
    "Engine": "rag_lookahead.serve.engine",
    "ServerConfig": "rag_lookahead.serve.config",
    "create_app": "rag_lookahead.serve.app",
    "make_server": "rag_lookahead.serve.app",
}


if not TYPE_CHECKING:  # seen by a type checker, it made every misspelled name Any

    def __getattr__(name: str) -> Any:
        import importlib

        if name not in _HOMES:
            raise AttributeError(f"module 'rag_lookahead.serve' has no attribute {name!r}")
        return getattr(importlib.import_module(_HOMES[name]), name)
