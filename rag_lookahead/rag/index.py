"""Document index: load -> split -> embed -> FAISS, persisted without pickle, updated incrementally.

On disk (one folder that only ``build_index`` writes)::

    manifest.json          the marker and the pointer: format name + version, embedding model and
                           dimension, splitter settings, counts, sha256 of every source file, and the
                           name and sha256 of the data below
    data-XXXXXXXX/         one immutable version of the data, named by ``tempfile.mkdtemp``
        index.faiss        faiss.write_index of an IndexFlatIP over L2-normalized vectors (row i = chunk i)
        docstore.jsonl     one JSON object per chunk, in row order: id, chunk_id, source, file_sha256, text
    .rag_lookahead.lock    held by the one build that may write here (``filelock``)

Loading reads JSON and a FAISS index only; nothing is ever unpickled. BM25 (the lexical half of
hybrid search) is rebuilt from the docstore at load time, which takes well under a second per
10k chunks.

Rebuilding is incremental (files are keyed by the sha256 of their bytes: unchanged files keep their
stored vectors, read back with ``reconstruct_n``) and atomic: a build writes a new data folder, then
publishes it by replacing ``manifest.json`` with one ``os.replace``, then removes the old data. A reader
therefore sees the old index or the new one; one that read the old manifest just before the old data
was removed notices the manifest changed and reads again. Readers never change anything on disk.

A build only writes into a folder that is new, empty, or holds one of our manifests; it never
deletes a file it did not write (old data folders are emptied file by known file name, then removed
with ``rmdir``, which fails on anything else). Format version 1 (the data files directly in the
folder) is still read, and upgraded by the next build.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rag_lookahead.atomic import fsync_dir, fsync_file, write_json_atomic
from rag_lookahead.errors import ConfigError, IndexLoadError, InputError

if TYPE_CHECKING:  # the embedders pull in LangChain: imported where used, so the CLI starts fast
    from rag_lookahead.rag.embedders import BM25Index, Embedder

__all__ = [
    "FORMAT_VERSION",
    "SUFFIXES",
    "CHUNK_SIZE",
    "CHUNK_OVERLAP",
    "SEPARATORS",
    "MAX_FILE_MB",
    "LOCK_TIMEOUT_S",
    "Passage",
    "IndexReport",
    "IndexBusyError",
    "DocumentIndex",
    "DecodedText",
    "Corpus",
    "default_index_dir",
    "make_splitter",
    "decode_text",
    "read_text_file",
    "load_corpus",
    "build_index",
    "load_index",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: index.faiss and docstore.jsonl directly in the index folder
FORMAT_NAME = "rag_lookahead.index"
MANIFEST, FAISS_FILE, DOCSTORE = "manifest.json", "index.faiss", "docstore.jsonl"
DATA_FILES = (FAISS_FILE, DOCSTORE)
DATA_PREFIX = "data-"
DATA_NAME = re.compile(r"data-[a-z0-9_]{1,32}")  # what tempfile.mkdtemp(prefix=DATA_PREFIX) makes
LOCK_FILE = ".rag_lookahead.lock"
MANIFEST_TMP_PREFIX = f".{MANIFEST}."  # write_json_atomic's temp files
SUFFIXES = (".txt", ".md", ".pdf")

# Limits (README "Security and limits").
MAX_FILE_MB = 20.0  # larger corpus files are skipped with a report line (--max-file-mb)
LOCK_TIMEOUT_S = 600.0  # how long a build waits for another build of the same folder (--lock-timeout)
READ_ATTEMPTS = 5  # a reader re-reads at most this often while builds keep publishing new versions

# 400 characters is ~250-400 e5 tokens of Chinese (well inside its 512-token window) or ~100 English
# words: one focused paragraph. Four such chunks (the default k) keep a RAG prompt near 1.5k tokens,
# cheap to prefill on a CPU, and give the lookahead trie whole sentences to draft from.
# 50 characters of overlap carries about one short sentence across a boundary.
CHUNK_SIZE = 400
CHUNK_OVERLAP = 50
SEPARATORS = ["\n\n", "\n", "。", "！", "？", "；", ". ", "! ", "? ", " ", ""]
SEARCH_MODES = ("hybrid", "dense", "lexical")
CANDIDATES = 50  # depth of each ranking fed to reciprocal rank fusion


class IndexBusyError(IndexLoadError):
    """Another build held the index folder's lock for longer than the lock timeout."""


# ---------------------------------------------------------------- paths and records


def default_index_dir() -> Path:
    """``$RAG_LOOKAHEAD_HOME/index``, else ``$XDG_DATA_HOME/rag_lookahead/index``, else ``~/.local/share/...``."""
    home = os.environ.get("RAG_LOOKAHEAD_HOME")
    if home:
        return Path(home).expanduser() / "index"
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "rag_lookahead" / "index"


@dataclass
class Passage:
    text: str
    source: str
    chunk_id: str
    score: float


@dataclass
class IndexReport:
    """What a :func:`build_index` run did; counts are files unless they say chunks."""

    index_dir: Path
    embedding_model: str
    added: int = 0
    updated: int = 0
    removed: int = 0
    unchanged: int = 0
    chunks: int = 0  # chunks in the new index
    embedded_chunks: int = 0  # chunks embedded by this run (the rest were reused)
    skipped: list[str] = field(default_factory=list)  # "path: reason" for files not indexed
    notes: list[str] = field(default_factory=list)  # "path: what" for files indexed with a caveat (encoding)
    rebuilt: bool = False  # True when the previous index could not be reused at all
    seconds: float = 0.0

    @property
    def files(self) -> int:
        return self.added + self.updated + self.unchanged

    def summary(self) -> str:
        """One line of counts, then one indented line per skipped file and per note."""
        lines = [
            f"indexed {self.files} files ({self.added} added, {self.updated} updated, {self.unchanged} unchanged,"
            f" {self.removed} removed), {self.chunks} chunks ({self.embedded_chunks} embedded)"
            f" with {self.embedding_model} in {self.seconds:.1f}s -> {self.index_dir}"
        ]
        lines += [f"  skipped {s}" for s in self.skipped]
        lines += [f"  note {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------- decoding text


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    """The most likely legacy encoding (Big5, Shift-JIS, EUC-KR, GBK, cp125x, ...) by charset-normalizer."""
    from charset_normalizer import from_bytes

    for match in from_bytes(data):
        # UTF-16/32 without a byte order mark is what it guesses for short texts it cannot place
        if match.encoding.startswith(("utf_16", "utf_32")):
            continue
        return DecodedText(str(match), match.encoding)
    return None


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


def _read_pdf(data: bytes) -> str:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(data))  # from the bytes already read: the file is read once
    pages = [(page.extract_text() or "").strip() for page in reader.pages]
    return "\n\n".join(p for p in pages if p)


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
            if not follow_symlinks and (here / name).is_symlink():
                skip("/".join(rel_dir + (name,)), "symbolic link to a folder, not followed (--follow-symlinks)")
                continue
            kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            if not name.startswith(".") and Path(name).suffix.lower() in SUFFIXES:
                yield "/".join(rel_dir + (name,)), here / name


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"


def _read_capped(path: Path, follow_symlinks: bool, max_file_mb: float) -> bytes | str:
    """The file's bytes, read once; or why not (a string). Never blocks on a FIFO or device, never
    follows a link unless asked (``O_NOFOLLOW`` also closes the gap between the check and the open)."""
    if not follow_symlinks and path.is_symlink():
        return "symbolic link, not followed (--follow-symlinks)"
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            return "symbolic link, not followed (--follow-symlinks)"
        return f"unreadable ({e.strerror or e})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        max_bytes = int(max_file_mb * 2**20)
        too_big = f"{_size(st.st_size)} is over the {max_file_mb:g} MB limit (--max-file-mb)"
        if st.st_size > max_bytes:
            return too_big
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            return f"unreadable ({e.strerror or e})"
    if len(data) > max_bytes:  # it grew after the size check
        return too_big
    return data


def _file_text(rel: str, data: bytes, notes: list[str]) -> str:
    """The text of one file (PDF or text); raises ValueError with the reason it cannot be used."""
    if rel.lower().endswith(".pdf"):
        try:
            text = _read_pdf(data)
        except Exception as e:  # pypdf raises many types on damaged files
            raise ValueError(f"unreadable PDF ({type(e).__name__}: {e})".splitlines()[0]) from None
        if not text.strip():
            raise ValueError("PDF has no extractable text")
        return text
    decoded = decode_text(data)
    if decoded is None:
        raise ValueError("binary or in no text encoding we could detect")
    if not decoded.text.strip():
        raise ValueError("empty")
    if decoded.replaced:
        note = f"{rel}: {decoded.replaced} undecodable byte(s) replaced with U+FFFD (read as {decoded.encoding})"
        notes.append(note)
        warnings.warn(note, stacklevel=4)
    elif decoded.encoding not in ("utf-8", "utf-8-sig"):
        notes.append(f"{rel}: read as {decoded.encoding} (detected)")
    return decoded.text


def load_corpus(corpus_dir: str | Path, *, follow_symlinks: bool = False, max_file_mb: float = MAX_FILE_MB) -> Corpus:
    """Read every .txt/.md/.pdf under ``corpus_dir`` (recursively, hidden entries skipped).

    Symbolic links are not followed unless ``follow_symlinks``; files over ``max_file_mb`` are not read.
    Each file that cannot be used gets a ``"path: reason"`` in ``skipped`` (also a warning).
    Raises :class:`InputError` when the folder is missing or holds no loadable file.
    """
    root = Path(corpus_dir).expanduser()
    if not root.exists():
        raise InputError(f"corpus folder not found: {root}")
    if not root.is_dir():
        raise InputError(f"corpus path is not a folder: {root}")
    if not 0 < max_file_mb < float("inf"):
        raise ConfigError(f"max_file_mb must be a positive number of megabytes, got {max_file_mb}")
    corpus = Corpus(docs={})

    def skip(rel: str, why: str) -> None:
        corpus.skipped.append(f"{rel}: {why}")
        warnings.warn(f"skipping {rel}: {why}", stacklevel=4)

    for rel, path in sorted(_walk(root, follow_symlinks, skip)):
        data = _read_capped(path, follow_symlinks, max_file_mb)
        if isinstance(data, str):
            skip(rel, data)
            continue
        try:
            text = _file_text(rel, data, corpus.notes)
        except ValueError as e:
            skip(rel, str(e))
            continue
        corpus.docs[rel] = (_sha256(data), text)
    if not corpus.docs:
        extra = f" (skipped: {'; '.join(corpus.skipped)})" if corpus.skipped else ""
        raise InputError(f"no loadable .txt/.md/.pdf files in {root}{extra}")
    return corpus


# ---------------------------------------------------------------- splitting


def make_splitter(chunk_size: int = CHUNK_SIZE, chunk_overlap: int = CHUNK_OVERLAP):
    """A Chinese-aware ``RecursiveCharacterTextSplitter``: paragraphs, lines, then sentence ends
    (``。！？；`` and ``. ! ?``), words, characters. Sentence punctuation stays at the END of a chunk."""
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    if not 0 <= chunk_overlap < chunk_size:
        raise ConfigError(f"chunk_overlap must be in [0, chunk_size), got {chunk_overlap}")
    return RecursiveCharacterTextSplitter(
        separators=SEPARATORS,
        keep_separator="end",
        chunk_size=chunk_size,
        chunk_overlap=chunk_overlap,
        length_function=len,
        strip_whitespace=True,
    )


# ---------------------------------------------------------------- the index in memory


class DocumentIndex:
    """A loaded index: FAISS for dense search, BM25 rebuilt from the texts, fused with RRF."""

    def __init__(
        self,
        index_dir: Path,
        manifest: dict,
        faiss_index: Any,
        records: list[dict],
        embedder: Embedder,
        mode: str = "hybrid",
    ):
        if mode not in SEARCH_MODES:
            raise ConfigError(f"search mode must be one of {', '.join(SEARCH_MODES)}, got {mode!r}")
        self.index_dir = index_dir
        self.manifest = manifest
        self.faiss = faiss_index
        self.records = records
        self.embedder = embedder
        self.mode = mode
        self._bm25: BM25Index | None = None

    def __len__(self) -> int:
        return len(self.records)

    @property
    def bm25(self) -> BM25Index:
        if self._bm25 is None:
            from rag_lookahead.rag.embedders import BM25Index

            self._bm25 = BM25Index(r["text"] for r in self.records)
        return self._bm25

    def _dense(self, query: str, depth: int) -> list[tuple[int, float]]:
        q = np.asarray(self.embedder.embed_query(query), dtype=np.float32).reshape(1, -1)
        scores, ids = self.faiss.search(q, depth)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def search(self, query: str, k: int = 4, *, mode: str | None = None) -> list[Passage]:
        """Top ``k`` passages. ``mode``: "hybrid" (default; score = RRF score), "dense" (score = cosine)
        or "lexical" (score = BM25)."""
        if not isinstance(query, str) or not query.strip():
            raise InputError("query is empty")
        if k < 1:
            raise ConfigError(f"k must be at least 1, got {k}")
        mode = mode or self.mode
        if mode not in SEARCH_MODES:
            raise ConfigError(f"search mode must be one of {', '.join(SEARCH_MODES)}, got {mode!r}")
        if not self.records:
            return []
        depth = min(len(self.records), max(CANDIDATES, k))
        if mode == "dense":
            hits = self._dense(query, k)
        elif mode == "lexical":
            hits = self.bm25.search(query, k)
        else:
            dense = [i for i, _ in self._dense(query, depth)]
            lexical = [i for i, _ in self.bm25.search(query, depth)]
            from rag_lookahead.rag.embedders import HYBRID_WEIGHTS, reciprocal_rank_fusion

            hits = reciprocal_rank_fusion([dense, lexical], weights=HYBRID_WEIGHTS)[:k]
        out = []
        for i, score in hits[:k]:
            r = self.records[i]
            out.append(Passage(text=r["text"], source=r["source"], chunk_id=r["chunk_id"], score=float(score)))
        return out

    def as_retriever(self, k: int = 4, *, mode: str | None = None):
        """A LangChain ``BaseRetriever`` returning ``Document``s (metadata: source, chunk_id, score)."""
        return _make_retriever(self, k, mode)


def _make_retriever(index: DocumentIndex, k: int, mode: str | None):
    """The one LangChain retriever class (it honours ``k``/``mode`` per call); imported late,
    since LangChain is only needed by those who ask for a retriever."""
    from rag_lookahead.rag.chains import DocumentIndexRetriever

    return DocumentIndexRetriever(index=index, k=k, mode=mode)


# ---------------------------------------------------------------- reading and verifying an index


def _parse_manifest(index_dir: Path, raw: bytes) -> dict:
    """Check a manifest's marker, version and keys; :class:`IndexLoadError` says what is wrong."""
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexLoadError(f"index at {index_dir} is corrupt: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise IndexLoadError(f"{index_dir / MANIFEST} is not a rag_lookahead index manifest")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise IndexLoadError(
            f"index at {index_dir} has format version {manifest.get('format_version')!r}; this version reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}: rebuild it with `rag_lookahead index`"
        )
    for key in ("embedding_model", "dimension", "num_chunks", "files", "artifacts"):
        if key not in manifest:
            raise IndexLoadError(f"index at {index_dir} is corrupt: {MANIFEST} lacks {key!r}")
    _data_dir(index_dir, manifest)  # a bad data name is corruption too
    return manifest


def _manifest_bytes(index_dir: Path) -> bytes:
    try:
        return (index_dir / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise IndexLoadError(f"index at {index_dir} is incomplete: {MANIFEST} is missing") from None
    except OSError as e:
        raise IndexLoadError(f"cannot read {index_dir / MANIFEST}: {e.strerror or e}") from None


def _read_manifest(index_dir: Path) -> dict:
    return _parse_manifest(index_dir, _manifest_bytes(index_dir))


def _data_dir(index_dir: Path, manifest: dict) -> Path:
    """Where the manifest's data lives: a ``data-*`` folder inside the index (version 1: the index itself)."""
    if manifest["format_version"] == 1:
        return index_dir
    name = manifest.get("data")
    if not isinstance(name, str) or not DATA_NAME.fullmatch(name):
        raise IndexLoadError(f"index at {index_dir} is corrupt: {MANIFEST} names no valid data folder ({name!r})")
    return index_dir / name


def _read_verified(index_dir: Path, manifest: dict) -> tuple[Any, list[dict]]:
    """The FAISS index and docstore the manifest names, checked against its sha256s and counts."""
    import faiss

    data_dir = _data_dir(index_dir, manifest)
    for name in DATA_FILES:
        path = data_dir / name
        if not path.is_file():
            raise IndexLoadError(f"index at {index_dir} is incomplete: {name} is missing")
        expected = manifest["artifacts"].get(name)
        try:
            actual = _file_sha256(path)
        except FileNotFoundError:  # a build removed it after the is_file check: the caller reads again
            raise IndexLoadError(f"index at {index_dir} is incomplete: {name} is missing") from None
        if actual != expected:
            raise IndexLoadError(
                f"index at {index_dir} is corrupt: {name} does not match the sha256 in {MANIFEST}; rebuild it"
            )
    try:
        fidx = faiss.read_index(str(data_dir / FAISS_FILE))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unreadable"
        raise IndexLoadError(f"index at {index_dir} is corrupt: cannot read {FAISS_FILE} ({first})") from None
    records = []
    try:
        with open(data_dir / DOCSTORE, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                try:
                    r = json.loads(line)
                    if not all(isinstance(r.get(key), str) for key in ("text", "source", "chunk_id")):
                        raise ValueError("missing text/source/chunk_id")
                except ValueError as e:  # JSONDecodeError is a ValueError
                    raise IndexLoadError(f"index at {index_dir} is corrupt: {DOCSTORE} line {lineno}: {e}") from None
                records.append(r)
    except FileNotFoundError:  # removed by a build after the hash check
        raise IndexLoadError(f"index at {index_dir} is incomplete: {DOCSTORE} is missing") from None
    n, d = int(manifest["num_chunks"]), int(manifest["dimension"])
    if fidx.ntotal != n or len(records) != n:
        raise IndexLoadError(
            f"index at {index_dir} is corrupt: {FAISS_FILE} has {fidx.ntotal} vectors, {DOCSTORE} has "
            f"{len(records)} chunks, {MANIFEST} says {n}"
        )
    if fidx.d != d:
        raise IndexLoadError(f"index at {index_dir} is corrupt: vectors have dimension {fidx.d}, {MANIFEST} says {d}")
    return fidx, records


def _read_snapshot(index_dir: Path) -> tuple[dict, Any, list[dict]]:
    """One published version: the manifest and the data it names, read without changing anything.

    A build publishes a new manifest, then removes the old data. A reader that read the old manifest
    and then found its data gone (or different) sees that the manifest changed and reads again.
    """
    for attempt in range(READ_ATTEMPTS):
        raw = _manifest_bytes(index_dir)
        manifest = _parse_manifest(index_dir, raw)
        try:
            fidx, records = _read_verified(index_dir, manifest)
        except IndexLoadError:
            if attempt + 1 < READ_ATTEMPTS and _manifest_changed(index_dir, raw):
                continue
            raise
        return manifest, fidx, records
    raise AssertionError("unreachable")


def _manifest_changed(index_dir: Path, raw: bytes) -> bool:
    try:
        return (index_dir / MANIFEST).read_bytes() != raw
    except OSError:
        return True


def load_index(
    index_dir: str | Path | None = None, embedder: Embedder | str | None = None, *, mode: str = "hybrid"
) -> DocumentIndex:
    """Open an index for search. ``embedder`` defaults to the model named in the manifest; a different
    one is refused (:class:`IndexLoadError`) because its vectors would not be comparable.
    Safe while a build publishes a new version: it returns the old index or the new one."""
    index_dir = Path(index_dir).expanduser() if index_dir is not None else default_index_dir()
    if not index_dir.is_dir():
        raise IndexLoadError(
            f"no index at {index_dir}: build one with `rag_lookahead index DIR --index-dir {index_dir}`"
        )
    from rag_lookahead.rag.embedders import get_embedder

    manifest, fidx, records = _read_snapshot(index_dir)
    built_with = manifest["embedding_model"]
    if isinstance(embedder, str):
        embedder = get_embedder(embedder)
    if embedder is not None and embedder.name != built_with:
        raise IndexLoadError(
            f"index at {index_dir} was built with embedding model {built_with!r}, not {embedder.name!r}:"
            f" use that model or rebuild the index"
        )
    if embedder is None:
        embedder = get_embedder(built_with)
    if int(embedder.dimension) != fidx.d:
        raise IndexLoadError(
            f"embedding model {embedder.name!r} gives {embedder.dimension}-d vectors but the index holds {fidx.d}-d"
        )
    return DocumentIndex(index_dir, manifest, fidx, records, embedder, mode=mode)


# ---------------------------------------------------------------- ownership of the index folder


def _is_our_manifest(path: Path) -> bool:
    """The file carries our marker (``"format": "rag_lookahead.index"``): only a build of ours wrote it."""
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME


def _is_our_data_dir(path: Path) -> bool:
    """A ``data-*`` folder (not a link) holding nothing but our data file names."""
    if not DATA_NAME.fullmatch(path.name) or path.is_symlink() or not path.is_dir():
        return False
    return all(c.name in DATA_FILES and not c.is_symlink() and c.is_file() for c in path.iterdir())


def _is_our_leftover(path: Path) -> bool:
    """What an interrupted first build can leave in a folder that has no manifest yet."""
    if path.name == LOCK_FILE or path.name.startswith(MANIFEST_TMP_PREFIX):
        return path.is_file() and not path.is_symlink()
    return _is_our_data_dir(path)


def _check_target(index_dir: Path) -> None:
    """Refuse (:class:`ConfigError`) to write into anything but a new folder, an empty one, or an index of ours."""
    if not index_dir.exists():
        if index_dir.is_symlink():
            raise ConfigError(f"index path is a broken symbolic link: {index_dir}")
        return
    if not index_dir.is_dir():
        raise ConfigError(f"index path exists and is not a folder: {index_dir}")
    if _is_our_manifest(index_dir / MANIFEST):
        return
    foreign = sorted(c.name for c in index_dir.iterdir() if not _is_our_leftover(c))
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ConfigError(
            f"refusing to write an index into {index_dir}: it is not empty ({foreign[0]!r}{more}) and is not a"
            f" rag_lookahead index (no {MANIFEST} of ours); choose a new or empty folder with --index-dir"
        )


@contextlib.contextmanager
def _writer_lock(index_dir: Path, timeout: float) -> Iterator[None]:
    """Hold the index folder's lock: one build at a time writes here; others wait up to ``timeout`` s."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(index_dir / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("another `rag_lookahead index` run is writing %s; waiting up to %g s", index_dir, timeout)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise IndexBusyError(
                f"another `rag_lookahead index` run is still writing {index_dir} after {timeout:g} s;"
                f" try again when it ends, or wait longer with --lock-timeout"
            ) from None
    try:
        yield
    finally:
        lock.release()


def _empty_our_data_dir(path: Path) -> None:
    """Remove a data folder of ours: our files by name, then ``rmdir``, which leaves anything else alone."""
    for name in DATA_FILES:
        with contextlib.suppress(FileNotFoundError):
            (path / name).unlink()
    try:
        path.rmdir()
    except OSError as e:
        log.warning("left %s in place: %s", path, e.strerror or e)


def _published_data(index_dir: Path) -> str | None:
    """The data folder the current manifest names (ours by that manifest), if any."""
    try:
        name = json.loads((index_dir / MANIFEST).read_bytes().decode("utf-8")).get("data")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and DATA_NAME.fullmatch(name) else None


def _remove_old_versions(index_dir: Path, current: str, replaced: str | None) -> None:
    """After publishing ``current``: drop the data it ``replaced`` (our files in it, by name), data
    folders that hold nothing but our files (unpublished leftovers), version-1 data files and temp
    manifests. Call with the lock held, in a folder whose manifest is ours."""
    for child in index_dir.iterdir():
        if child.name == current:
            continue
        if child.name in DATA_FILES or child.name.startswith(MANIFEST_TMP_PREFIX):
            if child.is_file() and not child.is_symlink():
                child.unlink()
        elif (child.name == replaced and child.is_dir() and not child.is_symlink()) or _is_our_data_dir(child):
            _empty_our_data_dir(child)
    fsync_dir(index_dir)


# ---------------------------------------------------------------- building


def _previous(index_dir: Path, embedder: Embedder, chunk_size: int, chunk_overlap: int):
    """The reusable part of an existing index: ``({source: (sha, [records], vectors)}, reason_if_not)``."""
    if not (index_dir / MANIFEST).exists():
        return {}, None
    try:
        manifest = _read_manifest(index_dir)
        if manifest["embedding_model"] != embedder.name:
            return {}, f"it was built with {manifest['embedding_model']!r}, now {embedder.name!r}"
        if manifest.get("chunk_size") != chunk_size or manifest.get("chunk_overlap") != chunk_overlap:
            return {}, "the chunk size or overlap changed"
        fidx, records = _read_verified(index_dir, manifest)
    except IndexLoadError as e:
        return {}, str(e)
    vectors = fidx.reconstruct_n(0, fidx.ntotal) if fidx.ntotal else np.zeros((0, fidx.d), np.float32)
    by_source: dict[str, tuple[str, list[dict], list[np.ndarray]]] = {}
    for r, v in zip(records, vectors):
        sha, recs, vecs = by_source.setdefault(r["source"], (r.get("file_sha256", ""), [], []))
        recs.append(r)
        vecs.append(v)
    return {s: (sha, recs, np.stack(vecs)) for s, (sha, recs, vecs) in by_source.items()}, None


def _plan(docs, previous, splitter, report: IndexReport):
    """Per file: reuse the stored chunks and vectors when its sha256 is unchanged, else split it anew.
    Returns ``(plan, texts_to_embed)``; ``plan`` rows are ``(source, records, vectors_or_None)``."""
    plan: list[tuple[str, list[dict], np.ndarray | None]] = []
    to_embed: list[str] = []
    for source, (sha, text) in docs.items():
        old = previous.get(source)
        if old is not None and old[0] == sha:
            report.unchanged += 1
            plan.append((source, old[1], old[2]))
            continue
        if old is None:
            report.added += 1
        else:
            report.updated += 1
        chunks = [c for c in splitter.split_text(text) if c.strip()]
        recs = [
            {"chunk_id": f"{source}#{i}", "source": source, "file_sha256": sha, "text": c} for i, c in enumerate(chunks)
        ]
        plan.append((source, recs, None))
        to_embed.extend(chunks)
    report.removed = sum(1 for s in previous if s not in docs)
    return plan, to_embed


def _assemble(plan, new_vecs, dimension: int):
    """Rows in plan order: ``(records with ids, FAISS IndexFlatIP)``."""
    import faiss

    records: list[dict] = []
    blocks: list[np.ndarray] = []
    offset = 0
    for _source, recs, vecs in plan:
        if vecs is None:
            vecs = new_vecs[offset : offset + len(recs)] if recs else np.zeros((0, dimension), np.float32)
            offset += len(recs)
        records.extend(recs)
        blocks.append(np.asarray(vecs, dtype=np.float32).reshape(len(recs), dimension))
    matrix = np.concatenate(blocks, axis=0) if blocks else np.zeros((0, dimension), np.float32)
    for i, r in enumerate(records):
        r["id"] = i
    fidx = faiss.IndexFlatIP(int(dimension))
    if len(matrix):
        fidx.add(np.ascontiguousarray(matrix))
    return records, fidx


def _write_docstore(path: Path, records: list[dict]) -> str:
    """Stream the docstore to disk (never the whole file in memory) and return its sha256."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for r in records:
            line = (
                json.dumps({k: r[k] for k in ("id", "chunk_id", "source", "file_sha256", "text")}, ensure_ascii=False)
                + "\n"
            ).encode("utf-8")
            h.update(line)
            f.write(line)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def _write_data(data_dir: Path, fidx: Any, records: list[dict]) -> dict[str, str]:
    """Write one data version, durably; returns the artifacts' sha256s for the manifest."""
    import faiss

    faiss.write_index(fidx, str(data_dir / FAISS_FILE))
    fsync_file(data_dir / FAISS_FILE)
    artifacts = {
        FAISS_FILE: _file_sha256(data_dir / FAISS_FILE),
        DOCSTORE: _write_docstore(data_dir / DOCSTORE, records),
    }
    fsync_dir(data_dir)
    return artifacts


def _publish(index_dir: Path, manifest: dict) -> None:
    """The one step that switches readers to the new version: an atomic replace of ``manifest.json``."""
    write_json_atomic(index_dir / MANIFEST, manifest)


def build_index(
    corpus_dir: str | Path,
    index_dir: str | Path | None = None,
    embedder: Embedder | str | None = None,
    *,
    chunk_size: int = CHUNK_SIZE,
    chunk_overlap: int = CHUNK_OVERLAP,
    progress: bool = True,
    follow_symlinks: bool = False,
    max_file_mb: float = MAX_FILE_MB,
    lock_timeout: float = LOCK_TIMEOUT_S,
) -> IndexReport:
    """Index ``corpus_dir`` into ``index_dir`` (default :func:`default_index_dir`), reusing the vectors of
    files whose sha256 did not change, then atomically publish the new version.

    Refuses (:class:`ConfigError`) a non-empty ``index_dir`` that is not an index of ours. Waits up to
    ``lock_timeout`` seconds for another build of the same folder, then raises :class:`IndexBusyError`.
    """
    t0 = time.perf_counter()
    index_dir = Path(index_dir).expanduser() if index_dir is not None else default_index_dir()
    if not lock_timeout >= 0:
        raise ConfigError(f"lock_timeout must be >= 0 seconds, got {lock_timeout}")
    splitter = make_splitter(chunk_size, chunk_overlap)
    _check_target(index_dir)  # before any slow work, and before anything is created
    corpus = load_corpus(corpus_dir, follow_symlinks=follow_symlinks, max_file_mb=max_file_mb)
    if embedder is None or isinstance(embedder, str):
        from rag_lookahead.rag.embedders import get_embedder

        embedder = get_embedder(embedder)
    report = IndexReport(index_dir=index_dir, embedding_model=embedder.name, skipped=corpus.skipped, notes=corpus.notes)

    index_dir.mkdir(parents=True, exist_ok=True)
    with _writer_lock(index_dir, lock_timeout):
        _check_target(index_dir)  # again: the folder may have changed while we waited
        previous, why_not = _previous(index_dir, embedder, chunk_size, chunk_overlap)
        if why_not:
            report.rebuilt = True
            warnings.warn(
                f"re-embedding everything: the index at {index_dir} cannot be reused ({why_not})", stacklevel=2
            )
            log.warning("rebuilding %s: %s", index_dir, why_not)
        plan, to_embed = _plan(corpus.docs, previous, splitter, report)
        if report.rebuilt:  # counts describe what happened to files relative to the previous file list
            old_files = set(_safe_manifest_files(index_dir))
            report.added = sum(1 for s in corpus.docs if s not in old_files)
            report.updated = len(corpus.docs) - report.added
            report.removed = sum(1 for s in old_files if s not in corpus.docs)
        new_vecs = embedder.embed_documents(to_embed, progress=progress) if to_embed else None
        report.embedded_chunks = len(to_embed)
        records, fidx = _assemble(plan, new_vecs, int(embedder.dimension))
        report.chunks = len(records)

        replaced = _published_data(index_dir)
        data_dir = Path(tempfile.mkdtemp(prefix=DATA_PREFIX, dir=index_dir))
        try:
            artifacts = _write_data(data_dir, fidx, records)
            manifest = _manifest(
                corpus, records, embedder, chunk_size, chunk_overlap, corpus_dir, data_dir.name, artifacts
            )
            _publish(index_dir, manifest)
        except BaseException:
            shutil.rmtree(data_dir, ignore_errors=True)  # made by this run, never published
            raise
        _remove_old_versions(index_dir, data_dir.name, replaced)
    report.seconds = time.perf_counter() - t0
    return report


def _manifest(corpus: Corpus, records, embedder, chunk_size, chunk_overlap, corpus_dir, data_name, artifacts) -> dict:
    per_file: dict[str, dict] = {}
    for r in records:
        per_file.setdefault(r["source"], {"sha256": r["file_sha256"], "chunks": 0})["chunks"] += 1
    for source, (sha, _) in corpus.docs.items():
        per_file.setdefault(source, {"sha256": sha, "chunks": 0})
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "data": data_name,
        "embedding_model": embedder.name,
        "dimension": int(embedder.dimension),
        "metric": "inner_product (vectors L2-normalized)",
        "chunk_size": chunk_size,
        "chunk_overlap": chunk_overlap,
        "separators": SEPARATORS,
        "num_files": len(corpus.docs),
        "num_chunks": len(records),
        "corpus_dir": str(Path(corpus_dir).expanduser().resolve()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": dict(sorted(per_file.items())),
        "artifacts": artifacts,
    }


def _safe_manifest_files(index_dir: Path) -> list[str]:
    try:
        files = json.loads((index_dir / MANIFEST).read_text(encoding="utf-8")).get("files", {})
        return list(files) if isinstance(files, dict) else []
    except (OSError, ValueError, AttributeError):
        return []


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rag_lookahead.rag.index DIR [--index-dir D] [--embedder NAME]``: the ``rag_lookahead index`` backend."""
    from rag_lookahead.errors import RagLookaheadError

    ap = argparse.ArgumentParser(prog="rag_lookahead index", description="Build or update a document index.")
    ap.add_argument("corpus_dir")
    ap.add_argument("--index-dir", default=None, help=f"default: {default_index_dir()}")
    ap.add_argument("--embedder", default=None, help="e5-small (default), use, or a sentence-transformers name/path")
    ap.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
    ap.add_argument("--chunk-overlap", type=int, default=CHUNK_OVERLAP)
    ap.add_argument("--follow-symlinks", action="store_true", help="index the targets of symbolic links")
    ap.add_argument("--max-file-mb", type=float, default=MAX_FILE_MB, help="skip larger files (default %(default)g)")
    ap.add_argument(
        "--lock-timeout",
        type=float,
        default=LOCK_TIMEOUT_S,
        help="seconds to wait for another run on the same index (default %(default)g)",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        report = build_index(
            args.corpus_dir,
            args.index_dir,
            args.embedder,
            chunk_size=args.chunk_size,
            chunk_overlap=args.chunk_overlap,
            progress=not args.no_progress,
            follow_symlinks=args.follow_symlinks,
            max_file_mb=args.max_file_mb,
            lock_timeout=args.lock_timeout,
        )
    except RagLookaheadError as e:
        print(f"error: {str(e).splitlines()[0]}")
        return 2
    print(report.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
