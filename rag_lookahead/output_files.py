"""Output paths a user names (a benchmark's report and charts, a pipeline's answers): checked
before the run, and never a file the run did not write.

A rerun replaces its own earlier output, so each kind of output says how it knows its own files
(``ours``): a benchmark report carries :data:`REPORT_MARK`, its charts name us as their PNG
``Software``. Anything else already at the path (a user's notes, the run's own prompts file, a
symlink to elsewhere) is refused in one line before any model loads, not overwritten after it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from types import EllipsisType
from typing import Any

from rag_lookahead.atomic import json_text, naming_failed_write, write_bytes_atomic, write_text_atomic
from rag_lookahead.errors import ConfigError, RagLookaheadError, quoted_path
from rag_lookahead.paths import expand_user
from rag_lookahead.progress import status_line

__all__ = [
    "REPORT_MARK",
    "FileState",
    "PathTaken",
    "check_output_file",
    "is_chart",
    "is_chart_of",
    "is_report",
    "output_target",
    "replaceable",
    "save_chart",
    "save_or_print",
    "save_report",
]

#: the key and value every benchmark report carries, so a rerun may replace it
REPORT_MARK = ("written_by", "rag_lookahead.bench")
#: the PNG ``Software`` text of our charts
CHART_SOFTWARE = "rag_lookahead.bench"
#: an existing file above this size is never read to see whether it is ours (it is not)
MOST_BYTES_READ = 64 * 1024 * 1024


class PathTaken(ConfigError):
    """An output's path holds a file this command did not write (``path``): callers that already
    wrote something say so instead of "nothing was changed"."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


def check_output_file(
    path: str | Path, option: str, *, ours: Callable[[Path], bool], inputs: Iterable[str | Path | None] = ()
) -> FileState:
    """Refuse ``path`` for an output unless it can be written and replaces nothing but our own file:
    its folder must exist, it must not be a folder, not one of the run's ``inputs``, and a file
    already there must be one that ``ours`` recognises (a symlink never is). Returns what was there
    (for :func:`output_target`'s ``seen``). A blank ``path`` is refused (it read as ".": "is a folder");
    a ``~`` is the home folder, as in ``--index-dir`` (the shell leaves it in ``--json=~/r.json``)."""
    target = expand_user(path, option)
    # Path() drops a final "/": "results/" made a file named "results"
    if target.is_dir() or str(path).endswith(("/", os.sep)):
        raise ConfigError(f"{option} {quoted_path(path)} is a folder; give a file path")
    folder = target.parent
    if not folder.is_dir():
        reason = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{option} {quoted_path(path)}: its folder {quoted_path(folder)} {reason}")
    _check_writable(folder, option, path, target.name)
    for source in inputs:
        if source is not None and _same_file(target, Path(os.path.expanduser(source))):
            raise ConfigError(
                f"{option} {quoted_path(path)} is this run's input {quoted_path(source)}; give another path"
            )
    if not replaceable(target, ours):
        raise PathTaken(
            f"{option} {quoted_path(path)} exists and this command did not write it; "
            "remove it or give another path (nothing was changed)",
            target,
        )
    return file_state(target)


#: (device, inode, size, modification time) of what is at a path, None when nothing is
FileState = tuple[int, int, int, int] | None


def file_state(path: Path) -> FileState:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _check_writable(folder: Path, option: str, path: str | Path, name: str) -> None:
    """A file of our own made and removed in ``folder``, named as long as the temporary file the
    save may write first (``.NAME.XXXXXXXX``, or ``.STEM.NN.SUFFIX.XXXXXXXX`` when it writes beside
    a file that came during the run): a folder the run cannot write (read-only, /proc), or a name a
    few bytes short of the limit, is said now, not after the whole run (all was lost)."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{name}.NN.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"{option} {quoted_path(path)}: cannot write in its folder {quoted_path(folder)} ({e.strerror or e})"
        ) from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.absolute() == b.absolute()


def _head(path: Path) -> bytes | None:
    """The file's bytes, or None when it cannot be read or is larger than any output of ours."""
    try:
        if path.stat().st_size > MOST_BYTES_READ:
            return None
        return path.read_bytes()
    except OSError:
        return None


def is_report(path: Path) -> bool:
    """Whether ``path`` is a benchmark report (a JSON object carrying :data:`REPORT_MARK`)."""
    data = _head(path)
    try:
        report = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):  # a user's file nested past Python's limit: a traceback
        return False
    key, value = REPORT_MARK
    return isinstance(report, dict) and report.get(key) == value


def save_report(
    path: str | Path,
    report: dict[str, Any],
    charts: Companions = lambda _: (),
    seen: FileState | EllipsisType = ...,
) -> Path:
    """Write ``report`` atomically, marked as ours (the mark is added to ``report`` too); returns
    where it went.

    The path was checked before the run, but a run lasts long enough for something else to take
    it meanwhile (a user's file, a symlink, another run's report): then the report goes beside it
    (:func:`output_target`). ``seen``: what :func:`check_output_file` found at the path before the
    run (without it, another run's report written meanwhile was replaced, unsaid). ``charts``: the
    paths of the charts the run will draw beside a report at a given path."""
    key, value = REPORT_MARK
    report[key] = value
    target = output_target(path, is_report, seen, charts)
    save_or_print(target, json_text(report), "the report")
    return target


def save_or_print(path: Path, text: str, what: str) -> None:
    """Write ``text`` to ``path`` atomically; where that fails (a full disk, a quota), print it on
    stdout instead and raise one :class:`RagLookaheadError` naming the file and where ``what`` went.
    Why: the output of a long run (a benchmark's report, a pipeline's answers) was lost to a
    traceback, or to "[Errno 28] No space left on device" naming no file."""
    try:
        with naming_failed_write(path):
            write_text_atomic(path, text)
    except OSError as e:
        why = e.strerror or str(e)  # "cannot write PATH: No space left on device"
        status_line(f"{why}: printing {what} on stdout instead")  # stderr on the same full disk: before the report
        kept = f"{what} went to stdout instead" if _printed(text) else f"stdout could not take {what} either: lost"
        raise RagLookaheadError(f"{why}; {kept}") from None


def _printed(text: str) -> bool:
    """Whether ``text`` reached stdout, in UTF-8 as the file would have held it (through a Latin-1
    locale's stdout a report's Chinese text failed, and was said lost). A benchmark's stdout
    (``bench.common``'s watched one) keeps its first failure in ``error`` rather than raising."""
    out = sys.stdout
    if out is None:  # started with stdout closed
        return False
    try:
        out.flush()  # what was printed before comes first
        if getattr(out, "error", None) is not None:
            return False
        binary = getattr(out, "buffer", None)
        if binary is not None:
            binary.write(text.encode("utf-8"))
            binary.flush()
        else:  # a text-only stream (a test's StringIO)
            out.write(text)
            out.flush()
    except (OSError, ValueError):  # ValueError: a closed file
        from rag_lookahead.ask import silence_stdout

        silence_stdout()  # Python's flush at exit would fail on the same stdout
        return False
    return getattr(out, "error", None) is None


#: the paths of the charts that go with an output at a given path
Companions = Callable[[Path], Iterable[Path]]


def output_target(
    path: str | Path,
    ours: Callable[[Path], bool],
    seen: FileState | EllipsisType = ...,
    charts: Companions = lambda _: (),
) -> Path:
    """Where to write, at the end of a run, an output :func:`check_output_file` passed before it:
    ``path`` while it holds nothing or a file ``ours`` recognises, else a free name beside it
    (``run.json`` -> ``run.1.json``), said on stderr. Something that took the path during the run
    is left as it is, and the run's results are kept too. ``seen``: what the check found there;
    anything else there now was written during the run, another run's output of ours too (it was
    replaced, unsaid, when two runs wrote the same answers file). ``charts``: the output's charts
    (see :func:`save_report`), which must be free or ours at the name taken, so that they follow
    the report whole: a free name's charts were never checked before the run; a chart of another
    report whose name shares the stem is not free (:func:`is_chart_of`). A ``~`` is the home folder
    (see :func:`check_output_file`)."""
    target = expand_user(path, "the output path")
    drawn_for_target = functools.partial(is_chart_of, report_path=target)  # not another report's: same names
    taken = next((chart for chart in charts(target) if not replaceable(chart, drawn_for_target)), None)
    if not replaceable(target, ours) or (seen is not ... and file_state(target) not in (seen, None)):
        taken = target
    if taken is None:
        return target
    free = free_name(target, charts)
    status_line(f"{taken} appeared or changed during the run, not by this command: writing {free} instead")
    return free


def replaceable(path: Path, ours: Callable[[Path], bool]) -> bool:
    """Whether an output may go to ``path``: nothing is there, or a regular file ``ours`` recognises."""
    return not path.is_symlink() and (not path.exists() or (path.is_file() and ours(path)))


def free_name(path: Path, charts: Companions = lambda _: ()) -> Path:
    """``bench.json`` -> the first of ``bench.1.json``, ``bench.2.json``, ... that nothing holds,
    nor the paths of its ``charts``."""
    n = 1
    while True:
        candidate = path.with_name(f"{path.stem}.{n}{path.suffix}")
        if all(not p.is_symlink() and not p.exists() for p in (candidate, *charts(candidate))):
            return candidate
        n += 1


def is_chart(path: Path) -> bool:
    """Whether ``path`` is a PNG chart we drew (its ``Software`` text chunk names us)."""
    return _marked_chart(_head(path))


def _marked_chart(data: bytes | None) -> bool:
    return data is not None and data.startswith(b"\x89PNG") and b"Software\x00" + CHART_SOFTWARE.encode() in data


def chart_owner(report_path: str | Path) -> str:
    """The mark a chart carries of the report it was drawn for (a hash of the report's file name:
    PNG text is Latin-1). Reports whose names differ after the last dot (``bench.h100``,
    ``bench.a100``) share chart names, and a chart of ours is removed beside a report only when
    it was drawn for that report."""
    return hashlib.sha256(Path(report_path).name.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def is_chart_of(path: Path, report_path: str | Path) -> bool:
    """Whether ``path`` is a chart we drew for the report at ``report_path`` (one drawn before charts
    named their report, with no ``Source`` text, counts as the report's beside it)."""
    data = _head(path)  # read once
    if not _marked_chart(data):
        return False
    return b"Source\x00" not in data or b"Source\x00" + chart_owner(report_path).encode() in data


def save_chart(figure, path: Path, report_path: str | Path) -> Path:
    """Draw a matplotlib ``figure`` as a PNG at ``path``, atomically, marked as ours and as drawn for
    the report at ``report_path`` (:func:`chart_owner`). Characters
    the font lacks (Chinese prompt ids in the default DejaVu Sans) are said in one line naming the
    labels drawn with boxes: matplotlib warned twice per character, dozens of lines a chart."""
    buffer = io.BytesIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metadata = {"Software": CHART_SOFTWARE, "Source": chart_owner(report_path)}
        figure.savefig(buffer, format="png", dpi=110, metadata=metadata)
    missing: set[str] = set()
    for warning in caught:
        glyph = _MISSING_GLYPH.search(str(warning.message))
        if glyph is not None:
            missing.add(chr(int(glyph[1])))
        else:  # any other warning goes on as it came
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if missing:
        _say_missing_glyphs(figure, path, missing)
    with naming_failed_write(path):
        write_bytes_atomic(path, buffer.getvalue())
    return path


_MISSING_GLYPH = re.compile(r"^Glyph (\d+) .*missing from (current )?font")  # 3.8 said "current font"
#: labels named in the missing-glyph line, the rest counted
_LABELS_NAMED = 5


def _say_missing_glyphs(figure, path: Path, missing: set[str]) -> None:
    from matplotlib.text import Text

    texts = (text.get_text() for text in figure.findobj(Text))
    labels = list(dict.fromkeys(text for text in texts if missing.intersection(text)))
    named = ", ".join(repr(label) for label in labels[:_LABELS_NAMED])
    more = f" and {len(labels) - _LABELS_NAMED} more" if len(labels) > _LABELS_NAMED else ""
    status_line(
        f"{path}: the chart's font has no glyphs for {len(missing)} characters; these labels show boxes: {named}{more}"
    )
