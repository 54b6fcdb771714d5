"""Tool calls in Qwen's format: parsing them out of the answer, and forcing one when ``tool_choice`` asks.

The model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a block per call or
several objects in one block; :func:`parse_tool_calls` turns that back into calls, one per object.
A ``tool_choice`` of "required"/"any" or a tool's name is honoured by opening the assistant's turn
with ``<tool_call>`` (and the tool's name when it is known), so the model writes the call from
there (:func:`forced_opening`); "none" and "auto" open nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rag_lookahead.errors import ConfigError
from rag_lookahead.tokens import chat_template_text

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ParsedCall",
    "ToolOptions",
    "check_tools",
    "forced_opening",
    "parse_tool_calls",
    "plain_choice",
    "several_calls",
    "split_calls",
    "tool_names",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# a block left open (no </tool_call>) ends where the next opens, or with the answer
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.S)
_BETWEEN_CALLS = re.compile(r"[\s,]*")  # what separates two calls written in one block
_JSON = json.JSONDecoder()


@dataclass
class ParsedCall:
    name: str | None
    args: dict | None
    raw: str
    error: str | None = None
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """Split Qwen-style output into (text outside the calls, the calls).

    Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` becomes a :class:`ParsedCall`,
    as does each of several objects in one block (:func:`_parse_block`); one whose JSON does not
    parse (cut short by ``max_tokens``, say) keeps its raw text and error.
    """
    parts, calls, pos = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        parts.append(text[pos : match.start()])
        pos = match.end()
        calls.extend(_parse_block(match.group(1).strip(), closed=match.group(0).endswith("</tool_call>")))
    parts.append(text[pos:])
    return "".join(parts), calls


def _parse_block(block: str, closed: bool) -> list[ParsedCall]:
    """The calls in one ``<tool_call>`` block: one per JSON object.

    Qwen2.5 often writes parallel calls as objects one after another in ONE block, a comma and/or
    whitespace between them; reading the first object only dropped the others unseen, and hid a
    second call cut by ``max_tokens``. An object that does not parse is an invalid call and ends
    the block; so does a comma the answer ends on in a block left open (the next call was cut
    before it began). Text after the last object that opens no other is not part of the calls: a
    block whose ``</tool_call>`` the model left out runs to the end of the answer, prose and all.
    """
    calls, start = [], 0
    while True:
        try:  # on the call's own text, so that an error's position counts from the call's start
            data, length = _JSON.raw_decode(block[start:])
        except json.JSONDecodeError as err:
            return [*calls, _unparsed(block[start:], f"the tool call is not valid JSON: {err}")]
        end = start + length
        calls.append(_call_of(data, block[start:end]))
        start = _BETWEEN_CALLS.match(block, end).end()
        if start == len(block) and not closed and "," in block[end:]:
            return [*calls, _unparsed("", "the answer ends after a comma, before the next tool call")]
        if not block.startswith("{", start):
            return calls


def _unparsed(raw: str, error: str) -> ParsedCall:
    """An invalid call from text that is no JSON object, named where the text shows its name."""
    name = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
    return ParsedCall(name.group(1) if name else None, None, raw, error)


def _call_of(data: Any, raw: str) -> ParsedCall:
    """One decoded JSON value as a call (invalid unless it holds a name and object arguments)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ParsedCall(None, None, raw, 'a tool call needs a JSON object with a "name"')
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            return ParsedCall(data["name"], None, raw, f"the tool call's arguments are not valid JSON: {err}")
    if not isinstance(args, dict):
        return ParsedCall(data["name"], None, raw, "the tool call's arguments are not a JSON object")
    return ParsedCall(data["name"], args, raw)


def _takes_no_arguments(tool: Mapping[str, Any]) -> bool:
    parameters = tool["function"].get("parameters") or {}
    return not parameters.get("properties") and not parameters.get("additionalProperties")


def _named_tool(tool_choice: Mapping[str, Any]) -> Any:
    function = tool_choice.get("function")
    return (function.get("name") if isinstance(function, Mapping) else None) or tool_choice.get("name")


#: the ``tool_choice`` words that name no tool
_CHOICE_WORDS = ("auto", "none", "any", "required")
#: the keys a ``tool_choice`` object may hold: its type, and the tool it names
_CHOICE_KEYS = frozenset({"type", "function", "name"})


def plain_choice(tool_choice: Any) -> Any:
    """A ``tool_choice`` object as what it means; anything else as given.

    ``{"type": "auto" | "none" | "any" | "required"}`` (the object forms of OpenAI and Anthropic)
    is that word; an object naming a tool (OpenAI's ``{"type": "function", "function": {"name":
    ...}}``, Anthropic's ``{"type": "tool", "name": ...}``) stays as it is. Any other object is
    refused: one this did not know (``{"type": "nonee"}``, ``{}``) forced a call, where an unknown
    string is refused, and ``{"type": "any"}`` with one tool bound did not name that tool in the
    opening, as "any" does.
    """
    if not isinstance(tool_choice, Mapping):
        return tool_choice
    kind, name = tool_choice.get("type"), _named_tool(tool_choice)
    if set(tool_choice) <= _CHOICE_KEYS:
        if kind in _CHOICE_WORDS and name is None:
            return kind
        if kind in ("function", "tool") and isinstance(name, str) and name:
            return tool_choice
    raise ConfigError(
        f"tool_choice {tool_choice!r} is no tool choice this model knows: give "
        "{'type': 'auto' | 'none' | 'any' | 'required'}, {'type': 'function', 'function': {'name': ...}}, "
        "{'type': 'tool', 'name': ...}, or the strings 'auto', 'none', 'any', 'required' or a tool's name"
    )


def several_calls(tool_choice: Any, parallel: bool | None) -> bool:
    """Whether an answer's calls all count, or only its first: ``parallel_tool_calls`` false, or a
    ``tool_choice`` naming one tool (a call to that tool, as OpenAI and vLLM read it). The default
    model, forced to name one tool, often goes on to call another in the same block; that call came
    back beside the chosen one, and cut by ``max_tokens`` it voided the chosen call on the server."""
    return parallel is not False and _chosen_tool(plain_choice(tool_choice)) is None


def _chosen_tool(tool_choice: Any) -> str | None:
    """The tool a ``tool_choice`` names (a tool's name, or an object naming one); None otherwise."""
    if isinstance(tool_choice, Mapping):
        return _named_tool(tool_choice)
    return tool_choice if isinstance(tool_choice, str) and tool_choice not in _CHOICE_WORDS else None


def forced_opening(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """The text the assistant's turn opens with so that it calls a tool (see module docstring).

    Ends where the template's own call format continues with a fresh token: after ``"name": "``
    when the model picks the tool, after ``"arguments":`` when the tool is known, after the
    whole call when the known tool takes no arguments.
    """
    tool_choice = plain_choice(tool_choice)
    if tool_choice in (None, "auto", "none"):
        return ""
    names = tool_names(tools)
    if tool_choice in ("any", "required", True):
        name = names[0] if len(names) == 1 else None
    elif isinstance(tool_choice, (str, Mapping)):
        name = _chosen_tool(tool_choice)
    else:
        raise ConfigError(f"tool_choice must be 'auto', 'none', 'any', 'required' or a tool name, got {tool_choice!r}")
    if name is not None and name not in names:
        raise ConfigError(f"tool_choice names {name!r}, which is not among the bound tools ({', '.join(names)})")
    opening = TOOL_CALL_OPEN + '\n{"name": "'
    if name is None:
        return opening
    opening += f'{name}", "arguments":'
    # a tool without parameters has one possible call: write it whole (left open, the model
    # fills an argument-less call with its schema)
    return opening + " {}}" if _takes_no_arguments(tools[names.index(name)]) else opening


def check_tools(tokenizer: Any, model_name: str | None, tools: Sequence[Mapping[str, Any]]) -> None:
    """Refuse tools a model's chat template cannot show it, or whose calls we could not parse back
    (a provider's built-in tool, ``{"type": "web_search_preview"}``, has no function to call)."""
    for tool in tools:
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ConfigError(
                f"tool {tool!r} is no function tool: ChatLookahead takes functions (a LangChain tool, a "
                "Pydantic model, a Python function or an OpenAI function schema)"
            )
    template = chat_template_text(tokenizer)
    if tools and "tools" not in template:
        raise ConfigError(f"{model_name}'s chat template does not take tools")
    if tools and TOOL_CALL_OPEN not in template:
        raise ConfigError(
            f"{model_name}'s chat template does not call tools with <tool_call> (Qwen2.5/Qwen3 style), "
            "the only tool-call output ChatLookahead parses"
        )


@dataclass(frozen=True)
class ToolOptions:
    """How one answer's tool calls are read back."""

    names: tuple[str, ...] = ()  # the tools the model was shown (none: the answer is all text)
    parallel: bool = True  # False: its first call only (see several_calls)


def tool_names(tools: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The function names of tools in OpenAI's form (as :func:`check_tools` takes them)."""
    return tuple(tool["function"]["name"] for tool in tools)


def split_calls(text: str, tool_options: ToolOptions) -> tuple[str, list[ParsedCall]]:
    """An answer as (its text outside tool calls, the calls); with ``parallel`` off (see
    :func:`several_calls`), the first call only. A call naming a tool the model was not shown stays
    a call, as LangChain's chat models return it: LangGraph's tool node answers it with an error
    naming the real tools, and the agent tries again (the server, whose clients dispatch on the
    name, reads such an answer as text)."""
    if not tool_options.names:
        return text, []
    content, calls = parse_tool_calls(text)
    return content, calls if tool_options.parallel else calls[:1]
