"""LookaheadLLM and ChatLookahead calls on a tiny random-weight model: token callbacks that call a
model on the same engine, a batch row's callback that calls another model, cancelling
build_rag_chain's async calls, a call cancelled while it waits for the engine, cancelling
``abatch_as_completed``, the chunks a stream reports to the callbacks, and the engine a call configured
through ``configurable_fields`` decodes with. Measured bugs, each test
failing on the code before its fix (the first two by hanging, so they run the call in a thread and
give up on it after a while)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
from hang_guard import finished
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import ConfigurableField
from tiny_tokenizer import tiny_tokenizer

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import ConfigError
from rag_lookahead.langchain.chat_model import ChatLookahead
from rag_lookahead.langchain.engine import Engine, RowRequest
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.rag.chains import build_rag_chain
from rag_lookahead.tiny import build_tiny_model

NESTED = "a model cannot be called from its own token callback"


class CallOnce(BaseCallbackHandler):
    """At the first token, ``ask()``: what it returned or raised is kept in ``answer``."""

    def __init__(self, ask) -> None:
        self.ask, self.answer = ask, None

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        if self.answer is None:
            try:
                self.answer = self.ask()
            except Exception as err:
                self.answer = err


class ACallOnce(AsyncCallbackHandler):
    """:class:`CallOnce` for an async ``ask()``."""

    def __init__(self, ask) -> None:
        self.ask, self.answer = ask, None

    async def on_llm_new_token(self, token: str, **kwargs) -> None:
        if self.answer is None:
            try:
                self.answer = await self.ask()
            except Exception as err:
                self.answer = err


def _models():
    model, tok = build_tiny_model("qwen2", seed=0), tiny_tokenizer()  # one each: a hang holds its engine
    return (
        LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=10),
        ChatLookahead(model=model, tokenizer=tok, max_tokens=10),
        ChatLookahead(model=model, tokenizer=tok, max_tokens=3),  # another chat model: the same engine
    )


CALLS = {
    "llm.invoke -> llm.invoke": lambda llm, chat, judge, h: llm.invoke("t9 t11", config={"callbacks": [h]}),
    "llm.ainvoke -> llm.invoke": lambda llm, chat, judge, h: asyncio.run(
        llm.ainvoke("t9 t11", config={"callbacks": [h]})
    ),
    "chat.invoke -> judge.invoke": lambda llm, chat, judge, h: chat.invoke("t9 t10", config={"callbacks": [h]}),
    "chat.ainvoke -> judge.invoke": lambda llm, chat, judge, h: asyncio.run(
        chat.ainvoke("t9 t10", config={"callbacks": [h]})
    ),
    "chat.invoke -> judge.stream": lambda llm, chat, judge, h: chat.invoke("t9 t10", config={"callbacks": [h]}),
    "chat.ainvoke -> await judge.ainvoke": lambda llm, chat, judge, h: asyncio.run(
        chat.ainvoke("t9 t10", config={"callbacks": [h]})
    ),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_a_token_callback_calling_its_own_engine_is_refused_not_hung(case):
    """``invoke``/``ainvoke`` with a token callback that calls a model on the same engine (itself, or
    another chat model on the same loaded model) hung for good: the engine's lock was held while the
    callback ran. The inner call is refused at once; the outer answer is the one without callback."""
    llm, chat, judge = _models()
    outer = llm if case.startswith("llm") else chat
    expected = outer.invoke("t9 t11" if outer is llm else "t9 t10")
    alone = judge.invoke("t5 t6").content
    if case.endswith("judge.stream"):
        handler = CallOnce(lambda: "".join(c.content for c in judge.stream("t5 t6")))
    elif case.endswith("judge.ainvoke"):
        handler = ACallOnce(lambda: judge.ainvoke("t5 t6"))
    else:
        handler = CallOnce(lambda: (llm if outer is llm else judge).invoke("t5 t6"))
    (answer,) = finished(lambda: CALLS[case](llm, chat, judge, handler))
    assert not isinstance(answer, BaseException), answer
    assert getattr(answer, "content", answer) == getattr(expected, "content", expected)
    assert isinstance(handler.answer, ConfigError) and NESTED in str(handler.answer)
    assert finished(lambda: judge.invoke("t5 t6").content) == [alone]  # the engine is free again


def test_under_stream_a_token_callback_may_call_its_own_engine():
    """``stream`` sends the chunks to the callbacks in the caller's thread, after the engine took
    them: the inner call waits for the decode and answers as it would alone."""
    llm, chat, judge = _models()
    alone, whole = judge.invoke("t5 t6").content, chat.invoke("t9 t10").content
    handler = CallOnce(lambda: judge.invoke("t5 t6").content)
    (chunks,) = finished(lambda: list(chat.stream("t9 t10", config={"callbacks": [handler]})))
    assert "".join(c.content for c in chunks) == whole and handler.answer == alone


class AskOnStart(BaseCallbackHandler):
    """When its chat model's run starts, asks ``other`` (another model) and keeps the answer."""

    def __init__(self, other: ChatLookahead) -> None:
        self.other, self.answer = other, None

    def on_chat_model_start(self, serialized, messages, **kwargs) -> None:
        self.answer = self.other.invoke("t5 t6").content


def test_a_batch_rows_callback_calling_another_model_decodes_with_that_model():
    """A callback of a ``batch`` row that called another ChatLookahead in the row's thread took the
    row's seat in the batch: that call was decoded with the batch's model (another answer), and the
    row itself decoded apart from the rest of the batch."""
    tok = tiny_tokenizer()
    chat = ChatLookahead(model=build_tiny_model("qwen2", seed=0), tokenizer=tok, max_tokens=10)
    other = ChatLookahead(model=build_tiny_model("qwen2", seed=1), tokenizer=tok, max_tokens=10)
    prompts = ["t9 t10", "t11 t12"]
    alone, other_alone = [chat.invoke(p).content for p in prompts], other.invoke("t5 t6").content
    handler = AskOnStart(other)
    (answers,) = finished(lambda: chat.batch(prompts, config=[{"callbacks": [handler]}, {}]))
    assert handler.answer == other_alone
    assert [a.content for a in answers] == alone
    assert [a.response_metadata["batch_size"] for a in answers] == [2, 2]  # the batch's rows still decode together


def _counted(model) -> list[int]:
    """``[forwards]``: the model's forward passes from now on."""
    forwards, forward = [0], model.forward

    def counted(*args, **kwargs):
        forwards[0] += 1
        return forward(*args, **kwargs)

    model.forward = counted
    return forwards


def _in_engine_run() -> bool:
    """Whether some thread is inside ``Engine.run`` (where the test holds the engine: waiting for it)."""
    for frame in sys._current_frames().values():
        while frame is not None and frame.f_code is not Engine.run.__code__:
            frame = frame.f_back
        if frame is not None:
            return True
    return False


async def _streamed(chunks) -> list:
    return [c async for c in chunks]


@pytest.mark.parametrize("how", ["ainvoke", "astream"])
@pytest.mark.parametrize("kind", ["llm", "chat"])
def test_a_call_cancelled_while_it_waits_for_the_engine_runs_no_forward(kind, how):
    """A cancelled ``ainvoke`` still waiting for another decode to end ran its whole prefill once it
    had the engine (61 s for a 2,700-token prompt on the default model, holding up every call after
    it): nothing looked at the cancel before the first token. Now it ends before any forward. So does
    an ``astream`` whose consumer is cancelled there: LangChain's ``_astream`` set the stream's cancel
    only once the ``next()`` waiting in its worker thread returned, after the prefill and a step. And
    the call stops waiting at once: it kept an executor thread until the engine was free."""
    llm, chat, _ = _models()
    model, engine = (llm, llm.engine) if kind == "llm" else (chat, chat.get_engine())
    model.invoke("t1")  # the first call measures step costs
    forwards = _counted(llm.model)

    async def cancel_while_it_waits() -> None:
        with engine._decoding:  # another decode holds the engine
            asked = model.ainvoke("t9 t10") if how == "ainvoke" else _streamed(model.astream("t9 t10"))
            call = asyncio.ensure_future(asked)
            while not _in_engine_run():
                await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(200):  # the engine still held: the cancelled call stops waiting all the same
                if not _in_engine_run():
                    break
                await asyncio.sleep(0.01)
            assert not _in_engine_run(), "a cancelled call kept a worker thread waiting for the engine"

    # asyncio.run returns once its worker threads end
    assert finished(lambda: asyncio.run(cancel_while_it_waits())) == [None]
    assert forwards[0] == 0


def test_a_run_cancelled_before_it_holds_an_idle_engine_runs_no_forward():
    """A cancel already set when the run takes an idle engine (no wait, so the check made while
    waiting never ran) ends the run there with ``CancelledError``, before any forward, and frees
    the engine."""
    model, tok = build_tiny_model("qwen2", seed=0), tiny_tokenizer()
    engine = Engine(model, tok)
    rows = [RowRequest(tok.encode("t9 t10"))]
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(asyncio.CancelledError):
            engine.run(rows, max_new_tokens=8, config=LookaheadConfig(), sampling={}, cancel=cancel)
        assert forwards == []
        assert engine._decoding.acquire(blocking=False), "the cancelled run kept the engine"
        engine._decoding.release()
        engine.run(rows, max_new_tokens=8, config=LookaheadConfig(), sampling={}, cancel=threading.Event())
        assert forwards  # the hook sees this model's forwards
    finally:
        hook.remove()


@pytest.mark.parametrize("kind", ["llm", "chat"])
def test_a_kept_stream_left_by_break_decodes_on_until_it_is_closed(kind):
    """As the README says: a ``break`` leaves a stream held in a variable open (Python closes only
    a generator nothing holds), so its decode goes on; ``close()`` ends it at the next block and
    frees the engine."""
    model, tok = build_tiny_model("qwen2", seed=0, max_positions=4096), tiny_tokenizer()
    off = LookaheadConfig(enabled=False)  # one token a forward
    if kind == "llm":
        runnable, limit = LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=1000, lookahead=off), "max_new_tokens"
        engine = runnable.engine
    else:
        runnable, limit = ChatLookahead(model=model, tokenizer=tok, max_tokens=1000, lookahead=off), "max_tokens"
        engine = runnable.get_engine()
    runnable.invoke("t1", **{limit: 2})  # the first call measures step costs
    forwards = _counted(model)
    kept = runnable.stream("t9 t10")
    for n, _ in enumerate(kept):
        if n == 1:
            break
    at_break = forwards[0]
    deadline = time.monotonic() + 60
    while forwards[0] < at_break + 5:  # still decoding with nobody reading
        assert time.monotonic() < deadline, "the kept stream's decode did not go on"
        time.sleep(0.01)
    kept.close()
    at_close = forwards[0]
    assert engine._decoding.acquire(timeout=30), "close() left the engine held"
    engine._decoding.release()
    time.sleep(0.2)
    assert forwards[0] <= at_close + 1 < 1000


@pytest.mark.parametrize("kind", ["llm", "chat"])
def test_cancelling_abatch_as_completed_ends_its_decodes(kind):
    """LangChain's ``abatch_as_completed`` runs each ``ainvoke`` in a task of its own that nothing
    cancelled: once its consumer was cancelled, the decodes ran on to their token limit, holding the
    engine (the next 3-token call waited 84 s behind 2,000 forwards). Now they end at the next block."""
    model, tok = build_tiny_model("qwen2", seed=0, max_positions=4096), tiny_tokenizer()
    off = LookaheadConfig(enabled=False)  # one token a forward
    if kind == "llm":
        runnable, limit = LookaheadLLM(model=model, tokenizer=tok, max_new_tokens=1000, lookahead=off), "max_new_tokens"
    else:
        runnable, limit = ChatLookahead(model=model, tokenizer=tok, max_tokens=1000, lookahead=off), "max_tokens"
    runnable.invoke("t1", **{limit: 2})  # the first call measures step costs
    forwards = _counted(model)

    async def consume() -> None:
        async for _ in runnable.abatch_as_completed(["t9 t10", "t5 t6"]):
            pass

    async def forwards_after_cancelling() -> int:
        consumer = asyncio.ensure_future(consume())
        while forwards[0] == 0:  # decoding
            await asyncio.sleep(0.005)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        before = forwards[0]
        await runnable.ainvoke("t5 t6", **{limit: 3})  # has the engine once the cancelled decodes end
        return forwards[0] - before

    (after,) = finished(lambda: asyncio.run(forwards_after_cancelling()))
    assert after <= 4  # the step under way, then the 3-token call's own 3


class Fixed(BaseRetriever):
    k: int = 4

    def _get_relevant_documents(self, query, *, run_manager):
        return [Document(page_content=f"t{i} t{i + 1} t{i + 2}", metadata={"source": f"d{i}"}) for i in range(5, 9)]


@pytest.mark.parametrize("how", ["ainvoke", "abatch"])
def test_cancelling_build_rag_chain_async_calls_ends_the_decode(how):
    """``build_rag_chain(...).ainvoke``/``abatch`` ran the sync chain in a worker thread, where a
    cancelled caller never reached the decode: it ran on to its token limit holding the engine, and
    the next call waited for it (20 s here). Now the next call starts at once."""
    model = build_tiny_model("qwen2", seed=0, max_positions=4096)
    forward = model.forward

    def slow_forward(*args, **kwargs):  # 10 ms a step: 2,000 tokens take 20 s
        time.sleep(0.01)
        return forward(*args, **kwargs)

    model.forward = slow_forward
    off = LookaheadConfig(enabled=False)  # one token a step
    llm = LookaheadLLM(model=model, tokenizer=tiny_tokenizer(), max_new_tokens=2000, lookahead=off)
    chain = build_rag_chain(llm, Fixed(), k_prompt=2, k_seed=4)
    short = {"question": "t9 t10", "max_new_tokens": 4}
    a_answer, answer = asyncio.run(chain.ainvoke(short)), chain.invoke(short)
    assert (a_answer["answer"], a_answer["sources"]) == (answer["answer"], answer["sources"])
    assert a_answer["stats"]["new_tokens"] == 4 and a_answer["stats"]["seed_passages"] == 2

    async def cancel_then_call() -> str:
        call = chain.ainvoke({"question": "t9 t10"}) if how == "ainvoke" else chain.abatch([{"question": "t9 t10"}])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call, 0.5)
        return await asyncio.wait_for(llm.ainvoke("t5 t6", max_new_tokens=3), 10)

    (answer,) = finished(lambda: asyncio.run(cancel_then_call()))
    assert answer == llm.invoke("t5 t6", max_new_tokens=3)


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def test_every_streamed_chunk_goes_to_the_token_callbacks():
    """LookaheadLLM's stream ends with a chunk carrying the stats, often with empty text, which the
    callbacks never saw (chunks = callbacks + 1); ChatLookahead's reach them all, the last included."""
    llm, chat, _ = _models()

    async def astreamed(model, handler) -> list:
        return [c async for c in model.astream("t5 t6 t7", config={"callbacks": [handler]})]

    for model in (llm, chat):
        for asynchronous in (False, True):
            handler = Tokens()
            if asynchronous:
                chunks = asyncio.run(astreamed(model, handler))
            else:
                chunks = list(model.stream("t5 t6 t7", config={"callbacks": [handler]}))
            texts = [getattr(c, "content", c) for c in chunks]
            assert texts[-1] == "" and handler.tokens == texts, (type(model).__name__, asynchronous)


def test_a_models_lookahead_settings_change_by_a_checked_copy():
    """``llm.lookahead.max_key_length = 0`` changed the shared config unchecked, and the next call
    failed deep in the trie; the config is frozen, and a checked copy goes in its place."""
    import dataclasses

    llm, chat, _ = _models()
    for model in (llm, chat):
        with pytest.raises(dataclasses.FrozenInstanceError):
            model.lookahead.max_key_length = 0
        with pytest.raises(ConfigError, match="max_key_length"):
            model.lookahead.replace(max_key_length=0)
    before = llm.invoke("t5 t6 t7 t5 t6 t7")
    llm.lookahead = llm.lookahead.replace(max_key_length=2)
    assert llm.invoke("t5 t6 t7 t5 t6 t7") == before


@pytest.mark.parametrize("kind", ["llm", "chat"])
def test_a_configured_call_decodes_with_the_models_engine(kind):
    """LangChain rebuilds the model from its fields for a call configured through
    ``configurable_fields``: a LookaheadLLM so rebuilt decoded on a new engine of its own, its
    forwards at once with the model's on the same weights, drafting from an empty output pool (0.52 s
    against 0.18 s for an 8-token call on the default model). It now decodes with the model's engine,
    as ChatLookahead's and a ``model_copy`` do: its answer goes into the model's pool, and called
    from a token callback of the model's own decode it is refused as the model itself is. A
    configured ``model`` decodes with that model's engine."""
    llm, chat, _ = _models()
    model, length = (llm, "max_new_tokens") if kind == "llm" else (chat, "max_tokens")

    def text(out) -> str:
        return getattr(out, "content", out)

    configured = model.configurable_fields(**{length: ConfigurableField(id="length")})
    shorter = configured.with_config(configurable={"length": 4})
    copied = model.model_copy(update={length: 4})
    pool = model.output_pool
    assert pool.nodes == 0
    answer = text(shorter.invoke("t9 t11"))
    assert pool.nodes > 0  # the configured call's answer went into the model's pool
    assert copied.output_pool is pool and text(copied.invoke("t9 t11")) == answer  # the text is the same
    for other in (shorter, copied):  # the model's decode holds the engine they would decode with
        handler = CallOnce(lambda other=other: other.invoke("t5 t6"))
        finished(lambda handler=handler: model.invoke("t9 t10", config={"callbacks": [handler]}))
        assert isinstance(handler.answer, ConfigError) and NESTED in str(handler.answer)
    weights = build_tiny_model("qwen2", seed=9)
    own = type(model)(model=weights, tokenizer=model.tokenizer, **{length: 4})
    swapped = model.configurable_fields(model=ConfigurableField(id="weights"), **{length: ConfigurableField(id="n")})
    nodes, wanted = pool.nodes, text(own.invoke("t9 t11"))
    assert wanted != answer and text(swapped.invoke("t9 t11", {"configurable": {"weights": weights, "n": 4}})) == wanted
    assert pool.nodes == nodes  # decoded with the other model's engine, not this one's
