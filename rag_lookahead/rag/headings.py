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
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def heading_paths(text: str, starts: Sequence[int]) -> list[str]:
    """Per chunk, given where each starts in ``text`` (in order: the splitter's ``start_index``),
    the ATX headings ("## title") in force there, outermost first, joined by " > " ("" where none
    is). Lines in fenced code, in HTML comments and in a front matter block are no headings; lines
    end at "\n" only, as Markdown's do."""
    reader = _Reader()
    paths: list[str] = []
    lines = text.split("\n")
    line, offset = 0, 0
    for start in starts:
        while line < len(lines) and offset + len(lines[line].rstrip("\r")) < start:  # lines ending before it
            reader.read(lines[line], first=line == 0)
            offset += len(lines[line]) + 1
            line += 1
        stack = reader.stack
        if line < len(lines) and offset <= start:  # the chunk starts on this line: a heading there is its own
            stack = reader.peek(lines[line], first=line == 0)
        paths.append(" > ".join(title for _, title in stack))
    return paths


class _Reader:
    """Markdown read line by line: the headings in force, and whether a line is code, a comment
    or front matter (none of which holds headings)."""

    def __init__(self) -> None:
        self.stack: list[tuple[int, str]] = []
        self.fence: str | None = None  # the open fence's run of ` or ~
        self.comment = False
        self.front_matter = False

    def read(self, line: str, first: bool = False) -> None:
        self.stack = self._after(line.rstrip("\r"), first, apply=True)

    def peek(self, line: str, first: bool = False) -> list[tuple[int, str]]:
        return self._after(line.rstrip("\r"), first, apply=False)

    def _after(self, line: str, first: bool, apply: bool) -> list[tuple[int, str]]:
        fence, comment, front = self.fence, self.comment, self.front_matter
        heading = None
        if first and line.strip() == "---":
            front = True
        elif front:
            front = line.strip() not in ("---", "...")
        elif fence is not None:
            stripped = line.strip()
            if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
                fence = None
        elif comment:
            comment = "-->" not in line
        elif (match := _FENCE.match(line)) is not None:
            fence = match.group(1)
        elif "<!--" in line and "-->" not in line.split("<!--", 1)[1]:
            comment = True
        else:
            heading = _HEADING.match(line)
        stack = self.stack
        if heading is not None:
            level = len(heading.group(1))
            stack = [*(h for h in stack if h[0] < level), (level, heading.group(2))]
        if apply:
            self.fence, self.comment, self.front_matter = fence, comment, front
        return stack


def searched_text(record: dict) -> str:
    """What search reads of a stored chunk: its heading path, then its text."""
    heading = record.get("heading")
    return f"{heading}\n{record['text']}" if heading else record["text"]
