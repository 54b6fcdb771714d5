"""Lossless: lookahead output equals transformers' greedy output, token for token, in fp32."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, PairedDrafter, padded, reference_generate, tiny_model

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding import decode_batch
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.errors import ConfigError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A small alphabet makes prompts repeat themselves, so drafts are found and often right.
tokens = st.integers(min_value=1, max_value=12)


@st.composite
def cases(draw):
    prompt = draw(st.lists(tokens, min_size=1, max_size=40))
    max_new = draw(st.integers(min_value=1, max_value=40))
    kind = draw(st.sampled_from(["none", "random", "right", "wrong", "eos_inside"]))
    config = LookaheadConfig(
        decoding_length=draw(st.integers(min_value=1, max_value=64)),
        branch_length=draw(st.integers(min_value=1, max_value=12)),
        max_key_length=draw(st.integers(min_value=1, max_value=4)),
        budget=draw(st.sampled_from(["fixed", "auto"])),
        use_output_pool=draw(st.booleans()),
        # stop words: the key then also skips a last stop word the source lacks (``draft.key_seeds``)
        stop_words=draw(st.sampled_from([frozenset(), frozenset({1, 2})])),
    )
    seed = draw(st.integers(min_value=0, max_value=2**16))
    return prompt, max_new, kind, config, seed


def _references(model, prompt, max_new, kind, seed):
    """References for one case, and the EOS id to use (None: no EOS)."""
    rng = torch.Generator().manual_seed(seed)
    if kind == "none":
        return [], None
    if kind == "random":
        return [torch.randint(1, 13, (int(torch.randint(1, 50, (1,), generator=rng)),), generator=rng).tolist()], None
    truth = reference_generate(model, prompt, max_new, None)
    if kind == "right":  # the true continuation, after the prompt's tail: every draft is accepted
        return [prompt[-3:] + truth], None
    if kind == "wrong":  # the prompt's tail followed by tokens the model never chooses next
        return [prompt[-3:] + [(t % 12) + 1 for t in truth]], None
    # eos_inside: EOS is a token in the middle of the true continuation, drafted in one block
    eos = truth[len(truth) // 2]
    return [prompt[-3:] + truth], eos


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@SETTINGS
@given(case=cases())
def test_single_row_matches_generate(arch, case):
    prompt, max_new, kind, config, seed = case
    model = tiny_model(arch)
    references, eos = _references(model, prompt, max_new, kind, seed)
    expected = reference_generate(model, prompt, max_new, eos)
    pool = OutputPool(config.pool_depth)
    if config.use_output_pool:  # an earlier answer that partly matches
        pool.add(expected[: len(expected) // 2] + prompt)
    result = generate(
        model,
        prompt,
        max_new_tokens=max_new,
        config=config,
        references=[references],
        eos_token_id=eos,
        pad_token_id=0,
        output_pool=pool,
    )
    got = result.sequences[0, len(prompt) :].tolist()
    assert got == expected
    assert len(got) <= max_new
    assert result.stats.new_tokens == len(got)


# eager: no row-local attention hides a row seeing another row's cache columns (a mutation that
# let rows see every column passed the sdpa cases)
@pytest.mark.parametrize(("arch", "attn"), [("qwen2", "sdpa"), ("llama", "sdpa"), ("glm4", "sdpa"), ("qwen2", "eager")])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(tokens, min_size=1, max_size=30), min_size=2, max_size=5),
    max_new=st.integers(min_value=1, max_value=30),
    eos=st.one_of(st.none(), st.integers(min_value=1, max_value=12)),
    budget=st.sampled_from(["fixed", "auto"]),
    with_refs=st.booleans(),
    group_tokens=st.sampled_from([1, 24, 1024]),  # rows prefilled one by one, in small groups, together
)
def test_batch_rows_match_single_rows(arch, attn, prompts, max_new, eos, budget, with_refs, group_tokens):
    model = tiny_model(arch, attn=attn)
    config = LookaheadConfig(decoding_length=16, branch_length=6, budget=budget, use_output_pool=False)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    expected = [reference_generate(model, p, max_new, eos) for p in prompts]
    references = [[p[-2:] + e] for p, e in zip(prompts, expected)] if with_refs else None
    with mock.patch.object(decode_batch, "PREFILL_FORWARD_TOKENS", group_tokens):
        result = generate(
            model,
            ids,
            mask,
            max_new_tokens=max_new,
            config=config,
            references=references,
            eos_token_id=eos,
            pad_token_id=0,
        )
    longest = max(len(e) for e in expected)
    assert result.sequences.shape == (len(prompts), width + longest)
    for row, want in enumerate(expected):
        got = result.sequences[row, width:].tolist()
        assert got == want + [0] * (longest - len(want))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_eager_attention_matches_generate(arch):
    model = tiny_model(arch, attn="eager")
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    expected = reference_generate(model, prompt, 30, None)
    result = generate(
        model, prompt, max_new_tokens=30, config=LookaheadConfig(budget="fixed"), references=[[prompt + expected]]
    )
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.mean_accepted > 1.5  # the reference holds the answer, so blocks are accepted


def test_matches_hf_batched_generate_padding_layout():
    """Shaped like ``model.generate``'s output for a left-padded batch."""
    model = tiny_model("qwen2")
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    ids = torch.tensor([[1, 2, 3, 4, 5], [0, 0, 0, 7, 8]])
    mask = (torch.arange(5)[None] >= torch.tensor([[0], [3]])).long()
    single = [reference_generate(model, p, 12, 5) for p in prompts]
    result = generate(model, ids, mask, max_new_tokens=12, eos_token_id=5, pad_token_id=0)
    for row, want in enumerate(single):
        assert result.sequences[row, 5 : 5 + len(want)].tolist() == want
        assert set(result.sequences[row, 5 + len(want) :].tolist()) <= {0}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.lists(tokens, min_size=1, max_size=30),
    later=st.lists(st.lists(tokens, min_size=1, max_size=30), min_size=1, max_size=3),
    join_after=st.integers(min_value=0, max_value=6),
    max_new=st.integers(min_value=1, max_value=25),
    extra=st.lists(st.integers(min_value=0, max_value=15), min_size=3, max_size=3),
)
def test_rows_joining_a_running_batch_match_single_rows(arch, first, later, join_after, max_new, extra):
    """Continuous batching: requests merged between decode steps keep their single-row output,
    while others leave (different budgets) and their cache columns are reclaimed."""
    from rag_lookahead.decoding.loop import DecodeBatch

    model = tiny_model(arch)
    config = LookaheadConfig(decoding_length=12, branch_length=5, budget="fixed", use_output_pool=False)
    batch = DecodeBatch(model, config, frozenset(), None)
    batch.add(torch.tensor([first]), torch.ones(1, len(first), dtype=torch.long), None, max_new, keys=["first"])
    outputs = {}
    steps = 0
    pending = list(enumerate(later))
    while batch.rows or pending:
        if steps >= join_after and pending:
            key, prompt = pending.pop(0)
            budget = max_new + extra[key]
            batch.add(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), None, budget, keys=[key])
        for row in batch.retire():
            outputs[row.index] = row.generated
        if batch.rows:
            batch.verify_and_accept(batch.propose())
        steps += 1
    assert outputs["first"] == reference_generate(model, first, max_new, None)
    for key, prompt in enumerate(later):
        assert outputs[key] == reference_generate(model, prompt, max_new + extra[key], None)


@pytest.mark.parametrize("fails", ["prefill", "merge"])
def test_a_failed_add_leaves_the_running_rows_as_they_were(fails):
    """Rows joining in several prefill groups: when a later group's forward fails (out of memory,
    say), or the merge into the shared cache fails half-way, nothing of the joining rows may stay.
    It did: the earlier groups' columns stayed in the cache without rows of their own, the running
    row then decoded against foreign columns, and the server, seeing the batch's size unchanged,
    kept using it. The callers' log-probability recorders kept the first tokens (a server retries
    with the same recorder: shifted by one), and the drafter never retired the rows it started."""
    from rag_lookahead.decoding.loop import DecodeBatch
    from rag_lookahead.decoding.packed_cache import PackedCache
    from rag_lookahead.decoding.results import LogprobRecorder

    model = tiny_model("qwen2")
    config = LookaheadConfig(decoding_length=8, branch_length=4, budget="fixed", use_output_pool=False)
    drafter = PairedDrafter(config)
    batch = DecodeBatch(model, config, frozenset(), None, drafter)
    first, joining, later = [5, 9, 3, 7, 2, 8], [[4, 4, 6, 1, 9], [7, 3, 3, 8, 2, 6, 1]], [6, 2, 9, 9, 4]
    batch.add(torch.tensor([first]), torch.ones(1, len(first), dtype=torch.long), None, 20, keys=["first"])
    batch.verify_and_accept(batch.propose())
    where = (decode_batch, "prefill_padded") if fails == "prefill" else (PackedCache, "append_rows")
    real = getattr(*where)
    calls = []

    def second_call_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (injected)")
        return real(*args, **kwargs)

    ids = torch.tensor([[0, 0] + joining[0], joining[1]])
    mask = (ids != 0).long()
    recorders = [LogprobRecorder(), LogprobRecorder()]
    with (
        mock.patch.object(decode_batch, "PREFILL_FORWARD_TOKENS", 8),  # one prompt a group
        mock.patch.object(*where, second_call_fails),
        pytest.raises(RuntimeError, match="injected"),
    ):
        batch.add(ids, mask, None, 20, keys=["a", "b"], logprobs=recorders)
    assert len(calls) == 2
    assert batch.packed.rows == len(batch.rows) == 1 and not batch.logprobs
    assert all(not recorder.entries for recorder in recorders)
    assert drafter.started == {"first"}
    batch.add(torch.tensor([later]), torch.ones(1, len(later), dtype=torch.long), None, 20, keys=["later"])
    outputs = {}
    while batch.rows:
        batch.verify_and_accept(batch.propose())
        for row in batch.retire():
            outputs[row.index] = row.generated
    assert outputs["first"] == reference_generate(model, first, 20, None)
    assert outputs["later"] == reference_generate(model, later, 20, None)
    assert not drafter.started


def test_rows_added_without_keys_get_their_arrival_order_and_leave_no_recorder():
    """Keys default to the order of arrival over all ``add`` calls (two calls both got key 0),
    and a retired row's log-probability recorder leaves the batch with it (kept, it leaked in
    a long-running server batch and put every later greedy step on the full-logits path)."""
    from rag_lookahead.decoding.loop import DecodeBatch
    from rag_lookahead.decoding.results import LogprobRecorder

    model = tiny_model("qwen2")
    config = LookaheadConfig(decoding_length=8, branch_length=4, budget="fixed", use_output_pool=False)
    batch = DecodeBatch(model, config, frozenset(), None)
    prompts, budgets = [[1, 2, 3], [4, 5, 6], [7, 8]], [3, 6, 4]
    recorder = LogprobRecorder()
    added = batch.add(torch.tensor([prompts[0]]), torch.ones(1, 3, dtype=torch.long), None, 3, logprobs=[recorder])
    ids, mask = padded(prompts[1:])
    added += batch.add(ids, mask, None, budgets[1:])
    assert [row.index for row in added] == [0, 1, 2]
    outputs = {}
    while batch.rows:
        batch.verify_and_accept(batch.propose())
        for row in batch.retire():
            outputs[row.index] = row.generated
            assert row not in batch.logprobs
        assert len(batch.logprobs) == (0 in [row.index for row in batch.rows])
    assert not batch.logprobs and len(recorder.entries) == 3
    assert outputs == {key: reference_generate(model, p, n, None) for key, (p, n) in enumerate(zip(prompts, budgets))}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_eos_and_pad_of_a_generation_config_passed_in_are_honoured(arch):
    """``generate(..., generation_config=GenerationConfig(eos_token_id=...))`` ignored that EOS
    (and pad), so rows ran on where ``model.generate`` stopped. An EOS id as a numpy or tensor
    value raised TypeError; a 2-D one was refused."""
    import array

    import numpy as np
    from transformers import GenerationConfig

    model = tiny_model(arch)
    prompt = torch.tensor([[5, 9, 3, 7, 2, 8]])
    free = model.generate(input_ids=prompt, do_sample=False, max_new_tokens=16)[0, 6:].tolist()
    eos = free[3]  # a token the model does produce, so the answer ends early
    config = GenerationConfig(eos_token_id=eos, pad_token_id=1, do_sample=False, max_new_tokens=16)
    expected = model.generate(input_ids=prompt, generation_config=config)[0, 6:].tolist()
    assert expected[-1] == eos and len(expected) < 16
    got = generate(model, prompt, max_new_tokens=16, generation_config=config).sequences[0, 6:].tolist()
    assert got[: len(expected)] == expected and all(t == 1 for t in got[len(expected) :])
    two_d = (torch.tensor([[eos, 0]]), np.array([[eos], [0]]))  # model.generate flattens them (they were refused)
    more = (array.array("l", [eos]), [torch.tensor(eos), torch.tensor(0)])  # model.generate takes these too
    for value in (np.int64(eos), torch.tensor(eos), [np.int64(eos)], *two_d, *more):
        again = generate(model, prompt, max_new_tokens=16, eos_token_id=value).sequences[0, 6:].tolist()
        assert again[: len(expected)] == expected
    for pad in (np.int64(1), torch.tensor(1), np.array([1])):  # one id, as model.generate takes it
        padded = generate(model, prompt, max_new_tokens=16, eos_token_id=eos, pad_token_id=pad).sequences[0, 6:]
        assert padded.tolist() == got
    # a list raised a bare TypeError; int() read 0.7 as pad 0 and "1" as 1
    for pad in ([1], 0.7, "1", True):
        with pytest.raises(ConfigError, match="pad_token_id must be one token id"):
            generate(model, prompt, max_new_tokens=16, eos_token_id=eos, pad_token_id=pad)
