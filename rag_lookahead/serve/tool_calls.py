"""``tools`` and ``tool_choice`` on ``/v1/chat/completions``, through the chat template.

The tools go to the tokenizer's chat template (a template that does not take them, or does not
call them with Qwen's ``<tool_call>``, the only output we parse back, is refused with 400). The
model's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks come back as OpenAI
``tool_calls`` with ``finish_reason: "tool_calls"``, one call per JSON object (Qwen2.5 often writes
two calls in one block, a comma between them); the parsing is LangChain's
(:mod:`rag_lookahead.langchain.tools`), shared rather than copied. If a call does not parse (cut
short by ``max_tokens``, say, a second object in a block included), or names a function not among
the request's ``tools`` (made to call one, "required" among several, the default model made up a
"hello"; an OpenAI client dispatches on the name it gets), the whole answer comes back as plain
``content`` with the answer's own ``finish_reason`` ("length" when the limit cut it), as vLLM's
Hermes parser does with a call that does not parse. With ``parallel_tool_calls`` false, or a ``tool_choice`` naming one
function, only the first call counts.

``tool_choice``: "auto" (default), "none" (the tools are left out of the prompt), "required" or
a named function: the assistant's turn is opened with ``<tool_call>`` (and the name, when known),
so the model writes the call from there. Streamed, the text before the first ``<tool_call>``
streams as it comes; the calls come whole in one chunk at the end (arguments are not streamed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rag_lookahead.errors import ConfigError
from rag_lookahead.langchain.tools import (
    TOOL_CALL_OPEN,
    ToolOptions,
    check_tools,
    forced_opening,
    several_calls,
    split_calls,
    tool_names,
)
from rag_lookahead.serve.api_error import ApiError

__all__ = ["ToolReply", "ToolSetup", "tool_setup"]


@dataclass(frozen=True)
class ToolSetup:
    """How one chat request uses tools: what the template gets, how the answer opens and is read."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # for the template ([]: no tools)
    opening: str = ""  # text the assistant's turn starts with (a forced call)
    parallel: bool = True  # False: the first call only

    @property
    def hold(self) -> tuple[str, ...]:
        """Markers from which on nothing streams (a call is sent whole, at the end)."""
        return (TOOL_CALL_OPEN,) if self.tools else ()

    def reply(self, text: str) -> ToolReply | None:
        """The answer as content and calls; None when it holds no call, or one that does not parse or
        names a function the request did not give."""
        if not self.tools:
            return None
        names = tool_names(self.tools)
        # first only when not parallel: a broken second call must not void the first
        content, calls = split_calls(text, ToolOptions(names, self.parallel))
        if not calls or any(call.args is None or call.name not in names for call in calls):
            return None  # a call that does not parse, or to a function the request did not give
        return ToolReply(
            content=content,
            calls=[
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.args, ensure_ascii=False)},
                }
                for call in calls
            ],
        )


@dataclass(frozen=True)
class ToolReply:
    content: str  # the text outside the calls
    calls: list[dict[str, Any]]  # OpenAI's tool_calls


def tool_setup(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    parallel: bool | None,
    tokenizer: Any,
    model_name: str,
) -> ToolSetup:
    """The request's tools checked against the model's chat template (400 when it cannot take them)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(
                400, "'tool_choice' asks for a tool call but the request has no 'tools'", param="tool_choice"
            )
        return ToolSetup()
    tools = [dict(tool) for tool in tools]
    names = tool_names(tools)
    if isinstance(tool_choice, Mapping) and tool_choice["function"]["name"] not in names:
        raise ApiError(
            400,
            f"'tool_choice' names {tool_choice['function']['name']!r}, which is not among the request's tools "
            f"({', '.join(names)})",
            param="tool_choice",
        )
    if tool_choice == "none":  # the model is not shown them
        return ToolSetup()
    try:
        check_tools(tokenizer, model_name, tools)
    except ConfigError as error:
        raise ApiError(400, str(error), param="tools") from None
    return ToolSetup(tools, forced_opening(tool_choice, tools), several_calls(tool_choice, parallel))
