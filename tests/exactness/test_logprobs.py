"""Log-probabilities from the decode loop are exact: each new token's entry equals ``log_softmax``
of transformers' own ``output_logits`` at that step, greedy and sampled, while the drafts get
several tokens accepted per forward; and nothing is recorded unless asked."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_logits
from tiny_models import tiny_model

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding import results
from rag_lookahead.decoding.loop import left_pad

CONFIG = LookaheadConfig(budget="fixed", decoding_length=16, branch_length=8, use_output_pool=False)
PROMPTS = [[5, 9, 14, 3, 5, 9, 14, 3, 5, 9], [7, 1, 22, 40, 61, 7, 1, 22]]
TOP = 5


def assert_exact(entries, tokens: list[int], logits: list[torch.Tensor]) -> None:
    assert [e.token for e in entries] == tokens and len(logits) == len(tokens)
    for entry, step in zip(entries, logits):
        expected = torch.log_softmax(step.float(), dim=-1)
        assert entry.logprob == pytest.approx(expected[entry.token].item(), abs=1e-5)
        values, ids = expected.topk(TOP)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_logprobs_equal_output_logits(arch):
    model = tiny_model(arch)
    for prompt in PROMPTS:
        tokens, logits = hf_logits(model, prompt, 24, do_sample=False)
        # the true continuation as a reference passage: the drafts get whole blocks accepted
        result = generate(model, prompt, max_new_tokens=24, config=CONFIG, references=[[prompt + tokens]], logprobs=TOP)
        assert result.sequences[0, len(prompt) :].tolist() == tokens
        assert max(result.stats.accepted_histogram) > 2
        assert_exact(result.logprobs[0], tokens, logits)


def test_seeded_sample_logprobs_equal_output_logits():
    """Sampled rows report the model's own distribution (the raw logits), not the warped one."""
    model = tiny_model("qwen2")
    options = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    for seed, prompt in enumerate(PROMPTS):
        tokens, logits = hf_logits(model, prompt, 20, seed=seed, **options)
        torch.manual_seed(seed)
        result = generate(
            model, prompt, max_new_tokens=20, config=CONFIG, references=[[prompt + tokens]], logprobs=TOP, **options
        )
        assert result.sequences[0, len(prompt) :].tolist() == tokens
        assert max(result.stats.accepted_histogram) > 2
        assert_exact(result.logprobs[0], tokens, logits)


def test_batch_rows_and_eos():
    """Rows of different lengths in one batch, ending at EOS: each row's entries are its own,
    the EOS token's included (as transformers gives a step's logits for it)."""
    model = tiny_model("qwen2")
    singles = [hf_logits(model, prompt, 16, do_sample=False) for prompt in PROMPTS]
    eos = singles[0][0][6]
    ids, mask = left_pad(PROMPTS, 0)
    result = generate(model, ids, mask, max_new_tokens=16, config=CONFIG, eos_token_id=eos, logprobs=TOP)
    for entries, (tokens, logits) in zip(result.logprobs, singles):
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert_exact(entries, tokens[:cut], logits[:cut])


def test_zero_top_and_nothing_recorded_unless_asked(monkeypatch):
    model = tiny_model("qwen2")
    result = generate(model, PROMPTS[0], max_new_tokens=6, config=CONFIG, logprobs=0)
    assert len(result.logprobs[0]) == 6 and all(e.top == () for e in result.logprobs[0])

    def refuse(*args, **kwargs):
        raise AssertionError("log-probabilities computed though nobody asked")

    monkeypatch.setattr(results, "token_logprobs", refuse)
    plain = generate(model, PROMPTS[0], max_new_tokens=6, config=CONFIG)
    assert plain.logprobs is None
    assert plain.sequences.tolist() == result.sequences.tolist()


@pytest.mark.parametrize("top", [-1, 2.5, True, "5"])
def test_a_bad_logprobs_count_is_a_config_error(top):
    from rag_lookahead.errors import ConfigError

    with pytest.raises(ConfigError, match="logprobs"):
        generate(tiny_model("qwen2"), PROMPTS[0], max_new_tokens=2, config=CONFIG, logprobs=top)


@pytest.mark.parametrize("extra", [0, 3])
def test_a_top_count_of_the_whole_vocabulary_or_more_lists_every_token(extra):
    """``top`` >= V keeps all V tokens at each place (clamped, not one short), most likely first,
    the chosen token among them with its own log-probability."""
    vocab = 7
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    chosen = [int(logits[0].argmin()), 4, int(logits[2].argmax())]  # the least likely token too
    entries = results.token_logprobs(logits, chosen, top=vocab + extra)
    for entry, row, token in zip(entries, logits, chosen, strict=True):
        expected = torch.log_softmax(row, dim=-1)
        assert sorted(t for t, _ in entry.top) == list(range(vocab))
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(sorted(expected.tolist(), reverse=True), abs=1e-6)
        assert dict(entry.top)[token] == pytest.approx(entry.logprob)
        assert entry.logprob == pytest.approx(expected[token].item(), abs=1e-6)
