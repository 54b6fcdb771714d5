"""Graceful shutdown: on SIGTERM the server stops admitting (503 for new requests, /health says
"draining"), lets running and queued requests finish for up to ``drain_seconds``, then ends what
is left with an error and exits. Real tiny-model server: in a thread (uvicorn's own SIGTERM path,
``handle_exit``) and in a child process sent a real SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import (  # noqa: F401 - tokenizer is a fixture
    parse_sse,
    running,
    single_text,
    slow_steps,
    stream_text,
    tiny_engine,
    tiny_prompts,
    tokenizer,
    until,
)


def slow_engine(tokenizer, monkeypatch, drain_seconds: float, step_seconds: float):
    engine = tiny_engine(
        tokenizer,
        max_batch_size=1,
        max_tokens_limit=200,
        lookahead=False,
        lookahead_config=None,
        drain_seconds=drain_seconds,
    )
    slow_steps(monkeypatch, step_seconds)
    return engine


async def stream(client: httpx.AsyncClient, prompt, max_tokens: int) -> list:
    async with client.stream(
        "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    ) as r:
        assert r.status_code == 200
        return parse_sse((await r.aread()).decode())


def test_sigterm_drains_running_and_queued_requests(tokenizer, monkeypatch):
    engine = slow_engine(tokenizer, monkeypatch, drain_seconds=60, step_seconds=0.02)
    a, b, c = tiny_prompts(3, seed=51)
    want_a, want_b = single_text(engine, a, 40), single_text(engine, b, 40)

    async def run(base: str, server) -> dict:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            streaming = asyncio.create_task(stream(client, a, 40))
            queued = asyncio.create_task(client.post("/v1/completions", json={"prompt": b, "max_tokens": 40}))
            await until(lambda: engine.active == 1 and engine.queue_depth == 1)
            server.handle_exit(signal.SIGTERM, None)  # what uvicorn's SIGTERM handler calls
            await until(lambda: engine.draining)
            late = await client.post("/v1/completions", json={"prompt": c, "max_tokens": 4})
            health = await client.get("/health")
            return {"stream": await streaming, "queued": await queued, "late": late, "health": health}

    with running(engine) as (base, server):
        out = asyncio.run(run(base, server))
    assert stream_text(out["stream"], chat=False) == (want_a, "length")
    assert out["queued"].status_code == 200 and out["queued"].json()["choices"][0]["text"] == want_b
    assert out["late"].status_code == 503 and out["late"].json()["error"]["code"] == "shutting_down"
    assert out["health"].status_code == 503 and out["health"].json()["status"] == "draining"


def test_drain_time_over_ends_the_rest_with_an_error(tokenizer, monkeypatch):
    """drain_seconds=0.5 while a request needs ~10 s: it ends with a shutting-down error in its
    stream, the queued one gets 503, and the server exits within a few seconds."""
    engine = slow_engine(tokenizer, monkeypatch, drain_seconds=0.5, step_seconds=0.05)
    a, b = tiny_prompts(2, seed=52)

    async def run(base: str, server) -> tuple:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            streaming = asyncio.create_task(stream(client, a, 200))
            queued = asyncio.create_task(client.post("/v1/completions", json={"prompt": b, "max_tokens": 200}))
            await until(lambda: engine.active == 1 and engine.queue_depth == 1)
            server.handle_exit(signal.SIGTERM, None)
            start = time.monotonic()
            events, refused = await streaming, await queued
            return events, refused, time.monotonic() - start

    with running(engine) as (base, server):
        thread = next(t for t in threading.enumerate() if t.name == "test-uvicorn")
        events, refused, seconds = asyncio.run(run(base, server))
        thread.join(10)
        assert not thread.is_alive(), "the server did not exit"
    assert seconds < 3, seconds
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"


CHILD = """
import socket, sys, time
sys.path[:0] = sys.argv[1:]  # this folder (test_server) and tests/ (tiny_models)
from transformers import AutoTokenizer
from rag_lookahead.decoding.loop import DecodeBatch
from rag_lookahead.models import default_model_dir
from rag_lookahead.serve import create_app, make_server
from test_server import tiny_engine

step, pause = DecodeBatch.verify_and_accept, float(sys.argv.pop())  # seconds a step takes
DecodeBatch.verify_and_accept = lambda self, drafts: time.sleep(pause) or step(self, drafts)
engine = tiny_engine(AutoTokenizer.from_pretrained(str(default_model_dir())), max_tokens_limit=200, lookahead=False,
                     lookahead_config=None, drain_seconds=30)
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
app = create_app(engine)
print(sock.getsockname()[1], flush=True)
make_server(app, engine, log_level="warning").run(sockets=[sock])
"""


async def stream_events(client: httpx.AsyncClient, body: dict, after_two) -> list[str]:
    """A completion streamed: its ``data:`` payloads; ``await after_two()`` once two have come. A
    stream the server cuts off ends the list where it broke."""
    events: list[str] = []
    with contextlib.suppress(httpx.HTTPError):
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        await after_two()
    return events


@contextlib.contextmanager
def child_server(step_seconds: float):
    """The tiny server of CHILD in a process of its own (each decode step ``step_seconds`` long),
    once healthy: ``(process, base URL)``; killed at the end if it is still running. Its stderr
    goes to a file (``process.stderr_file``), not a pipe nobody reads while it runs: a full pipe
    would block the server mid-test."""
    here = Path(__file__).resolve()
    command = [sys.executable, "-c", CHILD, str(here.parent), str(here.parents[1]), str(step_seconds)]
    stderr = tempfile.TemporaryFile("w+")
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, cwd=here.parents[2], text=True)
    child.stderr_file = stderr
    try:
        base = f"http://127.0.0.1:{child.stdout.readline().strip()}"
        asyncio.run(until(lambda: _healthy(base), timeout=120))
        yield child, base
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        stderr.close()


def test_real_sigterm_lets_the_running_stream_finish(tokenizer):
    engine = tiny_engine(tokenizer, max_tokens_limit=200, lookahead=False, lookahead_config=None)
    prompt = tiny_prompts(1, seed=53)[0]
    want = single_text(engine, prompt, 100)
    with child_server(step_seconds=0.02) as (child, base):

        async def run() -> tuple:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                late = []

                async def signal_then_ask() -> None:
                    child.send_signal(signal.SIGTERM)
                    deadline = time.monotonic() + 30
                    while (await client.get("/health")).status_code != 503:  # a fixed 0.3 s wait raced the signal
                        assert time.monotonic() < deadline, "the server did not begin to drain"
                        await asyncio.sleep(0.02)
                    late.append(await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}))

                events = await stream_events(client, {"prompt": prompt, "max_tokens": 100}, signal_then_ask)
                return events, late[0]

        events, late = asyncio.run(run())
        child.wait(30)
    parsed = [e if e == "[DONE]" else __import__("json").loads(e) for e in events]
    assert stream_text(parsed, chat=False) == (want, "length")
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert child.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_second_ctrl_c_ends_the_drain_at_once(tokenizer):
    """A second SIGINT did not cut the 30 s drain short: the server waited for the running stream
    (uvicorn's force-exit then skipped its own shutdown and logged a CancelledError traceback)."""
    prompt = tiny_prompts(1, seed=53)[0]
    with child_server(step_seconds=0.2) as (child, base):  # 200 tokens: 40 s, longer than the test waits

        async def run() -> list:
            async def interrupt_twice() -> None:
                child.send_signal(signal.SIGINT)
                await asyncio.sleep(0.5)
                child.send_signal(signal.SIGINT)

            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                return await stream_events(client, {"prompt": prompt, "max_tokens": 200}, interrupt_twice)

        start = time.monotonic()
        events = asyncio.run(run())
        child.wait(15)
        seconds = time.monotonic() - start
        child.stderr_file.seek(0)
        stderr = child.stderr_file.read()
    assert seconds < 15 and len(events) < 100, (seconds, len(events))
    assert "CancelledError" not in stderr  # the app's own shutdown ran


async def job_end(job, timeout: float = 30) -> tuple[str, object]:
    """A submitted job's last event once it comes: ``("done", result)`` or ``("error", ApiError)``."""
    while True:
        event = await asyncio.wait_for(job.channel.get(), timeout)
        if event[0] != "piece":
            return event[0], event[1]


def test_a_clean_stop_ends_the_leftovers_as_shutting_down_and_health_says_draining(tokenizer, monkeypatch):
    """``stop(0, 0.3)`` while a decode step takes 1.5 s: the running request is ended with the
    shutting-down error of a drain (not the engine-stopped one of a failure), and /health after the
    clean stop says "draining" (it read "error": an engine that stopped on purpose had failed)."""
    engine = slow_engine(tokenizer, monkeypatch, drain_seconds=30, step_seconds=1.5)
    engine.start()
    assert engine.ready.wait(60) and engine.health == "ok"

    async def run():
        job = engine.new_request(tiny_prompts(1, seed=54)[0], 30, [])
        engine.submit(job)
        await until(lambda: engine.active == 1)
        await asyncio.to_thread(engine.stop, 0.0, 0.3)
        return await job_end(job)

    kind, error = asyncio.run(run())
    assert kind == "error" and error.body()["error"]["code"] == "shutting_down", (kind, error)
    assert engine.error is None and engine.health == "draining"


def test_a_later_longer_drain_does_not_extend_an_earlier_deadline(tokenizer, monkeypatch):
    """``begin_drain(0.2)`` then ``begin_drain(30)`` (lifespan's stop after a cut-short drain): the
    running request (60 steps of 0.1 s) is ended at the first deadline, not left to run on."""
    engine = slow_engine(tokenizer, monkeypatch, drain_seconds=30, step_seconds=0.1)
    engine.start()
    assert engine.ready.wait(60)

    async def run():
        job = engine.new_request(tiny_prompts(1, seed=55)[0], 60, [])
        engine.submit(job)
        await until(lambda: engine.active == 1)
        engine.begin_drain(0.2)
        engine.begin_drain(30)
        start = time.monotonic()
        end = await job_end(job)
        return end, time.monotonic() - start

    try:
        (kind, error), seconds = asyncio.run(run())
    finally:
        engine.stop(0, 5)
    assert kind == "error" and error.body()["error"]["code"] == "shutting_down", (kind, error)
    assert seconds < 4, seconds  # the whole answer takes 6 s
