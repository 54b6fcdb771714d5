"""ChatLookahead and the LCEL chat RAG chain, on the real default model (fp32, small max_tokens).

The pure parts (tool-call parsing, forced openings, message conversion, the text tracker) run
without the model; everything else decodes with the real weights.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from hang_guard import finished
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool
from pydantic import BaseModel

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.langchain.chat_model import ChatLookahead
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.langchain.messages import call_chunks, message_calls, template_messages
from rag_lookahead.langchain.tools import ToolOptions, check_tools, forced_opening, parse_tool_calls, split_calls
from rag_lookahead.tokens import TextTracker

FIXED = LookaheadConfig(budget="fixed", decoding_length=16)
PASSAGE = (
    "decoding_length 是一次前向计算中最多验证的草稿词元总数，默认值为 64。"
    '在 CPU 上改用 budget="fixed" 时，建议把 decoding_length 设在 8 到 16 左右。'
)
QUOTE = f"资料：{PASSAGE}\n问题：在 CPU 上 decoding_length 建议设为多少？请引用原文回答。"
COUNT = "Write the numbers from 1 to 10 separated by spaces."
HELLO = "Say hello in one short sentence."


@tool
def magic_function(input: int) -> int:
    """Apply a magic function to an input."""
    return input + 2


@tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


class Collect(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


# ---------------------------------------------------------------- without the model


def test_parse_tool_calls_splits_text_and_calls():
    text = (
        'Let me look.<tool_call>\n{"name": "magic_function", "arguments": {"input": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"北京\\"}"}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me look.\n"
    assert [(c.name, c.args, c.error) for c in calls] == [
        ("magic_function", {"input": 3}, None),
        ("get_weather", {"city": "北京"}, None),
    ]
    assert calls[0].id != calls[1].id
    cut = parse_tool_calls('<tool_call>\n{"name": "magic_function", "arguments": {"inp')[1]  # max_tokens hit
    assert cut[0].name == "magic_function" and cut[0].args is None and "not valid JSON" in cut[0].error
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    unclosed = parse_tool_calls('<tool_call>\n{"name": "now", "arguments": {}}\nThat is the call.')[1]
    assert (unclosed[0].name, unclosed[0].args) == ("now", {})  # text after the JSON is not part of it
    assert parse_tool_calls('<tool_call>["a"]</tool_call>')[1][0].error.startswith("a tool call needs")


def test_a_calls_arguments_may_be_named_parameters_or_be_an_empty_string():
    """Some models write a call's arguments under "parameters" (Llama 3.1's JSON calls), or write
    an argument-less call's as an empty string: each is a valid call, not an invalid one."""
    [call] = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')[1]
    assert (call.name, call.args, call.error) == ("f", {"x": 1}, None)
    for empty in ('""', '" "'):
        [call] = parse_tool_calls(f'<tool_call>{{"name": "now", "arguments": {empty}}}</tool_call>')[1]
        assert (call.name, call.args, call.error) == ("now", {}, None)


# the default model's greedy answer to WEATHER_AND_TIME with both tools bound ("any"): two calls, one block
TWO_IN_ONE_BLOCK = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
    '{"name": "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call>'
)


def test_several_calls_in_one_block_are_one_call_each():
    """Qwen2.5 writes parallel calls as objects one after another in one block: only the first came
    back (the second dropped unseen), and a second cut by max_tokens left the first looking whole."""
    both = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Tokyo"})]
    for text in (
        TWO_IN_ONE_BLOCK,
        TWO_IN_ONE_BLOCK.replace("},\n{", "}\n{"),
        TWO_IN_ONE_BLOCK[: -len("\n</tool_call>")],
    ):
        content, calls = parse_tool_calls(text)
        assert content == "" and [(c.name, c.args) for c in calls] == both, text
        assert calls[0].id != calls[1].id
    cut = parse_tool_calls(TWO_IN_ONE_BLOCK[: TWO_IN_ONE_BLOCK.index("Tokyo")])[1]  # max_tokens hit in the second
    assert [(c.name, c.args is None) for c in cut] == [("get_weather", False), ("get_time", True)]
    assert "not valid JSON" in cut[1].error and cut[1].raw == '{"name": "get_time", "arguments": {"city": "'
    dangling = parse_tool_calls(TWO_IN_ONE_BLOCK[: TWO_IN_ONE_BLOCK.index('{"name": "get_time"')])[
        1
    ]  # cut after the comma
    assert [(c.name, c.args is None) for c in dangling] == [("get_weather", False), (None, True)]
    closed = parse_tool_calls('<tool_call>\n{"name": "now", "arguments": {}},\n</tool_call>')[1]
    assert [(c.name, c.args) for c in closed] == [("now", {})]  # closed after a comma: nothing was cut


def test_a_block_left_open_ends_where_the_next_opens():
    """A block whose </tool_call> the model left out ran to the end of the answer, so the call in
    the block after it was read as the first block's trailing text and dropped unseen."""
    first_open = TWO_IN_ONE_BLOCK.replace("},\n{", "}\n<tool_call>\n{")
    assert [(c.name, c.args) for c in parse_tool_calls(first_open)[1]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"city": "Tokyo"}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
        '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',
        '<tool_call>\n{"city": "Paris"}\n</tool_call>',  # no name
        '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}',
        TWO_IN_ONE_BLOCK[: TWO_IN_ONE_BLOCK.index("Tokyo")],
    ],
)
def test_streamed_tool_calls_are_the_whole_answers(text):
    """Streamed, LangChain parsed each chunk's args again (completing cut JSON), so a call that
    invoke reported invalid came back valid, with the wrong args, for an agent to run."""
    _, calls = split_calls(text, ToolOptions(("get_weather", "get_time", "now")))
    whole = AIMessage("", **message_calls(calls))
    streamed = AIMessageChunk(content="") + AIMessageChunk(content="", tool_call_chunks=call_chunks(calls))
    assert whole.invalid_tool_calls  # each case holds a call that is not valid
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    # as the README says: streamed, an invalid call's args are its text as a JSON string, and no error
    # (LangChain rebuilds invalid calls from the chunks, with error=None)
    assert [(c["name"], json.loads(c["args"])) for c in streamed.invalid_tool_calls] == [
        (c["name"], c["args"]) for c in whole.invalid_tool_calls
    ]
    assert all(c["error"] for c in whole.invalid_tool_calls)
    assert all(c["error"] is None for c in streamed.invalid_tool_calls)
    # either way, replayed in a later prompt, each is the text the model wrote
    assert template_messages([whole]) == template_messages([streamed])


def test_a_call_to_a_tool_not_shown_is_text_for_the_server_only():
    from rag_lookahead.serve.tool_calls import ToolSetup

    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
        '{"name": "hello", "arguments": {"message": "Hi"}}\n</tool_call>'
    )
    shown = [{"type": "function", "function": {"name": name, "parameters": {}}} for name in ("get_weather", "now")]
    # the server reads the whole answer as text: its clients dispatch on the name
    assert ToolSetup(tools=shown).reply(text) is None
    assert ToolSetup(tools=shown, parallel=False).reply(text).calls[0]["function"]["name"] == "get_weather"
    # the chat model's reading (LangChain's contract: the tool node answers a made-up name)
    _, calls = split_calls(text, ToolOptions(("get_weather", "now")))
    message = AIMessage("", **message_calls(calls))
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("hello", {"message": "Hi"}),
    ]
    assert not message.invalid_tool_calls
    assert split_calls(text, ToolOptions()) == (text, [])  # no tools shown: all text


def test_a_tool_that_is_no_function_is_refused_on_binding():
    """A provider's built-in tool (``{"type": "web_search_preview"}``, which convert_to_openai_tool
    passes through) was taken on binding, and every call then raised a bare KeyError."""
    with pytest.raises(ConfigError, match="is no function tool"):
        check_tools(None, "m", [{"type": "web_search_preview"}])


def test_a_template_that_takes_tools_but_writes_no_tool_call_blocks_is_refused(tokenizer):
    """A template that shows tools but has the model write its calls some other way (Llama 3.1's
    bare JSON) gives calls no parser here reads back: refused when the tools are bound."""
    from transformers import AutoTokenizer

    from rag_lookahead.models import default_model_dir

    llama_like = AutoTokenizer.from_pretrained(str(default_model_dir()))
    llama_like.chat_template = (
        "{% if tools %}{{ tools | tojson }} Respond with a JSON function call.{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "now", "parameters": {}}}]
    with pytest.raises(ConfigError, match="llama's chat template does not call tools with <tool_call>"):
        check_tools(llama_like, "llama", tools)
    check_tools(tokenizer, "default", tools)  # Qwen's template writes <tool_call> blocks
    check_tools(llama_like, "llama", [])  # no tools bound: nothing to read back


def test_an_ai_messages_refusal_is_its_text():
    """langchain-openai keeps a refused turn's text in ``additional_kwargs["refusal"]`` (content
    empty): it was replayed as an empty assistant turn, as the server once did with OpenAI's field."""
    refused = AIMessage("", additional_kwargs={"refusal": "I can't help with that."})
    turns = template_messages([HumanMessage("hi"), refused, HumanMessage("why?")])
    assert turns[1] == {"role": "assistant", "content": "I can't help with that."}
    assert template_messages([AIMessage("said", additional_kwargs={"refusal": "x"})])[0]["content"] == "said"


def test_forced_opening_per_tool_choice():
    takes_x = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = [
        {"type": "function", "function": {"name": n, "parameters": takes_x}} for n in ("magic_function", "get_weather")
    ]
    assert forced_opening(None, tools) == forced_opening("auto", tools) == forced_opening("none", tools) == ""
    assert forced_opening("any", tools) == '<tool_call>\n{"name": "'
    named = '<tool_call>\n{"name": "get_weather", "arguments":'
    assert forced_opening("get_weather", tools) == named
    assert forced_opening({"type": "function", "function": {"name": "get_weather"}}, tools) == named
    assert forced_opening("required", tools[1:]) == named  # one tool: its name is known
    bare = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    assert forced_opening("any", bare) == '<tool_call>\n{"name": "now", "arguments": {}}'  # the only possible call
    # a free-form object (no properties, but additionalProperties) takes arguments: the model writes them
    free_form = {"type": "object", "additionalProperties": {"type": "string"}}
    labels = [{"type": "function", "function": {"name": "set_labels", "parameters": free_form}}]
    assert forced_opening("any", labels) == '<tool_call>\n{"name": "set_labels", "arguments":'
    with pytest.raises(ConfigError, match="not among the bound tools"):
        forced_opening("nope", tools)
    with pytest.raises(ConfigError, match="tool_choice must be"):
        forced_opening(3, tools)
    # OpenAI's object forms: {"type": "auto"} lets the model choose (it forced a call)
    assert forced_opening({"type": "auto"}, tools) == forced_opening({"type": "none"}, tools) == ""
    assert forced_opening({"type": "required"}, tools) == '<tool_call>\n{"name": "'


def test_tool_choice_objects_mean_their_words_or_are_refused():
    """An object tool_choice the code did not know ({"type": "nonee"}, {}) forced a call, where an
    unknown string is refused; Anthropic's {"type": "any"} with one tool bound did not open the call
    with that tool's name, as "any" does, so the default model called a "hello" it made up."""
    takes_x = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = [
        {"type": "function", "function": {"name": n, "parameters": takes_x}} for n in ("magic_function", "get_weather")
    ]
    named = '<tool_call>\n{"name": "get_weather", "arguments":'
    assert forced_opening({"type": "any"}, tools[1:]) == forced_opening("any", tools[1:]) == named
    assert forced_opening({"type": "required"}, tools[1:]) == named
    assert forced_opening({"type": "any"}, tools) == forced_opening("any", tools) == '<tool_call>\n{"name": "'
    assert forced_opening({"type": "tool", "name": "get_weather"}, tools) == named  # Anthropic's named form
    assert forced_opening({"type": "none"}, tools) == forced_opening({"type": "auto"}, tools) == ""
    for unknown in ({"type": "nonee"}, {"mode": "NONE"}, {}, {"type": "function"}, {"type": "any", "name": "x"}):
        with pytest.raises(ConfigError, match="no tool choice this model knows"):
            forced_opening(unknown, tools)


def test_template_messages_convert_history():
    messages = [
        SystemMessage("a"),
        SystemMessage("b"),
        HumanMessage([{"type": "text", "text": "What is "}, "1 + 2"]),
        AIMessage(
            [{"type": "text", "text": "thinking"}, {"type": "tool_use", "id": "x", "name": "add", "input": {"a": 1}}],
            tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "x", "type": "tool_call"}],
        ),
        ToolMessage(json.dumps({"result": 3}), tool_call_id="x", name="add"),
    ]
    assert template_messages(messages) == [
        {"role": "system", "content": "a\n\nb"},
        {"role": "user", "content": "What is 1 + 2"},
        {
            "role": "assistant",
            "content": "thinking",
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": '{"result": 3}', "tool_call_id": "x", "name": "add"},
    ]
    with pytest.raises(InputError, match="image"):
        template_messages([HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])])
    with pytest.raises(InputError, match="empty"):
        template_messages([HumanMessage("")])
    with pytest.raises(InputError, match="empty"):  # as LookaheadLLM refuses a blank prompt (it was answered)
        template_messages([SystemMessage(" "), HumanMessage("  \n ")])


def test_a_developer_message_is_a_system_message():
    """OpenAI's "developer" role is the system prompt: Qwen's template skips a turn of a role it does
    not know, so the instruction went unseen. It joins the system messages before it, as one."""
    assert template_messages([SystemMessage("a"), ChatMessage(role="developer", content="b"), HumanMessage("q")]) == [
        {"role": "system", "content": "a\n\nb"},
        {"role": "user", "content": "q"},
    ]


def test_a_developer_message_counts_as_a_system_message(noise_chat):
    """Token counts (``trim_messages``) read a developer message as the system message it is."""
    count = noise_chat.get_num_tokens_from_messages
    assert count([ChatMessage(role="developer", content="Answer briefly.")]) == count(
        [SystemMessage("Answer briefly.")]
    )
    joined = [SystemMessage("Be kind.\n\nAnswer briefly."), HumanMessage("hi")]
    assert count(
        [SystemMessage("Be kind."), ChatMessage(role="developer", content="Answer briefly."), HumanMessage("hi")]
    ) == count(joined)


def test_a_history_of_tool_calls_only_is_not_empty():
    """An assistant turn whose only content is its tool calls says something: a history that is
    that turn alone was refused as empty messages."""
    calls = [{"name": "now", "args": {}, "id": "call_1", "type": "tool_call"}]
    [turn] = template_messages([AIMessage("", tool_calls=calls)])
    assert turn["role"] == "assistant" and turn["tool_calls"][0]["function"]["name"] == "now"
    with pytest.raises(InputError, match="empty"):
        template_messages([AIMessage("")])


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rag_lookahead.models import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def test_tracker_holds_tool_calls_and_keeps_stops_out_of_the_prefix(tokenizer):
    ids = tokenizer.encode('Sure. <tool_call>\n{"name": "f"}\n</tool_call>', add_special_tokens=False)
    tracker = TextTracker(tokenizer, None, frozenset(), hold=["<tool_call>"])
    pieces = [tracker.add([t]) for t in ids]
    # nothing from the marker on, nor the whitespace before it (the rest of the content comes at the end)
    assert "".join(pieces) == "Sure."
    assert tracker.final_text().endswith("</tool_call>")
    # a stop string inside the forced opening does not cut it; one in the answer does
    prefix = '<tool_call>\n{"name": "'
    tracker = TextTracker(tokenizer, ["\n"], frozenset(), prefix=prefix)
    tracker.add(tokenizer.encode('f", "arguments": {}}\n</tool_call>', add_special_tokens=False))
    assert tracker.stopped and tracker.final_text() == prefix + 'f", "arguments": {}}'


# ---------------------------------------------------------------- with the model

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def weights(default_model_fp32):
    return default_model_fp32


@pytest.fixture(scope="module")
def chat(weights):
    model, tok = weights
    return ChatLookahead(model=model, tokenizer=tok, max_tokens=24, lookahead=FIXED)


@pytest.fixture(scope="module")
def singles(chat):
    return {p: chat.invoke(p) for p in (HELLO, QUOTE, COUNT)}


@slow
def test_shares_engine_with_lookahead_llm_and_answers_alike(weights, chat, singles):
    model, tok = weights
    llm = LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=24, lookahead=FIXED)
    from_llm = ChatLookahead.from_llm(llm)
    assert from_llm.get_engine() is llm.engine and from_llm.output_pool is llm.output_pool
    assert from_llm.max_tokens == 24 and from_llm.lookahead == llm.lookahead
    assert ChatLookahead(model=model, tokenizer=tok).get_engine() is chat.get_engine()  # one engine per model
    assert llm.invoke(QUOTE) == singles[QUOTE].content  # same template, same engine code, same text
    assert from_llm.invoke(QUOTE).content == singles[QUOTE].content
    prompted = LookaheadLLM(model=model, tokenizer=tok, system_prompt="Always answer in French.")
    with pytest.raises(ConfigError, match="system_prompt"):  # it was dropped without a word
        ChatLookahead.from_llm(prompted)
    from rag_lookahead.rag.chains import build_rag_chain

    with pytest.raises(ConfigError, match="build_chat_rag_chain"):  # it failed inside LangChain
        build_rag_chain(chat, None)


@slow
def test_batch_is_one_decode_with_the_same_answers(chat, singles):
    prompts = [HELLO, QUOTE, COUNT]
    answers = chat.batch(prompts)
    assert [a.content for a in answers] == [singles[p].content for p in prompts]
    assert [a.response_metadata["batch_size"] for a in answers] == [3, 3, 3]
    assert [a.usage_metadata for a in answers] == [singles[p].usage_metadata for p in prompts]
    waves = chat.batch(prompts, config={"max_concurrency": 2})
    assert [a.response_metadata["batch_size"] for a in waves] == [2, 2, 1]
    mixed = chat.batch([HELLO, "", COUNT], return_exceptions=True)
    assert isinstance(mixed[1], InputError)
    assert [mixed[0].response_metadata["batch_size"], mixed[2].response_metadata["batch_size"]] == [2, 2]
    assert mixed[2].content == singles[COUNT].content
    # an input past the context window fails alone too (it failed every row of its batch)
    long = chat.batch([HELLO, "hello " * 33_000, COUNT], return_exceptions=True)
    assert isinstance(long[1], InputError) and "context holds" in str(long[1])
    assert [long[0].content, long[2].content] == [singles[HELLO].content, singles[COUNT].content]
    async_answers = asyncio.run(chat.abatch(prompts))
    assert [a.content for a in async_answers] == [singles[p].content for p in prompts]
    assert async_answers[0].response_metadata["batch_size"] == 3


@slow
def test_stream_yields_accepted_blocks_then_usage(chat, singles):
    whole = singles[QUOTE]
    chunks = list(chat.stream(QUOTE))
    assert "".join(c.content for c in chunks) == whole.content
    assert len(chunks) > 2 and all("\ufffd" not in c.content for c in chunks)
    assert chunks[-1].chunk_position == "last"
    assert all(c.usage_metadata is None for c in chunks[:-1])
    assert chunks[-1].usage_metadata == whole.usage_metadata
    meta = chunks[-1].response_metadata
    assert meta["finish_reason"] == whole.response_metadata["finish_reason"]
    assert meta["new_tokens"] == whole.usage_metadata["output_tokens"] and meta["forward_passes"] >= 1

    async def collect():
        return [c async for c in chat.astream(QUOTE)]

    assert "".join(c.content for c in asyncio.run(collect())) == whole.content


@slow
def test_callbacks_see_each_block(chat, singles):
    for run in (chat.invoke, lambda p, config: list(chat.stream(p, config=config))):
        handler = Collect()
        run(COUNT, config={"callbacks": [handler]})
        pieces = [t for t in handler.tokens if t]
        assert len(pieces) > 1 and "".join(pieces) == singles[COUNT].content


@slow
def test_usage_and_stats(chat, singles, weights):
    answer = singles[HELLO]
    usage = answer.usage_metadata
    tok = weights[1]
    prompt = tok.apply_chat_template([{"role": "user", "content": HELLO}], tokenize=False, add_generation_prompt=True)
    assert usage["input_tokens"] == len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    meta = answer.response_metadata
    assert meta["model_name"] == chat.model_name and meta["finish_reason"] in ("stop", "length")
    for key in ("new_tokens", "forward_passes", "mean_accepted", "tokens_per_second", "batch_size", "lookahead"):
        assert key in meta


@slow
def test_stop_strings(chat, singles):
    text = singles[COUNT].content
    assert " 5" in text
    cut = text[: text.index(" 5")]
    answer = chat.invoke(COUNT, stop=[" 5"])
    assert answer.content == cut and answer.response_metadata["finish_reason"] == "stop"
    assert "".join(c.content for c in chat.stream(COUNT, stop=[" 5", "never"])) == cut
    stopping = ChatLookahead(
        model=chat.get_engine().model,
        tokenizer=chat.get_engine().tokenizer,
        max_tokens=24,
        lookahead=FIXED,
        stop=[" 5"],
    )
    assert stopping.invoke(COUNT).content == cut


@slow
def test_tools_through_the_template_and_back_as_tool_calls(chat, singles):
    question = "What is the value of magic_function(3)? Use the tool."
    forced = chat.bind_tools([magic_function, get_weather], tool_choice="magic_function")
    answer = forced.invoke(question)
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "magic_function"
    assert answer.tool_calls[0]["args"] == {"input": 3}
    assert answer.response_metadata["finish_reason"] == "tool_calls"
    plain = chat.invoke(question)
    assert answer.usage_metadata["input_tokens"] > plain.usage_metadata["input_tokens"] + 40  # the tools' schemas
    streamed = None
    for chunk in forced.stream(question):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("magic_function", {"input": 3})]
    assert streamed.content == answer.content
    none = chat.bind_tools([magic_function], tool_choice="none").invoke(question)
    assert none.usage_metadata == plain.usage_metadata and none.content == plain.content
    # a tool result in the history reaches the model through the template's <tool_response>
    history = [
        HumanMessage(question),
        AIMessage("", tool_calls=[{"name": "magic_function", "args": {"input": 3}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("5", tool_call_id="c1", name="magic_function"),
    ]
    request = chat._prepare(history, None, {"tools": [magic_function]})[0]
    assert "<tool_response>\n5\n</tool_response>" in chat.get_engine().tokenizer.decode(request.ids)
    assert chat.bind_tools([magic_function]).invoke(history).content


@slow
def test_every_message_reaches_the_prompt_and_token_counts_match_usage(chat):
    """Measured bugs: a ChatMessage of role "developer" or "human" was left out of the prompt without
    a word (Qwen's template skips roles it does not know); tool_choice={"type": "none"} still showed
    the tools; get_num_tokens_from_messages counted "Human: ..." lines, not the template, so a
    history trim_messages fitted to a budget by it overflowed the budget."""
    from langchain_core.messages import ChatMessage, trim_messages

    def prompt_tokens(model, messages) -> int:
        return model.invoke(messages, max_tokens=1).usage_metadata["input_tokens"]

    question = [HumanMessage(HELLO)]
    as_user = chat.get_num_tokens_from_messages(question)
    assert as_user == prompt_tokens(chat, question)
    assert chat.get_num_tokens_from_messages([ChatMessage(role="human", content=HELLO)]) == as_user
    told = chat.get_num_tokens_from_messages([SystemMessage("Answer briefly."), *question])
    assert told != as_user  # Qwen's template puts in a system prompt of its own where none is given
    assert prompt_tokens(chat, [ChatMessage(role="developer", content="Answer briefly."), *question]) == told
    with pytest.raises(InputError, match="left out a message of role 'critic'"):
        chat.invoke([ChatMessage(role="critic", content="Too long."), *question])
    with_tools = prompt_tokens(chat.bind_tools([magic_function]), question)
    assert chat.get_num_tokens_from_messages(question, tools=[magic_function]) == with_tools > as_user
    assert prompt_tokens(chat.bind_tools([magic_function], tool_choice={"type": "none"}), question) == as_user
    history = [m for i in range(40) for m in (HumanMessage(f"question {i}?"), AIMessage(f"answer {i}."))]
    trimmed = trim_messages(history + question, max_tokens=200, token_counter=chat, strategy="last", start_on="human")
    assert 1 < len(trimmed) < len(history) and prompt_tokens(chat, trimmed) <= 200


@slow
def test_sampling_is_seeded_and_lossless(chat):
    first = chat.invoke(QUOTE, temperature=0.8, top_p=0.9, seed=7)
    assert chat.invoke(QUOTE, temperature=0.8, top_p=0.9, seed=7).content == first.content
    assert chat.invoke(QUOTE, temperature=0.8, top_p=0.9, seed=7, enable_lookahead=False).content == first.content
    hot = ChatLookahead(
        model=chat.get_engine().model,
        tokenizer=chat.get_engine().tokenizer,
        max_tokens=24,
        lookahead=FIXED,
        temperature=0.8,
        top_p=0.9,
        seed=7,
    )
    assert hot.invoke(QUOTE).content == first.content
    assert hot.batch([QUOTE, HELLO])[0].content == first.content  # each row draws from its own generator


@slow
def test_lookahead_off_and_references_leave_the_text(chat, singles):
    assert chat.invoke(QUOTE, enable_lookahead=False).content == singles[QUOTE].content
    assert chat.invoke(COUNT, references=["1 2 3 4 5 6 7 8 9 10"]).content == singles[COUNT].content


@slow
def test_timeout_ends_the_decode(chat):
    answer = chat.invoke(COUNT, timeout=1e-6)
    assert answer.response_metadata["finish_reason"] == "timeout"
    assert answer.usage_metadata["output_tokens"] == 1  # the prefill's token, then the deadline


@slow
def test_timeout_counts_from_when_the_decode_starts(chat):
    """A call waiting for another call's decode spent its timeout waiting, then answered one token
    marked "timeout" (which LangChain's cache could keep)."""
    import threading
    import time

    decoding = threading.Event()

    class Slow(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs) -> None:
            decoding.set()
            time.sleep(0.25)

    # one token a block (lookahead off: a warm pool made few, long blocks), so >= 24 x 0.25 s held
    slow = {"max_tokens": 24, "enable_lookahead": False, "config": {"callbacks": [Slow()]}}
    busy = threading.Thread(target=lambda: chat.invoke(COUNT, **slow))
    busy.start()
    assert decoding.wait(120)  # the other call holds the engine for 24 blocks of >= 0.25 s
    start = time.monotonic()
    answer = chat.invoke(HELLO, max_tokens=3, timeout=4.0)
    waited = time.monotonic() - start
    busy.join()
    assert waited > 4.0, waited  # it did wait past its timeout for the engine...
    assert answer.response_metadata["finish_reason"] != "timeout"  # ...and then had its 4 s to decode
    assert answer.usage_metadata["output_tokens"] == 3


@slow
def test_a_cut_tool_call_stays_invalid_when_streamed(chat):
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    whole = bound.invoke("What is the weather in Paris?", max_tokens=3)
    streamed = None
    for chunk in bound.stream("What is the weather in Paris?", max_tokens=3):
        streamed = chunk if streamed is None else streamed + chunk
    assert not whole.tool_calls and [c["name"] for c in whole.invalid_tool_calls] == ["get_weather"]
    assert not streamed.tool_calls and [c["name"] for c in streamed.invalid_tool_calls] == ["get_weather"]


@slow
def test_a_cut_tool_call_is_replayed_as_the_model_wrote_it(chat):
    """An answer holding only a call cut by max_tokens (content "", one invalid call) was replayed
    in a later prompt as an empty assistant turn: the model did not see what it had written."""
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    question = "What is the weather in Paris?"
    whole = bound.invoke(question, max_tokens=3)
    streamed = None
    for chunk in bound.stream(question, max_tokens=3):
        streamed = chunk if streamed is None else streamed + chunk
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city":\n</tool_call>'
    for answer in (whole, streamed):
        assert answer.content == "" and not answer.tool_calls, answer
        history = [HumanMessage(question), answer, HumanMessage("Your call was cut; write it again.")]
        assert template_messages(history)[1] == {"role": "assistant", "content": written}
    request = chat._prepare(history, None, {"tools": [get_weather]})[0]
    assert "<|im_start|>assistant\n" + written + "<|im_end|>" in chat.get_engine().tokenizer.decode(request.ids)


@slow
def test_a_call_to_a_tool_not_bound_comes_back_as_a_call(chat):
    """Made to call one of two tools ("required"), the default model calls a "hello" it made up.
    The chat model returns it in ``tool_calls``, as LangChain's chat models do: LangGraph's tool
    node answers a made-up name with an error naming the real tools, and the agent tries again
    (as an invalid call, the agent's run ended with an empty answer). The server refuses it."""
    bound = chat.bind_tools([get_weather, get_time], tool_choice="required")
    whole = bound.invoke("Say hello to me.")
    streamed = None
    for chunk in bound.stream("Say hello to me."):
        streamed = chunk if streamed is None else streamed + chunk
    for answer in (whole, streamed):
        assert [c["name"] for c in answer.tool_calls] == ["hello"] and not answer.invalid_tool_calls, answer
        assert answer.response_metadata["finish_reason"] == "tool_calls"


@slow
def test_an_unknown_tool_choice_object_is_refused(chat):
    """bind_tools(..., tool_choice={"type": "nonee"}) answered with a forced call (see
    test_tool_choice_objects_mean_their_words_or_are_refused); it is refused on binding, and per call."""
    for unknown in ({"type": "nonee"}, {"mode": "NONE"}, {}):
        with pytest.raises(ConfigError, match="no tool choice this model knows"):
            chat.bind_tools([get_weather], tool_choice=unknown)
    with pytest.raises(ConfigError, match="no tool choice this model knows"):
        chat.bind_tools([get_weather]).invoke(HELLO, tool_choice={"type": "nonee"})


@tool
def get_time(city: str) -> str:
    """Get the current time in a city."""
    return "12:00"


WEATHER_AND_TIME = "What's the weather in Paris and what time is it in Tokyo?"


@slow
def test_two_calls_in_one_block_come_back_as_two_and_a_cut_one_says_length(chat):
    """The default model writes both calls in one <tool_call> block: invoke and stream gave the
    first only; cut by max_tokens inside the second, finish_reason was "tool_calls"."""
    bound = chat.bind_tools([get_weather, get_time], tool_choice="any")
    both = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Tokyo"})]
    whole = bound.invoke(WEATHER_AND_TIME, max_tokens=40)
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == both, whole
    assert whole.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for chunk in bound.stream(WEATHER_AND_TIME, max_tokens=40):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == both
    assert streamed.response_metadata["finish_reason"] == "tool_calls"
    cut = bound.invoke(WEATHER_AND_TIME, max_tokens=20)  # the forced opening is not counted
    assert [c["name"] for c in cut.tool_calls] == ["get_weather"], cut
    assert [c["name"] for c in cut.invalid_tool_calls] == ["get_time"]
    assert cut.response_metadata["finish_reason"] == "length"


@slow
def test_a_named_tool_choice_gives_that_call_only(chat):
    """Forced to call get_weather, the default model goes on to call get_time in the same block:
    that call came back beside the chosen one (a named choice is one call, as OpenAI reads it), and
    cut by max_tokens it turned the forced call invalid-beside-"length"."""
    bound = chat.bind_tools([get_weather, get_time], tool_choice="get_weather")
    for max_tokens in (40, 20):
        answer = bound.invoke(WEATHER_AND_TIME, max_tokens=max_tokens)
        assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("get_weather", {"city": "Paris"})], answer
        assert not answer.invalid_tool_calls and answer.response_metadata["finish_reason"] == "tool_calls"


@slow
def test_the_models_refuse_pickling_before_writing_the_weights(chat, weights):
    """pickle wrote the whole model (1.27 GB) before failing on a lock, with no word of why."""
    import copy
    import io
    import pickle

    model, tok = weights
    llm = LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=4, lookahead=FIXED)
    for obj in (chat, llm):
        sink = io.BytesIO()
        with pytest.raises(TypeError, match="does not pickle or deep-copy: it holds a loaded model"):
            pickle.dump(obj, sink)
        assert sink.tell() < 1024  # refused before any weight was written
        with pytest.raises(TypeError, match="does not pickle"):
            copy.deepcopy(obj)
        with pytest.raises(TypeError, match="does not pickle"):
            obj.model_copy(deep=True)
        shallow = obj.model_copy(update={"lookahead": LookaheadConfig(budget="fixed", decoding_length=8)})
        assert shallow.model is obj.model  # a shallow copy with other settings still works
    assert copy.copy(chat).invoke(HELLO).content == chat.invoke(HELLO).content


@slow
def test_a_second_chat_models_pool_settings_are_said_unused(chat, weights, caplog):
    """Chat models on one loaded model share its engine and output pool; a later one's pool size
    was dropped in silence."""
    import logging

    model, tok = weights
    with caplog.at_level(logging.WARNING, logger="rag_lookahead.langchain.shared_weights"):
        same = ChatLookahead(model=model, tokenizer=tok, lookahead=FIXED)
        assert not caplog.records  # the same pool settings: nothing to say
        other = ChatLookahead(model=model, tokenizer=tok, lookahead=LookaheadConfig(output_pool_nodes=123))
    assert other._engine is chat._engine is same._engine
    assert "size no pool" in caplog.text and "123" in caplog.text
    assert chat._engine.output_pool.max_nodes == LookaheadConfig().output_pool_nodes


def test_a_loaded_model_is_freed_with_the_last_chat_model_on_it():
    """Chat models on one loaded model share its engine while one lives; once none does, the
    model and its engine go (the shared table held every model it was ever given)."""
    import gc
    import weakref

    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.langchain import shared_weights
    from rag_lookahead.tiny import build_tiny_model

    model, tok = build_tiny_model("qwen2", seed=5), tiny_tokenizer()
    first = ChatLookahead(model=model, tokenizer=tok, max_tokens=3, lookahead=FIXED)
    second = ChatLookahead(model=model, tokenizer=tok, max_tokens=3, lookahead=FIXED)
    assert first._engine is second._engine and first.invoke("t5 t6").content == second.invoke("t5 t6").content
    pool = first.output_pool
    assert pool.nodes > 0
    del first, second
    gc.collect()
    later = ChatLookahead(model=model, tokenizer=tok, max_tokens=3, lookahead=FIXED)
    assert later.output_pool is pool  # one made later (one a request, say) drafts from earlier answers
    gone = weakref.ref(model)
    del later, model, pool
    gc.collect()
    assert gone() is None and all(engine.model is not None for engine in shared_weights._ENGINES.values())


def test_from_llm_carries_the_llms_stop_strings():
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead import LookaheadLLM
    from rag_lookahead.tiny import build_tiny_model

    llm = LookaheadLLM(model=build_tiny_model("qwen2", seed=6), tokenizer=tiny_tokenizer(), stop=["t16"])
    assert ChatLookahead.from_llm(llm).stop == ["t16"]
    assert ChatLookahead.from_llm(llm, stop=["t9"]).stop == ["t9"]


@slow
def test_bad_settings_are_refused(chat, weights):
    model, tok = weights
    with pytest.raises(ConfigError, match="unknown option"):
        chat.invoke(HELLO, temprature=0.5)
    with pytest.raises(ConfigError, match="no tools are bound"):
        chat.invoke(HELLO, tool_choice="any")
    with pytest.raises(ConfigError, match="top_p"):
        ChatLookahead(model=model, tokenizer=tok, temperature=0.7, top_p=1.7)
    with pytest.raises(ConfigError, match="max_tokens"):
        ChatLookahead(model=model, tokenizer=tok, max_tokens=0)
    with pytest.raises(ConfigError, match="max_tokens"):
        chat.invoke(HELLO, max_tokens=0)  # per call as at construction (0 was read as "not given")
    with pytest.raises(ConfigError, match="timeout"):
        chat.invoke(HELLO, timeout=0)
    with pytest.raises(ConfigError, match="stop must be a list of strings"):
        chat.invoke(HELLO, stop="three")  # was split into characters
    with pytest.raises(ConfigError, match="stop must be a list of strings"):
        list(chat.stream(HELLO, stop="three"))
    for call in (chat.invoke, lambda *a, **k: list(chat.stream(*a, **k))):  # tracing read it up: no stop at all
        with pytest.raises(ConfigError, match="stop must be a list of strings"):
            call(HELLO, stop=(s for s in ["three"]))
    with pytest.raises(ConfigError, match="tokenizer only with a loaded model"):
        ChatLookahead(model="default", tokenizer=tok)
    with pytest.raises(ConfigError, match="max_tokns"):
        ChatLookahead(model=model, tokenizer=tok, max_tokns=5)  # a typo is not silently dropped
    with pytest.raises(ConfigError, match="not among the bound tools"):
        chat.bind_tools([magic_function], tool_choice="get_weather")
    with pytest.raises(InputError, match="image"):
        chat.invoke([HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])])
    with pytest.raises(InputError, match="not valid Unicode"):
        chat.invoke("hi \ud800")  # a lone surrogate: the tokenizer's TypeError before
    with pytest.raises(ConfigError, match="top_k"):
        chat.invoke(HELLO, temperature=0.7, top_k=1.5)  # per call: was cut to 1
    # per call as strictly as fields, greedy or not ("1.5" was float()ed and changed the answer)
    for name, value in [("top_p", "0.9"), ("top_p", True), ("min_p", "0.1"), ("repetition_penalty", "1.5")]:
        for temperature in (0.7, 0):
            with pytest.raises(ConfigError, match=name):
                chat.invoke(HELLO, temperature=temperature, **{name: value})
    with pytest.raises(ConfigError, match="top_k"):
        chat.invoke(HELLO, top_k=True)  # greedy skipped the check
    # as fields, checked as strictly as per call (pydantic turned True into 1, "0.5" into 0.5, 2.0 into 2)
    for field, value in [
        ("timeout", True),
        ("seed", True),
        ("seed", 2**64),  # taken, then refused by every call
        ("max_tokens", 2.0),
        ("temperature", "0.5"),
        ("top_k", 1.5),
    ]:
        with pytest.raises(ConfigError, match=field):
            ChatLookahead(model=model, tokenizer=tok, **{field: value})
    with pytest.raises(ConfigError, match="max_new_tokens"):
        LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=True)


@slow
def test_cache_keys_tell_models_and_timeouts_apart(weights, chat):
    """LangChain's cache keys an answer by the model's identifying params. Measured bugs: an answer
    cut by ``timeout`` was served to a model without one, and two different loaded models both
    named "custom" shared answers. Token counting uses the model's own tokenizer (LangChain's
    fallback fetched GPT-2's from the hub: minutes offline, then 0)."""
    import torch
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import get_llm_cache, set_llm_cache
    from tiny_models import tiny_model
    from tiny_tokenizer import tiny_tokenizer

    model, tok = weights
    hurried = ChatLookahead(model=model, tokenizer=tok, max_tokens=24, lookahead=FIXED, timeout=1e-6)
    previous = get_llm_cache()
    set_llm_cache(InMemoryCache())
    try:
        cut = hurried.invoke(COUNT)
        assert cut.response_metadata["finish_reason"] == "timeout"
        full = chat.invoke(COUNT)
        assert full.response_metadata["finish_reason"] != "timeout" and len(full.content) > len(cut.content)
        # two tiny models of one architecture, different weights, both "custom"
        tiny_tok = tiny_tokenizer()
        a, b = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=2)
        llm_a = LookaheadLLM(model=a, tokenizer=tiny_tok, max_new_tokens=8)
        llm_b = LookaheadLLM(model=b, tokenizer=tiny_tok, max_new_tokens=8)
        assert llm_a.model_name == llm_b.model_name == "custom"
        with torch.no_grad():
            prompt = "a b c d"
            answer_a = llm_a.invoke(prompt)
            set_llm_cache(None)
            uncached_b = llm_b.invoke(prompt)
            set_llm_cache(InMemoryCache())
            llm_a.invoke(prompt)
            assert llm_b.invoke(prompt) == uncached_b
        assert answer_a != uncached_b  # else the check above could not tell
    finally:
        set_llm_cache(previous)
    text = "Lookahead decoding keeps a trie."
    assert chat.get_token_ids(text) == tok.encode(text, add_special_tokens=False)
    assert chat.get_num_tokens(text) == len(tok.encode(text, add_special_tokens=False)) > 0
    llm = LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=8)
    assert llm.get_num_tokens(text) == chat.get_num_tokens(text)
    assert llm.invoke(COUNT, references=[]) == llm.invoke(COUNT)  # [] is no passages, as ChatLookahead takes it


@slow
def test_cancelling_ainvoke_ends_its_decode(weights):
    """``asyncio.wait_for`` around ``ainvoke`` cancelled the caller only: the decode ran on to
    max_tokens holding the engine, so the next call waited (measured 7.6 s against ~1 s)."""
    import time

    model, tok = weights
    long = ChatLookahead(model=model, tokenizer=tok, max_tokens=400, lookahead=FIXED)
    llm = LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=400, lookahead=FIXED)

    async def cancel_then_ask(runnable) -> tuple[float, str]:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(runnable.ainvoke("Count from 1 to 500, one number a line."), timeout=0.5)
        start = time.monotonic()
        short = (
            await runnable.ainvoke(HELLO, max_tokens=2)
            if runnable is long
            else await runnable.ainvoke(HELLO, max_new_tokens=2)
        )
        return time.monotonic() - start, short

    for runnable in (long, llm):
        seconds, _ = asyncio.run(cancel_then_ask(runnable))
        # the 400-token decode alone takes tens of seconds here; once cancelled, a 2-token call waits
        # at most for the cancelled decode's current step
        assert seconds < 8, (type(runnable).__name__, seconds)


# ---------------------------------------------------------------- the chat RAG chain

QUESTION = "What does the budget option do?"  # corpora/en/tuning.md answers it


@pytest.fixture(scope="module")
def corpus_index(bundled_index_dir, e5_embedder):
    """The session's index of the bundled corpus, opened with the session's embedder."""
    from rag_lookahead.rag.index import load_index

    return load_index(bundled_index_dir, e5_embedder)


def test_index_retriever_takes_k_and_mode_per_call(corpus_index):
    from rag_lookahead.rag.chains import as_retriever

    retriever = as_retriever(corpus_index, 8)
    assert len(retriever.invoke(QUESTION)) == 8
    two = retriever.invoke(QUESTION, k=2)
    assert [d.page_content for d in two] == [d.page_content for d in retriever.invoke(QUESTION)[:2]]
    lexical = retriever.invoke("budget", k=3, mode="lexical")
    assert len(lexical) == 3 and all("budget" in d.page_content for d in lexical)
    assert asyncio.run(retriever.ainvoke(QUESTION, k=1))[0].page_content == two[0].page_content


@slow
def test_chat_rag_chain_streams_sources_then_answer(chat, corpus_index):
    from langchain_core.output_parsers import StrOutputParser

    from rag_lookahead.rag.chains import RAG_CHAT_PROMPT, build_chat_rag_chain, format_context

    chain = build_chat_rag_chain(chat, corpus_index, k_prompt=2, k_seed=4)
    out = chain.invoke(QUESTION)
    assert set(out) == {"question", "answer", "sources", "stats"} and out["answer"].strip()
    sources = out["sources"]
    assert [s["in_prompt"] for s in sources] == [True, True, False, False]
    assert any(s["source"].endswith("tuning.md") for s in sources[:2])
    stats = out["stats"]
    assert stats["usage"]["output_tokens"] == stats["new_tokens"] >= 1 and stats["seed_passages"] == 2
    assert stats["retrieval_seconds"] >= 0 and stats["finish_reason"] in ("stop", "length")
    # the passages kept out of the prompt were handed to the drafter, keyed by the ones in it
    engine = chat.get_engine()
    assert engine.seeds.lookup("\n".join(s["text"] for s in sources[:2])) == [s["text"] for s in sources[2:]]
    # streaming: the sources come before the first piece of the answer, and the pieces add up
    parts = list(chain.stream(QUESTION))
    first_answer = next(i for i, p in enumerate(parts) if p.get("answer"))
    assert any("sources" in p for p in parts[:first_answer])
    assert sum(1 for p in parts if p.get("answer")) > 1
    assert "".join(p.get("answer", "") for p in parts) == out["answer"]

    # and asynchronously (every async call raised NotImplementedError: the split was sync only)
    async def run_async() -> tuple[dict, list[dict], list[dict]]:
        return (
            await chain.ainvoke(QUESTION),
            [p async for p in chain.astream(QUESTION)],
            await chain.abatch([QUESTION]),
        )

    one, pieces, batch = asyncio.run(run_async())
    assert one["answer"] == out["answer"] == batch[0]["answer"] and one["sources"] == sources
    assert "".join(p.get("answer", "") for p in pieces) == out["answer"] and "stats" in pieces[-1]
    # the same answer as plain decoding on the same context: seeds and drafts change speed only
    docs = [s for s in sources[:2]]
    from langchain_core.documents import Document

    context = format_context([Document(page_content=d["text"], metadata={"source": d["source"]}) for d in docs])
    plain = (RAG_CHAT_PROMPT | chat.bind(enable_lookahead=False) | StrOutputParser()).invoke(
        {"context": context, "question": QUESTION}
    )
    assert plain == out["answer"]


# the model's own refusal, "the input has 612 tokens but the model's context holds 256, ...", named
# neither the passages nor k_prompt
TOO_LONG_WITH_K = re.compile(
    r"the prompt built from the question and its 8 passage\(s\) has (\d+) tokens but the model's context holds"
    r" 256, prompt and answer together: no room is left for an answer; ask with a smaller k_prompt or a shorter"
    r" question"
)


@pytest.mark.parametrize("builder", ["build_rag_chain", "build_chat_rag_chain", "build_retrieval_qa"])
def test_a_prompt_that_k_prompt_passages_make_too_long_names_k_prompt_before_decoding(corpus_index, builder):
    """Eight passages of the bundled corpus overflow the tiny model's 256 tokens (the question
    fits): each chain says so, naming k_prompt, before the model runs; two passages fit and are
    answered as before."""
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.rag import chains
    from rag_lookahead.tiny import build_tiny_model

    model, tokenizer = build_tiny_model("qwen2", seed=0), tiny_tokenizer()
    cls = ChatLookahead if builder == "build_chat_rag_chain" else LookaheadLLM
    options = {"max_tokens": 2} if cls is ChatLookahead else {"max_new_tokens": 2}
    llm = cls(model=model, tokenizer=tokenizer, **options)
    question = {"query": QUESTION} if builder == "build_retrieval_qa" else QUESTION
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        chain = getattr(chains, builder)(llm, corpus_index, k_prompt=8, k_seed=8)
        with pytest.raises(InputError, match=TOO_LONG_WITH_K) as refused:
            chain.invoke(question)
        if builder == "build_chat_rag_chain":  # refused before the sources are streamed
            with pytest.raises(InputError, match=TOO_LONG_WITH_K):
                next(iter(chain.stream(question)))
        assert not forwards
        fits = getattr(chains, builder)(llm, corpus_index, k_prompt=2, k_seed=8).invoke(question)
    finally:
        hook.remove()
    assert int(TOO_LONG_WITH_K.search(str(refused.value)).group(1)) >= 256
    assert fits and forwards  # two passages fit: answered


@pytest.mark.parametrize("builder", ["build_rag_chain", "build_chat_rag_chain", "build_retrieval_qa"])
def test_a_prompt_that_even_one_passage_makes_too_long_advises_no_smaller_k_prompt(corpus_index, builder, monkeypatch):
    """Where the question with its first passage alone overflows the context, each chain advised
    "a smaller k_prompt", which could not help: it says so and what does, still counting the
    prompt it refused (its eight passages, as counted where the context is 256)."""
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.rag import chains
    from rag_lookahead.tiny import build_tiny_model

    model, tokenizer = build_tiny_model("qwen2", seed=0), tiny_tokenizer()
    cls = ChatLookahead if builder == "build_chat_rag_chain" else LookaheadLLM
    options = {"max_tokens": 2} if cls is ChatLookahead else {"max_new_tokens": 2}
    llm = cls(model=model, tokenizer=tokenizer, **options)
    question = {"query": QUESTION} if builder == "build_retrieval_qa" else QUESTION
    chain = getattr(chains, builder)(llm, corpus_index, k_prompt=8, k_seed=8)
    with pytest.raises(InputError, match=TOO_LONG_WITH_K) as refused:
        chain.invoke(question)
    tokens = TOO_LONG_WITH_K.search(str(refused.value)).group(1)
    monkeypatch.setattr(model.config, "max_position_embeddings", 40)  # the question fits, no prompt of a passage
    with pytest.raises(InputError) as refused:
        chain.invoke(question)
    assert str(refused.value) == (
        f"the prompt built from the question and its 8 passage(s) has {tokens} tokens but the model's context"
        " holds 40, prompt and answer together: no room is left for an answer; even with one passage it is too"
        f" long, so no smaller k_prompt helps: {chains.ONE_PASSAGE_ADVICE}"
    )


def test_the_chat_chain_builds_its_prompt_for_the_length_check_only_for_a_model_of_ours(corpus_index):
    """The check filled the prompt for every chat model, with ``format_prompt``: another model's
    chain with a prompt that is a Runnable (not a template) failed with an AttributeError, and a
    template missing a variable with a bare KeyError in place of LangChain's message."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.prompt_values import ChatPromptValue
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda

    from rag_lookahead.rag import chains

    def as_messages(inputs: dict) -> ChatPromptValue:
        return ChatPromptValue(messages=[HumanMessage(f"{inputs['context']}\n\n{inputs['question']}")])

    other = GenericFakeChatModel(messages=iter([AIMessage("an answer")]))
    chain = chains.build_chat_rag_chain(other, corpus_index, k_prompt=2, prompt=RunnableLambda(as_messages))
    assert chain.invoke(QUESTION)["answer"] == "an answer"
    missing = ChatPromptTemplate.from_messages([("human", "{context} {history} {question}")])
    other = GenericFakeChatModel(messages=iter([AIMessage("unused")]))
    with pytest.raises(KeyError, match="missing variables"):
        chains.build_chat_rag_chain(other, corpus_index, prompt=missing).invoke(QUESTION)


# ---------------------------------------------------------------- batches on a tiny model


@pytest.fixture
def tiny_chat():
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    return ChatLookahead(model=build_tiny_model("qwen2", seed=0), tokenizer=tiny_tokenizer(), max_tokens=10)


class _Boom(BaseCallbackHandler):
    raise_error = True

    def on_llm_new_token(self, token, **kwargs) -> None:
        raise RuntimeError("this row's handler failed")


def test_trimming_a_history_works_where_the_template_refuses_partial_lists():
    """trim_messages counts partial lists (a system message alone, reversed tails that open with an
    assistant turn); a template that checks its input refused them, and the trim raised."""
    from langchain_core.messages import trim_messages
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    picky = tiny_tokenizer()
    picky.chat_template = (
        "{% if not messages or messages[-1]['role'] != 'user' %}{{ raise_exception('the last turn must be the "
        "user') }}{% endif %}{% for m in messages %}t2 {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}t2 assistant {% endif %}"
    )
    chat = ChatLookahead(model=build_tiny_model("qwen2", seed=0), tokenizer=picky, max_tokens=4)
    history = [SystemMessage("t4 t5")]
    for i in range(10):
        history += [HumanMessage(f"t{10 + i} t{20 + i}"), AIMessage(f"t{30 + i}")]
    history.append(HumanMessage("t6 t7"))
    whole = chat.get_num_tokens_from_messages(history)
    assert whole == chat.invoke(history, max_tokens=1).usage_metadata["input_tokens"]
    for system in (True, False):
        trimmed = trim_messages(history, max_tokens=whole // 2, token_counter=chat, include_system=system)
        # the lists the template refused are counted LangChain's way, so the fit is near, not exact
        assert 1 < len(trimmed) < len(history) and trimmed[-1].content == "t6 t7"
        assert chat.get_num_tokens_from_messages(trimmed) < whole


@pytest.mark.parametrize("include_system", [True, False])
def test_trimming_keeps_the_longest_tail_that_fits_beside_the_system_message(tokenizer, include_system):
    """trim_messages(include_system=True) counts the system message alone and the tail without it,
    and adds the two; Qwen's template puts its default system prompt (~20 tokens) into a list that
    opens with no system message, so the tail's count held it and the system message's held the
    generation prompt: a history of 32 tokens trimmed to 32 (or 40) kept the system message only."""
    from langchain_core.messages import trim_messages

    from rag_lookahead.tiny import build_tiny_model

    chat = ChatLookahead(model=build_tiny_model("qwen2", seed=0), tokenizer=tokenizer, max_tokens=4)

    def real(messages) -> int:  # the prompt ids a call decodes
        return len(chat._prepare(messages, None, {})[0].ids)

    system, *body = [
        SystemMessage("Be brief."),
        HumanMessage("hi"),
        AIMessage("hello"),
        HumanMessage("what is budget?"),
    ]
    assert real([system, *body]) == chat.get_num_tokens_from_messages([system, *body]) == 32
    assert chat.get_num_tokens_from_messages(body[-1:]) == 33  # holds the default system prompt
    assert trim_messages([system, *body], max_tokens=32, token_counter=chat, include_system=True) == [system, *body]
    body += [AIMessage("budget is the draft size."), HumanMessage("and decoding_length, in a word?")]
    body += [AIMessage("the most draft tokens one step checks."), HumanMessage("on a CPU?")]
    history = [system, *body]
    head = [system] if include_system else []
    fits = {n: real([*head, *body[n:]]) for n in range(len(body)) if isinstance(body[n], HumanMessage)}
    for max_tokens in range(real([system]) - 4, real(history) + 4):
        kept = trim_messages(
            history,
            max_tokens=max_tokens,
            token_counter=chat,
            strategy="last",
            include_system=include_system,
            start_on="human",
        )
        longest = min((n for n, count in fits.items() if count <= max_tokens), default=len(body))
        assert kept == [*head, *body[longest:]], max_tokens
    first = {n: real(history[:n]) for n in range(2, len(history) + 1)}
    for max_tokens in range(first[2], real(history) + 4):
        kept = trim_messages(history, max_tokens=max_tokens, token_counter=chat, strategy="first")
        assert kept == history[: max(n for n, count in first.items() if count <= max_tokens)], max_tokens
    # the price, as the docstring says: below any longer prefix, "first" keeps the system message
    # alone where its own prompt (default system prompt and generation prompt left out) fits
    alone = chat.get_num_tokens_from_messages(history[:1])
    for max_tokens in range(max(alone - 2, 0), first[2]):
        kept = trim_messages(history, max_tokens=max_tokens, token_counter=chat, strategy="first")
        assert kept == (history[:1] if max_tokens >= alone else []), max_tokens


def test_a_callback_that_raises_fails_its_own_row_of_a_batch_only(tiny_chat):
    """Each row's callbacks ran inside the shared decode, so one row's raising handler ended the
    decode and every row got its error, even with ``return_exceptions=True``."""
    prompts = ["t5 t6 t7", "t40", "t3 t4"]
    alone = [tiny_chat.invoke(p).content for p in prompts[::2]]
    answers = tiny_chat.batch(prompts, config=[{}, {"callbacks": [_Boom()]}, {}], return_exceptions=True)
    assert [answers[0].content, answers[2].content] == alone
    assert isinstance(answers[1], RuntimeError) and "this row's handler" in str(answers[1])


def test_cancelling_abatch_ends_its_decode(tiny_chat):
    """``abatch`` ran ``batch`` in a worker thread that nothing told of a cancelled caller: the
    decode went on to max_tokens, holding the engine for the next call."""
    import time

    model = tiny_chat.model
    forwards = [0]
    plain = model.forward

    def slowed(*args, **kwargs):  # a forward as slow as a real model's, so the decode outlives the wait
        forwards[0] += 1
        time.sleep(0.03)
        return plain(*args, **kwargs)

    tiny_chat.invoke("t1", max_tokens=2)  # the first call measures step costs
    model.forward = slowed
    try:

        async def cancel_then_count() -> int:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(
                    tiny_chat.abatch(["t10 t11 t12", "t5 t6 t7"], max_tokens=300, enable_lookahead=False), 0.5
                )
            await asyncio.sleep(0.2)  # the step under way when it was cancelled
            before = forwards[0]
            await asyncio.sleep(1.0)  # ~30 forwards' time
            return forwards[0] - before

        assert asyncio.run(cancel_then_count()) == 0
    finally:
        model.forward = plain


def test_a_cancelled_abatch_leaves_no_cut_answer_in_the_cache(tiny_chat):
    """Each row of a cancelled ``abatch`` came back from its ``invoke`` as a normal answer, cut
    short, and LangChain's cache kept it: the same question then got the cut answer."""
    import time

    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache

    asked = ["t10 t11 t12", "t5 t6 t7"]
    settings = {"max_tokens": 40, "enable_lookahead": False}
    whole = tiny_chat.invoke(asked[0], **settings).content
    model, plain = tiny_chat.model, tiny_chat.model.forward
    model.forward = lambda *a, **kw: time.sleep(0.05) or plain(*a, **kw)
    set_llm_cache(InMemoryCache())
    try:
        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(asyncio.wait_for(tiny_chat.abatch(asked, **settings), 0.5))
        time.sleep(0.3)  # the rows end at their next block
        model.forward = plain
        assert tiny_chat.invoke(asked[0], **settings).content == whole
    finally:
        model.forward = plain
        set_llm_cache(None)


def test_model_copy_checks_its_update_and_decodes_with_an_updated_model():
    """pydantic's model_copy checked nothing and kept the copied object's engine: a copy with
    another model answered with the old one, and a timeout of -1 cut every answer to a token."""
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    tok = tiny_tokenizer()
    first, second = build_tiny_model("qwen2", seed=0), build_tiny_model("qwen2", seed=9)
    prompt = "t5 t6 t7 t5 t6 t7 t8 t9 t5 t6"
    for cls, length in ((ChatLookahead, "max_tokens"), (LookaheadLLM, "max_new_tokens")):
        model = cls(model=first, tokenizer=tok, **{length: 8})

        def answer(m):
            out = m.invoke(prompt)
            return out if isinstance(out, str) else out.content

        copied = model.model_copy(update={"model": second})
        assert answer(copied) == answer(cls(model=second, tokenizer=tok, **{length: 8})) != answer(model)
        if cls is ChatLookahead:  # a name worked out from the old model goes with it; one given stays
            first.config._name_or_path, second.config._name_or_path = "org/first", "org/second"
            named = cls(model=first, tokenizer=tok, **{length: 8})
            assert named.model_copy(update={"model": second}).model_name == "second"
            assert named.model_copy(update={"model": second, "model_name": "mine"}).model_name == "mine"
            given = cls(model=first, tokenizer=tok, model_name="mine", **{length: 8})
            assert given.model_copy(update={"model": second}).model_name == "mine"
        kept = model.model_copy(update={"temperature": 0.0})
        assert kept._engine is model._engine  # other settings keep the engine, so its output pool
        for bad, message in (
            ({length: 0}, f"{length} must be an integer >= 1, got 0"),
            ({"temperature": -1.0}, "temperature must be a number >= 0"),
            ({length: "8"}, f"setting {length}"),
            ({"temprature": 0.5}, "temprature"),
        ):
            with pytest.raises(ConfigError, match=message):
                model.model_copy(update=bad)
    chat = ChatLookahead(model=first, tokenizer=tok, max_tokens=8)
    for timeout in (-1.0, 0.0):
        with pytest.raises(ConfigError, match="timeout must be a number of seconds > 0"):
            chat.model_copy(update={"timeout": timeout})
    for temperature in ("abc", [0.5]):  # LangChain's tracing read it with float() before our check
        with pytest.raises(ConfigError, match="temperature must be a number >= 0"):
            chat.invoke(prompt, temperature=temperature)


def test_max_concurrency_zero_is_no_limit_and_a_negative_one_is_refused():
    """A negative max_concurrency made no wave, and batch answered [] for every input;
    LookaheadLLM's 0 raised "range() arg 3 must not be zero"."""
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    model, tok = build_tiny_model("qwen2", seed=4), tiny_tokenizer()
    prompts = ["t5 t6", "t7 t8", "t9"]
    for llm in (
        ChatLookahead(model=model, tokenizer=tok, max_tokens=3),
        LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=3),
    ):

        def texts(config=None, llm=llm):
            return [getattr(a, "content", a) for a in llm.batch(prompts, config)]

        whole = texts()
        assert len(whole) == 3 and [texts({"max_concurrency": n}) for n in (0, 1, 2)] == [whole] * 3
        for bad in (-1, 1.5, "2"):
            with pytest.raises(ConfigError, match=f"max_concurrency must be an integer >= 1 .*got {bad!r}"):
                texts({"max_concurrency": bad})


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])  # RuntimeError: "can't start new thread"
def test_a_ctrl_c_while_a_batch_starts_its_workers_returns_and_leaves_no_thread(tiny_chat, monkeypatch, failure):
    """A Ctrl-C (or a thread that could not start) while ``batch`` was starting its worker threads
    hung for good: the rows already handed over waited for workers that never came, and the
    pool's exit joined them."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    tiny_chat.batch(["t5 t6", "t7 t8"])  # warm
    real_submit, submitted = ThreadPoolExecutor.submit, []

    def interrupted_at_the_second(pool, *args, **kwargs):
        submitted.append(1)
        if len(submitted) == 2:
            raise failure
        return real_submit(pool, *args, **kwargs)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", interrupted_at_the_second)
    (outcome,) = finished(lambda: tiny_chat.batch(["t5 t6 t7", "t9 t10", "t11 t12"]))  # it hung
    assert isinstance(outcome, failure)
    assert not batch_workers_decoding()


def batch_workers_decoding() -> list:
    """The batch worker threads still alive a moment after ``batch`` returned or raised. A worker
    that decodes on (the bug these tests guard) runs for seconds; the suite on a loaded machine
    twice caught one in its last microseconds (listed, then "stopped" by the time it was shown)."""
    import threading

    workers = [t for t in threading.enumerate() if t.name.startswith("lookahead-batch")]
    for thread in workers:
        thread.join(timeout=0.5)
    return [t for t in workers if t.is_alive()]


@pytest.mark.parametrize("first", ["t5 t6 t7", "\ud800"])  # a bad first row: the others finish, unless...
def test_a_ctrl_c_during_a_batch_ends_its_decode_at_the_next_block(first):
    """``batch`` decoded every row to its token limit before a Ctrl-C came back (15 s on the tiny
    model at 3,000 tokens, minutes on a real model); ``invoke`` and ``stream`` returned at once.
    After one row's own error the others finish, and a Ctrl-C then stops them too."""
    import signal
    import threading
    import time

    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    chat = ChatLookahead(
        model=build_tiny_model("qwen2", max_positions=2048),
        tokenizer=tiny_tokenizer(),
        max_tokens=1500,
        lookahead=LookaheadConfig(enabled=False),
    )

    def ctrl_c(*args) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            chat.batch([first, "t8 t9", "t10 t11 t12"])
        assert time.perf_counter() - start < 3.0
        assert not batch_workers_decoding()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_ctrl_c_while_a_batch_worker_starts_leaves_no_worker_running(monkeypatch):
    """A Ctrl-C landing in ``Thread.start`` of a batch worker (it waits for the thread to run):
    the thread ran, but the pool never recorded it, so ``shutdown(wait=True)`` did not wait for it
    and it decoded on after ``batch`` had raised (seen once in the suite on a loaded machine)."""
    import threading
    import time

    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    chat = ChatLookahead(
        model=build_tiny_model("qwen2", max_positions=2048),
        tokenizer=tiny_tokenizer(),
        max_tokens=1500,
        lookahead=LookaheadConfig(enabled=False),
    )
    real_start = threading.Thread.start

    def start_then_ctrl_c(thread) -> None:
        if not (thread.name.startswith("lookahead-batch") and thread.name.endswith("_1")):
            return real_start(thread)
        work = thread.run

        def run_then_linger() -> None:  # a worker ending its block on a loaded machine
            work()
            time.sleep(0.5)

        thread.run = run_then_linger
        real_start(thread)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        chat.batch(["t5 t6 t7", "t8 t9", "t10 t11 t12"])
    monkeypatch.undo()
    assert not batch_workers_decoding()


def test_chat_models_by_id_share_one_model_and_free_it_with_the_last(tmp_path, monkeypatch):
    """Models loaded by id were kept for the process's life, one per spelling: "bf16", "bfloat16"
    and torch.bfloat16, or a relative and a trailing-slash path, each loaded the weights again."""
    import gc
    import weakref

    import torch
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    folder = tmp_path / "tiny"
    build_tiny_model("qwen2").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    spellings = [(str(folder), "bf16"), (str(folder) + "/", "bfloat16"), ("tiny", torch.bfloat16)]
    chats = [ChatLookahead(model=name, dtype=dtype, max_tokens=2) for name, dtype in spellings]
    models = {id(chat._engine.model) for chat in chats}
    assert len(models) == 1
    held = weakref.ref(chats[0]._engine.model)
    assert chats[2].invoke("t5 t6").content == chats[0].invoke("t5 t6").content
    del chats
    gc.collect()
    assert held() is None


def test_one_bad_input_of_a_batch_leaves_the_others_to_finish(tiny_chat):
    """With ``return_exceptions=False`` the caller gets the bad input's error, and the other rows
    end as they would alone (LangChain's own batch): the Ctrl-C handling first cancelled them and
    handed them that input's error ("not valid Unicode" on valid inputs, in their traces)."""
    from langchain_core.callbacks import BaseCallbackHandler

    class Seen(BaseCallbackHandler):
        def __init__(self) -> None:
            self.events: list[str] = []

        def on_llm_end(self, response, **kwargs) -> None:
            self.events.append("end")

        def on_llm_error(self, error, **kwargs) -> None:
            self.events.append(type(error).__name__)

    seen = [Seen() for _ in range(3)]
    with pytest.raises(InputError, match="Unicode"):
        tiny_chat.batch(["\ud800", "t5 t6", "t7 t8"], [{"callbacks": [s]} for s in seen])
    assert seen[0].events == ["InputError"]
    assert seen[1].events == ["end"] and seen[2].events == ["end"]


def test_a_model_id_is_read_as_load_model_reads_it(tmp_path, monkeypatch):
    """The shared-model key took a folder named "default" in the working folder for the embedded
    model "default" (load_model never does), so one chat model got the other's weights; a ~ naming
    no user is load_model's one-line ConfigError, not a bare RuntimeError."""
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    build_tiny_model("qwen2").save_pretrained(tmp_path / "default")
    tiny_tokenizer().save_pretrained(tmp_path / "default")
    monkeypatch.chdir(tmp_path)
    local = ChatLookahead(model="./default", dtype="bf16", max_tokens=2)
    embedded = ChatLookahead(model="default", dtype="bf16", max_tokens=2)
    assert local._engine.model.config.vocab_size == 96
    assert embedded._engine.model.config.vocab_size > 96
    with pytest.raises(ConfigError, match="~"):
        ChatLookahead(model="~no-such-user-here/model", max_tokens=2)._engine  # noqa: B018


def test_the_embedded_model_is_loaded_once_with_or_without_the_remote_code_opt_in():
    """The opt-in was part of the shared-model key for every id, so ``model="default"`` with and
    without ``trust_remote_code=True`` (which an embedded model ignores: it runs no code of its
    own) held two copies of the same weights."""
    plain = ChatLookahead(model="default", dtype="bf16", max_tokens=2)
    opted_in = ChatLookahead(model="default", dtype="bf16", max_tokens=2, trust_remote_code=True)
    assert opted_in._engine.model is plain._engine.model


def test_the_text_llm_from_a_model_id_shares_the_chat_models_weights():
    """``LookaheadLLM.from_model_id("default")`` beside ``ChatLookahead(model="default")``, as the
    README's LangChain example builds them, loaded a second copy of the weights (several GB)."""
    from rag_lookahead.langchain.llm import LookaheadLLM

    chat = ChatLookahead(model="default", dtype="bf16", max_tokens=2)
    llm = LookaheadLLM.from_model_id("default", dtype="bf16", max_new_tokens=2, model_name="mine")
    assert llm.model is chat._engine.model and llm.tokenizer is chat._engine.tokenizer
    # and its engine: two engines on one model decoded at once (each has its own lock)
    assert llm.engine is chat._engine and llm.model_name == "mine"
    assert LookaheadLLM.from_model_id("default", dtype="bf16").engine is llm.engine
    with pytest.raises(ConfigError, match="from_model_id loads the model and tokenizer itself"):
        LookaheadLLM.from_model_id("default", tokenizer=llm.tokenizer)


def test_a_custom_token_counter_is_used_by_both_models(tiny_chat):
    """LangChain counts with ``custom_get_token_ids`` where one is given (get_num_tokens,
    trim_messages); ours took the field and counted with the tokenizer all the same."""
    from langchain_core.messages import trim_messages

    counter = lambda text: [1] * (10 * len(text.split()))  # noqa: E731
    chat = tiny_chat.model_copy(update={"custom_get_token_ids": counter})
    llm = LookaheadLLM(model=tiny_chat.model, tokenizer=tiny_chat.tokenizer, custom_get_token_ids=counter)
    for model in (chat, llm):
        assert model.get_num_tokens("t5 t6") == 20
    history = [SystemMessage("t40"), HumanMessage("t5 t6"), AIMessage("t7"), HumanMessage("t8 t9")]
    assert chat.get_num_tokens_from_messages(history) == llm.get_num_tokens_from_messages(history) > 60
    assert len(trim_messages(history, max_tokens=45, token_counter=chat, strategy="last")) < len(history)
    assert tiny_chat.get_num_tokens("t5 t6") == len(tiny_chat.tokenizer.encode("t5 t6", add_special_tokens=False)) < 20


#: the tiny template, plus Qwen3's switch: with enable_thinking false the answer opens with an empty think block
THINKING_TEMPLATE = (
    "{% for m in messages %}t2 {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}t2 assistant "
    "{% if enable_thinking is defined and enable_thinking is false %}t8 t9 {% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template_as_field_per_call_and_bound():
    """ChatLookahead refused ``chat_template_kwargs`` (and ``enable_thinking``) as a field, per call
    and through bind, so LangChain users of a Qwen3-style template could not switch thinking off;
    the server's chat route takes them. Prompt and tokens are apply_chat_template's with the
    variable and model.generate's; apply_chat_template's own arguments are refused, as the server does."""
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.template_variables import template_arguments
    from rag_lookahead.tiny import build_tiny_model

    model, tok = build_tiny_model("qwen3", seed=0), tiny_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "t5 t6 t7"}]

    def reference(**variables) -> tuple[int, str]:
        inputs = tok.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt", **variables
        )
        n = inputs["input_ids"].shape[1]
        out = model.generate(**inputs, do_sample=False, max_new_tokens=10, eos_token_id=tok.eos_token_id)
        return n, tok.decode(out[0, n:], skip_special_tokens=True).strip()

    off, on = reference(enable_thinking=False), reference()
    assert off[0] == on[0] + 2 and off[1] != on[1]  # the switch changes the prompt and the answer

    def answered(message) -> tuple[int, str]:
        return message.usage_metadata["input_tokens"], message.content

    plain = ChatLookahead(model=model, tokenizer=tok, max_tokens=10)
    quiet = ChatLookahead(model=model, tokenizer=tok, max_tokens=10, chat_template_kwargs={"enable_thinking": False})
    assert answered(plain.invoke(messages)) == on
    assert answered(quiet.invoke(messages)) == off
    assert answered(plain.invoke(messages, chat_template_kwargs={"enable_thinking": False})) == off
    assert answered(plain.bind(chat_template_kwargs={"enable_thinking": False}).invoke(messages)) == off
    assert answered(quiet.invoke(messages, chat_template_kwargs={"enable_thinking": True})) == on  # key by key
    assert quiet.get_num_tokens_from_messages(quiet._convert_input(messages).to_messages()) == off[0]
    assert quiet._identifying_params != plain._identifying_params  # LangChain's cache keeps the two apart
    # also when a call brings its own variables: they went over the field's in the cache key
    other = {"chat_template_kwargs": {"other": 1}}
    assert quiet._get_llm_string(**other) != plain._get_llm_string(**other)
    for name in sorted(template_arguments()):  # the names the server refuses with a 400
        with pytest.raises(ConfigError, match=f"cannot set '{name}'"):
            plain.invoke(messages, chat_template_kwargs={name: True})
        with pytest.raises(ConfigError, match=f"cannot set '{name}'"):
            ChatLookahead(model=model, tokenizer=tok, chat_template_kwargs={name: True})
    for bad in ("enable_thinking", ["enable_thinking"], {1: True}):
        with pytest.raises(ConfigError, match="chat_template_kwargs must be a dict"):
            plain.invoke(messages, chat_template_kwargs=bad)


def test_device_none_and_cpu_share_the_weights_on_a_cpu(tmp_path, monkeypatch):
    """The shared-model key held the device as written, so ``device=None`` (the CPU here) and
    ``device="cpu"`` loaded two copies of the same weights on the same CPU."""
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.tiny import build_tiny_model

    build_tiny_model("qwen2").save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    unsaid = ChatLookahead(model="m", dtype="fp32", max_tokens=2)
    cpu = ChatLookahead(model="m", dtype="fp32", max_tokens=2, device="cpu")
    assert cpu._engine.model is unsaid._engine.model
    assert ChatLookahead(model="m", dtype="bf16", max_tokens=2, device="cpu")._engine.model is not cpu._engine.model


# ---------------------------------------------------------------- structured output


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str
    age: int


PERSON = "Alice is 31 years old and lives in Paris. Extract the person."


@pytest.fixture(scope="module")
def noise_chat():
    """A tiny random Qwen2 over the default tokenizer (its template shows tools): the call a
    structured answer is forced to open goes on in noise, never valid JSON."""
    from tiny_models import real_vocab_model

    model, tokenizer = real_vocab_model()
    return ChatLookahead(model=model, tokenizer=tokenizer, max_tokens=8)


@pytest.mark.parametrize("schema", [Person, Person.model_json_schema()], ids=["pydantic", "json_schema"])
def test_a_structured_answer_cut_by_max_tokens_says_so(noise_chat, schema):
    """The cut call was in invalid_tool_calls, where LangChain's parser does not look: invoke
    returned None, and include_raw=True a parsing_error of None, with no word of the cut."""
    structured = noise_chat.with_structured_output(schema)
    for answer in (lambda: structured.invoke(PERSON), lambda: list(structured.stream(PERSON))):
        with pytest.raises(OutputParserException, match="cut by max_tokens .*: raise max_tokens"):
            answer()
    with_raw = noise_chat.with_structured_output(schema, include_raw=True)
    whole = with_raw.invoke(PERSON)
    [streamed] = with_raw.stream(PERSON)  # the chunks added up, checked as invoke's
    for out in (whole, streamed):
        assert out["parsed"] is None and [c["name"] for c in out["raw"].invalid_tool_calls] == ["Person"], out
        assert out["raw"].response_metadata["finish_reason"] == "length"
        assert isinstance(out["parsing_error"], OutputParserException)
        assert "cut by max_tokens" in str(out["parsing_error"])


def test_a_structured_answer_cut_by_the_timeout_says_so(noise_chat):
    """A call cut by the timeout names the timeout (not the noise it was cut into) as the cause."""
    timed = noise_chat.model_copy(update={"timeout": 1e-6})  # the prefill's token, then the deadline
    out = timed.with_structured_output(Person, include_raw=True).invoke(PERSON)
    assert out["parsed"] is None and out["raw"].response_metadata["finish_reason"] == "timeout", out
    assert isinstance(out["parsing_error"], OutputParserException)
    assert "cut by the timeout" in str(out["parsing_error"])
    with pytest.raises(OutputParserException, match="cut by the timeout .*: raise timeout"):
        timed.with_structured_output(Person).invoke(PERSON)


def test_check_messages_takes_what_invoke_takes(noise_chat):
    """``check_messages`` took messages only: ``[("human", "...")]``, which ``invoke`` takes, failed
    with an AttributeError. It counts each input form as the call encodes it."""
    want = noise_chat.invoke([("human", PERSON)], max_tokens=1).usage_metadata["input_tokens"]
    for given in (
        [("human", PERSON)],
        PERSON,
        [{"role": "user", "content": PERSON}],
        [HumanMessage(PERSON)],
        ChatPromptTemplate.from_messages([("human", "{q}")]).invoke({"q": PERSON}),
    ):
        assert noise_chat.check_messages(given) == want, given
    # a history whose only turn is a tool call is no empty input
    calls = [{"name": "now", "args": {}, "id": "call_1", "type": "tool_call"}]
    assert noise_chat.check_messages([AIMessage("", tool_calls=calls)]) > 0
    with pytest.raises(InputError, match="empty"):
        noise_chat.check_messages([("human", " ")])


def test_a_structured_answer_whose_call_is_not_valid_gives_its_error(noise_chat):
    """Ended by a stop string (not cut), the noise call's error is the cause, from invoke and stream alike."""
    written = noise_chat.with_structured_output(Person, include_raw=True).invoke(PERSON)["raw"].invalid_tool_calls
    noise = written[0]["args"].split('"arguments":', 1)[1]  # after the forced opening
    stopped = noise_chat.model_copy(update={"stop": [noise[len(noise) // 2 : len(noise) // 2 + 2]]})
    out = stopped.with_structured_output(Person, include_raw=True).invoke(PERSON)
    raw = out["raw"]
    assert raw.response_metadata["finish_reason"] == "stop" and raw.invalid_tool_calls, raw
    error = raw.invalid_tool_calls[0]["error"]
    assert out["parsed"] is None and error.startswith("the tool call is not valid JSON")
    assert isinstance(out["parsing_error"], OutputParserException)
    assert f"the model's tool call is not valid: {error}" in str(out["parsing_error"])
    structured = stopped.with_structured_output(Person)
    for answer in (lambda: structured.invoke(PERSON), lambda: list(structured.stream(PERSON))):
        with pytest.raises(OutputParserException, match=re.escape(error)):  # a streamed call has no error: parsed again
            answer()


def test_a_streamed_call_that_does_not_fit_the_schema_raises_as_invoke_does(noise_chat):
    """A stream parses partial calls, and LangChain's partial parser drops the schema's
    ValidationError: a valid JSON call missing a field streamed as None, with no error, where
    invoke raised. Here the added-up stream output of such a call (as LangChain's stream hands
    it to our check) goes through the check the structured runnable ends with."""
    from pydantic import ValidationError

    from rag_lookahead.langchain import chat_model

    structured = noise_chat.with_structured_output(Person)
    check = structured.last.func  # the check the runnable ends with
    call = {"name": "Person", "args": '{"name": "Alice"}', "id": "call_1", "index": 0, "type": "tool_call_chunk"}
    streamed = {"raw": AIMessageChunk(content="", tool_call_chunks=[call]), "parsed": None, "parsing_error": None}
    assert streamed["raw"].tool_calls == [
        {"name": "Person", "args": {"name": "Alice"}, "id": "call_1", "type": "tool_call"}
    ]
    with pytest.raises(ValidationError, match="age"):
        check(streamed)
    kept = chat_model._checked_structured_output(streamed, include_raw=True, whole=check.keywords["whole"])
    assert kept["parsed"] is None and isinstance(kept["parsing_error"], ValidationError)
    fits = {
        **streamed,
        "raw": AIMessageChunk(content="", tool_call_chunks=[{**call, "args": '{"name": "A", "age": 3}'}]),
    }
    assert check(fits) == Person(name="A", age=3)


def test_structured_output_takes_langchains_methods_and_refuses_others(noise_chat):
    """LangChain's methods and ``strict`` are taken (its standard tests ask it of every chat model),
    all by the forced call; a method that is none of them, or an unknown option, was accepted and
    ignored: now refused, as the model's own options are."""
    for method in ("function_calling", "json_schema", "json_mode"):
        for strict in (None, False, True):
            assert noise_chat.with_structured_output(Person, method=method, strict=strict) is not None
    with pytest.raises(ConfigError, match="'function-calling'\\) is not a method: use one of"):
        noise_chat.with_structured_output(Person, method="function-calling")
    with pytest.raises(ConfigError, match="unknown option.*: tools"):
        noise_chat.with_structured_output(Person, tools=[get_weather])
    with pytest.raises(OutputParserException, match="no structured output: the answer was cut by max_tokens"):
        noise_chat.with_structured_output(Person, method="json_schema", strict=True).invoke(PERSON)


@slow
def test_a_valid_structured_answer_parses_as_before(chat):
    alice = Person(name="Alice", age=31)
    assert chat.with_structured_output(Person).invoke(PERSON) == alice
    assert list(chat.with_structured_output(Person).stream(PERSON)) == [alice]
    out = chat.with_structured_output(Person, include_raw=True).invoke(PERSON)
    assert out["parsed"] == alice and out["parsing_error"] is None and out["raw"].tool_calls
    assert chat.with_structured_output(Person.model_json_schema()).invoke(PERSON) == {"name": "Alice", "age": 31}
