"""Building the document index: split each file into chunks, embed the new ones, publish a version.

Rebuilding is incremental: files are keyed by the sha256 of their bytes, and unchanged files keep
their stored vectors (read back with ``reconstruct_n``); a changed embedding model (its name or
its dimension) or chunking (size, overlap, separators) re-embeds everything. Reading the corpus
is :mod:`.corpus`; the folder on disk, the lock and the atomic publish are :mod:`.store`.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

import numpy as np

from rag_lookahead.errors import ConfigError, IndexLoadError, RebuildWarning, one_line, shown_path
from rag_lookahead.paths import expand_user, refuse_blank_path
from rag_lookahead.rag import store
from rag_lookahead.rag.corpus import MAX_FILE_MB, Corpus, check_corpus, load_corpus, stage_bar
from rag_lookahead.rag.headings import MARKDOWN_SUFFIXES, heading_paths, searched_text
from rag_lookahead.rag.store import FORMAT_VERSION, LOCK_TIMEOUT_S, default_index_dir

if TYPE_CHECKING:  # the embedders pull in torch: imported where used, so the CLI starts fast
    from rag_lookahead.rag.embedders import Embedder

__all__ = ["CHUNK_OVERLAP", "CHUNK_SIZE", "SEPARATORS", "IndexReport", "build_index", "make_splitter"]


# 400 characters is ~250-400 e5 tokens of Chinese (well inside its 512-token window) or ~100 English
# words: one focused paragraph. Four such chunks (the default k) keep a RAG prompt near 1.5k tokens,
# cheap to prefill on a CPU, and give the lookahead trie whole sentences to draft from.
# 50 characters of overlap carries about one short sentence across a boundary.
CHUNK_SIZE = 400
CHUNK_OVERLAP = 50
HEADINGS_VERSION = 2  # how Markdown headings are read (see ``_previous``)
# how a file's legacy encoding is guessed (see ``_previous``; ``rag.charset``): an index without
# the key guessed the way before 2026-12-06 (a short GBK file with Latin words read as cp949);
# 2 scored a long file's whole text, 3 a sample of it (``charset.scored_sample``), which can pick
# another encoding for a file past the sample's size; 4 scores Latin letters by language and counts
# signs glued to words and capitals after small letters against a decoding (3 read short cp1252
# French as cp1257 or Mac Roman); 5 ranks cp1252 against a reading with Latin Extended letters by
# language, Western Europe's languages each alone (4 read Hungarian "Árvíztűrő" in cp1250 as cp1252
# "Árvíztûrõ")
DECODING_VERSION = 5
# how a PDF's text is read (``rag.pdf_text``): an index without the key read PDFs as before
# 2026-12-06 (Korean and Big5 CMaps as nonsense, a damaged page losing the file)
PDF_VERSION = 2
#: settings whose change reads some files again (see ``_previous``) instead of rebuilding the index
READING_VERSIONS = ("headings", "decoding", "pdf")
SEPARATORS = ["\n\n", "\n", "。", "！", "？", "；", ". ", "! ", "? ", " ", ""]


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
    passed_over: str = ""  # hidden entries and files of other types, counted (``Corpus.passed_over``)
    rebuilt: bool = False  # True when the previous index could not be reused at all
    kept: bool = False  # True when nothing changed, so the published version was left as it was
    seconds: float = 0.0

    @property
    def files(self) -> int:
        return self.added + self.updated + self.unchanged

    def summary(self) -> str:
        """One line of counts, then one indented line per skipped file, one counting the hidden
        entries and files of other types passed over, and one per note."""
        # the rate counts the whole run (loading the embedder, reading, splitting, writing), as a user waits it
        rate = f" ({self.embedded_chunks / self.seconds:.1f} chunks/s)" if self.embedded_chunks and self.seconds else ""
        lines = [
            f"indexed {self.files} files ({self.added} added, {self.updated} updated, {self.unchanged} unchanged,"
            f" {self.removed} removed), {self.chunks} chunks ({self.embedded_chunks} embedded)"
            f" with {self.embedding_model} in {self.seconds:.1f}s{rate} -> {shown_path(self.index_dir)}"
            + (" (nothing changed: the index was left as it was)" if self.kept else "")
        ]
        lines += [f"  skipped {one_line(s)}" for s in self.skipped]
        lines += [f"  skipped {self.passed_over}"] if self.passed_over else []
        lines += [f"  note {one_line(n)}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------- splitting


def make_splitter(chunk_size: int = CHUNK_SIZE, chunk_overlap: int = CHUNK_OVERLAP):
    """A Chinese-aware ``RecursiveCharacterTextSplitter``: paragraphs, lines, then sentence ends
    (``。！？；`` and ``. ! ?``), words, characters. Sentence punctuation stays at the END of a chunk.
    A run without separators is cut into windows by slicing (:mod:`.splitter`: langchain made one
    string per character). (Where each chunk starts: :func:`chunk_starts`.)"""
    from rag_lookahead.rag.splitter import CharacterWindowSplitter

    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    if not 0 <= chunk_overlap < chunk_size:
        raise ConfigError(f"chunk_overlap must be in [0, chunk_size), got {chunk_overlap}")
    return CharacterWindowSplitter(SEPARATORS, chunk_size, chunk_overlap)


def chunk_starts(splitter, text: str, chunks: list[str]) -> list[int]:
    """Where each of ``chunks`` (``splitter``'s non-blank chunks of ``text``) starts in ``text``.

    langchain's ``start_index`` searches for each chunk's text from the previous chunk's end less
    the overlap, and in repetitive text it found an earlier copy (a chunk after "### Example" got
    the heading above the copy). No rule on the text alone tells the copies apart: where the
    splitter cuts depends on its separators and on lengths only. So a copy of ``text`` with every
    other character drawn at random is split too: its cuts are the same, its chunks are (but for
    runs of separators alone) unique, and each is found after the one before."""
    twin = _twin(text)
    twin_chunks = [c for c in splitter.split_text(twin) if c.strip()]
    if [len(c) for c in twin_chunks] != [len(c) for c in chunks]:  # a splitter of another kind
        return _searched_starts(text, chunks)  # each chunk's first place, as langchain searches
    return _searched_starts(twin, twin_chunks, overlap=getattr(splitter, "_chunk_overlap", 0))


#: the characters ``str.strip`` removes (the splitter strips chunks): kept as they are in the twin
_WHITESPACE = np.array([c for c in range(0x3000 + 1) if chr(c).isspace()], dtype=np.uint32)
#: characters of ``text`` made into twin characters at a time (a block's code points take 4 bytes each)
_TWIN_BLOCK = 1 << 16


def _twin(text: str) -> str:
    """``text`` with every character but the separators' and whitespace drawn at random from the
    CJK ideographs: 20,992 of them, so even a chunk of one character is seldom found twice near by.

    Made a block at a time into 2-byte code units (the separators and whitespace kept are all in
    the BMP, as are the ideographs), so a long text costs about four bytes a character here, not
    the sixteen or more of whole-text arrays (a 19.5 MB line peaked at 470 MB); one generator,
    drawn from block after block, gives the same characters as one draw for the whole text."""
    kept = np.fromiter((ord(c) for c in set("".join(SEPARATORS))), dtype=np.uint32)
    rng = np.random.default_rng(0)
    units = np.empty(len(text), dtype="<u2")
    for begin in range(0, len(text), _TWIN_BLOCK):
        block = np.frombuffer(text[begin : begin + _TWIN_BLOCK].encode("utf-32-le", "surrogatepass"), dtype="<u4")
        other = ~np.isin(block, kept) & ~np.isin(block, _WHITESPACE)
        twin_block = np.where(other, 0, block).astype("<u2")
        twin_block[other] = rng.integers(0x4E00, 0xA000, size=int(other.sum()), dtype=np.uint32)
        units[begin : begin + len(block)] = twin_block
    return str(memoryview(units), "utf-16-le")


def _searched_starts(text: str, chunks: list[str], overlap: int | None = None) -> list[int]:
    """Each chunk's first place after the one before. With the splitter's ``overlap`` (on unique
    text), from the previous chunk's start or its end less the overlap, whichever is later: a
    chunk may start where the one before started (a longer one after a shorter), and it reaches
    back into the one before for the overlap only. Without, from the previous start plus one."""
    starts: list[int] = []
    cursor = 0
    for chunk in chunks:
        found = text.find(chunk, cursor)
        starts.append(found if found >= 0 else cursor)
        if overlap is None:
            cursor = starts[-1] + 1
        else:
            cursor = max(starts[-1], starts[-1] + len(chunk) - overlap)
    return starts


# ---------------------------------------------------------------- building


def _previous(index_dir: Path, embedder: Embedder, chunking: dict[str, object], guessed: set[str]):
    """The reusable part of an existing index: ``({source: (sha, [records], vectors)}, reason_if_not)``.

    Files are keyed by their bytes' sha256, so a change in how text is read would never reach an
    unchanged file: where the index read Markdown headings otherwise, its Markdown files are split
    again; where it guessed encodings otherwise, the files whose encoding is guessed (``guessed``);
    where it read PDFs otherwise, its PDFs."""
    if not (index_dir / store.MANIFEST).exists():
        return {}, None
    try:
        manifest = store.read_manifest(index_dir)
        if manifest["embedding_model"] != embedder.name:
            return {}, f"it was built with {manifest['embedding_model']!r}, now {embedder.name!r}"
        if manifest["dimension"] != int(embedder.dimension):  # another model under the name (st:./my-model)
            return {}, (
                f"its {manifest['dimension']}-d vectors were made by another {embedder.name!r}, which now gives"
                f" {int(embedder.dimension)}-d"
            )
        if any(manifest.get(key) != value for key, value in chunking.items() if key not in READING_VERSIONS):
            return {}, "its chunk size, overlap or separators differ from this run's"
        if "headings" not in manifest:
            return {}, "it was built before Markdown chunks were searched under their headings"
        fidx, records = store.read_verified(index_dir, manifest)
    except IndexLoadError as e:
        return {}, str(e)
    vectors = fidx.reconstruct_n(0, fidx.ntotal) if fidx.ntotal else np.zeros((0, fidx.d), np.float32)
    previous = _by_source(records, vectors)
    read_again: set[str] = set()
    if manifest["headings"] != chunking["headings"]:  # headings are read otherwise now: Markdown files anew
        read_again |= {source for source in previous if source.lower().endswith(MARKDOWN_SUFFIXES)}
    if manifest.get("decoding", 1) != chunking["decoding"]:  # encodings are guessed otherwise now: those files anew
        read_again |= guessed & previous.keys()
    if manifest.get("pdf", 1) != chunking["pdf"]:  # PDFs are read otherwise now: those files anew
        read_again |= {source for source in previous if source.lower().endswith(".pdf")}
    for source in read_again:  # no file's sha256: split and embedded again, as updated
        _, recs, vecs = previous[source]
        previous[source] = ("", recs, vecs)
    return previous, None


def _by_source(records: list[dict], vectors: np.ndarray) -> dict:
    """``{source: (sha, [records], vectors)}`` of stored rows."""
    by_source: dict[str, tuple[str, list[dict], list[np.ndarray]]] = {}
    for r, v in zip(records, vectors):
        sha, recs, vecs = by_source.setdefault(r["source"], (r.get("file_sha256", ""), [], []))
        recs.append(r)
        vecs.append(v)
    return {s: (sha, recs, np.stack(vecs)) for s, (sha, recs, vecs) in by_source.items()}


def _plan(docs, previous, splitter, report: IndexReport, progress: bool = False):
    """Per file: reuse the stored chunks and vectors when its sha256 is unchanged, else split it anew.
    Returns ``(plan, texts_to_embed)``; ``plan`` rows are ``(source, records, vectors_or_None)``."""
    plan: list[tuple[str, list[dict], np.ndarray | None]] = []
    to_embed: list[str] = []
    unchanged = {source for source, (sha, _) in docs.items() if (previous.get(source) or ("",))[0] == sha}
    bar = stage_bar(
        progress, "splitting", sum(len(text) for s, (_, text) in docs.items() if s not in unchanged), "char"
    )
    for source, (sha, text) in docs.items():
        old = previous.get(source)
        if source in unchanged:
            report.unchanged += 1
            plan.append((source, old[1], old[2]))
            continue
        if old is None:
            report.added += 1
        else:
            report.updated += 1
        bar.set_postfix_str(one_line(source), refresh=False)
        pieces = [c for c in splitter.split_text(text) if c.strip()]
        bar.update(len(text))
        recs = [
            {"chunk_id": f"{source}#{i}", "source": source, "file_sha256": sha, "text": piece}
            for i, piece in enumerate(pieces)
        ]
        if source.lower().endswith(MARKDOWN_SUFFIXES):  # searched under their section's headings
            for rec, heading in zip(recs, heading_paths(text, chunk_starts(splitter, text, pieces))):
                if heading:
                    rec["heading"] = heading
        plan.append((source, recs, None))
        to_embed.extend(searched_text(r) for r in recs)
    bar.close()
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


@overload
def build_index(
    corpus_dir: str | Path,
    index_dir: str | Path | None = None,
    embedder: Embedder | str | None = None,
    *,
    chunk_size: int = ...,
    chunk_overlap: int = ...,
    progress: bool = ...,
    follow_symlinks: bool = ...,
    max_file_mb: float = ...,
    lock_timeout: float = ...,
    if_missing: Literal[False] = False,
) -> IndexReport: ...


@overload
def build_index(
    corpus_dir: str | Path,
    index_dir: str | Path | None = None,
    embedder: Embedder | str | None = None,
    *,
    chunk_size: int = ...,
    chunk_overlap: int = ...,
    progress: bool = ...,
    follow_symlinks: bool = ...,
    max_file_mb: float = ...,
    lock_timeout: float = ...,
    if_missing: bool,
) -> IndexReport | None: ...


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
    if_missing: bool = False,
) -> IndexReport | None:
    """Index ``corpus_dir`` into ``index_dir`` (default :func:`default_index_dir`), reusing the vectors of
    files whose sha256 did not change, then atomically publish the new version.

    Refuses (:class:`ConfigError`) a non-empty ``index_dir`` that is not an index of ours. Waits up to
    ``lock_timeout`` seconds for another build of the same folder, then raises :class:`IndexBusyError`.
    ``if_missing``: build only into a folder with no index yet, and return None (writing nothing)
    where one was published while this run waited for the lock: ``ask``'s sample index must not
    replace the user's index that an ``index`` run was writing when ``ask`` looked.
    """
    t0 = time.perf_counter()
    refuse_blank_path(corpus_dir, "corpus folder")  # "" is ".": the working folder, over the documents indexed
    index_dir = expand_user(index_dir, "index folder") if index_dir is not None else default_index_dir()
    if not lock_timeout >= 0:
        raise ConfigError(f"lock_timeout must be >= 0 seconds, got {lock_timeout}")
    splitter = make_splitter(chunk_size, chunk_overlap)
    # "separators": where the splitter cuts (an index cut at others is split and embedded again);
    # "headings": chunks of Markdown files are searched with their heading path; an index built
    # before that is embedded again, one whose headings were read otherwise (version 1: CR-only
    # lines, uncut titles, langchain's start_index) gets its Markdown files embedded again;
    # "decoding": one that guessed encodings otherwise reads those files again; "pdf": one that read
    # PDFs otherwise reads its PDFs again. The manifest records every key here.
    chunking = {
        "chunk_size": chunk_size,
        "chunk_overlap": chunk_overlap,
        "separators": SEPARATORS,
        "headings": HEADINGS_VERSION,
        "decoding": DECODING_VERSION,
        "pdf": PDF_VERSION,
    }
    store.check_target(index_dir)  # before any slow work, and before anything is created
    # a mistyped, empty or .docx-only corpus folder fails before an embedder loads (or downloads)
    check_corpus(corpus_dir, follow_symlinks=follow_symlinks, max_file_mb=max_file_mb)
    # a blank or misspelt --embedder is refused before the documents are read (it was only after
    # the whole corpus was read: minutes of PDFs), into a new index folder or an existing one
    corpus: Corpus | None = None
    if not index_dir.exists():  # no other build's yet: a bad --embedder or corpus fails before the folder is made
        embedder = _loaded(embedder)
        corpus = load_corpus(corpus_dir, follow_symlinks=follow_symlinks, max_file_mb=max_file_mb, progress=progress)
    index_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # a folder we make is its owner's only
    # into an existing folder, before the embedder loads and the files are read: a busy folder fails fast
    with store.writer_lock(index_dir, lock_timeout) as waited:
        store.check_target(index_dir)  # again: the folder may have changed while we waited
        if if_missing and store.our_manifest(index_dir) is not None:
            return None
        embedder = _loaded(embedder)
        if corpus is None or waited:  # waited: a build that read them earlier must not publish an older corpus last
            corpus = load_corpus(
                corpus_dir, follow_symlinks=follow_symlinks, max_file_mb=max_file_mb, progress=progress
            )
        report = IndexReport(
            index_dir=index_dir,
            embedding_model=embedder.name,
            skipped=corpus.skipped,
            notes=corpus.notes,
            passed_over=corpus.passed_over(),
        )
        records, faiss_index = _embed_changes(index_dir, corpus, embedder, (splitter, chunking), progress, report)

        def manifest_for(data_name: str, artifacts: dict[str, str]) -> dict:
            settings = chunking | {"corpus_dir": corpus_dir}
            return _manifest(corpus, records, embedder, settings, data_name, artifacts)

        current = store.our_manifest(index_dir)
        # a file read again (same bytes, text read otherwise) re-embeds its chunks: never "kept"
        if (
            not report.rebuilt
            and not report.embedded_chunks
            and current is not None
            and _same_version(current, manifest_for)
        ):
            report.kept = True  # a new data folder would hold the same vectors and text under another name
            store.remove_leftovers(index_dir, current["data"])
        else:
            store.publish_version(index_dir, faiss_index, records, manifest_for)
    report.seconds = time.perf_counter() - t0
    return report


def _same_version(current: dict, manifest_for) -> bool:
    """Whether the published manifest already says all that a new one would (its time aside):
    the same files and hashes, chunks, embedder and settings, so the same data."""
    again = manifest_for(current.get("data"), current.get("artifacts"))
    return {k: v for k, v in again.items() if k != "created"} == {k: v for k, v in current.items() if k != "created"}


def _loaded(embedder: Embedder | str | None) -> Embedder:
    """The embedder itself, loaded by name (None: the default) where a name is given."""
    if embedder is None or isinstance(embedder, str):
        from rag_lookahead.rag.embedders import get_embedder

        return get_embedder(embedder)
    return embedder


def _embed_changes(index_dir: Path, corpus: Corpus, embedder: Embedder, splitting, progress, report: IndexReport):
    """The new version's ``(records, FAISS index)``: stored vectors for unchanged files, new ones for the rest.

    ``splitting``: the splitter and its settings (``chunking`` of :func:`build_index`; stored vectors
    are reused only under the same size, overlap and separators, by the same model and dimension)."""
    splitter, chunking = splitting
    previous, why_not = _previous(index_dir, embedder, chunking, corpus.guessed)
    if why_not:
        report.rebuilt = True
        why = f"re-embedded everything: the index at {shown_path(index_dir)} could not be reused ({why_not})"
        report.notes.append(why)  # the command's report prints it once
        warnings.warn(why, RebuildWarning, stacklevel=3)
    plan, to_embed = _plan(corpus.docs, previous, splitter, report, progress)
    if report.rebuilt:  # counts describe what happened to files relative to the previous file list
        old_files = set(store.manifest_files(index_dir))
        report.added = sum(1 for s in corpus.docs if s not in old_files)
        report.updated = len(corpus.docs) - report.added
        report.removed = sum(1 for s in old_files if s not in corpus.docs)
    if to_embed:  # the slow part: a folder that cannot take its result is refused first
        store.check_writable(index_dir)
    new_vecs = embedder.embed_documents(to_embed, progress=progress) if to_embed else None
    report.embedded_chunks = len(to_embed)
    records, faiss_index = _assemble(plan, new_vecs, int(embedder.dimension))
    report.chunks = len(records)
    return records, faiss_index


def _manifest(corpus: Corpus, records: list[dict], embedder: Embedder, settings: dict, data_name, artifacts) -> dict:
    """The manifest of a new version (see :mod:`.store`): settings, counts, per-file hashes, data name."""
    per_file: dict[str, dict] = {}
    for r in records:
        per_file.setdefault(r["source"], {"sha256": r["file_sha256"], "chunks": 0})["chunks"] += 1
    for source, (sha, _) in corpus.docs.items():
        per_file.setdefault(source, {"sha256": sha, "chunks": 0})
    return {
        "format": store.FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "data": data_name,
        "embedding_model": embedder.name,
        "dimension": int(embedder.dimension),
        "metric": "inner_product (vectors L2-normalized)",
        # every chunking and reading setting: one the manifest left out would compare equal on the
        # next run and keep a version whose text was read otherwise
        **{key: value for key, value in settings.items() if key != "corpus_dir"},
        "num_files": len(corpus.docs),
        "num_chunks": len(records),
        # a name that is not UTF-8 as \\xNN: JSON (and the UTF-8 manifest) cannot hold its surrogate escapes
        "corpus_dir": os.fsencode(Path(settings["corpus_dir"]).expanduser().resolve()).decode(
            "utf-8", "backslashreplace"
        ),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": dict(sorted(per_file.items())),
        "artifacts": artifacts,
    }
