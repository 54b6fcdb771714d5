"""Which sdpa kernels our forwards may use on a GPU: every one but cuDNN's.

Why: with a custom mask, or a query length other than 1, torch picks cuDNN's attention on recent
NVIDIA GPUs, and cuDNN builds (and caches) an execution plan per shape. A decode step's shape
changes every step (the cache grows, the draft tree's size varies), so each of the model's
attention calls paid a new plan: measured on an H200 (torch 2.11, default model, bf16),
``_cudnn_attention_forward`` took 2.7 ms of host time a call, 65 ms of a ~80 ms verify forward,
against 16 ms for a transformers decode token. The memory-efficient kernel takes the same masks
with no per-shape plan. On a CPU nothing changes.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["without_cudnn_attention"]


def without_cudnn_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """Within: sdpa on ``device`` (cuda) chooses among flash, memory-efficient and math attention."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
