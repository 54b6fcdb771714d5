"""Shared fixtures. The default model is loaded once per test session and reused by every test file."""

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
