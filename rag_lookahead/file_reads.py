"""Reading a file we did not open ourselves, whatever is at its name: never blocking, never endless.

Why: a name in a corpus, an index folder or a cache folder may hold a FIFO (an ``open`` for
reading waits for a writer, for ever), a link to ``/dev/zero`` (a read grows the process until it is
killed) or a file that grows while it is read. The corpus, the index manifest and the caches
(the cost curves, the BM25 words) all read through :func:`read_capped`.

The data sets shipped in the package are read here too, by name (:data:`PROMPT_SETS`,
:data:`RETRIEVAL_SETS`, :func:`shipped_text`; the bundled prompts, which the e5 encoder's calibration
reads as well: :func:`bundled_prompts_text`), and split by :func:`jsonl_lines`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path

__all__ = ["PROMPT_SETS", "RETRIEVAL_SETS", "bundled_prompts_text", "jsonl_lines", "read_capped", "shipped_text"]

#: the prompt sets shipped in the package, by the name the benchmarks' ``--prompts`` takes (files
#: under ``rag_lookahead/``: a path to them works only in a checkout of the repository, the names anywhere)
PROMPT_SETS = {
    "bundled": "data/bench_prompts.jsonl",  # the default
    "realistic-zh": "data/realistic/bench_zh.jsonl",
    "realistic-en": "data/realistic/bench_en.jsonl",
    "seeding": "data/seed_prompts.jsonl",  # passages for --seed-mode references to seed the trie with
}
#: the retrieval sets shipped in the package, by the name ``bench.retrieval``'s ``--dataset`` takes
RETRIEVAL_SETS = {
    "bundled": "data/retrieval_zh.jsonl",  # the default
    "realistic-zh": "data/realistic/retrieval_zh.jsonl",
    "realistic-en": "data/realistic/retrieval_en.jsonl",
}


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"


def read_capped(
    path: Path, follow_symlinks: bool, max_file_mb: float, limit_flag: str | None = "--max-file-mb"
) -> bytes | str:
    """The file's bytes, read once; or why not (a string). Never blocks on a FIFO or device, never
    reads past ``max_file_mb`` (``/dev/zero`` would grow the process until it was killed), never
    follows a link unless asked (``O_NOFOLLOW`` also closes the gap between the check and the open).
    ``limit_flag``: the option that sets the limit, named when a file is over it."""
    # os.path.islink, not Path.is_symlink: a file in a folder that can be listed but not entered
    # raised PermissionError there (the build stopped); the open below then says "unreadable"
    if not follow_symlinks and os.path.islink(path):
        return "symbolic link, not followed (--follow-symlinks)"
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            return "symbolic link, not followed (--follow-symlinks)"
        return f"unreadable ({e.strerror or e})"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder with its own error
        os.close(fd)
        return "not a regular file"
    with os.fdopen(fd, "rb") as f:
        max_bytes = int(max_file_mb * 2**20)
        too_big = f"{_size(st.st_size)} is over the {max_file_mb:g} MB limit" + (
            f" ({limit_flag})" if limit_flag else ""
        )
        if st.st_size > max_bytes:
            return too_big
        try:  # what the file holds plus a byte, to see it grow (read(n) reserves n bytes: never the limit)
            data = f.read(min(max_bytes, st.st_size) + 1)
            while st.st_size < len(data) <= max_bytes:  # it grew while being read: read on to the limit
                block = f.read(min(1 << 20, max_bytes + 1 - len(data)))
                if not block:
                    break
                data += block
        except OSError as e:
            return f"unreadable ({e.strerror or e})"
    if len(data) > max_bytes:  # it grew after the size check
        return too_big
    return data


def shipped_text(sets: Mapping[str, str], name: str) -> str | None:
    """The text of the set ``name`` of ``sets`` (:data:`PROMPT_SETS` or :data:`RETRIEVAL_SETS`), read
    from the installed package wherever the process runs; None when no set has that name."""
    return _package_text(sets[name]) if name in sets else None


def bundled_prompts_text() -> str:
    """The text of the default prompt set shipped in the package (``data/bench_prompts.jsonl``)."""
    return _package_text(PROMPT_SETS["bundled"])


def _package_text(relative: str) -> str:
    return resources.files("rag_lookahead").joinpath(relative).read_text(encoding="utf-8")


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSONL text with their numbers (from 1). Lines end at "\\n" only (a
    trailing "\\r" is dropped): U+2028, U+0085 or a form feed inside a JSON string ends no line."""
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            yield n, line
