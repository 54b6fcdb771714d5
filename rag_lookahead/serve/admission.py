"""Admission by tokens: a request holds prompt + max_tokens tokens of the KV budget from the moment
it is accepted until it ends, so a burst of long prompts is refused at the door (429 with a
``Retry-After`` header) instead of waiting in a queue that can only grow.

The budget counts waiting requests too: what they will hold once they run is what bounds how long
the last of them waits. Its default (:func:`default_token_budget`) is what the memory left
after loading the model holds as KV cache, capped by what the request limits can ever ask for.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rag_lookahead.serve.api_error import ApiError
from rag_lookahead.serve.config import ServerConfig

if TYPE_CHECKING:
    from rag_lookahead.serve.jobs import Job

__all__ = ["TokenBudget", "busy", "default_token_budget", "kv_bytes_per_token"]

#: Share of the free memory the KV cache may take by default: GPU memory is the cache's to fill;
#: on a CPU the activations, the masks and the rest of the machine need the larger part.
GPU_SHARE = 0.5
CPU_SHARE = 0.25
#: Bounds of a ``Retry-After`` hint, in seconds.
RETRY_MIN, RETRY_MAX = 1, 60


def kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take in the cache, over all layers."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    itemsize = int(getattr(getattr(model, "dtype", None), "itemsize", 4))
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * itemsize


def free_memory(device) -> tuple[int, float]:
    """Bytes free where the cache lives, and the share of them it may take."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0]), GPU_SHARE
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, CPU_SHARE
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * os.sysconf("SC_PAGE_SIZE") if pages else 4 << 30, CPU_SHARE


def default_token_budget(model, config: ServerConfig) -> int:
    """The KV token budget when ``max_batch_tokens`` is not set: the free memory's share (half of
    the GPU's, a quarter of the CPU's available memory, divided among ``config.memory_sharers``)
    over the bytes a token takes, at most
    what the batch and the queue could ever hold ((max_batch_size + max_queue) x (max_prompt_tokens
    + max_tokens_limit)) and at least one request of the largest size."""
    from rag_lookahead.decoding.verify import input_device

    largest = config.max_prompt_tokens + config.max_tokens_limit
    ceiling = (config.max_batch_size + config.max_queue) * largest
    free, share = free_memory(input_device(model))
    fits = int(free * share / config.memory_sharers) // max(kv_bytes_per_token(model), 1)
    return max(min(fits, ceiling), largest)


def busy(message: str, retry_after: int) -> ApiError:
    """A 429 with OpenAI's error body and a ``Retry-After`` header."""
    return ApiError(429, message, "rate_limit_error", headers={"Retry-After": str(retry_after)})


class TokenBudget:
    """The tokens held by accepted requests (waiting or running), and the refusals past ``limit``.

    Only the engine touches it, under its lock; a request stops holding its tokens once it ends
    or its client leaves (its row is dropped at the next step).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._holders: list[Job] = []

    @staticmethod
    def need(job: Job) -> int:
        return len(job.prompt_ids) + job.max_tokens

    @classmethod
    def need_of(cls, jobs: Sequence[Job]) -> int:
        """What a request's choices hold together: they are accepted or refused as one."""
        return sum(cls.need(job) for job in jobs)

    @property
    def held(self) -> int:
        self._holders = [job for job in self._holders if job.live]
        return sum(self.need(job) for job in self._holders)

    def hold(self, job: Job) -> None:
        self._holders.append(job)

    def never_fits(self, jobs: Sequence[Job]) -> ApiError | None:
        """A 400 when a request's ``jobs`` need more than the whole budget: no wait would let them in."""
        need = self.need_of(jobs)
        if need <= self.limit:
            return None
        if len(jobs) == 1:
            each = ""
        elif len({self.need(job) for job in jobs}) == 1:
            each = f"{len(jobs)} choices x {self.need(jobs[0])} = "
        else:  # several prompts need different amounts
            each = f"{len(jobs)} choices, "
        return ApiError(
            400,
            f"this request needs {each}{need} tokens of KV cache (prompt + max_tokens) but the server's "
            f"whole budget is {self.limit} (max_batch_tokens): shorten the prompt or lower max_tokens"
            + (" or n, or send fewer prompts" if len(jobs) > 1 else ""),
            param="max_tokens",
            code="request_too_large",
        )

    def refusal(self, jobs: Sequence[Job], tokens_per_second: float) -> ApiError | None:
        """The 429 when a request's ``jobs`` (its ``n`` choices; see ``never_fits`` first) do not fit
        beside what is held now (None: they do); without jobs, whether the budget is full (the
        message then names no need: a request's is known once it is tokenized)."""
        need = self.need_of(jobs) if jobs else 1
        held = self.held
        if held + need <= self.limit:
            return None
        wait = self.retry_after(held + need - self.limit, tokens_per_second)
        this = f" and this request needs {need}" if jobs else ""
        return busy(
            f"the server is busy: running and waiting requests hold {held} of its {self.limit} KV tokens "
            f"(max_batch_tokens){this}; retry after {wait} s",
            wait,
        )

    def retry_after(self, excess: int, tokens_per_second: float) -> int:
        """Seconds until about ``excess`` held tokens are free: a request frees prompt + max_tokens
        once it has generated its (at most max_tokens) tokens, at the measured rate."""
        budgets = sum(job.max_tokens for job in self._holders)
        if tokens_per_second <= 0 or not budgets:
            return RETRY_MIN
        freed_per_second = tokens_per_second * sum(self.need(job) for job in self._holders) / budgets
        return int(min(max(math.ceil(excess / freed_per_second), RETRY_MIN), RETRY_MAX))
