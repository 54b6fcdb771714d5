"""Chunked prefill is lossless and interleaves: a prompt fed a chunk per step (inside the running
rows' decode steps) gives the tokens of the one-forward prefill and of ``model.generate``, and
rows already decoding keep gaining tokens while a long prompt comes in. fp32 tiny models."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import ARCHITECTURES, VOCAB, reference_generate, tiny_model

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.loop import DecodeBatch, left_pad
from rag_lookahead.decoding.prefill import ChunkedPrefill
from rag_lookahead.decoding.sampling import SamplingParams

CONFIG = LookaheadConfig(decoding_length=16, branch_length=6, budget="fixed")


def prompts(count: int, seed: int, low: int = 5, high: int = 90) -> list[list[int]]:
    """Prompts with repeated spans (so drafts are found and often right), of varied lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        span = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 9))]
        text = []
        while len(text) < rng.randint(low, high):
            text += span if rng.random() < 0.6 else [rng.randrange(1, VOCAB)]
        out.append(text)
    return out


def new_tokens(result, prompts_: list[list[int]]) -> list[list[int]]:
    width = max(len(p) for p in prompts_)
    return [result.sequences[r, width:].tolist() for r in range(len(prompts_))]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_generate_chunked_matches_model_generate(arch, chunk):
    model = tiny_model(arch)
    for prompt in prompts(3, seed=len(arch) + chunk):
        expected = reference_generate(model, prompt, 24, None)
        result = generate(model, prompt, max_new_tokens=24, config=CONFIG, pad_token_id=0, prefill_chunk=chunk)
        assert result.sequences[0, len(prompt) :].tolist() == expected


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_chunked_rows_match_the_one_forward_prefill(arch, attn):
    """Several rows of different lengths, prompts split across steps and several short prompts in one
    step (budget 16): the same tokens as the unchunked batch, with and without drafting."""
    model = tiny_model(arch, attn)
    rows = prompts(5, seed=3)
    ids, mask = left_pad(rows, 0)
    for config in (CONFIG, CONFIG.replace(enabled=False)):
        plain = generate(model, ids, mask, max_new_tokens=20, config=config, pad_token_id=0)
        chunked = generate(model, ids, mask, max_new_tokens=20, config=config, pad_token_id=0, prefill_chunk=16)
        assert new_tokens(chunked, rows) == new_tokens(plain, rows)


def test_seeded_sampling_is_the_same_chunked():
    model = tiny_model("qwen2")
    rows = prompts(3, seed=5)
    options = dict(max_new_tokens=16, config=CONFIG, pad_token_id=0, do_sample=True, temperature=0.9, seed=[1, 2, 3])
    plain = generate(model, *left_pad(rows, 0), **options)
    chunked = generate(model, *left_pad(rows, 0), prefill_chunk=9, **options)
    assert new_tokens(chunked, rows) == new_tokens(plain, rows)


def run_steps(batch: DecodeBatch, outputs: dict) -> list[list[int]]:
    """One step: retire, propose, verify; returns what each row (by rows after the step) gained."""
    for row in batch.retire():
        outputs[row.index] = row.generated
    gained = batch.verify_and_accept(batch.propose())
    return gained


def drain(batch: DecodeBatch, outputs: dict) -> None:
    while batch.size:
        for row in batch.retire():
            outputs[row.index] = row.generated
        if batch.size:
            batch.verify_and_accept(batch.propose())


@pytest.mark.parametrize("arch", ["qwen2", "llama", "glm"])
def test_running_rows_keep_decoding_while_a_long_prompt_comes_in(arch):
    """A row decodes; a 150-token prompt joins with chunks of 16: the running row gains a token in
    every one of the ~10 steps that carry the prompt, the new row gets its first token only with the
    prompt's last chunk, and both texts equal the unchunked batch's."""
    model = tiny_model(arch)
    short, long_prompt = prompts(1, seed=11, low=8, high=12)[0], prompts(1, seed=12, low=150, high=150)[0]
    expected = {}
    for chunk in (0, 16):
        batch = DecodeBatch(model, CONFIG.replace(enabled=False), frozenset(), None, prefill_chunk=chunk)
        outputs: dict = {}
        batch.add(*left_pad([short], 0), None, 60, keys=["short"])
        run_steps(batch, outputs)  # the short prompt (and its first token with chunking)
        run_steps(batch, outputs)
        batch.add(*left_pad([long_prompt], 0), None, 20, keys=["long"])
        steps_until_first = 0
        while True:
            gained = run_steps(batch, outputs)
            steps_until_first += 1
            by_key = {row.index: g for row, g in zip(batch.rows, gained)}
            assert len(by_key["short"]) == 1  # the stream never stalls for the prompt
            if by_key.get("long"):
                break
        if chunk:
            assert steps_until_first == -(-len(long_prompt) // chunk)
        else:
            assert steps_until_first == 1
        drain(batch, outputs)
        expected[chunk] = outputs
    assert expected[16] == expected[0]
    assert expected[0]["long"] == reference_generate(model, long_prompt, 20, None)


def test_rows_leave_while_waiting_or_half_prefilled():
    """``retire(keep)`` takes out a row still waiting for its first chunk and one half-way through its
    prompt; the others' tokens do not change."""
    model = tiny_model("qwen2")
    a, b, c = prompts(3, seed=13, low=40, high=60)
    batch = DecodeBatch(model, CONFIG, frozenset(), None, prefill_chunk=24)
    batch.add(*left_pad([a, b, c], 0), None, 12, keys=["a", "b", "c"])
    batch.verify_and_accept(batch.propose())  # a: 24 tokens in; b, c wait
    assert [row.index for row in batch.rows] == ["a"] and batch.rows[0].prefilling and batch.size == 3
    left = batch.retire(lambda row: row.index not in ("a", "c"))
    assert sorted(row.index for row in left) == ["a", "c"] and all(row.done for row in left)
    assert batch.size == 1 and not batch.rows and batch.packed.rows == 0
    outputs: dict = {}
    drain(batch, outputs)
    assert outputs["b"] == reference_generate(model, b, 12, None)


def test_budget_is_shared_and_the_part_way_row_goes_first():
    queue = ChunkedPrefill(10)
    model = tiny_model("qwen2")
    batch = DecodeBatch(model, CONFIG, frozenset(), None, prefill_chunk=10)
    rows = batch.add(*left_pad([[5] * 4, [6] * 15, [7] * 3], 0), None, 4)
    for row in rows:
        queue.queue(row, ())
    joining, chunks = queue.plan([])
    assert joining == rows[:2] and [len(chunks[r]) for r in joining] == [4, 6]
    rows[0].position, rows[1].position = 4, 6  # as the step would leave them
    joining, chunks = queue.plan(rows[:2])
    assert joining == [rows[2]] and len(chunks[rows[1]]) == 9 and len(chunks[rows[2]]) == 1
    assert rows[0] not in chunks


def test_max_draft_rows_turns_drafting_off_above_the_row_count():
    model = tiny_model("qwen2")
    rows = prompts(3, seed=17)
    truths = [reference_generate(model, prompt, 10, None) for prompt in rows]
    references = [[prompt[-3:] + truth] for prompt, truth in zip(rows, truths)]  # every draft would be right
    batch = DecodeBatch(model, CONFIG, frozenset(), None, max_draft_rows=2)
    batch.add(*left_pad(rows[:2], 0), references[:2], 10)
    assert all(len(d) for d in batch.propose())  # two rows: they draft
    batch.add(*left_pad(rows[2:], 0), references[2:], 10)
    assert all(len(d) == 0 for d in batch.propose())  # three: nobody drafts
    outputs: dict = {}
    drain(batch, outputs)
    assert [outputs[r] for r in range(3)] == truths


def test_on_a_cpu_the_cost_budget_stops_drafting_above_the_measured_row_count():
    from rag_lookahead.decoding.decode_batch import MAX_DRAFT_ROWS

    model = tiny_model("qwen2")
    auto = CONFIG.replace(budget="auto")
    assert DecodeBatch(model, auto, frozenset(), None).max_draft_rows == MAX_DRAFT_ROWS["cpu"]
    assert DecodeBatch(model, auto, frozenset(), None, max_draft_rows=100).max_draft_rows == 100
    assert DecodeBatch(model, CONFIG, frozenset(), None).max_draft_rows is None  # a fixed budget drafts always
    many = MAX_DRAFT_ROWS["cpu"] + 1
    rows = prompts(many, seed=23)
    references = [[prompt[-4:] * 3] for prompt in rows]  # something to draft from for every row
    for limit, drafting in ((MAX_DRAFT_ROWS["cpu"], False), (many, True)):
        batch = DecodeBatch(model, CONFIG, frozenset(), None, max_draft_rows=limit)
        batch.add(*left_pad(rows, 0), references, 4)
        assert any(len(d) for d in batch.propose()) is drafting


def test_sampling_params_per_row_with_chunks():
    """Greedy and seeded rows share a chunked batch: each equals its own unchunked run."""
    model = tiny_model("llama")
    rows = prompts(2, seed=19)
    sampling = [SamplingParams(), SamplingParams(do_sample=True, temperature=0.8, seed=4)]
    outputs = {}
    for chunk in (0, 8):
        batch = DecodeBatch(model, CONFIG, frozenset(), None, prefill_chunk=chunk)
        batch.add(*left_pad(rows, 0), None, 12, sampling=sampling)
        outputs[chunk] = {}
        drain(batch, outputs[chunk])
    assert outputs[8] == outputs[0]
    assert torch.equal(torch.tensor(outputs[0][0]), torch.tensor(reference_generate(model, rows[0], 12, None)))


def test_interference_benchmark_smoke_run(tmp_path):
    """The benchmark on a tiny model: both runs finish, the texts are identical, the report has the
    latency rows (their values are timing noise on a tiny model)."""
    from rag_lookahead.bench.interference import main

    args = ["--tiny", "--long-tokens", "300", "--long-requests", "2", "--short-max-new-tokens", "12"]
    args += ["--long-max-new-tokens", "4", "--arrival-steps", "2", "--prefill-chunk", "64"]
    args += ["--device", "cpu", "--dtype", "fp32"]  # what --tiny runs with anyway: taken, not refused
    report = main([*args, "--json", str(tmp_path / "interference.json")])
    off, on = report["results"]
    assert (off["prefill"], on["prefill"]) == ("off", "on") and on["prefill_chunk"] == 64
    assert off["gaps"] and on["gaps"] and on["p95_itl_ms"] is not None
    done, total = off["identical"].split("/")
    assert done == total and int(total) >= 4
    assert (tmp_path / "interference.json").exists()


def test_logprobs_are_the_same_chunked():
    """The first token's log-probability comes from the step that ends the prompt; every entry
    equals the one-forward prefill's (fp32: to summation order)."""
    model = tiny_model("qwen2")
    rows = prompts(2, seed=23)
    ids, mask = left_pad(rows, 0)
    plain = generate(model, ids, mask, max_new_tokens=10, config=CONFIG, pad_token_id=0, logprobs=3)
    chunked = generate(model, ids, mask, max_new_tokens=10, config=CONFIG, pad_token_id=0, logprobs=3, prefill_chunk=8)
    assert new_tokens(chunked, rows) == new_tokens(plain, rows)
    for want_row, got_row in zip(plain.logprobs, chunked.logprobs):
        assert [e.token for e in got_row] == [e.token for e in want_row] and len(got_row) == 10
        for want, got in zip(want_row, got_row):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
