"""How well one row's drafts have been accepted so far: the correction the draft budget applies.

The decode loop weighs every row's draft with these rates before ``costs.allocate`` ranks the
nodes of all rows together, so a row whose drafts keep failing yields its nodes to rows whose
drafts are being accepted. They learn from any drafter's trees (``accepted`` is the path of
node indices), so every drafter behind the same loop is budgeted the same way.
"""

from __future__ import annotations

from dataclasses import replace

from rag_lookahead.decoding.draft import DraftTree


class AcceptanceRates:
    """How far one row's drafts have held up, as two acceptance rates learned step by step.

    A drafter's estimates say which continuation is likeliest, not whether the model will
    follow the passage at all (the trie's counts, for one): a phrase seen once in the prompt gets probability 1 at every
    depth, whether the answer quotes it or paraphrases it. So each row learns ``first``, the
    chance that a drafted first token is accepted, and ``onward``, the chance that an accepted
    node's drafted child is accepted too. A node at depth d is then worth
    ``p * first * onward ** (d - 1)``: deep nodes pay only while the row keeps copying long
    runs, and the rates recover as soon as it does again (a fully accepted draft counts no
    failure, so the next one may go deeper). Counts decay so the estimate follows the text.
    A step that says nothing of a rate (no draft; or, for ``onward``, a draft of single first
    tokens) drifts it back toward 1: where one-token drafts are cheap the budget would
    otherwise keep drafting them forever on an old low ``onward`` and never see a long copy
    again (measured: a Chinese answer took 20 one-node steps where prompt lookup's 10-token
    chains took 8).

    ``prior``: where a new row starts: from what earlier drafts of the same kind of drafter met
    on the same model, over every row and call (``DecodeBatch.workload``, kept in the model's
    ``ModelProfile``, decaying slowly), as one observation's worth, so its own first steps soon
    outweigh it. Without that, every row joining a busy server would draft its deepest trees
    once (32 rows doing so at once cost a step several times a plain one), and every call at
    batch 1 would begin with its deepest tree (44 nodes for 3 tokens, 3-4x a plain step,
    measured on a realistic English answer).

    Where nothing has been met yet (the model's first rows; every ``ask``, a process per
    question), the rates start at ``START`` rather than at 1: a deep first tree on trust cost
    short answers more than their whole gain (a 9-token Chinese answer's first step verified 64
    nodes for 2 tokens, 3.7x a plain step). Measured against trusting starts (bf16 CPU, two
    interleaved passes, lookahead vs prompt lookup decode tokens/s): Chinese 0.88x -> 0.95x,
    0.87x -> 0.98x and 0.90x -> 1.02x on three realistic sets of 12, 8 and 8 items, 1.10x ->
    1.14x on the copying prompts; English 1.02x -> 1.06x, 0.94x -> 0.89x, 1.20x -> 1.20x and
    1.05x -> 1.03x, within the noise.
    """

    #: (first, onward) where no earlier draft has been met, weighed as one observed step
    START = (0.6, 0.8)

    DECAY = 0.8
    PROBE = 0.1  # a step without a draft drifts both rates back toward 1, so no row is written off for good
    PRIOR_WEIGHT = 1.0  # a prior counts as one observed step

    def __init__(self, prior: AcceptanceRates | None = None, decay: float = DECAY) -> None:
        self.decay = decay
        if prior is None:  # decayed (accepted, drafted) at depth 1, and below an accepted node
            self._first, self._onward = [self.START[0], 1.0], [self.START[1], 1.0]
        else:
            w = self.PRIOR_WEIGHT
            self._first, self._onward = [prior.first * w, w], [prior.onward * w, w]

    def __repr__(self) -> str:
        return f"AcceptanceRates(first={self.first:.3f}, onward={self.onward:.3f})"

    @property
    def first(self) -> float:
        return _rate(self._first)

    @property
    def onward(self) -> float:
        return _rate(self._onward)

    def observe(self, draft: DraftTree, accepted: list[int], *, open_end: bool = False) -> None:
        """Update with one step's draft and its accepted nodes (root to leaf); ``open_end``: the
        children of the last accepted node were not verified (no failure below it is known)."""
        onward_hits = max(len(accepted) - 1, 0)  # accepted nodes below an accepted node
        # the last one had a drafted child that was verified and failed
        failed_below = not open_end and bool(accepted) and accepted[-1] in draft.parents
        for counts, hits, tries in (
            (self._first, min(len(accepted), 1), 1 if draft.tokens else 0),
            (self._onward, onward_hits, onward_hits + failed_below),
        ):
            if tries:
                counts[0] = self.decay * counts[0] + hits
                counts[1] = self.decay * counts[1] + tries
            else:  # no evidence (no draft; for onward, single first tokens): drift back toward 1
                counts[0] = self.decay * counts[0] + self.PROBE
                counts[1] = self.decay * counts[1] + self.PROBE

    def learn(self, draft: DraftTree, tokens: list[int]) -> tuple[list[int], bool]:
        """Update from the tokens a step gained (bonus token included) on ``draft``, the weighed
        tree the step's draft was cut from; returns the nodes that spell them and whether even
        the bonus token was drafted (then nothing is known below the last: ``open_end``)."""
        nodes = draft.path_of(tokens)
        open_end = len(nodes) == len(tokens)
        self.observe(draft, nodes, open_end=open_end)
        return nodes, open_end

    def weigh(self, draft: DraftTree) -> DraftTree:
        """The draft with each node's chance of acceptance corrected by these rates (never above its parent's)."""
        scale = [0.0, self.first]  # by depth; built so that it never grows with depth, even by rounding
        for _ in range(max(draft.depths, default=0) - 1):
            scale.append(min(scale[-1], scale[-1] * self.onward))
        return replace(draft, probs=[p * scale[d] for p, d in zip(draft.probs, draft.depths)])


def _rate(counts: list[float]) -> float:
    """accepted / drafted; 1 once the decayed counts have faded to nothing (no evidence left)."""
    return counts[0] / counts[1] if counts[1] > 1e-9 else 1.0
