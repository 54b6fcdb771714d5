"""Row-local attention (``row_attention``) is exact: a packed step's logits equal the masked
forward's, rows decoded together give the tokens each gives alone or under ``model.generate``,
the row-local path really runs, and a model whose attention ignores the layout stays exact."""

from __future__ import annotations

import copy

import pytest
import torch
from test_chunked_prefill import prompts
from tiny_models import ARCHITECTURES, VOCAB, reference_generate, tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding import row_attention
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.loop import DecodeBatch, left_pad
from rag_lookahead.decoding.prefill import forward_feed, step_feed

CONFIG = LookaheadConfig(decoding_length=16, branch_length=6, budget="fixed")


@pytest.fixture
def row_local_calls(monkeypatch):
    """Row-local attention on from 2 rows; counts the attention calls that ran row-local."""
    calls = []
    inner = row_attention._row_local

    def counted(*args, **kwargs):
        calls.append(args[2].shape[2])  # the step's queries
        return inner(*args, **kwargs)

    monkeypatch.setitem(row_attention.MIN_ROWS, "cpu", 2)
    monkeypatch.setattr(row_attention, "_row_local", counted)
    return calls


def running_batch(model) -> DecodeBatch:
    """Six rows of different lengths after a few drafted steps: columns interleaved, one row gone (holes)."""
    batch = DecodeBatch(model, CONFIG, frozenset(), None)
    rows = prompts(6, seed=11)
    shortest = min(range(len(rows)), key=lambda r: len(rows[r]))  # its dead columns stay as holes
    batch.add(*left_pad(rows, 0), max_new_tokens=[2 if r == shortest else 30 for r in range(len(rows))])
    for _ in range(4):
        batch.retire()
        batch.verify_and_accept(batch.propose())
    batch.retire()
    assert len(batch.rows) == 5 and not batch.packed.hole_free
    return batch


GROUPINGS = {"default": (1.5, 16384), "one group": (1e9, 0), "a group per shape": (1.0, 0)}


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_row_local_logits_equal_the_masked_forward(arch, grouping, row_local_calls, monkeypatch):
    """One step with trees of different shapes (and a row with no draft): the same logits, fp32."""
    monkeypatch.setattr(row_attention, "PADDING_FACTOR", GROUPINGS[grouping][0])
    monkeypatch.setattr(row_attention, "PADDING_SLACK", GROUPINGS[grouping][1])
    model = tiny_model(arch)
    batch = running_batch(model)
    shapes = [([-1, 0, 1], [1, 2, 3]), ([-1, 0, -1, 2, 0], [1, 2, 1, 2, 2]), ([], []), ([-1], [1]), ([-1, -1], [1, 1])]
    drafts = [DraftTree([7 + i for i in range(len(p))], p, d, [1.0] * len(p)) for p, d in shapes]
    feed = step_feed(batch.rows, drafts, {})
    logits = {}
    for least in (None, 2):
        monkeypatch.setitem(row_attention.MIN_ROWS, "cpu", least)
        with torch.inference_mode():
            logits[least], _ = forward_feed(model, copy.deepcopy(batch.packed), feed)
    assert row_local_calls[-model.config.num_hidden_layers :] == [len(feed.logits_at)] * model.config.num_hidden_layers
    masked, local = logits[None], logits[2]
    assert masked.shape == local.shape == (len(feed.logits_at), VOCAB)
    assert ((local - masked).abs().max() / masked.abs().max()).item() < 1e-5


def test_grouping_pads_little_and_keeps_every_row_once():
    rows = [(1, 600), (1, 580), (1, 20), (40, 40), (1, 610), (3, 590)]
    groups = row_attention._group_rows(rows)
    assert sorted(r for group in groups for r in group) == list(range(len(rows)))
    for group in groups:
        padded = len(group) * max(rows[r][0] for r in group) * max(rows[r][1] for r in group)
        own = sum(rows[r][0] * rows[r][1] for r in group)
        assert padded <= row_attention.PADDING_FACTOR * own + row_attention.PADDING_SLACK
    assert len(groups) < len(rows)  # the long single-query rows share one


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("chunk", [0, 11])
def test_greedy_rows_together_match_model_generate(arch, chunk, row_local_calls):
    model = tiny_model(arch)
    rows = prompts(5, seed=len(arch) + chunk)
    result = generate(model, *left_pad(rows, 0), max_new_tokens=20, config=CONFIG, pad_token_id=0, prefill_chunk=chunk)
    width = max(len(p) for p in rows)
    for r, prompt in enumerate(rows):
        expected = reference_generate(model, prompt, 20, None)
        assert result.sequences[r, width : width + len(expected)].tolist() == expected
    assert row_local_calls and max(row_local_calls) > len(rows)  # it ran, with drafts or chunks in the step


@pytest.mark.parametrize("arch", ["qwen2", "llama", "glm4"])
def test_seeded_sampled_rows_together_match_each_alone(arch, row_local_calls):
    model = tiny_model(arch)
    rows = prompts(4, seed=7)
    seeds = [3, 1, 4, 1]
    options = dict(max_new_tokens=16, config=CONFIG, pad_token_id=0, do_sample=True, temperature=0.9, top_p=0.95)
    alone = [generate(model, p, seed=s, **options).sequences[0, len(p) :].tolist() for p, s in zip(rows, seeds)]
    calls_alone = len(row_local_calls)
    together = generate(model, *left_pad(rows, 0), seed=seeds, prefill_chunk=13, **options)
    width = max(len(p) for p in rows)
    for r, want in enumerate(alone):
        assert together.sequences[r, width : width + len(want)].tolist() == want
    assert calls_alone == 0 and len(row_local_calls) > 0  # one row runs masked or plain; several row-local


def test_a_model_whose_attention_ignores_the_layout_still_decodes_exactly(row_local_calls, monkeypatch):
    """The layout goes to an "sdpa" that drops it: the full mask the model also got keeps rows apart."""
    seen = []

    def ignores_layout(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs.pop(row_attention.ROW_LAYOUT, None) is not None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ignores_layout.row_local_inner = sdpa_attention_forward  # so install() leaves it in place
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", ignores_layout)
    model = tiny_model("qwen2")
    rows = prompts(4, seed=5)
    result = generate(model, *left_pad(rows, 0), max_new_tokens=16, config=CONFIG, pad_token_id=0)
    width = max(len(p) for p in rows)
    for r, prompt in enumerate(rows):
        expected = reference_generate(model, prompt, 16, None)
        assert result.sequences[r, width : width + len(expected)].tolist() == expected
    assert any(seen) and not row_local_calls


def test_no_layout_for_eager_attention_or_one_row(row_local_calls):
    eager = tiny_model("qwen2", "eager")
    assert not row_attention.row_local_applies(eager, 8, torch.device("cpu"))
    sdpa = tiny_model("qwen2")
    assert not row_attention.row_local_applies(sdpa, 1, torch.device("cpu"))
    assert row_attention.row_local_applies(sdpa, 2, torch.device("cpu"))
    rows = prompts(3, seed=2)
    generate(eager, *left_pad(rows, 0), max_new_tokens=8, config=CONFIG, pad_token_id=0)
    generate(sdpa, rows[0], max_new_tokens=8, config=CONFIG, pad_token_id=0)
    assert not row_local_calls
