"""One Ray Serve replica: the FastAPI app of :func:`rag_lookahead.serve.app.create_app`, built in
the replica's own process from the ServerConfig every replica is given.

Each replica loads its own model, engine and index (from ``index_dir``, a folder every node reads)
when it starts, then starts its engine thread and waits for the warm-up before Ray counts it as
up (a warm-up that fails fails the replica's start). It runs the app's lifespan as uvicorn would:
when Ray stops the replica, the engine drains for ``drain_seconds``. Every response names the replica that
answered in an ``X-Replica-Id`` header, so a client can tell which replica's ``/metrics`` it read.

Ray imports this module in the replica processes (by its path); the default install never does.
"""

from __future__ import annotations

import asyncio
import threading
import time

from ray import serve

from rag_lookahead.serve.config import ServerConfig
from rag_lookahead.serve.ray_deploy import DRAIN_KEY, DRAINED_PREFIX, KV_NAMESPACE, REPLICA_HEADER

__all__ = ["LookaheadReplica", "ReplicaHeader"]

#: how often a replica looks for the driver's drain in Ray's key-value store
DRAIN_POLL_SECONDS = 0.5
#: how often a starting replica looks whether its engine's warm-up failed
WARM_UP_POLL_SECONDS = 0.1


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


def start_warmed_up(engine) -> None:
    """Start ``engine``'s thread (the app's lifespan then finds it started) and wait for its warm-up;
    raise the warm-up's error. Why: a replica is up once its app is built, so a warm-up that failed
    afterwards (a remote-code forward whose ``**kwargs`` swallow the cache: a ConfigError at its
    first forward) reached Ray's health check instead, and Ray replaced the replica, which loaded
    the model and failed again, forever, while ``serve`` said it was serving. Raised here, it fails
    the replica's start as a model that will not load does: Ray's few constructor retries, then
    ``serve`` exits 1 with the error's line. (One process keeps running and reports it on /health.)"""
    engine.start()
    while not engine.ready.wait(WARM_UP_POLL_SECONDS):
        if not engine.alive:  # the warm-up failed: its thread ended with engine.error set
            break
    if engine.error is not None:
        raise engine.error


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
        await asyncio.to_thread(start_warmed_up, self.engine)
        replica_id = serve.get_replica_context().replica_id.unique_id
        app.add_middleware(ReplicaHeader, replica_id=replica_id)
        threading.Thread(target=self._drain_when_told, args=(replica_id,), name="drain-watch", daemon=True).start()
        return app

    def _drain_when_told(self, replica_id: str) -> None:
        """Wait for the driver's drain (:func:`rag_lookahead.serve.ray_deploy.drain`), drain the
        engine as one process does on SIGTERM, and say so once it is idle."""
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

        def drain_seconds() -> float | None:
            try:
                value = _internal_kv_get(DRAIN_KEY, namespace=KV_NAMESPACE)
            except Exception:  # the key store unreachable for a moment (a GCS restart): look again
                return None
            return None if value is None else float(value)

        while (seconds := drain_seconds()) is None:
            time.sleep(DRAIN_POLL_SECONDS)
        engine = self.engine
        engine.begin_drain(seconds)
        while engine.alive and not engine.idle:
            if (sooner := drain_seconds()) is not None and sooner < seconds:  # the driver hurries (^C again)
                seconds = sooner
                engine.begin_drain(sooner)
            time.sleep(DRAIN_POLL_SECONDS)
        while True:
            try:
                _internal_kv_put(DRAINED_PREFIX + replica_id.encode(), b"1", namespace=KV_NAMESPACE)
                return
            except Exception:
                time.sleep(DRAIN_POLL_SECONDS)

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine thread died is replaced."""
        engine = self.engine
        if engine is not None and (engine.error is not None or (engine.ready.is_set() and not engine.alive)):
            raise RuntimeError(f"the generation engine stopped: {engine.error!r}")
