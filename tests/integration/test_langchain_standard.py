"""LangChain's own standard test suites (``langchain-tests``) against our LangChain classes.

* ``ChatModelIntegrationTests`` and ``ChatModelUnitTests`` against :class:`ChatLookahead` on the
  real default model (fp32 weights: on CPUs without native bf16 the bf16 copy decodes ~20x slower),
  with small ``max_tokens`` and fixed-size drafts (no cost calibration) to keep CPU time down;
* ``EmbeddingsIntegrationTests`` against :class:`LangChainEmbeddings` (the default e5-small embedder);
* ``RetrieversIntegrationTests`` against :class:`DocumentIndexRetriever` over an index of the
  bundled ``corpora/en``.

Tests the suite skips for us, and why (see the properties below): image, audio, PDF, video
inputs and tool messages (text-only models); Anthropic-format inputs; JSON mode (no constrained
decoding); model override per call (one model per instance); VCR timing (no HTTP to record).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_tests", reason="the standard suites need the test extra (langchain-tests)")

from langchain_tests.integration_tests import (  # noqa: E402
    ChatModelIntegrationTests,
    EmbeddingsIntegrationTests,
    RetrieversIntegrationTests,
)
from langchain_tests.unit_tests import ChatModelUnitTests, EmbeddingsUnitTests  # noqa: E402

from rag_lookahead.decoding.config import LookaheadConfig  # noqa: E402
from rag_lookahead.langchain.chat_model import ChatLookahead  # noqa: E402
from rag_lookahead.rag.chains import DocumentIndexRetriever  # noqa: E402
from rag_lookahead.rag.embedders import LangChainEmbeddings  # noqa: E402

CORPUS_EN = Path(__file__).resolve().parents[2] / "corpora" / "en"
_LOADED: dict[str, Any] = {}


@pytest.fixture(autouse=True, scope="module")
def _chat_weights(default_model_fp32):
    """The suites build their models from class properties: hand them the session's weights."""
    _LOADED["model"], _LOADED["tokenizer"] = default_model_fp32
    yield
    _LOADED.clear()


def _mark_async_tests(*suites: type) -> None:
    """Mark the suites' async tests for pytest-asyncio (a langchain-tests dependency), whose strict
    mode wants the mark. The mark goes onto the library's own functions: the suites fail any
    subclass that overrides one of their tests."""
    for suite in suites:
        for name, test in inspect.getmembers(suite, inspect.iscoroutinefunction):
            if name.startswith("test_") and not any(m.name == "asyncio" for m in getattr(test, "pytestmark", [])):
                pytest.mark.asyncio(test)


_mark_async_tests(ChatModelIntegrationTests, EmbeddingsIntegrationTests, RetrieversIntegrationTests)


def _chat_params(max_tokens: int) -> dict:
    return {
        "model": _LOADED["model"],
        "tokenizer": _LOADED["tokenizer"],
        "max_tokens": max_tokens,
        "lookahead": LookaheadConfig(budget="fixed", decoding_length=16),
    }


class _ChatSettings:
    @property
    def chat_model_class(self) -> type[ChatLookahead]:
        return ChatLookahead

    @property
    def chat_model_params(self) -> dict:
        # 40 tokens hold a tool call or a two-field structured answer; greetings end on EOS well before
        return _chat_params(40)

    @property
    def supports_model_override(self) -> bool:
        return False  # one loaded model per instance: a per-call ``model=`` is refused


@pytest.mark.slow
class TestChatLookaheadStandard(_ChatSettings, ChatModelIntegrationTests):
    # The suite's docs allow an xfail where the model, not the integration, decides; all are
    # the 0.5B default model's answers (greedy, so they fail the same way every run).
    @pytest.mark.xfail(
        reason="with tool_choice left to the model, the 0.5B default answers a fenced ```json object "
        "instead of a <tool_call>, so there is no tool call to parse",
        strict=False,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason="for the Japanese customer the 0.5B default writes an unescaped quote inside the "
        "description, so the call is not valid JSON (it comes back in invalid_tool_calls)",
        strict=False,
    )
    def test_unicode_tool_call_integration(self, model, *, tool_choice=None, force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)


@pytest.mark.slow
class TestChatLookaheadUnitStandard(_ChatSettings, ChatModelUnitTests):
    @property
    def standard_chat_model_params(self) -> dict:
        # the unit suite adds api_key=..., written for hosted models; a local model takes none and
        # refuses unknown settings
        return {k: v for k, v in super().standard_chat_model_params.items() if k != "api_key"}

    @property
    def chat_model_params(self) -> dict:
        # nothing decodes here, and test_standard_params passes its own max_tokens beside these
        return {k: v for k, v in super().chat_model_params.items() if k != "max_tokens"}


class TestLangChainEmbeddingsStandard(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[LangChainEmbeddings]:
        return LangChainEmbeddings


class TestLangChainEmbeddingsUnitStandard(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[LangChainEmbeddings]:
        return LangChainEmbeddings


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory, e5_embedder):
    from rag_lookahead.rag.index import build_index, load_index

    folder = tmp_path_factory.mktemp("standard") / "index"
    build_index(CORPUS_EN, folder, e5_embedder, progress=False)  # the session's embedder, loaded once
    return load_index(folder, e5_embedder)


class TestDocumentIndexRetrieverStandard(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _index(self, corpus_index):
        self._corpus_index = corpus_index

    @property
    def retriever_constructor(self) -> type[DocumentIndexRetriever]:
        return DocumentIndexRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"index": self._corpus_index, "k": 4}

    @property
    def retriever_query_example(self) -> str:
        return "What does decoding_length control?"
