"""``rag_lookahead.chat``: the article's ``model.chat`` for any chat-template model."""

from __future__ import annotations

import pytest
import torch
from test_llm import transformers_warnings
from tiny_models import real_vocab_model, tiny_model
from tiny_tokenizer import tiny_tokenizer
from transformers import GenerationConfig

from rag_lookahead.chat_api import chat
from rag_lookahead.errors import ConfigError, InputError


def plain_answer(model, tokenizer, messages, /, **options) -> str:
    """What model.generate answers for the same messages, decoded the same way."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, do_sample=False, **options)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("qwen2"), tiny_tokenizer()


def test_pairs_history_is_sent_and_returned_as_pairs(tiny):
    model, tokenizer = tiny
    config = GenerationConfig(use_lookahead=True, max_new_tokens=12, do_sample=False)
    history = [("t5 t6 t7", "t8 t9")]
    answer, new_history = chat(model, tokenizer, "t10 t11", history, generation_config=config)
    expected = plain_answer(
        model,
        tokenizer,
        [
            {"role": "user", "content": "t5 t6 t7"},
            {"role": "assistant", "content": "t8 t9"},
            {"role": "user", "content": "t10 t11"},
        ],
        max_new_tokens=12,
    )
    assert answer == expected and len(answer.split()) == 12
    assert new_history == [("t5 t6 t7", "t8 t9"), ("t10 t11", answer)]
    assert history == [("t5 t6 t7", "t8 t9")]  # the caller's list is left alone


def test_messages_history_is_returned_as_messages_and_answers_alike(tiny):
    model, tokenizer = tiny
    config = GenerationConfig(max_new_tokens=10, do_sample=False)
    messages = [
        {"role": "system", "content": "t40"},
        {"role": "user", "content": "t5"},
        {"role": "assistant", "content": "t6"},
    ]
    answer, new_history = chat(model, tokenizer, "t7", messages, generation_config=config)
    same, _ = chat(model, tokenizer, "t7", [("t5", "t6")], generation_config=config, system="t40")
    assert (
        answer
        == same
        == plain_answer(model, tokenizer, messages + [{"role": "user", "content": "t7"}], max_new_tokens=10)
    )
    assert new_history == messages + [{"role": "user", "content": "t7"}, {"role": "assistant", "content": answer}]


def test_without_a_length_answers_are_not_cut_at_transformers_default_20(tiny):
    model, tokenizer = tiny  # no EOS in the tiny model's config: the answer runs to the context end
    answer, _ = chat(model, tokenizer, "t5 t6")
    assert len(answer.split()) > 20


def test_one_length_setting_reaches_generate_so_transformers_does_not_warn_of_two(tiny):
    """chat set max_new_tokens beside a max_length from the model's config (GLM-4 ships 128000) or
    the caller's, and every call logged transformers' "Both max_new_tokens and max_length seem to
    have been set", about a setting the user never made. Same tokens as model.generate."""
    model, tokenizer = tiny
    query = [{"role": "user", "content": "t5 t6"}]
    prompt = tokenizer.apply_chat_template(query, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_length = prompt["input_ids"].shape[1]
    model.generation_config.max_length = 128000
    try:
        with transformers_warnings() as logged:
            answer, _ = chat(model, tokenizer, "t5 t6", generation_config=GenerationConfig(max_new_tokens=9))
        assert answer == plain_answer(model, tokenizer, query, max_new_tokens=9)
        assert not [m for m in logged if "seem to have been set" in m]
    finally:
        model.generation_config.max_length = None
    caller = GenerationConfig(max_length=prompt_length + 7, do_sample=False)
    with transformers_warnings() as logged:
        answer, _ = chat(model, tokenizer, "t5 t6", generation_config=caller)
    assert answer == plain_answer(model, tokenizer, query, max_length=prompt_length + 7)
    assert len(answer.split()) == 7 and caller.max_new_tokens is None  # the caller's config is left alone
    assert not [m for m in logged if "seem to have been set" in m]


@pytest.mark.parametrize(
    "history, query, error",
    [
        (None, "  ", InputError),
        ([("t1", "t2"), {"role": "user", "content": "t3"}], "t4", InputError),
        ([("t1",)], "t4", InputError),
        ([{"role": "user"}], "t4", InputError),
        ("t1 t2", "t4", InputError),
    ],
)
def test_bad_history_or_query_is_refused(tiny, history, query, error):
    model, tokenizer = tiny
    with pytest.raises(error):
        chat(model, tokenizer, query, history)


def test_system_twice_and_no_chat_template_are_refused(tiny):
    model, tokenizer = tiny
    with pytest.raises(InputError, match="system"):
        chat(model, tokenizer, "t4", [{"role": "system", "content": "t1"}], system="t2")
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        chat(model, bare, "t4")
    # one passage as a bare string was drafted from as one-character passages, in silence
    for references in ("t5 t6 t7", [b"t5"], [5, 6], 5):
        with pytest.raises(InputError, match="references must be a list of passages"):
            chat(model, tokenizer, "t4", references=references)


def test_a_message_the_template_leaves_out_is_refused_and_one_it_quotes_is_not(tiny):
    """A template skips roles it does not know: the message was dropped without a word. A first
    check looked for the message's text in the prompt: it refused a tool result the template had
    rendered as JSON (Llama 3's ``ipython`` turn: quoted, newlines escaped) and passed a dropped
    message whose text stood elsewhere in the prompt (here, in the question)."""
    from rag_lookahead.tokens import encode_messages

    model, tokenizer = tiny
    picky = tiny_tokenizer()
    picky.chat_template = (
        "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
        "t2 {{ m['role'] }} {{ m['content'] }} <eos> "
        "{% elif m['role'] == 'ipython' %}t2 ipython {{ m['content'] | tojson }} <eos> {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}t2 assistant {% endif %}"
    )
    question = {"role": "user", "content": "t5 t6"}
    with pytest.raises(InputError, match="left out a message of role 'observation'"):
        encode_messages(picky, [{"role": "observation", "content": "t5"}, question])
    with pytest.raises(InputError, match="left out a message of role 'observation'"):
        chat(model, picky, "t5 t6", [{"role": "observation", "content": "t5"}])
    # a tool result too: Phi-3-mini's template renders system, user and assistant turns only
    with pytest.raises(InputError, match="left out a message of role 'tool'"):
        encode_messages(picky, [question, {"role": "assistant", "content": "t7"}, {"role": "tool", "content": "t8"}])
    quoted = encode_messages(picky, [{"role": "ipython", "content": "t7\nt8"}, question])
    assert len(quoted) > len(encode_messages(picky, [question]))
    assert encode_messages(tokenizer, [{"role": "observation", "content": "t5"}, question])  # rendered: taken


def test_a_developer_message_is_the_system_message(tiny):
    """``developer`` is OpenAI's newer name for system, and the server takes it so; chat() passed it
    to the template as it was (Qwen's template drops roles it does not know: refused)."""
    model, tokenizer = tiny
    known_roles = tiny_tokenizer()
    known_roles.chat_template = (
        "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
        "t2 {{ m['role'] }} {{ m['content'] }} <eos> {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}t2 assistant {% endif %}"
    )
    config = GenerationConfig(max_new_tokens=6, do_sample=False)
    history = [{"role": "developer", "content": "t40"}, {"role": "user", "content": "t5"}]
    answer, new_history = chat(model, known_roles, "t7", history, generation_config=config)
    same, _ = chat(model, known_roles, "t7", [{**history[0], "role": "system"}, history[1]], generation_config=config)
    assert answer == same and new_history[0] == history[0]  # the caller's history keeps its own words
    with pytest.raises(InputError, match="system"):
        chat(model, known_roles, "t7", history, system="t41")


@pytest.mark.slow
def test_default_model_chat_two_turns(default_model_fp32):
    model, tokenizer = default_model_fp32
    passage = "decoding_length caps the number of draft tokens verified in one forward pass."
    config = GenerationConfig(
        use_lookahead=True, decoding_length=64, branch_length=24, max_new_tokens=32, do_sample=False
    )
    first_query = f"{passage}\nWhat does decoding_length cap? Answer with the sentence above."
    answer, history = chat(model, tokenizer, first_query, generation_config=config, references=[passage])
    assert answer == plain_answer(model, tokenizer, [{"role": "user", "content": first_query}], max_new_tokens=32)
    assert "draft tokens" in answer
    second, history = chat(model, tokenizer, "Say it again in one word.", history, generation_config=config)
    messages = [
        {"role": "user", "content": first_query},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Say it again in one word."},
    ]
    assert second == plain_answer(model, tokenizer, messages, max_new_tokens=32)
    assert [q for q, _ in history] == [first_query, "Say it again in one word."]


class Recorder:
    """A streamer that counts what it is given and how often it is ended."""

    def __init__(self) -> None:
        self.puts, self.ends = 0, 0

    def put(self, value) -> None:
        self.puts += 1

    def end(self) -> None:
        self.ends += 1


def test_a_refused_chat_still_ends_its_streamer(tiny):
    """chat refused bad input before decoding began without ending the streamer, so a
    TextIteratorStreamer's reader (chat in a thread, the usual pattern) waited for good."""
    model, tokenizer = tiny
    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    for bad in (
        {"history": [("t7",)]},
        {"references": "t9 t10"},
        {"generation_config": {"max_new_tokens": 4}},
        {"generation_config": GenerationConfig(max_length=3)},
    ):
        streamer = Recorder()
        with pytest.raises((InputError, ConfigError)):
            chat(model, tokenizer, "t5 t6", **({"generation_config": config} | bad), streamer=streamer)
        assert (streamer.puts, streamer.ends) == (0, 1), bad
    streamer = Recorder()
    chat(model, tokenizer, "t5 t6", generation_config=config, streamer=streamer)
    assert streamer.ends == 1 and streamer.puts == 1 + 4  # the prompt, then a token a put


@pytest.fixture(scope="module")
def real_vocab():
    """A tiny random Qwen2 over the default model's tokenizer (transformers' stop strings need a real one)."""
    return real_vocab_model()


def test_stop_strings_and_lengths_are_taken_as_model_generate_takes_them(real_vocab):
    """chat could not honour stop_strings (transformers drops tokenizer= for a custom_generate
    function, and then refuses them), and took the caller's max_length over the model's own
    max_new_tokens, which model.generate merges field by field and puts first."""
    model, tokenizer = real_vocab
    query = [{"role": "user", "content": "Name a colour."}]
    full = plain_answer(model, tokenizer, query, max_new_tokens=12)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, stop_strings=[stop])
    answer, _ = chat(model, tokenizer, "Name a colour.", generation_config=config)
    stopped = plain_answer(model, tokenizer, query, max_new_tokens=12, stop_strings=[stop], tokenizer=tokenizer)
    assert answer == stopped
    assert len(answer) < len(full) and config.stop_strings == [stop]  # the caller's config is left alone
    model.generation_config.stop_strings = [stop]  # the model's own: merged in by model.generate too
    try:
        answer, _ = chat(model, tokenizer, "Name a colour.", generation_config=GenerationConfig(max_new_tokens=12))
        assert answer == stopped
    finally:
        model.generation_config.stop_strings = None
    model.generation_config.max_new_tokens = 5
    try:
        answer, _ = chat(model, tokenizer, "Name a colour.", generation_config=GenerationConfig(max_length=60))
        assert answer == plain_answer(model, tokenizer, query, max_length=60)
        assert len(tokenizer(answer)["input_ids"]) <= 5
    finally:
        model.generation_config.max_new_tokens = None
    for bad in (0, -3):  # model.generate refuses these; chat answered one token
        config = GenerationConfig()
        config.max_new_tokens = bad  # set after construction, which refuses it
        with pytest.raises(ConfigError, match=f"max_new_tokens must be an integer >= 1, got {bad}"):
            chat(model, tokenizer, "Name a colour.", generation_config=config)
