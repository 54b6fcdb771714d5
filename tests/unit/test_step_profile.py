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
