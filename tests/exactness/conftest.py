"""The exactness tests run torch on one thread, except where the real default model is decoded.

Why: they decode tiny models (hidden size 64) thousands of times, and on a 2-core machine torch's
OpenMP team costs more than it gains on such small products: transformers' greedy ``generate`` of
30 tokens on tiny glm4 took 0.93-1.08 s with 2 threads and 0.11-0.12 s with 1 (ours: 0.23-1.27 s
against 0.03-0.07 s), measured back to back on the CI-sized machine. Both sides of each
comparison (transformers' output and ours) run in the same process on the same thread count, so
what a test checks is unchanged. The real default model's tests keep torch's default: its large
products do use both cores. ``test_cpu_linear`` and ``test_gpu_readiness`` keep it too: they
check the CPU kernels and the hardware paths themselves.
"""

from __future__ import annotations

import pytest
import torch

#: modules that keep torch's own thread count (see the module docstring)
KEEP_THREADS = {"test_cpu_linear", "test_gpu_readiness"}


@pytest.fixture(autouse=True)
def one_torch_thread(request):
    """torch on one thread for this test (restored after), unless it decodes the real model."""
    real_model = {"default_model", "default_model_fp32"} & set(request.fixturenames)
    if real_model or request.module.__name__.rpartition(".")[2] in KEEP_THREADS:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
