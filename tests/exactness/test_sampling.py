"""Sampling stays lossless: the same tokens as ``model.generate(do_sample=True)`` under the same seed,
and the same distribution (chi-square on the joint law of the first three tokens)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hf_reference import equal_up_to_an_fp32_tie, hf_logits, hf_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, PairedDrafter, build_tiny_model, tiny_model
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.loop import left_pad
from rag_lookahead.decoding.sampling import Accepted, SamplingParams, TokenChooser
from rag_lookahead.errors import ConfigError

tokens = st.integers(min_value=1, max_value=12)


def hf_sample(model, prompt, max_new, seed, eos=None, **options):
    """transformers' own sampling for one unpadded prompt, after ``torch.manual_seed(seed)``."""
    ids = torch.tensor([prompt])
    torch.manual_seed(seed)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0, **options
    )
    return out[0, len(prompt) :].tolist()


@st.composite
def sampling_options(draw):
    options = {"do_sample": True, "temperature": draw(st.floats(min_value=0.3, max_value=1.5))}
    if draw(st.booleans()):
        options["top_k"] = draw(st.integers(min_value=0, max_value=20))  # absent: transformers' default 50
    if draw(st.booleans()):
        options["top_p"] = draw(st.floats(min_value=0.5, max_value=1.0))
    if draw(st.booleans()):
        options["min_p"] = draw(st.floats(min_value=0.01, max_value=0.2))
    if draw(st.booleans()):
        options["repetition_penalty"] = draw(st.floats(min_value=1.0, max_value=1.6))
    return options


@st.composite
def cases(draw):
    motif = draw(st.lists(tokens, min_size=2, max_size=8))
    prompt = (motif * 6)[: draw(st.integers(min_value=2, max_value=40))]
    config = LookaheadConfig(
        decoding_length=draw(st.integers(min_value=1, max_value=48)),
        branch_length=draw(st.integers(min_value=1, max_value=12)),
        budget=draw(st.sampled_from(["fixed", "auto"])),
        use_output_pool=False,
    )
    return (
        prompt,
        draw(st.integers(1, 30)),
        config,
        draw(sampling_options()),
        draw(st.integers(0, 2**16)),
        draw(st.booleans()),
    )


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_batch_one_without_seed_equals_hf_sampling(arch, case):
    prompt, max_new, config, options, seed, eos_inside = case
    model = tiny_model(arch)
    expected = hf_sample(model, prompt, max_new, seed, **options)
    eos = expected[len(expected) // 2] if eos_inside else None  # EOS inside the drafted block
    if eos is not None:
        expected = hf_sample(model, prompt, max_new, seed, eos=eos, **options)
    # drafts: the true sample (accepted, several tokens a step) and a wrong variant (rejected)
    references = [[prompt[-3:] + expected, prompt[-2:] + [(t % 12) + 1 for t in expected]]]
    torch.manual_seed(seed)
    result = generate(
        model,
        prompt,
        max_new_tokens=max_new,
        config=config,
        references=references,
        eos_token_id=eos,
        pad_token_id=0,
        **options,
    )
    assert result.sequences[0, len(prompt) :].tolist() == expected


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(tokens, min_size=1, max_size=30), max_new=st.integers(1, 30), penalty=st.floats(1.0, 2.0))
def test_greedy_with_repetition_penalty_equals_hf(arch, prompt, max_new, penalty):
    """Token for token, up to the order of fp32 sums: a suite run met glm, prompt [9], penalty 1.6,
    where the 4th token's penalized score (0.375014991) and another's (0.375015140) lie 1.5e-7
    apart, and a verify forward over several tokens summed the other one's a hair higher."""
    model = tiny_model(arch)
    ids = torch.tensor([prompt])
    hf = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=max_new,
        pad_token_id=0,
        repetition_penalty=penalty,
        output_scores=True,
        return_dict_in_generate=True,
    )
    expected = hf.sequences[0, len(prompt) :].tolist()
    result = generate(
        model,
        prompt,
        max_new_tokens=max_new,
        repetition_penalty=penalty,
        references=[[prompt[-2:] + expected]],
        config=LookaheadConfig(budget="fixed"),
    )
    assert equal_up_to_an_fp32_tie(result.sequences[0, len(prompt) :].tolist(), expected, hf.scores)


def test_a_min_p_that_binds_samples_as_model_generate_does():
    """min_p 0.9 keeps only tokens near the likeliest one (the drawn cases' 0.01-0.2 never removed a
    token from a tiny model's flat distribution, so min_p dropped went unseen)."""
    model = tiny_model("qwen2", seed=4)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    options = dict(do_sample=True, min_p=0.9, top_k=None)
    expected = hf_sample(model, prompt, 12, 0, **options)
    assert expected != hf_sample(model, prompt, 12, 0, **{**options, "min_p": None})  # it binds
    torch.manual_seed(0)
    result = generate(model, prompt, max_new_tokens=12, pad_token_id=0, **options)
    assert result.sequences[0, len(prompt) :].tolist() == expected


@functools.cache
def bf16_model():
    """Tiny qwen2 in bf16 (its logits come out bf16, as a real model's on GPU do)."""
    return build_tiny_model("qwen2", "sdpa", 0).to(torch.bfloat16)


def test_a_bf16_model_samples_and_scores_as_model_generate_does():
    """transformers casts each step's logits to fp32 before its processors and its draw; warped and
    softmaxed in bf16 they round otherwise, and 5 of these 30 seeded rows drew another token. The
    log-probabilities are taken in fp32 too (``log_softmax`` in bf16 is off by ~1e-2). Decoded one
    token a forward (``enabled=False``), so no verify forward's shape changes the bf16 logits
    themselves: what is compared is the picking and the scoring."""
    model = bf16_model()
    options = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0)
    config = LookaheadConfig(enabled=False)
    for seed in range(30):
        prompt = [5, 9, 3, 7, 2, 8, 5, 9, 3][: 3 + seed % 6]
        expected, logits = hf_logits(model, prompt, 20, seed=seed, **options)
        torch.manual_seed(seed)
        result = generate(model, prompt, max_new_tokens=20, pad_token_id=0, config=config, logprobs=1, **options)
        assert result.sequences[0, len(prompt) :].tolist() == expected, seed
        if seed < 3:
            for entry, step in zip(result.logprobs[0], logits, strict=True):
                assert entry.logprob == pytest.approx(torch.log_softmax(step.float(), -1)[entry.token].item(), abs=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "glm4"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(tokens, min_size=1, max_size=25), min_size=2, max_size=4),
    max_new=st.integers(1, 25),
    options=sampling_options(),
    seeds=st.lists(st.integers(0, 2**31), min_size=4, max_size=4),
)
def test_per_row_seeds_do_not_depend_on_the_batch_or_the_drafts(arch, prompts, max_new, options, seeds):
    model = tiny_model(arch)
    seeds = seeds[: len(prompts)]
    config = LookaheadConfig(decoding_length=16, branch_length=6, budget="fixed", use_output_pool=False)
    alone = []
    for prompt, seed in zip(prompts, seeds):
        plain = generate(
            model, prompt, max_new_tokens=max_new, seed=seed, config=config.replace(enabled=False), **options
        )
        alone.append(plain.sequences[0, len(prompt) :].tolist())
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    references = [[p[-2:] + a] for p, a in zip(prompts, alone)]
    batched = generate(
        model, ids, mask, max_new_tokens=max_new, seed=seeds, config=config, references=references, **options
    )
    for row, want in enumerate(alone):
        assert batched.sequences[row, width : width + len(want)].tolist() == want


def test_numpy_integers_are_taken_as_seeds_and_top_k():
    """check_seed takes numpy integers, but torch's manual_seed and transformers' top-k warper want a
    Python int: a list of numpy seeds crashed with a bare TypeError from torch."""
    import numpy as np

    model = tiny_model("qwen2")
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    plain = generate(model, ids, mask, max_new_tokens=8, do_sample=True, top_k=5, seed=[1, 2]).sequences
    numpy = generate(
        model, ids, mask, max_new_tokens=8, do_sample=True, top_k=np.int64(5), seed=list(np.arange(1, 3))
    ).sequences
    assert numpy.tolist() == plain.tolist()
    for seeds in (np.array([1, 2]), torch.tensor([1, 2]), [torch.tensor(1), torch.tensor(2)]):  # as max_new_tokens
        given = generate(model, ids, mask, max_new_tokens=8, do_sample=True, top_k=5, seed=seeds).sequences
        assert given.tolist() == plain.tolist()
    one = generate(model, ids, mask, max_new_tokens=8, do_sample=True, top_k=5, seed=torch.tensor(3)).sequences
    assert (
        one.tolist() == generate(model, ids, mask, max_new_tokens=8, do_sample=True, top_k=5, seed=3).sequences.tolist()
    )


@pytest.mark.parametrize("name", ["top_p", "temperature", "repetition_penalty"])
def test_a_none_sampling_param_is_its_neutral_one(name):
    """SamplingParams(top_p=None) was taken, then the first sampled step failed with a bare
    TypeError ('<' between NoneType and float); None is 1.0 (off) there, as in resolve_sampling."""
    from rag_lookahead.decoding.decode_batch import DecodeBatch

    model = tiny_model("qwen2")
    config = LookaheadConfig(decoding_length=8, budget="fixed", use_output_pool=False)

    def sampled(params: SamplingParams) -> list[int]:
        batch = DecodeBatch(model, config, frozenset(), None)
        (row,) = batch.add(torch.tensor([[1, 2, 3, 1, 2, 3]]), None, None, 10, sampling=params)
        while not row.done:
            batch.verify_and_accept(batch.propose())
        return row.generated

    given_none = SamplingParams(do_sample=True, seed=1, **{name: None})
    assert getattr(given_none, name) == 1.0
    assert sampled(given_none) == sampled(SamplingParams(do_sample=True, seed=1))


def test_generation_config_is_taken_as_model_generate_takes_it():
    model = tiny_model("qwen2")
    prompt = [3, 4, 5, 6, 3, 4, 5, 6]
    gc = GenerationConfig(
        do_sample=True, temperature=0.8, top_k=7, top_p=0.9, repetition_penalty=1.1, max_new_tokens=20
    )
    torch.manual_seed(3)
    expected = model.generate(torch.tensor([prompt]), generation_config=gc, pad_token_id=0)[0, len(prompt) :].tolist()
    torch.manual_seed(3)
    got = generate(model, prompt, max_new_tokens=20, generation_config=gc, references=[[prompt + expected]])
    assert got.sequences[0, len(prompt) :].tolist() == expected


def test_model_generation_config_defaults_apply():
    """A model whose own generation config samples (as Qwen's does) samples with its settings."""
    model = tiny_model("llama", seed=3)
    saved = model.generation_config
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, pad_token_id=0
    )
    try:
        prompt = [5, 6, 7, 5, 6, 7]
        torch.manual_seed(11)
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=25)[0, len(prompt) :].tolist()
        torch.manual_seed(11)
        got = generate(model, prompt, max_new_tokens=25, references=[[prompt + expected]])
        assert got.sequences[0, len(prompt) :].tolist() == expected
    finally:
        model.generation_config = saved


def test_the_models_own_per_step_output_switches_do_not_block_generate():
    """``output_scores`` with ``return_dict_in_generate`` in the model's own config shape only what
    ``model.generate`` returns; they made every ``generate`` on such a model a ConfigError. Handed in,
    they are still refused: we would not return what they ask for."""
    model = tiny_model("qwen2", seed=5)
    saved = model.generation_config
    model.generation_config = GenerationConfig(output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    try:
        prompt = [5, 6, 7, 5, 6, 7]
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
        got = generate(model, prompt, max_new_tokens=12)
        assert got.sequences[0].tolist() == expected.sequences[0].tolist()
        with pytest.raises(ConfigError, match="output_scores"):
            generate(model, prompt, max_new_tokens=4, generation_config=model.generation_config)
    finally:
        model.generation_config = saved


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_beams": 4}, "num_beams"),
        ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
        ({"typical_p": 0.5, "do_sample": True}, "typical_p"),  # greedy ignores it, as transformers does
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
        ({"do_sample": True, "temperature": 0.0}, r"temperature must be a number > 0"),  # open at 0
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number > 0"),  # ours, not transformers' ValueError
        ({"do_sample": True, "top_p": 1.5}, "top_p"),
        ({"do_sample": True, "top_k": -1}, "top_k"),
        ({"seed": "abc"}, "seed"),
        ({"seed": [1, 2]}, "seed"),
    ],
)
def test_unsupported_or_bad_options_raise(options, message):
    model = tiny_model("qwen2")
    if "temperature" in options or "repetition_penalty" in options:  # refused by SamplingParams itself too
        with pytest.raises(ConfigError, match=message):
            SamplingParams(**options)
    with pytest.raises(ConfigError, match=message):
        if (
            "num_beams" in options
            or "no_repeat_ngram_size" in options
            or "typical_p" in options
            or "num_return_sequences" in options
        ):
            generate(model, [1, 2, 3], max_new_tokens=3, generation_config=GenerationConfig(**options))
        else:
            generate(model, [1, 2, 3], max_new_tokens=3, **options)


# --- the distribution ---------------------------------------------------------------------------

TEMPERATURE, TOP_K, SAMPLES, ROWS = 0.7, 3, 3000, 150


def _exact_law(model, prompt) -> dict[tuple[int, ...], float]:
    """P(first three tokens) under temperature + top-k, computed from the model's logits directly."""
    law: dict[tuple[int, ...], float] = {}

    def step(path):
        logits = model(torch.tensor([prompt + list(path)])).logits[0, -1].double() / TEMPERATURE
        top = torch.topk(logits, TOP_K)
        return top.indices.tolist(), torch.softmax(top.values, -1).tolist()

    with torch.no_grad():
        for a, pa in zip(*step(())):
            for b, pb in zip(*step((a,))):
                for c, pc in zip(*step((a, b))):
                    law[(a, b, c)] = pa * pb * pc
    return law


def _sample_counts(model, prompt, references) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    config = LookaheadConfig(decoding_length=8, branch_length=3, budget="fixed", use_output_pool=False)
    for start in range(0, SAMPLES, ROWS):
        result = generate(
            model,
            [prompt] * ROWS,
            max_new_tokens=3,
            do_sample=True,
            temperature=TEMPERATURE,
            top_k=TOP_K,
            seed=list(range(start, start + ROWS)),
            config=config,
            references=[references] * ROWS,
        )
        for row in result.sequences[:, len(prompt) :].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


def _chi_square_p(counts, law) -> float:
    """Goodness of fit; cells expected below 5 times are pooled, unseen outcomes count against."""
    big = [k for k, p in law.items() if p * SAMPLES >= 5]
    observed = [counts.get(k, 0) for k in big]
    expected = [law[k] * SAMPLES for k in big]
    observed.append(SAMPLES - sum(observed))
    expected.append(SAMPLES - sum(expected))
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    df = len(observed) - 1
    return _chi2_sf(stat, df)


def _chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square law (regularised upper incomplete gamma, by series)."""
    a, x = k / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 1
    while term > 1e-15 * total:
        term *= x / (a + n)
        total += term
        n += 1
    lower = math.exp(-x + a * math.log(x) - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


@pytest.fixture(scope="module")
def law_setup():
    model = tiny_model("qwen2", seed=5)
    prompt = [7, 8, 9, 7, 8]
    law = _exact_law(model, prompt)
    likeliest = max(law, key=law.get)
    # only the likeliest path is drafted: draws that leave it must end the step with their own token
    references = [prompt[-2:] + list(likeliest)]
    return model, prompt, law, references


def test_joint_law_of_three_tokens_matches_the_model(law_setup):
    model, prompt, law, references = law_setup
    counts = _sample_counts(model, prompt, references)
    assert sum(counts.values()) == SAMPLES
    assert _chi_square_p(counts, law) > 1e-4


def test_the_law_check_catches_argmax_instead_of_a_draw(law_setup, monkeypatch):
    model, prompt, law, references = law_setup

    def argmax_choose(self, history, logits):
        return int(logits.argmax())

    monkeypatch.setattr(TokenChooser, "choose", argmax_choose)
    assert _chi_square_p(_sample_counts(model, prompt, references), law) < 1e-6


def test_the_law_check_catches_keeping_a_rejected_draft_token(law_setup, monkeypatch):
    model, prompt, law, references = law_setup
    honest_walk = TokenChooser.walk

    def keep_rejected(self, draft, logits, history, limit, eos):
        result = honest_walk(self, draft, logits, history, limit, eos)
        parent = result.nodes[-1] if result.nodes else -1
        drafted = [i for i, p in enumerate(draft.parents) if p == parent]
        if drafted and len(result.tokens) < limit:  # the draw left the draft: keep the draft's token anyway
            return Accepted(
                result.nodes + [drafted[0]], result.tokens[:-1] + [draft.tokens[drafted[0]]] + [result.tokens[-1]]
            )
        return result

    monkeypatch.setattr(TokenChooser, "walk", keep_rejected)
    assert _chi_square_p(_sample_counts(model, prompt, references), law) < 1e-6


def test_sampling_law_helper_is_sane():
    assert abs(_chi2_sf(3.84, 1) - 0.05) < 1e-3
    assert abs(_chi2_sf(18.31, 10) - 0.05) < 1e-3


def test_a_hot_row_learns_low_acceptance_and_yields_its_nodes():
    """Acceptance falls as temperature rises: the row's own rates learn it, and the budget then
    gives the batch's draft nodes to the row whose drafts are being accepted."""
    from rag_lookahead.decoding.costs import CostCurve, StepCosts, allocate
    from rag_lookahead.decoding.loop import DecodeBatch

    model = tiny_model("qwen2")
    cold, hot = [3, 4, 5, 6, 3, 4, 5, 6, 3], [7, 8, 9, 10, 7, 8, 9, 10, 7]
    truth_cold = hf_sample(model, cold, 120, 0, do_sample=False)
    # every token has drafted continuations in the hot row's trie, which a near-uniform draw rarely takes
    rng = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 96, (3000,), generator=rng).tolist()
    config = LookaheadConfig(decoding_length=16, branch_length=8, budget="fixed", use_output_pool=False)
    batch = DecodeBatch(model, config, frozenset(), None)
    batch.add(torch.tensor([cold]), None, [[cold[-2:] + truth_cold]], 120, keys=["cold"])
    batch.add(
        torch.tensor([hot]),
        None,
        [[noise]],
        40,
        keys=["hot"],
        sampling=SamplingParams(do_sample=True, temperature=2.0, top_k=0, seed=1),
    )
    for _ in range(6):
        batch.verify_and_accept(batch.propose())
    rows = {row.index: row for row in batch.rows}
    assert rows["cold"].acceptance.first > 0.8
    assert rows["hot"].acceptance.first < 0.3
    # priced with the forward costs measured on this CPU (DESIGN.md: 1 token 120 ms ... 64 tokens 520 ms)
    costs = StepCosts(CostCurve([1, 8, 16, 32, 64], [0.12, 0.19, 0.24, 0.34, 0.52]))
    costs.observe(2, 2, 0.13)
    drafts = [row.acceptance.weigh(batch.drafter.propose(row)) for row in batch.rows]
    counts = dict(zip((row.index for row in batch.rows), allocate(drafts, costs)))
    assert counts["cold"] > counts["hot"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_row_whose_sampling_fails_ends_alone(chunked):
    """A sampled row whose draw fails (NaN logits in that row, say) ends with the error; the rows
    beside it keep their own outputs, token for token. It used to fail the whole step, and with it
    every request in the server's batch."""
    from rag_lookahead.decoding.loop import DecodeBatch

    model = tiny_model("qwen2")
    greedy_prompt, sampled_prompt, failing_prompt = [5, 9, 3, 7, 2, 8], [4, 4, 6, 1, 9], [7, 3, 3, 8, 2, 6, 1]
    config = LookaheadConfig(decoding_length=8, branch_length=4, budget="fixed", use_output_pool=False)
    options = {"do_sample": True, "temperature": 0.8, "top_k": 0, "seed": 3}
    want_greedy = generate(model, greedy_prompt, max_new_tokens=24, config=config).sequences[0, 6:].tolist()
    want_sampled = (
        generate(model, sampled_prompt, max_new_tokens=24, config=config, **options).sequences[0, 5:].tolist()
    )
    drafter = PairedDrafter(config)  # a row whose first token failed was never started: no retire
    batch = DecodeBatch(model, config, frozenset(), None, drafter, prefill_chunk=4 if chunked else 0)
    added = {}
    for key, prompt, sampling in (
        ("greedy", greedy_prompt, None),
        ("sampled", sampled_prompt, SamplingParams(**options)),
        ("failing", failing_prompt, SamplingParams(**{**options, "seed": 4})),
    ):
        (added[key],) = batch.add(torch.tensor([prompt]), None, None, 24, keys=[key], sampling=sampling)
    failing = added["failing"]
    calls = []

    def nan_logits(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    if chunked:  # its first token, when its last prompt chunk arrives
        failing.chooser.choose = nan_logits
    else:  # its third step
        real_walk = failing.chooser.walk
        failing.chooser.walk = lambda *a, **k: nan_logits() if len(failing.generated) > 2 else real_walk(*a, **k)
    outputs, ended = {}, []
    while batch.size:
        batch.verify_and_accept(batch.propose())
        for row in batch.retire():
            outputs[row.index] = row.generated
            if row.failure is not None:
                ended.append(row.index)
    assert calls and ended == ["failing"]
    assert "probability tensor" in str(failing.failure)
    assert outputs["greedy"] == want_greedy and outputs["sampled"] == want_sampled
    assert batch.packed.rows == 0 and not drafter.started


def test_generate_raises_when_one_rows_sampling_fails(monkeypatch):
    """One caller owns every row of ``generate``: a row's failed draw fails the call, as before."""
    model = tiny_model("qwen2")
    monkeypatch.setattr(TokenChooser, "walk", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("nan in row")))
    with pytest.raises(RuntimeError, match="nan in row"):
        generate(model, [5, 9, 3, 7, 2, 8], max_new_tokens=12, do_sample=True, seed=1, top_k=0)


def test_a_row_done_before_a_step_gains_nothing_and_draws_nothing():
    """A row whose first token is EOS is done at ``add``; stepped before ``retire`` (a caller of
    the public DecodeBatch, bench.interference) it gained tokens past its EOS, and its draws moved
    the global generator under a seedless row beside it."""
    from rag_lookahead.decoding.decode_batch import DecodeBatch

    model = tiny_model("qwen2")
    short, other = [1, 1], [5, 9, 13, 7]
    eos = int(model(torch.tensor([short])).logits[0, -1].argmax())
    config = LookaheadConfig(decoding_length=8, budget="fixed", use_output_pool=False)
    seedless = SamplingParams(do_sample=True, temperature=1.0, top_k=0)
    near_greedy = SamplingParams(do_sample=True, temperature=1e-5)

    def run(retire_first: bool) -> tuple[list[int], list[int]]:
        torch.manual_seed(7)
        batch = DecodeBatch(model, config, frozenset([eos]), None)
        (row,) = batch.add(torch.tensor([other]), None, None, 12, sampling=seedless)
        (done,) = batch.add(torch.tensor([short]), None, None, 12, sampling=near_greedy)
        assert done.done and done.generated == [eos]
        if retire_first:
            batch.retire()
        while not row.done:
            batch.verify_and_accept(batch.propose())
        return row.generated, done.generated

    alone, _ = run(retire_first=True)
    beside, done_tokens = run(retire_first=False)
    assert done_tokens == [eos]
    assert beside == alone


def test_a_row_whose_first_draw_failed_is_stepped_past_before_retire():
    """Under chunked prefill a row whose first token's draw failed is done with no token; a step
    before ``retire`` read its last token and failed the whole batch, the healthy row too."""
    from rag_lookahead.decoding.decode_batch import DecodeBatch

    model = tiny_model("qwen2")
    config = LookaheadConfig(decoding_length=8, budget="fixed", use_output_pool=False)
    want = generate(model, [5, 9, 13, 7], max_new_tokens=12, config=config).sequences[0, 4:].tolist()
    batch = DecodeBatch(model, config, frozenset(), None, prefill_chunk=4)
    (healthy,) = batch.add(torch.tensor([[5, 9, 13, 7]]), None, None, 12)
    (broken,) = batch.add(torch.tensor([[1, 2]]), None, None, 12, sampling=SamplingParams(do_sample=True, seed=1))

    def nan_logits(*args, **kwargs):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    broken.chooser.choose = nan_logits
    while not healthy.done:
        batch.verify_and_accept(batch.propose())
    assert healthy.generated == want
    assert broken.done and broken.generated == [] and "probability tensor" in str(broken.failure)


#: the sampling of the stop tests, and drafts from the row's own tokens only (no shared pool), in
#: blocks of at most five tokens (a step's last comes before the budget's)
STOP_SAMPLING = dict(do_sample=True, temperature=0.7)
NO_POOL = LookaheadConfig(budget="fixed", use_output_pool=False, branch_length=4)


def hf_stopped(model, prompt, max_new, seed, stop, **options):
    """transformers' decoding of one prompt after ``torch.manual_seed(seed)``, stopped by a
    criterion at the first ``stop`` token: its new tokens and torch's generator state after it."""

    class LastIs(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop

    out = hf_run(model, prompt, max_new, seed, stopping_criteria=StoppingCriteriaList([LastIs()]), **options)
    return out[0, len(prompt) :].tolist(), torch.get_rng_state()


def stop_run(model, prompt, budget, references, seed=None, **options) -> list[int]:
    """Our decoding of one prompt in the stop tests (drafts from ``references`` only), after
    ``torch.manual_seed(seed)`` where given: its new tokens."""
    if seed is not None:
        torch.manual_seed(seed)
    out = generate(model, prompt, max_new_tokens=budget, config=NO_POOL, references=references, **options)
    return out.sequences[0, len(prompt) :].tolist()


def token_places(blocks: list[list[int]]) -> list[str]:
    """Where each token came in the blocks ``on_tokens`` saw: the row's first (drawn in its
    prefill), inside a block (the walk would have gone on), or a block's last (no drafted child)."""
    places = ["first"]
    for block in blocks[1:]:
        places += ["inside a block"] * (len(block) - 1) + ["a block's last"]
    return places


@pytest.mark.parametrize(("arch", "prefill_chunk"), [("qwen2", 0), ("llama", 0), ("qwen2", 4)])
def test_stop_check_alone_ends_a_sampled_row_where_a_stopping_criterion_does(arch, prefill_chunk):
    """``generate(stop_check=)`` without an ``on_tokens`` that also stops: the walk broke at the stop,
    but the row went on drawing to ``max_new_tokens`` (its tokens and torch's generator past
    ``model.generate``'s), and the first token and each block's last were never asked. Now the
    row ends at the token the check stops, wherever that token comes, as a StoppingCriteria ends it."""
    model = tiny_model(arch)
    prompt, budget = [5, 6, 7, 5, 6, 7], 12
    covered = set()
    for seed in (0, 1, 2):
        free, _ = hf_stopped(model, prompt, budget, seed, stop=-1, **STOP_SAMPLING)
        references = [[prompt[-2:] + free]]  # the answer to draft from: long blocks are accepted
        blocks: list[list[int]] = []
        ours = functools.partial(
            stop_run, model, prompt, budget, references, seed, prefill_chunk=prefill_chunk, **STOP_SAMPLING
        )
        assert ours(on_tokens=lambda _row, tokens, blocks=blocks: blocks.append(list(tokens))) == free
        places = token_places(blocks)
        for place in ("first", "inside a block", "a block's last"):
            # a token not seen before it, and not the last (where the budget ends the row anyway)
            at = next((i for i in range(budget - 1) if places[i] == place and free[i] not in free[:i]), None)
            if at is None:
                continue
            covered.add(place)
            want, state = hf_stopped(model, prompt, budget, seed, stop=free[at], **STOP_SAMPLING)
            assert want == free[: at + 1]
            asked: list[list[int]] = []

            def stop_check(_row, drawn, stop=free[at], asked=asked):
                asked.append(list(drawn))
                return drawn[-1] == stop

            got = ours(stop_check=stop_check)
            assert got == want, (seed, place)
            assert torch.equal(torch.get_rng_state(), state), (seed, place)
            assert len(asked) == at + 1  # every token drawn asked once, none drawn past the stop
    assert covered == {"first", "inside a block", "a block's last"}


def test_stop_check_ends_only_the_row_it_stops_in_a_seeded_batch():
    """Rows with seeds of their own: the row the check stops ends at its stop token, padded after
    it, and draws nothing more; the row beside it decodes to its budget as it does alone."""
    model = tiny_model("qwen2")
    prompts, seeds, budget = [[5, 6, 7, 5, 6, 7], [9, 3, 11, 9, 3]], [11, 12], 12
    alone = [
        generate(model, p, max_new_tokens=budget, seed=s, config=NO_POOL, **STOP_SAMPLING)
        .sequences[0, len(p) :]
        .tolist()
        for p, s in zip(prompts, seeds)
    ]
    at = next(i for i in range(2, budget - 1) if alone[0][i] not in alone[0][:i])
    asked: dict[int, list[list[int]]] = {0: [], 1: []}

    def stop_check(row, drawn):
        asked[row].append(list(drawn))
        return row == 0 and drawn[-1] == alone[0][at]

    ids, mask = left_pad(prompts, 0)
    got = generate(
        model,
        ids,
        mask,
        max_new_tokens=budget,
        seed=seeds,
        config=NO_POOL,
        references=[[p[-2:] + a] for p, a in zip(prompts, alone)],
        pad_token_id=0,
        stop_check=stop_check,
        **STOP_SAMPLING,
    )
    width = ids.shape[1]
    assert got.sequences[0, width:].tolist() == alone[0][: at + 1] + [0] * (budget - at - 1)
    assert got.sequences[1, width:].tolist() == alone[1]
    assert len(asked[0]) == at + 1 and len(asked[1]) == budget


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_stop_check_alone_ends_a_greedy_row_where_a_stopping_criterion_does(penalty):
    """Greedy rows too: a plain one (its path found by one argmax, no walk) was never asked, and one
    with a repetition penalty (which walks) drew on past the stop. Each ends at the first token the
    check stops, the first token, inside a block and a block's last, as a StoppingCriteria ends it,
    each token asked once."""
    model = tiny_model("qwen2")
    prompt, budget = [9, 3, 11, 9, 3], 12  # greedy text without long runs of one token
    options = dict(do_sample=False, repetition_penalty=penalty)
    free, _ = hf_stopped(model, prompt, budget, 0, stop=-1, **options)
    references = [[prompt[-2:] + free]]
    blocks: list[list[int]] = []
    stop_run(model, prompt, budget, references, on_tokens=lambda _row, tokens: blocks.append(list(tokens)), **options)
    places = token_places(blocks)
    covered = set()
    for at in range(budget - 1):
        if free[at] in free[:at] or places[at] in covered:
            continue
        covered.add(places[at])
        want, _ = hf_stopped(model, prompt, budget, 0, stop=free[at], **options)
        asked: list[list[int]] = []

        def stop_check(_row, chosen, stop=free[at], asked=asked):
            asked.append(list(chosen))
            return chosen[-1] == stop

        got = stop_run(model, prompt, budget, references, stop_check=stop_check, **options)
        assert want == free[: at + 1] and got == want, places[at]
        assert len(asked) == at + 1, places[at]
    assert covered == {"first", "inside a block", "a block's last"}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_sampled_walk_draws_nothing_past_an_eos_inside_its_draft(seed):
    """An EOS drawn at a node with drafted children ends the walk: a draw below it would be cut from
    the output but would move torch's generator, so the call after it would differ from
    ``model.generate``'s (a mutation that walked on passed every other test)."""
    model = tiny_model("qwen2")
    ids = torch.tensor([[7, 3, 9, 4, 11, 2, 8] * 2])
    n = ids.shape[1]
    torch.manual_seed(seed)
    free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=True, pad_token_id=0)
    free = free[0, n:].tolist()
    at = next(i for i in range(4, 29) if free[i] not in free[:i])  # an EOS well inside the answer
    options = dict(max_new_tokens=30, do_sample=True, eos_token_id=free[at], pad_token_id=0)
    torch.manual_seed(seed)
    want = [model.generate(ids, attention_mask=torch.ones_like(ids), **options)[0, n:].tolist() for _ in range(2)]
    state = torch.get_rng_state()
    assert want[0] == free[: at + 1]
    torch.manual_seed(seed)
    blocks: list[list[int]] = []
    got = [
        generate(model, ids, references=[[free]], config=NO_POOL, on_tokens=lambda _r, t: blocks.append(t), **options)
        for _ in range(2)
    ]
    assert [g.sequences[0, n:].tolist() for g in got] == want
    assert torch.equal(torch.get_rng_state(), state)
    first_call = blocks[: next(i for i, b in enumerate(blocks) if b[-1] == free[at]) + 1]
    assert len(first_call[-1]) > 1  # the EOS was a drafted node's token, with the answer drafted below it


@pytest.mark.parametrize("stop_at", [0, 1, 2, 3])
def test_a_greedy_path_cut_at_a_stop_keeps_only_the_nodes_its_tokens_spell(stop_at):
    """A plain greedy path cut where ``stop_after`` ends the row: its tokens up to the stop, and
    one node fewer (the last kept token is the bonus, no node): the drafter is told only the
    nodes whose tokens were kept, or its acceptance statistics count a node that was cut."""
    chooser = TokenChooser(SamplingParams(), "cpu")
    path = Accepted(nodes=[3, 5, 8], tokens=[10, 11, 12, 13])
    chooser.stop_after = lambda tokens: tokens[-1] == path.tokens[stop_at]
    cut = chooser.cut_at_stop(path, limit=10, eos=frozenset())
    assert cut.stopped
    assert cut.tokens == path.tokens[: stop_at + 1]
    assert cut.nodes == path.nodes[:stop_at]
    assert len(cut.nodes) == len(cut.tokens) - 1
