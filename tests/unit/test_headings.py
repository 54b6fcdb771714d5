"""The heading path each Markdown chunk is searched under (``rag/headings.py``)."""

from __future__ import annotations

from rag_lookahead.rag.build import make_splitter
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


def _path_of(chunks, paths, needle):
    return next(p for c, p in zip(chunks, paths) if needle in c)


def test_each_chunk_gets_the_headings_in_force_where_it_starts():
    chunks = make_splitter(40, 10).split_text(DOC)
    paths = heading_paths(DOC, chunks)
    assert len(paths) == len(chunks) and paths[0] == "Tuning"
    assert _path_of(chunks, paths, "maximum number") == "Tuning > decoding_length"
    assert _path_of(chunks, paths, "echo hi") == "Tuning > decoding_length"  # the fenced "#" line is code
    assert _path_of(chunks, paths, "Fewer nodes") == "Tuning > decoding_length > On a CPU"  # closing #s dropped
    assert _path_of(chunks, paths, '"auto"') == "Tuning > budget"  # a level-2 heading closes the level 3


def test_text_without_headings_has_none_and_is_searched_as_it_is():
    chunks = make_splitter(30, 5).split_text("plain text, no headings at all. " * 4)
    assert set(heading_paths("plain text, no headings at all. " * 4, chunks)) == {""}
    assert searched_text({"text": "body"}) == "body"
    assert searched_text({"text": "body", "heading": "A > B"}) == "A > B\nbody"
