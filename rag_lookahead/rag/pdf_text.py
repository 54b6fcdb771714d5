"""A PDF's text for the index, read page by page with pypdf, as far as the file allows.

What a damaged or hostile PDF did before (2026-12-06 probe):

- one damaged page (a bad Ascii85 or LZW stream, an unterminated string) lost the whole file, and
  an intact file cut just before its final ``%%EOF`` was skipped: now each page is read on its own
  (the good ones kept, the failed ones named in a note), and a file pypdf cannot open is tried once
  more with a new end (``startxref 0``, so pypdf finds its objects by scanning); the user's file is
  never written;
- a 25 KB PDF whose pages share one content stream gave 11 million characters in 86 s, and a 180 KB
  one would have run for hours: text is counted page by page, and a file whose text passes the
  size limit of a corpus file (``--max-file-mb``, what a text file of that text would weigh in
  UTF-8) is given up at that page;
- a 9.7 KB PDF whose 32,768 pages (a page tree that shares its nodes) each draw one 2-million-operator
  content stream would have failed each page in turn at pypdf's parsing limit, ~9 s a page, for
  days: a file is given up at its third page past that limit (:data:`LIMITED_PAGES`); a 1.9 KB one
  whose page shows a 1 MB form 200 times ran 139 s before its text was measured: text is counted
  as it is drawn, and the operators a text page may draw are bounded by the file's size
  (:data:`OPERATORS_PER_BYTE`, at least :data:`LEAST_OPERATORS`); pages with no text operator are
  left to pypdf, which skips them unparsed;
- Korean (``KSC*``) and Big5 (``B5pc-*``) CMaps are missing from pypdf's table of predefined CMaps,
  so their text came out as UTF-16 nonsense without a word: :data:`LEGACY_CJK_CMAPS` adds them, and
  any other CMap pypdf says it does not know gets a note.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rag_lookahead.errors import first_line

__all__ = ["LEGACY_CJK_CMAPS", "PdfText", "read_pdf_text"]

#: predefined CMaps whose codes are a legacy byte encoding that Python decodes, missing from pypdf's
#: table (pypdf 7.1 decoded them as UTF-16-BE); each is checked by a test against text written in it
LEGACY_CJK_CMAPS = {
    "/KSCms-UHC-H": "cp949",  # Microsoft's Unified Hangul Code
    "/KSCms-UHC-V": "cp949",
    "/KSC-EUC-H": "euc-kr",
    "/KSC-EUC-V": "euc-kr",
    "/KSCpc-EUC-H": "cp949",  # Mac OS KS X 1001; cp949 holds its Hangul and Hanja
    "/KSCpc-EUC-V": "cp949",
    "/B5pc-H": "big5",  # Mac OS Big Five
    "/B5pc-V": "big5",
}

#: the end given to a PDF pypdf cannot open: a cross-reference at offset 0, which is none, makes
#: pypdf (not strict) rebuild the table by scanning the file for its objects
_NEW_END = b"\nstartxref\n0\n%%EOF\n"
#: content-stream operators a PDF may have drawn per byte of the file, and at least: text and vector
#: pages compress to about one operator for two bytes of file, so this leaves a wide margin; only a
#: file that draws what it holds over and over (shared streams, forms shown again and again) is cut
OPERATORS_PER_BYTE = 50
LEAST_OPERATORS = 1_000_000
#: pages past pypdf's parsing limits (each costs seconds) a file may have; one more gives it up
LIMITED_PAGES = 2
_FAILED_PAGES_SHOWN = 5
_UNKNOWN_CMAPS_SHOWN = 5
_UNKNOWN_CMAP = re.compile(r"Advanced encoding (\S+) not implemented")


@dataclass
class PdfText:
    """The text of a PDF's readable pages, and what the report should say about the rest."""

    text: str
    notes: list[str] = field(default_factory=list)  # caveats, without the file's name


def _add_legacy_cjk_cmaps() -> None:
    """Put :data:`LEGACY_CJK_CMAPS` into pypdf's private table of predefined CMaps, where that
    table is (a pypdf without it reads such fonts as before) and has no entry of its own for them."""
    try:
        from pypdf import _cmap

        table = _cmap._predefined_cmap
    except (ImportError, AttributeError):
        return
    if isinstance(table, dict):
        for name, codec in LEGACY_CJK_CMAPS.items():
            table.setdefault(name, codec)


class _UnknownCmaps(logging.Handler):
    """Collects the CMaps pypdf says it does not know (it reads their codes as UTF-16-BE)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.names: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("Advanced encoding") or len(self.names) >= _UNKNOWN_CMAPS_SHOWN:
            return  # a message is formatted only where it may name one, and a few names say enough
        try:
            found = _UNKNOWN_CMAP.match(record.getMessage())
        except Exception:  # a message pypdf could not format is not one we look for
            return
        if found:
            self.names.add(found.group(1).rstrip(","))


class _PypdfLogHeard:
    """pypdf's log for a block: kept off stderr (our report says what matters once, in a line,
    not pypdf's "EOF marker not found"), and the CMaps it names as unknown collected."""

    def __enter__(self) -> _UnknownCmaps:
        self._log = logging.getLogger("pypdf")
        self._saved = (self._log.level, self._log.propagate)
        self._heard = _UnknownCmaps()
        self._log.setLevel(logging.WARNING)
        self._log.propagate = False
        self._log.addHandler(self._heard)
        return self._heard

    def __exit__(self, *exc) -> None:
        self._log.removeHandler(self._heard)
        self._log.setLevel(self._saved[0])
        self._log.propagate = self._saved[1]


def _open(data: bytes):
    """A reader of ``data`` and its page count; ``data`` with :data:`_NEW_END` where pypdf cannot
    open it as it is (``True`` second then). Raises the first failure where neither opens."""
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data))  # from the bytes already read: the file is read once
        _check_opens_without_password(reader)
        return reader, len(reader.pages), False
    except _Locked:
        raise
    except Exception as first:  # pypdf raises many types on damaged files
        try:
            reader = PdfReader(io.BytesIO(data + _NEW_END))  # in memory only: the file is not touched
            pages = len(reader.pages)
        except Exception:
            raise first from None
        if not pages:  # not a PDF the new end repaired (text named .pdf opens, with no page)
            raise first from None
        return reader, pages, True


class _OverBudget(Exception):
    """Raised from pypdf's visitors to stop reading a file that costs more than it holds."""


class _Budget:
    """What one file may cost as its pages are read: operators drawn and characters of text."""

    def __init__(self, data_bytes: int, max_bytes: int, max_mb: float) -> None:
        self.operators = max(LEAST_OPERATORS, OPERATORS_PER_BYTE * data_bytes)
        self.characters = max_bytes  # a character is at least a byte in UTF-8
        self.max_mb = max_mb
        self.page = "1"
        self.limited = 0  # pages past pypdf's parsing limits

    def visitors(self) -> dict:
        """``extract_text``'s visitors that count against this budget."""
        return {"visitor_operand_before": self.operator, "visitor_text": self.text}

    def operator(self, operator, operands, cm, tm) -> None:
        self.operators -= 1
        if self.operators < 0:
            raise _OverBudget(
                f"it draws over {OPERATORS_PER_BYTE} content operators per byte of the file (repeated streams or"
                f" forms: a crafted or broken PDF?), given up at page {self.page}"
            )

    def text(self, text, cm, tm, font, size) -> None:
        self.characters -= len(text)
        if self.characters < 0:
            raise _OverBudget(f"its text passes the {self.max_mb:g} MB limit at page {self.page} (--max-file-mb)")


class _Locked(ValueError):
    """A PDF that opens only with a password: said as it is, not tried with a new end."""


def _check_opens_without_password(reader) -> None:
    """Refuse in one line a PDF that needs a password to open (pypdf opens one whose user password
    is empty by itself): each of its pages would fail alike, and a page-by-page note says less."""
    if not reader.is_encrypted:
        return
    try:
        opened = reader.decrypt("")
    except Exception as e:  # e.g. AES without the cryptography package
        raise _Locked(f"encrypted PDF that could not be decrypted ({_error(e)})") from None
    if not opened:  # PasswordType.NOT_DECRYPTED
        raise _Locked("encrypted PDF that needs a password to open: index a copy saved without one")


def _draws_text(page) -> bool:
    """Whether ``page``'s content has an operator that can show text, as pypdf judges it before it
    parses a page (a figure's stream is skipped unparsed, unless a visitor must see its operators:
    our visitors made every drawing page parsed). Where that cannot be told, True."""
    try:
        from pypdf._text_extraction import _has_text_operator

        contents = page.get_contents()
        return contents is None or _has_text_operator(contents.get_data())
    except Exception:  # pypdf's private helper moved, a damaged stream: extract_text says what is wrong
        return True


def _is_limit(e: BaseException) -> bool:
    """pypdf's ``LimitReachedError``: a stream past its parsing limits (seconds of work a page, and
    a 9.7 KB file whose 32,768 pages share that stream would have failed each in turn for days)."""
    return type(e).__name__ == "LimitReachedError"


def _error(e: BaseException) -> str:
    """``"ValueError: <its first line that holds text>"`` (a message starting with a line break printed
    ``"ValueError: "``)."""
    return f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__


def _failed_pages(failed: list[int], pages: int, first_error: BaseException) -> str:
    """``"pages 2, 5 of 7 unreadable (the first one's error)"``; past five pages, the rest counted."""
    shown = ", ".join(str(n) for n in failed[:_FAILED_PAGES_SHOWN])
    more = f" and {len(failed) - _FAILED_PAGES_SHOWN} more" if len(failed) > _FAILED_PAGES_SHOWN else ""
    word = "page" if len(failed) == 1 else "pages"
    return f"{word} {shown}{more} of {pages} unreadable ({_error(first_error)})"


def read_pdf_text(data: bytes, max_mb: float, on_page: Callable[[int, int], None] | None = None) -> PdfText:
    """The text of the readable pages of the PDF ``data``, pages apart by a blank line.

    Raises ValueError saying why the file cannot be used: pypdf cannot open it, no page could be
    read, or its text passes ``max_mb`` MB in UTF-8 (the file is then given up at that page, as a
    text file over the limit is not read). ``on_page(done, pages)`` is called after each page.
    """
    _add_legacy_cjk_cmaps()
    max_bytes = int(max_mb * 2**20)
    texts: list[str] = []
    size = 0
    failed: list[int] = []
    first_error: BaseException | None = None
    with _PypdfLogHeard() as heard:
        try:
            reader, pages, new_end = _open(data)
        except _Locked:
            raise
        except Exception as e:
            raise ValueError(f"unreadable PDF ({_error(e)})") from None
        budget = _Budget(len(data), max_bytes, max_mb)
        for number in range(1, pages + 1):
            budget.page = f"{number} of {pages}"
            try:
                page = reader.pages[number - 1]
                visitors = budget.visitors() if _draws_text(page) else {}  # a figure: pypdf skips it unparsed
                text = (page.extract_text(**visitors) or "").strip()
            except _OverBudget as e:
                raise ValueError(str(e)) from None
            except Exception as e:  # a damaged page: the others are still read
                if _is_limit(e):  # pypdf stopped a stream past its own limits: seconds of work a page
                    budget.limited += 1
                    if budget.limited > LIMITED_PAGES:
                        raise ValueError(
                            f"pypdf's parsing limits stop {budget.limited} pages, the last page {budget.page}"
                            f" ({_error(e)}): a crafted or broken PDF?"
                        ) from None
                failed.append(number)
                first_error = first_error or e
                text = ""
            if text:
                texts.append(text)
                size += len(text.encode("utf-8", "surrogatepass"))
                if size > max_bytes:
                    raise ValueError(
                        f"its text passes the {max_mb:g} MB limit at page {number} of {pages} (--max-file-mb)"
                    )
            if on_page is not None:
                on_page(number, pages)
    if first_error is not None and not texts:
        raise ValueError(f"PDF has no extractable text: {_failed_pages(failed, pages, first_error)}")
    notes = []
    if new_end:
        notes.append("the PDF's end (its %%EOF or cross-reference table) is damaged or missing: read by scanning it")
    if first_error is not None:
        notes.append(_failed_pages(failed, pages, first_error) + ", left out")
    notes += [f"font encoding {name} is unknown to pypdf: its text may read wrong" for name in sorted(heard.names)]
    return PdfText("\n\n".join(texts), notes)
