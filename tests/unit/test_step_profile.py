"""The step profiler times the real step regions of a tiny model's decode, and puts everything back."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

from rag_lookahead.bench.step_profile import RegionTimer, breakdown, bucket_of, instrumented
from rag_lookahead.decoding import decode_batch, prefill
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.decode_batch import DecodeBatch
from rag_lookahead.decoding.loop import generate


def test_buckets():
    assert [bucket_of(n) for n in (1, 2, 8, 9, 33, 64, 65, 500)] == [
        "1",
        "2-8",
        "2-8",
        "9-16",
        "33-64",
        "33-64",
        "65+",
        "65+",
    ]


def test_regions_cover_the_steps_and_the_patches_are_undone():
    model = tiny_model("qwen2")
    originals = (DecodeBatch.propose, DecodeBatch._accept, decode_batch.keep_accepted, prefill.step_mask)
    prompt = [5, 6, 7, 8, 9] * 6
    plain = generate(model, prompt, max_new_tokens=24, config=LookaheadConfig()).sequences
    timer = RegionTimer(torch.device("cpu"))
    with instrumented(timer, model):
        result = generate(model, prompt, max_new_tokens=24, config=LookaheadConfig())
    assert torch.equal(result.sequences, plain)  # timing changes nothing
    assert (DecodeBatch.propose, DecodeBatch._accept, decode_batch.keep_accepted, prefill.step_mask) == originals
    assert "forward" not in vars(model)  # the instance attribute is gone: the class's forward again

    steps = result.stats.forward_passes
    assert timer.calls["step"] == timer.calls["propose"] == steps
    assert sum(n for k, n in timer.calls.items() if k.startswith("forward ")) == steps
    assert timer.calls["prefill forward"] == 1
    regions, sizes = breakdown(timer)
    assert [r["region"] for r in regions][-1] == "python and the rest"
    assert all(r["ms/step"] >= 0 for r in regions)
    assert sum(s["forwards"] for s in sizes) == steps


def test_ms_per_step_is_a_regions_seconds_over_the_steps():
    timer = RegionTimer(torch.device("cpu"))
    timer.calls["step"] = 10
    timer.seconds["step"], timer.seconds["propose"] = 0.8, 0.2
    regions = {r["region"]: r for r in breakdown(timer)[0]}
    assert regions["propose"]["ms/step"] == 20.0  # 0.2 s over 10 steps
    assert regions["propose"]["share"] == "20.0%"  # of the step's 0.8 s and the propose's 0.2 s


def test_profile_steps_counts_decode_tokens_and_times_only_the_counted_steps(monkeypatch):
    """The tokens are those after each answer's first (the prefill's), and the timer sees the
    counted steps only: not the untimed warm-up's."""
    from rag_lookahead.bench import common, step_profile

    monkeypatch.setattr(common, "chat_ids", lambda tokenizer, prompt: prompt["ids"])
    monkeypatch.setattr(step_profile, "chat_ids", lambda tokenizer, prompt: prompt["ids"])
    monkeypatch.setattr(common, "eos_pad", lambda model, tokenizer: (None, None))
    results = []
    real = step_profile.fresh_pool_answers

    def noted(*args):
        for ids, result in real(*args):
            results.append(result)
            yield ids, result

    monkeypatch.setattr(step_profile, "fresh_pool_answers", noted)
    prompts = [{"ids": [5, 6, 7, 8, 9] * 6}, {"ids": [3, 4, 3, 4, 12, 13, 3, 4]}]
    timer, tokens, steps = step_profile.profile_steps(tiny_model("qwen2"), None, prompts, LookaheadConfig(), 16)
    assert len(results) == 2
    assert tokens == sum(r.stats.new_tokens - 1 for r in results) > 0
    assert steps == sum(r.stats.forward_passes for r in results) > 0
    assert timer.calls["step"] == timer.calls["propose"] == steps
