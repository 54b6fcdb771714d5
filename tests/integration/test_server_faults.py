"""The server never leaves a client waiting: faults injected into the engine (prefill, decode step,
retire, text tracking, the thread itself) end exactly the requests they concern, with an error that
says nothing of the internals; clients that leave early are not decoded for; /v1/rag refuses a
full queue before it retrieves. Real tiny-model server over HTTP; faults by monkeypatching.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import (  # noqa: F401 - tokenizer is a fixture
    hold_prefills,
    hold_steps,
    metric,
    parse_sse,
    patch_engine,
    running,
    serving,
    single_text,
    slow_steps,
    small_index,
    tiny_engine,
    tiny_prompts,
    tokenizer,
    until,
    wait_idle,
)

from rag_lookahead.decoding.loop import DecodeBatch
from rag_lookahead.decoding.packed_cache import PackedCache
from rag_lookahead.serve.streaming import POLL_SECONDS

SECRET = "/home/alice/.cache/weights.bin"  # in every injected exception: must never reach a client


def completion(prompt, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, **extra}


def assert_generic_error(response: httpx.Response, status: int = 500) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["message"]
    assert SECRET not in response.text and "RuntimeError" not in response.text and "Traceback" not in response.text
    if status == 500:
        assert "error id" in error["message"]


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def assert_serves_normally(base: str, engine, prompt) -> None:
    want = single_text(engine, prompt, 8)
    r = httpx.post(base + "/v1/completions", json=completion(prompt, 8), timeout=60)
    assert text_of(r) == want
    assert httpx.get(base + "/health", timeout=10).json()["status"] == "ok"


def test_prefill_failure_fails_only_the_request_at_fault(tokenizer, monkeypatch):
    """Two requests admitted in one prefill, one of them poisoned: the prefill is retried one by one,
    so only the poisoned request fails; the request already decoding is untouched."""
    engine = tiny_engine(tokenizer)
    running_prompt, good_prompt = tiny_prompts(2, seed=21)
    poisoned = [11, 12, 13, 14, 15]
    want_running, want_good = single_text(engine, running_prompt, 40), single_text(engine, good_prompt, 16)

    def poison(batch, input_ids, attention_mask, *args, **kwargs):
        for r in range(input_ids.shape[0]):
            n = int(attention_mask[r].sum())
            if input_ids[r, input_ids.shape[1] - n :].tolist() == poisoned:
                raise RuntimeError(f"CUDA out of memory reading {SECRET}")

    patch_engine(monkeypatch, DecodeBatch, "add", poison)
    gate = hold_steps(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=completion(running_prompt, 40)))
            await until(lambda: engine.active == 1)
            bad = asyncio.create_task(client.post("/v1/completions", json=completion(poisoned, 16)))
            good = asyncio.create_task(client.post("/v1/completions", json=completion(good_prompt, 16)))
            await until(lambda: engine.queue_depth == 2)  # both are admitted in the same prefill
            gate.set()
            return await asyncio.wait_for(asyncio.gather(first, bad, good), 60)

    with serving(engine) as base:
        first, bad, good = asyncio.run(run(base))
        assert text_of(first) == want_running
        assert_generic_error(bad)
        assert text_of(good) == want_good
        assert_serves_normally(base, engine, good_prompt)


def fail_once(monkeypatch, cls, name: str, error: Exception, when=lambda self, *a, **k: True) -> list:
    """``cls.name`` raises ``error`` on the engine thread the first time ``when`` holds; returns the
    list of faults still to inject (empty once it fired)."""
    faults = [error]

    def maybe_fail(*args, **kwargs):
        if faults and when(*args, **kwargs):
            raise faults.pop()

    patch_engine(monkeypatch, cls, name, maybe_fail)
    return faults


async def fill(client, engine, gate, first: dict, then: list[dict]) -> list[asyncio.Task]:
    """Post ``first``; once its prefill is held by ``gate``, post ``then`` one by one (so they queue
    in that order), then open the gate."""
    tasks = [asyncio.create_task(client.post("/v1/completions", json=first))]
    await until(lambda: gate.blocked == 1)
    for queued, body in enumerate(then, 1):
        tasks.append(asyncio.create_task(client.post("/v1/completions", json=body)))
        await until(lambda depth=queued: engine.queue_depth == depth)
    gate.set()
    return tasks


def only_the_first_fails(engine, gate, faults: list, first: dict, second: dict, want_second: str) -> str:
    """Serve ``first`` and ``second`` in one batch (``gate`` holds the first prefill until the second
    queues); the injected fault must end ``first`` alone: it gets the generic error, ``second`` its
    own text, and the server then serves normally. Returns /metrics."""

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tasks = await fill(client, engine, gate, first, [second])
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(engine) as base:
        failed, served = asyncio.run(run(base))
        assert not faults, "the fault was not injected"
        assert_generic_error(failed)
        assert text_of(served) == want_second
        assert_serves_normally(base, engine, first["prompt"])
        return httpx.get(base + "/metrics").text


def test_step_failure_fails_its_batch_and_the_engine_carries_on(tokenizer, monkeypatch):
    """A decode step of two rows raises: which row is at fault is unknown, so both requests fail (at
    once, with a generic message); the queued request is then served, and so is the next one."""
    engine = tiny_engine(tokenizer, max_batch_size=2)
    a, b, c = tiny_prompts(3, seed=22)
    want_c = single_text(engine, c, 16)
    faults = fail_once(
        monkeypatch,
        DecodeBatch,
        "verify_and_accept",
        RuntimeError(f"device-side assert in {SECRET}"),
        when=lambda batch, drafts: len(batch.rows) == 2,
    )
    gate = hold_prefills(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            # a is admitted alone, then b joins it (the batch is full) while c waits in the queue
            tasks = await fill(client, engine, gate, completion(a, 40), [completion(b, 40), completion(c, 16)])
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(engine) as base:
        ra, rb, rc = asyncio.run(run(base))
        assert not faults, "the fault was not injected"
        assert_generic_error(ra)
        assert_generic_error(rb)
        assert text_of(rc) == want_c
        assert_serves_normally(base, engine, a)
        metrics = httpx.get(base + "/metrics").text
    assert metric(metrics, "rag_lookahead_engine_errors_total") == 1
    assert metric(metrics, "rag_lookahead_requests_failed_total") == 2


def test_a_rows_failed_draw_fails_only_its_request(tokenizer, monkeypatch):
    """A sampled request's draw fails (NaN logits in its row, say) while a greedy request shares
    the step: only the sampled request gets the error; the other's text is its own, token for token."""
    from rag_lookahead.decoding.sampling import TokenChooser

    engine = tiny_engine(tokenizer, max_batch_size=2)
    a, b = tiny_prompts(2, seed=23)
    want_b = single_text(engine, b, 24)
    shared = {"rows": 0}
    patch_engine(
        monkeypatch, DecodeBatch, "verify_and_accept", lambda batch, drafts: shared.update(rows=len(batch.rows))
    )
    faults = fail_once(
        monkeypatch,
        TokenChooser,
        "walk",
        RuntimeError(f"probability tensor contains nan ({SECRET})"),
        when=lambda *args, **kwargs: shared["rows"] == 2,
    )
    gate = hold_prefills(monkeypatch)
    sampled = completion(a, 40, temperature=0.8, seed=5)
    metrics = only_the_first_fails(engine, gate, faults, sampled, completion(b, 24), want_b)
    assert metric(metrics, "rag_lookahead_engine_errors_total") == 1
    assert metric(metrics, "rag_lookahead_requests_failed_total") == 1


def test_retire_failure_fails_its_batch_and_the_engine_carries_on(tokenizer, monkeypatch):
    """Dropping a finished row from the packed cache raises (drop_rows, inside retire): every request
    of that batch ends with an error instead of waiting forever, and the engine keeps serving. A
    streamed one gets the error as an event, then ``[DONE]`` (clients wait for it to stop reading)."""
    engine = tiny_engine(tokenizer, max_batch_size=2, lookahead=False, lookahead_config=None)  # one token a step
    short, long = tiny_prompts(2, seed=23)
    faults = fail_once(monkeypatch, PackedCache, "drop_rows", RuntimeError(f"index out of range in {SECRET}"))
    gate = hold_prefills(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tasks = await fill(client, engine, gate, completion(short, 6, stream=True), [completion(long, 60)])
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(engine) as base:
        streamed, whole = asyncio.run(run(base))
        assert_generic_error(whole)
        assert streamed.status_code == 200, streamed.text
        events = parse_sse(streamed.text)
        assert events[-1] == "[DONE]" and SECRET not in streamed.text, events[-2:]
        error = events[-2]["error"]
        assert error["type"] == "server_error" and "error id" in error["message"], error
        assert not faults, "the fault was not injected"
        assert_serves_normally(base, engine, long)


def test_text_failure_fails_only_that_request(tokenizer, monkeypatch):
    """Turning one row's tokens into text raises: only that request fails; its batch mate finishes."""
    from rag_lookahead.tokens import TextTracker

    engine = tiny_engine(tokenizer, max_batch_size=2, lookahead=False, lookahead_config=None)  # one token a step
    a, b = tiny_prompts(2, seed=24)
    want_b = single_text(engine, b, 24)
    # the marked request's third block: a's prefill and first step come before b is admitted
    faults = fail_once(
        monkeypatch,
        TextTracker,
        "add",
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, SECRET),
        when=lambda tracker, tokens: "MARK" in tracker.stop and len(tracker.ids) == 2,
    )
    gate = hold_prefills(monkeypatch)
    only_the_first_fails(engine, gate, faults, completion(a, 24, stop=["MARK"]), completion(b, 24), want_b)


def test_a_failed_choice_stops_its_siblings_and_the_request_counts_as_failed(tokenizer, monkeypatch):
    """One of an n=2 request's choices fails: the other decoded on for nobody after the 500, and
    the request was counted as cancelled (the sibling's cancel ranked above the failure)."""
    from rag_lookahead.tokens import TextTracker

    engine = tiny_engine(tokenizer, max_batch_size=4, lookahead=False, lookahead_config=None)
    (prompt,) = tiny_prompts(1, seed=26)
    faults = fail_once(
        monkeypatch,
        TextTracker,
        "add",
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, SECRET),
        when=lambda tracker, tokens: len(tracker.ids) == 2,
    )
    slow_steps(monkeypatch, 0.05)  # 60 tokens: the sibling is still running when the error is answered
    with serving(engine) as base:
        r = httpx.post(base + "/v1/completions", json=completion(prompt, 60, n=2, temperature=1.0, seed=3), timeout=60)
        assert not faults
        assert_generic_error(r)
        wait_idle(engine)
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert_serves_normally(base, engine, prompt)
    assert metric(metrics, "rag_lookahead_forward_passes_total") < 10  # 59 when the sibling ran to the end
    assert metric(metrics, "rag_lookahead_requests_failed_total") == 1
    assert metric(metrics, "rag_lookahead_requests_cancelled_total") == 0
    assert metric(metrics, "rag_lookahead_requests_completed_total") == 0


class EngineKilled(BaseException):
    """Not an Exception: nothing in the engine loop may swallow it, so the thread dies."""


def test_engine_thread_death_answers_everyone_at_once(tokenizer, monkeypatch):
    """The engine thread dies: the running and the queued request get 503 at once, /health says
    "error", the ready gauge drops to 0 (it stayed 1), and a new request is refused at once instead
    of queueing for nobody."""
    engine = tiny_engine(tokenizer, max_batch_size=1)
    a, b = tiny_prompts(2, seed=25)

    def die(*args, **kwargs):
        raise EngineKilled(SECRET)

    patch_engine(monkeypatch, DecodeBatch, "verify_and_accept", die)
    gate = hold_steps(monkeypatch)  # outermost: the step waits for the gate, then kills the thread

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=completion(p, 40))) for p in (a, b)]
            await until(lambda: engine.active == 1 and engine.queue_depth == 1)
            gate.set()
            start = time.monotonic()
            responses = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return responses, time.monotonic() - start

    with serving(engine) as base:
        assert "rag_lookahead_ready 1.0" in httpx.get(base + "/metrics", timeout=10).text.splitlines()
        (ra, rb), seconds = asyncio.run(run(base))
        assert seconds < 5
        assert_generic_error(ra, 503)
        assert_generic_error(rb, 503)
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "error" and SECRET not in health.text
        assert "rag_lookahead_ready 0.0" in httpx.get(base + "/metrics", timeout=10).text.splitlines()
        start = time.monotonic()
        late = httpx.post(base + "/v1/completions", json=completion(a, 4), timeout=10)
        assert_generic_error(late, 503)
        assert time.monotonic() - start < 2


def asgi_spec(version: str):
    """An ASGI wrapper that reports ``version`` to the app. From 2.4 on, Starlette's streaming
    response stops listening for the client's disconnect and relies on ``send`` failing."""

    def wrap(app):
        async def reporting(scope, receive, send):
            if scope["type"] == "http":
                scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": version}}
            await app(scope, receive, send)

        return reporting

    return wrap


def post_and_leave(base: str, path: str, body: dict, stay: float) -> None:
    """Send a whole request on a raw socket, wait ``stay`` seconds, hang up (nothing was read)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head.encode() + data)
        time.sleep(stay)


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_stream_left_before_it_starts_is_cancelled(tokenizer, monkeypatch, spec):
    """A streaming client that hangs up while its request still waits in the queue (no event sent
    yet) is cancelled, not decoded to max_tokens, whichever ASGI version the server speaks."""
    engine = tiny_engine(tokenizer, max_batch_size=1, max_tokens_limit=200, lookahead=False, lookahead_config=None)
    slow_steps(monkeypatch, 0.02)  # 200 tokens take >= 4 s
    first, second = tiny_prompts(2, seed=26)
    with running(engine, wrap=asgi_spec(spec)) as (base, _):
        ahead = threading.Thread(
            target=httpx.post, args=(base + "/v1/completions",), kwargs={"json": completion(first, 30), "timeout": 60}
        )
        ahead.start()  # holds the only batch slot for >= 0.6 s
        asyncio.run(until(lambda: engine.active == 1))
        post_and_leave(base, "/v1/completions", completion(second, 200, stream=True), stay=0.2)
        ahead.join(60)
        time.sleep(2 * POLL_SECONDS)
        wait_idle(engine, 30)
        metrics = httpx.get(base + "/metrics").text
    assert metric(metrics, "rag_lookahead_requests_cancelled_total") == 1
    assert metric(metrics, "rag_lookahead_requests_completed_total") == 1
    assert metric(metrics, "rag_lookahead_tokens_generated_total") < 30 + 100


def test_non_stream_client_that_leaves_is_cancelled_while_tokens_flow(tokenizer, monkeypatch):
    """A non-streaming client gives up while its tokens keep coming: it is cancelled within
    CLIENT_CHECK_SECONDS (the disconnect used to be looked at only after a pause in the events, so
    a request whose steps came quickly enough was decoded to the end for nobody)."""
    import rag_lookahead.serve.streaming as streaming

    monkeypatch.setattr(
        streaming, "POLL_SECONDS", 30.0
    )  # no pause in the events this long: only the check finds the leave
    engine = tiny_engine(tokenizer, max_tokens_limit=200, lookahead=False, lookahead_config=None)
    slow_steps(monkeypatch, 0.02)  # 200 tokens take >= 4 s
    with serving(engine) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=completion(tiny_prompts(1, seed=28)[0], 200), timeout=1.0)
        wait_idle(engine, 10)
        metrics = httpx.get(base + "/metrics").text
    assert metric(metrics, "rag_lookahead_requests_cancelled_total") == 1
    assert metric(metrics, "rag_lookahead_tokens_generated_total") < 100


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory, e5_embedder):
    """A real two-passage index (real embedder, real FAISS)."""
    return small_index(
        tmp_path_factory.mktemp("rag"),
        {
            "tea.md": "Longjing tea grows near West Lake in Hangzhou.",
            "etna.md": "Mount Etna is an active volcano on the east coast of Sicily.",
        },
        e5_embedder,
    )


def test_rag_refuses_a_full_queue_before_retrieving(tokenizer, monkeypatch, tiny_index):
    engine = tiny_engine(tokenizer, max_batch_size=1, max_queue=1)
    engine.index = tiny_index
    retrievals = []
    real_retrieve = engine.retrieve
    monkeypatch.setattr(engine, "retrieve", lambda *a: retrievals.append(a) or real_retrieve(*a))
    a, b = tiny_prompts(2, seed=27)
    gate = hold_steps(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=completion(a, 8)))]
            await until(lambda: engine.active == 1)  # a holds the batch slot (its step waits for the gate)
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=completion(b, 8))))
            await until(lambda: engine.queue_depth == 1)  # b fills the queue
            refused = await client.post("/v1/rag", json={"question": "How tall is Etna?", "max_tokens": 4})
            gate.set()
            return refused, await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(engine) as base:
        refused, done = asyncio.run(run(base))
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        assert retrievals == []
        assert all(r.status_code == 200 for r in done)
        # with room it retrieves (and then refuses: the tiny model's 96-token vocabulary cannot hold
        # the chat prompt; the real-model RAG test covers the answer)
        r = httpx.post(base + "/v1/rag", json={"question": "How tall is Etna?", "max_tokens": 4}, timeout=60)
        assert len(retrievals) == 1 and r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


@pytest.mark.parametrize("lookahead", [True, False])
def test_rag_shows_k_passages_and_seeds_the_drafter_with_the_rest(tiny_index, monkeypatch, lookahead):
    """``k_prompt`` 1, ``k_seed`` 2 over the two-passage index (a real-vocabulary tiny model, so the
    chat prompt is taken): the nearest passage is in the prompt and marked so, the other is the one
    seed passage, encoded for the drafter only with lookahead on (off, nothing reads it)."""
    from test_server import LOOKAHEAD
    from tiny_models import real_vocab_model

    from rag_lookahead.serve import Engine, ServerConfig

    model, tokenizer = real_vocab_model()
    config = ServerConfig(k_prompt=1, k_seed=2, lookahead=lookahead, lookahead_config=LOOKAHEAD if lookahead else None)
    engine = Engine(model, tokenizer, config)
    engine.index = tiny_index
    encoded = []
    real_encode = engine.encode_passages
    monkeypatch.setattr(
        engine, "encode_passages", lambda passages: encoded.append(list(passages)) or real_encode(passages)
    )
    question = "Where is Mount Etna?"
    with serving(engine) as base:
        r = httpx.post(base + "/v1/rag", json={"question": question, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    other = tiny_index.search(question, 2)[1].to_document().page_content
    assert [s["in_prompt"] for s in answer["sources"]] == [True, False], answer["sources"]
    assert answer["stats"]["seed_passages"] == 1, answer["stats"]
    assert encoded == ([[other]] if lookahead else []), encoded


def bare_prompt_length(tokenizer, question: str, passages=()) -> int:
    """Tokens of /v1/rag's prompt for ``question`` with ``passages`` (none: the template's words and the question)."""
    from rag_lookahead.rag.chains import make_prompt
    from rag_lookahead.tokens import encode_messages

    return len(encode_messages(tokenizer, [{"role": "user", "content": make_prompt(question, list(passages))}]))


def first_passage(index, question: str):
    """The passage /v1/rag shows first for ``question`` (the nearest in ``index``), as a document."""
    return index.search(question, 2)[0].to_document()


def test_rag_names_k_when_the_built_prompt_is_too_long(tokenizer, tiny_index):
    """The question fits, and with its first passage, but the prompt the server builds around it
    with two does not: the error says so and names what the client can change, not a 'prompt' it
    never sent; with 'k' 1 the prompt is no longer refused for its length."""
    question = "How tall is Etna?"
    one = bare_prompt_length(tokenizer, question, [first_passage(tiny_index, question)])
    engine = tiny_engine(tokenizer, max_prompt_tokens=one)
    engine.index = tiny_index
    with serving(engine) as base:
        r = httpx.post(base + "/v1/rag", json={"question": question, "k": 2, "max_tokens": 4}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "k", r.text
        assert "built from the question and its 2 passage(s)" in error["message"] and "smaller 'k'" in error["message"]
        assert "no smaller" not in error["message"], r.text
        # k 1 fits the limit (and is refused only for the tiny model's 96-token vocabulary)
        r = httpx.post(base + "/v1/rag", json={"question": question, "k": 1, "max_tokens": 4}, timeout=60)
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text


def test_rag_names_the_question_where_even_one_passage_makes_the_prompt_too_long(tokenizer, tiny_index):
    """Two passages overflow the prompt limit, and the first alone does too: the refusal named 'k'
    ("ask with a smaller 'k'"), and the client's retry with 'k' 1 was refused naming 'question'.
    No k helps, so the first refusal names the question, and still counts the prompt it refused."""
    question = "How tall is Etna?"
    one = bare_prompt_length(tokenizer, question, [first_passage(tiny_index, question)])
    engine = tiny_engine(tokenizer, max_prompt_tokens=one - 1)
    engine.index = tiny_index
    assert bare_prompt_length(tokenizer, question) <= one - 1  # the question fits with no passage
    with serving(engine) as base:
        r = httpx.post(base + "/v1/rag", json={"question": question, "k": 2, "max_tokens": 4}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "question", r.text
        two = bare_prompt_length(tokenizer, question, [d.to_document() for d in tiny_index.search(question, 2)])
        assert error["message"] == (
            f"the prompt built from the question and its 2 passage(s) has {two} tokens; this server accepts at"
            f" most {one - 1} (max_prompt_tokens); even with one passage it is too long, so no smaller 'k'"
            " helps: ask a shorter question"
        ), r.text
        r = httpx.post(base + "/v1/rag", json={"question": question, "k": 1, "max_tokens": 4}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "question", r.text


def test_rag_searches_the_stripped_question_and_refuses_one_the_context_cannot_hold(tokenizer, monkeypatch, tiny_index):
    """/v1/rag searched with the question as sent, spaces and all (ask and the chains strip it:
    spaces moved the dense ranking, so other passages were shown), and measured the question
    against max_prompt_tokens only: one longer than the model's context was retrieved for, then
    refused naming 'k', which no value could fix."""
    engine = tiny_engine(tokenizer)
    engine.index = tiny_index
    retrievals = []
    real_retrieve = engine.retrieve
    monkeypatch.setattr(engine, "retrieve", lambda *a: retrievals.append(a) or real_retrieve(*a))
    assert engine.context_limit is not None and engine.context_limit < engine.config.max_prompt_tokens
    with serving(engine) as base:
        httpx.post(base + "/v1/rag", json={"question": "  How tall is Etna?\n\n", "max_tokens": 4}, timeout=60)
        assert [question for question, _ in retrievals] == ["How tall is Etna?"]
        long = " ".join(["Etna"] * engine.context_limit)
        r = httpx.post(base + "/v1/rag", json={"question": long, "max_tokens": 4}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "question", r.text
        assert "model's context holds" in error["message"] and len(retrievals) == 1


def test_rag_measures_the_question_with_the_prompt_around_it_before_retrieving(tokenizer, monkeypatch, tiny_index):
    """/v1/rag measured the question alone before retrieving, but the prompt adds the template's
    words (~130 tokens) and a passage: a question in that gap was retrieved for, then refused
    naming 'k' ("ask with a smaller 'k'") even at k=1, which no k could fix."""
    engine = tiny_engine(tokenizer, max_prompt_tokens=200)
    assert engine.context_limit is None or engine.context_limit > 200
    engine.index = tiny_index
    retrievals = []
    real_retrieve = engine.retrieve
    monkeypatch.setattr(engine, "retrieve", lambda *a: retrievals.append(a) or real_retrieve(*a))
    question = " ".join(["Etna"] * 60)  # 180 tokens
    assert len(engine.encode_text(question)) < 200 < bare_prompt_length(tokenizer, question)  # in the gap
    with serving(engine) as base:
        r = httpx.post(base + "/v1/rag", json={"question": question, "k": 1, "max_tokens": 4}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "question", r.text
        assert "with no passage" in error["message"] and "shorter question" in error["message"], r.text
        assert retrievals == []
    # the question fits with the template, but not with its one passage: only a shorter question helps
    short = "How tall is Etna?"
    engine = tiny_engine(tokenizer, max_prompt_tokens=bare_prompt_length(tokenizer, short) + 1)
    engine.index = tiny_index
    with serving(engine) as base:
        r = httpx.post(base + "/v1/rag", json={"question": short, "k": 1, "max_tokens": 4}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "question", r.text
        assert "its 1 passage(s)" in error["message"] and "'k'" not in error["message"], r.text


def test_a_client_gone_after_one_choice_cancels_the_rest_and_gets_499(tokenizer, monkeypatch):
    """Two choices: the short one is answered, then the client leaves while the long one runs.
    Collecting them gives None (the route's 499) and the long one is stopped; a list holding the
    answer and a hole for the missing choice would be shaped into a 500."""
    from rag_lookahead.serve import routes

    engine = tiny_engine(tokenizer, max_tokens_limit=200, lookahead=False, lookahead_config=None)
    slow_steps(monkeypatch, 0.05)
    engine.start()
    assert engine.ready.wait(60)
    jobs = []

    class LeavesOnceTheShortOneIsDone:  # the part of a Starlette request collect asks
        async def is_disconnected(self) -> bool:
            return jobs[0].finished

    async def run():
        jobs.extend(engine.new_request(p, n, []) for p, n in zip(tiny_prompts(2, seed=29), (1, 200)))
        short, long = jobs
        engine.submit(short, long)
        start = time.monotonic()
        answers = await routes._collect_all([short, long], LeavesOnceTheShortOneIsDone(), engine)
        await until(lambda: engine.idle and engine.batch_size == 0, timeout=10)
        return answers, time.monotonic() - start

    try:
        answers, seconds = asyncio.run(run())
    finally:
        engine.stop()
    assert jobs[0].finished and answers is None, answers
    assert seconds < 5, seconds  # 200 steps of 0.05 s: the long one did not run to its end
