"""LangChain messages in and out of the chat model.

In: LangChain messages as the dicts a chat template takes (text only; tool calls and tool results
in OpenAI's shape). Out: one decoded row of an :class:`~rag_lookahead.langchain.engine.EngineRun`
as an ``AIMessage`` (or the closing ``AIMessageChunk`` of a stream) with its tool calls, usage
and the decode stats in ``response_metadata``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk

from rag_lookahead.errors import InputError
from rag_lookahead.langchain.engine import EngineRun
from rag_lookahead.langchain.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedCall,
    ToolOptions,
    parse_tool_calls,
    split_calls,
)

__all__ = ["call_error", "chat_generation", "last_chunk", "template_messages", "unsent_text"]

#: content blocks an assistant turn may carry besides text; its tool_calls hold the same calls
_AI_CALL_BLOCKS = frozenset({"tool_use", "tool_call", "tool_call_chunk", "function_call", "server_tool_call"})
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "timeout"}
#: a ChatMessage's role as templates name it (Qwen's skipped "developer" and "human" turns unseen)
_ROLE_NAMES = {"developer": "system", "human": "user", "ai": "assistant", "function": "tool"}


def _text_of(message: BaseMessage) -> str:
    """A message's text; non-text content is refused (these models read text only)."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(message, AIMessage) and block.get("type") in _AI_CALL_BLOCKS | {"reasoning", "thinking"}:
            continue  # the call is in message.tool_calls; reasoning is not replayed
        else:
            raise InputError(
                f"a {message.type} message holds a {block.get('type')!r} block: this model reads text only"
            )
    return "".join(parts)


def _template_message(message: BaseMessage) -> dict:
    """A LangChain message as a chat-template dict (role, content, tool_calls, tool_call_id, and
    its ``name`` where it has one, for every role, as ``apply_chat_template`` and the server pass it)."""
    out = _role_and_content(message)
    if message.name is not None:
        out["name"] = message.name
    return out


def _role_and_content(message: BaseMessage) -> dict:
    text = _text_of(message)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": text}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": text}
    if isinstance(message, AIMessage):
        # a refused turn (langchain-openai keeps the refusal in additional_kwargs, content empty) is its refusal
        refusal = message.additional_kwargs.get("refusal")
        text = text or (refusal if isinstance(refusal, str) else "")
        out: dict[str, Any] = {"role": "assistant", "content": _with_invalid_calls(text, message.invalid_tool_calls)}
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for c in message.tool_calls
            ]
        return out
    if isinstance(message, ToolMessage):
        return {"role": "tool", "content": text, "tool_call_id": message.tool_call_id}
    if isinstance(message, FunctionMessage):
        return {"role": "tool", "content": text}
    if isinstance(message, ChatMessage):  # LangChain's and OpenAI's names for the template's roles
        return {"role": _ROLE_NAMES.get(message.role, message.role), "content": text}
    raise InputError(f"unsupported message type {type(message).__name__}")


def _with_invalid_calls(text: str, invalid_calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant turn's text with its invalid tool calls written back as the model wrote them,
    each in a ``<tool_call>`` block: a turn holding only a call cut by ``max_tokens`` was replayed
    empty, so the model never saw what it had written (and asked to write it again, could not see
    where it went wrong). The template writes the valid calls (``tool_calls``) after the text."""
    blocks = [f"{TOOL_CALL_OPEN}\n{raw}\n{TOOL_CALL_CLOSE}" for raw in map(_as_written, invalid_calls) if raw]
    return "\n".join([text, *blocks] if text else blocks)


def _as_written(invalid_call: Mapping[str, Any]) -> str:
    """An invalid call's text as the model wrote it: its ``args``, or, where a stream gave it (no
    ``error``, ``args`` a JSON string: see :func:`call_chunks`), the text that string holds."""
    args = invalid_call.get("args") or ""
    if invalid_call.get("error") is None:
        try:
            written = json.loads(args)
        except ValueError:
            return args
        return written if isinstance(written, str) else args
    return args


def call_error(invalid_call: Mapping[str, Any]) -> str:
    """Why an invalid call did not parse: its ``error``, or, for one a stream gave (no ``error``:
    see :func:`call_chunks`), the error its text gives when parsed again, so both say the same."""
    if invalid_call.get("error") is not None:
        return str(invalid_call["error"])
    _, calls = parse_tool_calls(f"{TOOL_CALL_OPEN}{_as_written(invalid_call)}{TOOL_CALL_CLOSE}")
    return next((c.error for c in calls if c.error), "the tool call is not valid")


def template_messages(messages: Sequence[BaseMessage], *, to_answer: bool = True) -> list[dict]:
    """Messages for ``apply_chat_template``; consecutive system messages become one (templates take
    one). ``to_answer``: refuse messages that say nothing (counting tokens takes them)."""
    out: list[dict] = []
    for message in messages:
        item = _template_message(message)
        if item["role"] == "system" and out and out[-1]["role"] == "system":
            out[-1]["content"] += "\n\n" + item["content"]
        else:
            out.append(item)
    if to_answer and not any(_said(m["content"]) or m.get("tool_calls") for m in out):
        raise InputError("the messages are empty: give the model a question or an instruction")
    return out


# ---------------------------------------------------------------- out: a decoded row as a message


def _usage(run: EngineRun, row: int) -> UsageMetadata:
    prompt, answer = run.prompt_tokens[row], len(run.trackers[row].ids)
    return UsageMetadata(input_tokens=prompt, output_tokens=answer, total_tokens=prompt + answer)


def _info(run: EngineRun, row: int, calls: list[ParsedCall], model_name: str | None) -> dict:
    """``finish_reason`` is "tool_calls" only when every call parsed, as the server says it: one
    valid call beside a second cut by ``max_tokens`` hid the cut behind "tool_calls"."""
    called = bool(calls) and all(c.args is not None for c in calls)
    finish = "tool_calls" if called else _FINISH[run.stopped_by(row)]
    return {"model_name": model_name, "finish_reason": finish, **run.info(row)}


def chat_generation(run: EngineRun, row: int, tool_options: ToolOptions, model_name: str | None) -> ChatGeneration:
    """The row's whole answer: an ``AIMessage`` with its tool calls (valid and invalid) and usage."""
    content, calls = split_calls(run.trackers[row].final_text(), tool_options)
    message = AIMessage(content=content, **message_calls(calls), usage_metadata=_usage(run, row))
    return ChatGeneration(message=message, generation_info=_info(run, row, calls, model_name))


def last_chunk(run: EngineRun, tool_options: ToolOptions, model_name: str | None) -> ChatGenerationChunk:
    """The closing chunk of a stream: the rest of the text, the tool calls whole, usage and stats."""
    content, calls = split_calls(run.trackers[0].final_text(), tool_options)
    message = AIMessageChunk(
        content=unsent_text(run, 0, content),
        tool_call_chunks=call_chunks(calls),
        usage_metadata=_usage(run, 0),
        chunk_position="last",
    )
    return ChatGenerationChunk(message=message, generation_info=_info(run, 0, calls, model_name))


def message_calls(calls: Sequence[ParsedCall]) -> dict[str, list[dict]]:
    """An ``AIMessage``'s ``tool_calls`` and ``invalid_tool_calls`` for parsed ``calls``."""
    return {
        "tool_calls": [
            {"name": c.name, "args": c.args, "id": c.id, "type": "tool_call"} for c in calls if c.args is not None
        ],
        "invalid_tool_calls": [
            {"name": c.name, "args": c.raw, "id": c.id, "error": c.error, "type": "invalid_tool_call"}
            for c in calls
            if c.args is None
        ],
    }


def call_chunks(calls: Sequence[ParsedCall]) -> list[dict]:
    """The same calls as an ``AIMessageChunk``'s ``tool_call_chunks``.

    LangChain parses each chunk's ``args`` again (``parse_partial_json``, which completes cut
    JSON), so an invalid call's raw text goes as a JSON string: as the object it held, a cut call,
    or one whose ``arguments`` were no object, came back as a valid call with the wrong args."""
    return [
        {
            "name": c.name,
            "args": json.dumps(c.args if c.args is not None else c.raw, ensure_ascii=False),
            "id": c.id,
            "index": i,
            "type": "tool_call_chunk",
        }
        for i, c in enumerate(calls)
    ]


def unsent_text(run: EngineRun, row: int, content: str) -> str:
    """What the row's answer text still lacks after the pieces emitted block by block."""
    emitted = run.trackers[row].emitted
    return content[len(emitted) :] if content.startswith(emitted) else ""


def _said(content) -> bool:
    """Whether a message's content holds anything but whitespace (as an empty prompt, a blank one is refused)."""
    return bool(content.strip()) if isinstance(content, str) else bool(content)
