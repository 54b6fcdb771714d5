"""ChatLookahead: a LangChain chat model over the lossless lookahead decoder.

    chat = ChatLookahead(model="default", max_tokens=256)          # or model=<loaded model>, tokenizer=...
    chat.invoke([("system", "Answer briefly."), ("human", "What does decoding_length do?")])
    for chunk in chat.stream("..."): print(chunk.content, end="")  # one chunk per accepted block
    chat.batch(["q1", "q2", "q3"])                                 # ONE batched decode for all three
    chat.bind_tools([my_tool]).invoke("...")                      # -> AIMessage.tool_calls

Messages go through the tokenizer's chat template; tools bound with :meth:`ChatLookahead.bind_tools`
go to the template too, and Qwen-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
output comes back as ``AIMessage.tool_calls``. A ``tool_choice`` other than "auto" is honoured
by opening the assistant's turn with ``<tool_call>`` (and the tool's name when it is known), so
the model writes the call from there. Greedy by default; ``temperature > 0`` samples exactly as
``model.generate`` would. Decoding is the same :class:`rag_lookahead.langchain.engine.Engine` as
:class:`rag_lookahead.langchain.llm.LookaheadLLM`'s: ``ChatLookahead.from_llm(llm)`` shares its engine
and output pool, and every ChatLookahead over the same loaded model shares one.

``usage_metadata`` counts prompt and answer tokens; ``response_metadata`` holds ``model_name``,
``finish_reason`` and the decode stats (``new_tokens``, ``forward_passes``, ``mean_accepted``,
``tokens_per_second``, ...). Per call: ``max_tokens``, ``references`` (passages that seed the
draft trie without being in the prompt), ``enable_lookahead``, ``lookahead``, the sampling options,
``timeout``; anything else is refused.
"""

from __future__ import annotations

import contextvars
import json
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
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
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_config_list, run_in_executor
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr, ValidationError

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.langchain.engine import (
    SAMPLING_FIELDS,
    Engine,
    EngineRun,
    RowRequest,
    check_max_tokens,
    resolve_config,
    sampling_options,
    settings_error,
)
from rag_lookahead.tokens import chat_template_text, encode_messages

__all__ = ["ChatLookahead", "parse_tool_calls"]

DEFAULT_MODEL_NAME = "qwen2.5-coder-0.5b-instruct"
TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "timeout"}
#: per-call options besides the sampling fields
_CALL_OPTIONS = (
    "max_tokens",
    "references",
    "enable_lookahead",
    "lookahead",
    "timeout",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
#: content blocks an assistant turn may carry besides text; its tool_calls hold the same calls
_AI_CALL_BLOCKS = frozenset({"tool_use", "tool_call", "tool_call_chunk", "function_call", "server_tool_call"})


# ---------------------------------------------------------------- loading and sharing


_LOADED: dict[tuple, tuple[Any, Any]] = {}
_LOAD_LOCK = threading.Lock()
_ENGINES: weakref.WeakKeyDictionary[Any, Engine] = weakref.WeakKeyDictionary()


def _load(model_id: str, dtype: Any, device: Any, device_map: Any) -> tuple[Any, Any]:
    """``load_model`` once per (id, dtype, device): chat models built from the same id share the weights."""
    from rag_lookahead.models import load_model

    key = (model_id, str(dtype), str(device), repr(device_map))
    with _LOAD_LOCK:
        if key not in _LOADED:
            _LOADED[key] = load_model(model_id, dtype=dtype, device=device, device_map=device_map)
        return _LOADED[key]


def _shared_engine(model: Any, tokenizer: Any, config: LookaheadConfig) -> Engine:
    """One engine (so one output pool) per loaded model and tokenizer."""
    with _LOAD_LOCK:
        engine = _ENGINES.get(model)
        if engine is None or engine.tokenizer is not tokenizer:
            engine = Engine(model, tokenizer, config)
            _ENGINES[model] = engine
        return engine


# ---------------------------------------------------------------- messages and tool calls


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
    """A LangChain message as a chat-template dict (role, content, tool_calls, tool_call_id)."""
    text = _text_of(message)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": text}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": text}
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": text}
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for c in message.tool_calls
            ]
        return out
    if isinstance(message, ToolMessage):
        return {"role": "tool", "content": text, "tool_call_id": message.tool_call_id, "name": message.name}
    if isinstance(message, FunctionMessage):
        return {"role": "tool", "content": text, "name": message.name}
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": text}
    raise InputError(f"unsupported message type {type(message).__name__}")


def template_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """Messages for ``apply_chat_template``; consecutive system messages become one (templates take one)."""
    out: list[dict] = []
    for message in messages:
        item = _template_message(message)
        if item["role"] == "system" and out and out[-1]["role"] == "system":
            out[-1]["content"] += "\n\n" + item["content"]
        else:
            out.append(item)
    if not out or not any(m["content"] or m.get("tool_calls") for m in out):
        raise InputError("the messages are empty: give the model a question or an instruction")
    return out


@dataclass
class ParsedCall:
    name: str | None
    args: dict | None
    raw: str
    error: str | None = None
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """Split Qwen-style output into (text outside the calls, the calls).

    Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` becomes a :class:`ParsedCall`;
    one whose JSON does not parse (cut short by ``max_tokens``, say) keeps its raw text and error.
    """
    parts, calls, pos = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        parts.append(text[pos : match.start()])
        pos = match.end()
        calls.append(_parse_call(match.group(1).strip()))
    parts.append(text[pos:])
    return "".join(parts), calls


def _parse_call(raw: str) -> ParsedCall:
    try:  # the first JSON value; text after it (before a missing </tool_call>) is not part of the call
        data = json.JSONDecoder().raw_decode(raw)[0]
    except json.JSONDecodeError as err:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
        return ParsedCall(name.group(1) if name else None, None, raw, f"the tool call is not valid JSON: {err}")
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


def _tool_name(tool: Mapping[str, Any]) -> str:
    return tool["function"]["name"]


def _takes_no_arguments(tool: Mapping[str, Any]) -> bool:
    parameters = tool["function"].get("parameters") or {}
    return not parameters.get("properties") and not parameters.get("additionalProperties")


def _forced_opening(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """The text the assistant's turn opens with so that it calls a tool (see module docstring).

    Ends where the template's own call format continues with a fresh token: after ``"name": "``
    when the model picks the tool, after ``"arguments":`` when the tool is known, after the
    whole call when the known tool takes no arguments.
    """
    if tool_choice in (None, "auto", "none"):
        return ""
    names = [_tool_name(t) for t in tools]
    if tool_choice in ("any", "required", True):
        name = names[0] if len(names) == 1 else None
    elif isinstance(tool_choice, str):
        name = tool_choice
    elif isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
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


# ---------------------------------------------------------------- one batch, one decode


@dataclass
class _Call:
    """One row's request inside a batch: what to decode and how, and where its result goes."""

    request: RowRequest
    settings: dict
    key: tuple
    on_block: Callable[[list[int], str], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    run: EngineRun | None = None
    row: int = 0
    error: BaseException | None = None


class _Gather:
    """The rows of one ``batch()`` call, met from their worker threads and decoded together.

    Each worker either hands its row over (:meth:`submit`, from ``_generate``) or says it has
    none (:meth:`leave`: a cache hit, an error, a streamed row). When every worker has done one
    or the other, the last to arrive decodes all the rows in one ``generate`` per group of
    identical settings, and the others wake up with their results.
    """

    def __init__(self, engine: Engine, size: int) -> None:
        self.engine = engine
        self.size = size
        self.calls: list[_Call] = []
        self.left = 0
        self.fired = False
        self.lock = threading.Lock()

    def submit(self, call: _Call) -> None:
        with self.lock:
            late = self.fired
            if not late:
                self.calls.append(call)
            leader = not late and self._ready()
        if late:
            _decode_together(self.engine, [call])
        elif leader:
            self._decode_all()
        call.done.wait()

    def leave(self) -> None:
        with self.lock:
            self.left += 1
            leader = self._ready()
        if leader:
            self._decode_all()

    def _ready(self) -> bool:
        if self.fired or len(self.calls) + self.left < self.size:
            return False
        self.fired = True
        return True

    def _decode_all(self) -> None:
        groups: dict[tuple, list[_Call]] = {}
        for call in self.calls:
            groups.setdefault(call.key, []).append(call)
        for calls in groups.values():
            _decode_together(self.engine, calls)


def _decode_together(engine: Engine, calls: list[_Call]) -> None:
    """One ``generate`` for ``calls`` (same settings); each gets its run and row, or the error."""

    def on_block(row: int, tokens: list[int], piece: str) -> None:
        callback = calls[row].on_block
        if callback is not None:
            callback(tokens, piece)

    deadlines = [c.settings["deadline"] for c in calls if c.settings["deadline"] is not None]
    settings = calls[0].settings | {"deadline": min(deadlines) if deadlines else None}
    try:
        run = engine.run([c.request for c in calls], on_block=on_block, **settings)
        for row, call in enumerate(calls):
            call.run, call.row = run, row
    except BaseException as err:  # every waiting row gets it
        for call in calls:
            call.error = err
    finally:
        for call in calls:
            call.done.set()


@dataclass
class _Seat:
    """A batch worker's ticket: used once, to submit a row or to leave."""

    gather: _Gather
    used: bool = False

    def take(self) -> _Gather | None:
        if self.used:
            return None
        self.used = True
        return self.gather


_SEAT: contextvars.ContextVar[_Seat | None] = contextvars.ContextVar("rag_lookahead_batch_seat", default=None)


# ---------------------------------------------------------------- the chat model


class ChatLookahead(BaseChatModel):
    """A local chat model decoded with trie-drafted, tree-verified lookahead (output unchanged)."""

    model: Any = Field(default="default", exclude=True, repr=False)
    """"default" (the embedded model), a hub id or local path, or an already loaded model."""
    tokenizer: Any = Field(default=None, exclude=True, repr=False)
    """The loaded model's tokenizer (only with a loaded ``model``)."""
    engine: Any = Field(default=None, exclude=True, repr=False)
    """An :class:`Engine` to decode with (``from_llm`` passes LookaheadLLM's); overrides model/tokenizer."""
    model_name: str | None = None
    lookahead: LookaheadConfig = Field(default_factory=LookaheadConfig)
    max_tokens: int = 256
    """Most new tokens per answer."""
    temperature: float | None = None
    """None or 0: greedy. Above 0: sample (lossless: the model's own sampling distribution)."""
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    """Sampling: a fixed seed makes each answer reproducible, whatever else is in the batch."""
    stop: list[str] | None = None
    """Stop strings used when a call gives none."""
    timeout: float | None = None
    """Seconds one call may decode; rows still running then end with ``finish_reason="timeout"``."""
    max_retries: int | None = None
    """Accepted for LangChain's standard parameters; a local decode has no transient failure to retry."""
    streaming: bool = False
    """Invoke through the streaming path (token callbacks then see chunks)."""
    dtype: Any = Field(default=None, exclude=True, repr=False)
    device: Any = Field(default=None, exclude=True, repr=False)
    device_map: Any = Field(default=None, exclude=True, repr=False)

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), extra="forbid")

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:  # pydantic wraps our ConfigError: hand it over as raised
            raise settings_error(type(self).__name__, err) from None

    def model_post_init(self, __context: Any) -> None:
        super().model_post_init(__context)
        self._engine = self._make_engine()
        if self.model_name is None:
            self.model_name = self._derived_name()
        check_max_tokens("max_tokens", self.max_tokens)
        _check_timeout(self.timeout)
        if isinstance(self.stop, str):
            raise ConfigError("stop must be a list of strings")
        if not self.lookahead.stop_words:
            self.lookahead = self.lookahead.with_tokenizer(self._engine.tokenizer)
        self._sampling({})  # refuse bad sampling settings at construction

    def _make_engine(self) -> Engine:
        if self.engine is not None:
            if not isinstance(self.engine, Engine):
                raise ConfigError(f"engine must be a rag_lookahead Engine, got {type(self.engine).__name__}")
            return self.engine
        if isinstance(self.model, str):
            if self.tokenizer is not None:
                raise ConfigError("give a tokenizer only with a loaded model; a model id loads its own")
            model, tokenizer = _load(self.model, self.dtype, self.device, self.device_map)
        else:
            if self.model is None or self.tokenizer is None:
                raise ConfigError("ChatLookahead needs a model id, or a loaded model and its tokenizer")
            model, tokenizer = self.model, self.tokenizer
        return _shared_engine(model, tokenizer, self.lookahead)

    def _derived_name(self) -> str:
        if self.model == "default" and self.engine is None:
            return DEFAULT_MODEL_NAME
        if isinstance(self.model, str):
            return self.model
        path = getattr(getattr(self._engine.model, "config", None), "_name_or_path", "") or ""
        return str(path).rstrip("/").rsplit("/", 1)[-1] or "custom"

    @classmethod
    def from_llm(cls, llm: Any, **kwargs: Any) -> ChatLookahead:
        """A chat model decoding with ``llm``'s engine (same weights, same output pool) and its settings."""
        from rag_lookahead.langchain.llm import LookaheadLLM

        if not isinstance(llm, LookaheadLLM):
            raise ConfigError(f"from_llm takes a LookaheadLLM, got {type(llm).__name__}")
        settings: dict[str, Any] = {
            "model_name": llm.model_name,
            "lookahead": llm.lookahead,
            "max_tokens": llm.max_new_tokens,
            **{name: getattr(llm, name) for name in SAMPLING_FIELDS},
        }
        return cls(model=llm.model, tokenizer=llm.tokenizer, engine=llm.engine, **(settings | kwargs))

    # ------------------------------------------------------------ LangChain plumbing

    @property
    def _llm_type(self) -> str:
        return "rag_lookahead-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        # only what changes the text: draft settings change speed, never output
        params = {"model_name": self.model_name, "max_tokens": self.max_tokens, "stop": self.stop}
        return params | {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        model = kwargs.get("model")  # LangChain's contract for tracing; a per-call model is refused at decode time
        name = model if isinstance(model, str) else self.model_name or ""
        params = LangSmithParams(ls_provider="rag_lookahead", ls_model_name=name, ls_model_type="chat")
        temperature = kwargs.get("temperature", self.temperature)
        params["ls_temperature"] = float(temperature or 0)
        params["ls_max_tokens"] = kwargs.get("max_tokens") or self.max_tokens
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    @property
    def output_pool(self):
        return self._engine.output_pool

    def get_engine(self) -> Engine:
        """The decoding engine (shared with LookaheadLLM and other chat models on the same model)."""
        return self._engine

    def register_seeds(self, anchors: Sequence[str], passages: Sequence[str]) -> None:
        """Seed any later prompt whose messages contain every string in ``anchors`` with ``passages``
        (see :class:`rag_lookahead.rag.chains.SeedingRetriever`)."""
        self._engine.seeds.register(anchors, passages)

    def bind_tools(
        self,
        tools: Sequence[Mapping[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | Mapping[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools: they go to the chat template, and Qwen-style calls come back as ``tool_calls``.

        ``tool_choice``: "auto" (default), "none", "any"/"required" (some tool must be called), or a
        tool's name (that tool must be called).
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        self._check_tools(formatted)
        _forced_opening(tool_choice, formatted)  # refuse a bad choice now, not at the first call
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)

    def _check_tools(self, tools: Sequence[Mapping[str, Any]]) -> None:
        template = chat_template_text(self._engine.tokenizer)
        if tools and "tools" not in template:
            raise ConfigError(f"{self.model_name}'s chat template does not take tools")
        if tools and TOOL_CALL_OPEN not in template:
            raise ConfigError(
                f"{self.model_name}'s chat template does not call tools with <tool_call> (Qwen2.5/Qwen3 style), "
                "the only tool-call output ChatLookahead parses"
            )

    # ------------------------------------------------------------ one call's request

    def _sampling(self, kwargs: dict) -> dict:
        return sampling_options(
            self._engine.model, {name: kwargs.pop(name, getattr(self, name)) for name in SAMPLING_FIELDS}
        )

    def _prepare(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict
    ) -> tuple[RowRequest, dict, dict]:
        """(the row to decode, ``Engine.run``'s settings, the call's tool options) for one call."""
        kwargs = {k: v for k, v in kwargs.items() if k != "stream"}  # LangChain's own switch
        config = resolve_config(self.lookahead, kwargs)
        max_tokens = check_max_tokens("max_tokens", kwargs.pop("max_tokens", None) or self.max_tokens)
        timeout = _check_timeout(kwargs.pop("timeout", None)) or self.timeout
        tools = list(kwargs.pop("tools", None) or [])
        tool_choice = kwargs.pop("tool_choice", None)
        parallel = kwargs.pop("parallel_tool_calls", None)
        references = kwargs.pop("references", None)
        sampling = self._sampling(kwargs)
        if kwargs:
            raise ConfigError(
                f"unknown option(s) for ChatLookahead: {', '.join(sorted(kwargs))} "
                f"(known: {', '.join(_CALL_OPTIONS + SAMPLING_FIELDS)})"
            )
        if tool_choice not in (None, "auto", "none") and not tools:
            raise ConfigError(f"tool_choice={tool_choice!r} but no tools are bound")
        tools = [convert_to_openai_tool(t) for t in tools]
        self._check_tools(tools)
        opening = _forced_opening(tool_choice, tools)
        if tool_choice == "none":
            tools = []
        chat = template_messages(messages)
        ids = encode_messages(self._engine.tokenizer, chat, tools=tools or None, answer_prefix=opening)
        passages = self._references(references, chat)
        request = RowRequest(
            ids,
            stop if stop is not None else self.stop,
            self._engine.passages(passages),
            answer_prefix=opening,
            hold=(TOOL_CALL_OPEN,) if tools else (),
        )
        deadline = time.monotonic() + timeout if timeout else None
        settings = {"max_new_tokens": max_tokens, "config": config, "sampling": sampling, "deadline": deadline}
        return request, settings, {"tools": bool(tools), "parallel": parallel is not False}

    def _references(self, references: Any, chat: list[dict]) -> list[str]:
        if references is None:
            return self._engine.seeds.lookup("\n".join(str(m["content"]) for m in chat))
        if isinstance(references, str) or not all(isinstance(p, str) for p in references):
            raise InputError("references must be a list of passages (strings)")
        return list(references)

    # ------------------------------------------------------------ results

    def _usage(self, run: EngineRun, row: int) -> UsageMetadata:
        prompt, answer = run.prompt_tokens[row], len(run.trackers[row].ids)
        return UsageMetadata(input_tokens=prompt, output_tokens=answer, total_tokens=prompt + answer)

    def _info(self, run: EngineRun, row: int, calls: list[ParsedCall]) -> dict:
        finish = "tool_calls" if any(c.args is not None for c in calls) else _FINISH[run.stopped_by(row)]
        return {"model_name": self.model_name, "finish_reason": finish, **run.info(row)}

    def _split(self, text: str, tool_options: dict) -> tuple[str, list[ParsedCall]]:
        if not tool_options["tools"]:
            return text, []
        content, calls = parse_tool_calls(text)
        return content, calls if tool_options["parallel"] else calls[:1]

    def _message(self, run: EngineRun, row: int, tool_options: dict) -> ChatGeneration:
        content, calls = self._split(run.trackers[row].final_text(), tool_options)
        message = AIMessage(
            content=content,
            tool_calls=[
                {"name": c.name, "args": c.args, "id": c.id, "type": "tool_call"} for c in calls if c.args is not None
            ],
            invalid_tool_calls=[
                {"name": c.name, "args": c.raw, "id": c.id, "error": c.error, "type": "invalid_tool_call"}
                for c in calls
                if c.args is None
            ],
            usage_metadata=self._usage(run, row),
        )
        return ChatGeneration(message=message, generation_info=self._info(run, row, calls))

    def _last_chunk(self, run: EngineRun, tool_options: dict) -> ChatGenerationChunk:
        """The closing chunk: the rest of the text, the tool calls whole, usage and stats."""
        content, calls = self._split(run.trackers[0].final_text(), tool_options)
        rest = _rest(run, 0, content)
        chunks = [
            {
                "name": c.name,
                "args": json.dumps(c.args, ensure_ascii=False) if c.args is not None else c.raw,
                "id": c.id,
                "index": i,
                "type": "tool_call_chunk",
            }
            for i, c in enumerate(calls)
        ]
        message = AIMessageChunk(
            content=rest, tool_call_chunks=chunks, usage_metadata=self._usage(run, 0), chunk_position="last"
        )
        return ChatGenerationChunk(message=message, generation_info=self._info(run, 0, calls))

    # ------------------------------------------------------------ BaseChatModel hooks

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request, settings, tool_options = self._prepare(messages, stop, kwargs)
        on_block = None
        if run_manager is not None:

            def on_block(tokens: list[int], piece: str) -> None:
                if piece:
                    run_manager.on_llm_new_token(
                        piece, chunk=ChatGenerationChunk(message=AIMessageChunk(content=piece))
                    )

        call = _Call(request, settings, _settings_key(settings), on_block)
        seat = _SEAT.get()
        gather = seat.take() if seat is not None else None
        if gather is not None:
            gather.submit(call)
        else:
            _decode_together(self._engine, [call])
        if call.error is not None:
            raise call.error
        generation = self._message(call.run, call.row, tool_options)
        if on_block is not None:
            on_block([], _rest(call.run, call.row, generation.message.content))
        return ChatResult(generations=[generation], llm_output={"model_name": self.model_name})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """One chunk per accepted block that adds text; the last chunk carries the tool calls,
        ``usage_metadata`` and the stats (``chunk_position="last"``). LangChain itself sends each
        chunk to the token callbacks."""
        seat = _SEAT.get()
        gather = seat.take() if seat is not None else None
        if gather is not None:  # a streamed row decodes alone: the batch must not wait for it
            gather.leave()
        request, settings, tool_options = self._prepare(messages, stop, kwargs)
        blocks = self._engine.stream([request], **settings)
        with closing(iter(blocks)) as it:
            for block in it:
                if block.piece:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=block.piece))
        yield self._last_chunk(blocks.run, tool_options)

    # ------------------------------------------------------------ batches: one decode

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Answer all ``inputs`` in one batched decode (per ``max_concurrency`` wave, if one is set).

        Each input still runs through ``invoke`` in its own thread (callbacks, tracing, caching
        as usual); their ``_generate`` calls meet in a :class:`_Gather` and decode together.
        """
        if len(inputs) <= 1:
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        configs = get_config_list(config, len(inputs))
        width = configs[0].get("max_concurrency") or len(inputs)
        results: list[Any] = []
        for start in range(0, len(inputs), width):
            wave = slice(start, start + width)
            results.extend(self._batch_wave(inputs[wave], configs[wave], return_exceptions, kwargs))
        return results

    def _batch_wave(self, inputs: list, configs: list[RunnableConfig], return_exceptions: bool, kwargs: dict) -> list:
        gather = _Gather(self._engine, len(inputs))

        def one(i: int) -> Any:
            seat = _Seat(gather)
            _SEAT.set(seat)
            try:
                return self.invoke(inputs[i], configs[i], **kwargs)
            except Exception as err:
                if return_exceptions:
                    return err
                raise
            finally:
                if seat.take() is not None:
                    gather.leave()

        with ThreadPoolExecutor(max_workers=len(inputs), thread_name_prefix="lookahead-batch") as pool:
            futures = [pool.submit(contextvars.copy_context().run, one, i) for i in range(len(inputs))]
            return [f.result() for f in futures]

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """:meth:`batch` in a worker thread: one batched decode, the event loop stays free."""
        return await run_in_executor(
            None, lambda: self.batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        )


def _check_timeout(timeout: Any) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return timeout


def _settings_key(settings: dict) -> tuple:
    """Rows decode together only under identical settings (generate takes one of each); rows
    with a deadline go apart from rows without one."""
    sampling = tuple(sorted(settings["sampling"].items()))
    return (settings["max_new_tokens"], repr(settings["config"]), sampling, settings["deadline"] is None)


def _rest(run: EngineRun, row: int, content: str) -> str:
    """What the row's answer text still lacks after the pieces emitted block by block."""
    emitted = run.trackers[row].emitted
    return content[len(emitted) :] if content.startswith(emitted) else ""
