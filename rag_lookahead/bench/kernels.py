"""Which kernels transformers' baselines run on, beside our loop on the same loaded model."""

from __future__ import annotations

import contextlib

from rag_lookahead.cpu_linear import stock_linears
from rag_lookahead.decoding.attention_backends import without_cudnn_attention
from rag_lookahead.decoding.verify import input_device

__all__ = ["transformers_kernels"]


def transformers_kernels(model, stock: bool = False) -> contextlib.AbstractContextManager:
    """Within: the kernels transformers' baselines run on. By default those our loop runs on (the
    linears ``load_model`` packs, and on a GPU sdpa without cuDNN: ``attention_backends``), the
    comparison the bars are judged by; with ``stock``, torch's own (its stock linears, and sdpa's own
    choice, cuDNN on recent NVIDIA GPUs), as a plain transformers user runs the model."""
    return stock_linears(model) if stock else without_cudnn_attention(input_device(model))
