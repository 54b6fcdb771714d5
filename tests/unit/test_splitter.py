"""The index's splitter (``rag/splitter.py``) and the twin text ``chunk_starts`` splits
(``rag/build.py``): a long line without separators, split without an object per character, into
the chunks langchain made of it, and every other text split as langchain splits it."""

from __future__ import annotations

import random
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from langchain_text_splitters import RecursiveCharacterTextSplitter

from rag_lookahead.errors import ConfigError
from rag_lookahead.rag import build
from rag_lookahead.rag.build import SEPARATORS, chunk_starts, make_splitter
from rag_lookahead.rag.corpus import load_corpus
from rag_lookahead.rag.headings import heading_paths
from rag_lookahead.rag.splitter import character_windows


def _langchain(size: int, overlap: int) -> RecursiveCharacterTextSplitter:
    """The splitter the index used before: langchain's own, with the index's settings."""
    return RecursiveCharacterTextSplitter(
        separators=SEPARATORS,
        keep_separator="end",
        chunk_size=size,
        chunk_overlap=overlap,
        length_function=len,
        strip_whitespace=True,
    )


def _texts() -> dict[str, str]:
    """The bundled corpus, and generated texts: words, separators of every kind, whitespace the
    splitter strips but does not cut at, and runs without separators of lengths about the window's."""
    corpus = Path(__file__).resolve().parents[2] / "corpora"
    texts = {f"corpus {source}": text for source, (_, text) in load_corpus(corpus).docs.items()}
    assert len(texts) >= 5
    rng = random.Random(7)
    words = ["alpha", "beta", "数据", "模型", "x" * 30, "y" * 500, "z" * 1200, "\t", "\u3000", "\u2003"]
    words += [" ", ". ", "。", "！", "？", "；", "! ", "? ", "\n", "\n\n", "## H\n", "\r\n", "😀" * 450]
    words += ["![img](data:image/png;base64," + "A/b+" * 300 + ")"]
    for i in range(40):
        texts[f"words {i}"] = "".join(rng.choice(words) for _ in range(rng.choice([3, 40, 300])))
    for i in range(20):
        alphabet = "ab\t\u3000\u2003" if i % 2 else "abc"
        texts[f"run {i}"] = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 2000)))
    for n in [0, 1, 9, 10, 11, 29, 30, 31, 49, 50, 51, 349, 350, 351, 399, 400, 401, 749, 750, 751, 1101]:
        texts[f"x {n}"] = "x" * n
        texts[f"x {n} in sentences"] = "head. " + "x" * n + " tail\n\n" + "\t" * (n % 7) + "y" * n + "\t"
    return texts


@pytest.mark.parametrize("size,overlap", [(10, 10), (10, 11), (10, -1), (1, 1), (0, 0)])
def test_an_overlap_outside_0_to_the_size_is_refused(size, overlap):
    """An overlap as long as the window never moves it forward (the splitter divided by zero)."""
    with pytest.raises(ConfigError, match=r"^chunk_(size|overlap) must be"):
        make_splitter(size, overlap)


@pytest.mark.parametrize("size,overlap", [(400, 50), (60, 10), (30, 0), (10, 9), (2, 1), (1, 0)])
def test_chunks_are_the_ones_langchain_made(size, overlap):
    """The index's chunks of ordinary text and of runs without separators are langchain's own,
    character for character (an index built before is reused, its vectors kept)."""
    ours, theirs = make_splitter(size, overlap), _langchain(size, overlap)
    for name, text in _texts().items():
        assert ours.split_text(text) == theirs.split_text(text), name


def test_character_windows_of_a_run_without_separators():
    assert character_windows("x" * 750, 400, 50) == ["x" * 400, "x" * 400]
    assert character_windows("x" * 751, 400, 50) == ["x" * 400, "x" * 400, "x" * 51]  # the last reaches the end
    assert character_windows("ab\t\tcd", 3, 1) == ["ab", "c", "cd"]  # "ab\t", "\t\tc", "cd", stripped
    assert character_windows(" \t\t\t b", 3, 1) == ["b"]  # blank windows are left out
    assert character_windows("", 400, 50) == []
    for text, size, overlap in [("x" * 751, 400, 50), ("ab\t\tcd", 3, 1), (" \t\t\t b", 3, 1)]:
        assert character_windows(text, size, overlap) == _langchain(size, overlap).split_text(text)


def _old_twin(text: str) -> str:
    """``chunk_starts``'s twin as it was made before, the whole text in one array."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).copy()
    kept = np.fromiter((ord(c) for c in set("".join(SEPARATORS))), dtype=np.uint32)
    other = ~np.isin(codes, kept) & ~np.isin(codes, build._WHITESPACE)
    codes[other] = np.random.default_rng(0).integers(0x4E00, 0xA000, size=int(other.sum()), dtype=np.uint32)
    return codes.tobytes().decode("utf-32-le")


def test_the_twin_made_block_by_block_is_the_one_made_at_once(monkeypatch):
    """Where a chunk starts, and so the heading it is searched under, comes from the twin: made a
    block at a time, it is the same text as before (the generator draws on where it left off)."""
    texts = _texts()
    texts["surrogates and astral"] = "a\ud800b 😀。\U0010ffff\n" * 50
    monkeypatch.setattr(build, "_TWIN_BLOCK", 97)  # blocks that end anywhere
    for name, text in texts.items():
        assert build._twin(text) == _old_twin(text), name


def test_a_long_line_without_separators_is_chunked_in_little_memory():
    """A Markdown note with an embedded base64 image (one 18.7 MB line) made ``rag_lookahead index``
    peak at 2.1 GB in a minute: langchain cut the line, and ``chunk_starts`` its twin, into a string
    per character. Splitting it and placing its chunks now takes a few bytes a character."""
    rng = random.Random(0)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    image = "".join(rng.choices(alphabet, k=1_000_000))
    text = f"# Trip\n\nWe went to the lake.\n\n![photo](data:image/jpeg;base64,{image})\n\n## Budget\n\n300 euros.\n"
    splitter = make_splitter()
    began = time.perf_counter()
    tracemalloc.start()
    try:
        chunks = [c for c in splitter.split_text(text) if c.strip()]
        starts = chunk_starts(splitter, text, chunks)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(text), f"peak {peak / len(text):.1f} bytes a character"
    assert time.perf_counter() - began < 10
    assert len(chunks) == 2 + -(-(len(image) + 40 - 400) // 350) + 1
    assert all(text[s : s + len(c)] == c for s, c in zip(starts, chunks))
    paths = heading_paths(text, starts)
    assert paths[1] == "Trip" and paths[-1] == "Trip > Budget"
