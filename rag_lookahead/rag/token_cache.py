"""BM25's words per chunk, kept on disk between processes.

BM25 is not stored in an index; every process rebuilds it from the chunks' texts on its first
search, and jieba's cut costs ~1.4 ms a 300-character Chinese chunk here (~28 s for a 20,000-chunk
corpus at every ``ask``), while reading the words back costs ~0.04 ms a chunk. So the words are
cached in our cache folder (``paths.cache_dir() / "bm25"``), not in the index: readers never write
into an index, and building one does not get slower.

A cache file is named by a hash of the chunks' texts, the code of :mod:`.lexical` and jieba's
version, so a rebuilt index, an edited tokenizer or a new jieba misses instead of serving stale
words; its first line holds a checksum of the rest, so a damaged file is cut again rather than
read. Files are written atomically; only the :data:`KEEP` most recently used are kept. Anything
that goes wrong with the cache (a folder we cannot write, a damaged file) falls back to cutting
the words again: the cache only ever saves time, it never changes a result.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from rag_lookahead.atomic import remove_leftovers, temporary_names, write_text_atomic
from rag_lookahead.file_reads import read_capped
from rag_lookahead.paths import cache_dir
from rag_lookahead.rag import lexical

__all__ = ["KEEP", "MIN_CHUNKS", "cached_tokens", "default_folder"]

log = logging.getLogger(__name__)

KEEP = 8  # cache files kept (most recently used first)
MIN_CHUNKS = 256  # below this, cutting the words is quicker than hashing, writing and pruning
_NAME = re.compile(r"[0-9a-f]{40}\.words")
_TEMPORARY = temporary_names(_NAME.pattern)  # write_text_atomic's, of a killed writer
STALE_SECONDS = 3600  # a writer takes seconds: a temporary file this old is a killed process's


def default_folder() -> Path:
    return cache_dir() / "bm25"


def _key(texts: Sequence[str]) -> str:
    import jieba

    h = hashlib.sha256()
    h.update(Path(lexical.__file__).read_bytes())
    # the loaded dictionary's state only where jieba cuts something: loading it took ~0.5 s
    dictionary = lexical.dictionary_state() if any(lexical.has_cjk(t) for t in texts) else ""
    h.update(f"\0jieba {jieba.__version__} {dictionary}\0{len(texts)}\0".encode())
    for t in texts:  # each text's length first: a text may hold "\0", so no separator tells them apart
        data = t.encode("utf-8", "surrogatepass")
        h.update(f"{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()[:40]


_HEADER = "rag_lookahead BM25 words 1 "


#: far above any corpus's words this library can index in memory; a bigger file is not one of ours
MAX_WORDS_MB = 8192.0


def _read(path: Path, n: int) -> list[list[str]] | None:
    """The words of ``n`` chunks, or None when the file is missing, unreadable, damaged (its body no
    longer matches the checksum in its first line) or not ``n`` chunks long."""
    raw = read_capped(path, follow_symlinks=False, max_file_mb=MAX_WORDS_MB, limit_flag=None)  # a FIFO: no wait
    if not isinstance(raw, bytes):  # why not, as text
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    header, _, body = text.partition("\n")
    if header != _HEADER + hashlib.sha256(body.encode("utf-8")).hexdigest():
        return None
    lines = body.split("\n")
    if len(lines) != n + 1 or lines[-1]:
        return None
    return [line.split(" ") if line else [] for line in lines[:-1]]


def _write(path: Path, docs: list[list[str]]) -> None:
    # tokens are \w+ runs (lexical.tokenize), so neither a space nor a newline can be inside one
    body = "".join(" ".join(d) + "\n" for d in docs)
    write_text_atomic(path, _HEADER + hashlib.sha256(body.encode("utf-8")).hexdigest() + "\n" + body, private=True)


def _prune(folder: Path, keep: int) -> None:
    """Delete our cache files beyond the ``keep`` most recently used, and the temporary files of
    writers killed mid-write (each as large as a cache file, they were never removed); nothing
    else in the folder."""
    try:
        files = [p for p in folder.iterdir() if p.is_file() and not p.is_symlink()]
        ours = sorted((p for p in files if _NAME.fullmatch(p.name)), key=lambda p: p.stat().st_mtime, reverse=True)
        for p in ours[keep:]:
            p.unlink(missing_ok=True)
    except OSError as e:
        log.debug("could not prune the BM25 word cache in %s: %s", folder, e)
    remove_leftovers(folder, _TEMPORARY, older_than=STALE_SECONDS)


def cached_tokens(
    texts: Sequence[str],
    folder: Path | None = None,
    min_chunks: int | None = None,
    keep: int | None = None,
) -> list[list[str]]:
    """``[lexical.tokenize(t) for t in texts]``, read from the cache when this exact corpus was cut
    before. ``folder``, ``min_chunks`` and ``keep`` default to :func:`default_folder`,
    :data:`MIN_CHUNKS` and :data:`KEEP`."""
    if len(texts) < (MIN_CHUNKS if min_chunks is None else min_chunks):
        return [lexical.tokenize(t) for t in texts]
    folder = default_folder() if folder is None else folder
    path = folder / f"{_key(texts)}.words"
    docs = _read(path, len(texts))
    if docs is not None:
        try:
            os.utime(path)  # most recently used: pruned last
        except OSError:
            pass
        return docs
    docs = [lexical.tokenize(t) for t in texts]
    try:
        _write(path, docs)
    except (OSError, UnicodeError) as e:
        log.info("BM25 words not cached (%s): the next process cuts them again", e)
        return docs
    _prune(folder, KEEP if keep is None else keep)
    return docs
