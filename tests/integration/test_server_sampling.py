"""Sampling through the server: lossless (the text generate() samples with the same seed), seeded
requests reproducible alone or among 16 concurrent ones, n choices, greedy and sampled rows in one batch.
Real tiny-model server over HTTP."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import serving, single_text, tiny_engine, tiny_prompts, tokenizer  # noqa: F401

from rag_lookahead.decoding.loop import generate
from rag_lookahead.serve import Engine

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
        assert text == sampled_text(engine, prompt, 16, 9, temperature=0.7, min_p=0.05, repetition_penalty=1.3)
        r = client.post("/v1/completions", json={"prompt": prompt, "presence_penalty": 0.5})
        assert r.status_code == 400 and "presence_penalty" in r.json()["error"]["message"]


def test_fields_left_out_take_the_models_generation_config_as_model_generate_does(tokenizer, caplog):
    """A Qwen2.5-Instruct style generation config (repetition_penalty 1.05, top_k 20, top_p 0.8):
    the server ignored it, so its greedy answers differed from ``model.generate``'s and from
    every other entry point's, and it sampled with no top-k where they drew from 50."""
    import torch
    from tiny_models import build_tiny_model

    from rag_lookahead.errors import ConfigError

    engine = Engine(build_tiny_model("qwen2"), tokenizer, tiny_engine(tokenizer).config)  # a model of its own
    own = engine.model.generation_config
    own.repetition_penalty, own.top_k, own.top_p = 1.05, 20, 0.8
    prompt = tiny_prompts(1, seed=5)[0]
    ids = torch.tensor([prompt])
    reference = engine.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    plain = generate(engine.model, prompt, max_new_tokens=16, repetition_penalty=1.0).sequences
    assert not torch.equal(reference, plain)  # the penalty changes this answer
    expected = [t for t in reference[0, len(prompt) :].tolist() if t not in engine.eos]
    with serving(engine) as base, httpx.Client(base_url=base, timeout=120) as client:
        greedy = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16}).json()
        assert greedy["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.9, "seed": 7}
        sampled = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert sampled == sampled_text(engine, prompt, 16, 7, temperature=0.9)  # top_k 20, top_p 0.8, penalty
        assert sampled != sampled_text(engine, prompt, 16, 7, temperature=0.9, top_k=None, top_p=1.0)
        off = client.post("/v1/completions", json=body | {"top_k": -1, "top_p": 1.0}).json()["choices"][0]["text"]
        assert off == sampled_text(engine, prompt, 16, 7, temperature=0.9, top_k=None, top_p=1.0)
    own.typical_p = 0.9  # applies only when sampling: greedy is served, sampling refused, said at start
    with caplog.at_level(logging.WARNING, logger="rag_lookahead.serve.engine"):
        typical = Engine(engine.model, tokenizer, engine.config)
    assert "sampled requests will be refused" in caplog.text and "typical_p" in caplog.text
    with serving(typical) as base, httpx.Client(base_url=base, timeout=120) as client:
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}).status_code == 200
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400 and "typical_p" in refused.json()["error"]["message"]
    own.typical_p = 1.0
    own.no_repeat_ngram_size = 2  # ours to refuse, not to drop: the server does not start
    with pytest.raises(ConfigError, match="no_repeat_ngram_size"):
        Engine(engine.model, tokenizer, engine.config)


def hf_text(engine, ids, max_tokens, seed=None, **options) -> str:
    """What ``model.generate`` gives for ``ids`` (after ``torch.manual_seed(seed)``), decoded as the
    server decodes (for settings our ``generate`` has no keyword for, or refuses)."""
    from hf_reference import hf_logits

    tokens, _ = hf_logits(engine.model, ids, max_tokens, seed, **options)
    tokens = tokens[: next((i + 1 for i, t in enumerate(tokens) if t in engine.eos), len(tokens))]
    return engine.tokenizer.decode([t for t in tokens if t not in engine.eos], skip_special_tokens=True)


def test_a_neutral_setting_in_the_request_turns_the_models_off(tokenizer):
    """``typical_p: 1`` (and ``epsilon_cutoff``/``eta_cutoff`` 0) were taken and dropped, so a model
    config's typical_p 0.9 refused the sampled request that turned it off (400), where
    ``model.generate(typical_p=1.0)`` samples; only fields left out take the model's config."""
    from tiny_models import build_tiny_model

    engine = Engine(build_tiny_model("qwen2"), tokenizer, tiny_engine(tokenizer).config)  # a model of its own
    own = engine.model.generation_config
    own.typical_p, own.epsilon_cutoff, own.eta_cutoff = 0.9, 3e-4, 1e-3
    prompt = tiny_prompts(1, seed=5)[0]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.7, "seed": 3}
    off = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0}
    with serving(engine) as base, httpx.Client(base_url=base, timeout=120) as client:
        for name in ("typical_p", "epsilon_cutoff", "eta_cutoff"):  # each left out: the config's, refused
            left_out = client.post("/v1/completions", json=body | {k: v for k, v in off.items() if k != name})
            assert left_out.status_code == 400 and name in left_out.json()["error"]["message"]
        reply = client.post("/v1/completions", json=body | off)
        assert reply.status_code == 200, reply.text
        expected = hf_text(engine, prompt, 12, 3, do_sample=True, temperature=0.7, **off)
        assert reply.json()["choices"][0]["text"] == expected
        assert client.post("/v1/completions", json=body | off | {"typical_p": 0.9}).status_code == 400  # still ours


def test_a_min_length_some_prompt_reaches_is_served_and_shorter_prompts_refused(tokenizer):
    """A model config's min_length 5 stopped the server from starting (its config was checked as for
    a one-token prompt), though ``model.generate`` serves every prompt of 5 tokens or more. Now each
    prompt is judged by its own width: one shorter than min_length (EOS held back, which lookahead
    decoding does not implement) answers 400; one min_length can never reach stops the start."""
    from tiny_models import build_tiny_model

    from rag_lookahead.errors import ConfigError

    engine = Engine(build_tiny_model("qwen2"), tokenizer, tiny_engine(tokenizer).config)  # a model of its own
    own = engine.model.generation_config
    own.min_length = 5
    engine = Engine(engine.model, tokenizer, engine.config)  # it starts
    assert engine.eos  # min_length holds EOS back only where there is one
    long, short = tiny_prompts(1, seed=5)[0], [5, 6, 7]
    assert len(long) >= 5
    with serving(engine) as base, httpx.Client(base_url=base, timeout=120) as client:
        greedy = client.post("/v1/completions", json={"prompt": long, "max_tokens": 12})
        assert greedy.status_code == 200, greedy.text
        assert greedy.json()["choices"][0]["text"] == hf_text(engine, long, 12, do_sample=False)
        sampled = {"prompt": long, "max_tokens": 12, "temperature": 0.7, "seed": 3}
        reply = client.post("/v1/completions", json=sampled)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == hf_text(engine, long, 12, 3, do_sample=True, temperature=0.7)
        for body in ({"prompt": short}, {**sampled, "prompt": short}, {"prompt": [long, short]}):
            refused = client.post("/v1/completions", json=body | {"max_tokens": 4})
            assert refused.status_code == 400 and "min_length=5" in refused.json()["error"]["message"]
    with pytest.raises(ConfigError, match="min_length=5"):  # no prompt this server takes reaches it
        Engine(engine.model, tokenizer, tiny_engine(tokenizer, max_prompt_tokens=4).config)
