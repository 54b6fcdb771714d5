"""Reading a corpus folder: which files, how much of each, and in which text encoding.

:func:`load_corpus` walks a folder for .txt/.md/.markdown/.pdf files (hidden entries and files of
other types counted, not read; symbolic links only when asked), reads each file once with a size
cap and without blocking on FIFOs or devices, and decodes it (:func:`decode_text`: byte order
mark, UTF-8, damaged UTF-8, else the legacy encoding charset-normalizer finds most likely; a PDF's
pages with :mod:`.pdf_text`). Files that cannot be used are reported, not fatal.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rag_lookahead.checks import is_unicode
from rag_lookahead.errors import (
    ESCAPED_BYTE,
    SURROGATE,
    ConfigError,
    CorpusWarning,
    InputError,
    one_line,
    shown_path,
    undecodable_bytes_escaped,
)
from rag_lookahead.file_reads import read_capped
from rag_lookahead.paths import expand_user
from rag_lookahead.rag.pdf_text import read_pdf_text

__all__ = [
    "MAX_FILE_MB",
    "SUFFIXES",
    "Corpus",
    "DecodedText",
    "decode_text",
    "load_corpus",
    "read_capped",
    "read_input_text",
    "read_text_file",
]

SUFFIXES = (".txt", ".md", ".markdown", ".pdf")
MAX_FILE_MB = 20.0  # larger corpus files are skipped with a report line (--max-file-mb; README "Security and limits")
SKIPS_SHOWN = 5  # skipped files named in the "no loadable files" error; the rest are counted


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _looks_binary(data: bytes) -> bool:
    head = data[:8192]
    if b"\x00" in head:
        return True
    controls = sum(b < 32 and b not in (9, 10, 12, 13, 27) for b in head)
    return controls > max(8, len(head) // 100)


@dataclass(frozen=True)
class DecodedText:
    """A decoded file: ``replaced`` counts undecodable bytes that became U+FFFD."""

    text: str
    encoding: str
    replaced: int = 0


# UTF-32 before UTF-16: the UTF-32-LE mark starts with the UTF-16-LE one.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


_UTF8_PIECE = 1 << 20  # bytes decoded at a time by _decode_utf8_replacing


def _decode_utf8_replacing(data: bytes) -> DecodedText:
    """UTF-8 with every invalid byte replaced by U+FFFD, counted (one per byte). A MB at a time:
    ``re.subn`` over a whole legacy file (every non-ASCII byte invalid) held a piece per match,
    ~24x the file's size (475 MB for a 20 MB GBK file, which every legacy file goes through)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    pieces, replaced = [], 0
    for start in range(0, len(data), _UTF8_PIECE):
        end = start + _UTF8_PIECE
        piece, count = ESCAPED_BYTE.subn("\ufffd", decoder.decode(data[start:end], final=end >= len(data)))
        pieces.append(piece)
        replaced += count
    return DecodedText("".join(pieces), "utf-8", replaced)


def _mostly_utf8(data: bytes, replaced: int) -> bool:
    """True when valid multi-byte UTF-8 dominates the invalid bytes (>= 10x): a damaged UTF-8 file,
    not one in a legacy encoding, where most non-ASCII bytes do not form valid UTF-8."""
    non_ascii = int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) >= 0x80))
    return non_ascii - replaced >= 10 * replaced


def _detect(data: bytes) -> DecodedText | None:
    """The most likely legacy encoding (GBK, Big5, Shift-JIS, EUC-KR, cp125x, ...); see :mod:`.charset`."""
    from rag_lookahead.rag.charset import detect_legacy

    guess = detect_legacy(data)
    return DecodedText(guess.text, guess.encoding) if guess is not None else None


def decode_text(data: bytes) -> DecodedText | None:
    """Decode a text file's bytes; ``None`` if they look binary or fit no encoding.

    Order: a byte order mark; strict UTF-8; UTF-8 with a few bad bytes replaced (U+FFFD, counted);
    else the encoding charset-normalizer finds most likely.
    """
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            if encoding == "utf-8-sig":
                decoded = _decode_utf8_replacing(data[len(bom) :])
                return DecodedText(decoded.text, encoding, decoded.replaced)
            try:  # UTF-16/32: strict, so a binary file that happens to start with FF FE is not "text"
                text = data.decode(encoding).lstrip("\ufeff")
            except UnicodeDecodeError:
                return None
            return None if _looks_binary(text[:8192].encode("utf-8")) else DecodedText(text, encoding)
    if _looks_binary(data):
        return None
    try:
        return DecodedText(data.decode("utf-8"), "utf-8")
    except UnicodeDecodeError:
        pass
    damaged = _decode_utf8_replacing(data)
    if _mostly_utf8(data, damaged.replaced):
        return damaged
    return _detect(data)


def read_text_file(data: bytes) -> str | None:
    """The text of a file's bytes (see :func:`decode_text`); ``None`` if binary or undecodable."""
    decoded = decode_text(data)
    return decoded.text if decoded is not None else None


# ---------------------------------------------------------------- loading files


@dataclass
class Corpus:
    """The files :func:`load_corpus` read: ``docs`` maps a relative path to ``(sha256, text)``."""

    docs: dict[str, tuple[str, str]]
    skipped: list[str] = field(default_factory=list)  # "path: reason"
    notes: list[str] = field(default_factory=list)  # "path: caveat"
    # files whose encoding was guessed (not UTF-8, no byte order mark): read anew where the index
    # was built with another way of guessing (``build.DECODING_VERSION``), the same bytes giving other text
    guessed: set[str] = field(default_factory=set)
    # passed over without a report line each (a notes folder holds many): counted, so the report
    # says they were not read rather than leave out .obsidian/ or a .docx without a word
    hidden: int = 0  # files and folders whose name starts with "." (a folder counts once)
    other_types: int = 0  # files whose suffix is none of SUFFIXES

    def passed_over(self) -> str:
        """``"2 hidden entries (...) and 3 files of other types (...)"``; ``""`` where there were none."""
        parts = []
        if self.hidden:
            entries = "entry" if self.hidden == 1 else "entries"
            parts.append(f'{self.hidden} hidden {entries} (names starting with ".")')
        if self.other_types:
            files = "file of another type" if self.other_types == 1 else "files of other types"
            parts.append(f"{self.other_types} {files} (not {' '.join(SUFFIXES)})")
        return " and ".join(parts)


def _join_surrogates(text: str) -> tuple[str, int]:
    """``text`` with UTF-16 surrogate pairs joined into their characters and unpaired surrogates
    replaced by U+FFFD (counted). pypdf decodes /ToUnicode maps with ``surrogatepass``, so a PDF can
    yield lone surrogates, which no tokenizer, JSON file or UTF-8 encoder accepts."""
    if not SURROGATE.search(text):
        return text, 0
    joined = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return joined, joined.count("\ufffd") - text.count("\ufffd")


def _walk(root: Path, follow_symlinks: bool, skip, corpus: Corpus) -> Iterator[tuple[str, Path]]:
    """``(relative path, path)`` of the candidate files under ``root``: supported suffix, no hidden part.

    Symbolic links are reported and left out unless ``follow_symlinks``; when following, each real
    folder is visited once, so a link loop ends. Hidden entries and files of other types are
    counted in ``corpus.hidden`` and ``corpus.other_types``.
    """
    seen: set[tuple[int, int]] = set()

    def unreadable(err: OSError) -> None:
        skip(
            os.path.relpath(err.filename, root) if err.filename else str(root),
            f"unreadable folder ({err.strerror or err})",
        )

    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_symlinks, onerror=unreadable):
        here = Path(dirpath)
        if follow_symlinks:
            try:
                st = os.stat(here)
            except OSError as err:  # removed (or its link broken) since os.walk listed it
                unreadable(err)
                dirnames[:] = []
                continue
            if (st.st_dev, st.st_ino) in seen:
                dirnames[:] = []
                continue
            seen.add((st.st_dev, st.st_ino))
        rel_dir = here.relative_to(root).parts
        kept = []
        for name in sorted(dirnames):
            if name.startswith("."):
                corpus.hidden += 1
                continue
            if not is_unicode(name):  # surrogate escapes: the docstore, manifest and report cannot write them
                skip(
                    "/".join(rel_dir + (undecodable_bytes_escaped(name),)), "folder name is not valid UTF-8 (rename it)"
                )
                continue
            if not follow_symlinks and os.path.islink(here / name):  # False where it cannot look: os.walk says why
                skip("/".join(rel_dir + (name,)), "symbolic link to a folder, not followed (--follow-symlinks)")
                continue
            kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name.startswith("."):
                corpus.hidden += 1
            elif Path(name).suffix.lower() not in SUFFIXES:
                corpus.other_types += 1
            elif not is_unicode(name):
                skip("/".join(rel_dir + (undecodable_bytes_escaped(name),)), "file name is not valid UTF-8 (rename it)")
            else:
                yield "/".join(rel_dir + (name,)), here / name


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


#: bytes (or characters) of a stage below which its bar is not shown: reading 8 MB of UTF-8 text
#: takes a fraction of a second, of another encoding ~1.3 s here (detection, GBK or cp1252)
STAGE_BAR_LEAST = 8 << 20


#: reading a PDF's text runs ~2 s a MB here, so its bytes weigh this much more in choosing a bar
PDF_READ_WEIGHT = 16


#: seconds after which the reading bar appears where the corpus looked too small for one: a 180 KB
#: PDF whose pages share one content stream holds minutes of text to read (its bytes tell nothing)
READ_BAR_LATE_S = 2.0


def stage_bar(
    shown: bool, desc: str, total: int, unit: str, *, work: int | None = None, late_after: float | None = None
):
    """A tqdm bar for a stage of indexing over ``total`` units, shown from its start (naming the
    file at hand) where the stage is large (``work``, in the units :data:`STAGE_BAR_LEAST`
    counts, when it is not ``total``). Otherwise a bar that shows nothing, or, given
    ``late_after``, one that appears at its first advance after that many seconds."""
    from rag_lookahead.progress import progress_bar

    large = (total if work is None else work) >= STAGE_BAR_LEAST
    hidden = not shown or (not large and late_after is None)
    delay = 0.0 if large or late_after is None else late_after
    return progress_bar(total=total, desc=desc, unit=unit, unit_scale=True, disable=hidden, leave=False, delay=delay)


def _name_file(bar, name: str) -> None:
    """Name the file at hand in the bar; a bar still waiting out its delay (tqdm's ``delay``) shows
    it at its next advance, since drawing it now would show the bar at once."""
    bar.set_postfix_str(name, refresh=getattr(bar, "delay", 0) <= 0)


class _PdfPagesRead:
    """Moves the reading bar through a PDF page by page (the file's bytes shared out over its
    pages), naming the page: one PDF can take minutes, and its bytes say nothing of how long."""

    def __init__(self, bar, name: str, size: int) -> None:
        self.bar, self.name, self.size, self.done = bar, name, size, 0

    def __call__(self, page: int, pages: int) -> None:
        self.bar.set_postfix_str(f"{self.name} (page {page} of {pages})", refresh=False)  # drawn by update
        self._advance(self.size * page // pages)

    def finish(self) -> None:
        self._advance(self.size)

    def _advance(self, done: int) -> None:
        self.bar.update(done - self.done)
        self.done = done


#: the largest input file a command reads whole besides the corpus (prompt sets, datasets, questions)
MAX_INPUT_MB = 256.0


def read_input_text(path: str | Path, max_mb: float = MAX_INPUT_MB) -> str:
    """A user-named input file's UTF-8 text (a leading byte order mark, as Windows editors write
    it, dropped), read as :func:`read_capped` reads (a FIFO never blocks, a device is never read
    without end); ``OSError`` or ``ValueError`` saying why not. A ``~`` is the home folder, as in
    ``--index-dir`` (the shell leaves it in ``--prompts=~/p.jsonl``); one naming no user is a
    :class:`ConfigError` (a ``ValueError``)."""
    data = read_capped(expand_user(path, "input file"), True, max_mb, limit_flag=None)
    if isinstance(data, str):
        raise ValueError(data)
    return data.decode("utf-8-sig")


def _is_pdf(rel: str) -> bool:
    return rel.lower().endswith(".pdf")


def _file_text(
    rel: str,
    data: bytes,
    notes: list[str],
    guessed: set[str],
    *,
    max_file_mb: float = MAX_FILE_MB,
    on_page: Callable[[int, int], None] | None = None,
) -> str:
    """The text of one file (PDF or text); raises ValueError with the reason it cannot be used.
    A text file whose encoding was guessed is added to ``guessed``. A PDF's text is limited to
    ``max_file_mb`` as its file is; ``on_page(done, pages)`` after each of its pages."""
    if _is_pdf(rel):
        pdf = read_pdf_text(data, max_file_mb, on_page)
        notes += [f"{rel}: {note}" for note in pdf.notes]
        text, lone = _join_surrogates(pdf.text)
        if not text.strip():
            raise ValueError("PDF has no extractable text")
        if lone:
            notes.append(f"{rel}: {lone} unpaired UTF-16 surrogate(s) in the PDF's text replaced with U+FFFD")
        return text
    decoded = decode_text(data)
    if decoded is None:
        raise ValueError("binary or in no text encoding we could detect")
    if not decoded.text.strip():
        raise ValueError("empty")
    if decoded.replaced:
        note = f"{rel}: {decoded.replaced} undecodable byte(s) replaced with U+FFFD (read as {decoded.encoding})"
        notes.append(note)
        warnings.warn(note, CorpusWarning, stacklevel=4)
    elif decoded.encoding in ("utf-16", "utf-32"):
        notes.append(f"{rel}: read as {decoded.encoding} (byte order mark)")
    elif decoded.encoding not in ("utf-8", "utf-8-sig"):
        notes.append(f"{rel}: read as {decoded.encoding} (detected)")
        guessed.add(rel)
    return decoded.text


def corpus_root(corpus_dir: str | Path, max_file_mb: float = MAX_FILE_MB) -> Path:
    """The corpus folder :func:`load_corpus` would read, checked without reading it: an
    :class:`InputError` where it is missing or no folder, a :class:`ConfigError` for ``max_file_mb``."""
    root = expand_user(corpus_dir, "corpus folder")
    if not root.exists():
        raise InputError(f"corpus folder not found: {shown_path(root)}")
    if not root.is_dir():
        raise InputError(f"corpus path is not a folder: {shown_path(root)}")
    if not 0 < max_file_mb < float("inf"):
        raise ConfigError(f"max_file_mb must be a positive number of megabytes, got {max_file_mb}")
    return root


def check_corpus(corpus_dir: str | Path, *, follow_symlinks: bool = False, max_file_mb: float = MAX_FILE_MB) -> None:
    """Raise what :func:`load_corpus` would raise before it reads a byte: a missing folder, a bad
    ``max_file_mb``, or no file it would read (an empty folder, one of .docx only). For what must
    come before slow work (``build_index`` loads the embedder first): the walk stops at the
    first file to read, so a corpus of any size answers at once."""
    root = corpus_root(corpus_dir, max_file_mb)
    if next(_walk(root, follow_symlinks, lambda rel, why: None, Corpus(docs={})), None) is None:
        load_corpus(root, follow_symlinks=follow_symlinks, max_file_mb=max_file_mb)  # nothing to read: its error


def load_corpus(
    corpus_dir: str | Path, *, follow_symlinks: bool = False, max_file_mb: float = MAX_FILE_MB, progress: bool = False
) -> Corpus:
    """Read every .txt/.md/.markdown/.pdf under ``corpus_dir`` (recursively; hidden entries and
    other files are counted, see :meth:`Corpus.passed_over`).

    Symbolic links are not followed unless ``follow_symlinks``; files over ``max_file_mb`` are not read,
    and a PDF whose text passes it is given up at that page.
    Each file that cannot be used gets a ``"path: reason"`` in ``skipped`` (also a warning).
    Raises :class:`InputError` when the folder is missing or holds no loadable file. ``progress``:
    a bar in bytes, naming the file being read (and a PDF's page), where reading takes over a
    second (an 18 MB file took 22 s before the embedding bar, with nothing shown) or runs past
    :data:`READ_BAR_LATE_S`.
    """
    root = corpus_root(corpus_dir, max_file_mb)
    corpus = Corpus(docs={})

    def skip(rel: str, why: str) -> None:
        corpus.skipped.append(f"{rel}: {why}")
        warnings.warn(f"skipping {rel}: {why}", CorpusWarning, stacklevel=4)

    files = sorted(_walk(root, follow_symlinks, skip, corpus))
    sizes = [_size_of(path) for _, path in files]
    # a 6 MB PDF took 11-16 s to read with no bar: PDF bytes weigh more
    work = sum(size * (PDF_READ_WEIGHT if _is_pdf(rel) else 1) for (rel, _), size in zip(files, sizes))
    with stage_bar(progress, "reading", sum(sizes), "B", work=work, late_after=READ_BAR_LATE_S) as bar:
        for (rel, path), size in zip(files, sizes):
            _name_file(bar, one_line(rel))
            data = read_capped(path, follow_symlinks, max_file_mb)
            if isinstance(data, str):
                bar.update(size)
                skip(rel, data)
                continue
            pages_read = _PdfPagesRead(bar, one_line(rel), size) if _is_pdf(rel) else None
            if pages_read is None:
                bar.update(size)  # a text file's bytes are read; a PDF's move the bar page by page
            try:
                text = _file_text(rel, data, corpus.notes, corpus.guessed, max_file_mb=max_file_mb, on_page=pages_read)
            except ValueError as e:
                skip(rel, str(e))
                continue
            finally:
                if pages_read is not None:
                    pages_read.finish()
            corpus.docs[rel] = (_sha256(data), text)
    if not corpus.docs:
        shown = corpus.skipped[:SKIPS_SHOWN]  # 3,000 empty files made one 53 KB line
        more = f"; and {len(corpus.skipped) - len(shown)} more" if len(corpus.skipped) > len(shown) else ""
        extra = f" (skipped {len(corpus.skipped)}: {'; '.join(shown)}{more})" if corpus.skipped else ""
        raise InputError(f"no loadable .txt/.md/.markdown/.pdf files in {shown_path(root)}{extra}")
    return corpus
