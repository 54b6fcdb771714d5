"""Shared fixtures. The default model is loaded once per test session and reused by every test file;
so are the default embedder and an index of the bundled corpus, which many files only read."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model():
    """``(model, tokenizer)`` of the embedded default model in bf16 on CPU (converts it on first use)."""
    import torch

    from rag_lookahead.models import load_model

    return load_model("default", dtype=torch.bfloat16, device="cpu")


@pytest.fixture(scope="session")
def default_model_fp32():
    """The same weights in fp32, loaded through the local-folder path (only when a test asks for it)."""
    import torch

    from rag_lookahead.models import default_model_dir, load_model

    return load_model(str(default_model_dir()), dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def e5_embedder():
    """The default embedder (multilingual-e5-small), loaded once per session. Each load reads and
    unpacks the 4-bit weights and calibrates the int8 linears: 5-13 s on the 2-core CI machine, which
    every ``build_index``/``load_index`` without an embedder (every ``ask``) paid again."""
    from rag_lookahead.rag.embedders import get_embedder

    return get_embedder()


@pytest.fixture
def shared_embedder(monkeypatch, e5_embedder):
    """``get_embedder`` hands out the session's :func:`e5_embedder` for the default model's names
    (the real embedder, loaded once); other names load as before. For tests whose subject is not
    the embedder's loading: ``ask`` and the pipelines open an index through it on every call."""
    from rag_lookahead.rag import embedders

    real = embedders.get_embedder
    default_names = {"default", "e5-small", "e5", embedders.E5SmallEmbedder.name.lower()}

    def shared(name: str | None = None):
        if (embedders.DEFAULT_EMBEDDER if name is None else name).strip().lower() in default_names:
            return e5_embedder
        return real(name)

    monkeypatch.setattr(embedders, "get_embedder", shared)
    return e5_embedder


@pytest.fixture(scope="session")
def bundled_index_dir(tmp_path_factory, e5_embedder):
    """An index of the bundled corpus (``corpora/``), built once per session. Tests only read it
    (a test that writes to an index builds or copies its own)."""
    from rag_lookahead.ask import bundled_corpus
    from rag_lookahead.rag.index import build_index

    folder = tmp_path_factory.mktemp("bundled") / "index"
    build_index(bundled_corpus(), folder, e5_embedder, progress=False)
    return folder
