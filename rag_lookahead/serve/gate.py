"""ASGI middleware in front of every handler: who may ask (Host, Origin, API key), how much
(Content-Length), and the count of every answer for ``/metrics``.

The gate runs before any body is read:

1. ``Host`` must name this server (the bound host, a loopback name or ``allowed_hosts``): a
   DNS-rebinding page reaches a loopback port under its own name and is refused (421); a browser
   ``Origin`` must pass the same test (403), so no web page can drive the server. No CORS
   headers are ever sent.
2. With API keys, ``Authorization: Bearer KEY`` on every path but ``/health`` (401). Keys are
   compared as SHA-256 digests with ``hmac.compare_digest`` against all keys, so the time taken
   says nothing about them; the handler learns only the digest's short id (``state.key_id``).
3. A declared ``Content-Length`` above ``max_body_bytes``: 413 at once. A body streamed without
   one is counted as it is read (:mod:`rag_lookahead.serve.body`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import Sequence

from rag_lookahead.serve.api_error import ApiError, too_large
from rag_lookahead.serve.config import LOOPBACK, WILDCARD_BINDS, ServerConfig
from rag_lookahead.serve.metrics import Metrics

__all__ = ["CountResponses", "Gate"]


class Gate:
    """The Host, Origin, API key and Content-Length checks (see the module docstring)."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.max_body = config.max_body_bytes
        hosts = set(LOOPBACK) | set(config.allowed_hosts)
        if config.host not in WILDCARD_BINDS:
            hosts.add(host_name(config.host) or config.host.lower())
        self.hosts = None if "*" in hosts else frozenset(hosts)
        self.keys = [
            (hashlib.sha256(k.encode()).digest(), hashlib.sha256(k.encode()).hexdigest()[:16]) for k in config.api_keys
        ]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers: dict[str, list[str]] = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
        error = self._check_host(headers) or self._check_key(scope, headers) or self._check_length(headers)
        if error is not None:
            # no "Connection: close" on a 413: closing while the client still uploads resets the
            # connection, and it may never read the answer; uvicorn discards the declared rest
            extra = [(b"www-authenticate", b"Bearer")] if error.status == 401 else []
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _send_error(send, error, extra)
        await self.app(scope, receive, send)

    def _check_host(self, headers: dict[str, list[str]]) -> ApiError | None:
        if self.hosts is None:
            return None
        hosts = headers.get("host", [])
        if len(hosts) != 1 or host_name(hosts[0]) not in self.hosts:
            return ApiError(
                421,
                "this server does not answer to that Host name (start it with --allowed-hosts NAME to allow it)",
                code="invalid_host",
            )
        for origin in headers.get("origin", []):
            if _origin_host(origin) not in self.hosts:
                return ApiError(403, "requests from web pages of other origins are refused", code="invalid_origin")
        return None

    def _check_key(self, scope, headers: dict[str, list[str]]) -> ApiError | None:
        if not self.keys or scope.get("path") in self.OPEN_PATHS:
            return None
        given = headers.get("authorization", [""])[0]
        scheme, _, token = given.partition(" ")
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        matched = ""
        for key_digest, key_id in self.keys:  # all of them, whatever matched: constant work
            if hmac.compare_digest(digest, key_digest) and scheme.lower() == "bearer":
                matched = key_id
        if not matched:
            return ApiError(
                401, "a valid API key is required: send 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key"
            )
        scope.setdefault("state", {})["key_id"] = matched
        return None

    def _check_length(self, headers: dict[str, list[str]]) -> ApiError | None:
        lengths = headers.get("content-length", [])
        if not lengths:
            return None
        if len(lengths) > 1 or not lengths[0].strip().isdigit():
            return ApiError(400, "the Content-Length header is not a single number")
        if int(lengths[0]) > self.max_body:
            return too_large(self.max_body)
        return None


class CountResponses:
    """Counts responses by endpoint and status for /metrics (outermost: the gate's refusals too).

    A response is counted as its status goes out, not when the app returns: a stream's client
    reads ``[DONE]`` before the stream's last awaits, so a scrape right after it missed the count."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope.get("path", "")
        started = False

        async def send_counted(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.request(endpoint, message["status"])
            await send(message)

        status = 500
        try:
            await self.app(scope, receive, send_counted)
        except asyncio.CancelledError:
            # Ray Serve cancels a replica's handler when its client leaves (no http.disconnect
            # reaches it): counted 500 while no answer had started, where one process counts 499
            status = 499
            raise
        finally:
            if not started:
                self.metrics.request(endpoint, status)


async def _send_error(send, error: ApiError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error.body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    head += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def host_name(value: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``; lower case, no final dot;
    "" when the port is not a number."""
    value = value.strip().lower()
    port = ""
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1 :][:1] not in ("", ":"):
            return ""
        value, port = value[1:end], value[end + 2 :]
    elif value.count(":") == 1:
        value, port = value.split(":")
    if port and not port.isdigit():
        return ""
    return value.rstrip(".")


def _origin_host(origin: str) -> str | None:
    """The host name of an ``Origin`` header (``http://localhost:3000`` -> ``localhost``); None if opaque."""
    scheme, sep, rest = origin.strip().partition("://")
    if not sep or not scheme:
        return None
    return host_name(rest.split("/", 1)[0]) or None
