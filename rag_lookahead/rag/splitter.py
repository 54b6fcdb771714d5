"""The index's text splitter: langchain's ``RecursiveCharacterTextSplitter``, with its last resort
(cutting a text that holds none of the separators character by character) done by slicing.

langchain cuts such a text into a list of one-character strings and merges them back into
chunks. On a long line without separators (a Markdown note with an embedded base64 ``data:``
image, a minified file) that is one Python object per character: a 19.5 MB line peaked at
2.1 GB and took a minute. Merging single characters only ever makes windows of ``chunk_size``
characters, each starting ``chunk_size - chunk_overlap`` after the one before, the last running
to the end, each stripped and dropped if blank; :meth:`CharacterWindowSplitter._split_text`
slices those windows out directly, so the chunks are the same, and every other text is split by
langchain as before. Imported where a splitter is made (:func:`rag.build.make_splitter`): langchain
is slow to import, and the CLI starts fast.
"""

from __future__ import annotations

from langchain_text_splitters import RecursiveCharacterTextSplitter


class CharacterWindowSplitter(RecursiveCharacterTextSplitter):
    """A ``RecursiveCharacterTextSplitter`` that keeps each separator at the end of the piece
    before it, measures with ``len`` and strips chunks: the settings under which its last
    resort is :func:`character_windows`."""

    def __init__(self, separators: list[str], chunk_size: int, chunk_overlap: int):
        super().__init__(
            separators=separators,
            keep_separator="end",
            chunk_size=chunk_size,
            chunk_overlap=chunk_overlap,
            length_function=len,
            strip_whitespace=True,
        )

    def _split_text(self, text: str, separators: list[str]) -> list[str]:
        # langchain takes the first separator found in the text (literally: not regexes), and
        # the empty one, found in every text, one character at a time; the recursion comes back
        # here. With chunks of one character it merges nothing: each character is a chunk, unstripped
        if self._chunk_size == 1 or any(separator and separator in text for separator in separators):
            return super()._split_text(text, separators)
        return character_windows(text, self._chunk_size, self._chunk_overlap)


def character_windows(text: str, size: int, overlap: int) -> list[str]:
    """What langchain's merge makes of ``text`` split into single characters: windows of ``size``
    characters, ``size - overlap`` apart, the last the first to reach the end of ``text``; each
    stripped, the blank ones left out."""
    stride = size - overlap
    # langchain closes a window when a character would make it longer than ``size``, so only
    # windows that end before the text does are followed by another
    later = -(-(len(text) - size) // stride) if len(text) > size else 0
    windows = (text[i * stride : i * stride + size].strip() for i in range(later + 1))
    return [w for w in windows if w]
