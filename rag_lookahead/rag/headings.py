"""The Markdown headings a chunk lies under, searched with the chunk.

Why: a chunk of a Markdown file is often the body of a section whose subject is named only in
its heading. "## budget" followed by a list of the option's values holds the word "budget" once;
the section before it, about another option, mentions "the automatic budget" twice and outranked
it for "What does the budget option do?". So each chunk is searched (by BM25 and by the dense
model) with the path of headings in force where it starts ("Tuning the decoder > budget"), the
way a reader sees it in the document. The text the model is shown stays the chunk itself.

The reading is CommonMark's where it matters here (ATX headings; fenced code, HTML comments and
front matter hold none) and linear in the file: each line is read once, with no regular
expression that could backtrack over a long line, and a title is cut to ``MAX_TITLE`` characters
(a 20 MB one-line file once became the heading of every one of its chunks).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence

__all__ = ["MARKDOWN_SUFFIXES", "MAX_TITLE", "heading_paths", "searched_text"]

MARKDOWN_SUFFIXES = (".md", ".markdown")
MAX_TITLE = 200  # characters of one heading kept in a path

_LINE_END = re.compile(r"\r\n|\r|\n")  # CommonMark's line endings (an old Mac file ends lines with CR only)
_FRONT_MATTER = {"---": ("---", "..."), "+++": ("+++",)}  # YAML and TOML: opening line -> closing lines

Stack = tuple[tuple[int, str], ...]


def heading_paths(text: str, starts: Sequence[int]) -> list[str]:
    """Per chunk, given where each starts in ``text``, the ATX headings ("## title") in force
    there, outermost first, joined by " > " ("" where none is): those of the lines before the
    chunk's start and of the line it starts on."""
    line_starts, stacks = _read(text)
    joined: dict[int, str] = {}
    paths = []
    for start in starts:
        stack = stacks[max(bisect.bisect_right(line_starts, start) - 1, 0)]
        if id(stack) not in joined:  # stacks change only at headings: lines share them
            joined[id(stack)] = " > ".join(title for _, title in stack if title)
        paths.append(joined[id(stack)])
    return paths


def _read(text: str) -> tuple[list[int], list[Stack]]:
    """Where each line starts, and the headings in force after it (the line included)."""
    lines, line_starts, offset = [], [], 0
    for end in _LINE_END.finditer(text):
        line_starts.append(offset)
        lines.append(text[offset : end.start()])
        offset = end.end()
    line_starts.append(offset)
    lines.append(text[offset:])
    stacks: list[Stack] = []
    stack: Stack = ()
    skip_to = _front_matter_end(lines)  # lines before it are front matter
    fence: str | None = None  # the open fence's run of ` or ~
    comment = False
    for number, line in enumerate(lines):
        if number < skip_to:
            pass
        elif fence is not None:
            fence = None if _closes(line, fence) else fence
        elif comment:
            comment = "-->" not in line
        elif (opened := _fence(line)) is not None:
            fence = opened
        elif _indent(line) <= 3 and line.startswith("<!--", _indent(line)):  # an HTML block comment
            comment = "-->" not in line.split("<!--", 1)[1]
        elif (heading := _heading(line)) is not None:
            level = heading[0]
            stack = (*(h for h in stack if h[0] < level), heading)
        stacks.append(stack)
    return line_starts, stacks


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _front_matter_end(lines: list[str]) -> int:
    """The number of lines a front matter block at the top takes (0: none; one never closed is none)."""
    closing = _FRONT_MATTER.get(lines[0].rstrip()) if lines else None
    if closing is None:
        return 0
    for number in range(1, len(lines)):
        if lines[number].rstrip() in closing:
            return number + 1
    return 0


def _fence(line: str) -> str | None:
    """The run of backticks or tildes that opens a code fence on ``line``; None if it opens none."""
    indent = _indent(line)
    if indent > 3:
        return None
    rest = line[indent:]
    char = rest[:1]
    if char not in ("`", "~"):
        return None
    run = len(rest) - len(rest.lstrip(char))
    if run < 3 or (char == "`" and "`" in rest[run:]):  # a backtick fence's info string holds no backtick
        return None
    return rest[:run]


def _closes(line: str, fence: str) -> bool:
    """Whether ``line`` closes the fence ``fence``: at most 3 spaces, then a run of its character
    at least as long, then only spaces."""
    if _indent(line) > 3:
        return False
    body = line.strip(" \t")
    return len(body) >= len(fence) and body == fence[0] * len(body)


def _heading(line: str) -> tuple[int, str] | None:
    """``(level, title)`` of an ATX heading line (``## title ##``); None for any other line."""
    indent = _indent(line)
    if indent > 3:
        return None
    rest = line[indent:]
    level = len(rest) - len(rest.lstrip("#"))
    if not 1 <= level <= 6 or (len(rest) > level and rest[level] not in " \t"):
        return None
    title = rest[level:].strip(" \t")
    bare = title.rstrip("#")
    if not bare:  # "##" or "## ##": an empty heading
        title = ""
    elif bare != title and bare[-1] in " \t":  # a closing run of "#" after a space
        title = bare.rstrip(" \t")
    return level, title[:MAX_TITLE].rstrip(" \t")


def searched_text(record: dict) -> str:
    """What search reads of a stored chunk: its heading path, then its text."""
    heading = record.get("heading")
    return f"{heading}\n{record['text']}" if heading else record["text"]
