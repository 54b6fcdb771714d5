"""The OpenAI-compatible server, started for real on a free loopback port.

Two engines:

* the tiny random Qwen2 (vocab 96) with the default model's tokenizer, fed token-id prompts
  through ``/v1/completions``: cheap enough for the 200-request load test, the queue-full test
  and cancellation under load;
* the real default model (slow): completions and chat completions (raw HTTP and the ``openai``
  client), stop strings, concurrent mixed requests, cancellation, RAG, validation errors.

Every completed text must equal what a single-request ``generate`` gives for the same prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import re
import signal
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from tiny_models import VOCAB, tiny_model

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.loop import generate
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.serve import Engine, ServerConfig, create_app, make_server

LOOKAHEAD = LookaheadConfig(budget="fixed", decoding_length=16)


# ---------------------------------------------------------------- helpers


@contextlib.contextmanager
def running(engine: Engine, wrap=None):
    """Run the app as ``serve`` does (uvicorn, draining on shutdown) in a background thread on a
    free 127.0.0.1 port; yield its base URL and the uvicorn server (``handle_exit`` is SIGTERM's path).
    ``wrap``: an ASGI wrapper put around the app."""
    app = create_app(engine)
    if wrap is not None:
        app = wrap(app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, engine, log_level="warning", lifespan="on")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (server.started and (engine.ready.is_set() or engine.error is not None)):
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive() and not engine.alive


@contextlib.contextmanager
def serving(engine: Engine):
    """``running`` for tests that need only the base URL."""
    with running(engine) as (base, _):
        yield base


def parse_sse(text: str) -> list:
    """The payloads of a server-sent event stream; "[DONE]" stays a string."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_text(events: list, chat: bool) -> tuple[str, str | None]:
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    text, reason = "", None
    for e in events[:-1]:
        for choice in e["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason


def metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def cut_at_stop(text: str, stop: list[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def single_text(engine: Engine, ids: list[int], max_tokens: int, stop: list[str] = ()) -> str:
    """What a single-request ``generate`` gives for ``ids``, decoded as the server decodes."""
    out = generate(
        engine.model, ids, max_new_tokens=max_tokens, config=engine.lookahead, eos_token_id=sorted(engine.eos)
    )
    tokens = [t for t in out.sequences[0, len(ids) :].tolist() if t not in engine.eos]
    tokens = tokens[:max_tokens]
    return cut_at_stop(engine.tokenizer.decode(tokens, skip_special_tokens=True), list(stop))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def wait_idle(engine: Engine, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not engine.idle or engine.batch_size:
        assert time.monotonic() < deadline, "the engine did not drain"
        time.sleep(0.05)


ENGINE_THREAD = "rag-lookahead-engine"


def patch_engine(monkeypatch, cls, name: str, before) -> None:
    """Call ``before(self, *args, **kwargs)`` ahead of ``cls.name`` whenever the engine thread runs
    it (fault injection: delay, hold or raise). Other threads, e.g. ``single_text`` computing the
    expected outputs through ``generate``, are untouched."""
    real = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        if threading.current_thread().name == ENGINE_THREAD:
            before(self, *args, **kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)


class Gate:
    """Holds the engine thread at one method until ``set``; ``blocked`` counts the calls held."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.blocked = 0

    def wait(self, *args, **kwargs) -> None:
        self.blocked += 1
        self.event.wait(60)

    def set(self) -> None:
        self.event.set()


def hold_steps(monkeypatch) -> Gate:
    """Decode steps wait for the gate (requests stay in the batch or the queue meanwhile)."""
    from rag_lookahead.decoding.loop import DecodeBatch

    gate = Gate()
    patch_engine(monkeypatch, DecodeBatch, "verify_and_accept", gate.wait)
    return gate


def hold_prefills(monkeypatch) -> Gate:
    """Prefills wait for the gate (the request being admitted has left the queue; later ones queue)."""
    from rag_lookahead.decoding.loop import DecodeBatch

    gate = Gate()
    patch_engine(monkeypatch, DecodeBatch, "add", gate.wait)
    return gate


def slow_steps(monkeypatch, seconds: float) -> None:
    """Each decode step takes at least ``seconds`` (so a request is still running when a test acts)."""
    from rag_lookahead.decoding.loop import DecodeBatch

    patch_engine(monkeypatch, DecodeBatch, "verify_and_accept", lambda *a, **k: time.sleep(seconds))


async def until(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- the tiny model (fast)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rag_lookahead.models import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def tiny_engine(tokenizer, **changes) -> Engine:
    settings = dict(
        max_batch_size=8, max_queue=64, max_tokens_limit=64, default_max_tokens=16, lookahead_config=LOOKAHEAD
    )
    settings.update(changes)
    return Engine(tiny_model("qwen2"), tokenizer, ServerConfig(**settings))


def small_index(root, files: dict[str, str], embedder):
    """A real index (real FAISS, the real ``embedder``: the session's ``e5_embedder``, loaded once)
    of ``files`` (name -> text), built under ``root``."""
    from rag_lookahead.rag.index import build_index, load_index

    (root / "corpus").mkdir()
    for name, text in files.items():
        (root / "corpus" / name).write_text(text, encoding="utf-8")
    build_index(root / "corpus", root / "index", embedder, progress=False)
    return load_index(root / "index", embedder)


def tiny_prompts(count: int, seed: int = 7) -> list[list[int]]:
    """Token-id prompts with repeated spans (so drafts get accepted) of varied lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        span = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 8))]
        noise = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        prompts.append((noise + span) * rng.randint(1, 3) + span[:2])
    return prompts


def test_tiny_load_200_requests_32_clients(tokenizer):
    """200 requests from 32 concurrent clients (non-stream, stream, and streams dropped after the
    first chunk): every completed text equals its single-request output, nothing is lost or
    duplicated, the engine drains, memory returns near its baseline and /health still answers."""
    engine = tiny_engine(tokenizer, max_queue=256)
    prompts = tiny_prompts(6)
    budgets = [8, 12, 16, 24, 32, 20]
    expected = {i: single_text(engine, p, budgets[i]) for i, p in enumerate(prompts)}
    assert len(set(expected.values())) > 1

    async def one(client: httpx.AsyncClient, n: int, gate: asyncio.Semaphore) -> dict:
        i = n % len(prompts)
        kind = ("plain", "stream", "drop", "plain", "stream")[n % 5]
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": budgets[i], "stream": kind != "plain"}
        async with gate:
            if kind == "plain":
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                data = r.json()
                return {
                    "n": n,
                    "i": i,
                    "kind": kind,
                    "id": data["id"],
                    "text": data["choices"][0]["text"],
                    "reason": data["choices"][0]["finish_reason"],
                    "usage": data["usage"],
                }
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                raw = ""
                async for chunk in r.aiter_text():
                    raw += chunk
                    if kind == "drop" and "\n\n" in raw:
                        return {"n": n, "i": i, "kind": kind}  # leave after the first event
            events = parse_sse(raw)
            text, reason = stream_text(events, chat=False)
            ids = {e["id"] for e in events[:-1]}
            assert len(ids) == 1
            return {"n": n, "i": i, "kind": kind, "id": ids.pop(), "text": text, "reason": reason}

    async def run(base: str, count: int, clients: int) -> list[dict]:
        gate = asyncio.Semaphore(clients)
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, n, gate) for n in range(count))), 300)

    with serving(engine) as base:
        asyncio.run(run(base, 32, 32))  # warm-up: allocator pools, thread pools, tokenizer caches
        wait_idle(engine)
        gc.collect()
        baseline = rss_bytes()
        before = httpx.get(base + "/metrics").text
        start = time.perf_counter()
        results = asyncio.run(run(base, 200, 32))
        seconds = time.perf_counter() - start
        wait_idle(engine)
        gc.collect()
        after = httpx.get(base + "/metrics").text
        grown = rss_bytes() - baseline
        health = httpx.get(base + "/health")

    assert len(results) == 200 and sorted(r["n"] for r in results) == list(range(200))
    finished = [r for r in results if r["kind"] != "drop"]
    assert len(finished) == 160
    assert len({r["id"] for r in finished}) == len(finished), "a response id was reused"
    for r in finished:
        assert r["text"] == expected[r["i"]], (r["n"], r["kind"])
        assert r["reason"] == "length"
        if "usage" in r:
            assert r["usage"]["completion_tokens"] == budgets[r["i"]]
            assert r["usage"]["prompt_tokens"] == len(prompts[r["i"]])
    done = metric(after, "rag_lookahead_requests_completed_total") - metric(
        before, "rag_lookahead_requests_completed_total"
    )
    dropped = metric(after, "rag_lookahead_requests_cancelled_total") - metric(
        before, "rag_lookahead_requests_cancelled_total"
    )
    assert done + dropped == 200, (done, dropped)  # a dropped stream may have finished before the server noticed
    assert done >= 160
    assert metric(after, "rag_lookahead_queue_depth") == 0 and metric(after, "rag_lookahead_batch_size") == 0
    assert grown < 200 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB over the load"
    assert health.status_code == 200 and health.json()["status"] == "ok"
    print(
        f"\n200 requests / 32 clients on the tiny model: {seconds:.1f} s, {dropped:.0f} cancelled, "
        f"RSS {grown / 2**20:+.1f} MiB"
    )


def test_tiny_queue_full_gives_429(tokenizer):
    engine = tiny_engine(
        tokenizer, max_batch_size=1, max_queue=1, max_tokens_limit=200, lookahead=False, lookahead_config=None
    )
    prompt = tiny_prompts(1, seed=3)[0]
    expected = single_text(engine, prompt, 200)

    async def run(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 200}) for _ in range(8))
            )

    with serving(engine) as base:
        responses = asyncio.run(run(base))
        metrics = httpx.get(base + "/metrics").text
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
    for r in responses:
        if r.status_code == 429:
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and "max_queue=1" in error["message"]
        else:
            assert r.json()["choices"][0]["text"] == expected
    assert metric(metrics, "rag_lookahead_requests_total", '{endpoint="/v1/completions",status="429"}') == codes.count(
        429
    )


def test_tiny_validation_health_metrics(tokenizer):
    engine = tiny_engine(tokenizer, max_prompt_tokens=50)
    bad = [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"max_tokens": 4}), "'prompt' is required"),
        (json.dumps({"prompt": [1, 2], "temperature": 2.5}), "'temperature'"),
        (json.dumps({"prompt": [1, 2], "top_p": 0}), "'top_p'"),
        # seeds were reduced mod 2**63, so -1, 2**63-1 and 2**64-1 drew the same text
        (json.dumps({"prompt": [1, 2], "temperature": 1, "seed": -1}), "'seed'"),
        (json.dumps({"prompt": [1, 2], "temperature": 1, "seed": 2**63 - 1}), "seed + i"),
        (json.dumps({"prompt": [1, 2], "n": 9}), "'n'"),
        (json.dumps({"prompt": [1, 2], "n": 2, "stream": True}), "'n'"),
        (json.dumps({"prompt": [1, 2], "max_tokens": 0}), "'max_tokens'"),
        (json.dumps({"prompt": [1, 2], "max_tokens": 65}), "max_tokens limit is 64"),
        (json.dumps({"prompt": [1, 2], "max_tokens": "8"}), "must be an integer"),
        (json.dumps({"prompt": [1, 2], "stop": 5}), "'stop'"),
        (json.dumps({"prompt": [1, 2], "stream": "yes"}), "'stream'"),
        (json.dumps({"prompt": [1] * 51}), "at most 50"),
        (json.dumps({"prompt": [1, VOCAB + 5]}), "vocabulary"),
        (json.dumps({"prompt": ["a", "b"], "stream": True}), "send one prompt per streamed request"),
        (json.dumps({"prompt": [[5, 6], []]}), "'prompt'[1] is empty"),
        (json.dumps({"prompt": [1, 2], "logprobs": 21}), "'logprobs' must be between 0 and 20"),
    ]
    with serving(engine) as base:
        with httpx.Client(base_url=base, timeout=60) as client:
            for body, message in bad:
                r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (body, r.text)
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and message in error["message"], (body, error)
            for body, message in [
                ({"messages": []}, "'messages' is required"),
                ({"messages": [{"role": "wizard", "content": "x"}]}, "role must be one of"),
                ({"messages": [{"role": "user", "content": 3}]}, "content must be"),
                ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "'temperature'"),
            ]:
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
            r = client.post("/v1/rag", json={"question": "what?"})
            assert r.status_code == 503 and "no document index" in r.json()["error"]["message"]
            assert client.post("/v1/rag", json={"question": ""}).status_code == 400
            chat_options = (  # the answer goes through the chat template: these were dropped unseen too
                {"add_generation_prompt": False},
                {"chat_template_kwargs": {"enable_thinking": False}},
                {"chat_template": "{{ messages }}"},
                {"reasoning_effort": "low"},
                {"modalities": ["audio"]},
                {"documents": [{"text": "x"}]},
            )
            for extra in (
                {"temperature": 0.7},
                {"stop": ["budget"]},
                {"n": 2},
                {"top_k": 3},
                {"min_tokens": 5},
                {"repetition_penalty": 1.0},  # neutral no more: the answer takes the model config's penalty
                {"max_new_tokens": 40},  # transformers' names: dropped unseen before 2026-12-06
                {"suppress_tokens": [12]},
                {"do_sample": True},
                *chat_options,
            ):
                r = client.post("/v1/rag", json={"question": "what?", **extra})  # they were dropped unseen
                assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), (extra, r.text)
            for extra, advice in (  # no advice to send what /v1/rag refuses (stop, n, a temperature)
                ({"stop_strings": ["x"]}, "leave it out"),
                ({"num_return_sequences": 2}, "leave it out"),
                ({"do_sample": True}, "answers greedily: leave it out"),
                ({"max_new_tokens": 8}, "send 'max_tokens' instead"),
            ):
                r = client.post("/v1/rag", json={"question": "what?", **extra})
                assert r.status_code == 400 and r.json()["error"]["message"].endswith(advice), (extra, r.text)
            harmless_values = (
                {"model": "default"},
                {"skip_special_tokens": True},
                {"user": "u1"},
                {"temperature": 0, "n": 1, "presence_penalty": 0, "stop": [], "seed": 3},  # OpenAI clients' defaults
                {"response_format": {"type": "text"}, "stream_options": {"include_usage": True}},
                {"stop": [""], "modalities": ["text"], "chat_template_kwargs": {}},  # as chat takes them
                {"functions": [], "function_call": "none", "tools": [], "tool_choice": "none"},
                {"do_sample": False, "suppress_tokens": [], "min_new_tokens": 0},  # transformers' defaults
            )
            for harmless in harmless_values:
                assert client.post("/v1/rag", json={"question": "what?", **harmless}).status_code == 503
            r = client.get("/v1/nothing")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
            for i in range(3):  # paths nobody serves: one "other" series, not a series per path
                assert client.get(f"/random-{i}").status_code == 404
            ok = client.post(
                "/v1/completions",
                json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "stop": None, "model": "my-alias"},
            )
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            assert ok.json()["model"] == "my-alias"  # the name the client asked by comes back, as OpenAI's does
            health = client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            head = client.head("/health")  # load balancers probe with HEAD (it answered 405)
            assert head.status_code == 200 and head.content == b""
            operations = [
                op["operationId"]
                for path in client.get("/openapi.json").json()["paths"].values()
                for op in path.values()
            ]
            assert len(operations) == len(set(operations))  # GET and HEAD /health once had one id: clients refuse it
            assert client.get("/v1/models").json()["data"][0]["object"] == "model"
            r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    sample = re.compile(
        r"^[a-zA-Z_:][a-zA-Z0-9_:]*"  # metric name
        r'(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})?'  # labels
        r" -?[0-9.e+-]+$"  # value
    )
    for line in text.strip().splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    assert metric(text, "rag_lookahead_requests_total", '{endpoint="/v1/completions",status="400"}') == len(bad)
    assert metric(text, "rag_lookahead_requests_total", '{endpoint="/v1/completions",status="200"}') == 1
    assert metric(text, "rag_lookahead_requests_total", '{endpoint="other",status="404"}') == 4
    assert len([line for line in text.splitlines() if 'endpoint="other",status="404"' in line]) == 1
    assert "/random-" not in text and "/v1/nothing" not in text
    assert metric(text, "rag_lookahead_tokens_generated_total") == 4
    assert metric(text, "rag_lookahead_forward_passes_total") >= 1
    assert metric(text, "process_resident_memory_bytes") > 0
    for name in (
        "rag_lookahead_mean_accepted_tokens",
        "rag_lookahead_queue_depth",
        "rag_lookahead_batch_size",
        "rag_lookahead_requests_cancelled_total",
    ):
        assert f"# TYPE {name} " in text


def test_metrics_count_decode_steps_and_the_tokens_answers_keep(tokenizer):
    """Rows taking prompt chunks counted as decode steps that gained nothing (plain decoding's
    mean accepted read 0.36, not 1.0), and tokens a step accepted past a stop string were counted
    though the answer drops them (40 with lookahead on, 29 off, for one answer of 29 tokens).
    An answer's ``stats`` count its decode steps, not the prefill that gave its first token (plain
    decoding: 39 forward passes for 40 tokens, 1.0 accepted each), and a row cut by a stop string
    leaves the batch then (it decoded on, unseen, to max_tokens)."""
    loop = [81, 24, 23, 68, 51, 41, 44, 42] * 6  # a loop the tiny model repeats, so drafts run long
    for lookahead in (False, True):
        engine = tiny_engine(tokenizer, max_tokens_limit=64, lookahead=lookahead, prefill_chunk=3, max_batch_size=2)
        with serving(engine) as base:
            whole = httpx.post(base + "/v1/completions", json={"prompt": loop, "max_tokens": 40}, timeout=120).json()
            answer = whole["choices"][0]["text"]
            stop = answer[len(answer) // 2 :][:3]  # cuts the answer by its middle at the latest
            before = metric(httpx.get(base + "/metrics").text, "rag_lookahead_tokens_generated_total")
            cut = httpx.post(
                base + "/v1/completions", json={"prompt": loop, "max_tokens": 40, "stop": [stop]}, timeout=120
            ).json()
            wait_idle(engine, 30)
            text = httpx.get(base + "/metrics").text
        assert cut["choices"][0]["finish_reason"] == "stop"
        kept = cut["usage"]["completion_tokens"]
        assert kept < whole["usage"]["completion_tokens"]
        assert cut["stats"]["forward_passes"] < whole["stats"]["forward_passes"], (cut["stats"], whole["stats"])
        if not lookahead:  # one token a step: the prefill's first, then a forward pass each
            assert whole["usage"]["completion_tokens"] == 40 and whole["choices"][0]["finish_reason"] == "length"
            assert (whole["stats"]["forward_passes"], whole["stats"]["mean_accepted"]) == (39, 1.0)
            assert (cut["stats"]["forward_passes"], cut["stats"]["mean_accepted"]) == (kept - 1, 1.0)
        assert metric(text, "rag_lookahead_tokens_generated_total") - before == kept, lookahead
        if not lookahead:
            assert metric(text, "rag_lookahead_mean_accepted_tokens") == 1.0  # "1.0 = plain decoding"


def test_a_request_answered_by_its_prefill_costs_no_decode_step(tokenizer):
    """``max_tokens`` 1: the prefill gives the only token and the row leaves the batch then (it
    stayed for one more forward pass whose token nobody kept: 3 passes for these 3 answers)."""
    engine = tiny_engine(tokenizer, prefill_chunk=0)
    with serving(engine) as base:
        answers = [
            httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 1}, timeout=60).json()
            for p in tiny_prompts(3, seed=5)
        ]
        wait_idle(engine, 30)
        text = httpx.get(base + "/metrics").text
    assert [(a["usage"]["completion_tokens"], a["stats"]["forward_passes"]) for a in answers] == [(1, 0)] * 3
    assert metric(text, "rag_lookahead_tokens_generated_total") == 3
    assert metric(text, "rag_lookahead_forward_passes_total") == 0


def test_tiny_cancel_frees_the_slot(tokenizer):
    """A client that leaves mid-stream is dropped at the next step; the others are undisturbed."""
    engine = tiny_engine(tokenizer, max_tokens_limit=200, lookahead=False, lookahead_config=None)
    prompts = tiny_prompts(2, seed=11)
    expected = single_text(engine, prompts[1], 64)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:

            async def leaver():
                async with client.stream(
                    "POST", "/v1/completions", json={"prompt": prompts[0], "max_tokens": 200, "stream": True}
                ) as r:
                    async for _ in r.aiter_text():
                        break

            async def stayer():
                r = await client.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 64})
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(leaver(), stayer())

    with serving(engine) as base:
        _, text = asyncio.run(run(base))
        wait_idle(engine, 30)
        metrics = httpx.get(base + "/metrics").text
    assert text == expected
    assert metric(metrics, "rag_lookahead_requests_cancelled_total") == 1
    assert metric(metrics, "rag_lookahead_requests_completed_total") == 1
    assert metric(metrics, "rag_lookahead_tokens_generated_total") < 200 + 64


def test_a_request_of_n_choices_is_counted_once(tokenizer, monkeypatch):
    """The request counters counted choices: an n=4 request added 4 completed requests (and 4
    request_seconds), and one whose client left after its first choice was answered counted as
    completed and cancelled both; completed + cancelled no longer matched the requests."""
    engine = tiny_engine(tokenizer, max_batch_size=1, max_tokens_limit=200)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "n": 4, "temperature": 1.0, "seed": 1}

    async def leave_after_the_first_choice(base: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            sent = asyncio.create_task(client.post("/v1/completions", json=body | {"n": 2, "max_tokens": 200}))
            await until(lambda: engine.queue_depth == 1, 120)  # choice 0 decodes, choice 1 waits its turn
            await until(lambda: engine.queue_depth == 0, 120)  # choice 0 answered, choice 1 decodes
            sent.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sent

    with serving(engine) as base:
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        wait_idle(engine, 30)
        text = httpx.get(base + "/metrics").text
        assert metric(text, "rag_lookahead_requests_completed_total") == 1
        assert metric(text, "rag_lookahead_request_seconds_count") == 1
        slow_steps(monkeypatch, 0.02)
        asyncio.run(leave_after_the_first_choice(base))
        wait_idle(engine, 30)
        text = httpx.get(base + "/metrics").text
    assert metric(text, "rag_lookahead_requests_completed_total") == 1
    assert metric(text, "rag_lookahead_requests_cancelled_total") == 1
    assert metric(text, "rag_lookahead_request_seconds_count") == 1


def test_a_stream_is_counted_as_its_status_goes_out(tokenizer, monkeypatch):
    """A response was counted when the app returned: a stream's client reads ``[DONE]`` before the
    stream's last awaits, so a /metrics scrape right after it could miss the request. Counted now
    as the status goes out (once: the stream's end adds nothing)."""
    from rag_lookahead.decoding.loop import DecodeBatch

    engine = tiny_engine(tokenizer)
    gate = hold_after_warm_up(monkeypatch, engine, DecodeBatch, "verify_and_accept")
    label = '{endpoint="/v1/completions",status="200"}'
    body = {"prompt": tiny_prompts(1, seed=66)[0], "max_tokens": 8, "stream": True}
    with serving(engine) as base, httpx.Client(base_url=base, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            during = metric(client.get("/metrics").text, "rag_lookahead_requests_total", label)
            gate.set()
            events = parse_sse(r.read().decode())
        after = metric(client.get("/metrics").text, "rag_lookahead_requests_total", label)
    assert gate.blocked >= 1 and events[-1] == "[DONE]"
    assert (during, after) == (1, 1)


def hold_after_warm_up(monkeypatch, engine: Engine, cls, name: str) -> Gate:
    """``cls.name`` waits for the gate when the engine thread runs it once the engine is ready."""
    gate = Gate()
    patch_engine(monkeypatch, cls, name, lambda *a, **k: gate.wait() if engine.ready.is_set() else None)
    return gate


@pytest.mark.parametrize("held", ["new_batch", "settle"])
def test_the_engine_is_never_idle_while_a_request_is_unanswered_or_uncounted(tokenizer, monkeypatch, held):
    """A job taken from the queue was counted active only from its prefill: while the engine built
    a new batch for it, the engine read idle (a drain then ended at once, and a test waiting for
    idle scraped /metrics before the request was counted: CI's flaky n-choices test). And a
    finished job left ``active`` before it was answered and counted."""
    from rag_lookahead.serve.batches import Batches
    from rag_lookahead.serve.metrics import Metrics

    engine = tiny_engine(tokenizer, drain_seconds=30)
    gate = hold_after_warm_up(monkeypatch, engine, Batches if held == "new_batch" else Metrics, held)
    prompt = tiny_prompts(1, seed=61)[0]
    want = single_text(engine, prompt, 6)

    async def run(base: str, server) -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            sent = asyncio.create_task(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6}))
            await until(lambda: gate.blocked == 1, 60)
            seen = engine.queue_depth, engine.idle
            server.handle_exit(signal.SIGTERM, None)  # the drain must wait for it
            await until(lambda: engine.draining)
            await asyncio.sleep(0.3)
            gate.set()
            response = await sent
            assert seen == (0, False)
            return response

    with running(engine) as (base, server):
        response = asyncio.run(run(base, server))
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == want
    assert metric(engine.metrics.render().decode(), "rag_lookahead_requests_completed_total") == 1


# ---------------------------------------------------------------- the real default model (slow)

PROMPTS = [
    "The three primary colors are",
    "北京是中国的首都，",
]
QUESTIONS = [
    "List three primary colors, separated by commas.",
    "用一句话介绍北京。",
]


@pytest.fixture(scope="module")
def real(default_model_fp32):
    # fp32, not bf16: in bf16 a greedy near-tie can flip with the shape of the verify forward
    # (draft tree size, batch rows), so the same prompt may give different text from one request
    # to the next (seen here: an answer that repeats itself changes once the output pool holds it)
    model, tok = default_model_fp32
    engine = Engine(
        model,
        tok,
        ServerConfig(
            max_batch_size=8, max_queue=64, max_tokens_limit=64, default_max_tokens=16, lookahead_config=LOOKAHEAD
        ),
    )
    with serving(engine) as base:
        yield engine, base


@pytest.fixture(scope="module")
def llm(default_model_fp32):
    model, tok = default_model_fp32
    return LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=16, lookahead=LOOKAHEAD)


@pytest.fixture(scope="module")
def expected_chat(real, llm):
    wait_idle(real[0])  # torch work only while the engine is idle
    return [llm.invoke(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected_completion(real):
    engine = real[0]
    wait_idle(engine)
    return [single_text(engine, engine.encode_text(p), 16) for p in PROMPTS]


@pytest.mark.slow
def test_real_completions_stream_and_not(real, expected_completion):
    engine, base = real
    with httpx.Client(base_url=base, timeout=300) as client:
        for prompt, expected in zip(PROMPTS, expected_completion):
            r = client.post("/v1/completions", json={"model": "m1", "prompt": prompt, "max_tokens": 16})
            data = r.json()
            assert r.status_code == 200 and data["object"] == "text_completion" and data["model"] == "m1"
            assert data["choices"][0]["text"] == expected
            assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "stream": True})
            assert r.headers["content-type"].startswith("text/event-stream")
            events = parse_sse(r.text)
            assert all(e["object"] == "text_completion" for e in events[:-1])
            text, reason = stream_text(events, chat=False)
            assert text == expected and reason == data["choices"][0]["finish_reason"]


@pytest.mark.slow
def test_real_chat_with_openai_client(real, expected_chat):
    openai = pytest.importorskip("openai")
    engine, base = real
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=300, max_retries=0)
    for question, expected in zip(QUESTIONS, expected_chat):
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
        assert reply.usage.completion_tokens <= 16
        pieces = []
        usage = None
        for chunk in client.chat.completions.create(
            model="default", messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        assert "".join(pieces) == expected and usage.total_tokens == reply.usage.total_tokens
    sampled = [
        client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0.8, seed=5)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # seeded sampling is reproducible
    text = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=16).choices[0].text
    assert text


@pytest.mark.slow
def test_real_stop_strings(real, expected_completion):
    engine, base = real
    full = expected_completion[0]
    stop = full.strip().split()[1]  # a word in the middle of the answer
    want = cut_at_stop(full, [stop])
    assert want != full
    with httpx.Client(base_url=base, timeout=300) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16, "stop": [stop, "never-seen"]})
        choice = r.json()["choices"][0]
        assert choice["text"] == want and choice["finish_reason"] == "stop"
        r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16, "stop": stop, "stream": True})
        assert stream_text(parse_sse(r.text), chat=False) == (want, "stop")


@pytest.mark.slow
def test_real_concurrent_mixed_requests(real, expected_chat, expected_completion):
    """12 requests from 6 clients, batched together: each text equals its single-request output."""
    engine, base = real

    async def one(client, n):
        chat, stream, i = n % 2 == 0, n % 3 == 0, n % len(PROMPTS)
        if chat:
            body, path, want = (
                {"messages": [{"role": "user", "content": QUESTIONS[i]}]},
                "/v1/chat/completions",
                expected_chat[i],
            )
        else:
            body, path, want = {"prompt": PROMPTS[i]}, "/v1/completions", expected_completion[i]
        body.update(max_tokens=16, stream=stream)
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        if stream:
            got = stream_text(parse_sse(r.text), chat)[0]
        else:
            choice = r.json()["choices"][0]
            got = choice["message"]["content"] if chat else choice["text"]
        return got, want

    async def run():
        gate = asyncio.Semaphore(6)
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:

            async def gated(n):
                async with gate:
                    return await one(client, n)

            return await asyncio.gather(*(gated(n) for n in range(12)))

    before = httpx.get(base + "/metrics").text
    for got, want in asyncio.run(run()):
        assert got == want
    after = httpx.get(base + "/metrics").text
    # the requests overlapped: fewer batched forwards than rows stepped
    steps = metric(after, "rag_lookahead_row_steps_total") - metric(before, "rag_lookahead_row_steps_total")
    forwards = metric(after, "rag_lookahead_forward_passes_total") - metric(
        before, "rag_lookahead_forward_passes_total"
    )
    assert steps > forwards


@pytest.mark.slow
def test_real_non_stream_disconnect_cancels(real):
    engine, base = real
    wait_idle(engine)
    before = httpx.get(base + "/metrics").text
    # a prompt no other test sends: the shared output pool holds no earlier answer to replay,
    # which with deep drafts could finish all 64 tokens before the disconnect is seen
    prompt = "请写一篇很长的故事，讲一位灯塔看守人的一生："
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 64}, timeout=1.0)
    wait_idle(engine, 60)
    after = httpx.get(base + "/metrics").text
    assert (
        metric(after, "rag_lookahead_requests_cancelled_total")
        - metric(before, "rag_lookahead_requests_cancelled_total")
        == 1
    )
    assert (
        metric(after, "rag_lookahead_tokens_generated_total") - metric(before, "rag_lookahead_tokens_generated_total")
        < 64
    )


@pytest.mark.slow
def test_real_rag_endpoint(real, llm, tmp_path, e5_embedder):
    from rag_lookahead.rag.chains import make_prompt

    engine, base = real
    engine.index = small_index(
        tmp_path,
        {
            "tea.md": "龙井茶产自杭州西湖一带，是中国十大名茶之一。龙井茶的采摘时间通常在清明节前后。",
            "volcano.md": (
                "Mount Etna is an active volcano on the east coast of Sicily, Italy. It is 3,357 metres tall."
            ),
        },
        e5_embedder,
    )
    try:
        question = "How tall is Mount Etna?"
        r = httpx.post(base + "/v1/rag", json={"question": question, "k": 1, "max_tokens": 16}, timeout=300)
        assert r.status_code == 200, r.text
        data = r.json()
        assert len(data["sources"]) == 2 and data["sources"][0]["in_prompt"] and not data["sources"][1]["in_prompt"]
        assert "Etna" in data["sources"][0]["text"]
        assert data["stats"]["seed_passages"] == 1
        wait_idle(engine)
        docs = engine.retrieve(question, 8)[:1]
        assert data["answer"] == llm.invoke(make_prompt(question, docs)).strip()
        r = httpx.post(
            base + "/v1/rag", json={"question": question, "k": 1, "max_tokens": 16, "stream": True}, timeout=300
        )
        events = parse_sse(r.text)
        assert events[0]["type"] == "sources" and events[-2]["type"] == "done" and events[-1] == "[DONE]"
        assert events[-2]["answer"] == data["answer"]
        assert (
            "".join(e["text"] for e in events if isinstance(e, dict) and e["type"] == "delta").strip() == data["answer"]
        )
    finally:
        engine.index = None
