"""Atomic, durable file writes: a reader sees the old file or the new one, never half of one, and a
crash right after a write cannot leave a renamed-in file whose bytes never reached the disk."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["fsync_dir", "fsync_file", "write_text_atomic", "write_json_atomic", "write_jsonl_atomic"]


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


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write to a temporary file beside ``path``, flush it to disk, rename it into place, flush the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path | str, data) -> None:
    write_text_atomic(path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def write_jsonl_atomic(path: Path | str, rows: Iterable[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
