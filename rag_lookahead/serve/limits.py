"""The server's own limits on a request that its model already accepted.

These depend on the :class:`~rag_lookahead.serve.config.ServerConfig` (and, for prompts, on the
model), which the request models of :mod:`rag_lookahead.serve.protocol` (and
:mod:`~rag_lookahead.serve.chat_protocol`) cannot know. Each
refusal is a 400 that names the setting, so the client knows which flag the operator set.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rag_lookahead.decoding.inputs import no_room_words
from rag_lookahead.serve.api_error import ApiError, quote
from rag_lookahead.serve.config import ServerConfig

if TYPE_CHECKING:
    from rag_lookahead.serve.chat_protocol import ChatMessage
    from rag_lookahead.serve.engine import Engine

__all__ = [
    "answer_length",
    "check_prompt_length",
    "checked_messages",
    "checked_prompt",
    "checked_stop",
    "checked_text_length",
    "prompt_fits",
]


def answer_length(name: str, value: int | None, config: ServerConfig) -> int:
    """``max_tokens`` (or the field named ``name``) within 1..max_tokens_limit; the default when None."""
    if value is None:
        return config.default_tokens
    limit = config.max_tokens_limit
    if not 1 <= value <= limit:
        raise ApiError(
            400,
            f"'{name}' must be between 1 and {limit} (the server's max_tokens limit is {limit}), got {quote(value)}",
            param=name,
        )
    return value


def checked_stop(stop: Sequence[str], config: ServerConfig) -> list[str]:
    """The non-empty stop strings, at most ``max_stop`` of at most ``max_stop_chars`` each."""
    if len(stop) > config.max_stop:
        raise ApiError(
            400, f"'stop' has {len(stop)} strings; at most {config.max_stop} are allowed (max_stop)", param="stop"
        )
    if any(len(s) > config.max_stop_chars for s in stop):
        raise ApiError(
            400, f"a 'stop' string is longer than {config.max_stop_chars} characters (max_stop_chars)", param="stop"
        )
    return [s for s in stop if s]


def checked_messages(
    messages: Sequence[ChatMessage], config: ServerConfig, template_inputs: Sequence[Any] = ()
) -> list[dict[str, Any]]:
    """At most ``max_messages`` messages, as the chat template takes them. Everything the template
    writes into the prompt counts toward the length judged before tokenizing: the messages whole
    (tool calls' arguments too) and ``template_inputs`` (the tools, the template's variables);
    text in a tool's description went around the bound and was tokenized, under the one lock."""
    if len(messages) > config.max_messages:
        raise ApiError(
            400,
            f"'messages' has {len(messages)} entries; at most {config.max_messages} are allowed (max_messages)",
            param="messages",
        )
    chat = [m.for_template() for m in messages]
    # the contents as they are (JSON would count each newline twice), the rest as JSON
    rest = [{k: v for k, v in m.items() if k != "content"} for m in chat]
    size = sum(len(str(m.get("content") or "")) for m in chat)
    size += len(json.dumps([rest, *template_inputs], ensure_ascii=False, default=str))
    checked_text_length(size, config, "messages", what="the messages, tools and template variables", verb="have")
    return chat


#: the most characters a token is taken to cover when a text is judged too long before tokenizing
CHARS_PER_TOKEN_BOUND = 32


def checked_text_length(
    chars: int, config: ServerConfig, param: str, what: str | None = None, verb: str = "has"
) -> None:
    """Refuse a text that cannot fit ``max_prompt_tokens`` before it is tokenized: tokenizing a 4 MiB
    prompt took 3.4 s under the one tokenizer lock, only to be refused, and others waited behind it.
    The bound is generous (32 characters a token; a token covers 1-5 on real text)."""
    limit = config.max_prompt_tokens * CHARS_PER_TOKEN_BOUND
    if chars > limit:
        raise ApiError(
            400,
            f"{what or repr(param)} {verb} {chars} characters, more than this server's prompt limit "
            f"({config.max_prompt_tokens} tokens, max_prompt_tokens) can hold",
            param=param,
        )


def prompt_fits(length: int, engine: Engine) -> bool:
    """Whether ``length`` tokens fit ``max_prompt_tokens`` and leave the model's context room for an
    answer (what :func:`check_prompt_length` refuses otherwise)."""
    limit = engine.context_limit
    return length <= engine.config.max_prompt_tokens and (limit is None or length < limit)


def check_prompt_length(length: int, engine: Engine, param: str, what: str, advice: str = "") -> None:
    """400 unless ``length`` tokens fit ``max_prompt_tokens`` and leave the model's context room for
    an answer (for the whole prompt, or a part of it that must fit on its own: /v1/rag's question)."""
    if prompt_fits(length, engine):
        return
    config = engine.config
    if length > config.max_prompt_tokens:
        raise ApiError(
            400,
            f"{what} has {length} tokens; this server accepts at most {config.max_prompt_tokens} "
            f"(max_prompt_tokens){advice}",
            param=param,
        )
    if engine.context_limit is not None and length >= engine.context_limit:
        raise ApiError(
            400,
            no_room_words(engine.model, length, engine.context_limit, what, advice),
            param=param,
        )


def checked_prompt(
    ids: list[int], engine: Engine, param: str = "prompt", what: str = "the prompt", advice: str = ""
) -> list[int]:
    """Prompt ids that are not empty, fit ``max_prompt_tokens`` and the model's context, and are in
    its vocabulary. ``what`` names the prompt and ``advice`` says how to shorten it where the
    server built it (``/v1/rag``: the question with its passages)."""
    if not ids:
        raise ApiError(400, f"{what} is empty", param=param)
    check_prompt_length(len(ids), engine, param, what, advice)
    if engine.vocab_size and any(t >= engine.vocab_size for t in ids):
        raise ApiError(
            400, f"{what} holds token ids outside the model's vocabulary (size {engine.vocab_size})", param=param
        )
    return ids
