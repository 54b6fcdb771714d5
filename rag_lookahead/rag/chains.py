"""Retrieval chains that seed the lookahead trie with the retrieved passages.

Retrieval returns ``k_seed`` passages; the best ``k_prompt`` go into the prompt (their tokens seed
the row's context pool like any prompt token), the rest are handed to :class:`LookaheadLLM` as
``references``: they are never shown to the model, so the answer is unchanged, but when the
model quotes them the trie already holds the words and drafts whole phrases.

Three shapes:

* :func:`build_chat_rag_chain` - current LangChain style: LCEL with a ``ChatPromptTemplate`` and
  :class:`rag_lookahead.langchain.chat_model.ChatLookahead`; question -> ``{"question", "answer", "sources",
  "stats"}``, and ``.stream()`` yields the sources first, then the answer block by block.
* :func:`build_rag_chain` - an LCEL ``Runnable`` over :class:`LookaheadLLM`: question (str, message or
  ``{"question": ...}``) -> ``{"answer", "sources", "stats"}``.
* :func:`build_retrieval_qa` - ``langchain_classic.chains.RetrievalQA.from_chain_type`` with a
  :class:`SeedingRetriever`. ``RetrievalQA`` cannot pass per-query kwargs to its LLM, so the
  retriever registers the extra passages on the LLM (``LookaheadLLM.register_seeds``), keyed by the
  texts of the passages it returns; the LLM picks them up for the prompt that contains those texts.
  This works across threads and needs no context variables; with a non-lookahead LLM the wrapper
  only returns the top ``k_prompt`` documents. Each comes back with its heading in the prompt
  under ``metadata["context_label"]`` ("[1] (docs/budget.md)"), which the chain's document prompt
  uses so that the prompt is the one ``make_prompt`` (and ``ask``) builds.
"""

from __future__ import annotations

import difflib
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.prompt_values import PromptValue
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableGenerator, RunnableLambda, RunnablePassthrough
from langchain_core.runnables.config import run_in_executor
from langchain_core.runnables.utils import AddableDict
from pydantic import StrictInt

from rag_lookahead.checks import positive_int, unicode_text
from rag_lookahead.errors import ConfigError, InputError, NoRoomError
from rag_lookahead.langchain.sampling_fields import SAMPLING_FIELDS

__all__ = [
    "DEFAULT_K_SEED",
    "RAG_TEMPLATE",
    "RAG_PROMPT",
    "RAG_SYSTEM",
    "RAG_CHAT_PROMPT",
    "DocumentIndexRetriever",
    "SeedingRetriever",
    "as_retriever",
    "check_k",
    "check_input_keys",
    "check_question_fits",
    "seed_count",
    "retrieve",
    "aretrieve",
    "format_context",
    "make_prompt",
    "passage_prompt_words",
    "source_info",
    "build_rag_chain",
    "build_chat_rag_chain",
    "build_retrieval_qa",
]

RAG_TEMPLATE = (
    "Answer the question using only the context below. Quote the context's exact words where they answer it. "
    "If the answer is not in the context, say that it is not there. Answer in the language of the question.\n"
    "请只根据下面的资料回答问题，尽量直接引用资料原文；如果资料里没有答案，请说明资料中没有。用提问的语言回答。\n"
    "\n"
    "Context / 资料:\n"
    "{context}\n"
    "\n"
    "Question / 问题: {question}"
)

RAG_PROMPT = PromptTemplate.from_template(RAG_TEMPLATE)

RAG_SYSTEM = (
    "Answer the question using only the context the user gives. Quote the context's exact words where they answer "
    "it. If the answer is not in the context, say that it is not there. Answer in the language of the question.\n"
    "请只根据用户给出的资料回答问题，尽量直接引用资料原文；如果资料里没有答案，请说明资料中没有。用提问的语言回答。"
)

RAG_CHAT_PROMPT = ChatPromptTemplate.from_messages(
    [("system", RAG_SYSTEM), ("human", "Context / 资料:\n{context}\n\nQuestion / 问题: {question}")]
)
SNIPPET_CHARS = 160


class DocumentIndexRetriever(BaseRetriever):
    """Retrieves passages from a rag_lookahead :class:`~rag_lookahead.rag.index.DocumentIndex`.

    ``k`` and ``mode`` are defaults; ``retriever.invoke(query, k=2, mode="lexical")`` overrides
    them for one call (LangChain's standard retriever contract). Documents carry ``source``,
    ``chunk_id`` and ``score`` metadata. ``k`` and ``mode`` are checked here, as ``index.search``
    checks them: pydantic took ``k=True`` as 1 and ``"2"`` as 2, and ``k=0`` or ``mode="bm25"``
    failed only at the first search.
    """

    index: Any
    k: StrictInt = 4
    mode: str | None = None

    def __init__(self, **fields: Any) -> None:
        from rag_lookahead.rag.index import check_search_mode

        if "k" in fields:
            fields["k"] = positive_int("k", fields["k"])  # numpy integers too, as search takes them
        if fields.get("mode") is not None:
            check_search_mode(fields["mode"])
        super().__init__(**fields)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        k: int | None = None,
        mode: str | None = None,
    ) -> list[Document]:
        return self._search(query, k, mode)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        k: int | None = None,
        mode: str | None = None,
    ) -> list[Document]:
        return await run_in_executor(None, self._search, query, k, mode)

    def _search(self, query: str, k: int | None, mode: str | None) -> list[Document]:
        hits = self.index.search(query, self.k if k is None else k, mode=self.mode if mode is None else mode)
        return [p.to_document() for p in hits]


def as_retriever(retriever_or_index: Any, k: int) -> BaseRetriever:
    """A ``BaseRetriever`` for a :class:`.index.DocumentIndex`, a folder holding one, or a retriever."""
    from pathlib import Path

    if isinstance(retriever_or_index, BaseRetriever):
        if hasattr(retriever_or_index, "k"):  # ours and most vector-store retrievers: ask for k_seed
            try:
                return retriever_or_index.model_copy(update={"k": max(k, retriever_or_index.k)})
            except Exception:
                return retriever_or_index
        if hasattr(retriever_or_index, "search_kwargs"):
            kwargs = dict(retriever_or_index.search_kwargs or {})
            kwargs["k"] = max(k, kwargs.get("k", 0))
            return retriever_or_index.model_copy(update={"search_kwargs": kwargs})
        return retriever_or_index
    if isinstance(retriever_or_index, (str, Path)):
        from rag_lookahead.rag.index import load_index

        retriever_or_index = load_index(retriever_or_index)
    from rag_lookahead.rag.index import DocumentIndex

    if isinstance(retriever_or_index, DocumentIndex):
        return DocumentIndexRetriever(index=retriever_or_index, k=k)
    if hasattr(retriever_or_index, "as_retriever"):
        return retriever_or_index.as_retriever(k=k)
    raise ConfigError(f"expected a retriever or a DocumentIndex, got {type(retriever_or_index).__name__}")


#: passages retrieved (those past the prompt's seed the trie) when a command line names no ``--k-seed``
DEFAULT_K_SEED = 8


def seed_count(k_prompt: int, k_seed: int | None, names: tuple[str, str] = ("k_prompt", "k_seed")) -> int:
    """``k_seed``, or where it is not given the larger of ``k_prompt`` and ``DEFAULT_K_SEED`` (so
    that ``--k 10`` alone is not refused for retrieving fewer than it shows), checked with
    ``k_prompt`` as :func:`check_k` checks them."""
    k_seed = max(k_prompt, DEFAULT_K_SEED) if k_seed is None else k_seed
    check_k(k_prompt, k_seed, names)
    return k_seed


def check_k(k_prompt: int, k_seed: int, names: tuple[str, str] = ("k_prompt", "k_seed")) -> None:
    """Passages in the prompt (k_prompt >= 1) and retrieved (k_seed >= k_prompt; the rest seed the
    trie); ``names``: what the caller calls them (a command line's ``--k``, ``--k-seed``)."""
    prompt_name, seed_name = names
    positive_int(prompt_name, k_prompt)
    if not isinstance(k_seed, int) or isinstance(k_seed, bool) or k_seed < k_prompt:  # True is an int
        raise ConfigError(f"{seed_name} must be an integer >= {prompt_name} ({k_prompt}), got {k_seed!r}")


def check_question_text(question: str) -> None:
    """Refuse a question UTF-8 cannot encode: argv bytes that were not UTF-8 reach Python as lone
    surrogates, which the tokenizers reject with a TypeError."""
    unicode_text(question, "the question is", " (its bytes were not valid UTF-8: is the terminal's encoding UTF-8?)")


def retrieve(
    retriever: BaseRetriever, question: str, k_seed: int, config: RunnableConfig | None = None
) -> list[Document]:
    _check_question(question)
    return list(retriever.invoke(question, config=config))[:k_seed]


async def aretrieve(
    retriever: BaseRetriever, question: str, k_seed: int, config: RunnableConfig | None = None
) -> list[Document]:
    """:func:`retrieve` through ``retriever.ainvoke``."""
    _check_question(question)
    return list(await retriever.ainvoke(question, config=config))[:k_seed]


def _check_question(question: Any) -> None:
    if not isinstance(question, str) or not question.strip():
        raise InputError("the question is empty")
    check_question_text(question)


def check_question_fits(llm: Any, question: str) -> int | None:
    """The question's length in ``llm``'s tokens (None where no tokenizer of it can be reached), or
    ``InputError`` if the model's context cannot hold that many: the prompt holds the question and
    more. The chains check it before retrieving (a 100,000-character question spent 15 s in the
    retriever before the model refused it) and ``ask`` before building its chain."""
    from rag_lookahead.decoding.inputs import check_prompt_room

    llm = _unbound(llm)  # through bind/with_retry: a wrapper has no tokenizer of its own
    get_engine = getattr(llm, "get_engine", None)  # ChatLookahead("default") holds its model there
    holder = get_engine() if callable(get_engine) else llm
    tokenizer, model = getattr(holder, "tokenizer", None), getattr(holder, "model", None)
    if tokenizer is None:
        return None
    # always counted (milliseconds): neither characters nor bytes bound the tokens (a CJK
    # Extension-B character is 3 tokens; NFC normalization makes U+1D160 3 characters)
    tokens = len(tokenizer.encode(question, add_special_tokens=False, verbose=False))
    if model is not None and not isinstance(model, str):
        check_prompt_room(model, tokens)
    return tokens


def passage_prompt_words(shown: int, k: str, alone: str, one_fits: bool = True) -> tuple[str, str]:
    """``(what, advice)`` for :func:`~rag_lookahead.decoding.inputs.no_room_words` where the prompt
    built from the question and its ``shown`` passages leaves no room for an answer: a smaller ``k``
    (as the caller names it: ``'k'``, ``--k``, ``k_prompt``) or a shorter question where more than
    one passage is shown and the prompt with the first one alone fits (``one_fits``), else ``alone``
    (no k is smaller than 1, and a smaller one would not help). The server's ``/v1/rag``, ``ask`` and
    the chains say it so."""
    what = f"the prompt built from the question and its {shown} passage(s)"
    if shown < 2:
        return what, f"; {alone}"
    if not one_fits:
        return what, f"; even with one passage it is too long, so no smaller {k} helps: {alone}"
    return what, f"; ask with a smaller {k} or a shorter question"


#: what makes room where the question and one passage fill the model's context (ask and the chains;
#: the server's client can only shorten the question)
ONE_PASSAGE_ADVICE = (
    "ask a shorter question, index the documents in smaller chunks (a smaller chunk size),"
    " or use a model with a longer context"
)


def _check_passages_fit(
    model: Any,
    build_prompt: Callable[[Sequence[Document]], str | PromptValue],
    shown: Sequence[Document],
    k: str = "k_prompt",
) -> None:
    """Refuse, before decoding, a prompt that its ``shown`` passages make too long for ``model``'s
    context, saying so and naming ``k`` (:func:`passage_prompt_words`): the model's own refusal
    ("the input has 1385 tokens ...") named neither. ``build_prompt(passages)``: the prompt as the
    chain hands it to the model with those passages, built only for a model of ours (another kind,
    or a prompt that is a Runnable of the user's, goes on as before and refuses an overlong prompt
    in its own words); it is measured as the model will decode it, with the options its ``bind``
    wrappers pass. Only a refused prompt of several passages is built again with the first alone:
    where that does not fit either, no smaller ``k`` helps, and the refusal says what does."""
    from rag_lookahead.langchain.chat_model import ChatLookahead

    model, options = _unwrapped(model)
    if _is_lookahead(model):
        check = model.check_prompt
    elif isinstance(model, ChatLookahead):
        for name in _TAKEN_BY_LANGCHAIN:
            options.pop(name, None)
        check = functools.partial(model.check_messages, **options)
    else:
        return

    def measure(passages: Sequence[Document], what: str = "the input", advice: str = "") -> None:
        check(build_prompt(passages), what, advice)

    try:
        measure(shown, *passage_prompt_words(len(shown), k, ONE_PASSAGE_ADVICE))
    except NoRoomError as refused:
        if len(shown) < 2 or _leaves_room(measure, shown[:1]):
            raise
        raise refused.reworded(*passage_prompt_words(len(shown), k, ONE_PASSAGE_ADVICE, one_fits=False)) from None


def _leaves_room(measure: Callable[..., None], passages: Sequence[Document]) -> bool:
    """Whether the prompt built with ``passages`` leaves room for an answer (``measure`` refuses it)."""
    try:
        measure(passages)
    except NoRoomError:
        return False
    return True


#: bound keywords LangChain's chat model call takes itself, before the model's own options (none
#: changes the prompt): ``stop``, and what ``with_structured_output`` binds for tracing
_TAKEN_BY_LANGCHAIN = ("stop", "ls_structured_output_format", "structured_output_format")


def format_context(docs: Sequence[Document]) -> str:
    return CONTEXT_SEPARATOR.join(f"{context_label(i, doc)}\n{doc.page_content}" for i, doc in enumerate(docs, start=1))


def context_label(number: int, doc: Document) -> str:
    """What heads a passage in the prompt's context: ``[1] (docs/budget.md)``."""
    source = doc.metadata.get("source", "")
    return f"[{number}] ({source})" if source else f"[{number}]"


CONTEXT_SEPARATOR = "\n\n"
#: the metadata key SeedingRetriever puts each passage's heading under, for RetrievalQA's document prompt
CONTEXT_LABEL = "context_label"


def make_prompt(question: str, docs: Sequence[Document], prompt: PromptTemplate = RAG_PROMPT) -> str:
    return prompt.format(context=format_context(docs), question=question.strip())


def source_info(doc: Document, in_prompt: bool) -> dict:
    text = doc.page_content
    snippet = " ".join(text.split())
    if len(snippet) > SNIPPET_CHARS:
        snippet = snippet[: SNIPPET_CHARS - 1] + "…"
    info = {
        "source": doc.metadata.get("source"),
        "chunk_id": doc.metadata.get("chunk_id"),
        "score": doc.metadata.get("score"),
        "in_prompt": in_prompt,
        "snippet": snippet,
        "text": text,
    }
    if doc.metadata.get("also_in"):  # the other files with the same text (the prompt labels the first source only)
        info["also_in"] = list(doc.metadata["also_in"])
    return info


#: per-call options of LookaheadLLM that the RAG chain passes on from its input dict
_CALL_OPTIONS = ("enable_lookahead", "max_new_tokens", *SAMPLING_FIELDS)
#: the keys that may hold the question in a chain's input dict
_QUESTION_KEYS = ("question", "query")
#: option names meant for the model or the retriever (LookaheadLLM's and ChatLookahead's call options,
#: OpenAI-style ones, a retriever's ``k``): an input key among them that a chain does not take is refused
_OPTION_NAMES = tuple(
    dict.fromkeys(
        (
            *_CALL_OPTIONS,
            *("references", "lookahead", "max_tokens", "max_completion_tokens", "stop", "timeout", "n", "k"),
            *("presence_penalty", "frequency_penalty", "tools", "tool_choice", "parallel_tool_calls"),
        )
    )
)


def check_input_keys(inputs: dict, taken: Sequence[str]) -> None:
    """Refuse a key of a chain's input dict that was meant for the chain but would be dropped: a model
    or retriever option it does not take (``max_tokens``, ``stop``, ``k``) or a near-miss of a key it
    takes or an option (``temprature``, ``questoin``), where ``llm.invoke(q, temprature=0.5)`` refuses
    it. Any other key passes over: ``RunnablePassthrough.assign(question=itemgetter("input")) | chain``
    keeps ``input``, and graph state carries ``chat_history`` and the like. A near-miss of a key that
    is given is no misspelling of it (``question_id`` beside ``question`` or ``query`` passes)."""
    given = {key for key in inputs if key in taken}
    if given & set(_QUESTION_KEYS):
        given |= set(_QUESTION_KEYS)
    meant = [name for name in (*taken, *_OPTION_NAMES) if name not in given]
    dropped = []
    for key in inputs:
        if not isinstance(key, str) or key in taken:
            continue
        if key in _OPTION_NAMES:
            dropped.append(f"{key!r} (an option this chain does not take)")
        elif near := difflib.get_close_matches(key, meant, n=1, cutoff=0.86):
            dropped.append(f"{key!r} (did you mean {near[0]!r}?)")
    if dropped:
        raise ConfigError(f"input key(s) the chain would drop: {', '.join(dropped)}; it takes {', '.join(taken)}")


def _refuse_other_model_kind(model: Any, chain: str) -> None:
    """``build_rag_chain`` prompts a text LLM with a string, ``build_chat_rag_chain`` a chat model with
    messages: the other kind was built without a word and failed at the first call (inside LangChain,
    or after decoding the whole answer)."""
    from langchain_core.language_models import BaseChatModel, BaseLLM

    if chain == "build_rag_chain" and isinstance(model, BaseChatModel):
        raise ConfigError(
            f"build_rag_chain takes a text LLM (LookaheadLLM), got the chat model {type(model).__name__}: "
            "use build_chat_rag_chain for chat models"
        )
    if chain == "build_chat_rag_chain" and isinstance(model, BaseLLM):
        raise ConfigError(
            f"build_chat_rag_chain takes a chat model (ChatLookahead), got the text LLM {type(model).__name__}: "
            "use build_rag_chain for text LLMs, or ChatLookahead.from_llm(llm)"
        )


def build_rag_chain(
    llm,
    retriever_or_index: Any,
    k_prompt: int = 3,
    k_seed: int = 8,
    prompt: PromptTemplate = RAG_PROMPT,
    *,
    names: tuple[str, str] = ("k_prompt", "k_seed"),
):
    """LCEL chain: question -> ``{"answer": str, "sources": [dict], "stats": dict}``.

    ``sources`` lists all ``k_seed`` passages (``in_prompt`` tells which the model saw).
    Extra call kwargs of :class:`LookaheadLLM` (``enable_lookahead``, ``max_new_tokens``, and the
    sampling options ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``seed``) can be
    given in the input dict: ``{"question": q, "enable_lookahead": False}``; another model option
    (``max_tokens``, ``stop``) or a near-miss (``temprature``) is a ``ConfigError``, other keys pass
    over. A question the model's context cannot hold is refused before retrieving, and a prompt
    that its passages make too long for it before decoding, naming ``k_prompt`` (``names``: what
    the errors call ``k_prompt`` and ``k_seed``; ``ask``'s are ``--k`` and ``--k-seed``).
    Token callbacks (``config={"callbacks": [...]}``) receive each accepted block's text.
    """
    llm, bound = _bound_options(llm)  # llm.bind(...)'s generate() was the bare model's: its options were lost
    if not callable(getattr(type(llm), "generate", None)):  # e.g. llm.with_retry(): an AttributeError inside
        raise ConfigError(
            f"build_rag_chain takes the LLM itself or llm.bind(...), got {type(llm).__name__}: wrap the chain"
            " instead, e.g. build_rag_chain(llm, index).with_retry()"
        )
    _refuse_other_model_kind(llm, "build_rag_chain")
    check_k(k_prompt, k_seed, names)
    retriever = as_retriever(retriever_or_index, k_seed)

    def request(inputs: Any) -> tuple[str, dict]:
        question = _question_of(inputs, (*_QUESTION_KEYS, *_CALL_OPTIONS))
        extra = {k: v for k, v in inputs.items() if k in _CALL_OPTIONS} if isinstance(inputs, dict) else {}
        check_question_fits(llm, question)
        return question, extra

    def prompt_call(docs: list[Document], question: str, extra: dict) -> tuple[list, dict]:
        """``generate``'s arguments: the prompt of the best ``k_prompt`` passages, the rest as references."""
        kwargs = bound | extra
        if _is_lookahead(llm):
            kwargs["references"] = [[d.page_content for d in docs[k_prompt:]]]
        text = make_prompt(question, docs[:k_prompt], prompt)
        _check_passages_fit(llm, lambda passages: make_prompt(question, passages, prompt), docs[:k_prompt], names[0])
        return [text], kwargs

    def traced(config: RunnableConfig) -> dict:
        return {"callbacks": config.get("callbacks"), "tags": config.get("tags"), "metadata": config.get("metadata")}

    def answer(result, docs: list[Document], retrieval_seconds: float) -> dict:
        generation = result.generations[0][0]
        stats = dict(generation.generation_info or {})
        stats["retrieval_seconds"] = round(retrieval_seconds, 4)
        stats["seed_passages"] = len(docs[k_prompt:])
        return {
            "answer": generation.text.strip(),
            "sources": [source_info(d, i < k_prompt) for i, d in enumerate(docs)],
            "stats": stats,
        }

    def run(inputs: Any, config: RunnableConfig) -> dict:
        question, extra = request(inputs)
        t0 = time.perf_counter()
        docs = retrieve(retriever, question, k_seed, config)
        retrieval_seconds = time.perf_counter() - t0
        prompts, kwargs = prompt_call(docs, question, extra)
        return answer(llm.generate(prompts, **traced(config), **kwargs), docs, retrieval_seconds)

    async def arun(inputs: Any, config: RunnableConfig) -> dict:
        """``run`` for ``ainvoke``/``abatch``/``astream``: through ``agenerate``, so a cancelled caller
        ends the decode at its next block (``run`` in a worker thread decoded on to the token limit)."""
        question, extra = request(inputs)
        t0 = time.perf_counter()
        docs = await aretrieve(retriever, question, k_seed, config)
        retrieval_seconds = time.perf_counter() - t0
        prompts, kwargs = prompt_call(docs, question, extra)
        return answer(await llm.agenerate(prompts, **traced(config), **kwargs), docs, retrieval_seconds)

    has_async = callable(getattr(type(llm), "agenerate", None))
    return RunnableLambda(run, afunc=arun if has_async else None, name="rag_lookahead_chain")


def _question_of(inputs: Any, taken: Sequence[str] = _QUESTION_KEYS) -> str:
    """The question of a chain's input, stripped (as the prompt has it: spaces moved the dense ranking):
    a string, a message's text, or the first string (or message) under ``question`` / ``query`` of a
    dict whose keys pass :func:`check_input_keys` with ``taken`` (``{"question": None, "query": q}``
    asks ``q``). Any other input is an ``InputError`` naming what it got (a message, ``None`` under
    ``question`` beside a string under ``query`` and a dict without either read "the question is empty")."""
    if isinstance(inputs, dict):
        check_input_keys(inputs, taken)
        held = {key: inputs[key] for key in _QUESTION_KEYS if key in inputs}
        if not held:
            keys = ", ".join(repr(key) for key in inputs) or "no keys"
            raise InputError(f"no question: the input dict holds {keys}, the question goes under 'question' or 'query'")
        texts = [text for text in map(_text_of, held.values()) if text is not None]
        if not texts:
            got = ", ".join(f"{key}={type(value).__name__}" for key, value in held.items())
            raise InputError(f"the question must be a string or a message, got {got}")
        question = next((text for text in texts if text.strip()), texts[0])
    else:
        question = _text_of(inputs)
        if question is None:
            raise InputError(
                f"expected a question string, a message or {{'question': ...}}, got {type(inputs).__name__}"
            )
    if not question.strip():
        raise InputError("the question is empty")
    return question.strip()


def _text_of(value: Any) -> str | None:
    """A question's text: a string, or a message's text (``chain.invoke(HumanMessage(q))``); None for anything else."""
    if isinstance(value, BaseMessage):
        return str(value.text)
    return value if isinstance(value, str) else None


def _unbound(model: Any) -> Any:
    """The model under every wrapper that holds one in ``.bound`` (``bind``, ``bind_tools``,
    ``with_retry``, ``with_config``), for what the chain reads off the model itself: its tokenizer
    and context (the fit check) and ``register_seeds``. The chain still calls the wrapper."""
    return _unwrapped(model)[0]


def _unwrapped(model: Any) -> tuple[Any, dict[str, Any]]:
    """:func:`_unbound`'s model, and the keywords those wrappers pass on to its calls (an outer
    one wins, as in the call)."""
    from langchain_core.runnables.base import RunnableBindingBase

    options: dict[str, Any] = {}
    while isinstance(model, RunnableBindingBase):
        options = dict(model.kwargs or {}) | options
        model = model.bound
    return model, options


def _bound_options(model: Any) -> tuple[Any, dict[str, Any]]:
    """The model under ``bind`` wrappers, and the keywords they bind (an outer one wins). Other
    wrappers (``with_retry``) are not unwrapped: their behaviour would be lost in silence. Nor is
    one that carries a config (``with_config(callbacks=..., tags=...)``, ``with_listeners``): it is
    given back as it is, and :func:`build_rag_chain` refuses it (its callbacks were dropped unseen)."""
    from langchain_core.runnables import RunnableBinding
    from langchain_core.runnables.retry import RunnableRetry

    options: dict[str, Any] = {}
    while isinstance(model, RunnableBinding) and not isinstance(model, RunnableRetry):
        if model.config or model.config_factories:
            break
        options = dict(model.kwargs or {}) | options
        model = model.bound
    return model, options


def build_chat_rag_chain(
    chat_model: Any,
    retriever_or_index: Any,
    k_prompt: int = 3,
    k_seed: int = 8,
    prompt: ChatPromptTemplate = RAG_CHAT_PROMPT,
) -> Runnable:
    """LCEL chain with a chat prompt: question -> ``{"question", "answer", "sources", "stats"}``.

    Spelled out, it is ``retrieve | RunnablePassthrough.assign(message=prompt | chat_model) | split``:
    ``retrieve`` fetches ``k_seed`` passages, formats the best ``k_prompt`` as the prompt's
    ``{context}`` and registers the rest on a :class:`ChatLookahead` as draft seeds (kept out of
    the prompt, so the answer is unchanged); ``split`` turns the message into ``answer`` text and
    ``stats`` (the model's ``response_metadata``, ``usage`` and ``retrieval_seconds``).
    ``.stream()`` yields ``{"question"}`` and ``{"sources"}`` first, then ``{"answer": piece}`` as
    the model's blocks are accepted, then ``{"stats"}``. Any LangChain chat model works; pass
    ``chat_model.bind(max_tokens=..., temperature=...)`` for per-chain options (an input dict's
    question is under ``question`` or ``query``; a model option such as ``max_tokens`` or a near-miss
    such as ``questoin`` is a ``ConfigError``, other keys pass over). A text LLM is refused: it would
    get the chat prompt as one string (use :func:`build_rag_chain` or ``ChatLookahead.from_llm``).
    """
    seeding = _unbound(chat_model)  # the model itself, through bind/with_retry wrappers
    _refuse_other_model_kind(seeding, "build_chat_rag_chain")
    check_k(k_prompt, k_seed)
    retriever = as_retriever(retriever_or_index, k_seed)

    def fetch(inputs: Any, config: RunnableConfig) -> dict:
        question = _question_of(inputs)
        check_question_fits(seeding, question)
        t0 = time.perf_counter()
        docs = retrieve(retriever, question, k_seed, config)
        shown, seeds = docs[:k_prompt], docs[k_prompt:]
        fetched = {
            "question": question,
            "context": format_context(shown),
            "sources": [source_info(d, i < k_prompt) for i, d in enumerate(docs)],
            "retrieval": {"retrieval_seconds": round(time.perf_counter() - t0, 4), "seed_passages": len(seeds)},
        }
        # the prompt the chat model will get, judged now: before the sources are streamed
        _check_passages_fit(
            chat_model, lambda passages: prompt.invoke({**fetched, "context": format_context(passages)}), shown
        )
        if seeds and hasattr(seeding, "register_seeds"):
            seeding.register_seeds([d.page_content for d in shown], [d.page_content for d in seeds])
        return fetched

    answer = RunnablePassthrough.assign(message=prompt | chat_model)
    return (
        RunnableLambda(fetch, name="retrieve")
        | answer
        | RunnableGenerator(_answer_and_stats, _aanswer_and_stats, name="answer")
    ).with_config(run_name="rag_lookahead_chat_chain")


def _answer_and_stats(chunks: Iterator[dict]) -> Iterator[AddableDict]:
    """The chain's output stream: question and sources as they come, the message as answer text
    (piece by piece) and, with its last piece, the stats."""
    split = _AnswerSplit()
    for chunk in chunks:
        yield from split(chunk)


async def _aanswer_and_stats(chunks: AsyncIterator[dict]) -> AsyncIterator[AddableDict]:
    """:func:`_answer_and_stats` for ``ainvoke``/``astream``/``abatch``."""
    split = _AnswerSplit()
    async for chunk in chunks:
        for part in split(chunk):
            yield part


class _AnswerSplit:
    """One chunk of ``{"question", "sources", "retrieval", "message", ...}`` as the chain's output
    parts (the retrieval timing is held until the message's last piece carries the stats)."""

    def __init__(self) -> None:
        self.retrieval: dict = {}

    def __call__(self, chunk: dict) -> Iterator[AddableDict]:
        for key, value in chunk.items():
            if key == "retrieval":
                self.retrieval = value
            elif key == "message":
                yield from _message_parts(value, self.retrieval)
            elif key != "context":
                yield AddableDict({key: value})


def _message_parts(message: BaseMessage, retrieval: dict) -> Iterator[AddableDict]:
    if not isinstance(message, BaseMessage):  # e.g. chat | StrOutputParser(): its str has no .text
        got = "str" if isinstance(message, str) else type(message).__name__  # StrOutputParser's is a str subclass
        raise ConfigError(
            f"build_chat_rag_chain's chat model must return a message, got {got}: pass the chat "
            "model itself (not chat | StrOutputParser()); a text LLM goes to build_rag_chain"
        )
    last = getattr(message, "chunk_position", None) == "last" or not type(message).__name__.endswith("Chunk")
    text = message.text
    if text or last:  # the key is there even for an empty answer
        yield AddableDict(answer=text)
    if last:
        stats = dict(message.response_metadata or {})
        if getattr(message, "usage_metadata", None):
            stats["usage"] = dict(message.usage_metadata)
        yield AddableDict(stats=stats | retrieval)


def _is_lookahead(llm) -> bool:
    from rag_lookahead.langchain.llm import LookaheadLLM

    return isinstance(llm, LookaheadLLM)


class SeedingRetriever(BaseRetriever):
    """Retrieves ``k_seed`` passages, returns the top ``k_prompt`` and registers the rest on ``llm``
    as references for the prompt that will hold the returned ones (see module docstring). With
    ``prompt`` (the "stuff" prompt ``RetrievalQA`` fills with them), a prompt they make too long
    for ``llm``'s context is refused here, naming ``k_prompt``, before ``llm`` is called."""

    retriever: BaseRetriever
    llm: Any = None
    k_prompt: int = 3
    k_seed: int = 8
    prompt: Any = None

    def __init__(self, **fields: Any) -> None:
        super().__init__(**fields)
        # as build_retrieval_qa checks them: k_prompt=-1 showed every passage but the last
        check_k(self.k_prompt, self.k_seed)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        # stripped as build_rag_chain and ask retrieve with it ("  q\n" ranked other passages)
        question = _question_of(query)
        if self.llm is not None:
            check_question_fits(self.llm, question)
        docs = retrieve(self.retriever, question, self.k_seed, {"callbacks": run_manager.get_child()})
        shown, seeds = docs[: self.k_prompt], docs[self.k_prompt :]
        if self.llm is not None and self.prompt is not None:
            # as RetrievalQA will fill it: the passages headed as below, the query as given
            def filled(passages: Sequence[Document]) -> PromptValue:
                return self.prompt.invoke({"context": format_context(passages), "question": query})

            _check_passages_fit(self.llm, filled, shown)
        if seeds and self.llm is not None and hasattr(self.llm, "register_seeds"):
            self.llm.register_seeds([d.page_content for d in shown], [d.page_content for d in seeds])
        # each with its heading in the prompt, so RetrievalQA's "stuff" prompt is make_prompt's
        return [
            d.model_copy(update={"metadata": {**d.metadata, CONTEXT_LABEL: context_label(i, d)}})
            for i, d in enumerate(shown, start=1)
        ]


def build_retrieval_qa(
    llm,
    retriever_or_index: Any,
    k_prompt: int = 3,
    k_seed: int = 8,
    prompt: PromptTemplate = RAG_PROMPT,
    return_source_documents: bool = True,
):
    """``RetrievalQA.from_chain_type(llm=llm, retriever=SeedingRetriever(...), chain_type_kwargs={"prompt": prompt,
    "document_prompt": <"{context_label}\\n{page_content}">, "document_separator": "\\n\\n"})``.

    Call it as ``qa.invoke({"query": question})`` -> ``{"query", "result", "source_documents"}``;
    the prompt is ``make_prompt``'s for a query without surrounding whitespace (RetrievalQA passes
    the query as given, ``make_prompt`` strips it). A prompt that its passages make too long for
    ``llm``'s context is refused before ``llm`` is called, naming ``k_prompt``.
    """
    from langchain_classic.chains import RetrievalQA

    check_k(k_prompt, k_seed)
    base = as_retriever(retriever_or_index, k_seed)
    seeding = SeedingRetriever(retriever=base, llm=llm, k_prompt=k_prompt, k_seed=k_seed, prompt=prompt)
    return RetrievalQA.from_chain_type(
        llm=llm,
        chain_type="stuff",
        retriever=seeding,
        chain_type_kwargs={
            "prompt": prompt,
            # the passages headed and joined as format_context does: the same prompt as ``ask`` builds
            "document_prompt": PromptTemplate.from_template(f"{{{CONTEXT_LABEL}}}\n{{page_content}}"),
            "document_separator": CONTEXT_SEPARATOR,
        },
        return_source_documents=return_source_documents,
    )
