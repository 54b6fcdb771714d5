"""Which sdpa kernels our forwards may use on a GPU: every one but cuDNN's.

Why: with a custom mask, or a query length other than 1, torch picks cuDNN's attention on recent
NVIDIA GPUs, and cuDNN builds (and caches) an execution plan per shape. A decode step's shape
changes every step (the cache grows, the draft tree's size varies), so each of the model's
attention calls paid a new plan: measured on an H200 (torch 2.11, default model, bf16),
``_cudnn_attention_forward`` took 2.7 ms of host time a call, 65 ms of a ~84 ms verify forward,
and 18 ms a forward without it. The memory-efficient kernel takes the same masks with no
per-shape plan. On a CPU nothing changes.

torch's switch for it is process-wide, not per thread, so the scope is counted: the first forward
to enter turns cuDNN's attention off, the last to leave restores what was set before, and
forwards on several threads (a server's engine beside a caller's own ``generate``) can neither
turn it back on under another's forward nor leave it off when all are done.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["without_cudnn_attention"]

_lock = threading.Lock()
_inside = 0  # forwards within the scope now, all threads together
_saved: bool | None = None  # cuDNN attention's setting before the first of them entered


@contextlib.contextmanager
def _cudnn_attention_off() -> Iterator[None]:
    global _inside, _saved
    with _lock:
        if _inside == 0:
            _saved = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                torch.backends.cuda.enable_cudnn_sdp(bool(_saved))


def without_cudnn_attention(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Within: sdpa on ``device`` (cuda) chooses among flash, memory-efficient and math attention."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return _cudnn_attention_off()
