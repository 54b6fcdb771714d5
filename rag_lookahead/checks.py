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

__all__ = ["hub_endpoint", "hub_offline", "hub_url", "is_unicode", "positive_int", "unicode_text"]


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
    """``$HF_ENDPOINT`` split into its parts; None where it is unset or empty. ConfigError for a value
    huggingface_hub cannot parse (a port that is no number or out of range, a broken ``[`` host):
    it parses it as it is first imported, so such a value was a ValueError traceback from every
    model load, a local folder's too. Any other value passes: only a fetch from the hub reads it,
    and :func:`hub_url` checks it there (``hub.example`` with no scheme blocked loads that never
    contact the hub)."""
    value = os.environ.get("HF_ENDPOINT")
    if not value:
        return None
    try:
        url = urllib.parse.urlsplit(value)
        url.port  # noqa: B018 - raises for a port that is no number or out of range
    except ValueError as err:
        raise ConfigError(f"$HF_ENDPOINT {value!r} is not a URL: {str(err)[:1].lower() + str(err)[1:]}") from None
    return url


def hub_url() -> urllib.parse.SplitResult:
    """The URL huggingface_hub fetches from: ``$HF_ENDPOINT``, else https://huggingface.co; for
    callers about to fetch from the hub (a load from a local folder or the cache never reads it).
    ConfigError for a value that is not an http(s) URL with a host: one with no scheme names no
    host (our reachability probe tried huggingface.co), and one set but empty is used as it is,
    so huggingface_hub asked for "/org/model/resolve/main/config.json" and failed saying nothing
    of the variable."""
    url = hub_endpoint()
    if url is None and os.environ.get("HF_ENDPOINT") is None:
        return urllib.parse.urlsplit("https://huggingface.co")
    if url is not None and url.scheme in ("http", "https") and url.hostname:
        return url
    value = os.environ["HF_ENDPOINT"]
    why = "it is set but empty" if not value else "it needs http:// or https:// and a host"
    raise ConfigError(
        f"$HF_ENDPOINT {value!r} is not a URL: {why}; give one such as https://huggingface.co, or unset it"
    )


def hub_offline() -> str | None:
    """The variable that keeps huggingface_hub offline (``HF_HUB_OFFLINE``, else
    ``TRANSFORMERS_OFFLINE``), or None; read as huggingface_hub reads it (the first of the two set
    and not empty decides; 1, ON, YES or TRUE in any letters), but now: it reads them once, at its
    import, which may come before a caller sets one. Ours took "y", "2" or " 1" for offline,
    where huggingface_hub went online, and missed ``TRANSFORMERS_OFFLINE``. Call it after
    :func:`hub_endpoint`: it imports huggingface_hub."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if value := os.environ.get(name):
            return name if value.upper() in ENV_VARS_TRUE_VALUES else None
    return None
