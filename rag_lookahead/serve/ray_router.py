"""Ray Serve's request router for the replicas: one session, one replica, while it has room.

Each replica keeps its own output pool and trie, so a session's next answer drafts best where its
earlier answers were decoded. The routing key of a request is, in order:

1. its ``X-Session-Id`` header (Ray's session header; ``RAY_SERVE_SESSION_ID_HEADER_KEY`` renames it),
2. else its API key (``Authorization: Bearer KEY``, hashed here and never kept),
3. else nothing: the request goes to any replica (a fresh key per request spreads them evenly).

A key picks its replica on a consistent-hash ring (Ray's ``ConsistentHashRouter``: 100 virtual
nodes per replica), so adding or losing a replica moves only the sessions that hashed to it.
When that replica already holds ``max_ongoing_requests`` the request goes to the next replica
on the ring, then the one after (two fallbacks), and waits with backoff if all are full.

Ray imports this module by its path (``rag_lookahead.serve.ray_router.SessionRouter``) in the
proxy and in every process holding a handle; nothing else imports it, so the default install
never imports Ray.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable
from typing import Any

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest

__all__ = ["ROUTER_PATH", "SessionRouter", "key_from_headers", "routing_key"]

#: What ``RequestRouterConfig.request_router_class`` names.
ROUTER_PATH = "rag_lookahead.serve.ray_router.SessionRouter"


class SessionRouter(ConsistentHashRouter):
    """Ray's consistent-hash router keyed by the session header, else the API key (module docstring)."""

    def _routing_key(self, pending_request: PendingRequest | None) -> str | None:
        if pending_request is None:
            return None
        return routing_key(pending_request) or pending_request.metadata.internal_request_id


def routing_key(pending_request: PendingRequest) -> str | None:
    """``session:<id>`` from the session header, else ``key:<digest>`` from the API key, else None."""
    metadata = pending_request.metadata
    if metadata.session_id:
        return f"session:{metadata.session_id}"
    if not metadata.is_http_request:
        return None
    return key_from_headers(_http_headers(pending_request.args))


def key_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """``key:<sha256 prefix>`` of a Bearer token among ASGI ``headers``; None without one."""
    for name, value in headers:
        if name.lower() != b"authorization":
            continue
        scheme, _, token = value.decode("latin-1").partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token:
            return "key:" + hashlib.sha256(token.encode("latin-1")).hexdigest()[:32]
        return None
    return None


def _http_headers(args: list[Any]) -> list[tuple[bytes, bytes]]:
    """The ASGI headers of a request from Ray's HTTP proxy: its one argument is the pickled
    ``StreamingHTTPRequest`` the proxy itself made (Ray 2.60), so unpickling it trusts no client."""
    if len(args) != 1 or not isinstance(args[0], bytes):
        return []
    try:
        scope = pickle.loads(args[0]).asgi_scope
        return list(scope.get("headers", ()))
    except Exception:  # another Ray version's wrapper: route without the key rather than fail
        return []
