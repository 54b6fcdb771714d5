"""The heading path each Markdown chunk is searched under (``rag/headings.py``)."""

from __future__ import annotations

from pathlib import Path

from rag_lookahead.rag.build import IndexReport, _plan, make_splitter
from rag_lookahead.rag.headings import heading_paths, searched_text

DOC = """# Tuning

Intro text.

## decoding_length

The maximum number of draft nodes.

```bash
# not a heading: a shell comment in a fence
echo hi
```

### On a CPU ###

Fewer nodes.

## budget

- "auto": measured.
"""


def _split(text: str, size: int, overlap: int) -> tuple[list[str], list[int]]:
    """The index's chunks of ``text`` and where each starts."""
    documents = make_splitter(size, overlap).create_documents([text])
    return [d.page_content for d in documents], [d.metadata["start_index"] for d in documents]


def _path_of(chunks, paths, needle):
    return next(p for c, p in zip(chunks, paths) if needle in c)


def test_each_chunk_gets_the_headings_in_force_where_it_starts():
    chunks, starts = _split(DOC, 40, 10)
    paths = heading_paths(DOC, starts)
    assert len(paths) == len(chunks) and paths[0] == "Tuning"
    assert _path_of(chunks, paths, "maximum number") == "Tuning > decoding_length"
    assert _path_of(chunks, paths, "echo hi") == "Tuning > decoding_length"  # the fenced "#" line is code
    assert _path_of(chunks, paths, "Fewer nodes") == "Tuning > decoding_length > On a CPU"  # closing #s dropped
    assert _path_of(chunks, paths, '"auto"') == "Tuning > budget"  # a level-2 heading closes the level 3


def test_text_without_headings_has_none_and_is_searched_as_it_is():
    _, starts = _split("plain text, no headings at all. " * 4, 30, 5)
    assert set(heading_paths("plain text, no headings at all. " * 4, starts)) == {""}
    assert searched_text({"text": "body"}) == "body"
    assert searched_text({"text": "body", "heading": "A > B"}) == "A > B\nbody"


def _expected_at(text: str, start: int) -> str:
    """The heading path at ``start`` read independently: every "#" line before the end of its line."""
    stack: list[tuple[int, str]] = []
    offset = 0
    for line in text.split("\n"):
        if offset > start:
            break
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            stack = [*(h for h in stack if h[0] < level), (level, line[level:].strip())]
        offset += len(line) + 1
    return " > ".join(t for _, t in stack)


def test_a_chunk_whose_text_occurs_earlier_gets_its_own_place():
    """A changelog repeats "- Bug fixes." under every version: the chunk under 2.0 was found at
    the copy inside the previous chunk and labelled 2.1."""
    text = "# Changelog\n\n" + "".join(f"## {v}\n\n- Bug fixes.\n- Faster.\n\n" for v in ("2.1", "2.0", "1.9", "1.8"))
    chunks, starts = _split(text, 30, 10)
    assert len(set(chunks)) < len(chunks)  # the same text several times
    expected = [_expected_at(text, s) for s in starts]
    # as the index splits a Markdown file: each chunk's heading from where the splitter cut it
    plan, _ = _plan({"changes.md": ("sha", text)}, {}, make_splitter(30, 10), IndexReport(Path("i"), "e"))
    assert [r["text"] for r in plan[0][1]] == chunks
    assert [r.get("heading", "") for r in plan[0][1]] == expected


def test_fences_comments_and_front_matter_hold_no_headings():
    text = (
        "---\n# a: yaml comment\n---\n# Doc\n\n````md\n```\n# shown code\n```\n````\n\n"
        "<!--\n# commented out\n-->\n\nbody ~~~\n~~~\n# in tildes\n~~~\n\n## Real\n\ntext \x0c# not a line start\n"
    )
    chunks = [line for line in text.split("\n") if line.strip()]
    starts, cursor = [], 0
    for chunk in chunks:  # one chunk a line
        starts.append(text.index(chunk, cursor))
        cursor = starts[-1] + len(chunk)
    paths = heading_paths(text, starts)
    assert paths[chunks.index("# shown code")] == "Doc"
    assert paths[chunks.index("# commented out")] == "Doc"
    assert paths[chunks.index("# in tildes")] == "Doc"
    assert paths[-1] == "Doc > Real" and paths[chunks.index("# a: yaml comment")] == ""
