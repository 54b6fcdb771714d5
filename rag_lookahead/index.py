"""Document index: load -> split -> embed -> FAISS, persisted without pickle, updated incrementally.

On disk (one folder)::

    manifest.json    format version, embedding model + dimension, splitter settings, counts,
                     sha256 of every source file and of the two files below
    index.faiss      faiss.write_index of an IndexFlatIP over L2-normalized vectors (row i = chunk i)
    docstore.jsonl   one JSON object per chunk, in row order: id, chunk_id, source, file_sha256, text

Loading reads JSON and a FAISS index only; nothing is ever unpickled. BM25 (the lexical half of
hybrid search) is rebuilt from the docstore at load time, which takes well under a second per
10k chunks.

Rebuilding is incremental (files are keyed by the sha256 of their bytes: unchanged files keep their
stored vectors, read back with ``reconstruct_n``) and atomic: the new index is written to a sibling
folder and swapped in with renames, so an interrupted run leaves the previous index loadable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .embeddings import HYBRID_WEIGHTS, BM25Index, Embedder, get_embedder, reciprocal_rank_fusion
from .errors import ConfigError, IndexLoadError, InputError

__all__ = [
    "FORMAT_VERSION",
    "SUFFIXES",
    "CHUNK_SIZE",
    "CHUNK_OVERLAP",
    "SEPARATORS",
    "Passage",
    "IndexReport",
    "DocumentIndex",
    "default_index_dir",
    "make_splitter",
    "read_text_file",
    "load_corpus",
    "build_index",
    "load_index",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FORMAT_NAME = "rag_lookahead.index"
MANIFEST, FAISS_FILE, DOCSTORE = "manifest.json", "index.faiss", "docstore.jsonl"
SUFFIXES = (".txt", ".md", ".pdf")
ENCODINGS = ("utf-8", "utf-8-sig", "gb18030")

# 400 characters is ~250-400 e5 tokens of Chinese (well inside its 512-token window) or ~100 English
# words: one focused paragraph. Four such chunks (the default k) keep a RAG prompt near 1.5k tokens,
# cheap to prefill on a CPU, and give the lookahead trie whole sentences to draft from.
# 50 characters of overlap carries about one short sentence across a boundary.
CHUNK_SIZE = 400
CHUNK_OVERLAP = 50
SEPARATORS = ["\n\n", "\n", "。", "！", "？", "；", ". ", "! ", "? ", " ", ""]
SEARCH_MODES = ("hybrid", "dense", "lexical")
CANDIDATES = 50  # depth of each ranking fed to reciprocal rank fusion


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
    rebuilt: bool = False  # True when the previous index could not be reused at all
    seconds: float = 0.0

    @property
    def files(self) -> int:
        return self.added + self.updated + self.unchanged

    def summary(self) -> str:
        s = (
            f"indexed {self.files} files ({self.added} added, {self.updated} updated, {self.unchanged} unchanged,"
            f" {self.removed} removed), {self.chunks} chunks ({self.embedded_chunks} embedded)"
            f" with {self.embedding_model} in {self.seconds:.1f}s -> {self.index_dir}"
        )
        if self.skipped:
            s += f"; skipped {len(self.skipped)}: " + "; ".join(self.skipped)
        return s


# ---------------------------------------------------------------- loading files


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


def read_text_file(data: bytes) -> str | None:
    """Decode a text file: UTF-8 (BOM stripped), then GB18030 (covers GBK/GB2312). ``None`` if binary."""
    if _looks_binary(data):
        return None
    for enc in ENCODINGS:
        try:
            text = data.decode(enc)
        except UnicodeDecodeError:
            continue
        return text.lstrip("\ufeff")
    return None


def _read_pdf(path: Path) -> str:
    from pypdf import PdfReader

    reader = PdfReader(str(path))
    pages = [(page.extract_text() or "").strip() for page in reader.pages]
    return "\n\n".join(p for p in pages if p)


def load_corpus(corpus_dir: str | Path) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Read every .txt/.md/.pdf under ``corpus_dir`` (recursively, hidden entries skipped).

    Returns ``({relative_path: (sha256, text)}, skipped)`` where ``skipped`` holds ``"path: reason"``
    for each file that could not be used; each is also reported with :mod:`warnings`.
    Raises :class:`InputError` when the folder is missing or holds no loadable file.
    """
    root = Path(corpus_dir).expanduser()
    if not root.exists():
        raise InputError(f"corpus folder not found: {root}")
    if not root.is_dir():
        raise InputError(f"corpus path is not a folder: {root}")
    docs: dict[str, tuple[str, str]] = {}
    skipped: list[str] = []

    def skip(rel: str, why: str) -> None:
        skipped.append(f"{rel}: {why}")
        warnings.warn(f"skipping {rel}: {why}", stacklevel=3)

    for path in sorted(root.rglob("*")):
        rel_parts = path.relative_to(root).parts
        if any(p.startswith(".") for p in rel_parts) or not path.is_file():
            continue
        if path.suffix.lower() not in SUFFIXES:
            continue
        rel = "/".join(rel_parts)
        try:
            data = path.read_bytes()
        except OSError as e:
            skip(rel, f"unreadable ({e.strerror or e})")
            continue
        if path.suffix.lower() == ".pdf":
            try:
                text = _read_pdf(path)
            except Exception as e:  # pypdf raises many types on damaged files
                skip(rel, f"unreadable PDF ({type(e).__name__}: {e})".splitlines()[0])
                continue
            if not text.strip():
                skip(rel, "PDF has no extractable text")
                continue
        else:
            text = read_text_file(data)
            if text is None:
                skip(rel, "binary or undecodable (tried utf-8, utf-8-sig, gb18030)")
                continue
            if not text.strip():
                skip(rel, "empty")
                continue
        docs[rel] = (_sha256(data), text)
    if not docs:
        extra = f" (skipped: {'; '.join(skipped)})" if skipped else ""
        raise InputError(f"no loadable .txt/.md/.pdf files in {root}{extra}")
    return docs, skipped


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

    def __init__(self, index_dir: Path, manifest: dict, faiss_index: Any, records: list[dict], embedder: Embedder,
                 mode: str = "hybrid"):
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
    from langchain_core.callbacks import CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    class DocumentIndexRetriever(BaseRetriever):
        """Retrieves passages from a rag_lookahead :class:`DocumentIndex`."""

        index: Any
        k: int = 4
        mode: str | None = None

        def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
            return [
                Document(page_content=p.text, metadata={"source": p.source, "chunk_id": p.chunk_id, "score": p.score})
                for p in self.index.search(query, self.k, mode=self.mode)
            ]

    return DocumentIndexRetriever(index=index, k=k, mode=mode)


# ---------------------------------------------------------------- reading and verifying an index


def _recover(index_dir: Path) -> None:
    """Finish a swap that was interrupted between its two renames (old moved away, new not yet in)."""
    backup = _sibling(index_dir, "old")
    if not index_dir.exists() and backup.is_dir():
        os.replace(backup, index_dir)


def _sibling(index_dir: Path, tag: str) -> Path:
    return index_dir.parent / f".{index_dir.name}.{tag}"


def _read_manifest(index_dir: Path) -> dict:
    path = index_dir / MANIFEST
    if not path.is_file():
        raise IndexLoadError(f"index at {index_dir} is incomplete: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexLoadError(f"index at {index_dir} is corrupt: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise IndexLoadError(f"{path} is not a rag_lookahead index manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise IndexLoadError(
            f"index at {index_dir} has format version {manifest.get('format_version')!r}; this version reads "
            f"{FORMAT_VERSION}: rebuild it with `rag_lookahead index`"
        )
    for key in ("embedding_model", "dimension", "num_chunks", "files", "artifacts"):
        if key not in manifest:
            raise IndexLoadError(f"index at {index_dir} is corrupt: {MANIFEST} lacks {key!r}")
    return manifest


def _read_verified(index_dir: Path, manifest: dict) -> tuple[Any, list[dict]]:
    import faiss

    for name in (FAISS_FILE, DOCSTORE):
        path = index_dir / name
        if not path.is_file():
            raise IndexLoadError(f"index at {index_dir} is incomplete: {name} is missing")
        expected = manifest["artifacts"].get(name)
        if _file_sha256(path) != expected:
            raise IndexLoadError(
                f"index at {index_dir} is corrupt: {name} does not match the sha256 in {MANIFEST}; rebuild it"
            )
    try:
        fidx = faiss.read_index(str(index_dir / FAISS_FILE))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unreadable"
        raise IndexLoadError(f"index at {index_dir} is corrupt: cannot read {FAISS_FILE} ({first})") from None
    records = []
    with open(index_dir / DOCSTORE, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                r = json.loads(line)
                if not all(isinstance(r.get(key), str) for key in ("text", "source", "chunk_id")):
                    raise ValueError("missing text/source/chunk_id")
            except ValueError as e:  # JSONDecodeError is a ValueError
                raise IndexLoadError(f"index at {index_dir} is corrupt: {DOCSTORE} line {lineno}: {e}") from None
            records.append(r)
    n, d = int(manifest["num_chunks"]), int(manifest["dimension"])
    if fidx.ntotal != n or len(records) != n:
        raise IndexLoadError(
            f"index at {index_dir} is corrupt: {FAISS_FILE} has {fidx.ntotal} vectors, {DOCSTORE} has "
            f"{len(records)} chunks, {MANIFEST} says {n}"
        )
    if fidx.d != d:
        raise IndexLoadError(f"index at {index_dir} is corrupt: vectors have dimension {fidx.d}, {MANIFEST} says {d}")
    return fidx, records


def load_index(
    index_dir: str | Path | None = None, embedder: Embedder | str | None = None, *, mode: str = "hybrid"
) -> DocumentIndex:
    """Open an index for search. ``embedder`` defaults to the model named in the manifest; a different
    one is refused (:class:`IndexLoadError`) because its vectors would not be comparable."""
    index_dir = Path(index_dir).expanduser() if index_dir is not None else default_index_dir()
    _recover(index_dir)
    if not index_dir.is_dir():
        raise IndexLoadError(f"no index at {index_dir}: build one with `rag_lookahead index DIR --index-dir {index_dir}`")
    manifest = _read_manifest(index_dir)
    built_with = manifest["embedding_model"]
    if isinstance(embedder, str):
        embedder = get_embedder(embedder)
    if embedder is not None and embedder.name != built_with:
        raise IndexLoadError(
            f"index at {index_dir} was built with embedding model {built_with!r}, not {embedder.name!r}:"
            f" use that model or rebuild the index"
        )
    fidx, records = _read_verified(index_dir, manifest)
    if embedder is None:
        embedder = get_embedder(built_with)
    if int(embedder.dimension) != fidx.d:
        raise IndexLoadError(
            f"embedding model {embedder.name!r} gives {embedder.dimension}-d vectors but the index holds {fidx.d}-d"
        )
    return DocumentIndex(index_dir, manifest, fidx, records, embedder, mode=mode)


# ---------------------------------------------------------------- building


def _before_swap(tmp_dir: Path) -> None:
    """Test hook, called after the new index is fully written and before it replaces the old one."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return _sha256(data)


def _previous(index_dir: Path, embedder: Embedder, chunk_size: int, chunk_overlap: int):
    """The reusable part of an existing index: ``({source: (sha, [records], vectors)}, reason_if_not)``."""
    if not index_dir.exists():
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


def build_index(
    corpus_dir: str | Path,
    index_dir: str | Path | None = None,
    embedder: Embedder | str | None = None,
    *,
    chunk_size: int = CHUNK_SIZE,
    chunk_overlap: int = CHUNK_OVERLAP,
    progress: bool = True,
) -> IndexReport:
    """Index ``corpus_dir`` into ``index_dir`` (default :func:`default_index_dir`), reusing the vectors of
    files whose sha256 did not change, then atomically replace the previous index."""
    import faiss

    t0 = time.perf_counter()
    index_dir = Path(index_dir).expanduser() if index_dir is not None else default_index_dir()
    splitter = make_splitter(chunk_size, chunk_overlap)
    docs, skipped = load_corpus(corpus_dir)
    if embedder is None or isinstance(embedder, str):
        embedder = get_embedder(embedder)
    report = IndexReport(index_dir=index_dir, embedding_model=embedder.name, skipped=skipped)

    _recover(index_dir)
    if index_dir.exists() and not index_dir.is_dir():
        raise ConfigError(f"index path exists and is not a folder: {index_dir}")
    previous, why_not = _previous(index_dir, embedder, chunk_size, chunk_overlap)
    if why_not:
        report.rebuilt = True
        warnings.warn(f"re-embedding everything: the index at {index_dir} cannot be reused ({why_not})", stacklevel=2)
        log.warning("rebuilding %s: %s", index_dir, why_not)

    # plan: reuse unchanged files' chunks and vectors, split the rest
    plan: list[tuple[str, str, list[dict], np.ndarray | None]] = []
    to_embed: list[str] = []
    for source, (sha, text) in docs.items():
        old = previous.get(source)
        if old is not None and old[0] == sha:
            report.unchanged += 1
            plan.append((source, sha, old[1], old[2]))
            continue
        if old is None:
            report.added += 1
        else:
            report.updated += 1
        chunks = [c for c in splitter.split_text(text) if c.strip()]
        recs = [{"chunk_id": f"{source}#{i}", "source": source, "file_sha256": sha, "text": c} for i, c in enumerate(chunks)]
        plan.append((source, sha, recs, None))
        to_embed.extend(c for c in chunks)
    report.removed = sum(1 for s in previous if s not in docs)
    if report.rebuilt and index_dir.exists():
        # counts describe what happened to files relative to the previous index's file list
        old_files = set(_safe_manifest_files(index_dir))
        report.added = sum(1 for s in docs if s not in old_files)
        report.updated = len(docs) - report.added
        report.removed = sum(1 for s in old_files if s not in docs)

    new_vecs = embedder.embed_documents(to_embed, progress=progress) if to_embed else None
    report.embedded_chunks = len(to_embed)

    # assemble rows in plan order
    records: list[dict] = []
    blocks: list[np.ndarray] = []
    offset = 0
    for source, sha, recs, vecs in plan:
        if vecs is None:
            vecs = new_vecs[offset : offset + len(recs)] if recs else np.zeros((0, embedder.dimension), np.float32)
            offset += len(recs)
        records.extend(recs)
        blocks.append(np.asarray(vecs, dtype=np.float32).reshape(len(recs), embedder.dimension))
    matrix = np.concatenate(blocks, axis=0) if blocks else np.zeros((0, embedder.dimension), np.float32)
    for i, r in enumerate(records):
        r["id"] = i
    fidx = faiss.IndexFlatIP(int(embedder.dimension))
    if len(matrix):
        fidx.add(np.ascontiguousarray(matrix))
    report.chunks = len(records)

    # write the new index beside the old one, then swap
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(index_dir, "tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        faiss_sha = _write_file(tmp / FAISS_FILE, faiss.serialize_index(fidx).tobytes())
        doc_bytes = "".join(
            json.dumps({k: r[k] for k in ("id", "chunk_id", "source", "file_sha256", "text")}, ensure_ascii=False) + "\n"
            for r in records
        ).encode("utf-8")
        doc_sha = _write_file(tmp / DOCSTORE, doc_bytes)
        per_file: dict[str, dict] = {}
        for r in records:
            per_file.setdefault(r["source"], {"sha256": r["file_sha256"], "chunks": 0})["chunks"] += 1
        for source, (sha, _) in docs.items():
            per_file.setdefault(source, {"sha256": sha, "chunks": 0})
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "embedding_model": embedder.name,
            "dimension": int(embedder.dimension),
            "metric": "inner_product (vectors L2-normalized)",
            "chunk_size": chunk_size,
            "chunk_overlap": chunk_overlap,
            "separators": SEPARATORS,
            "num_files": len(docs),
            "num_chunks": len(records),
            "corpus_dir": str(Path(corpus_dir).expanduser().resolve()),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": dict(sorted(per_file.items())),
            "artifacts": {FAISS_FILE: faiss_sha, DOCSTORE: doc_sha},
        }
        _write_file(tmp / MANIFEST, json.dumps(manifest, ensure_ascii=False, indent=1).encode("utf-8"))
        _fsync_dir(tmp)
        _before_swap(tmp)
        _swap(tmp, index_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.seconds = time.perf_counter() - t0
    return report


def _safe_manifest_files(index_dir: Path) -> list[str]:
    try:
        files = json.loads((index_dir / MANIFEST).read_text(encoding="utf-8")).get("files", {})
        return list(files) if isinstance(files, dict) else []
    except (OSError, ValueError, AttributeError):
        return []


def _swap(new: Path, index_dir: Path) -> None:
    """Put ``new`` at ``index_dir``. If a crash lands between the two renames, :func:`_recover`
    restores the old index on the next load or build."""
    backup = _sibling(index_dir, "old")
    if backup.exists():
        shutil.rmtree(backup)
    if index_dir.exists():
        os.replace(index_dir, backup)
    os.replace(new, index_dir)
    _fsync_dir(index_dir.parent)
    shutil.rmtree(backup, ignore_errors=True)


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rag_lookahead.index DIR [--index-dir D] [--embedder NAME]``: the ``rag_lookahead index`` backend."""
    from .errors import RagLookaheadError

    ap = argparse.ArgumentParser(prog="rag_lookahead index", description="Build or update a document index.")
    ap.add_argument("corpus_dir")
    ap.add_argument("--index-dir", default=None, help=f"default: {default_index_dir()}")
    ap.add_argument("--embedder", default=None, help="e5-small (default), use, or a sentence-transformers name/path")
    ap.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
    ap.add_argument("--chunk-overlap", type=int, default=CHUNK_OVERLAP)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        report = build_index(
            args.corpus_dir, args.index_dir, args.embedder, chunk_size=args.chunk_size,
            chunk_overlap=args.chunk_overlap, progress=not args.no_progress,
        )
    except RagLookaheadError as e:
        print(f"error: {e}")
        return 2
    print(report.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
