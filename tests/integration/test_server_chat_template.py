"""How the server makes chat prompts, against the real server on the tiny fp32 Qwen2 and the tiny
word-level tokenizer (templates set per test): what ``apply_chat_template`` would be given reaches
the template (a message's ``name``), what the template refuses or leaves out answers 400 (on
``/v1/rag`` too), and a tokenizer without a template is refused where a conversation needs one.
"""

from __future__ import annotations

import pytest
from tiny_models import reference_generate, tiny_model
from tiny_tokenizer import tiny_tokenizer

httpx = pytest.importorskip("httpx")

from test_server import LOOKAHEAD, serving  # noqa: E402
from test_server_faults import tiny_index  # noqa: E402, F401 (a real two-passage index, the fixture)

from rag_lookahead.serve import Engine, ServerConfig  # noqa: E402

#: a template that refuses a conversation not opened by a system message (as some models' do)
SYSTEM_FIRST = (
    "{% if messages[0]['role'] != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}"
    "{% for m in messages %}t2 {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}t2 assistant {% endif %}"
)
#: a template that shows who speaks: "t7 NAME" before a named message's text
NAMES = (
    "{% for m in messages %}t2 {{ m['role'] }} {% if m.name %}t7 {{ m.name }} {% endif %}{{ m['content'] }} <eos> "
    "{% endfor %}{% if add_generation_prompt %}t2 assistant {% endif %}"
)
#: Phi-3-mini's shape: system, user and assistant turns only; any other message vanishes
NO_TOOL_ROLE = (
    "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
    "t2 {{ m['role'] }} {{ m['content'] }} <eos> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}t2 assistant {% endif %}"
)
QUESTION = "How tall is Etna?"


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """``apply_chat_template``'s prompt ids, as a client would make them."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def engine_with(template: str | None, index=None) -> Engine:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    config = ServerConfig(max_tokens_limit=32, default_max_tokens=4, lookahead_config=LOOKAHEAD)
    return Engine(tiny_model("qwen2"), tokenizer, config, index=index)


def test_rag_answers_400_when_the_template_refuses_its_prompt(tiny_index):
    """/v1/rag encoded its prompt with no guard: a template's raise_exception was a 500 with the
    whole traceback in the log, where /v1/chat/completions answers the template's own message."""
    with serving(engine_with(SYSTEM_FIRST, tiny_index)) as base, httpx.Client(base_url=base, timeout=120) as http:
        for stream in (False, True):
            r = http.post("/v1/rag", json={"question": QUESTION, "max_tokens": 4, "stream": stream})
            assert r.status_code == 400, (stream, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"] == "the chat template rejected the prompt built from the question: " + (
                "first message must be system"
            )
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "t5"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert (
            chat.json()["error"]["message"] == "the chat template rejected these messages: first message must be system"
        )


def test_a_messages_name_reaches_the_template_for_every_role():
    """``name`` was passed on for tool results only: the prompt lost it where apply_chat_template
    (and vLLM) give it to the template, and the answer differed from model.generate's."""
    engine = engine_with(NAMES)
    tokenizer, model = engine.tokenizer, engine.model
    sent = [
        {"role": "developer", "content": "t40", "name": "t11"},
        {"role": "user", "content": "t5 t6", "name": "t9"},
        {"role": "assistant", "content": "t8", "name": "t12"},
        {"role": "user", "content": "t13", "name": "t9"},
    ]
    as_system = [{**sent[0], "role": "system"}, *sent[1:]]  # developer: OpenAI's newer name for system
    ids = template_ids(tokenizer, as_system)
    assert len(ids) > len(template_ids(tokenizer, [{k: m[k] for k in ("role", "content")} for m in as_system]))
    expected = tokenizer.decode(reference_generate(model, ids, 6, eos=3), skip_special_tokens=True)
    with serving(engine) as base:
        reply = httpx.post(base + "/v1/chat/completions", json={"messages": sent, "max_tokens": 6}, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(ids)
    assert reply.json()["choices"][0]["message"]["content"] == expected
    # the LangChain chat model builds the same prompt (it too kept names for tool results only)
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from rag_lookahead.langchain.chat_model import ChatLookahead

    chat = ChatLookahead(model=model, tokenizer=tokenizer, max_tokens=6)
    messages = [
        SystemMessage("t40", name="t11"),
        HumanMessage("t5 t6", name="t9"),
        AIMessage("t8", name="t12"),
        HumanMessage("t13", name="t9"),
    ]
    assert chat.get_num_tokens_from_messages(messages) == len(ids)
    assert chat.invoke(messages).content == expected


def test_a_tool_message_the_template_leaves_out_is_refused():
    """A template that renders no tool role (Phi-3's) dropped a tool result without a word: the
    answer was the one given without it. The check for messages left out now covers tool messages;
    a template that renders them takes them."""
    history = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}]
    tool = {"role": "tool", "content": "t40 t41 t42", "tool_call_id": "call0"}
    body = {"messages": [*history, tool], "max_tokens": 2}
    with serving(engine_with(NO_TOOL_ROLE)) as base:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert r.json()["error"]["message"].startswith("the chat template left out a message of role 'tool'")
    renders_tools = engine_with(tiny_tokenizer().chat_template)
    with serving(renders_tools) as base:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def test_without_a_chat_template_chat_is_refused_and_rag_prompts_are_the_text(tiny_index):
    """/v1/chat/completions joined the contents without roles (a 200 that answered something else),
    where apply_chat_template raises and vLLM answers 400. /v1/rag, ask and LookaheadLLM send one
    user message (LookaheadLLM's system prompt before it): without a template, the text is the
    prompt, as the README says."""
    from rag_lookahead.langchain.llm import LookaheadLLM
    from rag_lookahead.rag.chains import make_prompt

    engine = engine_with(None, tiny_index)
    conversation = [{"role": "system", "content": "t40"}, {"role": "user", "content": "t5"}]
    with serving(engine) as base, httpx.Client(base_url=base, timeout=120) as http:
        for extra in ({}, {"stream": True}):
            r = http.post("/v1/chat/completions", json={"messages": conversation, "max_tokens": 2, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "has no chat template" in r.json()["error"]["message"]
        rag = http.post("/v1/rag", json={"question": QUESTION, "k": 1, "max_tokens": 4})
    assert rag.status_code == 200, rag.text
    shown = engine.retrieve(QUESTION, engine.config.k_seed)[:1]
    text = make_prompt(QUESTION, shown)
    assert rag.json()["stats"]["usage"]["prompt_tokens"] == len(engine.tokenizer(text)["input_ids"])
    llm = LookaheadLLM(model=engine.model, tokenizer=engine.tokenizer, system_prompt="t40")  # ask's model, with one
    assert llm.check_prompt("t5 t6") == len(engine.tokenizer("t40\n\nt5 t6")["input_ids"]) == 3


def test_the_chat_model_refuses_a_tokenizer_without_a_chat_template():
    """ChatLookahead joined a conversation's contents without roles and answered that, as the
    server's chat route did."""
    from langchain_core.messages import HumanMessage, SystemMessage

    from rag_lookahead.errors import ConfigError
    from rag_lookahead.langchain.chat_model import ChatLookahead

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    chat = ChatLookahead(model=tiny_model("qwen2"), tokenizer=tokenizer, max_tokens=2)
    for call in (chat.invoke, chat.get_num_tokens_from_messages):  # counted as a call would encode them
        with pytest.raises(ConfigError, match="no chat template"):
            call([SystemMessage("t40"), HumanMessage("t5")])


def test_an_assistant_refusal_reaches_the_prompt_and_other_message_fields_are_refused():
    """OpenAI writes a refused turn as ``{"role": "assistant", "content": null, "refusal": "..."}``:
    the refusal was dropped unseen (an empty turn in the prompt, another answer); a message's
    ``function_call`` or ``audio`` was dropped the same way."""
    engine = engine_with(NAMES)
    tokenizer, model = engine.tokenizer, engine.model
    refused = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": None, "refusal": "t8 t9"}]
    as_text = [refused[0], {"role": "assistant", "content": "t8 t9"}, {"role": "user", "content": "t13"}]
    ids = template_ids(tokenizer, as_text)
    expected = tokenizer.decode(reference_generate(model, ids, 4, eos=3), skip_special_tokens=True)
    with serving(engine) as base, httpx.Client(base_url=base, timeout=120) as http:
        reply = http.post("/v1/chat/completions", json={"messages": [*refused, as_text[2]], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(ids)
        assert reply.json()["choices"][0]["message"]["content"] == expected
        for message, said in (
            ({"role": "user", "content": "t5", "refusal": "t8"}, "only assistant messages carry 'refusal'"),
            ({"role": "assistant", "content": "t5", "refusal": "t8"}, "'content' or 'refusal', not both"),
            (
                {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                "give 'tool_calls'",
            ),
            ({"role": "assistant", "content": "t5", "audio": {"id": "a1"}}, "'audio' is not supported"),
        ):
            r = http.post("/v1/chat/completions", json={"messages": [refused[0], message, as_text[2]], "max_tokens": 2})
            assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
