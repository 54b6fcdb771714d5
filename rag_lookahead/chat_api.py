"""The Lookahead article's ``model.chat`` call for any model with a chat template.

``response, history = model.chat(tokenizer, query, history, generation_config=...)`` in the
article comes from the model's own remote code (Qwen-1, ChatGLM3). Here it is one function
over any chat-template model, decoding through ``model.generate(custom_generate=hf_generate)``
so the answer equals ``model.generate``'s for the same generation config::

    answer, history = rag_lookahead.chat(model, tokenizer, "What does the budget option do?")
    answer, history = rag_lookahead.chat(model, tokenizer, "And branch_length?", history)

History comes in either of the two shapes those models use and goes back in the same shape:
Qwen-1's ``[(query, answer), ...]`` pairs (also the shape for ``history=None``), or
ChatGLM3/OpenAI-style messages ``[{"role": "user", "content": ...}, ...]``, which may start
with a system message (or a ``developer`` one, OpenAI's newer name for it: the template gets a
system message, as the server gives it).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from rag_lookahead.decoding.inputs import context_limit
from rag_lookahead.decoding.verify import input_device
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.hf_entry import hf_generate
from rag_lookahead.tokens import chat_template_text, encode_messages

#: answer length when neither the given config nor the model's sets one (transformers would stop at 20 tokens)
DEFAULT_MAX_NEW_TOKENS = 512

History = list  # list[tuple[str, str]] or list[dict[str, str]]


def chat(
    model,
    tokenizer,
    query: str,
    history: History | None = None,
    generation_config=None,
    *,
    system: str | None = None,
    references: Sequence[str] | None = None,
    streamer=None,
) -> tuple[str, History]:
    """Answer ``query`` after ``history``; return ``(answer, new_history)``.

    generation_config: a ``transformers.GenerationConfig``, with the article's keys
        (``use_lookahead``, ``decoding_length``, ``branch_length``, ...) if wanted; without
        ``max_new_tokens``/``max_length`` anywhere, answers stop at ``DEFAULT_MAX_NEW_TOKENS``.
    system: a system message put first (pairs history, or messages without one).
    references: passages to draft from (text), e.g. the retrieved ones the prompt quotes.
    streamer: a transformers streamer (``TextStreamer(tokenizer, skip_prompt=True)``).
    """
    watched = _EndOnce(streamer) if streamer is not None else None
    try:
        return _chat(model, tokenizer, query, history, generation_config, system, references, watched)
    except BaseException:
        # a refusal before decoding began: a TextIteratorStreamer's reader waited for good
        if watched is not None and not watched.ended:
            streamer.end()
        raise


def _chat(model, tokenizer, query, history, generation_config, system, references, streamer) -> tuple[str, History]:
    if not isinstance(query, str) or not query.strip():
        raise InputError("query must be a non-empty string")
    if references is not None:  # a bare string would be drafted from as one-character passages
        try:
            references = None if isinstance(references, (str, bytes)) else list(references)  # a generator once
        except TypeError:
            references = None
        if references is None or not all(isinstance(p, str) for p in references):
            raise InputError("references must be a list of passages (strings)")
    as_messages = _is_messages(history)
    messages = _messages(history, as_messages)
    if system is not None:
        if messages and messages[0].get("role") in ("system", "developer"):  # developer: OpenAI's newer name
            raise InputError("history already starts with a system message; do not also pass system=")
        messages.insert(0, {"role": "system", "content": system})
    messages.append({"role": "user", "content": query})

    inputs = _encode(tokenizer, messages)
    device = input_device(model)  # the embeddings' (a device map's first device; an offloaded one's hook's)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    config = _answer_config(model, generation_config, inputs["input_ids"].shape[1])
    own_stops = getattr(getattr(model, "generation_config", None), "stop_strings", None)
    output = model.generate(
        **inputs,
        custom_generate=hf_generate,
        generation_config=config,
        stopping_criteria=_stop_strings(config, own_stops, tokenizer),
        # else the model's own would be merged back in, and refused without a tokenizer
        **({"stop_strings": None} if own_stops else {}),
        references=[list(references)] if references else None,
        lookahead_tokenizer=tokenizer,
        streamer=streamer,
    )
    sequences = output if not hasattr(output, "sequences") else output.sequences
    answer = tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    return answer, _extended(history, as_messages, query, answer)


def _is_messages(history) -> bool:
    """True for message dicts, False for (query, answer) pairs or no history."""
    if history is None:
        return False
    if isinstance(history, (str, bytes)) or not isinstance(history, Sequence):
        raise InputError("history must be a list of (query, answer) pairs or of {'role', 'content'} messages")
    kinds = {isinstance(item, dict) for item in history}
    if len(kinds) > 1:
        raise InputError("history mixes (query, answer) pairs and message dicts; use one shape")
    return kinds == {True}


def _messages(history, as_messages: bool) -> list[dict[str, Any]]:
    if not history:
        return []
    if as_messages:
        for i, message in enumerate(history):
            if "role" not in message or "content" not in message:
                raise InputError(f"history[{i}] is a message without 'role' and 'content'")
        return [dict(message) for message in history]
    messages = []
    for i, pair in enumerate(history):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise InputError(f"history[{i}] must be a (query, answer) pair")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return messages


def _encode(tokenizer, messages: list[dict]) -> dict:
    """``generate``'s inputs for one conversation, through the chat template (``tokens.encode_messages``)."""
    if not chat_template_text(tokenizer):
        raise ConfigError("the tokenizer has no chat template; rag_lookahead.chat needs a chat model")
    ids = torch.tensor([encode_messages(tokenizer, messages)], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _answer_config(model, generation_config, prompt_length: int):
    """A copy of the caller's config that stops somewhere sensible: at its length (the caller's
    config first, then the model's, else ``DEFAULT_MAX_NEW_TOKENS``), and at the latest at the end
    of the model's context window (``hf_generate`` refuses to be asked past it)."""
    from transformers import GenerationConfig

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ConfigError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}"
        )
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    own = getattr(model, "generation_config", None)
    # as transformers merges them: each field from the caller's config, else from the model's; then
    # max_new_tokens before max_length
    new, total = (
        next((v for v in (getattr(c, f, None) for c in (config, own)) if v is not None), None) for f in _LENGTHS
    )
    if new is None and total is None:
        new = DEFAULT_MAX_NEW_TOKENS
    if new is not None and (isinstance(new, bool) or not isinstance(new, int) or new < 1):
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {new!r}")
    wanted = prompt_length + new if new is not None else total
    if wanted <= prompt_length:  # model.generate refuses this too
        raise InputError(
            f"max_length {total} leaves no room for an answer after the {prompt_length}-token prompt "
            "(the history included): set max_new_tokens instead"
        )
    limit = context_limit(model)
    total = max(min(wanted, limit or wanted), prompt_length + 1)  # a full window: refused there
    _set_length(config, own, prompt_length, total)
    return config


def _set_length(config, own, prompt_length: int, total: int) -> None:
    """Give ``config`` one length field, ``total`` tokens in all: ``model.generate`` logs "Both
    max_new_tokens and max_length seem to have been set" whenever the merged config holds both
    (GLM-4 ships max_length 128000, so every call did). A field left None is filled from the model's
    own config, so the one kept is ``max_new_tokens`` where the model sets that (it would come back),
    else ``max_length``; where the model sets both, plain ``model.generate`` logs it too."""
    if getattr(own, "max_new_tokens", None) is not None:
        config.max_new_tokens, config.max_length = total - prompt_length, None
    else:
        config.max_new_tokens, config.max_length = None, total


_LENGTHS = ("max_new_tokens", "max_length")


def _stop_strings(config, own_stops, tokenizer):
    """The ``stop_strings`` ``model.generate`` would take (the config's, else the model's own,
    ``own_stops``) as the stopping criterion it would make of them: transformers drops
    ``tokenizer=`` for a ``custom_generate`` function and then refused them."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    stops = config.stop_strings if config.stop_strings is not None else own_stops
    config.stop_strings = None
    if not stops:
        return None
    return StoppingCriteriaList([StopStringCriteria(tokenizer, [stops] if isinstance(stops, str) else list(stops))])


class _EndOnce(BaseStreamer):
    """The caller's streamer, with ``ended`` set once it is ended, so that :func:`chat` ends it on a
    failure only where decoding did not."""

    def __init__(self, streamer) -> None:
        self.streamer, self.ended = streamer, False

    def put(self, value) -> None:
        self.streamer.put(value)

    def end(self) -> None:
        self.ended = True
        self.streamer.end()


def _extended(history, as_messages: bool, query: str, answer: str) -> History:
    """A new history (the caller's is left as it was) in the shape it came in."""
    if as_messages:
        return [dict(m) for m in history] + [
            {"role": "user", "content": query},
            {"role": "assistant", "content": answer},
        ]
    return [tuple(pair) for pair in (history or [])] + [(query, answer)]
