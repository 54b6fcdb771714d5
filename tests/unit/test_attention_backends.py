"""Our forwards on a GPU keep sdpa off cuDNN (a new execution plan per step's shape), and only there."""

from __future__ import annotations

import torch

from rag_lookahead.decoding.attention_backends import without_cudnn_attention


def _enabled() -> tuple[bool, bool, bool, bool]:
    cuda = torch.backends.cuda
    return cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()


def test_cuda_forwards_choose_among_every_kernel_but_cudnn_and_restore_the_flags():
    before = _enabled()
    with without_cudnn_attention(torch.device("cuda", 0)):
        assert _enabled() == (False, True, True, True)
    assert _enabled() == before


def test_cpu_forwards_change_nothing():
    before = _enabled()
    with without_cudnn_attention(torch.device("cpu")):
        assert _enabled() == before
