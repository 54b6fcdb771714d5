"""Errors a user can act on. The CLI prints their message as one line instead of a traceback."""

from __future__ import annotations

import os
import re
import shlex


class RagLookaheadError(Exception):
    """Base class: something the caller must fix; ``str(err)`` is a one-line explanation."""


class ConfigError(RagLookaheadError, ValueError):
    """An invalid setting or argument."""


class InputError(RagLookaheadError, ValueError):
    """Invalid input data: empty prompt, prompt longer than the model's context, empty question."""


class NoRoomError(InputError):
    """A prompt that leaves no room for an answer in the model's context window. ``length`` and
    ``holds`` (the limit as the message names it) let a caller that built the prompt (the RAG
    chains) say again in its own words what made it too long (:meth:`reworded`)."""

    def __init__(self, length: int, holds: str, what: str = "the input", advice: str = "") -> None:
        self.length, self.holds, self.what, self.advice = length, holds, what, advice
        super().__init__(no_room_message(length, holds, what, advice))

    def __reduce__(self):  # rebuilt from its parts (the default passes the message alone), notes kept
        return type(self), (self.length, self.holds, self.what, self.advice), self.__dict__

    def reworded(self, what: str, advice: str) -> NoRoomError:
        """The same refusal, the prompt named ``what`` and ``advice`` after it."""
        return NoRoomError(self.length, self.holds, what, advice)


def no_room_message(length: int, holds: str, what: str = "the input", advice: str = "") -> str:
    """How a prompt of ``length`` tokens that leaves no room for an answer is refused: ``what``
    names the prompt, ``holds`` the context limit, ``advice`` ("; ...") says how to shorten it."""
    return (
        f"{what} has {length} tokens but the model's context holds {holds}, prompt and"
        f" answer together: no room is left for an answer{advice}"
    )


class ModelLoadError(RagLookaheadError, OSError):
    """A model could not be found, downloaded, verified or converted."""


class IndexLoadError(RagLookaheadError, OSError):
    """A document index is missing, corrupt, or was built with another embedding model."""


class CorpusWarning(UserWarning):
    """A corpus file skipped or read with a caveat; the index report lists each one as well."""


class RebuildWarning(UserWarning):
    """An index build re-embeds everything (the old index cannot be reused); the report notes it too."""


def first_line(error: BaseException) -> str:
    """What a command prints for ``error``: its message's first line that holds text (a message that
    starts with a line break printed an empty one), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


#: invisible characters that words are written with (Persian, Indic scripts, emoji sequences): kept as they are
_JOINERS = frozenset("\u200c\u200d")
#: a byte that was not UTF-8, as errors="surrogateescape" (os.fsdecode, argv) holds it
ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
#: any UTF-16 surrogate, which no UTF-8 encoder takes alone (json.loads of "\ud800", pypdf's ToUnicode maps)
SURROGATE = re.compile("[\ud800-\udfff]")


def one_line(text: str) -> str:
    """``text`` for one line of a report: control characters and line breaks (a file named
    ``"a\\nskipped b: empty"`` printed a fake report line) and other invisible characters (a bidi
    override) as escapes, ``\\n``, ``\\x1b``, ``\\u2028``; spaces and the zero-width (non-)joiners
    that words are spelt with stay (a Persian folder name printed with ``\\u200c`` inside a word)."""
    import unicodedata

    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or ch in _JOINERS or unicodedata.category(ch) == "Zs" else _escape(ch) for ch in text
    )


def _escape(ch: str) -> str:
    """One invisible character as an escape bash's ``$'...'`` reads back: ``\\n``, ``\\x1b`` below
    U+0080, ``\\u00ad`` above (``\\xad`` is kept for a byte that is not UTF-8, see
    :func:`undecodable_bytes_escaped`: bash reads it as that byte, not as the character)."""
    code = ord(ch)
    if code < 0x80:
        return ascii(ch)[1:-1]
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def undecodable_bytes_escaped(text: str) -> str:
    """``text`` with each byte of a name that was not UTF-8 (held as a surrogate escape,
    U+DC80..U+DCFF, as :func:`os.fsdecode` holds it) written ``\\xNN``: bash's ``$'...'`` reads that
    back as the byte, where ``\\udcfe`` read back as three other bytes and named another folder."""
    return ESCAPED_BYTE.sub(lambda m: f"\\x{ord(m[0]) - 0xDC00:02x}", text)


def quoted_path(path: str | os.PathLike[str]) -> str:
    """:func:`shown_path` in quotes, for a path inside a sentence (``repr`` showed ``\\udcfe``)."""
    return f"'{shown_path(path)}'"


def shown_path(path: str | os.PathLike[str]) -> str:
    """``path`` for a message: control characters and line breaks escaped (:func:`one_line`), bytes
    that are not UTF-8 as ``\\xNN``. A command prints an error's first line only
    (:func:`first_line`), so a folder named ``"docs\\nold"`` was said as ``corpus folder not found:
    docs``, another folder's name."""
    return one_line(undecodable_bytes_escaped(os.fspath(path)))


def shell_word(path: str | os.PathLike[str]) -> str:
    """``path`` as one word to paste into a shell (a folder with spaces): quoted by ``shlex``, or,
    holding control characters, in bash's ``$'...'`` form, whose escapes are :func:`one_line`'s
    (``shlex`` kept a newline as it is, and the message was cut there); a byte that is not UTF-8
    as ``\\xNN``, which bash reads back as that byte."""
    text = os.fspath(path)
    if text.isprintable():
        return shlex.quote(text)
    return "$'" + one_line(undecodable_bytes_escaped(text.replace("\\", "\\\\").replace("'", "\\'"))) + "'"
