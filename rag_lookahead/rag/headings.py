"""The Markdown headings a chunk lies under, searched with the chunk.

Why: a chunk of a Markdown file is often the body of a section whose subject is named only in
its heading. "## budget" followed by a list of the option's values holds the word "budget" once;
the section before it, about another option, mentions "the automatic budget" twice and outranked
it for "What does the budget option do?". So each chunk is searched (by BM25 and by the dense
model) with the path of headings in force where it starts ("Tuning the decoder > budget"), the
way a reader sees it in the document. The text the model is shown stays the chunk itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["MARKDOWN_SUFFIXES", "heading_paths", "searched_text"]

MARKDOWN_SUFFIXES = (".md", ".markdown")

_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")


def heading_paths(text: str, chunks: Sequence[str]) -> list[str]:
    """Per chunk (in the order the splitter cut them from ``text``), the headings in force at its
    start, outermost first, joined by " > " ("" where none is). Lines in fenced code are no headings."""
    starts, cursor = [], 0
    for chunk in chunks:  # chunks overlap: each one starts after the previous one's start
        at = text.find(chunk, cursor)
        starts.append(cursor if at < 0 else at)
        cursor = starts[-1] + 1
    paths, stack, fenced, offset = [], [], False, 0
    lines = text.splitlines(keepends=True)
    line = 0
    for start in starts:
        while line < len(lines) and offset + len(lines[line].rstrip("\r\n")) < start:  # lines ending before it
            fenced, stack = _read_line(lines[line], fenced, stack)
            offset += len(lines[line])
            line += 1
        if line < len(lines) and offset <= start:  # the chunk starts on this line: a heading there is its own
            _, with_line = _read_line(lines[line], fenced, stack)
            paths.append(" > ".join(title for _, title in with_line))
        else:
            paths.append(" > ".join(title for _, title in stack))
    return paths


def _read_line(line: str, fenced: bool, stack: list[tuple[int, str]]) -> tuple[bool, list[tuple[int, str]]]:
    """The fence state and heading stack after ``line``."""
    if _FENCE.match(line):
        return not fenced, stack
    match = None if fenced else _HEADING.match(line.rstrip("\r\n"))
    if match is None:
        return fenced, stack
    level = len(match.group(1))
    return fenced, [*(h for h in stack if h[0] < level), (level, match.group(2))]


def searched_text(record: dict) -> str:
    """What search reads of a stored chunk: its heading path, then its text."""
    heading = record.get("heading")
    return f"{heading}\n{record['text']}" if heading else record["text"]
