"""One Ray Serve replica: the FastAPI app of :func:`rag_lookahead.serve.app.create_app`, built in
the replica's own process from the ServerConfig every replica is given.

Each replica loads its own model, engine and index (from ``index_dir``, a folder every node reads)
when it starts, and runs the app's lifespan as uvicorn would: the engine thread starts with it and,
when Ray stops the replica, drains for ``drain_seconds``. Every response names the replica that
answered in an ``X-Replica-Id`` header, so a client can tell which replica's ``/metrics`` it read.

Ray imports this module in the replica processes (by its path); the default install never does.
"""

from __future__ import annotations

import asyncio

from ray import serve

from rag_lookahead.serve.config import ServerConfig
from rag_lookahead.serve.ray_deploy import REPLICA_HEADER

__all__ = ["LookaheadReplica", "ReplicaHeader"]


class ReplicaHeader:
    """ASGI middleware adding ``X-Replica-Id`` to every response."""

    def __init__(self, app, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode("latin-1"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class LookaheadReplica:
    """The deployment class; ``__serve_build_asgi_app__`` builds the app after the constructor."""

    def __init__(self, config: ServerConfig, cpu_threads: int = 0) -> None:
        """``cpu_threads``: torch threads of a CPU replica (its share of the node), 0 to leave them."""
        self.config = config
        self.engine = None
        if cpu_threads:
            import torch

            torch.set_num_threads(cpu_threads)

    async def __serve_build_asgi_app__(self):
        from rag_lookahead.serve.app import create_app

        app = await asyncio.to_thread(create_app, self.config)  # the model loads off the event loop
        self.engine = app.state.engine
        app.add_middleware(ReplicaHeader, replica_id=serve.get_replica_context().replica_id.unique_id)
        return app

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine thread died is replaced."""
        engine = self.engine
        if engine is not None and (engine.error is not None or (engine.ready.is_set() and not engine.alive)):
            raise RuntimeError(f"the generation engine stopped: {engine.error!r}")
