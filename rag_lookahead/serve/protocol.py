"""The request bodies of the OpenAI-compatible endpoints, as pydantic models.

FastAPI validates each body against its model, and the OpenAPI schema at ``/docs`` is drawn
from them. What a model cannot know, the server's own limits (``max_tokens_limit``,
``max_stop``, ``max_messages``, the prompt's length in tokens), is checked afterwards by
:mod:`rag_lookahead.serve.limits`.

A refused request gets one message naming the first bad field, in the server's words
(``'n' must be between 1 and 8 (at most 8 choices a request), got 9``), not pydantic's list:
each model turns its validation errors into one ``invalid_request`` error (:func:`explain`),
which the app answers with 400. Unknown fields are ignored (clients send many); options the
server does not implement are refused, never ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from rag_lookahead.decoding.sampling import MIN_REPETITION_PENALTY, MIN_TEMPERATURE
from rag_lookahead.serve.api_error import quote
from rag_lookahead.serve.generate_options import MAX_TEMPERATURE, neutral, refused_generate_option

__all__ = [
    "INVALID_REQUEST",
    "CompletionRequest",
    "GenerationRequest",
    "RagRequest",
    "explain",
]

Integer = Annotated[int, Strict()]  # a JSON integer: not 1.0, "1" or true
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an integer is a number too
Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
TokenIds = list[Integer]

MAX_CHOICES = 8
MAX_LOGPROBS = 20  # most likely tokens reported per place, as vLLM's default max_logprobs
INVALID_REQUEST = "invalid_request"
PROMPT_REQUIRED = "'prompt' is required: a string or a list of token ids"
QUESTION_REQUIRED = "'question' is required: a non-empty string"


@dataclass(frozen=True)
class Wording:
    """How a refused field is worded; pydantic keeps this ``Annotated`` metadata and ignores it.

    ``message``: the whole message, whatever is wrong with the value. Without it the message is
    built from the field's type and bounds in the JSON schema, with ``hint`` after the bounds.
    """

    message: str = ""
    hint: str = ""


def invalid_request(message: str, param: str | None) -> PydanticCustomError:
    """The one error a refused body raises; the app answers it with 400 and this message."""
    return PydanticCustomError(INVALID_REQUEST, "{message}", {"message": message, "param": param})


class OpenAIRequest(BaseModel):
    """A request body: unknown fields are ignored, the first bad field is refused in our words."""

    model_config = ConfigDict(extra="ignore")

    @classmethod
    def explain_field(cls, loc: tuple, error: dict) -> str | None:
        """A request's own wording for an error at ``loc`` (None: worded from the field's schema)."""
        return None

    @model_validator(mode="wrap")
    @classmethod
    def _one_message(cls, data: Any, handler: Any) -> Any:
        try:
            return handler(data)
        except ValidationError as error:
            raise invalid_request(*explain(cls, error.errors(include_url=False)[0])) from None


# vLLM's own sampling options (and a few of transformers' generate), each with the values under
# which it changes nothing. Clients written for vLLM send them; any other value would be answered
# as if it had not been asked.
VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "logits_processors": ([],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "return_tokens_as_token_ids": (False,),
    # transformers' generate options that clients of text-generation-inference style servers send
    "typical_p": (1, 1.0),
    "epsilon_cutoff": (0, 0.0),
    "eta_cutoff": (0, 0.0),
    "no_repeat_ngram_size": (0,),
    "num_beams": (1,),
}
#: the options of VLLM_NEUTRAL that are transformers' generation-config settings of the same name:
#: one given (at its neutral value) is passed on, so it overrides the model config's, as the same
#: argument to model.generate does (typical_p: 1 turns off a config's typical_p 0.9)
GENERATION_CONFIG_OPTIONS = ("typical_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "num_beams")
#: vLLM's completion-only options (a raw prompt gets the special tokens unless told otherwise)
VLLM_COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {"add_special_tokens": (True,)}


def refuse_changing_options(data: Any, table: dict[str, tuple[Any, ...]], why: str | None = None) -> None:
    """Refuse the first option of ``table`` in the raw body ``data`` set to a value that changes
    the answer: unknown fields are dropped before validation, so these are looked for here.
    ``why``: the refusal's words after the option's name (default: this server does not support it)."""
    if not isinstance(data, dict):
        return
    for name, values in table.items():
        if not neutral(data.get(name), values):
            if why is not None:
                raise invalid_request(f"'{name}' {why}", name)
            default = f" (or send {json.dumps(values[0])})" if values else ""
            raise invalid_request(f"'{name}' is not supported by this server: leave it out{default}", name)


def refuse_generate_options(data: Any, taken: frozenset[str], **endpoint: Any) -> None:
    """Refuse the first of transformers' generation options in the raw body ``data`` that would
    change the answer (see :mod:`generate_options`); ``taken``: the names the endpoint reads itself;
    ``endpoint``: what :func:`refused_generate_option` is told of it."""
    refused = refused_generate_option(data, skip=taken, **endpoint)
    if refused is not None:
        raise invalid_request(refused[1], refused[0])


class StreamOptions(BaseModel):
    include_usage: Flag | None = Field(None, description="send a last chunk with the token usage")
    include_obfuscation: Flag | None = Field(None, description="OpenAI's padding field: accepted, never sent")

    #: vLLM's stream options, with the values under which they change nothing
    vllm_options: ClassVar[dict[str, tuple[Any, ...]]] = {"continuous_usage_stats": (False,)}

    @model_validator(mode="before")
    @classmethod
    def _known_options_only(cls, data: Any) -> Any:
        # an option left unseen changed the stream without a word (vLLM's usage on every chunk)
        if isinstance(data, dict):
            for name, value in data.items():
                if name in cls.model_fields or neutral(value, cls.vllm_options.get(name, ())):
                    continue
                raise invalid_request(
                    f"'stream_options' may hold only 'include_usage' here, got {quote(name)}: {json.dumps(value)}",
                    "stream_options",
                )
        return data


class GenerationRequest(OpenAIRequest):
    """What ``/v1/completions`` and ``/v1/chat/completions`` share: OpenAI's options, plus vLLM's
    ``top_k``, ``min_p`` and ``repetition_penalty``. ``temperature`` 0 or absent is greedy;
    sampling is lossless too (each row draws exactly from the model's distribution)."""

    model: Annotated[Text | None, Wording("'model' must be a string of at most 256 characters")] = Field(
        None, max_length=256, description="reported back; the server serves one model"
    )
    n: Annotated[Integer | None, Wording(hint=f" (at most {MAX_CHOICES} choices a request)")] = Field(
        1, ge=1, le=MAX_CHOICES, description="independent choices; choice i of a seeded request draws with seed + i"
    )
    best_of: Annotated[Integer | None, Wording(hint=" (best_of is not supported)")] = Field(1, ge=1, le=1)
    temperature: Number | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: Integer | None = Field(None, ge=-1, le=1 << 31, description="0 and -1: off, as in vLLM")
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Number | None = Field(None, gt=0.0, le=10.0, description="as transformers applies it")
    seed: Annotated[Integer | None, Wording(hint=" (choice i of a request draws with seed + i)")] = Field(
        None, ge=0, le=(1 << 63) - MAX_CHOICES, description="same seed, same text"
    )
    max_tokens: Integer | None = Field(
        None, json_schema_extra={"minimum": 1}, description="at most the server's --max-tokens-limit"
    )
    stop: Annotated[Text | list[Text] | None, Wording("'stop' must be a string or a list of strings")] = Field(
        None, description="at most --max-stop strings of at most --max-stop-chars characters"
    )
    stream: Flag | None = Field(None, description="server-sent events in OpenAI's chunk shapes")
    stream_options: Annotated[StreamOptions | None, Wording("'stream_options' must be an object")] = None
    user: Annotated[Text | None, Wording("'user' must be a string")] = Field(
        None, description="OpenAI's end-user id: accepted, not stored"
    )
    response_format: Any = Field(None, description='only {"type": "text"}: decoding is not constrained')
    stop_token_ids: Annotated[TokenIds | None, Wording("'stop_token_ids' must be a list of token ids")] = Field(
        None, description="vLLM's: only the model's own end-of-answer ids (the server stops at them anyway)"
    )
    presence_penalty: Any = Field(None, description="not supported: leave it out (or 0)")
    frequency_penalty: Any = Field(None, description="not supported: leave it out (or 0)")
    logit_bias: Any = Field(None, description="not supported")
    echo: Any = Field(None, description="not supported")
    suffix: Any = Field(None, description="not supported")
    # only their neutral values are taken (VLLM_NEUTRAL); given, they override the model config's
    typical_p: Any = Field(None, description="only 1 (off); given, it turns off the model config's")
    epsilon_cutoff: Any = Field(None, description="only 0 (off); given, it turns off the model config's")
    eta_cutoff: Any = Field(None, description="only 0 (off); given, it turns off the model config's")
    no_repeat_ngram_size: Any = Field(None, description="only 0 (off)")
    num_beams: Any = Field(None, description="only 1 (no beam search)")

    #: vLLM's options this endpoint knows, with their neutral values (subclasses add their own)
    vllm_options: ClassVar[dict[str, tuple[Any, ...]]] = VLLM_NEUTRAL

    @model_validator(mode="before")
    @classmethod
    def _refuse_vllm_options(cls, data: Any) -> Any:
        refuse_changing_options(data, cls.vllm_options)
        refuse_generate_options(data, frozenset(cls.vllm_options).union(cls.model_fields), fields=cls.model_fields)
        return data

    @model_validator(mode="after")
    def _refuse_what_is_not_implemented(self) -> GenerationRequest:
        if self.temperature and self.temperature < MIN_TEMPERATURE:
            # 1e-300 turned the logits into inf/nan and failed every request of the batch
            raise invalid_request(
                f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature!r}",
                "temperature",
            )
        if (
            self.temperature
            and self.repetition_penalty is not None
            and self.repetition_penalty < MIN_REPETITION_PENALTY
        ):
            raise invalid_request(  # a seen token's logit / 1e-300 is inf: the draw failed with a 500
                f"'repetition_penalty' must be at least {MIN_REPETITION_PENALTY:g} when sampling, "
                f"got {self.repetition_penalty!r}",
                "repetition_penalty",
            )
        if self.response_format is not None and self.response_format != {"type": "text"}:  # chat; vLLM's completions
            kind = self.response_format.get("type") if isinstance(self.response_format, dict) else None
            raise invalid_request(
                f"'response_format' {quote(kind or self.response_format)} is not supported: this server does not "
                'constrain decoding to a format or a schema; leave it out (or send {"type": "text"})',
                "response_format",
            )
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise invalid_request("'stream_options' is only allowed with 'stream': true", "stream_options")
        if self.choices > 1 and self.stream:
            raise invalid_request("'n' > 1 is not supported with 'stream': send n requests instead", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and value != 0:
                raise invalid_request(
                    f"'{name}' is not supported (use repetition_penalty, as transformers applies it): leave it out",
                    name,
                )
        for name in ("logit_bias", "echo", "suffix"):
            if getattr(self, name):
                raise invalid_request(f"'{name}' is not supported by this server", name)
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        """The most likely tokens to report per answer token; None: no log-probabilities asked."""
        return None

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def answer_length(self) -> tuple[str, int | None]:
        """The field that sets the answer's length and its value (None: not given)."""
        return "max_tokens", self.max_tokens

    def sampling_options(self) -> dict:
        """The request's sampling fields in ``model.generate``'s terms. A field left out is not given,
        so the model's generation config holds, as in ``model.generate`` (its repetition penalty;
        sampling, its top_k, top_p and min_p, else transformers' defaults). A field given holds over
        the config's, neutral ones too: ``typical_p: 1`` was taken and dropped, and a config's
        ``typical_p`` 0.9 refused the sampled request it had turned off."""
        if not self.temperature:  # 0 or absent: greedy
            options: dict = {"do_sample": False}
        else:
            options = {"do_sample": True, "temperature": self.temperature}
            if self.top_k is not None:
                options["top_k"] = self.top_k if self.top_k > 0 else None  # 0 and -1: off, as in vLLM
            if self.top_p is not None:
                options["top_p"] = self.top_p
            if self.min_p is not None:
                options["min_p"] = self.min_p or None  # 0: off
        if self.repetition_penalty is not None:
            options["repetition_penalty"] = self.repetition_penalty
        for name in GENERATION_CONFIG_OPTIONS:
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    def choice_sampling(self, base, choice: int):
        """Choice ``choice`` of ``n`` under ``base`` (the resolved settings): a seeded request's
        choice i draws with ``seed + i``, so distinct choices draw distinct tokens."""
        if not base.do_sample or self.seed is None:
            return base
        return dataclasses.replace(base, seed=self.seed + choice)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: a raw prompt, no chat template."""

    prompt: Annotated[Text | TokenIds | list[Text | TokenIds], Wording(PROMPT_REQUIRED)] = Field(
        description="a string or a list of token ids, or a list of them (several prompts: not streamed; "
        "choice i of prompt p is choices[p * n + i])"
    )
    logprobs: Annotated[Integer | None, Wording(hint=" (the most likely tokens reported per answer token)")] = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="report each answer token's log-probability and this many most likely tokens at its place",
    )
    top_logprobs: Any = Field(None, description="chat completions only: here 'logprobs' is the count")
    max_completion_tokens: Any = Field(None, description="chat completions only: here 'max_tokens' sets the length")

    vllm_options: ClassVar[dict[str, tuple[Any, ...]]] = {**VLLM_NEUTRAL, **VLLM_COMPLETION_NEUTRAL}
    #: what only /v1/chat/completions takes, with the values under which each changes nothing (as
    #: /v1/rag takes them); others were dropped unseen: a tool_choice "required" answered plain text
    chat_only: ClassVar[dict[str, tuple[Any, ...]]] = {
        "tools": ([],),
        "tool_choice": ("none",),
        "functions": ([],),
        "function_call": ("none",),
        "modalities": (["text"],),
        "chat_template_kwargs": ({},),
    }
    _prompts: list[str | list[int]] = PrivateAttr(default_factory=list)  # set by the validator

    @model_validator(mode="before")
    @classmethod
    def _refuse_chat_options(cls, data: Any) -> Any:
        from rag_lookahead.serve.chat_protocol import REFUSED  # it imports this module

        refuse_changing_options(
            data,
            {**dict.fromkeys(REFUSED, ()), **cls.chat_only},
            "is a chat completions field, not taken by /v1/completions (a raw prompt, no chat template): "
            "leave it out, or send messages to /v1/chat/completions",
        )
        return data

    @model_validator(mode="after")
    def _checked_prompts(self) -> CompletionRequest:
        """One prompt, or several (langchain's OpenAI LLM sends up to 20 a request), each checked alone."""
        prompt = self.prompt
        one = isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt))
        prompts = [prompt] if one else list(prompt)
        if not prompts:
            raise invalid_request(PROMPT_REQUIRED, "prompt")
        for i, text_or_ids in enumerate(prompts):
            name = f"'prompt'[{i}]" if len(prompts) > 1 else "'prompt'"
            if not text_or_ids:
                raise invalid_request(f"{name} is empty", "prompt")
            if isinstance(text_or_ids, list) and any(t < 0 for t in text_or_ids):
                raise invalid_request(f"token ids in {name} must be >= 0", "prompt")
        if len(prompts) > 1 and self.stream:
            raise invalid_request(
                "'prompt' holds several prompts, which are not supported with 'stream': send one prompt per "
                "streamed request",
                "prompt",
            )
        self._prompts = prompts
        if self.top_logprobs is not None:
            raise invalid_request(
                "'top_logprobs' is a chat completions field: on /v1/completions, 'logprobs' is the number of "
                "most likely tokens to report",
                "top_logprobs",
            )
        if self.max_completion_tokens is not None:  # it was dropped unseen, as vLLM drops it here
            raise invalid_request(
                "'max_completion_tokens' is a chat completions field: on /v1/completions, send 'max_tokens'",
                "max_completion_tokens",
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or token ids."""
        return self._prompts

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class RagRequest(OpenAIRequest):
    """``POST /v1/rag``: retrieve from the loaded index, answer from the passages."""

    question: Annotated[Text, Wording(QUESTION_REQUIRED)]
    k: Annotated[Integer | None, Wording(hint=" (passages shown to the model)")] = Field(
        None, ge=1, le=32, description="passages shown to the model (default --k-prompt; the rest seed the drafter)"
    )
    max_tokens: Integer | None = Field(
        None, json_schema_extra={"minimum": 1}, description="at most the server's --max-tokens-limit"
    )
    stream: Flag | None = Field(None, description="server-sent events: sources, deltas, done")

    #: what the generation endpoints take and this one does not, with the values under which each
    #: changes nothing (OpenAI clients send their defaults); others were dropped unseen (a 'stop'
    #: the answer ran past, a 'temperature' answered greedily). A seed changes no greedy answer.
    generation_only: ClassVar[dict[str, tuple[Any, ...]]] = {
        "temperature": (0, 0.0),  # greedy, as this endpoint answers
        "top_p": (1, 1.0),
        "top_k": (0, -1),
        "min_p": (0, 0.0),
        "repetition_penalty": (),  # none is neutral: the answer takes the model config's (1.05 in Qwen2.5-Instruct)
        "n": (1,),
        "best_of": (1,),
        "presence_penalty": (0, 0.0),
        "frequency_penalty": (0, 0.0),
        "logit_bias": ({},),
        "stop": ([], "", [""]),  # as the chat endpoints drop an empty stop string
        "stop_token_ids": ([],),
        "echo": (False,),
        "suffix": ("",),
        "response_format": ({"type": "text"},),
        "logprobs": (False, 0),
        "top_logprobs": (0,),
        "tools": ([],),
        "tool_choice": ("none",),
        "functions": ([],),
        "function_call": ("none",),
        "max_completion_tokens": (),  # this endpoint's is max_tokens
        "prompt": (),
        "messages": (),
        "modalities": (["text"],),
        "chat_template_kwargs": ({},),
    }

    @model_validator(mode="before")
    @classmethod
    def _refuse_generation_options(cls, data: Any) -> Any:
        from rag_lookahead.serve.chat_protocol import REFUSED, VLLM_CHAT_NEUTRAL  # it imports this module

        refuse_changing_options(
            data,
            cls.generation_only,
            "is not taken by /v1/rag, which answers greedily from the passages with {question, k, max_tokens, "
            "stream}: leave it out (or retrieve yourself and send /v1/chat/completions)",
        )
        # the answer goes through the chat template: its options would change it as in chat
        chat_options = {**VLLM_NEUTRAL, **VLLM_CHAT_NEUTRAL, **dict.fromkeys(REFUSED, ())}
        refuse_changing_options(data, {k: v for k, v in chat_options.items() if k not in cls.generation_only})
        refuse_generate_options(
            data,
            frozenset(chat_options).union(cls.generation_only, cls.model_fields),
            fields=cls.model_fields,  # no advice to send what it refuses (stop, n)
            greedy_only=True,
        )
        return data

    @model_validator(mode="after")
    def _a_question(self) -> RagRequest:
        if not self.question.strip():
            raise invalid_request(QUESTION_REQUIRED, "question")
        return self


# ---------------------------------------------------------------- one message from pydantic's errors


def explain(model: type[BaseModel], error: dict) -> tuple[str, str | None]:
    """The message and the field name of the first validation error of ``model``."""
    if error["type"] == INVALID_REQUEST:
        return error["ctx"]["message"], error["ctx"]["param"]
    loc = error["loc"]
    if not loc:
        return "the request body must be a JSON object", None
    name = str(loc[0])
    own = model.explain_field(loc, error) if issubclass(model, OpenAIRequest) else None
    if own is not None:
        return own, name
    field = model.model_fields[name]
    nested = _nested_model(field.annotation)
    if len(loc) > 1 and nested is not None:
        return explain(nested, {**error, "loc": loc[1:]})[0], name  # param: the request's own field
    wording = next((m for m in field.metadata if isinstance(m, Wording)), Wording())
    if wording.message:
        return wording.message, name
    return _from_schema(_schema_of(model, name), name, error["input"], wording.hint), name


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


@functools.cache
def _properties(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema()["properties"]


def _schema_of(model: type[BaseModel], name: str) -> dict[str, Any]:
    """The JSON schema of field ``name``, its non-null branch."""
    schema = _properties(model)[name]
    branches = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    return branches[0] if branches else {}


def _from_schema(schema: dict[str, Any], name: str, value: Any, hint: str) -> str:
    got = quote(value)
    kind = schema.get("type")
    if kind == "boolean":
        return f"'{name}' must be true or false, got {got}"
    low, high = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
    if kind == "number":
        opening = "(" if "exclusiveMinimum" in schema else "["
        return f"'{name}' must be a number in {opening}{low}, {high}], got {got}"
    if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
        span = f"between {low} and {high}" if high is not None else f">= {low}"
        return f"'{name}' must be {span}{hint}, got {got}"
    if kind == "integer":
        return f"'{name}' must be an integer, got {got}"
    return f"'{name}' is not valid here, got {got}"
