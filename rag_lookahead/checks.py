"""Argument checks shared by every front end, so each refuses bad values with the same words."""

from __future__ import annotations

import operator
import os
import urllib.parse
from typing import TYPE_CHECKING, Any, TypeAlias

from rag_lookahead.errors import ConfigError, InputError

if TYPE_CHECKING:
    import numpy as np

    #: an integer as ``numbers.Integral`` takes it (``LookaheadConfig``'s fields, token ids): an
    #: ``int`` or a numpy integer, not a ``bool`` (refused at run time; a type checker lets it pass)
    Integer: TypeAlias = int | np.integer[Any]

__all__ = ["hub_endpoint", "is_unicode", "positive_int", "unicode_text"]


def positive_int(name: str, value: Any, *, error: type[Exception] = ConfigError) -> int:
    """``value`` as an ``int`` if it is an integer >= 1, else ``error`` naming ``name``.

    Integer numpy scalars and one-element integer tensors count, as ``model.generate`` takes them
    (anything with ``__index__``); a ``bool``, a float or a string does not."""
    number = None
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            pass
    if number is None or number < 1:
        raise error(f"{name} must be an integer >= 1, got {value!r}")
    return number


def is_unicode(text: str) -> bool:
    """Whether UTF-8 can encode ``text`` (no lone surrogate: JSON's "\\ud800", or the surrogate
    escapes of file names and argv bytes that were not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unicode_text(text: str, subject: str, hint: str = "") -> str:
    """``text`` if UTF-8 can encode it, else :class:`InputError` ("``subject`` not valid Unicode ...").

    A lone surrogate ("\\ud800" in JSON, or argv bytes that were not UTF-8) gave the tokenizers'
    TypeError far from where the text came in."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(f"{subject} not valid Unicode: {err.reason} at character {err.start}{hint}") from None
    return text


def hub_endpoint() -> urllib.parse.SplitResult | None:
    """``$HF_ENDPOINT`` split into its parts; None where it is unset or empty. A value that is not an
    http(s) URL with a host is a ConfigError: huggingface_hub parses it as it is first imported,
    so a port that is no number or a broken ``[`` host was a ValueError traceback from every model
    load, and one with no scheme named no host (the reachability probe tried huggingface.co)."""
    value = os.environ.get("HF_ENDPOINT")
    if not value:
        return None
    try:
        url = urllib.parse.urlsplit(value)
        url.port  # noqa: B018 - raises for a port that is no number or out of range
    except ValueError as err:
        why = str(err)[:1].lower() + str(err)[1:]
    else:
        if url.scheme in ("http", "https") and url.hostname:
            return url
        why = "it needs http:// or https:// and a host, such as https://huggingface.co"
    raise ConfigError(f"$HF_ENDPOINT {value!r} is not a URL: {why}")
