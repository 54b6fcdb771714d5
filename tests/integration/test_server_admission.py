"""Admission by tokens and chunked prefill in the real tiny-model server: a request that would take
the running and waiting requests past the KV token budget gets 429 with a ``Retry-After`` header
at once (streamed or not), one larger than the whole budget gets 400, the queue-full 429 carries
the header too; long prompts prefilled in chunks give the texts of a single-request ``generate``.
"""

from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import (  # noqa: F401 - tokenizer is a fixture
    hold_steps,
    metric,
    serving,
    single_text,
    slow_steps,
    tiny_engine,
    tiny_prompts,
    tokenizer,
    until,
)
from tiny_models import tiny_model

from rag_lookahead.errors import ConfigError
from rag_lookahead.serve import ServerConfig, admission
from rag_lookahead.serve.admission import RETRY_MAX, RETRY_MIN, TokenBudget, default_token_budget, kv_bytes_per_token
from rag_lookahead.serve.command import config_from_args, parse_args
from rag_lookahead.serve.jobs import Job


def completion(prompt, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, **extra}


def assert_busy(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and "retry" in error["message"]
    assert response.headers["retry-after"].isdigit() and 1 <= int(response.headers["retry-after"]) <= 60


def test_token_budget_refuses_with_429_and_retry_after(tokenizer, monkeypatch):
    """Budget 200: a running request (20 + 60) and a waiting one (20 + 60) hold 160; a third of 80
    tokens is refused at once, streamed or not, while a small one (20 + 10) still fits; once the
    first two are done the third is served."""
    engine = tiny_engine(tokenizer, max_batch_size=1, max_batch_tokens=200)
    a, b, c = (p[:20] + [5] * (20 - len(p[:20])) for p in tiny_prompts(3, seed=31))
    want_a, want_c = single_text(engine, a, 60), single_text(engine, c, 60)
    gate = hold_steps(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=completion(a, 60)))
            await until(lambda: engine.active == 1)
            second = asyncio.create_task(client.post("/v1/completions", json=completion(b, 60)))
            await until(lambda: engine.queue_depth == 1)
            refused = await asyncio.wait_for(client.post("/v1/completions", json=completion(c, 60)), 10)
            streamed = await asyncio.wait_for(client.post("/v1/completions", json=completion(c, 60, stream=True)), 10)
            small = asyncio.create_task(client.post("/v1/completions", json=completion(c[:10], 10)))
            await until(lambda: engine.queue_depth == 2)
            gate.set()
            done = await asyncio.wait_for(asyncio.gather(first, second, small), 60)
            again = await client.post("/v1/completions", json=completion(c, 60))
            return refused, streamed, done, again

    with serving(engine) as base:
        refused, streamed, (ra, rb, rsmall), again = asyncio.run(run(base))
    assert_busy(refused)
    assert "max_batch_tokens" in refused.json()["error"]["message"]
    assert_busy(streamed)
    assert ra.status_code == rb.status_code == rsmall.status_code == 200
    assert ra.json()["choices"][0]["text"] == want_a
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == want_c


def test_request_larger_than_the_whole_budget_gets_400(tokenizer):
    """Budget 50: 10 + 45 tokens can never fit (400), 10 + 8 is served, and so is 10 + 40, exactly
    the whole budget (a request that fills an empty budget must not be refused as too large)."""
    engine = tiny_engine(tokenizer, max_batch_tokens=50)
    prompt = tiny_prompts(1, seed=32)[0][:10]
    assert len(prompt) == 10
    with serving(engine) as base:
        too_big = httpx.post(base + "/v1/completions", json=completion(prompt, 45), timeout=10)
        fits = httpx.post(base + "/v1/completions", json=completion(prompt, 8), timeout=60)
        whole = httpx.post(base + "/v1/completions", json=completion(prompt, 40), timeout=60)
    assert whole.status_code == 200, whole.text
    assert too_big.status_code == 400, too_big.text
    error = too_big.json()["error"]
    assert error["code"] == "request_too_large" and "max_batch_tokens" in error["message"] and "50" in error["message"]
    assert fits.status_code == 200 and fits.json()["choices"][0]["text"] == single_text(engine, prompt, 8)


def test_a_requests_choices_are_admitted_together_or_not_at_all(tokenizer, monkeypatch):
    """``n`` choices hold n x (prompt + max_tokens): more than the whole budget is 400, more than
    what is free is 429, and in neither case does any choice run (before, the choices that still
    fitted were queued one by one and decoded with nobody to read them)."""
    engine = tiny_engine(tokenizer, max_batch_size=4, max_batch_tokens=200)
    a, c = (p[:20] + [5] * (20 - len(p[:20])) for p in tiny_prompts(2, seed=36))
    gate = hold_steps(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=completion(a, 60)))  # holds 80
            await until(lambda: engine.active == 1)
            never = await client.post("/v1/completions", json=completion(c, 30, n=5, temperature=1.0, seed=1))
            not_now = await client.post("/v1/completions", json=completion(c, 20, n=4, temperature=1.0, seed=1))
            counts = engine.active, engine.queue_depth
            gate.set()
            await asyncio.wait_for(first, 60)
            fits = await client.post("/v1/completions", json=completion(c, 20, n=2, temperature=1.0, seed=1))
            return never, not_now, counts, fits

    with serving(engine) as base:
        never, not_now, counts, fits = asyncio.run(run(base))
    assert never.status_code == 400, never.text  # 5 x 50 > 200
    assert never.json()["error"]["code"] == "request_too_large" and "5 choices" in never.json()["error"]["message"]
    assert_busy(not_now)  # 4 x 40 + 80 > 200, though 3 of them would have fitted
    assert counts == (1, 0)  # only the first request: no choice of the refused ones runs
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2


async def one_running_one_waiting(client, engine, a, b) -> list:
    """Requests for prompts ``a`` (running) and ``b`` (waiting) of a one-row engine, once both are there."""
    tasks = [asyncio.create_task(client.post("/v1/completions", json=completion(a, 8)))]
    await until(lambda: engine.active == 1)
    tasks.append(asyncio.create_task(client.post("/v1/completions", json=completion(b, 8))))
    await until(lambda: engine.queue_depth == 1)
    return tasks


def test_queue_full_429_carries_retry_after(tokenizer, monkeypatch):
    engine = tiny_engine(tokenizer, max_batch_size=1, max_queue=1)
    a, b, c = tiny_prompts(3, seed=33)
    gate = hold_steps(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tasks = await one_running_one_waiting(client, engine, a, b)
            refused = await asyncio.wait_for(client.post("/v1/completions", json=completion(c, 8)), 10)
            gate.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return refused

    with serving(engine) as base:
        refused = asyncio.run(run(base))
    assert_busy(refused)
    assert "max_queue" in refused.json()["error"]["message"]


def test_queue_counts_each_choice(tokenizer, monkeypatch):
    """max_queue=2, one waiting: a request of n=2 choices is refused (it was queued, leaving 3 waiting
    and the next client told "3 requests are already waiting"); n=1 still fits; n above max_queue
    can never fit, so it is a 400, not a 429 to retry forever."""
    engine = tiny_engine(tokenizer, max_batch_size=1, max_queue=2)
    a, b, c = tiny_prompts(3, seed=36)
    gate = hold_steps(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tasks = await one_running_one_waiting(client, engine, a, b)
            pair = await asyncio.wait_for(client.post("/v1/completions", json=completion(c, 8, n=2)), 10)
            depth = engine.queue_depth
            many = await asyncio.wait_for(client.post("/v1/completions", json=completion(c, 8, n=3)), 10)
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=completion(c, 8))))
            await until(lambda: engine.queue_depth == 2)
            gate.set()
            done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return pair, depth, many, done

    with serving(engine) as base:
        pair, depth, many, done = asyncio.run(run(base))
    assert_busy(pair)
    assert depth == 1 and "has 2" in pair.json()["error"]["message"]
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
    assert "max_queue=2" in many.json()["error"]["message"]
    assert [r.status_code for r in done] == [200, 200, 200]


async def head_only(base: str, length: int) -> bytes:
    """The answer to a completions request whose head declares ``length`` body bytes that never come."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {length}\r\n\r\n".encode())
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(4096), 10)
    finally:
        writer.close()


def test_choices_that_never_fit_get_400_while_the_queue_is_full(tokenizer, monkeypatch):
    """max_queue=2, full: n=3 (or 2 prompts x n=2, or a chat request's n=3) can never wait in the
    queue, so it is a 400 then too, as when the queue has room (it was a 429 to retry, "this request
    has 1", before the body was read); n=1 and n=2 could fit later: 429 with their own count. A body
    over 64 KiB is still refused unread while the queue is full, without a count it does not know."""
    engine = tiny_engine(tokenizer, max_batch_size=1, max_queue=2)
    a, b, c = tiny_prompts(3, seed=39)
    gate = hold_steps(monkeypatch)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tasks = await one_running_one_waiting(client, engine, a, b)
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=completion(c, 8))))
            await until(lambda: engine.queue_depth == 2)
            never = [
                await client.post("/v1/completions", json=completion(c, 8, n=3)),
                await client.post("/v1/completions", json=completion([c, a], 8, n=2)),
                await client.post("/v1/chat/completions", json={**chat, "n": 3}),
            ]
            later = [await client.post("/v1/completions", json=completion(c, 8, n=k)) for k in (1, 2)]
            unread = await head_only(base, 100_000)
            gate.set()
            return never, later, unread, await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(engine) as base:
        never, later, unread, done = asyncio.run(run(base))
    for response, choices in zip(never, (3, 4, 3)):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "n" and error["code"] == "request_too_large", error
        assert f"{choices} choices" in error["message"] and "max_queue=2" in error["message"], error
    for response, choices in zip(later, (1, 2)):
        assert_busy(response)
        assert f"this request has {choices} (max_queue=2)" in response.json()["error"]["message"]
    status, _, rest = unread.partition(b"\r\n")
    assert b" 429 " in status, unread
    assert b"retry-after" in rest.lower() and b"max_queue=2" in rest and b"this request has" not in rest, rest
    assert [r.status_code for r in done] == [200, 200, 200]


def test_a_request_larger_than_the_budget_gets_400_while_the_budget_is_full(tokenizer, monkeypatch):
    """Budget 160, all held (two requests of 20 + 60): one needing 20 + 150 can never fit, so it is a
    400 then too (it was a 429 to retry, "this request needs 1", before the body was read); one of
    20 + 10 could fit later: 429 with what it needs. A body over 64 KiB is refused unread: a full
    budget has no room for any request (judged as needing one token, not none, which "fits")."""
    engine = tiny_engine(tokenizer, max_batch_size=1, max_batch_tokens=160, max_tokens_limit=200)
    a, b, c = (p[:20] + [5] * (20 - len(p[:20])) for p in tiny_prompts(3, seed=40))
    gate = hold_steps(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=completion(a, 60)))]
            await until(lambda: engine.active == 1)
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=completion(b, 60))))
            await until(lambda: engine.queue_depth == 1)
            never = await client.post("/v1/completions", json=completion(c, 150))
            later = await client.post("/v1/completions", json=completion(c, 10))
            unread = await head_only(base, 100_000)
            gate.set()
            return never, later, unread, await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(engine) as base:
        never, later, unread, done = asyncio.run(run(base))
    assert never.status_code == 400, never.text
    error = never.json()["error"]
    assert error["code"] == "request_too_large" and "170 tokens" in error["message"], error
    assert "whole budget is 160" in error["message"], error
    assert_busy(later)
    assert "hold 160 of its 160 KV tokens (max_batch_tokens) and this request needs 30" in later.text
    status, _, rest = unread.partition(b"\r\n")
    assert b" 429 " in status, unread
    assert b"retry-after" in rest.lower() and b"hold 160 of its 160" in rest and b"this request needs" not in rest, rest
    assert [r.status_code for r in done] == [200, 200]


@pytest.mark.parametrize("chunk", [0, 16])
def test_long_prompts_in_chunks_give_single_request_texts(tokenizer, chunk):
    """Short and long (180-token) prompts at once, prefilled in chunks of 16 (or whole): every text
    equals a single-request ``generate``'s."""
    engine = tiny_engine(tokenizer, max_batch_size=4, prefill_chunk=chunk, max_tokens_limit=64)
    short = tiny_prompts(3, seed=34)
    long_prompts = [(p * 20)[:180] for p in tiny_prompts(2, seed=35)]
    prompts = short + long_prompts
    want = [single_text(engine, p, 24) for p in prompts]

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            posts = [client.post("/v1/completions", json=completion(p, 24)) for p in prompts]
            return await asyncio.wait_for(asyncio.gather(*posts), 120)

    with serving(engine) as base:
        responses = asyncio.run(run(base))
        metrics = httpx.get(base + "/metrics").text
    assert [r.json()["choices"][0]["text"] for r in responses] == want
    # admissions are counted whether a prompt is prefilled whole or in chunks inside the steps
    assert 1 <= metric(metrics, "rag_lookahead_prefills_total") <= len(prompts)
    assert metric(metrics, "rag_lookahead_prompt_tokens_total") == sum(len(p) for p in prompts)


def test_settings_and_their_command_line():
    config = config_from_args(parse_args(["--prefill-chunk", "256", "--max-batch-tokens", "9000"]), environ={})
    assert (config.prefill_chunk, config.max_batch_tokens, config.max_draft_rows) == (256, 9000, None)
    config = config_from_args(parse_args(["--prefill-chunk", "0", "--max-draft-rows", "16"]), environ={})
    assert (config.prefill_chunk, config.max_batch_tokens, config.max_draft_rows) == (0, None, 16)
    config = config_from_args(parse_args(["--output-pool-nodes", "300000", "--branch-length", "16"]), environ={})
    assert (config.lookahead_config.output_pool_nodes, config.lookahead_config.branch_length) == (300_000, 16)
    with pytest.raises(ConfigError, match="output_pool_nodes"):  # LookaheadConfig's own bound
        config_from_args(parse_args(["--output-pool-nodes", "0"]), environ={})
    assert ServerConfig().prefill_chunk == 512
    for bad in (dict(prefill_chunk=-1), dict(max_batch_tokens=0), dict(max_draft_rows=True)):
        with pytest.raises(ConfigError):
            ServerConfig(**bad)


def test_default_budget_is_between_one_request_and_what_the_limits_allow(monkeypatch):
    """Whatever the host's free memory: a budget below one request of the largest size would refuse
    every such request as too large (with 1 MiB free, 512 tokens fit), one above what the batch and
    the queue can hold is never used."""
    model = tiny_model("qwen2")
    assert kv_bytes_per_token(model) == 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 KV heads of 16, fp32
    config = ServerConfig()
    budget = default_token_budget(model, config)
    largest = config.max_prompt_tokens + config.max_tokens_limit
    ceiling = (config.max_batch_size + config.max_queue) * largest
    assert largest <= budget <= ceiling
    monkeypatch.setattr(admission, "free_memory", lambda device: (1 << 20, admission.CPU_SHARE))  # a low-memory host
    assert (1 << 20) // 4 // kv_bytes_per_token(model) < largest
    assert default_token_budget(model, config) == largest
    monkeypatch.setattr(admission, "free_memory", lambda device: (1 << 50, admission.CPU_SHARE))
    assert default_token_budget(model, config) == ceiling


def budget_holding(limit: int, prompt_tokens: int, max_tokens: int) -> TokenBudget:
    """A budget of ``limit`` tokens that holds one real job of ``prompt_tokens`` + ``max_tokens``."""

    async def job() -> Job:  # a job is made where a handler's event loop runs
        return Job([5] * prompt_tokens, max_tokens, [], [], tracker=None)

    budget = TokenBudget(limit)
    budget.hold(asyncio.run(job()))
    return budget


def test_a_full_budget_refuses_at_the_door_and_retry_after_stays_within_its_bounds():
    """Held exactly to its limit, the budget refuses a request whose body is not read yet (taken to
    need 1 token: taken as 0 it "fitted"); Retry-After is 1 to 60 s however far the rate is off."""
    full = budget_holding(50, 10, 40)
    refusal = full.refusal((), 10.0)
    assert refusal is not None and refusal.status == 429 and refusal.headers["Retry-After"] == "1"
    assert budget_holding(51, 10, 40).refusal((), 10.0) is None  # one token free: room for a request
    slow = budget_holding(100, 10, 90)
    assert slow.retry_after(10_000, 1.0) == RETRY_MAX == 60  # ~9,000 s at this rate: capped
    assert slow.retry_after(1, 1000.0) == RETRY_MIN == 1


def test_engine_batches_take_the_settings(tokenizer):
    engine = tiny_engine(tokenizer, prefill_chunk=64, max_draft_rows=2)
    batch = engine.batches.new_batch()
    assert batch.prefill.budget == 64 and batch.max_draft_rows == 2
    assert tiny_engine(tokenizer, prefill_chunk=0).batches.new_batch().prefill is None


# ---------------------------------------------------------------- fairness between API keys

KEY_A, KEY_B = "sk-test-aaaaaaaaaaaaaaaa", "sk-test-bbbbbbbbbbbbbbbb"


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_keys_take_turns_for_free_slots(tokenizer, monkeypatch):
    """One key's backlog no longer holds another key's request until all of it is served: with a
    first-in-first-out queue B's request ran after all of A's, here it runs after one of them."""
    engine = tiny_engine(tokenizer, max_batch_size=1, api_keys=(KEY_A, KEY_B))
    prompts = tiny_prompts(4, seed=37)
    gate = hold_steps(monkeypatch)
    finished: list[str] = []

    async def ask(client, name: str, key: str, prompt) -> httpx.Response:
        response = await client.post("/v1/completions", json=completion(prompt, 4), headers=_as(key))
        finished.append(name)
        return response

    async def run(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tasks = [asyncio.create_task(ask(client, "A1", KEY_A, prompts[0]))]
            await until(lambda: engine.active == 1)
            for depth, (name, key, prompt) in enumerate(
                [("A2", KEY_A, prompts[1]), ("A3", KEY_A, prompts[2]), ("B1", KEY_B, prompts[3])], start=1
            ):
                tasks.append(asyncio.create_task(ask(client, name, key, prompt)))
                await until(lambda depth=depth: engine.queue_depth == depth)
            gate.set()
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(engine) as base:
        responses = asyncio.run(run(base))
    assert [r.status_code for r in responses] == [200] * 4
    assert finished == ["A1", "A2", "B1", "A3"]  # one row at a time: finished in the order admitted


def test_max_queue_per_key_refuses_one_keys_backlog_not_another_key(tokenizer, monkeypatch):
    """A key's full queue: 429 for that key only; a request that could never fit (n, or the KV
    budget) gets its 400 even then (the budget's got a 429, to retry forever)."""
    engine = tiny_engine(
        tokenizer, max_batch_size=1, max_queue_per_key=2, api_keys=(KEY_A, KEY_B), max_batch_tokens=200
    )
    prompts = [p[:20] for p in tiny_prompts(5, seed=38)]
    gate = hold_steps(monkeypatch)

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:

            def post(key: str, prompt, **extra):
                return client.post("/v1/completions", json=completion(prompt, 4, **extra), headers=_as(key))

            tasks = [asyncio.create_task(post(KEY_A, prompts[0]))]
            await until(lambda: engine.active == 1)
            for depth in (1, 2):
                tasks.append(asyncio.create_task(post(KEY_A, prompts[depth])))
                await until(lambda depth=depth: engine.queue_depth == depth)
            refused = await asyncio.wait_for(post(KEY_A, prompts[3]), 10)
            never = await asyncio.wait_for(post(KEY_A, (prompts[3] * 20)[:200]), 10)  # 200 + 4 > 200
            too_many = await asyncio.wait_for(post(KEY_B, prompts[3], n=3), 10)
            tasks.append(asyncio.create_task(post(KEY_B, prompts[4])))
            await until(lambda: engine.queue_depth == 3)
            gate.set()
            return refused, never, too_many, await asyncio.wait_for(asyncio.gather(*tasks), 60)

    with serving(engine) as base:
        refused, never, too_many, done = asyncio.run(run(base))
    assert_busy(refused)
    assert "this API key already has 2 choices waiting" in refused.json()["error"]["message"]
    assert never.status_code == 400 and never.json()["error"]["code"] == "request_too_large", never.text
    assert "max_batch_tokens" in never.json()["error"]["message"]
    assert too_many.status_code == 400 and "max_queue_per_key=2" in too_many.json()["error"]["message"]
    assert [r.status_code for r in done] == [200] * 4


def test_max_queue_per_key_is_checked():
    with pytest.raises(ConfigError, match="max_queue_per_key"):
        ServerConfig(max_queue_per_key=0, api_keys=(KEY_A,))
    with pytest.raises(ConfigError, match="max_queue_per_key needs API keys"):  # it capped the whole queue
        ServerConfig(max_queue_per_key=2)
    args = parse_args(["--max-queue-per-key", "3", "--api-key", KEY_A])
    assert config_from_args(args, {}).max_queue_per_key == 3


def test_the_batch_never_grows_past_max_batch_size(tokenizer, monkeypatch):
    """Six requests at once for a two-row engine whose steps are slowed: rows are taken from the
    queue only as far as the batch has room (it grew to six rows), and every request is served."""
    engine = tiny_engine(tokenizer, max_batch_size=2, lookahead=False, lookahead_config=None)
    slow_steps(monkeypatch, 0.05)
    engine.start()
    assert engine.ready.wait(60)

    async def run():
        jobs = [engine.new_request(p, 12, []) for p in tiny_prompts(6, seed=37)]
        for job in jobs:
            engine.submit(job)
        sizes = []
        while not engine.idle:
            sizes.append(engine.batch_size)
            await asyncio.sleep(0.005)
        ends = []
        for job in jobs:
            while (event := await asyncio.wait_for(job.channel.get(), 30))[0] == "piece":
                pass
            ends.append(event[0])
        return sizes, ends

    try:
        sizes, ends = asyncio.run(run())
    finally:
        engine.stop()
    assert max(sizes) == 2, sorted(set(sizes))
    assert ends == ["done"] * 6
