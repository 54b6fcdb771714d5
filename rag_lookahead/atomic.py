"""Atomic, durable file writes: a reader sees the old file or the new one, never half of one, and a
crash right after a write cannot leave a renamed-in file whose bytes never reached the disk."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from rag_lookahead.errors import shown_path

__all__ = [
    "fsync_dir",
    "fsync_file",
    "json_text",
    "jsonl_text",
    "naming_failed_write",
    "remove_leftovers",
    "temporary_names",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]


def fsync_file(path: Path | str) -> None:
    """Flush a file someone else wrote (e.g. ``save_pretrained``) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """Flush a folder's entries (new names, renames) to disk. Best effort: some filesystems refuse it."""
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


_TEMPORARY_SUFFIX_HEX = 4  # bytes of secrets.token_hex in a temporary name: 8 hex digits


def temporary_names(name: str) -> re.Pattern[str]:
    """The names of the temporary files :func:`write_bytes_atomic` makes beside a file named by the
    regex ``name`` (``.NAME.XXXXXXXX``): the leftovers of a writer killed mid-write, which only
    their owner may clean (store's manifest, the BM25 word cache)."""
    return re.compile(rf"\.(?:{name})\.[0-9a-f]{{{2 * _TEMPORARY_SUFFIX_HEX}}}")


def remove_leftovers(folder: Path, names: re.Pattern[str], older_than: float | None = None) -> None:
    """Remove a killed writer's temporary files from a folder of ours: the regular files (no links)
    whose whole name ``names`` matches, and with ``older_than`` only those last written that many
    seconds ago or more (where a live writer may hold one). A cache chore: what cannot be removed is
    left, with a debug line."""
    stale = None if older_than is None else time.time() - older_than
    try:
        for child in folder.iterdir():
            if names.fullmatch(child.name) and child.is_file() and not child.is_symlink():
                if stale is None or child.stat().st_mtime < stale:
                    child.unlink(missing_ok=True)
    except OSError as err:
        logging.getLogger(__name__).debug("could not remove leftovers in %s: %s", folder, err)


def _create_beside(path: Path, private: bool) -> tuple[int, Path]:
    """A new, empty temporary file beside ``path`` (``.NAME.XXXXXXXX``), open for writing, with the
    mode ``path`` has, or, for a new file, the usual one (0o666 less the umask, which the kernel
    applies): a rename never changes who may read the file. ``private``: 0o600 whatever was there."""
    try:
        keep = 0o600 if private else stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        keep = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(_TEMPORARY_SUFFIX_HEX)}"
        try:
            fd = os.open(tmp, flags, 0o666 if keep is None else keep)
        except FileExistsError:
            continue
        if keep is not None:
            os.fchmod(fd, keep)  # the umask may have cleared bits the old file had
        return fd, tmp
    raise FileExistsError(f"no free temporary name beside {path}")


@contextlib.contextmanager
def naming_failed_write(path: Path | str) -> Iterator[None]:
    """Within: an OSError says which file it could not write (a write error names none: "[Errno 28]
    No space left on device"), its path escaped (:func:`~rag_lookahead.errors.shown_path`)."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, f"cannot write {shown_path(path)}: {e.strerror or e}") from None


def write_bytes_atomic(path: Path | str, data: bytes, *, private: bool = False) -> None:
    """Write to a temporary file beside ``path``, flush it to disk, rename it into place, flush the folder.
    The file keeps the mode it had; a new one gets the usual mode (0o666 less the umask).
    ``private``: readable by its owner only (0o600), for files that hold a user's document text."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_beside(path, private)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path | str, text: str, *, private: bool = False) -> None:
    """``text`` in UTF-8 by :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"), private=private)


def json_text(data) -> str:
    """``data`` as the JSON files we write hold it: UTF-8 text as it is, indented, a final newline."""
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def jsonl_text(rows: Iterable[dict]) -> str:
    """``rows`` as JSON lines: one object a line, UTF-8 text as it is."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_json_atomic(path: Path | str, data, *, private: bool = False) -> None:
    write_text_atomic(path, json_text(data), private=private)
