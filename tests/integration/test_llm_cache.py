"""LangChain's cache and chains around LookaheadLLM and ChatLookahead, on a tiny random-weight
model: an answer comes from the cache only for the call that would decode the same text, a batch
that is partly cached decodes the rest, and the chains keep what ``bind`` set. Measured bugs,
each test failing on the code before its fix."""

from __future__ import annotations

import copy

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from tiny_tokenizer import tiny_tokenizer

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.langchain.chat_model import ChatLookahead
from rag_lookahead.langchain.engine import SeedRegistry
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.rag.chains import (
    SNIPPET_CHARS,
    SeedingRetriever,
    build_chat_rag_chain,
    build_rag_chain,
    build_retrieval_qa,
    check_k,
    format_context,
    source_info,
)
from rag_lookahead.tiny import build_tiny_model

A, B, C = "t5 t6 t7", "t9 t10 t11", "t20 t21 t22"


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen2", seed=0)


def make_llm(model, tokenizer=None, **fields) -> LookaheadLLM:
    return LookaheadLLM(model=model, tokenizer=tokenizer or tiny_tokenizer(), max_new_tokens=8, **fields)


class Fixed(BaseRetriever):
    docs: list = []

    def _get_relevant_documents(self, query, *, run_manager):
        return list(self.docs)


def test_a_stop_field_is_in_the_cache_key(model):
    """LangChain sets the key's "stop" to the call's own stop list: a model built with stop= got
    the whole answer cached by one without it."""
    whole = make_llm(model).invoke(A)
    stop = whole.split()[2]
    cut = make_llm(model, stop=[stop]).invoke(A)
    assert cut != whole
    cache = InMemoryCache()
    assert make_llm(model, cache=cache).invoke(A) == whole
    assert make_llm(model, cache=cache, stop=[stop]).invoke(A) == cut
    chat_cut = ChatLookahead(model=model, tokenizer=tiny_tokenizer(), max_tokens=8, stop=[stop]).invoke(A).content
    ChatLookahead(model=model, tokenizer=tiny_tokenizer(), max_tokens=8, cache=cache).invoke(A)
    assert (
        ChatLookahead(model=model, tokenizer=tiny_tokenizer(), max_tokens=8, stop=[stop], cache=cache).invoke(A).content
        == chat_cut
    )


def test_weights_edited_anywhere_are_another_cache_key():
    """The key's weights digest sampled three parameters (the first, the middle one, the last), once
    per engine: a copy with an adapter merged into the attention's values and the MLPs, or the same
    model after an edit in place, was served the answer cached before."""
    import torch

    base = build_tiny_model("qwen2", seed=0)
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name, weight in merged.named_parameters():
            if "v_proj.weight" in name or "mlp" in name:
                weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    want = make_llm(merged).invoke(A)
    assert want != make_llm(base).invoke(A)
    cache = InMemoryCache()
    assert make_llm(base, cache=cache).invoke(A) != want
    assert make_llm(merged, cache=cache).invoke(A) == want  # was the base model's answer
    edited = make_llm(base, cache=cache)
    with torch.no_grad():  # in place, through .data as peft merges: no version counter moves
        for name, weight in base.named_parameters():
            if "mlp" in name:
                weight.data.copy_(dict(merged.named_parameters())[name])
            if "v_proj.weight" in name:
                weight.data.copy_(dict(merged.named_parameters())[name])
    assert edited.invoke(A) == want  # was the answer cached before the edit
    from rag_lookahead.langchain.engine import weights_digest

    spared = copy.deepcopy(merged)
    with torch.no_grad():  # matrices edited but for their first column, where every sample sat (rows 64k)
        for name, weight in spared.named_parameters():
            if "q_proj.weight" in name or "mlp" in name:
                weight[:, 1:] *= 1.01
    assert weights_digest(spared) != weights_digest(merged)


def test_an_explicit_none_option_is_in_the_cache_key(model):
    """``temperature=None`` turns the field's sampling off (greedy), but the key left it out and the
    cached sample came back."""
    greedy = make_llm(model).invoke(A)
    cached = make_llm(model, cache=InMemoryCache(), temperature=0.9, seed=1)
    sampled = cached.invoke(A)
    assert sampled != greedy
    assert cached.invoke(A, temperature=None) == greedy


def test_a_partly_cached_batch_decodes_the_rest_with_their_own_references(model):
    """The cache decodes only the prompts it missed but passed the whole batch's per-input
    references: "references has 2 lists but there are 1 prompts", for every row. References
    change the speed only, so they are not in the key either."""
    plain = make_llm(model)
    want = [plain.invoke(p) for p in (A, B, C)]
    cached = make_llm(model, cache=InMemoryCache())
    refs = [[f"{A} t8"], [f"{B} t12"]]
    assert cached.batch([A, B], references=refs) == want[:2]
    assert cached.batch([A, C], references=refs) == [want[0], want[2]]
    assert cached.batch([C, A, B], references=[[], [f"{A} t8"], []], return_exceptions=True) == [want[2], *want[:2]]


def test_another_chat_template_on_the_same_weights_is_another_cache_key(model):
    other = tiny_tokenizer()
    other.chat_template = "{% for m in messages %}t3 {{ m['content'] }} {% endfor %}t2 assistant "
    cache = InMemoryCache()
    first = make_llm(model, cache=cache).invoke(A)
    own = make_llm(model, other).invoke(A)
    assert own != first
    assert make_llm(model, other, cache=cache).invoke(A) == own


def test_a_rag_chain_over_a_bound_llm_keeps_what_bind_set(model):
    """``build_rag_chain(llm.bind(max_new_tokens=3))`` called the bare model's generate: 8 tokens."""
    llm = make_llm(model)
    docs = [
        Document(page_content=A, metadata={"source": "a.md"}),
        Document(page_content=B, metadata={"source": "b.md"}),
    ]
    chain = build_rag_chain(llm.bind(max_new_tokens=3), Fixed(docs=docs), k_prompt=1, k_seed=2)
    answer = chain.invoke("t5 t6")
    assert answer["stats"]["new_tokens"] == 3
    sampled = build_rag_chain(llm.bind(temperature=0.9, seed=1), Fixed(docs=docs), k_prompt=1, k_seed=2)
    greedy = build_rag_chain(llm, Fixed(docs=docs), k_prompt=1, k_seed=2)
    assert sampled.invoke("t5 t6")["answer"] != greedy.invoke("t5 t6")["answer"]
    assert sampled.invoke({"question": "t5 t6", "temperature": None})["answer"] == greedy.invoke("t5 t6")["answer"]


def test_a_seed_passage_that_is_not_unicode_is_left_out_not_raised(model):
    """Seeds change the speed only; a lone surrogate in one failed the request with tokenizers'
    bare TypeError, and once registered, every later call on a prompt with its anchor."""
    llm = make_llm(model)
    shown = Document(page_content=A, metadata={"source": "a.md"})
    seed = Document(page_content="t8 t9 \udce9", metadata={"source": "b.md"})
    prompt = f"context: {A} question: t5 t6"
    want = llm.invoke(prompt)
    qa = build_retrieval_qa(copy.copy(llm), Fixed(docs=[shown, seed]), k_prompt=1, k_seed=2)
    chain = build_rag_chain(llm, Fixed(docs=[shown, seed]), k_prompt=1, k_seed=2)
    assert qa.invoke({"query": "t5 t6"})["result"] and chain.invoke("t5 t6")["answer"]
    assert llm.invoke(prompt) == want
    assert llm.invoke(prompt, references=["t8 t9 \udce9"]) == want
    with pytest.raises(InputError, match="not valid Unicode"):
        llm.get_num_tokens("t8 \udce9")


def test_a_seeding_retriever_checks_its_counts():
    for k_prompt, k_seed in ((-1, 4), (0, 4), (3, 2)):
        with pytest.raises(ConfigError):
            SeedingRetriever(retriever=Fixed(), k_prompt=k_prompt, k_seed=k_seed)
    assert SeedingRetriever(retriever=Fixed(), k_prompt="2", k_seed=4).k_prompt == 2  # as pydantic reads it
    check_k(3, 3)  # every passage retrieved is shown: none seeds the trie, and that is allowed
    assert SeedingRetriever(retriever=Fixed(), k_prompt=3, k_seed=3).k_seed == 3


def test_a_rag_chain_retrieves_with_the_question_the_prompt_holds(model):
    """The prompt held the stripped question but the retriever got the spaces around it, which
    moved the dense ranking: ``ask "  q "`` answered from other passages than ``ask "q"``."""

    class Asked(Fixed):
        queries: list = []

        def _get_relevant_documents(self, query, *, run_manager):
            self.queries.append(query)
            return list(self.docs)

    retriever = Asked(docs=[Document(page_content=A, metadata={"source": "a.md"})])
    build_rag_chain(make_llm(model), retriever, k_prompt=1, k_seed=1).invoke("  t5 t6 \n")
    assert retriever.queries == ["t5 t6"]


def test_a_rag_chain_refuses_a_wrapper_it_would_strip(model):
    """Unwrapping ``with_retry`` as ``bind`` is unwrapped ran the bare model: no retry, unseen."""
    with pytest.raises(ConfigError, match="wrap the chain instead"):
        build_rag_chain(make_llm(model).with_retry(), Fixed(docs=[]), k_prompt=1, k_seed=2)
    # with_config's callbacks and tags were dropped unseen (bind's keywords are kept, see below)
    for wrapped in (
        make_llm(model).with_config(tags=["mine"]),
        make_llm(model).bind(max_new_tokens=2).with_config(callbacks=[]),
        make_llm(model).with_listeners(on_end=lambda run: None),
    ):
        with pytest.raises(ConfigError, match="wrap the chain instead"):
            build_rag_chain(wrapped, Fixed(docs=[]), k_prompt=1, k_seed=2)


class Asked(Fixed):
    """Records each query it is asked."""

    queries: list = []

    def _get_relevant_documents(self, query, *, run_manager):
        self.queries.append(query)
        return list(self.docs)


def make_chat(model) -> ChatLookahead:
    return ChatLookahead(model=model, tokenizer=tiny_tokenizer(), max_tokens=8)


def test_the_rag_chains_refuse_an_input_key_they_would_drop(model):
    """``{"question": q, "max_tokens": 5}`` (or ``temprature``, ``stop``, ``timeout``, ``k``) ran
    and dropped the key in silence, where ``llm.invoke(q, temprature=0.5)`` refuses it."""
    docs = [Document(page_content=A, metadata={"source": "a.md"})]
    chain = build_rag_chain(make_llm(model), Fixed(docs=docs), k_prompt=1, k_seed=1)
    for key, value, why in (
        ("max_tokens", 5, "an option this chain does not take"),
        ("temprature", 0.5, "did you mean 'temperature'\\?"),
        ("stop", ["t9"], "an option this chain does not take"),
        ("timeout", 0.001, "an option this chain does not take"),
        ("k", 1, "an option this chain does not take"),
    ):
        with pytest.raises(ConfigError, match=f"would drop: '{key}' \\({why}\\); it takes question, query, "):
            chain.invoke({"question": "t5 t6", key: value})
    with pytest.raises(ConfigError, match="'questoin' \\(did you mean 'question'\\?\\)"):
        chain.invoke({"questoin": "t5 t6"})
    assert chain.invoke({"query": "t5 t6", "max_new_tokens": 3})["stats"]["new_tokens"] == 3
    chat_chain = build_chat_rag_chain(make_chat(model), Fixed(docs=docs), k_prompt=1, k_seed=1)
    for key in ("max_tokens", "temperature"):  # the chat chain takes its options from chat.bind(...)
        with pytest.raises(
            ConfigError, match=f"'{key}' \\(an option this chain does not take\\); it takes question, query$"
        ):
            chat_chain.invoke({"question": "t5 t6", key: 3})
    assert chat_chain.invoke({"query": "t5 t6"})["answer"] is not None


def test_the_rag_chains_pass_over_keys_not_meant_for_them(model):
    """Since every unknown key was refused, ``RunnablePassthrough.assign(question=itemgetter("input")) | chain``
    (which keeps ``input``) and input carrying ``chat_history`` or a ``question_id`` failed; they
    answer as ``{"question": q}`` does."""
    from operator import itemgetter

    from langchain_core.runnables import RunnablePassthrough

    docs = [
        Document(page_content=A, metadata={"source": "a.md"}),
        Document(page_content=B, metadata={"source": "b.md"}),
    ]
    chains = {
        "build_rag_chain": build_rag_chain(make_llm(model), Fixed(docs=docs), k_prompt=1, k_seed=2),
        "build_chat_rag_chain": build_chat_rag_chain(make_chat(model), Fixed(docs=docs), k_prompt=1, k_seed=2),
    }
    for name, chain in chains.items():
        plain = chain.invoke({"question": "t5 t6"})
        assigned = (RunnablePassthrough.assign(question=itemgetter("input")) | chain).invoke({"input": "t5 t6"})
        assert (assigned["answer"], assigned["sources"]) == (plain["answer"], plain["sources"]), name
        # "toolset" and "top" are one letter or two from options, but plausible keys of their own
        carried = chain.invoke({"question": "t5 t6", "question_id": 7, "chat_history": [], "toolset": 1, "top": 2})
        assert carried["answer"] == plain["answer"], name
        # one letter from "query", but the question is given (under "question"): no misspelling of it
        assert chain.invoke({"question": "t5 t6", "querys": 1})["answer"] == plain["answer"], name


def test_the_rag_chains_refuse_a_question_past_the_context_before_retrieving(model):
    """A question the model's context cannot hold was retrieved for first (15 s for 100,000
    characters on the real index), then refused by the model; ``ask`` checks it first."""
    long_question = "t5 " * 300  # the tiny model's context holds 256 tokens
    docs = [Document(page_content=A, metadata={"source": "a.md"}), Document(page_content=B)]
    chains = {
        "build_rag_chain": lambda r: build_rag_chain(make_llm(model), r, k_prompt=1, k_seed=2),
        "build_chat_rag_chain": lambda r: build_chat_rag_chain(make_chat(model), r, k_prompt=1, k_seed=2),
        "build_retrieval_qa": lambda r: build_retrieval_qa(make_llm(model), r, k_prompt=1, k_seed=2),
    }
    for name, build in chains.items():
        retriever = Asked(docs=docs)
        question = {"query": long_question} if name == "build_retrieval_qa" else long_question
        with pytest.raises(InputError, match="tokens but the model's context holds"):
            build(retriever).invoke(question)
        assert retriever.queries == [], name


def test_the_chat_rag_chain_refuses_a_text_llm_before_decoding(model):
    """``build_chat_rag_chain(LookaheadLLM(...), index)`` was built, then each call retrieved and
    decoded the whole answer (of the chat prompt read as one string) before an ``AttributeError``
    ('str' object has no attribute 'text'); ``chat | StrOutputParser()`` failed so too."""
    from langchain_core.output_parsers import StrOutputParser

    docs = [Document(page_content=A, metadata={"source": "a.md"})]
    for llm in (make_llm(model), make_llm(model).bind(max_new_tokens=2), make_llm(model).with_retry()):
        with pytest.raises(
            ConfigError, match="takes a chat model .*got the text LLM LookaheadLLM: use build_rag_chain"
        ):
            build_chat_rag_chain(llm, Fixed(docs=docs), k_prompt=1, k_seed=1)
    chain = build_chat_rag_chain(make_chat(model) | StrOutputParser(), Fixed(docs=docs), k_prompt=1, k_seed=1)
    for call in (chain.invoke, lambda q: list(chain.stream(q))):
        with pytest.raises(ConfigError, match="chat model must return a message, got str"):
            call("t5 t6")


def test_the_rag_chains_ask_a_message_and_the_key_that_holds_a_string(model):
    """``chat_chain.invoke(HumanMessage(q))`` and ``{"question": None, "query": q}`` both read "the
    question is empty"; any other non-string did too, naming nothing."""
    from langchain_core.messages import HumanMessage

    docs = [Document(page_content=A, metadata={"source": "a.md"})]
    rag = build_rag_chain(make_llm(model), Fixed(docs=docs), k_prompt=1, k_seed=1)
    chat_chain = build_chat_rag_chain(make_chat(model), Fixed(docs=docs), k_prompt=1, k_seed=1)
    for chain in (rag, chat_chain):
        plain = chain.invoke("t5 t6")["answer"]
        assert chain.invoke(HumanMessage(" t5 t6 "))["answer"] == plain
        assert chain.invoke({"question": None, "query": "t5 t6"})["answer"] == plain
        assert chain.invoke({"question": "  ", "query": "t5 t6"})["answer"] == plain  # a blank one too
        assert chain.invoke({"question": HumanMessage("t5 t6")})["answer"] == plain
        with pytest.raises(InputError, match="got int$"):
            chain.invoke(5)
        with pytest.raises(InputError, match="got question=NoneType, query=int$"):
            chain.invoke({"question": None, "query": 3})
        with pytest.raises(InputError, match="no question: the input dict holds 'input'"):
            chain.invoke({"input": "t5 t6"})
        with pytest.raises(InputError, match="the question is empty"):
            chain.invoke({"question": " ", "query": None})


def test_the_rag_chains_keep_k_seed_passages_of_a_retriever_that_returns_more(model):
    """A retriever with no ``k`` to set (a custom one, an ensemble) returns what it likes: the
    chains keep its first ``k_seed``, the first ``k_prompt`` of them shown, the rest seeds."""
    docs = [Document(page_content=f"t{i} t{i + 1} t{i + 2}", metadata={"source": f"d{i}.md"}) for i in range(5, 15)]
    chains = {
        "build_rag_chain": build_rag_chain(make_llm(model), Fixed(docs=docs), k_prompt=1, k_seed=3),
        "build_chat_rag_chain": build_chat_rag_chain(make_chat(model), Fixed(docs=docs), k_prompt=1, k_seed=3),
    }
    for name, chain in chains.items():
        out = chain.invoke("t5 t6")
        assert [s["source"] for s in out["sources"]] == ["d5.md", "d6.md", "d7.md"], name
        assert [s["in_prompt"] for s in out["sources"]] == [True, False, False], name
        assert out["stats"]["seed_passages"] == 2, name


def test_an_empty_answer_is_still_under_the_answer_key(model):
    """A chat model that answers nothing (stopped at its first word) still answers ``""``: the
    output and the stream hold the ``answer`` key as for any answer."""
    docs = [Document(page_content=A, metadata={"source": "a.md"})]
    first = build_chat_rag_chain(make_chat(model), Fixed(docs=docs), k_prompt=1, k_seed=1).invoke("t5 t6")["answer"]
    stopped = ChatLookahead(model=model, tokenizer=tiny_tokenizer(), max_tokens=8, stop=[first.split()[0]])
    chain = build_chat_rag_chain(stopped, Fixed(docs=docs), k_prompt=1, k_seed=1)
    out = chain.invoke("t5 t6")
    assert set(out) == {"question", "answer", "sources", "stats"} and out["answer"] == ""
    parts = list(chain.stream("t5 t6"))
    assert [p["answer"] for p in parts if "answer" in p] == [""] and "stats" in parts[-1]


def test_passages_are_headed_by_their_source_and_shown_in_a_snippet():
    """The prompt heads each passage "[n] (source)", or "[n]" alone for one without a source (not
    "[n] ()"); a source's snippet is its text on one line, cut to ``SNIPPET_CHARS`` characters
    with the ellipsis included."""
    docs = [Document(page_content="x"), Document(page_content="y", metadata={"source": "b.md"})]
    assert format_context(docs) == "[1]\nx\n\n[2] (b.md)\ny"
    long = source_info(Document(page_content="word\n  " * 100), True)["snippet"]
    assert len(long) == SNIPPET_CHARS and long.endswith("…") and long.startswith("word word ")
    short = source_info(Document(page_content=" a\n\tb "), False)
    assert (short["snippet"], short["text"], short["in_prompt"]) == ("a b", " a\n\tb ", False)


def test_the_chat_rag_chain_reaches_the_model_through_with_retry(model):
    """Under ``chat.with_retry()`` the chain found no tokenizer (``RunnableRetry`` was not unwrapped):
    a question past the context was retrieved for first, and the passages past the prompt were
    not handed to the drafter as seeds."""
    long_question = "t5 " * 300  # the tiny model's context holds 256 tokens
    docs = [Document(page_content=A, metadata={"source": "a.md"}), Document(page_content=B)]
    chat = make_chat(model)
    retriever = Asked(docs=docs)
    chain = build_chat_rag_chain(chat.with_retry(), retriever, k_prompt=1, k_seed=2)
    with pytest.raises(InputError, match="tokens but the model's context holds"):
        chain.invoke(long_question)
    assert retriever.queries == []
    assert chain.invoke("t5 t6")["answer"] is not None
    assert chat.get_engine().seeds.lookup(A) == [B]


def test_retrieval_qa_retrieves_with_the_question_stripped(model):
    """RetrievalQA's seeding retriever searched for ``"  q\\n"`` where ``ask`` and ``build_rag_chain``
    search for ``"q"``: the dense ranking moved, and one question got two answers."""
    retriever = Asked(docs=[Document(page_content=A, metadata={"source": "a.md"})])
    build_retrieval_qa(make_llm(model), retriever, k_prompt=1, k_seed=1).invoke({"query": "  t5 t6 \n"})
    assert retriever.queries == ["t5 t6"]


def test_a_name_or_text_where_a_loaded_model_or_tokenizer_goes_is_refused(model):
    """``LookaheadLLM(model="default", tokenizer=tok)`` was taken and every call then failed with
    "'str' object has no attribute 'config'"; an assignment left the LLM unusable; a tokenizer
    given as text, or ``ChatLookahead(model=5)``, raised a TypeError from deep inside."""
    tokenizer = tiny_tokenizer()
    for build in (
        lambda: LookaheadLLM(model="default", tokenizer=tokenizer),
        lambda: ChatLookahead(model=5, tokenizer=tokenizer),
    ):
        with pytest.raises(ConfigError, match="^model must be a loaded model .*from_model_id"):
            build()
    for build in (lambda: make_llm(model, tokenizer="x"), lambda: ChatLookahead(model=model, tokenizer="x")):
        with pytest.raises(ConfigError, match="^tokenizer must be the model's loaded tokenizer"):
            build()
    llm = make_llm(model)
    want = llm.invoke(A)
    with pytest.raises(ConfigError, match="^model must be a loaded model"):
        llm.model = "default"
    assert llm.model is model and llm.invoke(A) == want  # left as it was


def test_references_and_enable_lookahead_of_the_wrong_type_are_refused(model):
    """``references=5`` raised "'int' object is not iterable", a dict had its keys taken for
    passages, and ``enable_lookahead="False"`` decoded with lookahead on."""
    llm = make_llm(model)
    for references in (5, {A: 1}):
        with pytest.raises(InputError, match="^references must be a list of passages"):
            llm.invoke(A, references=references)
    for references in ([5], [{A: 1}]):  # a prompt's own entry
        with pytest.raises(InputError, match="^each entry of references must be a list of passages"):
            llm.invoke(A, references=references)
    chat = ChatLookahead(model=model, tokenizer=tiny_tokenizer(), max_tokens=8)
    for references in (5, {A: 1}, A):
        with pytest.raises(InputError, match="^references must be a list of passages"):
            chat.invoke(A, references=references)
    with pytest.raises(ConfigError, match="^enable_lookahead must be True or False, got 'False'"):
        llm.invoke(A, enable_lookahead="False")
    assert llm.invoke(A, references=(f"{A} t8",), enable_lookahead=False) == llm.invoke(A)


def test_a_boolean_k_seed_is_refused_under_its_own_name(model):
    """``k_seed=True`` passed as the integer 1 and was refused later as "k must be an integer"."""
    for build in (build_rag_chain, build_retrieval_qa):
        with pytest.raises(ConfigError, match=r"^k_seed must be an integer >= k_prompt \(1\), got True"):
            build(make_llm(model), Fixed(docs=[]), k_prompt=1, k_seed=True)


def _passes(result) -> int:
    return result.generations[0][0].generation_info["forward_passes"]


def test_passages_given_or_registered_reach_the_drafts(model):
    """Passages change only the speed, so no text comparison sees them: an engine that dropped
    every call's ``references`` and a text LLM that never looked up its registered seeds (what
    ``SeedingRetriever`` and ``build_retrieval_qa`` rely on) passed every test. Each LLM is fresh:
    the shared pool of earlier answers would draft the answer too. The draft size is fixed: the
    auto budget sizes drafts from forwards timed on this machine, and on a busy CPU it drew small
    ones (17 forwards against 15 once)."""
    fixed = LookaheadConfig(budget="fixed")

    def fresh() -> LookaheadLLM:  # a model of its own: the pool of earlier answers is per model
        return LookaheadLLM(
            model=build_tiny_model("qwen2", seed=0), tokenizer=tiny_tokenizer(), max_new_tokens=32, lookahead=fixed
        )

    plain = fresh().generate([A])
    answer = plain.generations[0][0].text
    given = fresh().generate([A], references=[[answer]])
    registered = fresh()
    registered.register_seeds([A], [answer])
    seeded = registered.generate([A])
    for run in (given, seeded):
        assert run.generations[0][0].text == answer
        assert _passes(run) < _passes(plain) / 2, (_passes(run), _passes(plain))

    def fresh_chat() -> ChatLookahead:
        return ChatLookahead(
            model=build_tiny_model("qwen2", seed=0), tokenizer=tiny_tokenizer(), max_tokens=32, lookahead=fixed
        )

    chat_plain = fresh_chat().invoke(A)
    chat_given = fresh_chat().invoke(A, references=[chat_plain.content])
    assert chat_given.content == chat_plain.content
    passes = [m.response_metadata["forward_passes"] for m in (chat_plain, chat_given)]
    assert passes[1] < passes[0] / 2, passes


def test_a_prompt_holding_two_registrations_anchors_is_seeded_by_the_newer():
    """The seeds are looked up newest first: a prompt that holds the anchors of an older
    registration too (a shorter set, of the same document) got the older one's passages."""
    seeds = SeedRegistry()
    seeds.register(["doc"], ["old"])
    seeds.register(["doc", "more"], ["new"])
    assert seeds.lookup("doc more") == ["new"]
    assert seeds.lookup("doc alone") == ["old"]
    seeds.register(["doc"], ["again"])  # registered again: the newest once more
    assert seeds.lookup("doc more") == ["again"]


def test_mean_accepted_counts_the_tokens_of_each_decode_step():
    """``mean_accepted`` is the tokens a decode step gave on average; the prefill's token is no
    decode step's, so a decode without lookahead (one token a step) reads exactly 1.0."""
    llm = LookaheadLLM(
        model=build_tiny_model("qwen2", seed=0),
        tokenizer=tiny_tokenizer(),
        max_new_tokens=32,
        lookahead=LookaheadConfig(budget="fixed"),  # not sized by timings (see the test above)
    )
    plain = llm.generate([A], enable_lookahead=False).generations[0][0]
    info = plain.generation_info
    assert info["new_tokens"] > 2 and info["forward_passes"] == info["new_tokens"] - 1, info
    assert info["mean_accepted"] == 1.0
    seeded = llm.generate([A], references=[[plain.text]]).generations[0][0]
    info = seeded.generation_info
    assert seeded.text == plain.text and info["mean_accepted"] > 1.5, info
    assert info["mean_accepted"] == round((info["new_tokens"] - 1) / info["forward_passes"], 4)


def test_a_call_that_differs_only_in_its_references_is_answered_from_the_cache(model):
    """References change the speed, never the text, so they are no part of the cache key: the same
    prompt with other passages is the cached answer, not decoded again."""
    cached = make_llm(model, cache=InMemoryCache())
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        first = cached.invoke(A, references=[f"{A} t8"])
        decoded = len(forwards)
        assert decoded > 0
        assert cached.invoke(A, references=[f"{B} t12"]) == first
        assert len(forwards) == decoded
    finally:
        hook.remove()


@pytest.mark.parametrize("field", ["seed", "top_k", "top_p", "min_p"])
def test_every_sampling_field_is_in_the_cache_key(model, field):
    """Two sampled models sharing one cache that differ in one sampling field get their own
    answers (a key without ``seed`` returned seed 1's answer to seed 2: no test saw it)."""
    base = dict(temperature=1.5, seed=1, top_k=0, top_p=1.0, min_p=0.0)
    other = {"seed": 2, "top_k": 3, "top_p": 0.3, "min_p": 0.9}[field]
    want = [make_llm(model, **base).invoke(A), make_llm(model, **{**base, field: other}).invoke(A)]
    assert want[0] != want[1]
    cache = InMemoryCache()
    assert [make_llm(model, cache=cache, **{**base, field: v}).invoke(A) for v in (base[field], other)] == want
    chat_fields = dict(base)
    chats = [
        ChatLookahead(model=model, tokenizer=tiny_tokenizer(), max_tokens=8, cache=shared, **{**chat_fields, field: v})
        for shared in (None, InMemoryCache())
        for v in (base[field], other)
    ]
    chat_want = [c.invoke(A).content for c in chats[:2]]
    assert chat_want[0] != chat_want[1]
    assert [c.invoke(A).content for c in chats[2:]] == chat_want


def test_check_prompt_takes_what_invoke_takes(model):
    """``check_prompt`` took a string only: a prompt value or messages, which ``invoke`` takes,
    were refused as an empty prompt. Each form counts as ``invoke`` converts it."""
    from langchain_core.messages import HumanMessage
    from langchain_core.prompts import ChatPromptTemplate, PromptTemplate

    llm = make_llm(model)
    text = "t5 t6 t7"
    assert llm.check_prompt(PromptTemplate.from_template("{q}").invoke({"q": text})) == llm.check_prompt(text)
    as_chat = ChatPromptTemplate.from_messages([("human", "{q}")]).invoke({"q": text})
    for given in (as_chat, [HumanMessage(text)], [("human", text)]):
        assert llm.check_prompt(given) == llm.check_prompt(f"Human: {text}"), given
    with pytest.raises(InputError, match="empty"):
        llm.check_prompt(PromptTemplate.from_template("{q}").invoke({"q": " "}))
