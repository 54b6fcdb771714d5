"""The response bodies, as pydantic models in OpenAI's shapes, and how each endpoint fills them.

The models document the answers at ``/docs``; every body is built through them, so what is
documented is what is sent. Each endpoint has a *shape* that turns an
:class:`~rag_lookahead.serve.jobs.Answer` (and, when streaming, each new piece of text) into
bodies: ``opening()`` (sent before any text), ``piece(piece)`` (a :class:`~rag_lookahead.serve.jobs.Piece`:
new text and its tokens' log-probabilities), ``closing(answer, include_usage)`` and
``whole(answers)`` for a non-streamed answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from rag_lookahead.serve.jobs import Answer, Piece
from rag_lookahead.serve.logprobs import ChatLogprobs, CompletionLogprobs, LogprobFormat
from rag_lookahead.serve.tool_calls import ToolSetup

__all__ = ["ChatShape", "CompletionShape", "RagShape"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Stats(BaseModel):
    """What lookahead did for the (first) answer; an extension of OpenAI's shapes."""

    forward_passes: int
    mean_accepted: float
    seconds: float
    lookahead: bool


def usage_of(answers: list[Answer], prompts: int = 1) -> Usage:
    """Usage of all choices: each prompt counted once (``answers``: the n choices of each of
    ``prompts`` prompts, in order), completions added up, as OpenAI reports n > 1 and several prompts."""
    prompt = sum(a.prompt_tokens for a in answers[:: len(answers) // prompts])
    completion = sum(a.completion_tokens for a in answers)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def stats_of(answer: Answer) -> Stats:
    return Stats(
        forward_passes=answer.forward_passes,
        mean_accepted=answer.mean_accepted,
        seconds=answer.seconds,
        lookahead=answer.lookahead,
    )


# ---------------------------------------------------------------- /v1/completions


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]


class CompletionUsageChunk(CompletionChunk):
    """The last chunk of a stream with ``stream_options.include_usage`` (no choices)."""

    usage: Usage


class Completion(CompletionUsageChunk):
    stats: Stats


@dataclass(frozen=True)
class _OpenAIShape:
    """What the two OpenAI endpoints share: a stream ends with the held-back rest, a finish chunk
    and (asked for) a usage chunk; the whole body holds every choice, the usage and the stats.
    ``logprobs``: set when the request asked for log-probabilities."""

    id: str
    created: int
    model: str
    logprobs: LogprobFormat | None = None
    prompts: int = 1  # a whole answer holds n choices for each (completions: several prompts)
    usage_chunk: ClassVar[type[BaseModel]]
    body: ClassVar[type[BaseModel]]

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    def piece(self, piece: Piece) -> dict:
        raise NotImplementedError

    def _finish(self, finish_reason: str) -> dict:
        raise NotImplementedError

    def _choice(self, index: int, answer: Answer) -> BaseModel:
        raise NotImplementedError

    def _usage_chunks(self, answer: Answer, include_usage: bool) -> list[dict]:
        if not include_usage:
            return []
        return [self.usage_chunk(**self._head(), choices=[], usage=usage_of([answer])).model_dump()]

    def closing(self, answer: Answer, include_usage: bool) -> list[dict]:
        chunks = (
            [self.piece(Piece(answer.rest, answer.unsent_logprobs))] if answer.rest or answer.unsent_logprobs else []
        )
        chunks.append(self._finish(answer.finish_reason))
        return chunks + self._usage_chunks(answer, include_usage)

    def whole(self, answers: list[Answer]) -> dict:
        choices = [self._choice(i, answer) for i, answer in enumerate(answers)]
        body = self.body(
            **self._head(), choices=choices, usage=usage_of(answers, self.prompts), stats=stats_of(answers[0])
        )
        return body.model_dump()


@dataclass(frozen=True)
class CompletionShape(_OpenAIShape):
    usage_chunk = CompletionUsageChunk
    body = Completion

    def _chunk(self, text: str, finish_reason: str | None = None, logprobs: CompletionLogprobs | None = None) -> dict:
        choice = CompletionChoice(text=text, finish_reason=finish_reason, logprobs=logprobs)
        return CompletionChunk(**self._head(), choices=[choice]).model_dump()

    def opening(self) -> list[dict]:
        return []

    def piece(self, piece: Piece) -> dict:
        logprobs = None if self.logprobs is None else self.logprobs.completion(piece.logprobs, streamed=True)
        return self._chunk(piece.text, logprobs=logprobs)

    def _finish(self, finish_reason: str) -> dict:
        return self._chunk("", finish_reason)

    def _choice(self, index: int, answer: Answer) -> BaseModel:
        logprobs = None if self.logprobs is None else self.logprobs.completion(answer.logprobs or ())
        return CompletionChoice(text=answer.text, index=index, finish_reason=answer.finish_reason, logprobs=logprobs)


# ---------------------------------------------------------------- /v1/chat/completions


class CalledFunction(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolCallDelta(ToolCall):
    index: int


class ChatDeltaChoice(BaseModel):
    index: int = 0
    # {"role": "assistant", "content": ""} first, then {"content": ...} or {"tool_calls": [...]}, {} at the end
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatDeltaChoice]


class ChatUsageChunk(ChatCompletionChunk):
    """The last chunk of a stream with ``stream_options.include_usage`` (no choices)."""

    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatChoice]
    usage: Usage
    stats: Stats


@dataclass(frozen=True)
class ChatShape(_OpenAIShape):
    """``tools``: how the request uses tools (the answer's calls come back as ``tool_calls``)."""

    tools: ToolSetup = field(default_factory=ToolSetup)
    usage_chunk = ChatUsageChunk
    body = ChatCompletion

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None, logprobs=None) -> dict:
        """``logprobs``: the chunk's tokens' entries (None: the chunk carries none, as the first and last)."""
        entries = None if self.logprobs is None or logprobs is None else self.logprobs.chat(logprobs, streamed=True)
        choice = ChatDeltaChoice(delta=delta, finish_reason=finish_reason, logprobs=entries)
        return ChatCompletionChunk(**self._head(), choices=[choice]).model_dump()

    def opening(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def piece(self, piece: Piece) -> dict:
        return self._chunk({"content": piece.text}, logprobs=piece.logprobs)

    def _finish(self, finish_reason: str) -> dict:
        return self._chunk({}, finish_reason)

    def closing(self, answer: Answer, include_usage: bool) -> list[dict]:
        """With tool calls: the text not sent yet, then the calls whole in one chunk."""
        reply = self.tools.reply(answer.text)
        if reply is None:
            return super().closing(answer, include_usage)
        emitted = answer.text[: len(answer.text) - len(answer.rest)]
        unsent = reply.content[len(emitted) :] if reply.content.startswith(emitted) else ""
        # the same content as whole() (whitespace and all) once the answer has any text outside its calls
        chunks = [self._chunk({"content": unsent})] if unsent and reply.content.strip() else []
        calls = [ToolCallDelta(index=i, **call).model_dump() for i, call in enumerate(reply.calls)]
        chunks.append(self._chunk({"tool_calls": calls}, logprobs=answer.unsent_logprobs))
        chunks.append(self._finish("tool_calls"))
        return chunks + self._usage_chunks(answer, include_usage)

    def _choice(self, index: int, answer: Answer) -> BaseModel:
        logprobs = None if self.logprobs is None else self.logprobs.chat(answer.logprobs or ())
        reply = self.tools.reply(answer.text)
        if reply is None:
            message = AssistantMessage(content=answer.text)
            return ChatChoice(index=index, message=message, finish_reason=answer.finish_reason, logprobs=logprobs)
        # as streamed: the text outside the calls as it is (None when there is none but whitespace)
        message = AssistantMessage(content=reply.content if reply.content.strip() else None, tool_calls=reply.calls)
        return ChatChoice(index=index, message=message, finish_reason="tool_calls", logprobs=logprobs)


# ---------------------------------------------------------------- /v1/rag


class RagStats(Stats):
    retrieval_seconds: float
    seed_passages: int  # retrieved passages left out of the prompt that seeded the drafter
    finish_reason: str
    usage: Usage


class RagAnswer(BaseModel):
    answer: str
    sources: list[dict[str, Any]]  # rag.chains.source_info: source, chunk_id, score, in_prompt, snippet, text, also_in
    stats: RagStats
    model: str


class RagSourcesEvent(BaseModel):
    type: Literal["sources"] = "sources"
    sources: list[dict[str, Any]]


class RagDeltaEvent(BaseModel):
    type: Literal["delta"] = "delta"
    text: str


class RagDoneEvent(BaseModel):
    type: Literal["done"] = "done"
    answer: str
    stats: RagStats


@dataclass(frozen=True)
class RagShape:
    """``/v1/rag`` streams a sources event, text deltas, then a done event with the whole answer."""

    sources: list[dict[str, Any]]
    model: str
    retrieval_seconds: float
    seed_passages: int

    def _stats(self, answer: Answer) -> RagStats:
        return RagStats(
            **stats_of(answer).model_dump(),
            retrieval_seconds=round(self.retrieval_seconds, 4),
            seed_passages=self.seed_passages,
            finish_reason=answer.finish_reason,
            usage=usage_of([answer]),
        )

    def opening(self) -> list[dict]:
        return [RagSourcesEvent(sources=self.sources).model_dump()]

    def piece(self, piece: Piece) -> dict:
        return RagDeltaEvent(text=piece.text).model_dump()

    def closing(self, answer: Answer, include_usage: bool) -> list[dict]:
        chunks = [self.piece(Piece(answer.rest))] if answer.rest else []
        return chunks + [RagDoneEvent(answer=answer.text.strip(), stats=self._stats(answer)).model_dump()]

    def whole(self, answers: list[Answer]) -> dict:
        answer = answers[0]
        body = RagAnswer(answer=answer.text.strip(), sources=self.sources, stats=self._stats(answer), model=self.model)
        return body.model_dump()


# ---------------------------------------------------------------- /v1/models, /health


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "rag_lookahead"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """``status``: ok | starting | draining | error (the engine failed to start or its thread died);
    200 only when ok, else 503."""

    status: Literal["ok", "starting", "draining", "error"]
    model: str
    lookahead: bool
    index: bool
    queue_depth: int
    batch_size: int
    max_batch_size: int
    error: str | None = None
