"""Hypothesis fuzz of the HTTP API against the real tiny-model server (with an API key and a real
index): random JSON bodies, near-valid requests with wrong types, huge values, unicode, missing
fields, non-JSON bytes, odd headers. Every answer is 2xx or 4xx with an OpenAI-style error body
(never 5xx, never a hang); afterwards the server still answers a normal request exactly.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import parse_sse, serving, single_text, small_index, tiny_engine, tiny_prompts, tokenizer  # noqa: F401

KEY = "sk-fuzz-0123456789abcdef"
MAX_BODY = 64 * 1024

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "\ud7ff\ue000", "😀" * 50, "<|im_end|>", "\u202e", "a" * 5000, "0", "1e999"]),
)
any_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
small_ints = st.integers(min_value=-3, max_value=12)
token_ids = st.lists(st.integers(min_value=-2, max_value=120), max_size=24)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "wizard", ""]),
            "content": st.one_of(
                st.text(max_size=30),
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2),
                any_json,
            ),
        },
        optional={"name": st.text(max_size=5)},
    ),
    max_size=5,
)
FIELDS = {
    "prompt": st.one_of(st.text(max_size=30), token_ids, st.lists(token_ids, max_size=2), any_json),
    "messages": st.one_of(messages, any_json),
    "question": st.one_of(st.text(max_size=60), any_json),
    "max_tokens": st.one_of(small_ints, any_json),
    "max_completion_tokens": st.one_of(small_ints, any_json),
    "k": st.one_of(small_ints, any_json),
    "stop": st.one_of(st.text(max_size=6), st.lists(st.text(max_size=6), max_size=20), any_json),
    "stream": st.one_of(st.booleans(), any_json),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), scalars)}), any_json),
    "temperature": st.one_of(st.just(0), st.floats(-1, 3), any_json),
    "top_p": st.one_of(st.just(1), st.floats(-1, 2), any_json),
    "top_k": st.one_of(small_ints, any_json),
    "seed": st.one_of(st.integers(), any_json),
    "n": st.one_of(small_ints, any_json),
    "best_of": st.one_of(small_ints, any_json),
    "model": st.one_of(st.text(max_size=20), any_json),
    "logprobs": any_json,
    "echo": any_json,
    "suffix": any_json,
    "logit_bias": any_json,
    "presence_penalty": any_json,
    "tools": any_json,
    "user": any_json,
}
near_valid = st.fixed_dictionaries({}, optional=FIELDS)


VALID = {
    "/v1/completions": {"prompt": [5, 6, 7, 8], "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/rag": {"question": "How tall is Etna?", "max_tokens": 3},
}
RAW_VALUES = [
    "NaN",
    "-Infinity",
    "1e400",
    "-0",
    "1" * 5000,
    '"\\ud800"',
    '"a\\udfff"',
    '["\\ud83d"]',
    '"\\u0000"',
    "[" * 3000 + "]" * 3000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    '"\\u202e<|im_end|>"',
]
PATHS = list(VALID) + ["/v1/models", "/health", "/metrics", "/v1/nope"]


@st.composite
def bodies(draw, path: str) -> bytes:
    """Mostly a valid request with fields changed or removed; else random JSON, bytes, or a huge one."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "near_valid", "raw", "json", "bytes", "huge"]))
    if kind == "raw":  # JSON that json.dumps never writes: NaN, lone surrogates, deep nesting, overflow
        name = draw(st.sampled_from(sorted(FIELDS)))
        body = json.dumps({**VALID.get(path, {}), name: "@@"}).replace('"@@"', draw(st.sampled_from(RAW_VALUES)))
        return body.encode()
    if kind == "mutated":  # a valid request, streamed or not, with up to two fields changed and some removed
        body = {**VALID.get(path, {}), "stream": draw(st.booleans())}
        for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
            body[name] = draw(FIELDS[name])
        for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
            del body[name]
        return json.dumps(body).encode()
    if kind == "near_valid":
        return json.dumps(draw(near_valid)).encode()
    if kind == "json":
        return json.dumps(draw(any_json)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    size = draw(st.integers(min_value=1_000, max_value=3 * MAX_BODY))  # a value far too large, or a body past the limit
    return json.dumps(
        {**VALID.get(path, {}), "prompt": "7" * size, "messages": [{"role": "user", "content": "9" * size}]}
    ).encode()


@st.composite
def requests(draw) -> dict:
    path = draw(st.sampled_from(PATHS))
    method = "POST" if path in VALID else draw(st.sampled_from(["GET", "POST", "DELETE"]))
    headers = {
        "Content-Type": draw(st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]))
    }
    auth = draw(st.sampled_from(["good"] * 8 + ["none", "wrong"]))
    if auth != "none":
        headers["Authorization"] = f"Bearer {KEY if auth == 'good' else KEY[::-1]}"
    host = draw(st.sampled_from([None] * 30 + ["evil.example.com", "localhost", "[::1]:1", "127.0.0.1:x"]))
    if host is not None:
        headers["Host"] = host
    return {"method": method, "path": path, "content": draw(bodies(path)), "headers": headers}


def check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    kind = response.headers.get("content-type", "")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    elif kind.startswith("text/event-stream"):
        events = parse_sse(response.text)
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert event.get("error", {}).get("type") != "server_error", event
    elif kind.startswith("application/json"):
        assert isinstance(response.json(), dict)


@pytest.fixture(scope="module")
def fuzz_server(tokenizer, tmp_path_factory, e5_embedder):
    index = small_index(
        tmp_path_factory.mktemp("fuzz"),
        {
            "digits.md": "3141592653589793 are the first digits of pi.",
            "etna.md": "Mount Etna is an active volcano on the east coast of Sicily.",
        },
        e5_embedder,
    )
    engine = tiny_engine(
        tokenizer,
        api_keys=(KEY,),
        max_tokens_limit=8,
        default_max_tokens=4,
        max_body_bytes=MAX_BODY,
        max_prompt_tokens=200,
    )
    engine.index = index
    with serving(engine) as base, httpx.Client(base_url=base, timeout=30) as client:
        yield engine, client


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(request=requests())
def test_fuzz_every_answer_is_2xx_or_4xx(fuzz_server, request):
    engine, client = fuzz_server
    response = client.request(
        request["method"], request["path"], content=request["content"], headers=request["headers"]
    )
    hypothesis.event(f"{request['path']} {response.status_code}")
    check_answer(response)


def test_after_the_fuzz_the_server_answers_exactly(fuzz_server):
    engine, client = fuzz_server
    prompt = tiny_prompts(1, seed=61)[0]
    r = client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 8}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == single_text(engine, prompt, 8)
    assert client.get("/health").json()["status"] == "ok"
