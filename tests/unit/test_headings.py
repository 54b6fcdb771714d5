"""The heading path each Markdown chunk is searched under (``rag/headings.py``)."""

from __future__ import annotations

from pathlib import Path

from rag_lookahead.rag.build import IndexReport, _plan, chunk_starts, make_splitter
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
    splitter = make_splitter(size, overlap)
    chunks = [c for c in splitter.split_text(text) if c.strip()]
    return chunks, chunk_starts(splitter, text, chunks)


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


def _path_of_line(text: str, marker: str) -> str:
    """The heading path of a chunk starting at the line that begins with ``marker``."""
    return heading_paths(text, [text.index(marker)])[0]


def test_lines_end_as_commonmark_ends_them():
    """CR-only line endings (an old Mac file) made the whole file one "# ..." line: that line
    became the heading of every chunk, 20,227 characters each, and all vectors alike."""
    for newline in ("\n", "\r\n", "\r"):
        text = newline.join(["# A", "", "## B", "", "MARK", "", "# C", "", "END"])
        assert _path_of_line(text, "MARK") == "A > B" and _path_of_line(text, "END") == "C"


def test_a_heading_is_read_in_linear_time_and_cut():
    """A heading line of 60,000 spaces took 13 s in a backtracking pattern; any title is cut."""
    from rag_lookahead.rag.headings import MAX_TITLE

    assert heading_paths("# a" + " " * 60_000 + "x\nMARK", [60_005]) == ["a"]
    long = "# " + "word " * 10_000 + "\nMARK"
    path = heading_paths(long, [long.index("MARK")])[0]
    assert path.startswith("word word") and len(path) <= MAX_TITLE


def test_commonmark_blocks_that_hold_no_headings_and_lines_that_are_not_them():
    """Each case guards one CommonMark rule the reader keeps: a fence closed by a longer run (else
    every heading after it is lost), a fence's three characters at least, the six heading levels, a
    comment opener's 3-space indent, YAML front matter's two closing lines, a closing run of "#"."""
    cases = {
        "Write `<!--` to start a comment.\n\n## B\n\nMARK": "A > B",  # a comment starts a line, not mid-line
        "``` `code` ``` inline\n\n## B\n\nMARK": "A > B",  # a backtick fence's info holds no backtick
        "```\n    ```\n## in code\n```\n\n## B\n\nMARK": "A > B",  # a closing fence is indented 3 spaces at most
        "## B\n\n#\n\nMARK": "",  # an empty level-1 heading closes A
        "````\ncode\n`````\n## After\n\nMARK": "A > After",  # a longer run closes a fence too
        "####### seven\n\nMARK": "A",  # seven #s are a paragraph: headings go to level 6
        "    <!-- x\n## Sub\n\nMARK": "A > Sub",  # a comment opener indented 4 spaces is code, no comment
        "   <!--\n## hidden\n-->\n\nMARK": "A",  # ... and one indented 3 spaces opens a comment
        "``\n## Two\n\nMARK": "A > Two",  # two backticks open no fence: a fence takes three
    }
    for body, expected in cases.items():
        text = "# A\n\n" + body
        assert _path_of_line(text, "MARK") == expected, body
    assert _path_of_line("---\n\n# A\n\nMARK", "MARK") == "A"  # a rule never closed is no front matter
    assert _path_of_line("+++\n# key = 1\n+++\n# A\n\nMARK", "MARK") == "A"  # TOML front matter
    # YAML front matter may close with "..." as well as "---": its "#" comment is no heading
    assert _path_of_line("---\n# a YAML comment\ntitle: x\n...\n\nMARK", "MARK") == ""
    # a closing run of "#" follows a space: the "#" that ends a word is the title's
    assert _path_of_line("# Learn C#\n\nMARK", "MARK") == "Learn C#"
    assert _path_of_line("# Learn C# #\n\nMARK", "MARK") == "Learn C#"


def test_chunk_starts_are_where_the_splitter_cut():
    """langchain's start_index put a chunk that follows "### Example" at an earlier copy of its
    text, above the heading, and it was searched under "Intro" instead of "Intro > Example". The
    places are checked against a copy of each text whose other characters Python's generator
    draws (the splitter cuts it where it cut the text, and its chunks are unique)."""
    import random

    intro = "here intro words some " * 12
    text = "# Intro\n\n" + intro + "\n\n" + "\n\n".join(["x" * 38 + "\n### Example"] * 10) + "\n\n" + "x" * 38
    chunks, starts = _split(text, 400, 50)
    assert all(text[s : s + len(c)] == c for s, c in zip(starts, chunks))
    assert heading_paths(text, starts)[1] == "Intro > Example"
    rng = random.Random(0)
    pieces = ["note this.", "see above", "x " * 20, "done.", "x" * 38, "a a a a a a a", "## H1", "# H2"]
    for trial in range(300):
        text = rng.choice(["\n\n", "\n", " "]).join(rng.choice(pieces) for _ in range(rng.randint(3, 30)))
        size = rng.choice([10, 20, 50, 400])
        overlap = min(rng.choice([0, 5, 9, 50]), size - 1)
        chunks, starts = _split(text, size, overlap)
        twin = "".join(c if c.isspace() or c in ".!?。！？；" else chr(rng.randrange(0x4E00, 0xA000)) for c in text)
        twin_chunks = [c for c in make_splitter(size, overlap).split_text(twin) if c.strip()]
        expected, cursor = [], 0
        for chunk in twin_chunks:
            expected.append(twin.index(chunk, cursor))
            cursor = max(expected[-1], expected[-1] + len(chunk) - overlap)
        assert starts == expected, (trial, text)


def test_markdown_files_of_either_suffix_are_read(tmp_path):
    from rag_lookahead.rag.corpus import load_corpus

    (tmp_path / "a.md").write_text("# A\n\nalpha")
    (tmp_path / "b.markdown").write_text("# B\n\nbeta")  # was left out without a word
    assert sorted(Path(p).name for p in load_corpus(tmp_path).docs) == ["a.md", "b.markdown"]
