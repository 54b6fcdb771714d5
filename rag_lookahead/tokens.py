"""Token plumbing every front end shares: EOS and pad ids, chat encoding, stop strings.

The LangChain wrappers, the server and the benchmarks all turn text into prompt ids and
accepted token blocks back into text; doing it in one place keeps them from drifting apart
(pad picked differently, a stop string cut in one place and not another). Nothing here writes
into the caller's tokenizer.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rag_lookahead.checks import unicode_text
from rag_lookahead.errors import ConfigError, InputError

__all__ = [
    "REPLACEMENT",
    "TextTracker",
    "chat_template_text",
    "checked_stop",
    "cut_at_stop",
    "encode_messages",
    "eos_ids",
    "held_back",
    "pad_id",
]

REPLACEMENT = "\ufffd"
#: a byte-fallback token's name (sentencepiece vocabularies: Llama, Mistral, Gemma)
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
#: what transformers' ``clean_up_tokenization`` rewrites (each loses its leading space)
CLEAN_UP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


# ---------------------------------------------------------------- text from accepted blocks


class TextTracker:
    """Turns a row's accepted token blocks into stable text pieces, honouring stop strings.

    A row stops at the first token whose text, decoded with all before it, holds a stop string:
    what one token a step would see, whatever number of tokens each step accepted (a block is
    searched token by token wherever a later token may rewrite the text before it). The final
    text is the decoded text cut at the stop string.

    What is streamed is the *settled* text, less what a later token may still rewrite, so nothing
    streamed is ever taken back: a trailing U+FFFD (a character split over tokens), a trailing run
    of byte-fallback tokens (``<0xE4>``: Llama- and Mistral-style decoders turn a whole run into
    U+FFFDs when its last character is incomplete, the characters already whole in it included),
    the end ``clean_up_tokenization`` may still rewrite, and text that may start a stop string.

    ``prefix``: answer text the prompt already holds (a forced opening such as ``<tool_call>``);
    it is part of the text but never searched for stop strings. ``hold``: markers from which
    on nothing is emitted while decoding goes on (a tool call is handed over whole, at the end).
    """

    #: tokens before the draws that ``would_stop`` decodes them with (see ``_text_with``)
    CONTEXT_TOKENS = 8

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] | None,
        eos: frozenset[int],
        *,
        prefix: str = "",
        hold: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in checked_stop(stop) if s]
        self.eos = eos
        self.prefix = prefix
        self.hold = [h for h in hold if h]
        self.ids: list[int] = []
        self.emitted = ""
        self.cleans_up = _cleans_up(tokenizer)
        self.stopped = False
        self._byte_tokens: dict[int, bool] = {}
        self._unseen: dict[int, bool] = {}
        self._whole = prefix  # text() of the ids taken so far
        # a stop string with U+FFFD may match a character still split over tokens, and clean-up
        # rewrites: then a block is searched token by token
        self._rewrites = self.cleans_up or any(REPLACEMENT in s for s in self.stop)

    def text(self, count: int | None = None) -> str:
        """The text of the first ``count`` ids (all of them when None: kept, not decoded again)."""
        if count is None or count >= len(self.ids):
            return self._whole
        return self.prefix + self._decode(self.ids[:count])

    def _decode_all(self) -> str:
        return self.prefix + self._decode(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.eos], skip_special_tokens=True)

    def settled(self, count: int | None = None) -> str:
        """The text of the first ``count`` ids less the end a later token may still rewrite."""
        count = len(self.ids) if count is None else count
        # back over the trailing byte run, and the tokens decode drops (they do not end a run)
        run = count
        while run and (self._is_byte_token(self.ids[run - 1]) or self.is_unseen(self.ids[run - 1])):
            run -= 1
        if any(self._is_byte_token(t) for t in self.ids[run:count]):
            count = run
        text = self.text(count).rstrip(REPLACEMENT)
        if self.cleans_up:
            # decode's clean-up (" ' " -> "'", " n't" -> "n't") rewrites text once a pattern is
            # whole: keep only what the text one token shorter agrees with, less an end that may
            # still become a pattern (a tokenizer's own clean-up may have other patterns)
            if count > 1:
                text = os.path.commonprefix([text, self.text(count - 1)])
            # its replacements run one after another (" ' " -> "'", then " 's" -> "'s"), so one
            # token may rewrite a whole trailing run of spaces and quotes
            while (shorter := text.rstrip(" '")) != text or held_back(text, CLEAN_UP_PATTERNS):
                text = shorter[: len(shorter) - held_back(shorter, CLEAN_UP_PATTERNS)]
        return text

    def is_unseen(self, token: int) -> bool:
        """Whether ``token`` adds no text of its own (EOS, a special token decode drops, a control
        token ``all_special_ids`` may not list); it does not end a byte-fallback run."""
        known = self._unseen.get(token)
        if known is None:
            known = self._unseen[token] = token in self.eos or not self._decode([token])
        return known

    def _is_byte_token(self, token: int) -> bool:
        known = self._byte_tokens.get(token)
        if known is None:
            try:
                name = self.tokenizer.convert_ids_to_tokens(token)
            except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError):
                name = None
            known = self._byte_tokens[token] = isinstance(name, str) and BYTE_TOKEN.fullmatch(name) is not None
        return known

    def _holds_stop(self, text: str) -> bool:
        answer = text[len(self.prefix) :]
        return any(s in answer for s in self.stop)

    def would_stop(self, tokens: Sequence[int]) -> bool:
        """Whether the ids taken so far plus ``tokens`` (drawn, not taken yet) hold a stop string:
        a sampled row asks this after each draw, so that no draw is spent past the stop
        (the generator must stand where one-token-a-step decoding leaves it). It is the test
        :meth:`add` makes, so the two never disagree."""
        if self.stopped or not self.stop:
            return self.stopped
        return self._holds_stop(self._text_with([int(t) for t in tokens]))

    def _text_with(self, tokens: list[int]) -> str:
        """``text()`` with ``tokens`` appended, without decoding the whole answer at every draw:
        the last ``CONTEXT_TOKENS`` ids are decoded with and without ``tokens``, and where the
        first reads as the second plus more and the whole text ends as the second, that more is
        what ``tokens`` add. Elsewhere (drawn byte-fallback tokens, which may turn a whole run
        into U+FFFDs; a clean-up across the seam) all is decoded."""
        context = self.ids[-self.CONTEXT_TOKENS :]
        if len(context) < len(self.ids) and not any(self._is_byte_token(t) for t in tokens):
            head, whole = self._decode(context), self._decode(context + tokens)
            core = head.lstrip(REPLACEMENT)  # the context may start inside a character
            if core and not head.endswith(REPLACEMENT) and whole.startswith(head) and self._whole.endswith(core):
                return self._whole + whole[len(head) :]
        return self.prefix + self._decode(self.ids + tokens)

    def final_text(self) -> str:
        return self.prefix + cut_at_stop(self._whole[len(self.prefix) :], self.stop)

    def add(self, tokens: Sequence[int]) -> str:
        """Take a block of accepted tokens; return the newly stable text (may be "")."""
        if self.stopped:
            return ""
        before = len(self.ids)
        block = [int(t) for t in tokens]
        self.ids.extend(block)
        self._whole = self._decode_all()
        if self.stop:
            end = self._stop_end(before, block)
            if end is not None:
                self.stopped = True
                # the ids one-token-a-step decoding stops at (the token that completes the stop
                # string), so a token count never depends on how many tokens a step accepted
                del self.ids[end:]
                self._whole = self._decode_all()
                return self._emit(_before_hold(self.final_text(), self.hold))
        stable = self.settled()
        stable = stable[: len(stable) - held_back(stable[len(self.prefix) :], self.stop)]
        return self._emit(_before_hold(stable, self.hold))

    def _stop_end(self, before: int, block: list[int]) -> int | None:
        """How many ids there are up to the first one whose text holds a stop string, if one in
        ``block`` (taken after the first ``before`` ids) does."""
        if not (self._rewrites or any(self._is_byte_token(t) for t in block)) and not self._holds_stop(self._whole):
            return None  # the text only grows at its end: a stop seen inside the block would still be there
        for count in range(before + 1, len(self.ids)):
            if self._holds_stop(self.text(count)):
                return count
        return len(self.ids) if self._holds_stop(self._whole) else None

    def _emit(self, stable: str) -> str:
        """The part of ``stable`` past what was emitted. Were a tokenizer to rewrite text already
        emitted, the piece still starts at the emitted length: a stream may then differ from the
        final text where it was rewritten, but never loses what follows."""
        if len(stable) <= len(self.emitted):
            return ""
        piece = stable[len(self.emitted) :]
        self.emitted = stable
        return piece

    def rest(self) -> str:
        """What is left to emit once the row is done: the final text minus what was emitted."""
        return self._emit(self.final_text())


def _cleans_up(tokenizer) -> bool:
    """Whether ``decode`` applies transformers' clean-up (``" ."`` -> ``"."``): the flag says so,
    but transformers 5 skips it for BPE tokenizers (Llama 3's config sets it). Told by decoding
    "a . b" both ways where the tokenizer spells it with the space; else the flag is believed."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        ids = tokenizer.encode("a . b", add_special_tokens=False)
        raw = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        return " ." not in raw or tokenizer.decode(ids, clean_up_tokenization_spaces=True) != raw
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: believe its flag
        return True


def checked_stop(stop: Sequence[str] | None) -> list[str]:
    """``stop`` as a list, refused unless it is a collection of strings. A generator is refused: it
    can be read only once, and LangChain reads ``stop`` for tracing before decoding (the stop
    strings were then silently lost)."""
    if isinstance(stop, str) or isinstance(stop, Iterator):
        raise ConfigError(f"stop must be a list of strings, got {stop!r}")
    stop = list(stop or ())
    if not all(isinstance(s, str) for s in stop):
        raise ConfigError(f"stop must be a list of strings, got {stop!r}")
    return stop


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first stop string in it (all of it when none occurs)."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


def held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _before_hold(text: str, hold: Sequence[str]) -> str:
    """``text`` up to the first hold marker, less a suffix that may be the start of one, and less
    the whitespace that may lead up to one: an answer of whitespace and a tool call has no content
    (the server's whole reply says None), so its stream must not have sent the whitespace."""
    if not hold:
        return text
    text = cut_at_stop(text, hold)
    return text[: len(text) - held_back(text, hold)].rstrip()


# ---------------------------------------------------------------- token plumbing


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends an answer: the model's generation config and the tokenizer's EOS."""
    ids: set[int] = set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen, int):
        ids.add(gen)
    elif gen is not None:
        ids.update(int(t) for t in gen)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def pad_id(model, tokenizer, eos: frozenset[int] | set[int]) -> int:
    """The id to left-pad batches with, read without setting ``tokenizer.pad_token``.

    Padded positions are masked out, so any id in the vocabulary serves; the tokenizer's pad,
    then the model's, then an EOS id.
    """
    for candidate in (tokenizer.pad_token_id, getattr(getattr(model, "generation_config", None), "pad_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return min(eos) if eos else 0


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template source ("" without one; named templates joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def encode_messages(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    answer_prefix: str = "",
    template_variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt ids for chat ``messages`` (role/content dicts) through the chat template.

    ``tools`` go to the template (a template that never reads them is refused, not ignored);
    ``answer_prefix`` is text the assistant's turn starts with; ``template_variables`` are more
    variables the template may read (Qwen3's ``enable_thinking``). A ``developer`` message is a
    system message, as OpenAI reads it (templates know only the older name: Qwen's drops it).

    A tokenizer without a chat template (a base model) gets the contents joined by blank lines:
    ``LookaheadLLM``, ``ask`` and ``/v1/rag`` send one user message (after ``LookaheadLLM``'s
    system prompt, if set), whose text is then the prompt. Conversations need the template's
    roles and turns: ``rag_lookahead.chat`` and ``/v1/chat/completions`` refuse such a tokenizer.
    """
    messages = [_as_template_role(m) for m in messages]
    template = chat_template_text(tokenizer)
    if not template:
        if tools:
            raise ConfigError("this tokenizer has no chat template, so it cannot be given tools")
        text = "\n\n".join(str(m.get("content") or "") for m in messages)
        return list(tokenizer(_unicode(text + answer_prefix), verbose=False)["input_ids"])
    if tools and "tools" not in template:
        raise ConfigError(
            "this model's chat template does not take tools: bind tools only to a model whose template does"
        )
    extra = {**(template_variables or {}), **({"tools": list(tools)} if tools else {})}
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **extra)
    except Exception as err:  # jinja's TemplateError and friends: say what the template refused
        raise InputError(f"the chat template refused these messages: {err}") from None
    _check_nothing_left_out(tokenizer, messages, extra)
    # verbose=False: a prompt past the context is refused in our words (decoding.inputs), without
    # transformers' "sequence length is longer" warning printed first
    return list(tokenizer(_unicode(text + answer_prefix), add_special_tokens=False, verbose=False)["input_ids"])


#: OpenAI's role names that chat templates know by an older one
_TEMPLATE_ROLES = {"developer": "system"}
#: the roles every chat template renders; others only some: "tool" (Phi-3-mini's template renders
#: system, user and assistant only), GLM's "observation", Llama's "ipython"
_COMMON_ROLES = frozenset({"system", "user", "assistant"})


def _as_template_role(message: Mapping[str, Any]) -> Mapping[str, Any]:
    role = message.get("role")
    return {**message, "role": _TEMPLATE_ROLES[role]} if role in _TEMPLATE_ROLES else message


def _check_nothing_left_out(tokenizer, messages: Sequence[Mapping[str, Any]], extra: Mapping[str, Any]) -> None:
    """Refuse a message of a role the template does not know: templates skip those without a word,
    and the model answered as if the message had never been written. Such messages are rendered
    once more with a marker for their text (a template may quote it, ``tojson``, or trim it; the
    text itself may also stand elsewhere in the prompt), and each marker must come out."""
    uncommon = [i for i, m in enumerate(messages) if m.get("role") not in _COMMON_ROLES]
    if not uncommon:
        return
    tag = uuid.uuid4().hex
    marked = [dict(m) for m in messages]
    for i in uncommon:
        marked[i]["content"] = f"ragprobe{i}x{tag}"
    try:
        text = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True, **extra)
    except Exception:  # noqa: BLE001 - a template that reads the content (it rendered the real one)
        return
    for i in uncommon:
        if f"ragprobe{i}x{tag}" not in text:
            raise InputError(
                f"the chat template left out a message of role {messages[i].get('role')!r}: this model's"
                " template does not render that role, and the model would answer as if it had never been sent"
            )


def _unicode(text: str) -> str:
    return unicode_text(text, "the messages are")


def accepted_per_step(tokens: int, decode_steps: int) -> float:
    """Mean tokens accepted per decode step; the first token comes from the prefill, not a step."""
    return round((tokens - 1) / decode_steps, 4) if decode_steps else 0.0
