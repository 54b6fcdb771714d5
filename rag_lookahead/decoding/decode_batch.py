"""``DecodeBatch``: the rows being decoded together, stepped by ``generate`` and by the server.

It holds one packed KV cache (``packed_cache``), each row's tokens (``rows``) and the drafter's
state, and runs the loop's steps:

* ``add``: new rows; their prompts are prefilled at once, or queued and fed a chunk per step
  (``prefill``) so that a long prompt never stalls the rows already decoding;
* ``propose``: the drafter's tree per row, weighed by the row's acceptance rates and cut to
  the nodes that pay for their cost in this forward (``costs.allocate``);
* ``verify_and_accept``: one forward over all trees and prompt chunks (``verify``), each row's
  accepted path (``sampling``), its KV entries kept (``packed_cache``) and its tokens taken;
* ``retire``: rows that are done leave the batch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex

import torch

from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.acceptance import AcceptanceRates
from rag_lookahead.decoding.config import LookaheadConfig, config_or_default
from rag_lookahead.decoding.costs import allocate, step_costs
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.drafter import Drafter, PromptLookupDrafter, TrieDrafter
from rag_lookahead.decoding.inputs import (
    as_batch,
    check_ids,
    check_model,
    check_references,
    check_room,
    context_limit,
    vocab_size,
)
from rag_lookahead.decoding.packed_cache import PackedCache
from rag_lookahead.decoding.prefill import ChunkedPrefill, forward_feed, prefill_padded, step_feed
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.results import LogprobRecorder
from rag_lookahead.decoding.rows import Row
from rag_lookahead.decoding.sampling import Accepted, SamplingParams, TokenChooser, longest_paths
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.decoding.verify import input_device, keep_accepted, supports_tree_mask
from rag_lookahead.decoding.windows import check_layers
from rag_lookahead.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

WORKLOAD_DECAY = 0.97  # the model's rates follow the last few dozen row-steps
#: most (padded) prompt tokens in one prefill forward; rows joining together are prefilled in
#: groups up to this size (32 prompts of ~200 tokens on a 2-core CPU: 137 tokens/s in one
#: forward, 170-175 in groups of 4-8, 137 one by one: huge activations spill out of cache)
PREFILL_FORWARD_TOKENS = 1024

#: Above this many rows nobody drafts, by device type (absent: no limit). CPU: on a 2-core Xeon
#: (default model, bf16, 32 rows) drafted steps gained 3-10% over plain ones and whole runs lost
#: 3-11% against drafting off (rows finish out of step: smaller prefills, a drained tail), and
#: the budget, scaling a one-row cost curve, put a 58-token step of 32 rows at 1.28-1.55x a plain
#: one where it cost 1.70x; at 8-24 rows drafted steps gained 19-70%.
MAX_DRAFT_ROWS: dict[str, int] = {"cpu": 24}

__all__ = ["DecodeBatch"]


def row_budgets(max_new_tokens, count: int) -> list[int]:
    """Each row's ``max_new_tokens``: one for all rows or one per row, each an integer >= 1
    (ConfigError otherwise). A numpy integer was indexed as a list (IndexError), 0 or a negative
    budget ran a row that could never end on a token, and a list of another length failed or was
    silently cut."""
    if getattr(max_new_tokens, "ndim", 0) == 1:  # a numpy array or a tensor of one per row
        max_new_tokens = max_new_tokens.tolist()
    if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes)):
        if len(max_new_tokens) != count:
            raise ConfigError(f"max_new_tokens has {len(max_new_tokens)} entries for {count} rows")
        return [positive_int("max_new_tokens", budget) for budget in max_new_tokens]
    return [positive_int("max_new_tokens", max_new_tokens)] * count


class DecodeBatch:
    """Rows decoded together: one packed KV cache, the columns each row owns, one drafter for all rows.

    ``output_pool`` is the trie drafter's pool of earlier answers; pass ``drafter`` instead to
    draft otherwise (see ``drafter.Drafter``). ``config.enabled=False`` decodes plainly.
    ``prefill_chunk``: prompt tokens per step, all new rows together (chunked prefill, see
    ``prefill``); 0 prefills each ``add`` in one forward. ``max_draft_rows``: above this many
    rows no row drafts (None: ``MAX_DRAFT_ROWS`` for the model's device under the cost budget,
    no limit under ``budget="fixed"``; where row-local
    attention does not apply, e.g. eager or remote-code models, every token's attention spans
    every row's columns, so a tree costs more the more rows share the cache; see ``row_attention``).
    """

    def __init__(
        self,
        model,
        config: LookaheadConfig,
        eos: frozenset[int],
        output_pool: OutputPool | None,
        drafter: Drafter | None = None,
        *,
        prefill_chunk: int = 0,
        max_draft_rows: int | None = None,
    ) -> None:
        if drafter is not None and output_pool is not None:
            raise ConfigError("output_pool is the trie drafter's: pass TrieDrafter(config, output_pool) as the drafter")
        check_model(model)
        check_layers(model)
        config = config_or_default(config)
        self.model = model
        self.config = config
        self.eos = eos
        self.drafter = drafter if drafter is not None else TrieDrafter(config, output_pool)
        self.tree_mask = supports_tree_mask(model)  # also what keeps packed rows apart
        self.costs = step_costs(model) if config.enabled and config.budget == "auto" else None
        self.context_limit = context_limit(model)
        self.vocab = vocab_size(model)
        self.rows: list[Row] = []
        self.logprobs: dict[Row, LogprobRecorder] = {}  # the rows that asked for log-probabilities
        self._arrivals = 0
        self.packed = PackedCache()  # every row's KV entries, side by side
        # what this drafter's drafts met lately on this model, over all rows and calls: where new rows start
        self.workload = profile_of(model).acceptance(
            type(self.drafter).__name__, lambda: AcceptanceRates(decay=WORKLOAD_DECAY)
        )
        self.prefill = ChunkedPrefill(positive_int("prefill_chunk", prefill_chunk)) if prefill_chunk else None
        if max_draft_rows is None:  # the measured cap belongs to the cost budget; a fixed budget drafts always
            self.max_draft_rows = MAX_DRAFT_ROWS.get(input_device(model).type) if self.costs is not None else None
        else:
            self.max_draft_rows = positive_int("max_draft_rows", max_draft_rows)

    @property
    def size(self) -> int:
        """Rows in the batch, with those still waiting for their first prompt chunk."""
        return len(self.rows) + (len(self.prefill) if self.prefill is not None else 0)

    @torch.inference_mode()
    def add(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        references=None,
        max_new_tokens: SupportsIndex | Sequence[SupportsIndex] | torch.Tensor | npt.NDArray[np.integer[Any]] = 1,
        keys: Sequence | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        logprobs: Sequence[LogprobRecorder | None] | None = None,
        stop_check: Callable[[Any, list[int]], bool] | None = None,
    ) -> list[Row]:
        """Prefill new left-padded rows and merge them into the running batch.

        ``keys`` name the rows (default: their order of arrival); rows joining a running
        batch are how a server batches continuously. ``sampling``: one setting for all rows
        or one per row (default greedy); rows with different settings share the batch.
        ``logprobs``: per row, a recorder for its tokens' log-probabilities (None: not recorded).
        ``stop_check(key, tokens)``: asked after each token a row chooses, its first included, with
        the step's tokens so far; True ends the row there, before its next draw
        (``TokenChooser.stop_after``).
        With ``prefill_chunk`` the rows only queue here: their prompts go through the next steps
        a chunk at a time, and each row's first token comes from the step that ends its prompt.
        """
        input_ids, attention_mask = as_batch(input_ids, attention_mask)
        check_ids(input_ids, self.vocab)
        check_room(self.model, attention_mask)
        count = input_ids.shape[0]
        if not self.tree_mask and self.size + count > 1:
            raise ConfigError(
                f"{type(self.model).__name__}'s attention ignores custom masks, so rows cannot share a batch: "
                "decode one row at a time (generate() does this by itself)"
            )
        references = check_references(references, count, self.vocab) or [()] * count
        device = input_device(self.model)  # callers may build ids on the CPU
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        rows = self._new_rows(input_ids, attention_mask, max_new_tokens, keys, sampling, device)
        if stop_check is not None:  # before the prefill: it chooses the first tokens
            for row in rows:
                row.chooser.stop_after = functools.partial(stop_check, row.index)
        for row, recorder in zip(rows, logprobs or [None] * count):
            if recorder is not None:
                self.logprobs[row] = recorder
        if self.prefill is not None:
            for row, row_references in zip(rows, references):
                self.prefill.queue(row, row_references)
            return rows
        lengths = [row.prompt_length for row in rows]
        recorded = {row: len(self.logprobs[row].entries) for row in rows if row in self.logprobs}
        try:
            prefilled = []
            for group in prefill_groups(lengths, PREFILL_FORWARD_TOKENS):
                width = max(lengths[group])  # the group's own padding only
                cache, logits = prefill_padded(self.model, input_ids[group, -width:], attention_mask[group, -width:])
                for r, row in enumerate(rows[group]):
                    row.position = row.prompt_length
                    self._first_token(row, logits[r, -1], references[group][r])
                prefilled.append((cache, lengths[group]))
            with self.packed.all_or_nothing():  # every group's prefill succeeded: merge them all, or none
                for cache, group_lengths in prefilled:
                    self.packed.append_rows(cache, group_lengths)
        except BaseException:
            self._forget(rows, recorded)
            raise
        self.rows = self.rows + rows
        return rows

    def _forget(self, rows: list[Row], recorded: dict[Row, int]) -> None:
        """Undo what a failed ``add`` did for its rows (none of them is in the batch): the tokens
        recorded into the callers' log-probability recorders (a server retries the same request
        with the same recorder), and the drafter's state of the rows it started."""
        for row in rows:
            recorder = self.logprobs.pop(row, None)
            if recorder is not None:
                del recorder.entries[recorded.get(row, 0) :]
            if row.drafting:
                row.drafting = False
                self.drafter.retire(row)

    def _new_rows(self, input_ids, attention_mask, max_new_tokens, keys, sampling, device) -> list[Row]:
        """The rows of left-padded prompts, with their budgets, keys and choosers; nothing in the cache yet."""
        count = input_ids.shape[0]
        max_new_tokens = row_budgets(max_new_tokens, count)
        if keys is not None and len(keys) != count:
            raise ConfigError(f"keys has {len(keys)} entries for {count} rows")
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * count
        if len(sampling) != count:
            raise ConfigError(f"sampling has {len(sampling)} entries for {count} rows")
        if keys is None:
            keys = list(range(self._arrivals, self._arrivals + count))
        self._arrivals += count
        lengths = attention_mask.sum(-1).tolist()
        width = input_ids.shape[1]
        return [
            Row(
                keys[r],
                input_ids[r, width - lengths[r] :].tolist(),
                max_new_tokens[r],
                TokenChooser(sampling[r], device),
                self.context_limit,
                acceptance=AcceptanceRates(prior=self.workload),
            )
            for r in range(count)
        ]

    def _first_token(self, row: Row, logits: torch.Tensor | int, references) -> list[int]:
        """The row's prompt is all in the cache: its first token, from the logits (V,) of its last
        prompt token (greedy as transformers does: fp32, the first maximum on ties; or that token
        itself, from a greedy-only step); it starts drafting."""
        if isinstance(logits, int):
            token = logits
        else:
            token = int(logits.float().argmax()) if row.chooser.plain else row.chooser.choose(row.prompt, logits)
        first = row.take([token], self.eos, stopped=row.chooser.stops([token]))
        recorder = self.logprobs.get(row)
        if recorder is not None:
            recorder.record(logits[None], first)
        self.drafter.start(row, references)
        row.drafting = True
        return first

    def propose(self) -> list[DraftTree]:
        """Each row's draft tree, cut to the nodes that pay for themselves in this step; none at
        all above ``max_draft_rows`` rows."""
        if self.max_draft_rows is not None and len(self.rows) > self.max_draft_rows:
            return [DraftTree() for _ in self.rows]
        drafts = [row.acceptance.weigh(self._candidates(row)) for row in self.rows]
        for row, draft in zip(self.rows, drafts):
            row.candidates = draft
        counts = allocate(drafts, self.costs)
        return [draft.top(count) for draft, count in zip(drafts, counts)]

    def _candidates(self, row: Row) -> DraftTree:
        """The drafter's tree, cut to what the row may still accept (and to a chain without a tree mask)."""
        if not self.config.enabled or row.prefilling or row.done:
            return DraftTree()
        return row_candidates(self.drafter, row, self.tree_mask, self.vocab)

    @torch.inference_mode()
    def verify_and_accept(self, drafts: list[DraftTree]) -> list[list[int]]:
        """One forward over all trees and this step's prompt chunks; returns the tokens each row
        gained, by ``rows`` after the step (rows whose first prompt chunk came in this step join
        last; a row gains its first token with its prompt's last chunk, nothing before)."""
        tick = time.perf_counter()
        chunks = self._take_chunks()
        drafts = list(drafts) + [DraftTree() for _ in range(len(self.rows) - len(drafts))]
        start = self.packed.length
        feed = step_feed(self.rows, drafts, chunks)
        greedy_only = not self.logprobs and all(row.chooser.plain for row in self.rows)
        logits, step = forward_feed(self.model, self.packed, feed, greedy_only=greedy_only)
        # a row done before this step (not retired yet) gains nothing, nor draws from a generator
        finished = {r for r, row in enumerate(self.rows) if row.done}
        decoding = [r for r, row in enumerate(self.rows) if row not in chunks and r not in finished]
        found = self._accept(
            [self.rows[r] for r in decoding],
            logits[: feed.decoded],
            [feed.starts[r] for r in decoding],
            [drafts[r] for r in decoding],
        )
        accepted = dict(zip(decoding, found)) | {r: Accepted([], []) for r in finished}
        for r, row in enumerate(self.rows):
            if row in chunks:  # a prompt chunk is kept whole: its root and every node of its chain
                accepted[r] = Accepted(list(range(len(chunks[row]) - 1)), [])
        keep_accepted(self.packed, start, step, [accepted[r] for r in range(len(self.rows))])
        gained = []
        for r, (row, draft) in enumerate(zip(self.rows, drafts)):
            if row in chunks:
                gained.append(self._prefilled(row, len(chunks[row]), logits, feed.starts[r]))
                continue
            if row.failure is not None or r in finished:  # failed this step or done before: its root column only
                row.position += 1
                row.done = True
                gained.append([])
                continue
            result, offset = accepted[r], feed.starts[r]
            row.position += 1 + len(result.nodes)
            self._learn(row, draft, result)
            gained.append(row.take(result.tokens, self.eos, stopped=result.stopped))
            recorder = self.logprobs.get(row)
            if recorder is not None:  # the logits that chose each token: the root's, then each accepted node's
                recorder.record(logits[[offset] + [offset + 1 + node for node in result.nodes]], gained[-1])
            self.drafter.observe(row, draft, result.nodes)
        if self.costs is not None and not chunks:  # the cost curve is of draft trees, not prompt chunks
            self.costs.observe(len(drafts), step.ids.shape[1], time.perf_counter() - tick)
        return gained

    def raise_row_failure(self) -> None:
        """Raise the first failed row's failure, for callers that own every row (``generate``, the
        benchmarks); a server instead fails only that row's request (``Row.failure``)."""
        failed = next((row.failure for row in self.rows if row.failure is not None), None)
        if failed is not None:
            raise failed

    def _learn(self, row: Row, draft: DraftTree, result: Accepted) -> None:
        """Update the row's acceptance rates (and the workload's) from this step.

        Judged on the whole weighed tree the draft was cut from, not only the verified nodes:
        the bonus token is the model's own next token, so it also says whether the first node
        the budget cut below the accepted path would have been accepted. Without that, a row
        whose budget drafts one node at a time learns nothing about depth and stays shallow
        through a long copy (measured: 20 one-node steps where 10-token chains took 8)."""
        full = row.candidates if row.candidates is not None and len(row.candidates) >= len(draft) else draft
        row.candidates = None
        nodes, open_end = row.acceptance.learn(full, result.tokens)
        if full.tokens:
            self.workload.observe(full, nodes, open_end=open_end)

    def _take_chunks(self) -> dict[Row, list[int]]:
        """This step's prompt chunks by row; rows whose first chunk comes now join ``rows`` (and the cache)."""
        if self.prefill is None:
            return {}
        joining, chunks = self.prefill.plan(self.rows)
        if joining:
            self.packed.add_rows(len(joining))
            self.rows = self.rows + joining
        return chunks

    def _prefilled(self, row: Row, size: int, logits: torch.Tensor, start: int) -> list[int]:
        """``size`` more prompt tokens of ``row`` are in the cache; if they ended its prompt, its first
        token (from ``logits[start]``, its last prompt token's)."""
        row.position += size
        if row.prefilling:
            return []
        references = self.prefill.references.pop(row, ())
        try:
            return self._first_token(row, logits[start], references)
        except Exception as e:  # noqa: BLE001 - this row's choice failed (its sampling): it alone ends
            row.failure, row.done = e, True
            return []

    def _accept(
        self, rows: list[Row], logits: torch.Tensor, offsets: list[int], drafts: list[DraftTree]
    ) -> list[Accepted]:
        """Each decoding row's accepted path (``logits``: theirs only, rows side by side; or, when
        every row is greedy, just their argmax tokens): greedy rows from one argmax over all
        logits, the others by a walk that draws (or applies the repetition penalty) node by node."""
        ends = offsets[1:] + [len(logits)]
        if not isinstance(logits, torch.Tensor):
            greedy = logits
        else:
            greedy = logits.float().argmax(dim=-1).tolist() if any(row.chooser.plain for row in rows) else []
        plain = [r for r, row in enumerate(rows) if row.chooser.plain]
        paths = dict(zip(plain, longest_paths([drafts[r] for r in plain], greedy, [offsets[r] for r in plain])))
        accepted = []
        for r, (row, draft, start, end) in enumerate(zip(rows, drafts, offsets, ends)):
            try:
                if r in paths:
                    accepted.append(row.chooser.cut_at_stop(paths[r], row.room, self.eos))
                else:
                    accepted.append(row.chooser.walk(draft, logits[start:end], row.tokens, row.room, self.eos))
            except Exception as e:  # noqa: BLE001 - NaN logits, a caller's stop check failing: this row alone ends
                row.failure = e
                accepted.append(Accepted([], []))
        return accepted

    def retire(self, keep: Callable[[Row], bool] | None = None) -> list[Row]:
        """Take the finished rows (and any that ``keep`` rejects, also among those waiting for their
        prompt's first chunk) out of the batch; return them."""
        keep = keep or (lambda row: True)
        left = self.prefill.drop(keep) if self.prefill is not None else []
        stay = [i for i, row in enumerate(self.rows) if not row.done and keep(row)]
        staying = set(stay)
        left += [row for i, row in enumerate(self.rows) if i not in staying]
        for row in left:
            row.done = True
            if self.prefill is not None:
                self.prefill.references.pop(row, None)
            if row.drafting:  # the drafter never saw a row that had no token yet (or whose first failed)
                row.drafting = False
                self.drafter.retire(row)
            self.logprobs.pop(row, None)
        if len(stay) != len(self.rows):
            self.rows = [self.rows[i] for i in stay]
            self.packed.drop_rows(stay)
        return left


_OWN_DRAFTERS = (TrieDrafter, PromptLookupDrafter)


def row_candidates(drafter: Drafter, row: Row, tree_mask: bool, vocab: int | None = None) -> DraftTree:
    """``drafter``'s tree for a decoding row, cut to what the row may still accept (and to ids
    below ``vocab``), and to its likeliest chain without a tree mask (``bench.replay`` drafts
    through this too)."""
    room = row.room - 1  # the bonus token needs no draft
    if room < 1:
        return DraftTree()
    draft = drafter.propose(row)
    if type(drafter) not in _OWN_DRAFTERS:  # a user's tree is checked before its depths become positions
        draft = draft.checked()
    draft = draft.limit_depth(room)
    if vocab is not None:
        draft = draft.within_vocab(vocab)
    return draft if tree_mask else draft.best_chain()


def prefill_groups(lengths: Sequence[int], most_tokens: int) -> list[slice]:
    """Consecutive groups of rows whose padded size (rows x longest prompt) stays within
    ``most_tokens``; a longer prompt forms a group of its own."""
    groups, start, longest = [], 0, 0
    for r, length in enumerate(lengths):
        longest = max(longest, length)
        if r > start and longest * (r + 1 - start) > most_tokens:
            groups.append(slice(start, r))
            start, longest = r, length
    if lengths:
        groups.append(slice(start, len(lengths)))
    return groups
