"""One row of a decode batch: its tokens so far and when it must stop.

A row stops at EOS, at its token budget (``max_new_tokens``), at the end of the model's
context window or where a caller's stopping rule says (``take``'s ``stopped``), whichever comes
first; ``take`` enforces them as tokens arrive, so a running row's KV cache and its
``generated`` tokens always stay in step.

Under chunked prefill a row joins the batch before its prompt is in the cache: it is
``prefilling`` until its last prompt chunk has been through a step, which also gives its first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rag_lookahead.decoding.acceptance import AcceptanceRates
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.sampling import TokenChooser


@dataclass(eq=False)
class Row:
    """A row being decoded. ``index`` is its key: its row in ``generate``'s batch, a request id in a server."""

    index: object
    prompt: list[int]
    max_new_tokens: int
    chooser: TokenChooser
    context_limit: int | None  # tokens (prompt + generated) the model's context holds; None: no limit
    acceptance: AcceptanceRates = field(default_factory=AcceptanceRates)
    generated: list[int] = field(default_factory=list)
    position: int = 0  # cache entries this row owns = position id of its pending token (or next prompt chunk)
    done: bool = False
    draft_state: Any = None  # what the batch's drafter keeps for this row (the trie drafter: its context pool)
    candidates: DraftTree | None = None  # the weighed tree this step's draft was cut from (judges what was cut)
    failure: Exception | None = None  # why choosing this row's tokens failed (it ended there; the others went on)
    drafting: bool = False  # the drafter started this row (and has not retired it)

    @property
    def prompt_length(self) -> int:
        return len(self.prompt)

    @property
    def length(self) -> int:
        """Tokens of the row's text so far: prompt + generated."""
        return len(self.prompt) + len(self.generated)

    @property
    def tokens(self) -> list[int]:
        """The row's text so far (prompt + generated), as a new list."""
        return self.prompt + self.generated

    def tokens_from(self, start: int) -> list[int]:
        """The row's tokens from position ``start`` of its text on: what a drafter has not seen yet."""
        if start >= len(self.prompt):
            return self.generated[start - len(self.prompt) :]
        return self.prompt[start:] + self.generated

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is not in the cache yet (chunked prefill), so the row has no token yet."""
        return self.position < len(self.prompt)

    def next_chunk(self, most: int) -> list[int]:
        """The next ``most`` (at least one) prompt tokens that are not in the cache yet."""
        return self.prompt[self.position : self.position + max(most, 1)]

    @property
    def pending(self) -> int:
        """The last accepted token, whose KV entry the next verify step computes."""
        return self.generated[-1]

    @property
    def room(self) -> int:
        """Tokens the row may still gain: its token budget, and the context window, which holds
        ``context_limit`` tokens (prompt + generated) in all."""
        room = self.max_new_tokens - len(self.generated)
        if self.context_limit is not None:
            room = min(room, self.context_limit - self.length)
        return max(room, 0)

    def take(self, tokens: list[int], eos: frozenset[int], stopped: bool = False) -> list[int]:
        """Append accepted tokens, cut at EOS, the token budget or the context end; return what was kept.

        The room is counted before the tokens are added; a block cut short always ends the row,
        so a running row's KV cache and ``generated`` stay in step. ``stopped``: a caller's
        stopping rule ended the row at the last of ``tokens`` (``TokenChooser.stop_after``).
        """
        tokens = tokens[: self.room]
        for i, token in enumerate(tokens):
            if token in eos:
                tokens = tokens[: i + 1]
                break
        self.generated.extend(tokens)
        if stopped or not tokens or tokens[-1] in eos or self.room == 0:
            self.done = True
        return tokens
