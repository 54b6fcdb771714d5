"""Log-probabilities for ``/v1/completions`` (``logprobs: N``) and ``/v1/chat/completions``
(``logprobs: true``, ``top_logprobs: N``), in OpenAI's shapes.

The decode loop records them, exactly, from the verify forward that accepted each token (see
:mod:`rag_lookahead.decoding.results`: the model's own distribution, the raw logits' softmax,
before repetition penalty and the sampling warpers). A job's :class:`AnswerLogprobs` is that
recorder; it hands the entries on with the job's pieces and its answer, keeping only the
tokens of the answer's text: no EOS, nothing past a stop string. Streamed, a chunk carries the
tokens whose text the stream has sent since the previous chunk (a token whose text is held back
waits for the chunk that sends it); the chunks' entries together are the non-streamed list.

Tokens are named as OpenAI names them: the token's text and its UTF-8 ``bytes`` (exact for
byte-level BPE tokenizers such as Qwen's and Llama 3's, where one token may hold part of a
character, and for byte-fallback tokens). Where a token's text depends on what precedes it
(sentencepiece's leading "▁", WordPiece's "##"), it is the text the token adds after the
answer's tokens before it, so the names spell the answer. Log-probabilities below -9999 are
reported as -9999.0, as OpenAI does.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel

from rag_lookahead.decoding.results import LogprobRecorder, TokenLogprob
from rag_lookahead.tokens import TextTracker

if TYPE_CHECKING:
    from rag_lookahead.serve.jobs import Answer

__all__ = ["AnswerLogprobs", "ChatLogprobs", "CompletionLogprobs", "LogprobFormat"]

LOWEST = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


class AnswerLogprobs(LogprobRecorder):
    """A job's recorder (the decode loop records into it), handing its entries on to the client."""

    def __init__(self, top: int) -> None:
        super().__init__(top)
        self.sent = 0  # entries the pieces carried so far
        self._after_stop: int | None = None  # the answer's token count, once a stop string ended it

    def for_piece(self, tracker: TextTracker) -> tuple[TokenLogprob, ...]:
        """The entries not sent yet of the tokens the streamed text spells (called in the engine
        thread, with a piece). Tokens whose text is still held back (the start of a stop string,
        a character split over tokens) wait: a stop may yet drop them from the answer."""
        end = self._answer_tokens(tracker)
        if not tracker.stopped:
            while end > self.sent and not tracker.emitted.startswith(tracker.text(end)):
                end -= 1
        piece = tuple(self.entries[self.sent : end])
        self.sent = max(self.sent, end)
        return piece

    def complete(self, answer: Answer, tracker: TextTracker) -> Answer:
        """``answer`` with its tokens' entries, and those no piece carried."""
        end = self._answer_tokens(tracker)
        entries = tuple(self.entries[:end])
        return dataclasses.replace(answer, logprobs=entries, unsent_logprobs=entries[self.sent :])

    def _answer_tokens(self, tracker: TextTracker) -> int:
        """How many tokens the answer's text is made of (the tracker's, less a closing EOS, cut at a stop)."""
        count = min(len(self.entries), len(tracker.ids))
        if count and tracker.ids[count - 1] in tracker.eos:
            count -= 1
        if not tracker.stopped:
            return count
        if self._after_stop is None:
            self._after_stop = _tokens_for_text(tracker, count)
        return min(count, self._after_stop)


def _tokens_for_text(tracker: TextTracker, count: int) -> int:
    """The fewest of the first ``count`` tokens whose text starts with the answer cut at its stop
    string. Only the tokens that may spell the stop string are tried (up to 4 a character, past
    tokens that add no text), and each of them, since the text need not grow with the tokens (an
    unfinished byte-fallback run decodes to one U+FFFD a byte)."""
    answer = tracker.final_text()
    reach = 4 * max((len(s) for s in tracker.stop), default=0) + 4
    fewest = k = count
    while k > 0 and reach > 0:
        k -= 1
        reach -= not tracker.is_unseen(tracker.ids[k])
        if tracker.text(k).startswith(answer):
            fewest = k
    return fewest


# ---------------------------------------------------------------- OpenAI's shapes


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion (and of each streamed chunk)."""

    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a completion: OpenAI's legacy shape (offsets count from the answer's start)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (byte-level BPE vocabularies are written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _is_byte_level(tokenizer) -> bool:
    """Whether the vocabulary is written in GPT-2's byte alphabet (" é" is spelled "Ġé" there):
    plain ASCII pieces of other tokenizers ("bracket", "##o") would pass for it."""
    try:
        pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(" é", add_special_tokens=False))
        spelled = "".join(p for p in pieces if isinstance(p, str))
        decoder = _byte_decoder()
        return all(c in decoder for c in spelled) and bytes(decoder[c] for c in spelled).endswith(" é".encode())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: name its tokens by their text
        return False


class LogprobFormat:
    """Entries in OpenAI's shapes for one request: tokens named through ``tokenizer``, a stream's
    running text offset (for completions) and its last tokens (the context a name is read in)."""

    #: answer tokens before a position that its tokens are decoded after (see ``_in_context``)
    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stream_offset = 0
        self._stream_context: tuple[int, ...] = ()
        self._names: dict[int, tuple[str, list[int], bool]] = {}
        self._byte_level = _is_byte_level(tokenizer)

    def _alone(self, token: int) -> tuple[str, list[int], bool]:
        """The token's text and bytes read alone, cached, and whether context changes its text."""
        named = self._names.get(token)
        if named is None:
            named = self._names[token] = self._name(token)
        return named

    def _name(self, token: int) -> tuple[str, list[int], bool]:
        """Text, bytes, and whether the text depends on the tokens before it."""
        text = self.tokenizer.decode([token])
        piece = self.tokenizer.convert_ids_to_tokens(token)
        added = token in getattr(self.tokenizer, "added_tokens_decoder", {})
        if isinstance(piece, str) and not added:
            byte = _BYTE_TOKEN.fullmatch(piece)
            if byte:  # its own byte (decode alone may strip a space: sentencepiece drops a leading one)
                raw = bytes([int(byte.group(1), 16)])
                return raw.decode("utf-8", errors="replace"), list(raw), False
            if self._byte_level:
                decoder = _byte_decoder()
                if piece and all(c in decoder for c in piece):
                    raw = bytes(decoder[c] for c in piece)
                    if raw.decode("utf-8", errors="replace") == text:
                        return text, list(raw), False
        # sentencepiece's "▁word" decodes alone without its space, WordPiece's "##ing" with its
        # marks: such a token is named by what it adds to the text before it
        return text, list(text.encode("utf-8")), not added

    def _named(self, entries: Sequence[TokenLogprob], streamed: bool):
        """Per entry: (text, bytes) of its token and (text, bytes, logprob) of its top tokens,
        each read after the answer's tokens before it, so that the names spell the answer."""
        context = self._stream_context if streamed else ()
        named = []
        for entry in entries:
            heads: list[str] = []  # the context's text, decoded once a position when needed
            token = self._in_context(context, heads, entry.token)
            top = [(*self._in_context(context, heads, t), lp) for t, lp in entry.top]
            named.append((token, top))
            context = (*context, entry.token)[-self.CONTEXT_TOKENS :]
        if streamed:
            self._stream_context = context
        return named

    def _in_context(self, context: tuple[int, ...], heads: list[str], token: int) -> tuple[str, list[int]]:
        text, raw, contextual = self._alone(token)
        if not (contextual and context):
            return text, raw
        if not heads:
            heads.append(self.tokenizer.decode(list(context), skip_special_tokens=True))
        whole = self.tokenizer.decode([*context, token], skip_special_tokens=True)
        if not whole.startswith(heads[0]):  # e.g. a character finished across the seam
            return text, raw
        added = whole[len(heads[0]) :]
        return added, list(added.encode("utf-8"))

    def chat(self, entries: Sequence[TokenLogprob], streamed: bool = False) -> ChatLogprobs:
        """``streamed``: a chunk of a stream, read after the chunks before it."""
        content = []
        for entry, ((text, raw), top) in zip(entries, self._named(entries, streamed), strict=True):
            logprob = max(entry.logprob, LOWEST)
            tops = [TopLogprob(token=t, logprob=max(lp, LOWEST), bytes=b) for t, b, lp in top]
            content.append(ChatTokenLogprob(token=text, logprob=logprob, bytes=raw, top_logprobs=tops))
        return ChatLogprobs(content=content)

    def completion(self, entries: Sequence[TokenLogprob], streamed: bool = False) -> CompletionLogprobs:
        """Offsets from the answer's start: a whole answer's from 0, a stream's carried over its chunks."""
        offset = self.stream_offset if streamed else 0
        named = self._named(entries, streamed)
        tokens, offsets = [], []
        for (text, _), _ in named:
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        if streamed:
            self.stream_offset = offset
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[max(e.logprob, LOWEST) for e in entries],
            top_logprobs=[_by_name(top, text, e.logprob) for ((text, _), top), e in zip(named, entries, strict=True)],
            text_offset=offsets,
        )


def _by_name(top: list[tuple[str, list[int], float]], chosen: str, chosen_logprob: float) -> dict[str, float]:
    """A place's most likely tokens by text, and the chosen token's: OpenAI's completions "always
    return the logprob of the sampled token, so there may be up to logprobs+1 elements" (vLLM too;
    a sampled token outside the top was left out, and ``logprobs: 0`` gave ``{}``). Tokens spelled
    alike (byte tokens each half a character, all U+FFFD) share one key. The chosen token's text
    holds the chosen token's own log-probability, so ``top_logprobs[i][tokens[i]]`` is
    ``token_logprobs[i]``, the look-up clients make, even where a likelier token is spelled the same
    (a sample may draw the less likely of two); any other text holds its likeliest token's (the
    later, less likely ones had overwritten it). Most likely first."""
    named = {chosen: max(chosen_logprob, LOWEST)}
    for text, _, logprob in top:
        named.setdefault(text, max(logprob, LOWEST))
    return dict(sorted(named.items(), key=lambda item: -item[1]))  # a stable sort: ties stay as put in
