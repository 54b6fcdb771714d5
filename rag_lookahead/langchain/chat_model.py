"""ChatLookahead: a LangChain chat model over the lossless lookahead decoder.

    chat = ChatLookahead(model="default", max_tokens=256)          # or model=<loaded model>, tokenizer=...
    chat.invoke([("system", "Answer briefly."), ("human", "What does decoding_length do?")])
    for chunk in chat.stream("..."): print(chunk.content, end="")  # one chunk per accepted block
    chat.batch(["q1", "q2", "q3"])                                 # ONE batched decode for all three
    chat.bind_tools([my_tool]).invoke("...")                      # -> AIMessage.tool_calls
    chat.with_structured_output(Person).invoke("...")             # -> Person, by a forced tool call

Messages go through the tokenizer's chat template (:mod:`.messages`); tools bound with
:meth:`ChatLookahead.bind_tools` go to the template too, and Qwen-style
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` output comes back as
``AIMessage.tool_calls`` (:mod:`.tools`, which also honours ``tool_choice``). ``batch`` decodes all
inputs in one ``generate`` (:mod:`.batching`). Greedy by default; ``temperature > 0`` samples exactly as
``model.generate`` would. Decoding is the same :class:`rag_lookahead.langchain.engine.Engine` as
:class:`rag_lookahead.langchain.llm.LookaheadLLM`'s: ``ChatLookahead.from_llm(llm)`` shares its engine
and output pool, and every ChatLookahead over the same loaded model shares one.

``usage_metadata`` counts prompt and answer tokens; ``response_metadata`` holds ``model_name``,
``finish_reason`` and the decode stats (``new_tokens``, ``forward_passes``, ``mean_accepted``,
``tokens_per_second``, ...). Per call: ``max_tokens``, ``references`` (passages that seed the
draft trie without being in the prompt), ``enable_lookahead``, ``lookahead``, the sampling options,
``timeout``, ``chat_template_kwargs`` (more variables for the chat template, over the field's key by
key: Qwen3's ``{"enable_thinking": False}``); anything else is refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing
from functools import partial
from typing import Any, ClassVar

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt

from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.inputs import check_prompt_room
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.langchain.batching import (
    BatchCall,
    decode_together,
    gather_of_this_thread,
    run_wave,
    settings_key,
    wave_width,
)
from rag_lookahead.langchain.engine import (
    CancellableAsync,
    Engine,
    EngineAccess,
    NotPickled,
    RowRequest,
    check_loaded,
    in_worker_cancellable,
    prompt_format,
)
from rag_lookahead.langchain.messages import (
    call_error,
    chat_generation,
    last_chunk,
    template_messages,
    unsent_text,
)
from rag_lookahead.langchain.sampling_fields import SAMPLING_FIELDS, SamplingFields, resolve_config
from rag_lookahead.langchain.shared_weights import load_shared, shared_engine
from rag_lookahead.langchain.tools import (
    TOOL_CALL_OPEN,
    ToolOptions,
    check_tools,
    forced_opening,
    plain_choice,
    several_calls,
    tool_names,
)
from rag_lookahead.langchain.tools import parse_tool_calls as parse_tool_calls
from rag_lookahead.models import reported_name
from rag_lookahead.template_variables import reserved_names
from rag_lookahead.tokens import chat_template_text, checked_stop, encode_messages

__all__ = ["ChatLookahead", "parse_tool_calls"]

log = logging.getLogger(__name__)

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
    "chat_template_kwargs",
)


# ---------------------------------------------------------------- the chat model


class ChatLookahead(EngineAccess, CancellableAsync, NotPickled, SamplingFields, BaseChatModel):
    """A local chat model decoded with trie-drafted, tree-verified lookahead (output unchanged).

    The sampling fields (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
    ``seed``) come from :class:`~rag_lookahead.langchain.sampling_fields.SamplingFields`."""

    model: Any = Field(default="default", exclude=True, repr=False)
    """"default" (the embedded model), a hub id or local path, or an already loaded model."""
    tokenizer: Any = Field(default=None, exclude=True, repr=False)
    """The loaded model's tokenizer (only with a loaded ``model``)."""
    engine: Any = Field(default=None, exclude=True, repr=False)
    """An :class:`Engine` to decode with (``from_llm`` passes LookaheadLLM's). The engine decodes, so
    ``model`` and ``tokenizer`` are its own: a loaded one given beside it must be the engine's, and
    one assigned (or updated by ``model_copy``) alone takes them from it."""
    model_name: str | None = None
    lookahead: LookaheadConfig = Field(default_factory=LookaheadConfig)
    max_tokens: StrictInt = 256
    """Most new tokens per answer."""
    stop: list[str] | None = None
    """Stop strings used when a call gives none."""
    timeout: StrictFloat | None = None
    """Seconds one call may decode; rows still running then end with ``finish_reason="timeout"``."""
    max_retries: int | None = None
    """Accepted for LangChain's standard parameters; a local decode has no transient failure to retry."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template, as the server's ``chat_template_kwargs`` (Qwen3's
    ``{"enable_thinking": False}``); a call's own go over these key by key. ``apply_chat_template``'s
    own arguments (``add_generation_prompt``, ``tools``, ...) are refused: the model sets those."""
    streaming: bool = False
    """Invoke through the streaming path (token callbacks then see chunks)."""
    dtype: Any = Field(default=None, exclude=True, repr=False)
    device: Any = Field(default=None, exclude=True, repr=False)
    device_map: Any = Field(default=None, exclude=True, repr=False)
    trust_remote_code: StrictBool = Field(default=False, exclude=True, repr=False)
    """With a model id: run the modeling code its repo or folder ships (ChatGLM3, Qwen-1), as
    :func:`rag_lookahead.models.load_model` does; off by default, since that code runs with your rights."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), extra="forbid")
    _name_derived: bool = PrivateAttr(default=False)  # model_name was worked out from the model

    engine_fields: ClassVar[frozenset[str]] = frozenset(
        {"model", "tokenizer", "engine", "dtype", "device", "device_map", "trust_remote_code"}
    )

    def model_post_init(self, __context: Any) -> None:
        super().model_post_init(__context)
        self._settle_built()

    def _settle(self, updated: frozenset[str] | None) -> None:
        if self._new_engine(updated):
            self._engine = self._make_engine(updated)
            if updated is not None and "model_name" not in updated and self._name_derived:
                self.model_name = None  # named after the model it no longer decodes with
        if updated is not None and "model_name" in updated:
            self._name_derived = False
        if self.model_name is None:
            self.model_name = self._derived_name()
            self._name_derived = True
        positive_int("max_tokens", self.max_tokens)
        _check_timeout(self.timeout)
        checked_stop(self.stop)
        _template_variables(self.chat_template_kwargs)
        if not self.lookahead.stop_words:
            self.lookahead = self.lookahead.with_tokenizer(self._engine.tokenizer)
        self._sampling({})  # refuse bad sampling settings at construction

    def _make_engine(self, updated: frozenset[str] | None) -> Engine:
        """The engine to decode with: ``engine`` if given, else one for the loaded or named model.
        ``updated``: the fields a copy or an assignment changed (None: the model is being built)."""
        if self.engine is not None:
            if not isinstance(self.engine, Engine):
                raise ConfigError(f"engine must be a rag_lookahead Engine, got {type(self.engine).__name__}")
            if updated is not None and "engine" in updated and not updated & {"model", "tokenizer"}:
                # another engine alone (chat.engine = llm2.engine): decode with it, and its model and
                # tokenizer become the chat model's, as from_llm sets them
                self.model, self.tokenizer = self.engine.model, self.engine.tokenizer
            else:
                self._check_engine_matches()
            return self.engine
        if isinstance(self.model, str):
            if self.tokenizer is not None:
                raise ConfigError("give a tokenizer only with a loaded model; a model id loads its own")
            model, tokenizer = load_shared(self.model, self.dtype, self.device, self.device_map, self.trust_remote_code)
        else:
            if self.model is None or self.tokenizer is None:
                raise ConfigError("ChatLookahead needs a model id, or a loaded model and its tokenizer")
            check_loaded(self.model, self.tokenizer)  # model=5: "cannot create weak reference to 'int' object"
            model, tokenizer = self.model, self.tokenizer
        return shared_engine(model, tokenizer, self.lookahead)

    def _check_engine_matches(self) -> None:
        """A loaded ``model`` or a ``tokenizer`` given (or updated) beside ``engine`` must be the
        engine's own: the engine decodes, so ``chat.model = other`` on a chat model from ``from_llm``
        (or a copy updating ``model``) went on answering with the engine's model, with no word of it."""
        for name, own in (("model", self.engine.model), ("tokenizer", self.engine.tokenizer)):
            given = getattr(self, name)
            if given is not None and not isinstance(given, str) and given is not own:
                raise ConfigError(
                    f"this ChatLookahead decodes with the engine it was given (from_llm), not with the {name} "
                    f"given beside it: to decode with another {name}, drop the engine too, "
                    f"model_copy(update={{{name!r}: ..., 'engine': None}}), "
                    f"or build it from a LookaheadLLM on that {name}"
                )

    def _derived_name(self) -> str:
        if isinstance(self.model, str):
            return reported_name(self.model) if self.engine is None else self.model
        path = getattr(getattr(self._engine.model, "config", None), "_name_or_path", "") or ""
        return str(path).rstrip("/").rsplit("/", 1)[-1] or "custom"

    @classmethod
    def from_llm(cls, llm: Any, **kwargs: Any) -> ChatLookahead:
        """A chat model decoding with ``llm``'s engine (same weights, same output pool) and its settings."""
        from rag_lookahead.langchain.llm import LookaheadLLM

        if not isinstance(llm, LookaheadLLM):
            raise ConfigError(f"from_llm takes a LookaheadLLM, got {type(llm).__name__}")
        if llm.system_prompt:  # a chat model takes it as a message: carrying it over silently was impossible
            raise ConfigError(
                "from_llm cannot carry llm.system_prompt over (a chat model takes it as a SystemMessage): "
                "give it as the first message of each call, or build the LookaheadLLM without system_prompt"
            )
        settings: dict[str, Any] = {
            "model_name": llm.model_name,
            "lookahead": llm.lookahead,
            "max_tokens": llm.max_new_tokens,
            "stop": llm.stop,
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
        # and what tells models and cut answers apart: the weights (two loaded models may share a
        # name) and the timeout (an answer cut by it must not be served to a call without one)
        # "default_stop": LangChain sets "stop" to the call's own stop list, which replaced the field
        params = {"model_name": self.model_name, "max_tokens": self.max_tokens, "default_stop": self.stop}
        params |= {"weights": self._engine.fingerprint, "timeout": self.timeout}
        params["prompt_format"] = prompt_format(self._engine.tokenizer)
        # the field under its own name: a call's chat_template_kwargs (merged key by key over it)
        # replaced it in LangChain's key, and two models of other fields shared cached answers
        params["default_chat_template_kwargs"] = self.chat_template_kwargs
        return params | self._sampling_params()

    def _require_template(self, tokenizer: Any = None) -> None:
        """A conversation needs the template's roles and turns: without one its contents were joined
        and answered as one text (as the server's chat route did). ``tokenizer``: the call's (by
        default the current engine's)."""
        if not chat_template_text(self._engine.tokenizer if tokenizer is None else tokenizer):
            raise ConfigError(
                "the tokenizer has no chat template, so messages cannot be made into a prompt:"
                " ChatLookahead needs a chat model (LookaheadLLM takes a base model's text)"
            )

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """The prompt tokens these messages make through the chat template, as a call encodes them
        (LangChain's default counted "Human: ..." lines: a history ``trim_messages`` fitted to the
        window by it still overflowed it). A system message alone counts what it adds to a
        conversation (its turn, less the default system prompt a template such as Qwen's puts in
        where none is given: it may be negative), so that it and the rest, counted apart as
        ``trim_messages(include_system=True)`` counts them, add up to the whole (the price:
        ``strategy="first"``, which counts it alone first, may keep it alone where its real prompt
        is over ``max_tokens`` by up to the default system prompt and the generation prompt; every
        longer prefix is exact). Where the template
        refuses the messages as they stand (``trim_messages`` counts partial lists: a list that opens
        with an assistant turn), LangChain's count of them, so trimming goes on. With
        ``custom_get_token_ids``, LangChain's count through it, as its own models count."""
        if not messages:
            return 0
        if self.custom_get_token_ids is not None:
            return super().get_num_tokens_from_messages(messages, tools)
        self._require_template()
        formatted = [convert_to_openai_tool(t) for t in tools or ()]
        try:
            chat = template_messages(messages, to_answer=False)
            if len(chat) == 1 and chat[0]["role"] == "system":
                # counted alone it held the generation prompt and not the default system prompt,
                # both of which the rest's count holds: the whole fitted the window, and the trim
                # kept the system message only
                probe = {"role": "user", "content": "?"}
                return self._template_tokens([*chat, probe], formatted) - self._template_tokens([probe], formatted)
            return self._template_tokens(chat, formatted)
        except InputError:
            return super().get_num_tokens_from_messages(messages)

    def _template_tokens(self, chat: list[dict], tools: list[dict]) -> int:
        tokenizer = self._engine.tokenizer
        return len(encode_messages(tokenizer, chat, tools=tools or None, template_variables=self.chat_template_kwargs))

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        model = kwargs.get("model")  # LangChain's contract for tracing; a per-call model is refused at decode time
        name = model if isinstance(model, str) else self.model_name or ""
        params = LangSmithParams(ls_provider="rag_lookahead", ls_model_name=name, ls_model_type="chat")
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is None or isinstance(temperature, (int, float)):  # else refused at decode time
            params["ls_temperature"] = float(temperature or 0)
        params["ls_max_tokens"] = kwargs.get("max_tokens") or self.max_tokens
        stop = checked_stop(stop or self.stop)  # first to see a call's stop: a generator, read here, would be lost
        if stop:
            params["ls_stop"] = stop
        return params

    def get_engine(self) -> Engine:
        """The decoding engine (shared with LookaheadLLM and other chat models on the same model)."""
        return self._engine

    def bind_tools(
        self,
        tools: Sequence[Mapping[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | Mapping[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools: they go to the chat template, and Qwen-style calls come back as ``tool_calls``.

        ``tool_choice``: "auto" (default), "none", "any"/"required" (some tool must be called), or a
        tool's name (that tool must be called); or the objects OpenAI and Anthropic write for these
        (:func:`~rag_lookahead.langchain.tools.plain_choice`). A call to a tool not bound comes back
        as a call (see :func:`~rag_lookahead.langchain.tools.split_calls`).
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        check_tools(self._engine.tokenizer, self.model_name, formatted)
        forced_opening(tool_choice, formatted)  # refuse a bad choice now, not at the first call
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: str = "function_calling",
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """LangChain's structured output by function calling: ``schema`` is bound as the tool the
        answer must call (:meth:`bind_tools`, ``tool_choice="any"``) and the call parsed back, with
        ``include_raw`` as LangChain's (``{"raw", "parsed", "parsing_error"}``).

        An answer whose call did not parse (cut by ``max_tokens`` or the timeout, or not valid
        JSON) raises an ``OutputParserException`` naming the cause, or with ``include_raw=True``
        has it as ``parsing_error``: LangChain's parsers look for such a call in
        ``additional_kwargs``, where OpenAI's messages carry it (ours hold it in
        ``invalid_tool_calls``), and returned None with no error. An answer with no call at all is
        None, as LangChain gives it. ``method`` "json_schema" and "json_mode" and ``strict`` are
        taken, as LangChain's standard tests ask of every chat model, and served by the same forced
        call: this decoder does no constrained decoding, so nothing holds the answer to the schema
        as it is written; a pydantic schema validates the parsed call (and raises where it does
        not fit). Another ``method`` or option is refused.
        """
        if method not in STRUCTURED_METHODS:
            raise ConfigError(
                f"with_structured_output(method={method!r}) is not a method: use one of "
                f"{', '.join(map(repr, STRUCTURED_METHODS))} (all served by a forced tool call)"
            )
        if kwargs:
            raise ConfigError(
                f"unknown option(s) for with_structured_output: {', '.join(sorted(kwargs))} "
                "(known: include_raw, method, strict)"
            )
        del strict  # taken for LangChain's signature; the forced call is what each method gets
        structured = super().with_structured_output(schema, include_raw=True)
        # a stream parses partial calls and drops the schema's ValidationError: parsed again whole
        whole = (
            PydanticToolsParser(tools=[schema], first_tool_only=True)
            if isinstance(schema, type) and issubclass(schema, BaseModel)
            else None
        )
        check = partial(_checked_structured_output, include_raw=include_raw, whole=whole)
        return structured | RunnableLambda(check, name="check_structured_output")

    # ------------------------------------------------------------ one call's request

    def check_messages(
        self, messages: LanguageModelInput, what: str = "the input", advice: str = "", **kwargs: Any
    ) -> int:
        """The prompt's length in tokens as a call with ``messages`` and the call options ``kwargs``
        (``tools``, ``chat_template_kwargs``, ...) will decode it; ``InputError`` if it leaves no
        room in the context window, naming the prompt ``what`` and ending with ``advice``
        (``"; ask with a smaller k"``), or the error the call would fail with. For a caller that
        built the prompt (the RAG chains) to say, before decoding, what made it too long.
        ``messages``: any input ``invoke`` takes (a string, a prompt value, messages, or
        ``("human", "...")`` tuples and dicts), converted as ``invoke`` converts it."""
        messages = self._convert_input(messages).to_messages()
        request, _, _ = self._prepare(messages, None, {**kwargs, "references": []}, room=(what, advice))
        return len(request.ids)

    def _prepare(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict,
        engine: Engine | None = None,
        room: tuple[str, str] = ("the input", ""),
    ) -> tuple[RowRequest, dict, ToolOptions]:
        """(the row to decode, ``Engine.run``'s settings, the call's tool options) for one call on
        ``engine`` (by default the current one), which the call read once: an assignment of ``model``
        or ``tokenizer`` meanwhile (another thread's) builds another engine, and a call that read it
        again encoded with one tokenizer and decoded with the other engine. ``room``: what a prompt
        that leaves no room for an answer is called, and the advice after it."""
        engine = self._engine if engine is None else engine
        kwargs = {k: v for k, v in kwargs.items() if k != "stream"}  # LangChain's own switch
        config = resolve_config(self.lookahead, kwargs)
        max_tokens = kwargs.pop("max_tokens", None)
        max_tokens = positive_int("max_tokens", self.max_tokens if max_tokens is None else max_tokens)
        timeout = _check_timeout(kwargs.pop("timeout", None))
        timeout = self.timeout if timeout is None else timeout
        tools = list(kwargs.pop("tools", None) or [])
        tool_choice = plain_choice(kwargs.pop("tool_choice", None))  # {"type": "none"} showed the tools
        parallel = kwargs.pop("parallel_tool_calls", None)
        references = kwargs.pop("references", None)
        template_variables = {
            **(self.chat_template_kwargs or {}),
            **_template_variables(kwargs.pop("chat_template_kwargs", None)),
        }
        sampling = self._sampling(kwargs, engine)
        if kwargs:
            raise ConfigError(
                f"unknown option(s) for ChatLookahead: {', '.join(sorted(kwargs))} "
                f"(known: {', '.join(_CALL_OPTIONS + SAMPLING_FIELDS)})"
            )
        if tool_choice not in (None, "auto", "none") and not tools:
            raise ConfigError(f"tool_choice={tool_choice!r} but no tools are bound")
        tools = [convert_to_openai_tool(t) for t in tools]
        check_tools(engine.tokenizer, self.model_name, tools)
        opening = forced_opening(tool_choice, tools)
        if tool_choice == "none":
            tools = []
        self._require_template(engine.tokenizer)
        chat = template_messages(messages)
        ids = encode_messages(
            engine.tokenizer,
            chat,
            tools=tools or None,
            answer_prefix=opening,
            template_variables=template_variables,
        )
        check_prompt_room(engine.model, len(ids), *room)  # here, so a batch fails this input alone
        passages = self._references(references, chat, engine)
        request = RowRequest(
            ids,
            stop if stop is not None else self.stop,
            engine.passages(passages),
            answer_prefix=opening,
            hold=(TOOL_CALL_OPEN,) if tools else (),
        )
        settings = {"max_new_tokens": max_tokens, "config": config, "sampling": sampling, "timeout": timeout or None}
        return request, settings, ToolOptions(tool_names(tools), several_calls(tool_choice, parallel))

    def _references(self, references: Any, chat: list[dict], engine: Engine) -> list[str]:
        if references is None:
            return engine.seeds.lookup("\n".join(str(m["content"]) for m in chat))
        if not isinstance(references, (list, tuple)) or not all(isinstance(p, str) for p in references):
            raise InputError("references must be a list of passages (strings)")
        return list(references)

    # ------------------------------------------------------------ BaseChatModel hooks

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._decode(messages, stop, run_manager, kwargs)

    def _decode(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
        cancel: threading.Event | None = None,
    ) -> ChatResult:
        engine = self._engine  # once per call (see _prepare)
        request, settings, tool_options = self._prepare(messages, stop, kwargs, engine)
        on_block = None
        if run_manager is not None:

            def on_block(tokens: list[int], piece: str) -> None:
                if piece:
                    run_manager.on_llm_new_token(
                        piece, chunk=ChatGenerationChunk(message=AIMessageChunk(content=piece))
                    )

        call = BatchCall(request, settings, settings_key(settings), on_block)
        gather = gather_of_this_thread(run_manager.run_id if run_manager is not None else None)
        if gather is not None:
            cancel = gather.cancel
        if gather is not None and gather.engine is engine:
            gather.submit(call)
        else:
            if gather is not None:  # the batch's engine was replaced since it began: this row decodes alone
                gather.leave()
            decode_together(engine, [call], cancel)
        if call.error is not None:
            raise call.error
        if cancel is not None and cancel.is_set():  # an answer cut short is no answer: never cached
            raise asyncio.CancelledError()
        generation = chat_generation(call.run, call.row, tool_options, self.model_name)
        if on_block is not None:
            on_block([], unsent_text(call.run, call.row, generation.message.content))
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
        yield from self._decode_stream(messages, stop, run_manager, kwargs)

    def _decode_stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
        cancel: threading.Event | None = None,
    ) -> Iterator[ChatGenerationChunk]:
        """``_stream``'s chunks; a set ``cancel`` ends the decode (``astream``, see CancellableAsync)."""
        gather = gather_of_this_thread(run_manager.run_id if run_manager is not None else None)
        if gather is not None:  # a streamed row decodes alone: the batch must not wait for it
            gather.leave()
        engine = self._engine  # once per call (see _prepare)
        request, settings, tool_options = self._prepare(messages, stop, kwargs, engine)
        blocks = engine.stream([request], cancel, **settings)
        with closing(iter(blocks)) as it:
            for block in it:
                if block.piece:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=block.piece))
        yield last_chunk(blocks.run, tool_options, self.model_name)

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
        as usual); their ``_generate`` calls meet in a :class:`~.batching.Gather` and decode together.
        """
        if len(inputs) <= 1:
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        return self._batch(inputs, config, return_exceptions, kwargs)

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """:meth:`batch` in a worker thread: one batched decode, the event loop stays free. A
        cancelled caller ends the decode at its next block (and starts no further wave)."""
        if len(inputs) <= 1:  # through ainvoke, which cancels its own decode
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        return await in_worker_cancellable(self._batch, inputs, config, return_exceptions, kwargs)

    def _batch(
        self, inputs: list, config, return_exceptions: bool, kwargs: dict, cancel: threading.Event | None = None
    ) -> list[Any]:
        configs = get_config_list(config, len(inputs))
        width = wave_width(configs[0].get("max_concurrency"), len(inputs))
        results: list[Any] = []
        for start in range(0, len(inputs), width):
            if cancel is not None and cancel.is_set():
                raise asyncio.CancelledError()
            wave = slice(start, start + width)
            results.extend(
                run_wave(self._engine, self.invoke, inputs[wave], configs[wave], return_exceptions, kwargs, cancel)
            )
        return results


#: ``with_structured_output``'s methods, all served by a forced tool call (no constrained decoding)
STRUCTURED_METHODS = ("function_calling", "json_schema", "json_mode")


def _checked_structured_output(output: Mapping[str, Any], include_raw: bool, whole: Runnable | None = None) -> Any:
    """LangChain's ``include_raw=True`` output of :meth:`ChatLookahead.with_structured_output`
    with the error of a call that did not parse, raised (``include_raw`` false) or as its
    ``parsing_error``. A stream's chunks come here added up, so it ends the same way: where its
    parser gave nothing for a call, ``whole`` (the pydantic schema's parser) parses it again, so
    a call that does not fit the schema raises as ``invoke``'s does (the stream gave None)."""
    raw, parsed, error = output["raw"], output.get("parsed"), output.get("parsing_error")
    if parsed is None and error is None and whole is not None and raw.tool_calls:
        try:
            parsed = whole.invoke(raw)
        except Exception as err:  # noqa: BLE001 - the schema's ValidationError, as invoke raises it
            error = err
    if parsed is None and error is None:
        error = _unparsed_call(raw)
    if include_raw:
        return {"raw": raw, "parsed": parsed, "parsing_error": error}
    if error is not None:
        raise error
    return parsed


def _unparsed_call(message: AIMessage) -> OutputParserException | None:
    """Why an answer that gave no structured output has none: its call cut (by ``max_tokens`` or
    the timeout) or not valid; None where it made no call (text only)."""
    finish = message.response_metadata.get("finish_reason")
    if finish == "length":
        why = "the answer was cut by max_tokens before its tool call was complete: raise max_tokens"
    elif finish == "timeout":
        why = "the answer was cut by the timeout before its tool call was complete: raise timeout"
    elif message.invalid_tool_calls:
        why = f"the model's tool call is not valid: {call_error(message.invalid_tool_calls[0])}"
    else:
        return None
    return OutputParserException(f"no structured output: {why}")


def _template_variables(variables: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` (a field's or a call's) as a dict, refused unless a mapping of names
    none of which is ``apply_chat_template``'s own argument (the server refuses the same ones)."""
    if variables is None:
        return {}
    if not isinstance(variables, Mapping) or not all(isinstance(name, str) for name in variables):
        raise ConfigError(
            f"chat_template_kwargs must be a dict of template variables by name, got {type(variables).__name__}"
        )
    taken = reserved_names(variables)
    if taken:
        raise ConfigError(
            f"chat_template_kwargs cannot set {taken[0]!r}: it is an argument of apply_chat_template, which "
            "ChatLookahead sets itself (tools are bound with bind_tools)"
        )
    return dict(variables)


def _check_timeout(timeout: Any) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return timeout
