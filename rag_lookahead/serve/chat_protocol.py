"""The body of ``POST /v1/chat/completions``: messages (tool calls and tool results included), tools,
``tool_choice``, log-probabilities; what the server does not implement is refused, never ignored.

See :mod:`rag_lookahead.serve.protocol` for the options every generation endpoint shares and for
how a refused field is worded.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, Field, model_validator

from rag_lookahead.serve.api_error import quote
from rag_lookahead.serve.protocol import (
    MAX_LOGPROBS,
    VLLM_NEUTRAL,
    Flag,
    GenerationRequest,
    Integer,
    Text,
    Wording,
    invalid_request,
)
from rag_lookahead.template_variables import reserved_names

__all__ = ["ChatCompletionRequest", "ChatMessage", "FunctionTool"]

Role = Literal["system", "user", "assistant", "tool", "developer"]  # developer: OpenAI's newer name for system

ROLES = get_args(Role)
MESSAGES_REQUIRED = "'messages' is required: a non-empty list of {role, content} objects"
TOOL_CHOICE = '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
#: options that would change the answer and that this server does not implement (null is fine)
REFUSED = {
    "functions": "'functions' is OpenAI's older form of tools: send 'tools' instead",
    "function_call": "'function_call' is OpenAI's older form of tool_choice: send 'tool_choice' instead",
    "audio": "audio output is not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "reasoning_effort": "'reasoning_effort' is not supported by this server: leave it out",
    "verbosity": "'verbosity' is not supported by this server: leave it out",
}

#: vLLM's chat options, with the values under which they change nothing (see protocol.VLLM_NEUTRAL)
VLLM_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "chat_template": (),
    "documents": (),
    "mm_processor_kwargs": (),
}


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    name: Text
    arguments: Text = Field(description="a JSON object, as a string")


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (replayed in the history)."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    @model_validator(mode="after")
    def _arguments_are_an_object(self) -> ToolCall:
        try:
            arguments = json.loads(self.function.arguments) if self.function.arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError):  # nested past the parser's depth: was a 500
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid_request(
                f"the arguments of the call to {self.function.name!r} must be a JSON object in a string", "messages"
            )
        return self

    def for_template(self) -> dict[str, Any]:
        """As chat templates take it: the arguments as an object (Qwen's template writes them as JSON)."""
        arguments = json.loads(self.function.arguments) if self.function.arguments.strip() else {}
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    role: Role
    content: Text | list[TextPart] | None = Field(None, description="a string or text parts (text only)")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: Text | None = Field(None, description="a tool result's call")
    name: Text | None = Field(
        None, description="the participant's name (a tool result's: its function), passed to the chat template"
    )
    refusal: Text | None = Field(None, description="an assistant turn's refusal, its text where content is empty")
    # OpenAI's other message fields, refused: they were dropped unseen, and the answer changed unsaid
    function_call: Any = Field(None, description="not supported: give tool_calls")
    audio: Any = Field(None, description="not supported: text only")

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise invalid_request("only assistant messages carry 'tool_calls'", "messages")
        if self.refusal is not None and self.role != "assistant":
            raise invalid_request("only assistant messages carry 'refusal'", "messages")
        if self.refusal is not None and self._content_text():
            raise invalid_request("an assistant message gives 'content' or 'refusal', not both", "messages")
        if self.function_call is not None:
            raise invalid_request("a message's 'function_call' is not supported: give 'tool_calls'", "messages")
        if self.audio is not None:
            raise invalid_request("a message's 'audio' is not supported (text only)", "messages")
        return self

    def _content_text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def text(self) -> str:
        """The turn's text: its content, or an assistant's refusal (OpenAI sends a refusal with
        ``content: null``; it was dropped, and the next answer was built on an empty turn)."""
        return self._content_text() or self.refusal or ""

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template takes it, as ``apply_chat_template`` and vLLM pass it:
        ``name`` for any role (a template may show who speaks), ``tool_call_id`` for a tool result
        (``tokens.encode_messages`` reads ``developer`` as system)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.role == "tool" and self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.name:
            message["name"] = self.name
        return message


class FunctionSpec(BaseModel):
    name: Annotated[Text, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: Flag | None = Field(None, description="not supported: arguments are not constrained to the schema")


class FunctionTool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class NamedFunction(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

    max_completion_tokens: Integer | None = Field(
        None, json_schema_extra={"minimum": 1}, description="OpenAI's newer name for max_tokens (wins over it)"
    )
    messages: list[ChatMessage] = Field(min_length=1, description="at most the server's --max-messages")
    tools: list[FunctionTool] | None = Field(
        None, description="functions the model may call, shown to it through the chat template"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" (default), "none", "required" or a named function: see serve.tool_calls'
    )
    parallel_tool_calls: Flag | None = Field(None, description="false: the first call only")
    logprobs: Flag | None = Field(None, description="report each answer token's log-probability")
    top_logprobs: Annotated[Integer | None, Wording(hint=" (the most likely tokens reported per answer token)")] = (
        Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: this many most likely tokens at each place")
    )
    modalities: Any = Field(None, description='only ["text"]')
    functions: Any = Field(None, description="not supported: send tools")
    function_call: Any = Field(None, description="not supported: send tool_choice")
    audio: Any = Field(None, description="not supported")
    web_search_options: Any = Field(None, description="not supported")
    reasoning_effort: Any = Field(None, description="not supported")
    verbosity: Any = Field(None, description="not supported")
    chat_template_kwargs: Annotated[
        dict[Text, Any] | None, Wording("'chat_template_kwargs' must be an object of template variables")
    ] = Field(None, description='more variables for the chat template, as in vLLM (e.g. {"enable_thinking": false})')

    vllm_options: ClassVar[dict[str, tuple[Any, ...]]] = {**VLLM_NEUTRAL, **VLLM_CHAT_NEUTRAL}

    @model_validator(mode="after")
    def _something_to_answer(self) -> ChatCompletionRequest:
        if not any(m.text().strip() or m.tool_calls for m in self.messages):
            raise invalid_request("every message is empty", "messages")
        for name, message in REFUSED.items():
            if getattr(self, name) is not None:
                raise invalid_request(message, name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise invalid_request("'modalities' must be [\"text\"]: this server answers in text only", "modalities")
        taken = reserved_names(self.chat_template_kwargs)
        if taken:
            raise invalid_request(
                f"'chat_template_kwargs' cannot set {quote(taken[0])}: the server sets it (send it as a field of "
                "its own where the server takes one)",
                "chat_template_kwargs",
            )
        if self.top_logprobs and not self.logprobs:  # 0 is vLLM's default: asks nothing
            raise invalid_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if any(tool.function.strict for tool in self.tools or ()):
            raise invalid_request(
                "'strict' function tools are not supported: this server does not constrain the arguments to the "
                "schema; leave 'strict' out",
                "tools",
            )
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def answer_length(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.for_template() for tool in self.tools or ()]

    def plain_tool_choice(self) -> str | dict | None:
        """``tool_choice`` as plain data (a named function as ``{"type": ..., "function": {"name": ...}}``)."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, BaseModel) else choice

    @classmethod
    def explain_field(cls, loc: tuple, error: dict) -> str | None:
        if loc[0] == "messages":
            return _explain_message(loc, error)
        if loc[0] == "tools":
            return _explain_tool(loc, error)
        if loc[0] == "tool_choice":
            return TOOL_CHOICE
        return None


def _explain_message(loc: tuple, error: dict) -> str:
    if len(loc) < 2 or not isinstance(loc[1], int):
        return MESSAGES_REQUIRED
    i = loc[1]
    if len(loc) == 2:
        return f"messages[{i}] must be an object with 'role' and 'content'"
    field = loc[2]
    if field == "role":
        role = None if error["type"] == "missing" else error["input"]
        return f"messages[{i}].role must be one of {sorted(ROLES)}, got {quote(role)}"
    if field == "content":
        if len(loc) > 4 or isinstance(error["input"], list):  # inside the list of content parts
            return f'messages[{i}].content parts must be {{"type": "text", "text": ...}} (text only)'
        return f"messages[{i}].content must be a string or a list of text parts"
    if field == "tool_calls":
        return (
            f"messages[{i}].tool_calls must be a list of "
            '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<a JSON object>"}}'
        )
    return f"messages[{i}].{field} must be a string"


def _explain_tool(loc: tuple, error: dict) -> str:
    if len(loc) < 2 or not isinstance(loc[1], int):
        return "'tools' must be a list of function tools"
    where = f"tools[{loc[1]}]" + "".join(f".{part}" for part in loc[2:])
    if loc[2:] == ("function", "name"):
        return f"{where} must be 1 to 64 letters, digits, '_' or '-', got {quote(error['input'])}"
    if loc[2:3] == ("type",):
        return f'{where} must be "function" (function tools only), got {quote(error["input"])}'
    return f'{where} is not valid ({error["msg"]}); a tool is {{"type": "function", "function": {{"name": ...}}}}'
