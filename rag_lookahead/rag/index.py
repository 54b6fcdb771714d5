"""The document index in memory: dense search (FAISS), lexical search (BM25), and the two fused.

:func:`load_index` opens the version of an index folder that is published (:mod:`.store`) as a
:class:`DocumentIndex`; BM25 (:mod:`.lexical`) is rebuilt from the docstore by the first search
(its words cut by jieba, ~1.4 ms a Chinese chunk here, or read back from :mod:`.token_cache` for
a corpus of 256 chunks or more that was cut before, ~0.04 ms a chunk). Building and updating an
index is :mod:`.build` (:func:`build_index`, re-exported here with the other names this module
has always offered).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rag_lookahead.checks import positive_int, unicode_text
from rag_lookahead.errors import (
    ConfigError,
    IndexLoadError,
    InputError,
    first_line,
    shell_word,
    shown_path,
)
from rag_lookahead.paths import expand_user
from rag_lookahead.rag import store
from rag_lookahead.rag.build import CHUNK_OVERLAP, CHUNK_SIZE, SEPARATORS, IndexReport, build_index, make_splitter
from rag_lookahead.rag.corpus import (
    MAX_FILE_MB,
    SUFFIXES,
    Corpus,
    DecodedText,
    decode_text,
    load_corpus,
    read_text_file,
)
from rag_lookahead.rag.store import FORMAT_VERSION, LOCK_TIMEOUT_S, IndexBusyError, default_index_dir

if TYPE_CHECKING:  # the embedders pull in torch and LangChain: imported where used, so the CLI starts fast
    from langchain_core.documents import Document

    from rag_lookahead.rag.embedders import Embedder
    from rag_lookahead.rag.lexical import BM25Index

__all__ = [
    "Passage",
    "DocumentIndex",
    "load_index",
    # re-exported: building (.build), reading files (.corpus), the folder on disk (.store)
    "CHUNK_SIZE",
    "CHUNK_OVERLAP",
    "SEPARATORS",
    "IndexReport",
    "make_splitter",
    "build_index",
    "FORMAT_VERSION",
    "SUFFIXES",
    "MAX_FILE_MB",
    "LOCK_TIMEOUT_S",
    "IndexBusyError",
    "DecodedText",
    "Corpus",
    "default_index_dir",
    "decode_text",
    "read_text_file",
    "load_corpus",
]

SEARCH_MODES = ("hybrid", "dense", "lexical")


def check_search_mode(mode: Any) -> None:
    """Refuse a search mode other than :data:`SEARCH_MODES` (the index, its search and its retriever)."""
    if mode not in SEARCH_MODES:
        raise ConfigError(f"search mode must be one of {', '.join(SEARCH_MODES)}, got {mode!r}")


CANDIDATES = 50  # depth of each ranking fed to reciprocal rank fusion


@dataclass
class Passage:
    """One search hit: a chunk's text, the file it came from, its id and its score in the search mode."""

    text: str
    source: str
    chunk_id: str
    score: float
    also_in: tuple[str, ...] = ()  # other files holding the same text (see DocumentIndex.search)

    def to_document(self) -> Document:
        """The LangChain ``Document`` every retriever of ours returns (metadata: source, chunk_id, score,
        and ``also_in`` where the same text is in other files)."""
        from langchain_core.documents import Document

        metadata: dict[str, Any] = {"source": self.source, "chunk_id": self.chunk_id, "score": self.score}
        if self.also_in:
            metadata["also_in"] = list(self.also_in)
        return Document(page_content=self.text, metadata=metadata)


def check_searchable(query: str, what: str = "query") -> None:
    """Refuse a query with no letter or digit ("…", "？！", a zero-width space): dense search would
    rank passages by noise; or one UTF-8 cannot encode (a lone surrogate, from JSON's "\\udce9"),
    which the embedder's tokenizer failed on with a TypeError. Callers with a model to load check
    first, so the refusal comes at once."""
    from rag_lookahead.rag.lexical import searchable

    unicode_text(query, f"{what} is")
    if not searchable(query):
        raise InputError(f"{what} has no letters or digits to search for: {query[:40]!r}")


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
        check_search_mode(mode)
        self.index_dir = index_dir
        self.manifest = manifest
        self.faiss = faiss_index
        self.records = records
        self.embedder = embedder
        self.mode = mode
        self._bm25: BM25Index | None = None
        self._rows_of: dict[str, list[int]] | None = None

    def __len__(self) -> int:
        return len(self.records)

    @property
    def bm25(self) -> BM25Index:
        if self._bm25 is None:
            from rag_lookahead.rag.headings import searched_text
            from rag_lookahead.rag.lexical import BM25Index
            from rag_lookahead.rag.token_cache import cached_tokens

            self._bm25 = BM25Index(tokens=cached_tokens([searched_text(r) for r in self.records]))
        return self._bm25

    def warm(self) -> DocumentIndex:
        """Build now what the first search would build: BM25 over every chunk's words (jieba's
        dictionary loads in ~1 s, then ~1.4 ms a 300-character Chinese chunk here: 2.4 s for 931
        court-judgment chunks, unless :mod:`.token_cache` has them). A server calls this while it
        loads, so its first question does not wait for it and concurrent first questions do not
        each build one."""
        if self.mode != "dense" and self.records:
            _ = self.bm25
        return self

    def _dense(self, query: str, depth: int) -> list[tuple[int, float]]:
        q = np.asarray(self.embedder.embed_query(query), dtype=np.float32).reshape(1, -1)
        scores, ids = self.faiss.search(q, depth)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def search(self, query: str, k: int = 4, *, mode: str | None = None) -> list[Passage]:
        """Top ``k`` distinct passages. ``mode``: "hybrid" (default; score = RRF score), "dense"
        (score = cosine) or "lexical" (score = BM25).

        Chunks with the same text (a file copied into two folders, a boilerplate paragraph) are one
        passage, at its best rank, with the other files it came from in ``also_in`` (reported in a
        chain's sources; the prompt labels the passage by its first source): the prompt then holds
        each text once and ``k`` distinct texts fill it. Each ranking holds ``CANDIDATES`` distinct
        texts, however many files repeat one."""
        if not isinstance(query, str):
            raise InputError(f"the query must be text (str), got {type(query).__name__}")
        if not query.strip():
            raise InputError("query is empty")
        check_searchable(query)
        k = positive_int("k", k)
        mode = self.mode if mode is None else mode
        check_search_mode(mode)
        if not self.records:
            return []
        rows_of = self._rows_by_text()
        depth = min(len(rows_of), max(CANDIDATES, k))  # distinct texts in each ranking
        reach = min(len(self.records), depth + len(self.records) - len(rows_of))  # ... whatever the copies
        if mode == "dense":
            hits = self._distinct_texts(self._dense(query, reach), depth)
        elif mode == "lexical":
            hits = self._distinct_texts(self.bm25.search(query, reach), depth)
        else:
            dense = [i for i, _ in self._distinct_texts(self._dense(query, reach), depth)]
            lexical = [i for i, _ in self._distinct_texts(self.bm25.search(query, reach), depth)]
            from rag_lookahead.rag.lexical import HYBRID_WEIGHTS, reciprocal_rank_fusion

            hits = reciprocal_rank_fusion([dense, lexical], weights=HYBRID_WEIGHTS)
        return [self._passage(i, score) for i, score in hits[:k]]

    def _rows_by_text(self) -> dict[str, list[int]]:
        """Each distinct chunk text -> the rows holding it, in index order (built once)."""
        if self._rows_of is None:
            rows_of: dict[str, list[int]] = {}
            for i, r in enumerate(self.records):
                rows_of.setdefault(r["text"], []).append(i)
            self._rows_of = rows_of
        return self._rows_of

    def _distinct_texts(self, hits: list[tuple[int, float]], depth: int) -> list[tuple[int, float]]:
        """``hits`` with each text once, at its best rank and as its first row (so both rankings name
        a text alike), cut to ``depth``: copies of one boilerplate paragraph in many files no longer
        fill a ranking's whole depth and leave one passage."""
        rows_of = self._rows_by_text()
        seen: set[str] = set()
        kept = []
        for i, score in hits:
            text = self.records[i]["text"]
            if text not in seen:
                seen.add(text)
                kept.append((rows_of[text][0], score))
                if len(kept) == depth:
                    break
        return kept

    def _passage(self, row: int, score: float) -> Passage:
        """The hit at ``row``, with the other files holding the same text in ``also_in``."""
        r = self.records[row]
        others = dict.fromkeys(
            self.records[i]["source"]
            for i in self._rows_by_text()[r["text"]]
            if self.records[i]["source"] != r["source"]
        )
        return Passage(r["text"], r["source"], r["chunk_id"], float(score), tuple(others))

    def as_retriever(self, k: int = 4, *, mode: str | None = None):
        """A LangChain ``BaseRetriever`` returning ``Document``s (metadata: source, chunk_id, score)."""
        return _make_retriever(self, k, mode)


def _make_retriever(index: DocumentIndex, k: int, mode: str | None):
    """The one LangChain retriever class (it honours ``k``/``mode`` per call); imported late,
    since LangChain is only needed by those who ask for a retriever."""
    from rag_lookahead.rag.chains import DocumentIndexRetriever

    return DocumentIndexRetriever(index=index, k=k, mode=mode)


def _warn_if_built_without_headings(index_dir: Path, manifest: dict, records: list[dict]) -> None:
    """An index built before Markdown chunks were searched under their headings still searches
    their text alone (a section named only in its heading ranks low): say how to rebuild it."""
    from rag_lookahead.rag.headings import MARKDOWN_SUFFIXES

    if "headings" in manifest or not any(r["source"].lower().endswith(MARKDOWN_SUFFIXES) for r in records):
        return
    warnings.warn(
        f"the index at {shown_path(index_dir)} was built before chunks of Markdown files were searched under "
        f"their headings: run `{_index_command(index_dir, manifest)}` again to search them so",
        UserWarning,
        stacklevel=3,
    )


def _index_command(index_dir: Path, manifest: dict, *options: str) -> str:
    """The ``rag_lookahead index`` command that updates this index: its corpus folder (from the
    manifest) and ``--index-dir``, then ``options``, each a shell word already."""
    corpus = shell_word(manifest["corpus_dir"]) if manifest.get("corpus_dir") else "DIR"
    return " ".join(("rag_lookahead index", corpus, "--index-dir", shell_word(index_dir), *options))


def no_index_error(index_dir: Path, docs: str = "DIR") -> IndexLoadError:
    """There is no index at ``index_dir``, with advice that works there: where ``index`` would
    refuse to build (a file, a broken link, a folder of the user's files; :func:`store.check_target`
    judges, our own leftovers allowed), the advice to build into that path failed when followed."""
    elsewhere = f"build one into a new folder with `rag_lookahead index {docs} --index-dir NEW_FOLDER`"
    try:
        store.check_target(index_dir, advice=elsewhere, writing=False)
    except ConfigError as refused:
        return IndexLoadError(f"no index at {shown_path(index_dir)}: {first_line(refused)}")
    return IndexLoadError(
        f"no index at {shown_path(index_dir)}: build one with `rag_lookahead index {docs} --index-dir "
        f"{shell_word(index_dir)}`"
    )


def holds_index(index_dir: Path) -> bool:
    """Whether ``index_dir`` holds an index, whole or damaged (its manifest, or a data folder a
    build of ours finished): an empty folder, or the documents' folder given by mistake, is "no
    index" with advice to build one, not an index whose manifest is missing."""
    manifest = index_dir / store.MANIFEST
    return index_dir.is_dir() and (manifest.exists() or manifest.is_symlink() or store.holds_our_data(index_dir))


def load_index(
    index_dir: str | Path | None = None, embedder: Embedder | str | None = None, *, mode: str = "hybrid"
) -> DocumentIndex:
    """Open an index for search. ``embedder`` defaults to the model named in the manifest; a different
    one is refused (:class:`IndexLoadError`) because its vectors would not be comparable.
    Safe while a build publishes a new version: it returns the old index or the new one."""
    index_dir = expand_user(index_dir, "index folder") if index_dir is not None else default_index_dir()
    if not holds_index(index_dir):
        raise no_index_error(index_dir)
    from rag_lookahead.rag.embedders import get_embedder

    manifest, fidx, records = store.read_snapshot(index_dir)
    _warn_if_built_without_headings(index_dir, manifest, records)
    built_with = manifest["embedding_model"]
    if isinstance(embedder, str):
        embedder = get_embedder(embedder)
    if embedder is not None and embedder.name != built_with:
        raise IndexLoadError(
            f"index at {shown_path(index_dir)} was built with embedding model {built_with!r}, "
            f"not {embedder.name!r}:"
            f" use that model or rebuild the index"
        )
    if embedder is None:
        embedder = get_embedder(built_with)
    if int(embedder.dimension) != fidx.d:  # another model under the name the index was built with
        rebuild = _index_command(index_dir, manifest, "--embedder", shell_word(embedder.name))
        raise IndexLoadError(
            f"embedding model {embedder.name!r} gives {embedder.dimension}-d vectors but the index at"
            f" {shown_path(index_dir)} holds {fidx.d}-d: rebuild it with `{rebuild}`"
        )
    return DocumentIndex(index_dir, manifest, fidx, records, embedder, mode=mode)


if __name__ == "__main__":  # `python -m rag_lookahead.rag.index DIR ...` is `rag_lookahead index DIR ...`
    import sys

    from rag_lookahead.cli import app

    app(args=["index", *sys.argv[1:]], prog_name="rag_lookahead")
