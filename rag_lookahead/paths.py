"""Where rag_lookahead keeps what it can rebuild: converted models, cost curves, BM25's words.

A module of its own so that callers which do not load a model (the index, the CLI) can find the
cache without importing torch."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Root of our cache: ``$RAG_LOOKAHEAD_CACHE``, else ``$XDG_CACHE_HOME/rag_lookahead``,
    else ``~/.cache/rag_lookahead``."""
    if os.environ.get("RAG_LOOKAHEAD_CACHE"):
        return Path(os.environ["RAG_LOOKAHEAD_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "rag_lookahead"
    return Path.home() / ".cache" / "rag_lookahead"
