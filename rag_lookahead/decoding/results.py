"""What ``generate`` returns: the sequences, the counts and timings of the decoding and, when asked,
each new token's log-probability.

Log-probabilities are those of the model's own distribution: ``log_softmax`` of the raw logits
that chose the token (what transformers returns as ``output_logits``), before any repetition
penalty, temperature, top-k, top-p or min-p, so a sampled token may be unlikely under them;
this is what OpenAI's ``logprobs`` and vLLM (by default) report. They come from the verify
forward at the tree node where the token was accepted, so they are exact, not re-scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rag_lookahead.errors import ConfigError

#: the summed fields of ``GenerationStats`` (the histogram is merged key by key)
_ADDED = ("forward_passes", "new_tokens", "prefill_seconds", "decode_seconds", "lookup_seconds", "draft_tokens")


@dataclass
class GenerationStats:
    """Counts and timings of one ``generate`` call, over all its rows."""

    rows: int = 0
    forward_passes: int = 0  # decode forwards after the prefill
    new_tokens: int = 0  # over all rows, the prefill's token included
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    lookup_seconds: float = 0.0  # drafting (trie lookups, draft building) and sizing the drafts
    draft_tokens: int = 0  # draft nodes verified, over all rows and steps
    accepted_histogram: dict[int, int] = field(default_factory=dict)  # tokens gained by a row in one step -> count
    trace: list[dict] | None = None

    @property
    def row_steps(self) -> int:
        return sum(self.accepted_histogram.values())

    @property
    def mean_accepted(self) -> float:
        """New tokens per decode forward and row (1.0 for plain decoding)."""
        steps = self.row_steps
        return sum(k * n for k, n in self.accepted_histogram.items()) / steps if steps else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after each row's first, per second of decoding."""
        tokens = self.new_tokens - self.rows
        return tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def record_step(self, drafts: list, gained: list[list[int]], lookup: float, seconds: float) -> None:
        """Count one decode step: each row's verified draft (``DraftTree``) and the tokens it gained."""
        self.forward_passes += 1
        self.lookup_seconds += lookup
        for draft, tokens in zip(drafts, gained):
            self.draft_tokens += len(draft)
            self.accepted_histogram[len(tokens)] = self.accepted_histogram.get(len(tokens), 0) + 1
        if self.trace is not None:
            self.trace.append(
                {
                    "step": self.forward_passes,
                    "draft": [len(d) for d in drafts],
                    "gained": [len(t) for t in gained],
                    "lookup_ms": round(lookup * 1e3, 3),
                    "step_ms": round(seconds * 1e3, 3),
                }
            )

    def add(self, other: GenerationStats) -> None:
        """Count another run's steps, tokens and time in these (rows are not added: the caller counts them)."""
        for name in _ADDED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, n in other.accepted_histogram.items():
            self.accepted_histogram[k] = self.accepted_histogram.get(k, 0) + n

    def as_dict(self) -> dict:
        return {
            "rows": self.rows,
            "forward_passes": self.forward_passes,
            "new_tokens": self.new_tokens,
            "mean_accepted": round(self.mean_accepted, 4),
            "accepted_histogram": dict(sorted(self.accepted_histogram.items())),
            "draft_tokens": self.draft_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "lookup_seconds": round(self.lookup_seconds, 4),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
        }


@dataclass(frozen=True)
class TokenLogprob:
    """One new token's log-probability, and the ``top`` most likely tokens at its place (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class LogprobRecorder:
    """Collects one row's :class:`TokenLogprob` as its tokens are accepted (the decode loop records into it).

    ``top``: how many most likely tokens to keep per place (0: the chosen token's only).
    """

    def __init__(self, top: int = 0) -> None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ConfigError(f"logprobs (the most likely tokens kept per place) must be an integer >= 0, got {top!r}")
        self.top = top
        self.entries: list[TokenLogprob] = []

    def record(self, logits: torch.Tensor, tokens: Sequence[int]) -> None:
        """``logits[i]``: the raw logits (V,) that chose ``tokens[i]``."""
        if tokens:
            self.entries.extend(token_logprobs(logits[: len(tokens)], tokens, self.top))


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """Each token's log-probability under ``log_softmax(logits[i])`` (in fp32, as transformers keeps
    its logits), with the ``top`` most likely tokens there."""
    scores = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(tokens), dtype=torch.long, device=scores.device)
    values = scores.gather(-1, chosen[:, None])[:, 0].tolist()
    if top:
        best, ids = scores.topk(min(top, scores.shape[-1]), dim=-1)
        tops = [tuple(zip(row_ids, row_best)) for row_ids, row_best in zip(ids.tolist(), best.tolist())]
    else:
        tops = [()] * len(values)
    return [TokenLogprob(int(t), v, alternatives) for t, v, alternatives in zip(tokens, values, tops)]


@dataclass
class GenerationResult:
    sequences: torch.LongTensor  # the prompt as given + new tokens, right-padded with the pad id
    stats: GenerationStats
    logprobs: list[list[TokenLogprob]] | None = None  # per row, one per new token (asked with logprobs=)


def assemble(ids: torch.Tensor, outputs: list[list[int]], pad: int) -> torch.LongTensor:
    """The prompts as given, then each row's new tokens right-padded with ``pad`` (``model.generate``'s layout)."""
    width = max(len(o) for o in outputs)
    new = torch.full((ids.shape[0], width), pad, dtype=torch.long, device=ids.device)
    for r, tokens in enumerate(outputs):
        new[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return torch.cat([ids, new], dim=1)
