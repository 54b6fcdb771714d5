"""Request limits: a huge body is refused with 413 before it is read, tokenizing a long prompt
never stalls /health or running streams, messages and stop strings are capped, malformed JSON
gets a 400, and ServerConfig refuses settings out of range. Real tiny-model server over HTTP.
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
    parse_sse,
    running,
    serving,
    slow_steps,
    tiny_engine,
    tiny_prompts,
    tokenizer,
    until,
)

from rag_lookahead.errors import ConfigError
from rag_lookahead.serve import ServerConfig

MiB = 1 << 20


def raw_request(base: str, head: str, body_parts, read_timeout: float = 10) -> tuple[int, dict, float]:
    """Send ``head`` and as much of ``body_parts`` as the server takes; return the status, the JSON
    body and the seconds from the first byte sent to the response's arrival."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        start = time.monotonic()
        s.sendall(head.encode())
        s.settimeout(0.2)
        for part in body_parts:
            try:
                s.sendall(part)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                break  # the server answered and stopped reading
        s.settimeout(read_timeout)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        seconds = time.monotonic() - start
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split()[1])
    return status, json.loads(payload[: _length(data)]), seconds


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_a_body_that_stalls_gets_408_after_the_body_timeout(tokenizer):
    """A client that declared 200 bytes and sent 20 held its handler until the connection died."""
    engine = tiny_engine(tokenizer, body_timeout=0.5)
    with serving(engine) as base:
        host = base.removeprefix("http://")
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
        )
        status, body, seconds = raw_request(base, head, [b'{"prompt": "abcdefgh'])
        assert status == 408 and body["error"]["code"] == "body_timeout", (status, body)
        assert 0.4 < seconds < 5, seconds
        # a whole body in time is served as before
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": tiny_prompts(1)[0], "max_tokens": 2}, timeout=30)
        assert reply.status_code == 200, reply.text


def trickle(base: str, first: bytes, drip: bytes, limit: float = 10) -> tuple[bytes, float]:
    """Send ``first``, then one byte of ``drip`` every 0.1 s until the server closes the connection;
    return all it sent and the seconds from ``first`` to the close."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(0.1)
        start, data, i = time.monotonic(), b"", 0
        s.sendall(first)
        while time.monotonic() - start < limit:
            try:
                if drip:
                    s.sendall(drip[i % len(drip) :][:1])
                    i += 1
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            data += chunk
        return data, time.monotonic() - start


def test_a_head_that_trickles_in_is_cut_off_after_the_head_timeout(tokenizer):
    """Slowloris: uvicorn times no request head out (its keep-alive timer stops at any byte), so a
    client sending a header byte now and then, or nothing, or an answered body byte by byte, held
    its connection for good."""
    engine = tiny_engine(tokenizer, head_timeout=0.5)
    with serving(engine) as base:
        host = base.removeprefix("http://")
        get = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        partial = b"GET /health HTTP/1.1\r\n"
        for first in (partial, get + partial):  # a fresh connection; a keep-alive one's second head
            data, seconds = trickle(base, first, b"X-Slow: ab")
            assert data.count(b"HTTP/1.1 200 ") == (first != partial) and data.count(b"HTTP/1.1 408 ") == 1, data
            assert json.loads(data.rpartition(b"\r\n\r\n")[2])["error"]["code"] == "head_timeout", data
            assert 0.4 < seconds < 5, seconds
        # a connection that sends nothing, and a body the server answered without reading: closed
        for first, drip in ((b"", b""), (get.replace(b"\r\n\r\n", b"\r\nContent-Length: 1000\r\n\r\n"), b"a")):
            data, seconds = trickle(base, first, drip)
            assert data.count(b"HTTP/1.1 ") == (first != b"") and 0.4 < seconds < 5, (data, seconds)
        # an idle keep-alive connection is uvicorn's to close (after 5 s), and a head sent in time is served
        with socket.create_connection(host.split(":")) as s:
            s.settimeout(10)
            for _ in range(2):
                s.sendall(get)
                assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
                time.sleep(1)
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert closed_by_server(base) == {"head_timeout": 4.0}  # the two trickles, the silent one, the leftover body


def closed_by_server(base: str) -> dict[str, float]:
    """``/metrics``' count of connections the server closed before a handler saw them, by reason."""
    counts = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("rag_lookahead_connections_closed_total{"):
            labels, _, value = line.partition("} ")
            counts[labels.split('reason="')[1].rstrip('"')] = float(value)
    return counts


def health_latencies(base: str, stop: threading.Event, out: list) -> None:
    """Ask /health again and again until ``stop``; record each answer's latency (None: not 200)."""
    with httpx.Client(base_url=base, timeout=30) as client:
        while not stop.is_set():
            start = time.monotonic()
            ok = client.get("/health").status_code == 200
            out.append(time.monotonic() - start if ok else None)
            time.sleep(0.05)


def test_huge_body_gets_413_at_once_and_health_stays_prompt(tokenizer):
    """A declared 60 MB body is refused before it is read (the measured bug: 27 s to a 400, /health
    blocked meanwhile); a chunked body with no length is cut off once it passes the limit. A body of
    exactly the limit is served, declared or chunked (the limit is the largest body taken)."""
    engine = tiny_engine(tokenizer)
    with serving(engine) as base:
        host = base.removeprefix("http://")
        stop, latencies = threading.Event(), []
        watcher = threading.Thread(target=health_latencies, args=(base, stop, latencies))
        watcher.start()
        try:
            asyncio.run(until(lambda: len(latencies) >= 2))
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {60 * MiB}\r\n\r\n"
            )
            status, body, seconds = raw_request(base, head, [b'{"prompt": "' + b"a" * MiB])
            assert status == 413 and body["error"]["code"] == "body_too_large" and seconds < 2, (status, body, seconds)

            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"a" * (256 * 1024)
            parts = [b'{"prompt": "'] + [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(24)]  # 6 MiB
            parts[0] = f"{len(parts[0]):x}\r\n".encode() + parts[0] + b"\r\n"
            status, body, seconds = raw_request(base, head, parts)
            assert status == 413 and "max_body_bytes" in body["error"]["message"] and seconds < 5, (
                status,
                body,
                seconds,
            )
            # exactly max_body_bytes is taken, with a Content-Length and chunked; one byte more is not
            limit = engine.config.max_body_bytes
            body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode()
            body += b" " * (limit - len(body))
            for content in (body, iter([body[: limit // 2], body[limit // 2 :]])):
                r = httpx.post(base + "/v1/completions", content=content, headers={"content-type": "application/json"})
                assert r.status_code == 200, r.text
            over = body + b" "
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            status, _, _ = raw_request(base, f"{head}Content-Length: {len(over)}\r\n\r\n", [over[:1024]])
            assert status == 413
            chunked = [f"{len(over):x}\r\n".encode() + over + b"\r\n0\r\n\r\n"]
            status, _, _ = raw_request(base, f"{head}Transfer-Encoding: chunked\r\n\r\n", chunked)
            assert status == 413
            seen = len(latencies)
            asyncio.run(until(lambda: len(latencies) >= seen + 2))
        finally:
            stop.set()
            watcher.join()
        assert len(latencies) >= 3 and None not in latencies and max(latencies) < 1.0, latencies
        assert httpx.post(base + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}).status_code == 200


def test_tokenizing_a_long_prompt_stalls_neither_health_nor_streams(tokenizer, monkeypatch):
    """A 3.8 MB text prompt (under the body cap) takes seconds to tokenize before it is refused as
    too long; meanwhile /health answers at once and a running stream keeps streaming."""
    engine = tiny_engine(
        tokenizer, max_tokens_limit=200, max_prompt_tokens=200_000, lookahead=False, lookahead_config=None
    )
    slow_steps(monkeypatch, 0.02)
    prompt = ("the quick brown fox jumps over the lazy dog " * 90_000)[:3_800_000]

    async def run(base: str):
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            arrivals: list[float] = []

            async def stream():
                body = {"prompt": tiny_prompts(1, seed=31)[0], "max_tokens": 200, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_raw():
                        arrivals.append(time.monotonic())

            streaming = asyncio.create_task(stream())
            await until(lambda: len(arrivals) >= 2)
            big = asyncio.create_task(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}))
            start = time.monotonic()
            health = []
            while not big.done():
                t = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                health.append(time.monotonic() - t)
                await asyncio.sleep(0.05)
            big_seconds = time.monotonic() - start
            streamed = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= start and b <= start + big_seconds]
            await streaming
            return (await big), big_seconds, health, streamed

    with serving(engine) as base:
        big, big_seconds, health, gaps = asyncio.run(run(base))
    assert big.status_code == 400 and "max_prompt_tokens" in big.json()["error"]["message"]
    assert big_seconds > 1.5, "the prompt tokenized too fast to show anything"
    assert max(health) < 1.0, health
    assert gaps and max(gaps) < 2.0, gaps


def test_messages_and_stop_strings_are_capped(tokenizer):
    """Past a cap: 400 naming it. At it (3 messages, 2 stop strings of 8 characters): taken."""
    engine = tiny_engine(tokenizer, max_messages=3, max_stop=2, max_stop_chars=8)
    message = {"role": "user", "content": "hi"}
    cases = [
        ("/v1/chat/completions", {"messages": [message] * 4}, "max_messages"),
        ("/v1/completions", {"prompt": [5, 6], "stop": ["a", "b", "c"]}, "max_stop"),
        ("/v1/completions", {"prompt": [5, 6], "stop": "123456789"}, "max_stop_chars"),
        ("/v1/completions", {"prompt": [5, 6], "stop": ["ok", "x" * 10_000]}, "max_stop_chars"),
    ]
    with serving(engine) as base:
        for path, body, name in cases:
            r = httpx.post(base + path, json=body, timeout=30)
            assert r.status_code == 400 and name in r.json()["error"]["message"], (body, r.text)
        r = httpx.post(
            base + "/v1/completions", json={"prompt": [5, 6], "stop": ["12345678"], "max_tokens": 3}, timeout=30
        )
        assert r.status_code == 200
        r = httpx.post(base + "/v1/completions", json={"prompt": [5, 6], "stop": ["ab", "cd"], "max_tokens": 3})
        assert r.status_code == 200, r.text
        # 3 messages pass the cap and reach the tokenizer (whose chat template ids the tiny model's
        # 96-token vocabulary cannot hold: the refusal that comes after the cap's)
        r = httpx.post(base + "/v1/chat/completions", json={"messages": [message] * 3, "max_tokens": 2}, timeout=30)
        error = r.json()["error"]
        assert "max_messages" not in error["message"] and "outside the model's vocabulary" in error["message"], r.text


def test_a_prompt_as_long_as_the_context_is_refused_and_one_token_shorter_served(tokenizer):
    """The edge of ``prompt_fits``: a prompt that fills the model's whole context leaves no room
    for one token of answer, so 400 naming the context before any work; one token shorter is
    served (its one token)."""
    engine = tiny_engine(tokenizer)
    limit = engine.context_limit
    assert limit is not None and limit <= engine.config.max_prompt_tokens
    with serving(engine) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": [5] * limit, "max_tokens": 1}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "prompt", r.text
        assert "model's context holds" in error["message"], r.text
        r = httpx.post(base + "/v1/completions", json={"prompt": [5] * (limit - 1), "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


def test_malformed_json_is_a_400(tokenizer):
    engine = tiny_engine(tokenizer)
    bodies = [
        b'{"prompt": [1, 2], "max_tokens": NaN}',
        b'{"prompt": [1, 2], "max_tokens": Infinity}',
        b'{"prompt": "\\ud800 lone surrogate"}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": [1, 2]' + b" " * 10,
        b"\xff\xfe not utf-8",
    ]
    with serving(engine) as base:
        for body in bodies:
            r = httpx.post(
                base + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
            )
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body[:40], r.text)
        # NaN and Infinity are not JSON wherever they stand, in a field the endpoint drops too
        for path, body in (
            ("/v1/completions", b'{"prompt": [1, 2], "foo": NaN}'),
            ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": 2, "user": "u", "extra": [-Infinity]}'),
            ("/v1/chat/completions", b'{"messages": [], "chat_template_kwargs": {"x": NaN}}'),
        ):
            r = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], (body, r.text)
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True}, timeout=30)
        assert parse_sse(r.text)[-1] == "[DONE]"


def test_connections_past_max_connections_get_503_and_are_closed(tokenizer):
    """Connections that send nothing were never counted (uvicorn's limit_concurrency looks only at
    complete heads): a flood of them held a descriptor each until the process ran out."""
    engine = tiny_engine(tokenizer, max_connections=2, head_timeout=30)
    with running(engine) as (base, server):
        host, port = base.removeprefix("http://").split(":")
        get = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()

        def open_connections(count: int) -> None:  # as the server counts them (a fixed sleep raced it)
            deadline = time.monotonic() + 30
            while len(server.server_state.connections) != count:
                assert time.monotonic() < deadline, len(server.server_state.connections)
                time.sleep(0.01)

        silent = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            open_connections(2)
            with socket.create_connection((host, int(port))) as third:
                third.settimeout(10)
                third.sendall(get)  # at once, as clients do: a close with it unread was a reset, not the 503
                data = b""
                while chunk := third.recv(65536):  # answered at once, then closed (b"" ends it)
                    data += chunk
            assert data.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1\r\n" in data.lower(), data
            error = json.loads(data.rpartition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "too_many_connections" and error["type"] == "server_error"
            for _ in range(3):  # a real client posting a body gets the 503 too
                refused = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=10)
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
            silent[0].sendall(get)  # the held ones are served as usual
            silent[0].settimeout(10)
            assert silent[0].recv(65536).startswith(b"HTTP/1.1 200 ")
        finally:
            for s in silent:
                s.close()
        open_connections(0)  # closed: their places are free again
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert closed_by_server(base) == {"too_many_connections": 4.0}  # counted where no handler sees them


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"max_batch_size": 10**9}, "max_batch_size"),
        ({"max_queue": 0}, "max_queue"),
        ({"max_tokens_limit": True}, "max_tokens_limit"),
        ({"max_body_bytes": 2**40}, "max_body_bytes"),
        ({"body_timeout": 0}, "body_timeout"),
        ({"body_timeout": "30"}, "body_timeout"),
        ({"head_timeout": 0}, "head_timeout"),
        ({"head_timeout": float("inf")}, "head_timeout"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_connections": 2.5}, "max_connections"),
        ({"max_messages": "10"}, "max_messages"),
        ({"max_stop_chars": 10**6}, "max_stop_chars"),
        ({"k_prompt": 4, "k_seed": 2}, "k_seed"),
        ({"drain_seconds": -1}, "drain_seconds"),
        ({"drain_seconds": float("nan")}, "drain_seconds"),
        ({"lookahead": "yes"}, "lookahead"),
        ({"port": 70000}, "port"),
        ({"output_pool": "everyone"}, "output_pool"),
        ({"output_pool": "per-key"}, "per-key"),
        ({"api_keys": "a-single-string-key"}, "list of strings"),
        ({"api_keys": ["short"]}, "API key"),
        ({"api_keys": ["has space in it"]}, "API key"),
        ({"allowed_hosts": ["http://example.com/"]}, "allowed_hosts"),
        ({"log_level": "loud"}, "log_level"),
        ({"host": ""}, "host"),
        ({"lookahead_config": {"decoding_length": 8}}, "lookahead_config"),
        ({"memory_sharers": 0}, "memory_sharers"),  # it divides the default KV budget
        ({"api_keys": ["1234567"]}, "API key"),  # one short of the 8 characters a key needs
        ({"allowed_hosts": [f"h{i}.example" for i in range(1025)]}, "at most 1024"),
    ],
)
def test_server_config_refuses_bad_settings(changes, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**changes)


def test_server_config_takes_the_edges_of_what_it_allows():
    """k_seed may equal k_prompt (every passage retrieved is shown, none only seeds the trie), and an
    IPv6 address may be given as it appears in a Host header, in brackets."""
    config = ServerConfig(k_prompt=3, k_seed=3, allowed_hosts=["[2001:DB8::1]", "2001:db8::2"])
    assert (config.k_prompt, config.k_seed) == (3, 3)
    assert config.allowed_hosts == ("2001:db8::1", "2001:db8::2")
    # drain_seconds 0 (no drain: stop at once), a key of exactly 8 characters, 1024 host names
    hosts = [f"h{i}.example" for i in range(1024)]
    config = ServerConfig(drain_seconds=0, api_keys=["12345678"], allowed_hosts=hosts)
    assert (config.drain_seconds, config.api_keys, len(config.allowed_hosts)) == (0.0, ("12345678",), 1024)


def test_server_config_keeps_keys_out_of_its_repr():
    config = ServerConfig(api_keys=["sk-0123456789abcdef"], allowed_hosts=["Example.COM."], output_pool="per-key")
    assert "sk-0123456789abcdef" not in repr(config)
    assert config.allowed_hosts == ("example.com",) and config.api_keys == ("sk-0123456789abcdef",)


def test_connection_limits_set_with_replicas_are_said_unapplied(caplog):
    """Under --replicas Ray's proxy owns the connections: limits set for them were accepted in silence."""
    import logging

    from rag_lookahead.serve.command import _warn_about_proxy_limits

    with caplog.at_level(logging.WARNING, logger="rag_lookahead.serve.command"):
        _warn_about_proxy_limits(ServerConfig())
        assert not caplog.records  # the defaults: nothing was asked
        _warn_about_proxy_limits(ServerConfig(max_connections=10, head_timeout=5))
    assert "--head-timeout, --max-connections: not applied with --replicas" in caplog.text


def test_a_public_bind_is_warned_about_missing_keys_and_allowed_hosts(caplog):
    """Bound past loopback: no API key is said (anyone can use it), and a wildcard bind without
    --allowed-hosts is said (only loopback names would be answered); loopback says nothing."""
    import logging

    from rag_lookahead.serve.command import _warn_about_exposure

    key = ["sk-0123456789abcdef"]
    with caplog.at_level(logging.WARNING, logger="rag_lookahead.serve.command"):
        _warn_about_exposure(ServerConfig())
        _warn_about_exposure(ServerConfig(host="0.0.0.0", api_keys=key, allowed_hosts=["example.com"]))
        assert not caplog.records
        _warn_about_exposure(ServerConfig(host="0.0.0.0", api_keys=key))
        assert "pass --allowed-hosts" in caplog.text and "without --api-key" not in caplog.text
        caplog.clear()
        _warn_about_exposure(ServerConfig(host="192.0.2.7"))
    assert "binding to 192.0.2.7 without --api-key" in caplog.text and "--allowed-hosts" not in caplog.text


def test_a_chunked_body_past_the_limit_gets_413_and_the_connection_closed(tokenizer):
    """A chunked body (no Content-Length) is cut off once it passes ``max_body_bytes``; the rest of
    it is still on the wire, unread, so the 413 must close the connection (kept open, the unread
    bytes would be read as the next request)."""
    engine = tiny_engine(tokenizer, max_body_bytes=1024)

    def body():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    with serving(engine) as base:
        r = httpx.post(base + "/v1/completions", content=body(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"], r.text
        assert r.headers.get("connection") == "close", r.headers
        assert httpx.post(base + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200


def test_the_default_max_tokens_never_passes_max_tokens_limit(tokenizer):
    """``default_max_tokens`` 40 with ``max_tokens_limit`` 8: a request that names no ``max_tokens``
    gets at most 8 tokens (the limit is the most any request is given)."""
    assert ServerConfig(default_max_tokens=40, max_tokens_limit=8).default_tokens == 8
    engine = tiny_engine(tokenizer, default_max_tokens=40, max_tokens_limit=8, lookahead=False, lookahead_config=None)
    with serving(engine) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": tiny_prompts(1, seed=34)[0]}, timeout=60)
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 8, r.json()["usage"]


def test_a_generation_config_that_no_prompt_can_meet_is_refused_at_the_start(tokenizer):
    """``min_length`` equal to the model's context: the widest prompt the server takes is one token
    short of the context, so no request could ever be served; Engine(...) says so at once."""
    from test_server import LOOKAHEAD
    from tiny_models import tiny_model

    from rag_lookahead.decoding.inputs import context_limit
    from rag_lookahead.serve import Engine

    model = tiny_model("qwen2")
    model.generation_config.min_length = context_limit(model)
    try:
        with pytest.raises(ConfigError):
            Engine(model, tokenizer, ServerConfig(max_prompt_tokens=10_000, lookahead_config=LOOKAHEAD))
        model.generation_config.min_length = context_limit(model) - 1
        engine = Engine(model, tokenizer, ServerConfig(max_prompt_tokens=10_000, lookahead_config=LOOKAHEAD))
        assert engine.widest_prompt == context_limit(model) - 1
    finally:
        model.generation_config.min_length = 0
