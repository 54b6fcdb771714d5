"""The index folder on disk: its manifest, its immutable data versions, the build lock, and publishing.

One folder that only ``build_index`` writes::

    manifest.json          the marker and the pointer: format name + version, embedding model and
                           dimension, splitter settings, counts, sha256 of every source file, and the
                           name and sha256 of the data below
    data-XXXXXXXX/         one immutable version of the data, named by ``tempfile.mkdtemp``
        .rag_lookahead-data  our mark, written first: only a data folder with it is ever taken for ours
        index.faiss        faiss.write_index of an IndexFlatIP over L2-normalized vectors (row i = chunk i)
        docstore.jsonl     one JSON object per chunk, in row order: id, chunk_id, source, file_sha256, text
    .rag_lookahead.lock    held by the one build that may write here (``filelock``)

Loading reads JSON and a FAISS index only; nothing is ever unpickled.

A build writes a new data folder, then publishes it by replacing ``manifest.json`` with one
``os.replace``, then removes the old data. A reader therefore sees the old index or the new one; one
that read the old manifest just before the old data was removed notices the manifest changed and
reads again. Readers never change anything on disk.

A build only writes into a folder that is new, empty, or holds one of our manifests; it never
deletes a file it did not write: it only removes the data folder the manifest it replaces named and
``data-*`` folders that carry our mark (or are empty), each emptied file by known file name, then
removed with ``rmdir``, which fails on anything else; a ``data-*`` folder of someone else's is left
alone (and keeps a folder without our manifest from being taken as empty). Format version 1 (the
data files directly in the folder) is still read, and upgraded by the next build, which removes
those files only when they still match the sha256s the old manifest recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rag_lookahead.atomic import fsync_dir, naming_failed_write, temporary_names, write_json_atomic
from rag_lookahead.errors import ConfigError, IndexLoadError, first_line, quoted_path, shown_path
from rag_lookahead.locks import exclusive
from rag_lookahead.paths import env_folder, home_dir

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LOCK_FILE",
    "LOCK_TIMEOUT_S",
    "MANIFEST",
    "IndexBusyError",
    "check_target",
    "default_index_dir",
    "manifest_files",
    "publish_version",
    "read_manifest",
    "read_snapshot",
    "read_verified",
    "writer_lock",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: index.faiss and docstore.jsonl directly in the index folder
FORMAT_NAME = "rag_lookahead.index"
MANIFEST, FAISS_FILE, DOCSTORE = "manifest.json", "index.faiss", "docstore.jsonl"
DATA_FILES = (FAISS_FILE, DOCSTORE)
DATA_MARK = ".rag_lookahead-data"  # written into each data folder we make, before anything else
DATA_PREFIX = "data-"
DATA_NAME = re.compile(r"data-[a-z0-9_]{8}")  # what tempfile.mkdtemp(prefix=DATA_PREFIX) makes
LOCK_FILE = ".rag_lookahead.lock"
MANIFEST_TMP = temporary_names(re.escape(MANIFEST))  # write_json_atomic's temp files
LOCK_TIMEOUT_S = 600.0  # how long a build waits for another build of the same folder (--lock-timeout)
READ_ATTEMPTS = 5  # a reader re-reads at most this often while builds keep publishing new versions


class IndexBusyError(IndexLoadError):
    """Another build held the index folder's lock for longer than the lock timeout."""


def default_index_dir() -> Path:
    """``$RAG_LOOKAHEAD_HOME/index``, else ``$XDG_DATA_HOME/rag_lookahead/index``, else ``~/.local/share/...``."""
    if (home := env_folder("RAG_LOOKAHEAD_HOME")) is not None:
        return home / "index"
    xdg = env_folder("XDG_DATA_HOME")
    base = xdg if xdg is not None else home_dir("RAG_LOOKAHEAD_HOME") / ".local" / "share"
    return base / "rag_lookahead" / "index"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- reading and verifying an index


def _parse_manifest(index_dir: Path, raw: bytes) -> dict:
    """Check a manifest's marker, version and keys; :class:`IndexLoadError` says what is wrong."""
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # Recursion: nested thousands deep
        why = f"{MANIFEST} is not valid JSON ({e})"
        raise IndexLoadError(
            f"index at {shown_path(index_dir)} is corrupt: {why}; rebuild it with `rag_lookahead index`"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        where = "rebuild it with `rag_lookahead index`" if holds_our_data(index_dir) else "is it the right folder?"
        raise IndexLoadError(f"{shown_path(index_dir / MANIFEST)} is not a rag_lookahead index manifest; {where}")
    if _is_newer(version := manifest.get("format_version")):  # not ours to rebuild over: check_target refuses
        raise IndexLoadError(_newer_format(index_dir, version, _READ_ELSEWHERE))
    if isinstance(version, bool) or version not in READABLE_VERSIONS:  # true == 1 to Python, not to us
        raise IndexLoadError(
            f"index at {shown_path(index_dir)} has format version {version!r}; this version "
            f"reads {', '.join(map(str, READABLE_VERSIONS))}: rebuild it with `rag_lookahead index`"
        )
    for key, kind, what in _MANIFEST_KEYS:
        if key not in manifest:
            raise IndexLoadError(f"index at {shown_path(index_dir)} is corrupt: {MANIFEST} lacks {key!r}")
        value = manifest[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            raise IndexLoadError(
                f"index at {shown_path(index_dir)} is corrupt: {MANIFEST}'s {key!r} should be {what}, not {value!r:.60}"
            )
    _data_dir(index_dir, manifest)  # a bad data name is corruption too
    return manifest


#: how a reader is told to go on without the newer release (``index`` refuses to rebuild over its index)
_READ_ELSEWHERE = (
    "build an index of this version into a new folder with `rag_lookahead index DIR --index-dir NEW_FOLDER`"
)


def _is_newer(version: Any) -> bool:
    """Whether a manifest's ``format_version`` is a later one than this release writes."""
    return isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION


def _newer_format(index_dir: Path, version: int, advice: str) -> str:
    """Why an index of a later format version is neither read nor rebuilt (a newer release may still
    read it), ending with ``advice``: what to do instead, short of upgrading."""
    return (
        f"the index at {shown_path(index_dir)} was written by a newer rag_lookahead (format version {version};"
        f" this one reads up to {FORMAT_VERSION}): upgrade rag_lookahead to use it, or {advice}"
    )


_MANIFEST_KEYS = (  # the keys a reader relies on, with the types it relies on
    ("embedding_model", str, "a model name"),
    ("dimension", int, "a whole number"),
    ("num_chunks", int, "a whole number"),
    ("files", dict, "an object of file hashes"),
    ("artifacts", dict, "an object of file hashes"),
)


#: a manifest holds about 150 bytes a file indexed; a bigger file of that name is no manifest of ours
MAX_MANIFEST_MB = 256


def _manifest_file(path: Path, follow_symlinks: bool = True) -> bytes | str:
    """A manifest's bytes, or why not (a string). Read as corpus files are: a FIFO of that name hung
    ``index`` and ``load_index``, a link to ``/dev/zero`` or a 2 GB ``manifest.json`` of the user's
    (a common name in dataset folders) was read until memory ran out."""
    from rag_lookahead.rag.corpus import read_capped

    return read_capped(path, follow_symlinks, MAX_MANIFEST_MB, limit_flag=None)


def _manifest_bytes(index_dir: Path) -> bytes:
    raw = _manifest_file(index_dir / MANIFEST)
    if isinstance(raw, bytes):
        return raw
    if not (index_dir / MANIFEST).exists():
        raise IndexLoadError(f"index at {shown_path(index_dir)} is incomplete: {MANIFEST} is missing")
    raise IndexLoadError(f"cannot read {shown_path(index_dir / MANIFEST)}: {raw}")


def read_manifest(index_dir: Path) -> dict:
    return _parse_manifest(index_dir, _manifest_bytes(index_dir))


def _data_dir(index_dir: Path, manifest: dict) -> Path:
    """Where the manifest's data lives: a ``data-*`` folder inside the index (version 1: the index itself)."""
    if manifest["format_version"] == 1:
        return index_dir
    name = manifest.get("data")
    if not isinstance(name, str) or not DATA_NAME.fullmatch(name):
        raise IndexLoadError(
            f"index at {shown_path(index_dir)} is corrupt: {MANIFEST} names no valid data folder ({name!r})"
        )
    return index_dir / name


#: faiss's serialized IndexFlatIP: fourcc, d, ntotal, two unused int64s, is_trained, metric (0: inner
#: product), then its vectors as a count of floats and the floats
_FLAT_IP_HEADER = struct.Struct("<4siqqq?iq")


def _flat_ip_problem(data: bytes, n: int, d: int) -> str | None:
    """What makes ``data`` other than the IndexFlatIP of ``n`` vectors of ``d`` floats we write; None if
    nothing. Checked before faiss parses it: a file whose sha256 was written to match (anyone who can
    edit the folder can) may be another index kind (an IndexIDMap aborted the process in
    ``reconstruct_n``; a foreign id made every search fail) or claim more vectors than it holds,
    which faiss allocates before it notices (2**35 entries in a 3 KB file: ``std::bad_alloc``)."""
    if len(data) < _FLAT_IP_HEADER.size:
        return "is too short to be an IndexFlatIP"
    fourcc, dim, total, _, _, _, metric, floats = _FLAT_IP_HEADER.unpack_from(data)
    if fourcc != b"IxFI" or metric != 0:
        return f"is not an IndexFlatIP (it starts {fourcc!r}, metric {metric})"
    if dim != d or total != n or floats != n * d or len(data) != _FLAT_IP_HEADER.size + 4 * n * d:
        return f"does not hold {n} vectors of dimension {d} in {len(data)} bytes"
    return None


def read_verified(index_dir: Path, manifest: dict) -> tuple[Any, list[dict]]:
    """The FAISS index and docstore the manifest names, checked against its sha256s and counts."""
    import faiss
    import numpy as np

    data_dir = _data_dir(index_dir, manifest)
    faiss_bytes = b""
    for name in DATA_FILES:
        path = data_dir / name
        if not path.is_file():
            raise IndexLoadError(f"index at {shown_path(index_dir)} is incomplete: {name} is missing")
        expected = manifest["artifacts"].get(name)
        try:
            if name == FAISS_FILE:  # read once: the bytes hashed are the bytes loaded
                faiss_bytes = path.read_bytes()
                actual = hashlib.sha256(faiss_bytes).hexdigest()
            else:
                actual = file_sha256(path)
        except FileNotFoundError:  # a build removed it after the is_file check: the caller reads again
            raise IndexLoadError(f"index at {shown_path(index_dir)} is incomplete: {name} is missing") from None
        except OSError as e:
            raise IndexLoadError(f"cannot read {shown_path(path)}: {e.strerror or e}") from None
        if actual != expected:
            raise IndexLoadError(
                f"index at {shown_path(index_dir)} is corrupt: {name} does not match the sha256 in {MANIFEST}; "
                "rebuild it"
            )
    n, d = int(manifest["num_chunks"]), int(manifest["dimension"])
    problem = _flat_ip_problem(faiss_bytes, n, d)
    if problem is not None:
        raise IndexLoadError(f"index at {shown_path(index_dir)} is corrupt: {FAISS_FILE} {problem}; rebuild it")
    try:  # read by Python, not by faiss: a path that is not UTF-8 is an ordinary path here
        fidx = faiss.deserialize_index(np.frombuffer(faiss_bytes, dtype=np.uint8))
    except (RuntimeError, MemoryError) as e:
        raise IndexLoadError(
            f"index at {shown_path(index_dir)} is corrupt: cannot read {FAISS_FILE} ({first_line(e)})"
        ) from None
    records = []
    try:
        with open(data_dir / DOCSTORE, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                try:
                    r = json.loads(line)
                    if not isinstance(r, dict) or not all(
                        isinstance(r.get(key), str) for key in ("text", "source", "chunk_id")
                    ):
                        raise ValueError("not an object with text, source and chunk_id strings")
                    if not isinstance(r.get("heading", ""), str):
                        raise ValueError("its heading is not a string")
                except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
                    raise IndexLoadError(
                        f"index at {shown_path(index_dir)} is corrupt: {DOCSTORE} line {lineno}: {e}"
                    ) from None
                records.append(r)
    except IndexLoadError:  # an OSError too: said already
        raise
    except FileNotFoundError:  # removed by a build after the hash check
        raise IndexLoadError(f"index at {shown_path(index_dir)} is incomplete: {DOCSTORE} is missing") from None
    except OSError as e:
        raise IndexLoadError(f"cannot read {shown_path(data_dir / DOCSTORE)}: {e.strerror or e}") from None
    if fidx.ntotal != n or len(records) != n:
        raise IndexLoadError(
            f"index at {shown_path(index_dir)} is corrupt: {FAISS_FILE} has {fidx.ntotal} vectors, {DOCSTORE} has "
            f"{len(records)} chunks, {MANIFEST} says {n}"
        )
    if fidx.d != d:
        raise IndexLoadError(
            f"index at {shown_path(index_dir)} is corrupt: vectors have dimension {fidx.d}, {MANIFEST} says {d}"
        )
    return fidx, records


def read_snapshot(index_dir: Path) -> tuple[dict, Any, list[dict]]:
    """One published version: the manifest and the data it names, read without changing anything.

    A build publishes a new manifest, then removes the old data. A reader that read the old manifest
    and then found its data gone (or different) sees that the manifest changed and reads again.
    """
    for attempt in range(READ_ATTEMPTS):
        raw = _manifest_bytes(index_dir)
        manifest = _parse_manifest(index_dir, raw)
        try:
            fidx, records = read_verified(index_dir, manifest)
        except IndexLoadError:
            if attempt + 1 < READ_ATTEMPTS and _manifest_changed(index_dir, raw):
                continue
            raise
        return manifest, fidx, records
    raise AssertionError("unreachable")


def _manifest_changed(index_dir: Path, raw: bytes) -> bool:
    return _manifest_file(index_dir / MANIFEST) != raw


# ---------------------------------------------------------------- ownership of the index folder


def _our_manifest(path: Path) -> dict | None:
    """The manifest at ``path`` if it carries our marker (``"format": "rag_lookahead.index"``): only a
    build of ours wrote it. None for a missing, unreadable or foreign file (a link too: we write none)."""
    raw = _manifest_file(path, follow_symlinks=False)
    try:
        manifest = json.loads(raw.decode("utf-8")) if isinstance(raw, bytes) else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME else None


def our_manifest(index_dir: Path) -> dict | None:
    """The folder's published manifest, if ours (see :func:`_our_manifest`)."""
    return _our_manifest(index_dir / MANIFEST)


def _is_our_data_dir(path: Path) -> bool:
    """A folder (not a link) named as ``tempfile.mkdtemp`` names ours (``data-`` and 8 characters)
    that is empty (what an interrupted build leaves before its mark) or carries our mark and holds
    nothing but our file names."""
    if not DATA_NAME.fullmatch(path.name) or path.is_symlink():
        return False
    try:
        children = list(path.iterdir())
    except FileNotFoundError:  # removed since its folder was listed: by a build of ours (its probe)
        return True
    except OSError:  # a file of that name, a folder we cannot read: not ours to replace
        return False
    if not children:
        return True
    names = {c.name for c in children}
    return DATA_MARK in names and all(
        c.name in (*DATA_FILES, DATA_MARK) and not c.is_symlink() and c.is_file() for c in children
    )


def holds_our_data(index_dir: Path) -> bool:
    """Whether the folder holds a data folder a build of ours finished (marked, our files only)."""
    try:
        return any((c / DATA_MARK).is_file() and _is_our_data_dir(c) for c in index_dir.iterdir())
    except OSError:
        return False


def _is_our_leftover(path: Path) -> bool:
    """What an interrupted first build can leave in a folder that has no manifest yet, or what a
    build running beside us made and removed since the folder was listed (its write probe, a
    leftover it cleared, a temporary manifest it renamed): a first build into a new folder was
    refused, or failed with a traceback, when it looked as another build did that."""
    if path.name == LOCK_FILE or MANIFEST_TMP.fullmatch(path.name):
        return not os.path.lexists(path) or (path.is_file() and not path.is_symlink())
    return _is_our_data_dir(path)


def check_target(
    index_dir: Path, advice: str = "choose a new or empty folder with --index-dir", *, writing: bool = True
) -> None:
    """Refuse (:class:`ConfigError`) to write into anything but a new folder, an empty one, or an
    index of ours; ``advice`` ends the message of a folder that holds someone else's files.
    ``writing=False``: only reading was asked for (``ask --index-dir``), so the message of such a
    folder does not speak of writing into it."""
    if not index_dir.exists():
        if index_dir.is_symlink():
            raise ConfigError(f"index path is a broken symbolic link: {shown_path(index_dir)}")
        return
    if not index_dir.is_dir():
        raise ConfigError(f"index path exists and is not a folder: {shown_path(index_dir)}")
    ours = _our_manifest(index_dir / MANIFEST)
    if ours is not None:
        if _is_newer(newer := ours.get("format_version")):  # a rebuild would replace what a newer release reads
            raise ConfigError(_newer_format(index_dir, newer, advice))
        return
    foreign = sorted(c.name for c in index_dir.iterdir() if not _is_our_leftover(c))
    if foreign == [MANIFEST] and _our_manifest(index_dir / MANIFEST) is not None:
        return  # a build (holding the lock, which we check before) published between the two looks
    manifest = index_dir / MANIFEST
    if foreign == [MANIFEST] and manifest.is_file() and not manifest.is_symlink() and holds_our_data(index_dir):
        return  # our index, its manifest damaged (garbled, emptied): the build replaces it, re-embedding all
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        refusing = f"refusing to write an index into {shown_path(index_dir)}: " if writing else ""
        raise ConfigError(
            f"{refusing}it is not empty ({quoted_path(foreign[0])}{more}) and is not a rag_lookahead index"
            f" (no {MANIFEST} of ours); {advice}"
        )


@contextlib.contextmanager
def writer_lock(index_dir: Path, timeout: float) -> Iterator[bool]:
    """Hold the index folder's lock: one build at a time writes here; others wait up to ``timeout`` s.

    Yields whether it had to wait (another build ran meanwhile, and the files may have changed)."""
    with exclusive(
        index_dir / LOCK_FILE,
        timeout,
        on_wait=lambda: log.warning(
            "another `rag_lookahead index` run is writing %s; waiting up to %g s", index_dir, timeout
        ),
        on_timeout=lambda: IndexBusyError(
            f"another `rag_lookahead index` run is still writing {shown_path(index_dir)} after {timeout:g} s;"
            f" try again when it ends, or wait longer with --lock-timeout"
        ),
    ) as waited:
        yield waited


def _empty_our_data_dir(path: Path) -> None:
    """Remove a data folder of ours: our files by name, then ``rmdir``, which leaves anything else alone."""
    for name in (*DATA_FILES, DATA_MARK):
        with contextlib.suppress(FileNotFoundError):
            (path / name).unlink()
    try:
        path.rmdir()
    except OSError as e:
        log.warning("left %s in place: %s", path, e.strerror or e)


@dataclass(frozen=True)
class _Published:
    """What the manifest about to be replaced says is ours: its data folder (version 2), or the
    sha256s of its data files in the index folder itself (version 1)."""

    data: str | None = None
    top_level: dict[str, str] = field(default_factory=dict)


def _published(index_dir: Path) -> _Published:
    manifest = _our_manifest(index_dir / MANIFEST)
    if manifest is None:
        return _Published()
    name, artifacts = manifest.get("data"), manifest.get("artifacts")
    if manifest.get("format_version") == 1 and isinstance(artifacts, dict):
        return _Published(top_level={k: v for k, v in artifacts.items() if k in DATA_FILES and isinstance(v, str)})
    return _Published(data=name if isinstance(name, str) and DATA_NAME.fullmatch(name) else None)


def remove_leftovers(index_dir: Path, current: str) -> None:
    """Drop what interrupted builds left (their data folders of ours, temp manifests) beside the
    published ``current``, which stays. Call with the lock held, in a folder whose manifest is ours."""
    _remove_old_versions(index_dir, current, _Published())


def _remove_old_versions(index_dir: Path, current: str, replaced: _Published) -> None:
    """After publishing ``current``: drop the data it ``replaced`` (our files in it, by name), data
    folders of ours left by interrupted builds, the version-1 data files the replaced manifest
    vouches for, and temp manifests. Call with the lock held, in a folder whose manifest is ours."""
    try:
        children = list(index_dir.iterdir())
    except OSError as e:  # published already: a folder that cannot be listed keeps its old data, said
        log.warning("left old data in %s in place: %s", index_dir, e.strerror or e)
        children = []
    for child in children:
        if child.name == current or os.path.islink(child):
            continue
        try:
            _remove_if_old(child, replaced)
        except OSError as e:  # the new version is published: what could not go stays, said, until a later run
            log.warning("left %s in place: %s", child, e.strerror or e)
    try:
        fsync_dir(index_dir)
    except OSError as e:
        log.warning("could not sync %s after removing old data: %s", index_dir, e.strerror or e)


def _remove_if_old(child: Path, replaced: _Published) -> None:
    if MANIFEST_TMP.fullmatch(child.name) and child.is_file():
        child.unlink()
    elif child.name in replaced.top_level and child.is_file():
        if file_sha256(child) == replaced.top_level[child.name]:
            child.unlink()
        else:
            log.warning("left %s in place: it is not the file the old manifest recorded", child)
    elif (child.name == replaced.data and child.is_dir()) or _is_our_data_dir(child):
        _empty_our_data_dir(child)


def _write_docstore(path: Path, records: list[dict]) -> str:
    """Stream the docstore to disk (never the whole file in memory) and return its sha256."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for r in records:
            line = (
                json.dumps(
                    {k: r[k] for k in ("id", "chunk_id", "source", "file_sha256", "heading", "text") if k in r},
                    ensure_ascii=False,
                )
                + "\n"
            ).encode("utf-8")
            h.update(line)
            f.write(line)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def write_data(data_dir: Path, fidx: Any, records: list[dict]) -> dict[str, str]:
    """Write one data version, durably; returns the artifacts' sha256s for the manifest."""
    import faiss

    # serialized by faiss, written by Python. faiss.write_index only prints an error of its final
    # fclose ("close error: No space left on device") and returns: a cut-off index.faiss was hashed and
    # published, and the old version removed. It raised RuntimeError (a traceback) for an error of an
    # earlier fwrite, and TypeError for a folder whose name is not UTF-8. Here each is an OSError.
    data = faiss.serialize_index(fidx).tobytes()
    with naming_failed_write(data_dir / FAISS_FILE), open(data_dir / FAISS_FILE, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    with naming_failed_write(data_dir / DOCSTORE):
        artifacts = {
            FAISS_FILE: hashlib.sha256(data).hexdigest(),
            DOCSTORE: _write_docstore(data_dir / DOCSTORE, records),
        }
    fsync_dir(data_dir)
    return artifacts


def check_writable(index_dir: Path) -> None:
    """Refuse (:class:`ConfigError`) an existing index folder this process cannot write, before the
    slow work: a read-only folder was found only when the new version was written, after every
    changed chunk had been embedded, in an error naming a temporary folder. Probed by making (and
    removing) an empty data folder, as the write would: permission bits, ACLs, read-only mounts
    and immutable flags all answer alike. An empty ``data-`` folder is a leftover we clean."""
    if index_dir.is_dir():  # else made by this build
        os.rmdir(_new_data_dir(index_dir))


def _new_data_dir(index_dir: Path) -> Path:
    """A new, empty data folder in ``index_dir``; a folder that cannot take one is refused, named."""
    try:
        return Path(tempfile.mkdtemp(prefix=DATA_PREFIX, dir=index_dir))
    except OSError as e:
        raise ConfigError(f"cannot write the index at {shown_path(index_dir)}: {e.strerror or e}") from None


def publish(index_dir: Path, manifest: dict) -> None:
    """The one step that switches readers to the new version: an atomic replace of ``manifest.json``."""
    with naming_failed_write(index_dir / MANIFEST):
        write_json_atomic(index_dir / MANIFEST, manifest, private=True)


def publish_version(
    index_dir: Path, faiss_index: Any, records: list[dict], manifest_for: Callable[[str, dict[str, str]], dict]
) -> None:
    """Write a new data version, publish it, then remove the versions it replaced. Call with the lock held.

    ``manifest_for(data_name, artifacts)`` gives the manifest that names the new data. A failure
    before publishing removes the new data folder (made by this call, never published)."""
    replaced = _published(index_dir)
    data_dir = _new_data_dir(index_dir)
    try:
        (data_dir / DATA_MARK).write_bytes(b"")  # first: from here on the folder says it is ours
        artifacts = write_data(data_dir, faiss_index, records)
        publish(index_dir, manifest_for(data_dir.name, artifacts))
    except BaseException:
        # an interrupt can land after the manifest's rename, in write_json_atomic's fsync of the folder:
        # the new data is then the published index, and removing it left a manifest naming nothing
        if (_our_manifest(index_dir / MANIFEST) or {}).get("data") != data_dir.name:
            shutil.rmtree(data_dir, ignore_errors=True)
        raise
    _remove_old_versions(index_dir, data_dir.name, replaced)


def manifest_files(index_dir: Path) -> list[str]:
    raw = _manifest_file(index_dir / MANIFEST)
    try:
        files = json.loads(raw.decode("utf-8")).get("files", {}) if isinstance(raw, bytes) else {}
        return list(files) if isinstance(files, dict) else []
    except (ValueError, AttributeError, RecursionError):
        return []
