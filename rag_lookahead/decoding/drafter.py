"""Drafters: what proposes the tokens each verify step checks.

The decode loop (``decode_batch.DecodeBatch``) asks its drafter for every row's draft tree, verifies all
the trees in one forward, and then tells the drafter what each row accepted. No draft can make
the output wrong: verification keeps exactly the tokens plain decoding chooses, so a drafter
only decides how many tokens a step gains. Two drafters come with the package:

* ``TrieDrafter`` (the default): lookahead's n-gram tries over the row's own text and reference
  passages, and over earlier answers (the shared output pool).
* ``PromptLookupDrafter``: transformers' prompt lookup (``prompt_lookup_num_tokens``), so the
  two can be compared on the same loop: ``generate(model, ids, drafter=PromptLookupDrafter())``.

A new drafter is one subclass of ``Drafter``: ``propose`` is required; ``start``, ``observe`` and
``retire`` are for drafters that keep state per row (in ``row.draft_state``) or across rows.
What every drafter must keep to:

* It never draws from torch's random generators: sampled rows draw every token from them in
  transformers' order, and a stray draw would change the sample.
* ``DraftTree.probs`` are its estimates that each node will be accepted, never higher for a
  child than for its parent (1.0 everywhere when it has none). The loop weighs them by the
  row's ``AcceptanceRates`` and the cost budget keeps the nodes that pay.
* Its tree lists parents before children. The loop checks a tree from a drafter it does not
  know (``DraftTree.checked``): depths are taken from the parents (they become positions),
  probabilities are clamped to their parent's, and a tree it cannot read raises ``ValueError``.
* It may propose more than fits: the loop cuts each draft to the row's remaining room, and to
  a single chain where the model's attention cannot take a tree mask.
* It runs on the host between forwards, so it must stay cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.draft import DraftTree, propose
from rag_lookahead.decoding.rows import Row
from rag_lookahead.decoding.trie import ContextPool, OutputPool

__all__ = ["Drafter", "PromptLookupDrafter", "TrieDrafter"]


class Drafter(ABC):
    """Proposes each row's draft tree and learns from what was accepted."""

    def start(self, row: Row, references: Sequence[Sequence[int]]) -> None:  # noqa: B027 (optional hook)
        """A row joined the batch; its prompt and first token are in ``row``. ``references`` are its
        passages (token-id lists) to draft from; a drafter may ignore them."""

    @abstractmethod
    def propose(self, row: Row) -> DraftTree:
        """The draft tree continuing ``row.tokens`` (empty: nothing to propose this step)."""

    def observe(self, row: Row, draft: DraftTree, accepted: list[int]) -> None:  # noqa: B027 (optional hook)
        """A verify step ended: ``draft`` was verified, ``accepted`` are its accepted nodes (root to
        leaf), and the tokens the row gained are already in ``row.generated``."""

    def retire(self, row: Row) -> None:  # noqa: B027 (optional hook)
        """The row left the batch (finished, stopped by its caller, or dropped)."""


class TrieDrafter(Drafter):
    """Lookahead's drafter: the likeliest continuations in n-gram tries (see ``draft.propose``).

    Each row's context pool (``row.draft_state``) holds its references and its text so far; the
    output pool, shared across rows and calls, holds earlier answers, and every row that leaves
    adds its answer to it.
    """

    def __init__(self, config: LookaheadConfig, output_pool: OutputPool | None = None) -> None:
        self.config = config
        self.output_pool = output_pool if config.use_output_pool else None

    def start(self, row: Row, references: Sequence[Sequence[int]]) -> None:
        context = ContextPool(self.config.pool_depth, references, key_length=self.config.max_key_length)
        context.extend(row.tokens)
        row.draft_state = context

    def propose(self, row: Row) -> DraftTree:
        return propose(row.draft_state, self.output_pool, self.config)

    def observe(self, row: Row, draft: DraftTree, accepted: list[int]) -> None:
        context: ContextPool = row.draft_state
        context.extend(row.tokens_from(len(context.stream)))

    def retire(self, row: Row) -> None:
        if self.output_pool is not None:
            self.output_pool.add(row.generated)


class _NgramIndex:
    """One row's text and the first position of every n-gram in it (n <= ``max_ngram``)."""

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.first.setdefault(tuple(self.tokens[end - n :]), end - n)


class PromptLookupDrafter(Drafter):
    """transformers' prompt lookup decoding as a drafter of our loop.

    The last n tokens of the row's text (prompt + generated; n from ``max_ngram`` down to 1)
    are looked up among its earlier tokens; at their first (leftmost) earlier occurrence, the
    ``num_pred_tokens`` tokens that followed are the draft, one chain. That is the candidate
    transformers' ``PromptLookupCandidateGenerator`` proposes, less two cuts that cannot change
    the output here: at EOS (our loop ends a row at an accepted EOS) and at tokens a logits
    processor forbids (we refuse such processors). Defaults are transformers'
    (``max_matching_ngram_size=2``, ``prompt_lookup_num_tokens=10``). Each row keeps the first
    position of every n-gram as its tokens arrive, so a lookup does not rescan the text.
    Reference passages are not read: prompt lookup drafts from the row's own text only.
    """

    def __init__(self, max_ngram: int = 2, num_pred_tokens: int = 10) -> None:
        self.max_ngram = positive_int("max_ngram", max_ngram)
        self.num_pred_tokens = positive_int("num_pred_tokens", num_pred_tokens)

    def __repr__(self) -> str:
        return f"PromptLookupDrafter(max_ngram={self.max_ngram}, num_pred_tokens={self.num_pred_tokens})"

    def start(self, row: Row, references: Sequence[Sequence[int]]) -> None:
        index = _NgramIndex(self.max_ngram)
        index.extend(row.tokens)
        row.draft_state = index

    def propose(self, row: Row) -> DraftTree:
        index: _NgramIndex = row.draft_state
        tokens = index.tokens
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            start = index.first.get(tuple(tokens[length - n :]))
            if start is not None and start + n < length:  # an earlier occurrence, not the suffix itself
                chain = tokens[start + n : start + n + self.num_pred_tokens]
                return DraftTree(
                    tokens=chain,
                    parents=list(range(-1, len(chain) - 1)),
                    depths=list(range(1, len(chain) + 1)),
                    probs=[1.0] * len(chain),
                )
        return DraftTree()

    def observe(self, row: Row, draft: DraftTree, accepted: list[int]) -> None:
        index: _NgramIndex = row.draft_state
        index.extend(row.tokens_from(len(index.tokens)))
