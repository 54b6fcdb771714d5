"""Bad input to the decode loop fails with one clear InputError/ConfigError, never a crash deep inside."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import VOCAB, reference_generate, tiny_model

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.loop import DecodeBatch
from rag_lookahead.errors import ConfigError, InputError, NoRoomError


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def test_attention_mask_with_holes_is_refused(model):
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]])  # a zero after the row's first token
    with pytest.raises(InputError, match="no holes"):
        generate(model, ids, mask, max_new_tokens=4)
    with pytest.raises(InputError, match="no holes"):
        DecodeBatch(model, LookaheadConfig(), frozenset(), None).add(ids, mask, None, 4)


def test_a_prompt_filling_the_context_is_refused_by_the_batch_too(model):
    """generate() refused it; DecodeBatch.add returned a row of no tokens (a sampled row spent a draw)."""
    limit = model.config.max_position_embeddings
    ids = torch.full((2, limit), 5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the shorter row fits; the longest decides
    for add in (
        lambda: generate(model, ids, mask, max_new_tokens=4),
        lambda: DecodeBatch(model, LookaheadConfig(), frozenset(), None).add(ids, mask, None, 4),
    ):
        with pytest.raises(InputError, match=f"the input has {limit} tokens but .* holds {limit}, .*no room is left"):
            add()
    batch = DecodeBatch(model, LookaheadConfig(), frozenset(), None)
    (row,) = batch.add(ids[1:, 1:], mask[1:, 1:], None, 4)  # limit - 2 tokens: room to decode
    assert batch.size == 1


def test_a_prompt_with_no_room_is_a_no_room_error_that_keeps_its_length_when_reworded_or_pickled(model):
    """The RAG chains reword this refusal by its parts (they matched the message's text before)."""
    import pickle

    limit = model.config.max_position_embeddings
    with pytest.raises(NoRoomError) as caught:
        generate(model, torch.full((1, limit + 3), 5), max_new_tokens=4)
    refused = caught.value
    assert isinstance(refused, InputError) and refused.length == limit + 3
    again = refused.reworded("the prompt built from X", "; ask less")
    assert str(again) == str(refused).replace("the input", "the prompt built from X", 1) + "; ask less"
    again.add_note("a note")
    copy = pickle.loads(pickle.dumps(again))
    assert type(copy) is NoRoomError and str(copy) == str(again) and copy.length == limit + 3
    assert copy.__notes__ == ["a note"]


def test_max_new_tokens_may_be_a_numpy_or_tensor_integer(model):
    """model.generate takes them; we refused them with a ConfigError."""
    import numpy as np

    ids = torch.tensor([[5, 6, 7, 5, 6]])
    expected = generate(model, ids, max_new_tokens=6).sequences.tolist()
    for value in (np.int64(6), np.int32(6), torch.tensor(6)):
        assert generate(model, ids, max_new_tokens=value).sequences.tolist() == expected
    for value in (6.0, "6", True, np.float32(6), torch.tensor(6.0), 0):
        with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1"):
            generate(model, ids, max_new_tokens=value)


def test_decode_batch_checks_each_rows_budget_as_generate_does(model):
    """DecodeBatch.add indexed anything but an int as a list: a numpy integer was an IndexError, 2.5
    a TypeError; 0 or a negative budget ran a row silently, and a list of another length than the
    rows failed (too short) or was silently cut (too long)."""
    import numpy as np

    ids = torch.tensor([[5, 6, 7, 5, 6], [5, 6, 7, 5, 6]])
    mask = torch.ones_like(ids)
    expected = generate(model, ids, mask, max_new_tokens=5).sequences[:, 5:].tolist()

    def decoded(budget) -> list[list[int]]:
        batch = DecodeBatch(model, LookaheadConfig(), frozenset(), None)
        rows = batch.add(ids, mask, None, budget)
        while batch.retire() or batch.size:
            if batch.size:
                batch.verify_and_accept(batch.propose())
        return [row.generated for row in rows]

    for budget in (5, np.int64(5), torch.tensor(5), [5, np.int32(5)], (5, 5), np.array([5, 5]), torch.tensor([5, 5])):
        assert decoded(budget) == expected, budget
    for budget, message in (
        (2.5, "max_new_tokens must be an integer >= 1"),
        (0, "max_new_tokens must be an integer >= 1"),
        (-3, "max_new_tokens must be an integer >= 1"),
        (True, "max_new_tokens must be an integer >= 1"),
        ([5, 0], "max_new_tokens must be an integer >= 1"),
        ([5], "max_new_tokens has 1 entries for 2 rows"),
        ([5, 6, 7], "max_new_tokens has 3 entries for 2 rows"),
    ):
        batch = DecodeBatch(model, LookaheadConfig(), frozenset(), None)
        with pytest.raises(ConfigError, match=message):
            batch.add(ids, mask, None, budget)
        assert batch.size == 0
    with pytest.raises(ConfigError, match="keys has 1 entries for 2 rows"):
        DecodeBatch(model, LookaheadConfig(), frozenset(), None).add(ids, mask, None, 5, keys=["a"])


def test_attention_mask_values_are_checked(model):
    with pytest.raises(InputError, match="only 0 and 1"):
        generate(model, [[1, 2, 3]], [[1, 2, 1]], max_new_tokens=2)


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 1000])
def test_input_ids_outside_the_vocabulary(model, bad):
    with pytest.raises(InputError, match=f"token id {bad}, outside the model's vocabulary"):
        generate(model, [1, 2, bad], max_new_tokens=2)


def test_pad_positions_are_checked_too(model):
    ids = torch.tensor([[VOCAB + 5, 1, 2]])  # a padding id the embedding cannot take
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        generate(model, ids, torch.tensor([[0, 1, 1]]), max_new_tokens=2)


def test_text_instead_of_ids(model):
    with pytest.raises(InputError, match="not text"):
        generate(model, "hello", max_new_tokens=2)
    with pytest.raises(InputError, match="must be integers"):
        generate(model, [1.5, 2.0], max_new_tokens=2)


def test_what_a_tokenizer_returns_is_taken_as_its_ids_and_mask(model):
    """transformers 5's apply_chat_template returns a BatchEncoding: the README's snippet passed it
    on and failed deep in torch ("Could not infer dtype of tokenizers.Encoding")."""
    from transformers import BatchEncoding

    ids, mask = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    plain = generate(model, ids, mask, max_new_tokens=5).sequences
    encoded = BatchEncoding({"input_ids": ids, "attention_mask": mask})
    assert torch.equal(generate(model, encoded, max_new_tokens=5).sequences, plain)
    single = generate(model, BatchEncoding({"input_ids": [8, 9, 10, 11]}), max_new_tokens=5).sequences
    assert torch.equal(single, plain[1:])
    with pytest.raises(InputError, match="without 'input_ids'"):
        generate(model, {"ids": [1, 2]}, max_new_tokens=2)


@pytest.mark.parametrize(
    ("references", "message"),
    [
        (["a passage"], "is text"),  # strings where ids belong
        ([[["a", "b"]]], "token ids must be integers"),
        ([[1, 2, 3]], "must be a list of token ids"),  # one level of nesting missing
        ([[[1, 2, VOCAB]]], "outside the model's vocabulary"),
        ([[[1, -2]]], "outside the model's vocabulary"),
        ("passage", "one entry per row"),
        ([[[1]], [[2]]], "references has 2 rows"),
    ],
)
def test_bad_references(model, references, message):
    with pytest.raises(InputError, match=message):
        generate(model, [1, 2, 3], max_new_tokens=2, references=references)


def test_good_references_as_tensors_and_tuples(model):
    prompt = [3, 4, 5, 3, 4]
    expected = reference_generate(model, prompt, 8, None)
    refs = [(torch.tensor(prompt[-2:] + expected),)]
    result = generate(model, prompt, max_new_tokens=8, references=refs, config=LookaheadConfig(budget="fixed"))
    assert result.sequences[0, len(prompt) :].tolist() == expected


def test_decode_batch_moves_inputs_to_the_model_device(model):
    """Ids built on another device than the model's are moved (here both are the CPU; the call path
    is the same one a CUDA model takes)."""
    batch = DecodeBatch(model, LookaheadConfig(), frozenset(), None)
    rows = batch.add([[1, 2, 3]], None, None, 3)
    assert rows[0].generated


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"decoding_length": 10**6}, "decoding_length"),
        ({"branch_length": 10**5}, "branch_length"),
        ({"max_key_length": 1000}, "max_key_length"),
        ({"output_pool_nodes": 10**12}, "output_pool_nodes"),
        ({"decoding_length": 2.5}, "decoding_length"),
        ({"enabled": "no"}, "enabled must be True or False"),
        ({"use_output_pool": 1}, "use_output_pool must be True or False"),
        ({"debug": None}, "debug must be True or False"),
        ({"stop_words": ",."}, "stop_words"),
        ({"stop_words": {","}}, "stop_words"),
        ({"stop_words": {-3}}, "stop_words"),
        ({"budget": "AUTO"}, "budget"),
        ({"min_key_length": 5, "max_key_length": 4}, r"min_key_length \(5\) must not exceed max_key_length \(4\)"),
    ],
)
def test_config_checks(changes, message):
    with pytest.raises(ConfigError, match=message):
        LookaheadConfig(**changes)


def test_config_bounds_are_inclusive():
    """Each integer field takes its upper bound and refuses one more; a key length range may be a
    single length."""
    from rag_lookahead.decoding.config import _UPPER_BOUNDS

    assert LookaheadConfig(min_key_length=4, max_key_length=4).min_key_length == 4
    for name, high in _UPPER_BOUNDS.items():
        valid = {"max_key_length": high} if name == "min_key_length" else {}  # min may not exceed max
        assert getattr(LookaheadConfig(**valid, **{name: high}), name) == high
        with pytest.raises(ConfigError, match=f"{name} must be an integer from 1 to {high:,}, got {high + 1}"):
            LookaheadConfig(**{name: high + 1})


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_key_length", 0), ("stop_words", "abc"), ("decoding_length", -5), ("budget", "weird"), ("debug", True)],
)
def test_a_config_is_changed_by_a_checked_copy_not_in_place(model, field, value):
    """Fields were assignable after the checks: max_key_length 0 failed deep in the trie, text
    stop words in the drafter, and a negative decoding_length or an unknown budget ran silently.
    The config is frozen; ``replace`` checks the new value."""
    config = LookaheadConfig(budget="fixed")
    with pytest.raises(dataclasses.FrozenInstanceError, match=field):
        setattr(config, field, value)
    assert config == LookaheadConfig(budget="fixed")
    if field == "debug":
        assert config.replace(debug=True).debug is True
    else:
        with pytest.raises(ConfigError, match=field):
            config.replace(**{field: value})
    assert generate(model, [1, 2, 3, 1, 2, 3], max_new_tokens=4, config=config).sequences.shape == (1, 10)


def test_the_pool_depth_follows_the_fields_and_is_no_field():
    """Every n-gram pool is ``branch_length + max_key_length`` deep; the property is derived, so a
    copy recomputes it and it stays out of the fields (``asdict``, ``replace``)."""
    config = LookaheadConfig(branch_length=10, max_key_length=3)
    assert config.pool_depth == 13 and config.replace(max_key_length=5).pool_depth == 15
    assert "pool_depth" not in dataclasses.asdict(config)
    with pytest.raises(AttributeError):
        config.pool_depth = 1


def test_longrope_per_layer_kind_limits_the_context_at_the_earliest_switch(model):
    """Rope parameters per layer kind (``rope_parameters`` keyed by layer type), each longrope with
    its own switch: past the earlier one those layers' factors change, so decoding must stop
    there, not at the later one, where a verify step would re-rotate the earlier layers' keys."""
    import copy

    from rag_lookahead.decoding.inputs import context_limit

    longrope = copy.deepcopy(model)
    longrope.config.rope_parameters = {
        "full_attention": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 96},
        "sliding_attention": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 48},
    }
    assert context_limit(longrope) == 48
    with pytest.raises(InputError, match="48 tokens but .* holds 48 .*longrope"):
        generate(longrope, [5] * 48, max_new_tokens=4)


def test_numpy_integers_are_taken_as_config_integers():
    """stop_words, max_new_tokens, seed and top_k took numpy integers; the config's sizes refused them."""
    import numpy as np

    config = LookaheadConfig(decoding_length=np.int64(8), branch_length=np.int32(3), max_key_length=np.int8(2))
    assert (config.decoding_length, config.branch_length, config.max_key_length) == (8, 3, 2)
    assert all(type(v) is int for v in (config.decoding_length, config.branch_length, config.max_key_length))
    assert config == LookaheadConfig(decoding_length=8, branch_length=3, max_key_length=2)


def test_a_dict_for_the_config_is_refused_naming_the_class(model):
    """A dict reached the decoder: AttributeError "'dict' object has no attribute 'enabled'"."""
    with pytest.raises(ConfigError, match=r"config must be a LookaheadConfig .*LookaheadConfig\(\*\*fields\).*dict"):
        generate(model, [1, 2, 3], max_new_tokens=4, config={"decoding_length": 8})
    with pytest.raises(ConfigError, match="config must be a LookaheadConfig"):
        DecodeBatch(model, {"decoding_length": 8}, frozenset(), None)


@pytest.mark.parametrize(("given", "message"), [("default", r"load_model\('default'\)"), (None, "NoneType")])
def test_a_model_name_or_none_is_refused_asking_for_a_loaded_model(given, message):
    """generate("default", ids) failed with AttributeError "'str' object has no attribute 'config'"."""
    with pytest.raises(ConfigError, match=message):
        generate(given, [1, 2, 3], max_new_tokens=4)
    with pytest.raises(ConfigError, match=message):
        DecodeBatch(given, LookaheadConfig(), frozenset(), None)


def test_config_error_is_one_line():
    with pytest.raises(ConfigError) as info:
        LookaheadConfig(stop_words=",.")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("docs\nold", "docs\\nold"),
        ("a\x1b[31mred", "a\\x1b[31mred"),
        ("evil\u202etxt.exe", "evil\\u202etxt.exe"),  # a bidi override reorders what follows on a terminal
        (
            "/data/\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",
            "/data/\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",
        ),
        ("\U0001f468\u200d\U0001f469\u200d\U0001f467 photos", "\U0001f468\u200d\U0001f469\u200d\U0001f467 photos"),
        ("two\u3000words", "two\u3000words"),
    ],
)
def test_a_path_is_shown_on_one_line_with_the_joiners_words_are_spelt_with(text, shown):
    """Line breaks and terminal controls are escaped in messages; the zero-width (non-)joiners of
    Persian words and emoji sequences printed as ``\\u200c`` and ``\\u200d`` in every path."""
    from rag_lookahead.errors import one_line, shown_path

    assert shown_path(text) == one_line(text) == shown


def test_a_path_with_bytes_that_are_not_utf8_is_shown_and_quoted_as_those_bytes():
    """A folder named ``b"/tmp/idx\\xfe"`` was shown as ``idx\\udcfe`` and suggested as
    ``$'/tmp/idx\\udcfe'``, which bash reads as three other bytes: the pasted command named
    another folder. Both now say ``\\xfe``, and bash reads the suggested word back as the path."""
    import os
    import subprocess

    from rag_lookahead.errors import shell_word, shown_path

    path = os.fsdecode(b"/tmp/idx\xfe it's\n")
    assert shown_path(path) == "/tmp/idx\\xfe it's\\n"
    assert shell_word(path) == "$'/tmp/idx\\xfe it\\'s\\n'"
    # an invisible character above U+007F (a soft hyphen, NEL) is \\u00ad, not \\xad: that is the byte
    soft = "/tmp/idx\u00ad2\x85"
    assert shown_path(soft) == "/tmp/idx\\u00ad2\\u0085"
    for name in (path, soft):
        word = shell_word(name)
        utf8 = {**os.environ, "LC_ALL": "C.UTF-8"}  # bash writes \\uXXXX in the locale's encoding
        pasted = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, check=True, env=utf8).stdout
        assert pasted == os.fsencode(name), word


def test_an_output_path_with_bytes_that_are_not_utf8_is_named_as_those_bytes(tmp_path):
    """The output checks quoted paths with ``repr``: ``'/tmp/x\\udcfe/r.json'``, no name a user can
    type or paste; they say ``\\xfe`` as every other message does."""
    import os

    from rag_lookahead.output_files import check_output_file

    missing = os.fsdecode(os.fsencode(str(tmp_path)) + b"/nodir\xfe/r.json")
    with pytest.raises(ConfigError) as err:
        check_output_file(missing, "--json", ours=lambda path: False)
    assert "nodir\\xfe/r.json'" in str(err.value) and "udc" not in str(err.value), err.value
