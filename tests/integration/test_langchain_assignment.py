"""Fields of LookaheadLLM and ChatLookahead assigned after construction, on tiny random-weight models.

Pydantic's plain assignment checked nothing and kept the engine built for the old settings:
``llm.model = other`` went on answering with the old model, ``chat.timeout = -1.0`` cut every
answer to one token, ``llm.system_prompt = 5`` was taken. An assignment is now checked and settled
as ``model_copy(update=...)`` does it. Each test fails on the code before that, but
``test_langchain_settings_assigned_or_bound_still_work``: a guard that LangChain's own settings,
which plain assignment already took, still work through the checked one.
"""

from __future__ import annotations

import threading

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage
from tiny_tokenizer import tiny_tokenizer

from rag_lookahead.errors import ConfigError
from rag_lookahead.langchain.chat_model import ChatLookahead
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.tiny import build_tiny_model

PROMPT = "t5 t6 t7 t5 t6 t7 t8 t9 t5 t6"
LENGTH = {ChatLookahead: "max_tokens", LookaheadLLM: "max_new_tokens"}


@pytest.fixture(scope="module")
def models():
    first, second = build_tiny_model("qwen2", seed=0), build_tiny_model("qwen2", seed=9)
    for model in (first, second):
        model.generation_config.eos_token_id = 3
    return first, second


def build(cls, loaded, **settings):
    return cls(**{"model": loaded, "tokenizer": tiny_tokenizer(), LENGTH[cls]: 8} | settings)


def answer(model, **kwargs) -> str:
    out = model.invoke(PROMPT, **kwargs)
    return out.content if isinstance(out, AIMessage) else out


@pytest.mark.parametrize("cls", [LookaheadLLM, ChatLookahead])
def test_an_assigned_model_or_tokenizer_decodes_with_its_own_engine(cls, models):
    first, second = models
    wanted = answer(build(cls, second))
    model = build(cls, first)
    before = answer(model)
    assert before != wanted
    model.model = second
    assert model.model is second and model._engine.model is second
    assert answer(model) == wanted
    tokenizer = tiny_tokenizer()
    model.tokenizer = tokenizer
    assert model._engine.tokenizer is tokenizer
    engine = model._engine
    model.temperature = 0.0  # other settings keep the engine, so its output pool
    assert model._engine is engine and answer(model) == wanted


def test_a_chat_model_on_a_given_engine_refuses_another_model_beside_it(models):
    """From from_llm the engine decodes: a model assigned beside it was silently not used."""
    first, second = models
    chat = ChatLookahead.from_llm(build(LookaheadLLM, first))
    before = answer(chat)
    for name, value in (("model", second), ("tokenizer", tiny_tokenizer())):
        with pytest.raises(ConfigError, match="decodes with the engine it was given.*'engine': None"):
            setattr(chat, name, value)
        with pytest.raises(ConfigError, match="decodes with the engine it was given"):
            chat.model_copy(update={name: value})
    assert chat.model is first and answer(chat) == before
    own = chat.model_copy(update={"model": second, "engine": None})
    assert answer(own) == answer(build(ChatLookahead, second))


def test_an_engine_assigned_or_copied_in_alone_decodes_with_it(models):
    """``chat.engine = llm2.engine`` or a copy updating the engine alone takes that engine's model
    and tokenizer (as from_llm does); they were refused with "drop the engine too". A model given
    beside an engine that is not its own is still refused."""
    first, second = models
    llm1, llm2 = build(LookaheadLLM, first), build(LookaheadLLM, second)
    wanted = answer(ChatLookahead.from_llm(llm2))
    chat = ChatLookahead.from_llm(llm1)
    assert answer(chat) != wanted
    copied = chat.model_copy(update={"engine": llm2.engine})
    assert copied._engine is llm2.engine and copied.model is second and copied.tokenizer is llm2.tokenizer
    assert answer(copied) == wanted
    assert chat._engine is llm1.engine and chat.model is first  # the copied one is left as it was
    chat.engine = llm2.engine
    assert chat._engine is llm2.engine and chat.model is second and chat.tokenizer is llm2.tokenizer
    assert answer(chat) == wanted
    with pytest.raises(ConfigError, match="decodes with the engine it was given"):
        chat.model_copy(update={"engine": llm1.engine, "model": second})


def test_two_threads_assigning_different_fields_keep_both(models):
    """Each assignment settles a copy of every field and writes them all back: another thread's
    assignment between the two was reverted. The settle of one is held here until the other
    assignment is done (or, under the lock, a second has passed), as a thread switch there would."""
    first, _ = models
    other_done = threading.Event()
    others: list[threading.Thread] = []

    class HeldSettle(LookaheadLLM):
        def _settle(self, updated):
            super()._settle(updated)
            if updated == frozenset({"temperature"}) and not others:
                others.append(threading.Thread(target=assign_length))
                others[0].start()
                other_done.wait(timeout=1.0)

    llm = HeldSettle(model=first, tokenizer=tiny_tokenizer(), max_new_tokens=8)

    def assign_length() -> None:
        llm.max_new_tokens = 5
        other_done.set()

    llm.temperature = 0.5
    others[0].join()
    assert llm.temperature == 0.5 and llm.max_new_tokens == 5


@pytest.mark.parametrize("cls", [LookaheadLLM, ChatLookahead])
def test_a_call_overlapping_an_assignment_decodes_with_the_engine_it_began_with(cls, models):
    """A call read the engine again after encoding: a model assigned (by another thread) while it
    encoded decoded the prompt with the new engine, whose tokenizer need not be the one that
    encoded it. The call now reads the engine once."""
    first, second = models
    began_with, assigned = answer(build(cls, first)), answer(build(cls, second))
    assert began_with != assigned
    tokenizer = tiny_tokenizer()
    model = build(cls, first, tokenizer=tokenizer)
    encode = tokenizer.apply_chat_template
    assignments: list[threading.Thread] = []

    def encode_while_assigned(*args, **kwargs):
        if not assignments:
            assignments.append(threading.Thread(target=setattr, args=(model, "model", second)))
            assignments[0].start()
            assignments[0].join()
        return encode(*args, **kwargs)

    tokenizer.apply_chat_template = encode_while_assigned
    assert answer(model) == began_with and assignments
    assert model._engine.model is second and answer(model) == assigned


@pytest.mark.parametrize(
    ("cls", "name", "value"),
    [
        (LookaheadLLM, "max_new_tokens", 0),
        (LookaheadLLM, "max_new_tokens", 2.5),
        (LookaheadLLM, "system_prompt", 5),
        (LookaheadLLM, "temperature", -1.0),
        (LookaheadLLM, "top_p", 5.0),
        (LookaheadLLM, "stop", "t6"),
        (LookaheadLLM, "model", None),
        (ChatLookahead, "max_tokens", -3),
        (ChatLookahead, "timeout", -1.0),
        (ChatLookahead, "timeout", 0.0),
        (ChatLookahead, "top_k", -5),
        (ChatLookahead, "seed", -1),
        (ChatLookahead, "stop", ["t6", 5]),
    ],
)
def test_an_assigned_bad_value_is_refused_as_the_constructor_refuses_it(cls, name, value, models):
    first, _ = models
    with pytest.raises(ConfigError) as built:
        build(cls, first, **{name: value})
    model = build(cls, first)
    before, kept = answer(model), getattr(model, name)
    with pytest.raises(ConfigError) as assigned:
        setattr(model, name, value)
    assert str(assigned.value) == str(built.value)
    assert getattr(model, name) is kept and answer(model) == before  # left as it was


@pytest.mark.parametrize("cls", [LookaheadLLM, ChatLookahead])
def test_langchain_settings_assigned_or_bound_still_work(cls, models):
    from langchain_core.caches import InMemoryCache

    class Starts(BaseCallbackHandler):
        def __init__(self) -> None:
            self.starts = 0

        def on_llm_start(self, *args, **kwargs) -> None:
            self.starts += 1

        on_chat_model_start = on_llm_start

    first, _ = models
    model = build(cls, first)
    plain = answer(model)
    handler = Starts()
    model.callbacks = [handler]
    model.verbose = True
    model.tags = ["mine"]
    model.cache = InMemoryCache()
    assert answer(model) == plain and handler.starts == 1
    assert model.tags == ["mine"] and model.verbose is True
    model.callbacks = None
    assert answer(model.with_config(run_name="bound")) == plain
    assert answer(model.bind(**{LENGTH[cls]: 2})) == " ".join(plain.split()[:2])
    model.cache = None
    words = plain.split()
    model.stop = [words[2]]
    assert answer(model) == answer(build(cls, first, stop=[words[2]])) == " ".join(words[:2]) + " "


def test_an_assigned_name_prompt_or_timeout_is_taken_as_the_constructor_takes_it():
    first, second = build_tiny_model("qwen2", seed=0), build_tiny_model("qwen2", seed=9)
    first.config._name_or_path, second.config._name_or_path = "org/first", "org/second"
    chat = build(ChatLookahead, first)
    assert chat.model_name == "first"
    chat.model = second
    assert chat.model_name == "second"  # a name worked out from the old model goes with it
    chat.model_name = "mine"
    chat.model = first
    assert chat.model_name == "mine"
    chat.timeout = 30.0
    assert chat.invoke(PROMPT).response_metadata["finish_reason"] != "timeout"
    llm = build(LookaheadLLM, first)
    llm.system_prompt = "t9"
    assert answer(llm) == answer(build(LookaheadLLM, first, system_prompt="t9"))
