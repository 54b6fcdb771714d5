"""``generate`` reads its arguments as ``model.generate`` does, where they decide the output.

Four measured differences: an explicit None for a sampling option (transformers: "off"; we kept
the model's setting), a batch padded with the smallest EOS id (transformers: the first), a pad id
inside a prompt passed without a mask (transformers masks it out), and greedy decoding refusing
the sampling warpers' values that transformers ignores (``temperature=0.0``).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from transformers import GenerationConfig

from rag_lookahead import generate
from rag_lookahead.decoding.loop import left_pad
from rag_lookahead.errors import InputError

MAX_NEW = 16


def _hf(model, ids, mask=None, seed: int = 5, **options) -> list[list[int]]:
    torch.manual_seed(seed)
    kwargs = {} if mask is None else {"attention_mask": mask}
    return model.generate(ids, max_new_tokens=MAX_NEW, **kwargs, **options).tolist()


def _ours(model, ids, mask=None, seed: int = 5, **options) -> list[list[int]]:
    torch.manual_seed(seed)
    return generate(model, ids, mask, max_new_tokens=MAX_NEW, **options).sequences.tolist()


@pytest.fixture
def sampling_model():
    """A model whose own generation config samples, as Qwen-Instruct's does."""
    model = tiny_model("qwen2", seed=4)
    saved = model.generation_config
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.05, pad_token_id=0
    )
    yield model
    model.generation_config = saved


@pytest.mark.parametrize("name", ["do_sample", "top_k", "top_p", "min_p", "temperature", "repetition_penalty"])
def test_an_explicit_none_turns_the_option_off_as_in_transformers(sampling_model, name):
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    mask = torch.ones_like(ids)
    assert _ours(sampling_model, ids, mask, **{name: None}) == _hf(sampling_model, ids, mask, **{name: None})
    assert _ours(sampling_model, ids, mask) == _hf(sampling_model, ids, mask)  # left out: the model's setting


def test_explicit_none_differs_from_left_out_where_it_matters(sampling_model):
    """So the test above can fail: for these two options off and the model's setting part ways."""
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    mask = torch.ones_like(ids)
    for name in ("do_sample", "top_k"):
        assert _hf(sampling_model, ids, mask, **{name: None}) != _hf(sampling_model, ids, mask)


def test_finished_rows_are_padded_with_the_first_eos_id():
    """Two EOS ids, no pad id: transformers pads with the first; we padded with the smallest."""
    model = tiny_model("qwen2", seed=4)
    saved = model.generation_config.pad_token_id
    model.generation_config.pad_token_id = None
    try:
        rows = [[5, 6, 7, 5, 6], [9, 9, 3, 4, 2, 8, 1]]
        ids, mask = left_pad(rows, pad=1)
        free = _hf(model, ids, mask, do_sample=False, eos_token_id=None, pad_token_id=0)
        first, second = (row[ids.shape[1] :] for row in free)
        stop = next(t for t in first[:4] if t not in second)  # ends row 0 early, never row 1
        other = max(t for t in range(model.config.vocab_size) if t not in first + second)
        eos = [other, stop] if other > stop else [stop, other]  # the first is not the smallest
        assert eos[0] != min(eos)
        expected = _hf(model, ids, mask, do_sample=False, eos_token_id=eos)
        assert expected[0][-1] == eos[0]  # row 0 was padded
        assert _ours(model, ids, mask, do_sample=False, eos_token_id=eos) == expected
    finally:
        model.generation_config.pad_token_id = saved


def test_a_pad_id_in_a_prompt_without_a_mask_is_masked_out_as_in_transformers():
    model = tiny_model("qwen2", seed=4)
    ids = torch.tensor([[0, 0, 5, 6, 7, 5, 6]])
    options = {"do_sample": False, "pad_token_id": 0, "eos_token_id": 95}
    expected = _hf(model, ids, **options)
    assert expected == _hf(model, ids, (ids != 0).long(), **options)  # the pads are masked out
    assert expected != _hf(model, ids, torch.ones_like(ids), **options)  # (they would change the answer)
    assert _ours(model, ids, **options) == expected
    with pytest.raises(InputError, match="pad id 0 stands inside a row"):  # holes: transformers' own, not ours
        generate(model, [5, 0, 6, 7], max_new_tokens=4, **options)
    # through model.generate, transformers infers the mask itself: the error says where its zeros came from
    from rag_lookahead.hf_entry import hf_generate

    with pytest.raises(InputError, match="without an attention_mask, transformers masks out every pad_token_id"):
        model.generate(torch.tensor([[5, 0, 6, 7]]), max_new_tokens=4, custom_generate=hf_generate, **options)
    # a pad id that is also an EOS id is not masked (transformers cannot tell it from text either)
    same = {"do_sample": False, "pad_token_id": 5, "eos_token_id": 5}
    assert _ours(model, torch.tensor([[5, 6, 7, 5, 6]]), **same) == _hf(model, torch.tensor([[5, 6, 7, 5, 6]]), **same)


@pytest.mark.parametrize(
    "do_sample, options",
    [
        # greedy ignores the sampling warpers, as transformers does
        *((False, options) for options in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_k": -3}, {"min_p": 7.0})),
        # large temperatures and penalties are taken: capped at 100 before, for no reason transformers has
        (True, {"temperature": 150.0}),
        (True, {"repetition_penalty": 200.0}),
        (True, {"top_p": 0.0}),  # keeps the most likely token, as transformers' warper does (it was refused)
    ],
)
def test_settings_transformers_takes_are_taken(do_sample, options):
    model = tiny_model("llama", seed=2)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    mask = torch.ones_like(ids)
    expected = _hf(model, ids, mask, do_sample=do_sample, pad_token_id=0, **options)
    assert _ours(model, ids, mask, do_sample=do_sample, pad_token_id=0, **options) == expected


@pytest.mark.parametrize(
    "options",
    [
        {"typical_p": 0.5},
        {"epsilon_cutoff": 0.01},
        {"eta_cutoff": 0.01},
        {"renormalize_logits": True},
        {"penalty_alpha": 0.0},
    ],
)
def test_greedy_takes_the_sampling_only_settings_transformers_ignores(options):
    """transformers applies these warpers only when sampling (a renormalisation keeps the argmax,
    penalty_alpha 0 is no contrastive search): greedy refused them here."""
    model = tiny_model("llama", seed=2)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    config = GenerationConfig(do_sample=False, pad_token_id=0, **options)
    assert _ours(model, ids, generation_config=config) == _hf(model, ids, generation_config=config)


@pytest.mark.parametrize("do_sample", [False, True])
def test_empty_suppression_lists_are_taken_as_in_transformers(do_sample):
    """transformers suppresses nothing for ``suppress_tokens=[]``: it was refused here."""
    model = tiny_model("llama", seed=2)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    config = GenerationConfig(do_sample=do_sample, pad_token_id=0, suppress_tokens=[], begin_suppress_tokens=[])
    assert _ours(model, ids, generation_config=config) == _hf(model, ids, generation_config=config)


@pytest.fixture
def eos_model():
    """A model whose own generation config names an EOS and a pad id."""
    model = tiny_model("llama", seed=0)
    saved = (model.generation_config.eos_token_id, model.generation_config.pad_token_id)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 74, 7
    yield model
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = saved


@pytest.mark.parametrize("options", [{"eos_token_id": None}, {"eos_token_id": 74, "pad_token_id": None}])
def test_an_explicit_none_eos_or_pad_is_off_as_in_transformers(eos_model, options):
    """``eos_token_id=None`` decoded past the model's own EOS in transformers and stopped at it here;
    ``pad_token_id=None`` padded finished rows with the first EOS there and with the model's pad here."""
    ids, mask = left_pad([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [12, 3, 8]], pad=0)
    want = _hf(eos_model, ids, mask, do_sample=False, **options)
    assert _ours(eos_model, ids, mask, **options) == want
    left_out = _ours(eos_model, ids, mask, **{k: v for k, v in options.items() if v is not None})
    assert left_out != want  # the model's own id then applies: the case tells them apart


@pytest.mark.parametrize("where", ["argument", "model"])
def test_sampling_with_prompt_lookup_is_refused(where):
    """transformers samples through its assisted decoding when prompt_lookup_num_tokens is set
    (passed, or in the model's own config), drawing other tokens: ours drew plain sampling's."""
    from rag_lookahead.errors import ConfigError

    model = tiny_model("llama", seed=0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6]])
    config = GenerationConfig(do_sample=True, prompt_lookup_num_tokens=3)
    saved = model.generation_config
    try:
        if where == "model":
            model.generation_config = config
        with pytest.raises(ConfigError, match="assisted generation"):
            generate(
                model, ids, max_new_tokens=MAX_NEW, **({"generation_config": config} if where == "argument" else {})
            )
        greedy = generate(model, ids, max_new_tokens=MAX_NEW, do_sample=False, generation_config=config)
        assert greedy.sequences.tolist() == _hf(model, ids, generation_config=config, do_sample=False)
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("eos", ["12", b"12", [3, "4"], 2.0, [True]])
def test_an_eos_id_that_is_no_token_id_is_refused(eos):
    """A string was read as its characters' digits (``"12"`` -> ids 1 and 2); transformers raises."""
    from rag_lookahead.errors import ConfigError

    with pytest.raises(ConfigError, match="eos_token_id must be a token id"):
        generate(tiny_model("llama", seed=0), [1, 2, 3], max_new_tokens=4, eos_token_id=eos)


def test_token_healing_is_refused_not_ignored():
    from rag_lookahead.errors import ConfigError

    with pytest.raises(ConfigError, match="token_healing"):
        generate(
            tiny_model("llama", seed=0),
            [1, 2, 3],
            max_new_tokens=4,
            generation_config=GenerationConfig(token_healing=True),
        )


def test_a_repetition_penalty_that_overflows_the_logits_is_refused_when_sampling():
    """A seen token's logit divided by 1e-300 is inf and the draw NaN (a server 500); greedy
    takes the argmax of the same values as transformers does, so only sampling refuses it."""
    from rag_lookahead.errors import ConfigError

    model, ids = tiny_model("llama", seed=0), torch.tensor([[5, 6, 5, 6, 5, 6]])
    with pytest.raises(ConfigError, match="repetition_penalty must be at least 1e-06 to sample"):
        _ours(model, ids, do_sample=True, repetition_penalty=1e-300)
    assert _ours(model, ids, do_sample=False, repetition_penalty=1e-300) == _hf(
        model, ids, do_sample=False, repetition_penalty=1e-300
    )
    assert _ours(model, ids, do_sample=True, repetition_penalty=1e-6) == _hf(
        model, ids, do_sample=True, repetition_penalty=1e-6
    )


def test_on_tokens_gets_blocks_it_may_keep_or_change():
    """Each block handed to ``on_tokens`` is the callback's own: kept blocks join up to the answer,
    and a callback that empties its block changes nothing (the first block was the row's own list)."""
    model = tiny_model("qwen2")
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 7]
    plain = generate(model, prompt, max_new_tokens=10).sequences[0, len(prompt) :].tolist()
    kept: list[list[int]] = []
    generate(model, prompt, max_new_tokens=10, on_tokens=lambda _row, tokens: kept.append(tokens))
    assert sum(kept, []) == plain and len(kept) > 1

    def consume(_row: int, tokens: list[int]) -> None:
        tokens.clear()

    emptied = generate(model, prompt, max_new_tokens=10, on_tokens=consume)
    assert emptied.sequences[0, len(prompt) :].tolist() == plain
