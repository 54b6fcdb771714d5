"""Argument checks shared by every front end, so each refuses bad values with the same words."""

from __future__ import annotations

from typing import Any

from rag_lookahead.errors import ConfigError

__all__ = ["positive_int"]


def positive_int(name: str, value: Any, *, error: type[Exception] = ConfigError) -> int:
    """``value`` if it is an ``int >= 1`` (a ``bool`` is not one), else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name} must be an integer >= 1, got {value!r}")
    return value
