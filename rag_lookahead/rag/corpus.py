"""Reading a corpus folder: which files, how much of each, and in which text encoding.

:func:`load_corpus` walks a folder for .txt/.md/.markdown/.pdf files (hidden entries skipped, symbolic links
only when asked), reads each file once with a size cap and without blocking on FIFOs or devices,
and decodes it (:func:`decode_text`: byte order mark, UTF-8, damaged UTF-8, else the legacy
encoding charset-normalizer finds most likely). Files that cannot be used are reported, not fatal.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import logging
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rag_lookahead.checks import is_unicode
from rag_lookahead.errors import ConfigError, CorpusWarning, InputError, one_line
from rag_lookahead.file_reads import read_capped
from rag_lookahead.paths import expand_user

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
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a bad byte


def _decode_utf8_replacing(data: bytes) -> DecodedText:
    """UTF-8 with every invalid byte replaced by U+FFFD, counted (one per byte)."""
    text, replaced = _ESCAPED_BYTE.subn("\ufffd", data.decode("utf-8", errors="surrogateescape"))
    return DecodedText(text, "utf-8", replaced)


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


def _read_pdf(data: bytes) -> str:
    from pypdf import PdfReader

    # pypdf logs what it finds wrong ("EOF marker not found"): our report says it once, in a line
    pypdf_log = logging.getLogger("pypdf")
    level = pypdf_log.level
    pypdf_log.setLevel(logging.CRITICAL)
    try:
        reader = PdfReader(io.BytesIO(data))  # from the bytes already read: the file is read once
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
    finally:
        pypdf_log.setLevel(level)
    return "\n\n".join(p for p in pages if p)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _join_surrogates(text: str) -> tuple[str, int]:
    """``text`` with UTF-16 surrogate pairs joined into their characters and unpaired surrogates
    replaced by U+FFFD (counted). pypdf decodes /ToUnicode maps with ``surrogatepass``, so a PDF can
    yield lone surrogates, which no tokenizer, JSON file or UTF-8 encoder accepts."""
    if not _SURROGATE.search(text):
        return text, 0
    joined = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return joined, joined.count("\ufffd") - text.count("\ufffd")


def _walk(root: Path, follow_symlinks: bool, skip) -> Iterator[tuple[str, Path]]:
    """``(relative path, path)`` of the candidate files under ``root``: supported suffix, no hidden part.

    Symbolic links are reported and left out unless ``follow_symlinks``; when following, each real
    folder is visited once, so a link loop ends.
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
            st = os.stat(here)
            if (st.st_dev, st.st_ino) in seen:
                dirnames[:] = []
                continue
            seen.add((st.st_dev, st.st_ino))
        rel_dir = here.relative_to(root).parts
        kept = []
        for name in sorted(dirnames):
            if name.startswith("."):
                continue
            if not is_unicode(name):  # surrogate escapes: the docstore, manifest and report cannot write them
                skip("/".join(rel_dir + (_shown(name),)), "folder name is not valid UTF-8 (rename it)")
                continue
            if not follow_symlinks and os.path.islink(here / name):  # False where it cannot look: os.walk says why
                skip("/".join(rel_dir + (name,)), "symbolic link to a folder, not followed (--follow-symlinks)")
                continue
            kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            if not name.startswith(".") and Path(name).suffix.lower() in SUFFIXES:
                if not is_unicode(name):
                    skip("/".join(rel_dir + (_shown(name),)), "file name is not valid UTF-8 (rename it)")
                    continue
                yield "/".join(rel_dir + (name,)), here / name


def _shown(name: str) -> str:
    """A name as the report can print it: undecodable bytes as ``\\xNN``."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


#: bytes (or characters) of a stage below which its bar is not shown: reading 8 MB of UTF-8 text
#: takes a fraction of a second, of another encoding ~4 s here (detection)
STAGE_BAR_LEAST = 8 << 20


#: reading a PDF's text runs ~2 s a MB here, so its bytes weigh this much more in choosing a bar
PDF_READ_WEIGHT = 16


def stage_bar(shown: bool, desc: str, total: int, unit: str, *, work: int | None = None):
    """A tqdm bar for a stage of indexing over ``total`` units, shown from its start (naming the
    file at hand) where the stage is large (``work``, in the units :data:`STAGE_BAR_LEAST`
    counts, when it is not ``total``); a bar that shows nothing otherwise."""
    from rag_lookahead.progress import progress_bar

    hidden = not shown or (total if work is None else work) < STAGE_BAR_LEAST
    return progress_bar(total=total, desc=desc, unit=unit, unit_scale=True, disable=hidden, leave=False)


#: the largest input file a command reads whole besides the corpus (prompt sets, datasets, questions)
MAX_INPUT_MB = 256.0


def read_input_text(path: str | Path, max_mb: float = MAX_INPUT_MB) -> str:
    """A user-named input file's UTF-8 text (a leading byte order mark, as Windows editors write
    it, dropped), read as :func:`read_capped` reads (a FIFO never blocks, a device is never read
    without end); ``OSError`` or ``ValueError`` saying why not."""
    data = read_capped(Path(path), True, max_mb, limit_flag=None)
    if isinstance(data, str):
        raise ValueError(data)
    return data.decode("utf-8-sig")


def _is_pdf(rel: str) -> bool:
    return rel.lower().endswith(".pdf")


def _file_text(rel: str, data: bytes, notes: list[str], guessed: set[str]) -> str:
    """The text of one file (PDF or text); raises ValueError with the reason it cannot be used.
    A text file whose encoding was guessed is added to ``guessed``."""
    if _is_pdf(rel):
        try:
            text = _read_pdf(data)
        except Exception as e:  # pypdf raises many types on damaged files
            raise ValueError(f"unreadable PDF ({type(e).__name__}: {e})".splitlines()[0]) from None
        text, lone = _join_surrogates(text)
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


def load_corpus(
    corpus_dir: str | Path, *, follow_symlinks: bool = False, max_file_mb: float = MAX_FILE_MB, progress: bool = False
) -> Corpus:
    """Read every .txt/.md/.markdown/.pdf under ``corpus_dir`` (recursively, hidden entries skipped).

    Symbolic links are not followed unless ``follow_symlinks``; files over ``max_file_mb`` are not read.
    Each file that cannot be used gets a ``"path: reason"`` in ``skipped`` (also a warning).
    Raises :class:`InputError` when the folder is missing or holds no loadable file. ``progress``:
    a bar in bytes, naming the file being read, where reading takes over a second (an 18 MB file
    took 22 s before the embedding bar, with nothing shown).
    """
    root = expand_user(corpus_dir, "corpus folder")
    if not root.exists():
        raise InputError(f"corpus folder not found: {root}")
    if not root.is_dir():
        raise InputError(f"corpus path is not a folder: {root}")
    if not 0 < max_file_mb < float("inf"):
        raise ConfigError(f"max_file_mb must be a positive number of megabytes, got {max_file_mb}")
    corpus = Corpus(docs={})

    def skip(rel: str, why: str) -> None:
        corpus.skipped.append(f"{rel}: {why}")
        warnings.warn(f"skipping {rel}: {why}", CorpusWarning, stacklevel=4)

    files = sorted(_walk(root, follow_symlinks, skip))
    sizes = [_size_of(path) for _, path in files]
    # a 6 MB PDF took 11-16 s to read with no bar: PDF bytes weigh more
    work = sum(size * (PDF_READ_WEIGHT if _is_pdf(rel) else 1) for (rel, _), size in zip(files, sizes))
    with stage_bar(progress, "reading", sum(sizes), "B", work=work) as bar:
        for (rel, path), size in zip(files, sizes):
            bar.set_postfix_str(one_line(rel))
            data = read_capped(path, follow_symlinks, max_file_mb)
            bar.update(size)
            if isinstance(data, str):
                skip(rel, data)
                continue
            try:
                text = _file_text(rel, data, corpus.notes, corpus.guessed)
            except ValueError as e:
                skip(rel, str(e))
                continue
            corpus.docs[rel] = (_sha256(data), text)
    if not corpus.docs:
        shown = corpus.skipped[:SKIPS_SHOWN]  # 3,000 empty files made one 53 KB line
        more = f"; and {len(corpus.skipped) - len(shown)} more" if len(corpus.skipped) > len(shown) else ""
        extra = f" (skipped {len(corpus.skipped)}: {'; '.join(shown)}{more})" if corpus.skipped else ""
        raise InputError(f"no loadable .txt/.md/.markdown/.pdf files in {root}{extra}")
    return corpus
