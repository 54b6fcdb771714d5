"""Lexical retrieval and rank fusion: the half of hybrid search that matches words, not meanings.

* :func:`tokenize`: over :func:`normalized` text (NFKC, as the e5 tokenizer folds it), lower-cased
  words for non-CJK scripts (identifiers kept whole, plus their ``_`` parts), jieba search-mode
  words for Chinese; punctuation and English stop words (as English writes them) dropped.
* :class:`BM25Index`: Okapi BM25 (every IDF above zero) over those tokens, rebuilt whenever an
  index loads (the tokens of a large corpus come from :mod:`.token_cache`).
* :func:`reciprocal_rank_fusion`: merges the dense and BM25 rankings; :data:`HYBRID_WEIGHTS` and
  :data:`RRF_K` are tuned on realistic similar-passage sets (``python -m rag_lookahead.bench.retrieval --tune``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import re
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np

from rag_lookahead.atomic import remove_leftovers

__all__ = ["HYBRID_WEIGHTS", "RRF_K", "BM25Index", "reciprocal_rank_fusion", "tokenize"]

# RRF weights (dense, BM25) and constant for hybrid search, tuned on half of the questions of the
# realistic sets (300 similar court judgments in Chinese, 299 Wikipedia paragraphs in English; see
# bench.retrieval): equal weights with a small constant, so each list's top hits count most. The
# earlier (1.0, 0.5) with k=60 (tuned on the easy bundled set) ranked worse than BM25 alone on the
# Chinese set.
HYBRID_WEIGHTS = (1.0, 1.0)
RRF_K = 5


#: the CJK ideograph blocks jieba cuts (a character class's inside)
_CJK_CHARS = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK = re.compile(rf"[{_CJK_CHARS}]")
# Japanese has no spaces and jieba would cut kana into single characters: a run of one kana
# script is a word ("東京タワーに" -> 東京, タワー, に), a katakana loanword at least matching itself
# ("ー", the long-vowel mark, sits in the katakana block but lengthens hiragana too: "すごーい")
_KANA_RUN = re.compile(r"[\u3041-\u309f\u30fc]+|[\u30a0-\u30ff\u31f0-\u31ff]+")
_jieba = None
# English function words: in short English questions they otherwise dominate BM25 matches
_EN_STOP = frozenset(
    "a an and are as at be by can do does did for from how i in is it its of on or so that the this to"
    " was what when where which who why will with you your my we our they their me should would".split()
)


def _get_jieba():
    global _jieba
    if _jieba is None:
        import jieba

        jieba.setLogLevel(logging.WARNING)
        _keep_dictionary_cache_in_ours(jieba)
        _jieba = jieba
    return _jieba


def dictionary_state() -> str:
    """What of jieba's loaded dictionary decides its cuts, cheaply (~10 ms): its number of entries
    and the sum of their frequencies (not jieba's ``total``, which ``del_word`` leaves as it was). A
    word added or removed, or a dictionary rebuilt, changes it, so cached words cut with another
    dictionary are not served (queries are cut with the one loaded now)."""
    jieba = _get_jieba()
    jieba.dt.check_initialized()
    return f"{len(jieba.dt.FREQ)}:{sum(jieba.dt.FREQ.values())}"


def _keep_dictionary_cache_in_ours(jieba) -> None:
    """jieba keeps its parsed dictionary in ``$TMPDIR/jieba.cache``, shared by every user of the
    machine: it loads whatever marshal file is there (another user's, planted first, changes our
    words), and where that file is another user's it cannot replace it, so every process prints a
    traceback ("Dump cache file failed.") and leaves a 9 MB temporary file in /tmp. Keep it in our
    own cache folder instead; where that cannot be made, jieba keeps its default."""
    from rag_lookahead.paths import cache_dir

    folder = cache_dir() / "jieba"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return
    if folder.is_dir() and os.access(folder, os.W_OK):
        jieba.dt.tmp_dir = str(folder)
        _remove_killed_dumps(folder)


#: what jieba's dump writes first (``tempfile.mkstemp`` in its folder), then renames to jieba.cache
_JIEBA_TEMPORARY = re.compile(r"tmp[a-z0-9_]{8}")
STALE_DUMP_SECONDS = 3600  # a dump takes a second or two: one this old is a killed process's


def _remove_killed_dumps(folder) -> None:
    """The 9 MB temporary files of jieba dumps killed before their rename (``kill -9``, a Ctrl-C: its
    dump catches only ``Exception``), which nothing removed: in our own jieba folder, by
    ``mkstemp``'s names only, an hour old or more."""
    if not folder.is_symlink():  # a folder linked elsewhere (/tmp) holds others' mkstemp files
        remove_leftovers(folder, _JIEBA_TEMPORARY, older_than=STALE_DUMP_SECONDS)


@functools.cache
def _words() -> tuple[re.Pattern, re.Pattern]:
    """(a word, a word outside the CJK blocks): a letter, digit or ``_`` and then those and the
    marks written on letters. Python's ``\\w`` has no marks (vowel signs, viramas): Hindi "काम"
    and "कोमा" were both the words "क म". Built on first use (the scan took ~30 ms here)."""
    code_points = itertools.chain(range(0x20000), range(0xE0100, 0xE01F0))
    marks = [c for c in code_points if unicodedata.category(chr(c)) in ("Mn", "Mc", "Me")]
    spans: list[list[int]] = []
    for c in marks:
        if spans and spans[-1][1] == c - 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    mark = "".join(f"{chr(a)}-{chr(b)}" for a, b in spans)
    other = rf"[^\W{_CJK_CHARS}]"
    return re.compile(rf"\w[\w{mark}]*"), re.compile(rf"{other}(?:{other}|[{mark}])*")


def _word_tokens(word: str, beside_cjk: bool) -> list[str]:
    """A non-CJK word (as written), lower-cased, plus its parts when it is an identifier like
    ``branch_length``. A stop word is dropped only as English writes it ("the", "What"): a capital
    acronym ("IT", "WHO") or a letter beside Chinese ("A股", "维生素A") is a word of its own."""
    lower = word.lower()
    if lower in _EN_STOP and _written_as_stop_word(word, beside_cjk):
        return []
    if not lower.strip("_"):
        return []
    parts = [p for p in lower.split("_") if p and p not in _EN_STOP] if "_" in lower else []
    return [lower, *parts]  # "__init__" is found by "init", "budget_" by "budget"


def _written_as_stop_word(word: str, beside_cjk: bool) -> bool:
    if len(word) == 1:  # "a", "A", "I": a stop word unless it names something beside Chinese
        return not beside_cjk
    return word.islower() or word.istitle()


# characters that only shape text (zero-width spaces and joiners, the soft hyphen, a BOM): dropped
_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u2060\ufeff"))
# a line break inside Chinese text (wrapped lines, PDF extraction) splits no word
_CJK_LINE_BREAK = re.compile(rf"(?<=[{_CJK_CHARS}])[ \t]*\r?\n[ \t]*(?=[{_CJK_CHARS}])")
# a number written with thousands separators ("50,000", "1,234,567"; also a list "101,102,103")
_GROUPED_NUMBER = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d,])")
_symbol_words: re.Pattern | None = None


def _symbols_that_spell_words() -> re.Pattern:
    """Symbols NFKC spells as letters or digits ("™" -> "TM", "㎏" -> "kg", "№" -> "No"): kept
    apart from the word beside them, which NFKC would otherwise glue them to ("Acme™" -> "acmetm")."""
    global _symbol_words
    if _symbol_words is None:
        chars = [
            c
            for c in map(chr, range(0x80, 0x10000))
            if not c.isalnum()
            and (folded := unicodedata.normalize("NFKC", c)) != c
            and any(x.isalnum() for x in folded)
        ]
        _symbol_words = re.compile("[" + re.escape("".join(chars)) + "]")
    return _symbol_words


def normalized(text: str) -> str:
    """The text BM25 reads: NFKC (full-width "ＡＢＣ１２３" is "ABC123", the ligature "ﬁ" is "fi",
    as the e5 tokenizer folds them; a symbol such as "™" or "㎡" stays a word of its own), without
    invisible characters, and Chinese lines joined. A number with thousands separators reads as
    itself and as its parts ("50,000" -> "50000 50,000"), since "101,102,103" may be a list. Case is
    kept (see :func:`_word_tokens`)."""
    text = _symbols_that_spell_words().sub(lambda m: f" {m.group()} ", text)
    text = unicodedata.normalize("NFKC", text).translate(_INVISIBLE)
    text = _CJK_LINE_BREAK.sub("", text)
    return _GROUPED_NUMBER.sub(lambda m: m.group().replace(",", "") + " " + m.group(), text)


def searchable(query: str) -> bool:
    """Whether ``query`` holds a letter or a digit to search for ("…", "？！", "___" hold none)."""
    return re.search(r"[^\W_]", normalized(query)) is not None


def tokenize(text: str) -> list[str]:
    """Tokens for BM25 over :func:`normalized` text: lower-cased non-CJK words and identifiers (kept
    whole, plus their ``_`` parts), jieba search-mode words for everything else; punctuation and
    English stop words dropped.

    Single-character Chinese function words are kept: BM25's IDF already discounts them.
    """
    text = _KANA_RUN.sub(lambda m: f" {m.group()} ", normalized(text))
    toks: list[str] = []
    pos = 0
    for m in _words()[1].finditer(text):
        toks.extend(_other_tokens(text[pos : m.start()].lower()))
        beside_cjk = bool(_CJK.match(text[m.start() - 1 : m.start()]) or _CJK.match(text[m.end() : m.end() + 1]))
        toks.extend(_word_tokens(m.group(), beside_cjk))
        pos = m.end()
    toks.extend(_other_tokens(text[pos:].lower()))
    return toks


def has_cjk(text: str) -> bool:
    """Whether jieba cuts any of ``text`` (it holds a CJK character)."""
    return _CJK.search(text) is not None


def _other_tokens(chunk: str) -> list[str]:
    if not chunk.strip():
        return []
    if not _CJK.search(chunk):
        return _words()[0].findall(chunk)  # other scripts: word runs
    word = _words()[0]
    return [w for w in (t.strip() for t in _get_jieba().lcut_for_search(chunk)) if w and word.fullmatch(w)]


def _okapi_with_positive_idf(docs: list[list[str]]):
    """rank_bm25's Okapi BM25, with every word's IDF kept above zero.

    Okapi's IDF, log((N - n + 0.5) / (n + 0.5)), is zero or negative for a word in half the chunks
    or more; rank_bm25 lifts a negative one to a quarter of the mean IDF, but left a zero one at zero,
    and on a small index that mean is itself negative: an index of one chunk, or of two sharing
    their words, scored every match at or below zero and BM25 found nothing (hybrid search then ran
    dense alone). Here a word at or below zero gets the floor when the mean is positive (rank_bm25's
    ranking, kept because it measured best on the realistic sets), and otherwise, on a tiny index,
    every word takes Lucene's IDF, log(1 + (N - n + 0.5) / (n + 0.5)), which is always positive."""
    from rank_bm25 import BM25Okapi

    class _PositiveIdfOkapi(BM25Okapi):
        def _calc_idf(self, nd):
            n = self.corpus_size
            okapi = {word: math.log((n - df + 0.5) / (df + 0.5)) for word, df in nd.items()}
            self.average_idf = sum(okapi.values()) / max(len(okapi), 1)
            if self.average_idf > 0:
                floor = self.epsilon * self.average_idf
                self.idf = {word: idf if idf > 0 else floor for word, idf in okapi.items()}
            else:
                self.idf = {word: math.log1p((n - df + 0.5) / (df + 0.5)) for word, df in nd.items()}

    return _PositiveIdfOkapi(docs)


class BM25Index:
    """BM25 (Okapi, every IDF above zero) over :func:`tokenize` tokens, built from the texts or from
    their tokens (as :mod:`.token_cache` keeps them). Never stored in an index: rebuilt by each process."""

    def __init__(self, texts: Iterable[str] = (), *, tokens: list[list[str]] | None = None):
        self._docs = tokens if tokens is not None else [tokenize(t) for t in texts]
        self.size = len(self._docs)
        # Okapi divides by the corpus size: keep an empty corpus searchable (no hits)
        self._bm25 = _okapi_with_positive_idf(self._docs) if self._docs and any(self._docs) else None

    def scores(self, query: str) -> np.ndarray:
        if self._bm25 is None:
            return np.zeros(self.size, dtype=np.float32)
        return np.asarray(self._bm25.get_scores(tokenize(query)), dtype=np.float32)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        s = self.scores(query)
        order = np.argsort(-s, kind="stable")[:k]
        return [(int(i), float(s[i])) for i in order if s[i] > 0]


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]], k: int = RRF_K, weights: Sequence[float] | None = None
) -> list[tuple[int, float]]:
    """Fuse ranked id lists: score(d) = sum over lists of w / (k + rank), rank from 1. Best first.

    Ties (common with few documents) go to the better rank in the earliest list, so put the more
    trusted ranking (dense) first.
    """
    weights = list(weights) if weights is not None else [1.0] * len(rankings)
    fused: dict[int, float] = {}
    first_seen: dict[int, tuple[int, int]] = {}
    for li, (ranking, w) in enumerate(zip(rankings, weights)):
        for rank, doc in enumerate(ranking, start=1):
            fused[doc] = fused.get(doc, 0.0) + w / (k + rank)
            first_seen.setdefault(doc, (li, rank))
    return sorted(fused.items(), key=lambda kv: (-round(kv[1], 12), first_seen[kv[0]], kv[0]))
