"""Sampling through the server: lossless (the text generate() samples with the same seed), seeded
requests reproducible alone or among 16 concurrent ones, n choices, greedy and sampled rows in one batch.
Real tiny-model server over HTTP."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import serving, single_text, tiny_engine, tiny_prompts, tokenizer  # noqa: F401

from rag_lookahead.decoding.loop import generate

SAMPLE = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}


def sampled_text(engine, ids, max_tokens, seed, **options) -> str:
    """What generate() samples for ``ids`` with ``seed``, decoded as the server decodes."""
    out = generate(
        engine.model,
        ids,
        max_new_tokens=max_tokens,
        config=engine.lookahead,
        eos_token_id=sorted(engine.eos),
        do_sample=True,
        seed=seed,
        **options,
    )
    tokens = [t for t in out.sequences[0, len(ids) :].tolist() if t not in engine.eos]
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_seeded_sampling_alone_and_among_16(tokenizer):
    engine = tiny_engine(tokenizer, max_batch_size=16)
    prompts = tiny_prompts(16, seed=11)
    probe = {"prompt": prompts[0], "max_tokens": 24, "seed": 1234, **SAMPLE}
    with serving(engine) as base, httpx.Client(base_url=base, timeout=120) as client:
        alone = client.post("/v1/completions", json=probe).json()["choices"][0]["text"]
        assert alone == sampled_text(engine, prompts[0], 24, 1234, **SAMPLE)  # lossless: generate()'s sample

        def send(i: int) -> str:
            if i == 0:
                body = probe
            elif i % 2:  # greedy and sampled rows share the batch
                body = {"prompt": prompts[i], "max_tokens": 24}
            else:
                body = {"prompt": prompts[i], "max_tokens": 24, "seed": i, **SAMPLE}
            return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(send, range(16)))
    assert texts[0] == alone
    for i in range(1, 16, 2):
        assert texts[i] == single_text(engine, prompts[i], 24)


def test_n_choices_are_seed_plus_i(tokenizer):
    engine = tiny_engine(tokenizer)
    prompt = tiny_prompts(1, seed=3)[0]
    with serving(engine) as base, httpx.Client(base_url=base, timeout=120) as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "n": 3, "seed": 40, **SAMPLE})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        for i, choice in enumerate(choices):
            assert choice["text"] == sampled_text(engine, prompt, 16, 40 + i, **SAMPLE)
        assert r.json()["usage"]["completion_tokens"] <= 3 * 16


def test_repetition_penalty_and_min_p_are_applied(tokenizer):
    engine = tiny_engine(tokenizer)
    prompt = tiny_prompts(1, seed=5)[0]
    with serving(engine) as base, httpx.Client(base_url=base, timeout=120) as client:
        body = {
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0.7,
            "min_p": 0.05,
            "repetition_penalty": 1.3,
            "seed": 9,
        }
        text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert text == sampled_text(engine, prompt, 16, 9, temperature=0.7, min_p=0.05, repetition_penalty=1.3, top_k=0)
        r = client.post("/v1/completions", json={"prompt": prompt, "presence_penalty": 0.5})
        assert r.status_code == 400 and "presence_penalty" in r.json()["error"]["message"]
