"""Where rag_lookahead keeps what it can rebuild: converted models, cost curves, BM25's words.

A module of its own so that callers which do not load a model (the index, the CLI) can find the
cache without importing torch."""

from __future__ import annotations

import os
from pathlib import Path

from rag_lookahead.errors import ConfigError, quoted_path

__all__ = ["cache_dir", "env_folder", "expand_user", "home_dir", "refuse_blank_path"]


def cache_dir() -> Path:
    """Root of our cache: ``$RAG_LOOKAHEAD_CACHE``, else ``$XDG_CACHE_HOME/rag_lookahead``,
    else ``~/.cache/rag_lookahead``."""
    if (own := env_folder("RAG_LOOKAHEAD_CACHE")) is not None:
        return own
    if (xdg := env_folder("XDG_CACHE_HOME")) is not None:
        return xdg / "rag_lookahead"
    return home_dir("RAG_LOOKAHEAD_CACHE") / ".cache" / "rag_lookahead"


def env_folder(name: str) -> Path | None:
    """The folder the environment variable ``name`` names; None where it is unset or blank, or, for
    an ``XDG_*`` variable, not an absolute path (relative, or a ``~user`` naming no user: the XDG
    spec says to ignore such a value). One of ours must be absolute after ``~``: a relative one
    named another folder from every working folder (another 1.26 GB conversion, another index)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    xdg = name.startswith("XDG_")
    try:
        path = expand_user(value, f"${name}")
    except ConfigError:
        if xdg:
            return None
        raise
    if path.is_absolute():
        return path
    if xdg:
        return None
    raise ConfigError(
        f"${name} {value!r} is a relative path, which names another folder from each working folder: "
        "give an absolute path"
    )


def refuse_blank_path(path: str | os.PathLike[str] | None, what: str, instead: str = "give a path") -> None:
    """A ConfigError naming ``what`` where ``path`` is a blank string ("" or spaces), as an unset
    variable gives (``rag_lookahead index "$DOCS"``): pathlib reads "" as ".", so the working folder
    was indexed in place of the documents, which dropped out of the index. ``instead``: what to do."""
    if isinstance(path, str) and not path.strip():
        raise ConfigError(f"{what} {path!r} is empty (an unset variable?): {instead}")


def expand_user(path: str | os.PathLike[str], what: str) -> Path:
    """``Path(path).expanduser()``, where a ``~user`` naming no user (or a ``~`` with no home to
    find) is a ConfigError naming ``what``, not pathlib's RuntimeError (a traceback in the CLI);
    so is a blank ``path`` (:func:`refuse_blank_path`)."""
    refuse_blank_path(path, what)
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise ConfigError(
            f"{what} {quoted_path(path)}: its ~ names no home folder (no such user, or $HOME unset); give a full path"
        ) from None


def home_dir(setting: str) -> Path:
    """The user's home folder; ConfigError (saying to set ``setting``) where there is none to find
    ($HOME unset and no passwd entry, as for a container's arbitrary uid)."""
    try:
        return Path.home()
    except RuntimeError:
        raise ConfigError(f"no home folder to keep files in ($HOME unset, no passwd entry): set ${setting}") from None
