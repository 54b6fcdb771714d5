"""LookaheadLLM: a LangChain ``BaseLLM`` over the lossless lookahead ``generate``.

    llm = LookaheadLLM.from_model_id("default", max_new_tokens=256)
    llm.invoke("什么是前瞻解码？")
    llm.batch(["q1", "q2"])                      # one batched generate() call for all prompts
    for piece in llm.stream("q"): print(piece, end="")
    llm.invoke(prompt, references=["passage that is not in the prompt", ...])

Each prompt is wrapped in the tokenizer's chat template (prompt as the user turn, optional system
prompt); only the answer text comes back. Greedy by default; ``temperature > 0`` samples (also
``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``seed``, as fields or per call). Either
way the text is the same with lookahead on or off (``enable_lookahead=False`` per call; for
sampling, under the same ``seed``), only the speed differs.

``references`` (per call): passages that seed the row's draft trie without being in the prompt,
one list of strings per prompt (a flat list of strings is accepted for a single prompt).
Passages may also be registered ahead with :meth:`LookaheadLLM.register_seeds` (used by
:class:`rag_lookahead.rag.chains.SeedingRetriever` for ``RetrievalQA``, whose chain cannot pass
per-query kwargs to the LLM).

The decoding itself is :class:`rag_lookahead.langchain.engine.Engine`, shared with
:class:`rag_lookahead.langchain.chat_model.ChatLookahead` (``ChatLookahead.from_llm(llm)`` decodes with this
LLM's engine and output pool).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any, ClassVar

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LanguageModelInput
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict, Field, StrictInt

from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.inputs import check_prompt_room
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.langchain.batching import wave_width
from rag_lookahead.langchain.engine import (
    BlockStream,
    CancellableAsync,
    Engine,
    EngineAccess,
    EngineRun,
    NotPickled,
    RowRequest,
    check_loaded,
    prompt_format,
)
from rag_lookahead.langchain.sampling_fields import SAMPLING_FIELDS, SamplingFields, resolve_config
from rag_lookahead.tokens import checked_stop, encode_messages

__all__ = ["LookaheadLLM"]

_CHAT_ONLY = (
    "LookaheadLLM is a text-completion LLM and takes no {what}: use ChatLookahead.from_llm(llm), "
    "which decodes with the same model and output pool"
)


class LookaheadLLM(EngineAccess, CancellableAsync, NotPickled, SamplingFields, BaseLLM):
    """A local causal LM decoded with trie-drafted, tree-verified lookahead (output unchanged).

    The sampling fields (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
    ``seed``) come from :class:`~rag_lookahead.langchain.sampling_fields.SamplingFields`."""

    model: Any = Field(default=None, exclude=True, repr=False)
    tokenizer: Any = Field(default=None, exclude=True, repr=False)
    model_name: str = "custom"
    lookahead: LookaheadConfig = Field(default_factory=LookaheadConfig)
    max_new_tokens: StrictInt = 256
    system_prompt: str | None = None
    stop: list[str] | None = None
    """Stop strings for every call that gives none of its own (as ``ChatLookahead.stop``)."""

    # a misspelt or foreign setting (``temprature``, ``max_tokens``) is refused, not dropped
    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), extra="forbid")

    engine_fields: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})

    def model_post_init(self, __context: Any) -> None:
        self._settle_built()

    def _settle(self, updated: frozenset[str] | None) -> None:
        if self.model is None or self.tokenizer is None:
            raise ConfigError("LookaheadLLM needs a model and a tokenizer (or use LookaheadLLM.from_model_id)")
        check_loaded(self.model, self.tokenizer)
        positive_int("max_new_tokens", self.max_new_tokens)
        if not self.lookahead.stop_words:
            self.lookahead = self.lookahead.with_tokenizer(self.tokenizer)
        if self._new_engine(updated):
            self._engine = Engine(self.model, self.tokenizer, self.lookahead)
        self._sampling({})  # refuse bad sampling settings at construction

    # ------------------------------------------------------------ construction

    @classmethod
    def from_model_id(
        cls,
        model_id: str = "default",
        *,
        lookahead: LookaheadConfig | None = None,
        max_new_tokens: int = 256,
        system_prompt: str | None = None,
        dtype: Any = None,
        device: Any = None,
        device_map: Any = None,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> LookaheadLLM:
        """Load ``model_id`` ("default", a hub id or a local path) with :func:`rag_lookahead.models.load_model`;
        ``trust_remote_code=True`` runs the modeling code a repo or folder ships (ChatGLM3, Qwen-1), as there.
        Chat models and other LLMs built from the same id (and dtype, device) share its weights and its
        engine (one output pool; their decodes take turns); ``model_name`` overrides the name reported."""
        from rag_lookahead.langchain.shared_weights import load_shared, shared_engine
        from rag_lookahead.models import reported_name

        if own := sorted({"model", "tokenizer"} & set(kwargs)):
            raise ConfigError(
                f"from_model_id loads the model and tokenizer itself ({', '.join(own)} given): "
                "pass a loaded model and tokenizer to LookaheadLLM(model=..., tokenizer=...) instead"
            )
        unknown = sorted(set(kwargs) - set(cls.model_fields))
        if unknown:  # refused before the load, which can take minutes, not after it
            raise ConfigError(
                f"invalid LookaheadLLM setting {unknown[0]}: Extra inputs are not permitted "
                f"(nothing was loaded; its settings: {', '.join(sorted(cls.model_fields))})"
            )
        model, tokenizer = load_shared(model_id, dtype, device, device_map, trust_remote_code)
        kwargs.setdefault("model_name", reported_name(model_id))
        llm = cls(
            model=model,
            tokenizer=tokenizer,
            lookahead=lookahead or LookaheadConfig(),
            max_new_tokens=max_new_tokens,
            system_prompt=system_prompt,
            **kwargs,
        )
        # the weights' one engine, which chat models on the same id decode with too: with an engine
        # of its own, its decodes and theirs ran on the one model at once (each engine has its lock)
        llm._engine = shared_engine(model, tokenizer, llm.lookahead)
        return llm

    # ------------------------------------------------------------ LangChain plumbing

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        """Refused: a text-completion LLM takes no tools (``ChatLookahead`` does, on the same engine)."""
        raise NotImplementedError(_CHAT_ONLY.format(what="tools"))

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Any:
        """Refused, as ``bind_tools`` (LangChain's own refusal said nothing)."""
        raise NotImplementedError(_CHAT_ONLY.format(what="structured output"))

    @property
    def _llm_type(self) -> str:
        return "rag_lookahead"

    @property
    def _identifying_params(self) -> Mapping[str, Any]:
        # only what changes the text: draft settings change speed, never output, so the cache is shared
        params = {
            "model_name": self.model_name,
            "max_new_tokens": self.max_new_tokens,
            "system_prompt": self.system_prompt,
            # LangChain sets "stop" to the call's own stop list (None when not given): the field was lost
            "default_stop": self.stop,
            "weights": self._engine.fingerprint,  # two loaded models may share a name ("custom")
            "prompt_format": prompt_format(self.tokenizer),  # another tokenizer or template: other prompts
        }
        options = _CALL_OPTIONS.get()
        if options:  # this call's own options: LangChain's LLM cache keys on these params and stop only
            params["call_options"] = options
        return params | self._sampling_params()

    def generate(self, prompts: list[str], stop: list[str] | None = None, callbacks=None, **kwargs: Any) -> LLMResult:
        """LangChain's ``generate``, with this call's options (``max_new_tokens``, sampling, ...) in
        the cache key: ``BaseLLM`` keys its cache on the model's fields and ``stop`` only, so a
        cached 4-token answer came back for ``max_new_tokens=20``."""
        with _call_options(kwargs):
            return super().generate(prompts, stop, callbacks, **_with_prompts(kwargs, prompts))

    async def agenerate(
        self, prompts: list[str], stop: list[str] | None = None, callbacks=None, **kwargs: Any
    ) -> LLMResult:
        with _call_options(kwargs):
            return await super().agenerate(prompts, stop, callbacks, **_with_prompts(kwargs, prompts))

    def batch(self, inputs: list, config=None, *, return_exceptions: bool = False, **kwargs: Any) -> list:
        """LangChain's ``batch``, except that with ``return_exceptions`` a bad input (blank, past the
        context window) fails alone: ``BaseLLM`` decodes every input in one ``generate``, so one
        bad prompt failed every row. Per-input ``references`` go with their inputs into each part
        ``max_concurrency`` splits the batch into (``BaseLLM`` gave every part the whole list)."""
        parts = _concurrency_parts(inputs, config, kwargs)
        if parts is not None:
            return [
                answer
                for part, part_config, part_kwargs in parts
                for answer in self.batch(part, part_config, return_exceptions=return_exceptions, **part_kwargs)
            ]
        bad, good, configs = self._split_bad(inputs, config, return_exceptions)
        if not bad:
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        answers = super().batch(
            [inputs[i] for i in good],
            [configs[i] for i in good],
            return_exceptions=True,
            **_rows_of(kwargs, good, inputs),
        )
        return _merged(len(inputs), bad, good, answers)

    async def abatch(self, inputs: list, config=None, *, return_exceptions: bool = False, **kwargs: Any) -> list:
        parts = _concurrency_parts(inputs, config, kwargs)
        if parts is not None:
            return [
                answer
                for part, part_config, part_kwargs in parts
                for answer in await self.abatch(part, part_config, return_exceptions=return_exceptions, **part_kwargs)
            ]
        bad, good, configs = self._split_bad(inputs, config, return_exceptions)
        if not bad:
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        answers = await super().abatch(
            [inputs[i] for i in good],
            [configs[i] for i in good],
            return_exceptions=True,
            **_rows_of(kwargs, good, inputs),
        )
        return _merged(len(inputs), bad, good, answers)

    def _split_bad(self, inputs: list, config, return_exceptions: bool) -> tuple[dict[int, Exception], list[int], list]:
        """The inputs that cannot decode, by position (only looked for with ``return_exceptions``
        and several inputs), the others' positions, and a config for each input."""
        from langchain_core.runnables.config import get_config_list

        if not return_exceptions or len(inputs) < 2:
            return {}, [], []
        bad: dict[int, Exception] = {}
        for i, value in enumerate(inputs):
            try:
                self.check_prompt(value)
            except (InputError, ValueError) as err:  # ValueError: LangChain's for an input of no known type
                bad[i] = err
        good = [i for i in range(len(inputs)) if i not in bad]
        return bad, good, get_config_list(config, len(inputs))

    def check_prompt(self, prompt: LanguageModelInput, what: str = "the input", advice: str = "") -> int:
        """The prompt's length in tokens as it will be decoded (system prompt and chat template
        included); ``InputError`` if it is empty or leaves no room in the context window (naming
        the prompt ``what``, ending with ``advice``: ``"; ask with a smaller k"``). For a caller
        with many prompts to refuse a bad one before decoding any, or one that built the prompt
        (the RAG chains) to say what made it too long. ``prompt``: any input ``invoke`` takes (a
        string, a prompt value, messages), converted as ``invoke`` converts it."""
        return len(self._encode(self._convert_input(prompt).to_string(), what=what, advice=advice))

    @property
    def engine(self) -> Engine:
        """The decoding engine (model, tokenizer, output pool); share it with ``ChatLookahead.from_llm``."""
        return self._engine

    # ------------------------------------------------------------ encoding

    def _encode(
        self, prompt: str, engine: Engine | None = None, what: str = "the input", advice: str = ""
    ) -> list[int]:
        """The prompt's ids by ``engine``'s tokenizer (the call's; by default the current one);
        one that leaves no room in the context is refused naming it ``what``, with ``advice``."""
        engine = self._engine if engine is None else engine
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("the prompt is empty: give the model a question or an instruction")
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": prompt})
        ids = encode_messages(engine.tokenizer, messages)
        check_prompt_room(engine.model, len(ids), what, advice)  # here, so a batch can fail this prompt alone
        return ids

    def _references(self, prompts: Sequence[str], references: Any, engine: Engine) -> list[list[list[int]]]:
        if isinstance(references, _ByPrompt):
            references = references.for_prompts(prompts)
        if references is None:
            rows: list[list[str]] = [[] for _ in prompts]
        elif isinstance(references, str) or not isinstance(references, (list, tuple)):
            # 5: "'int' object is not iterable"; {"a": 1}: its keys taken for passages
            raise InputError("references must be a list of passages (strings), one list per prompt")
        else:
            references = list(references) or [[] for _ in prompts]  # [] (no passages) as ChatLookahead takes it
            if _one_passage_list(references):
                if len(prompts) != 1:
                    raise InputError(_ONE_LIST_FOR_MANY.format(count=len(prompts)))
                references = [references]
            if len(references) != len(prompts):
                raise InputError(f"references has {len(references)} lists but there are {len(prompts)} prompts")
            rows = []
            for r in references:
                if r is None:
                    r = []
                if not isinstance(r, (list, tuple)) or not all(isinstance(p, str) for p in r):
                    raise InputError("each entry of references must be a list of passages (strings)")
                rows.append(list(r))
        return [engine.passages(passages or engine.seeds.lookup(prompt)) for prompt, passages in zip(prompts, rows)]

    def _run(
        self, prompts: Sequence[str], stop, kwargs: dict, on_block=None, cancel: threading.Event | None = None
    ) -> EngineRun:
        """One batched ``generate`` over ``prompts``; ``on_block(row, tokens, piece)`` sees each accepted block.

        The engine is read once: an assignment of ``model`` or ``tokenizer`` meanwhile (another
        thread's) builds another engine, and a call that read it again encoded with one tokenizer
        and decoded with the other engine."""
        engine = self._engine
        kwargs = dict(kwargs)
        config = resolve_config(self.lookahead, kwargs)
        max_new = kwargs.pop("max_new_tokens", None)
        max_new = positive_int("max_new_tokens", self.max_new_tokens if max_new is None else max_new)
        references = self._references(prompts, kwargs.pop("references", None), engine)
        sampling = self._sampling(kwargs, engine)
        if kwargs:
            raise ConfigError(
                f"unknown option(s) for LookaheadLLM: {', '.join(sorted(kwargs))} (known: max_new_tokens, references, "
                f"enable_lookahead, lookahead, {', '.join(SAMPLING_FIELDS)})"
            )
        stop = checked_stop(stop if stop is not None else self.stop)
        rows = [RowRequest(self._encode(p, engine), stop, refs) for p, refs in zip(prompts, references)]
        return engine.run(
            rows, max_new_tokens=max_new, config=config, sampling=sampling, on_block=on_block, cancel=cancel
        )

    # ------------------------------------------------------------ BaseLLM hooks

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return self._decode(prompts, stop, run_manager, kwargs)

    def _decode(
        self,
        prompts: list[str],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
        cancel: threading.Event | None = None,
    ) -> LLMResult:
        if not prompts:
            return LLMResult(generations=[])
        on_block = None
        if run_manager is not None and len(prompts) == 1:

            def on_block(row: int, tokens: list[int], piece: str) -> None:
                if piece:
                    run_manager.on_llm_new_token(piece)

        run = self._run(prompts, stop, kwargs, on_block, cancel)
        generations = []
        for row, tracker in enumerate(run.trackers):
            text = tracker.final_text()
            if on_block is not None:
                rest = tracker.rest()
                if rest:
                    run_manager.on_llm_new_token(rest)
            generations.append([Generation(text=text, generation_info=run.info(row))])
        return LLMResult(
            generations=generations, llm_output={"stats": run.result.stats.as_dict(), "model_name": self.model_name}
        )

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        """Chunks as blocks are accepted. Intermediate chunks carry no generation_info (LangChain
        merges chunk infos key by key and keeps equal ints instead of summing them, so partial
        counters cannot add up); the last chunk carries all the stats. Every chunk goes to the token
        callbacks, the last one even when its text is empty, as LangChain does for ChatLookahead's."""
        yield from self._decode_stream(prompt, stop, run_manager, kwargs)

    def _decode_stream(
        self,
        prompt: str,
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationChunk]:
        """``_stream``'s chunks; a set ``cancel`` ends the decode (``astream``, see CancellableAsync)."""
        self._encode(prompt)  # fail fast, in the caller's thread
        blocks = BlockStream(lambda on_block, cancel: self._run([prompt], stop, kwargs, on_block, cancel), cancel)
        with closing(iter(blocks)) as it:  # leaving early cancels the decode
            for block in it:
                if block.piece:
                    chunk = GenerationChunk(text=block.piece)
                    if run_manager is not None:
                        run_manager.on_llm_new_token(block.piece, chunk=chunk)
                    yield chunk
        run = blocks.run
        rest = run.trackers[0].rest()
        chunk = GenerationChunk(text=rest, generation_info=run.info(0))
        if run_manager is not None:
            run_manager.on_llm_new_token(rest, chunk=chunk)
        yield chunk


_ONE_LIST_FOR_MANY = "references is one list of passages but there are {count} prompts: give one list per prompt"


def _one_passage_list(references: Any) -> bool:
    """Whether ``references`` is one list of passages (for a single prompt), not one list per prompt."""
    return isinstance(references, (list, tuple)) and bool(references) and all(isinstance(r, str) for r in references)


def _per_input(references: Any, inputs: Sequence) -> bool:
    """Whether ``references`` holds one passage list per input (else one list, or a bad value)."""
    return (
        isinstance(references, (list, tuple))
        and len(references) == len(inputs)
        and not any(isinstance(r, str) for r in references)
    )


def _rows_of(kwargs: dict[str, Any], rows: Sequence[int], inputs: Sequence) -> dict[str, Any]:
    """``kwargs`` for the inputs at ``rows`` only: per-input ``references`` (one list per input)
    kept for those inputs; anything else, one passage list included, as it is (checked later)."""
    references = kwargs.get("references")
    if _per_input(references, inputs):
        return {**kwargs, "references": [references[i] for i in rows]}
    return kwargs


class _ByPrompt(list):
    """Per-input ``references`` as (prompt, passages) pairs: LangChain's cache decodes only the
    prompts it missed but passes the call's keywords whole, and the lists no longer lined up."""

    def for_prompts(self, prompts: Sequence[str]) -> list:
        """The passage lists of ``prompts``, taken in order (a prompt given twice has two)."""
        unused = list(self)
        out = []
        for prompt in prompts:
            i = next((i for i, (text, _) in enumerate(unused) if text == prompt), None)
            if i is None:  # not one of the call's prompts: let the length check say so
                return [passages for _, passages in self]
            out.append(unused.pop(i)[1])
        return out


def _with_prompts(kwargs: dict[str, Any], prompts: Sequence[str]) -> dict[str, Any]:
    references = kwargs.get("references")
    if len(prompts) > 1 and _per_input(references, prompts):
        return {**kwargs, "references": _ByPrompt(zip(prompts, references))}
    return kwargs


def _concurrency_parts(inputs: list, config, kwargs: dict[str, Any]) -> list[tuple[list, list, dict]] | None:
    """The parts of at most ``max_concurrency`` inputs a batch is decoded in, each with its own
    configs and ``kwargs``; None when no ``max_concurrency`` is set (one part)."""
    from langchain_core.runnables.config import get_config_list

    if not inputs:
        return None
    configs = get_config_list(config, len(inputs))
    if configs[0].get("max_concurrency") is None:
        return None
    size = wave_width(configs[0]["max_concurrency"], len(inputs))
    if _one_passage_list(kwargs.get("references")) and len(inputs) > 1:
        # each part of one prompt would take it as that prompt's passages
        raise InputError(_ONE_LIST_FOR_MANY.format(count=len(inputs)))
    configs = [{**c, "max_concurrency": None} for c in configs]
    starts = range(0, len(inputs), size)
    return [
        (inputs[i : i + size], configs[i : i + size], _rows_of(kwargs, range(i, min(i + size, len(inputs))), inputs))
        for i in starts
    ]


def _merged(size: int, bad: dict[int, Exception], good: list[int], answers: list) -> list:
    """The batch's results in input order: each bad input's error, the good ones' answers."""
    results: list = [None] * size
    for i, err in bad.items():
        results[i] = err
    for i, answer in zip(good, answers):
        results[i] = answer
    return results


_CALL_OPTIONS: contextvars.ContextVar[str | None] = contextvars.ContextVar("rag_lookahead_llm_call", default=None)
# LangChain's own keywords of generate; and references, which change the speed, never the text
_NOT_OPTIONS = frozenset({"tags", "metadata", "run_name", "run_id", "references"})


@contextlib.contextmanager
def _call_options(kwargs: Mapping[str, Any]) -> Iterator[None]:
    """Make this call's options part of ``_identifying_params`` while LangChain reads them (an
    explicit None too: ``temperature=None`` turns a field's sampling off)."""
    options = {k: v for k, v in kwargs.items() if k not in _NOT_OPTIONS}
    token = _CALL_OPTIONS.set(repr(sorted(options.items())) if options else None)
    try:
        yield
    finally:
        _CALL_OPTIONS.reset(token)
