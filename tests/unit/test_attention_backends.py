"""Our forwards on a GPU keep sdpa off cuDNN (a new execution plan per step's shape), and only there;
torch's switch is process-wide, so overlapping scopes on several threads restore it only when all end."""

from __future__ import annotations

import threading

import torch

from rag_lookahead.decoding.attention_backends import without_cudnn_attention


def _enabled() -> tuple[bool, bool, bool, bool]:
    cuda = torch.backends.cuda
    return cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()


def test_cuda_forwards_choose_among_every_kernel_but_cudnn_and_restore_the_setting():
    before = _enabled()
    with without_cudnn_attention(torch.device("cuda", 0)):
        assert _enabled() == (False,) + before[1:]
    assert _enabled() == before


def test_a_setting_made_before_is_what_comes_back():
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with without_cudnn_attention("cuda"):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_cpu_forwards_change_nothing():
    before = _enabled()
    with without_cudnn_attention(torch.device("cpu")):
        assert _enabled() == before


def test_overlapping_scopes_on_two_threads_keep_it_off_until_the_last_ends():
    assert torch.backends.cuda.cudnn_sdp_enabled()
    entered, release, seen = threading.Event(), threading.Event(), []

    def other_forward() -> None:
        with without_cudnn_attention("cuda"):
            entered.set()
            release.wait(10)
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())

    thread = threading.Thread(target=other_forward)
    with without_cudnn_attention("cuda"):
        thread.start()
        assert entered.wait(10)
    # this thread's scope ended first: the other thread's forward must still run without cuDNN
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    release.set()
    thread.join(10)
    assert seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled()
