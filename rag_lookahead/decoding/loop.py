"""The decode loop: prefill, then propose -> verify -> accept until every row is done.

``generate`` is lossless: each row's tokens are exactly what ``model.generate`` gives for it
(greedy, or sampled under the same seed), but a step may accept several tokens when the draft
guessed them. ``DecodeBatch`` holds the state of the rows being decoded (one packed KV cache,
each row's tokens and drafter state) so that a server can drive the same loop step by step:

* ``propose``: the drafter's tree per row, weighed by the row's acceptance rates and cut to
  the nodes that pay for their cost in this forward (``costs.allocate``);
* ``verify_and_accept``: one forward over all trees (``verify``), each row's accepted path
  (``sampling``), its KV entries kept (``packed_cache``) and its tokens taken (``rows``);
* ``retire``: rows that are done leave the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import allocate, step_costs
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.drafter import Drafter, TrieDrafter
from rag_lookahead.decoding.inputs import as_batch, check_ids, check_references, context_limit, vocab_size
from rag_lookahead.decoding.packed_cache import PackedCache
from rag_lookahead.decoding.prefill import ChunkedPrefill, forward_feed, prefill_padded, step_feed
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.results import GenerationResult, GenerationStats, LogprobRecorder, assemble
from rag_lookahead.decoding.rows import Row
from rag_lookahead.decoding.sampling import (
    Accepted,
    SamplingParams,
    TokenChooser,
    longest_path,
    per_row,
    resolve_sampling,
)
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.decoding.verify import input_device, keep_accepted, supports_tree_mask
from rag_lookahead.errors import ConfigError, InputError

__all__ = ["DecodeBatch", "GenerationResult", "GenerationStats", "Row", "generate", "left_pad"]


class DecodeBatch:
    """Rows decoded together: one packed KV cache, the columns each row owns, one drafter for all rows.

    ``output_pool`` is the trie drafter's pool of earlier answers; pass ``drafter`` instead to
    draft otherwise (see ``drafter.Drafter``). ``config.enabled=False`` decodes plainly.
    ``prefill_chunk``: prompt tokens per step, all new rows together (chunked prefill, see
    ``prefill``); 0 prefills each ``add`` in one forward. ``max_draft_rows``: above this many
    rows no row drafts (every token's attention spans every row's columns, so a tree costs more
    the more rows share the cache); None: no limit.
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
        self.prefill = ChunkedPrefill(positive_int("prefill_chunk", prefill_chunk)) if prefill_chunk else None
        self.max_draft_rows = None if max_draft_rows is None else positive_int("max_draft_rows", max_draft_rows)

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
        max_new_tokens: int | Sequence[int] = 1,
        keys: Sequence | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        logprobs: Sequence[LogprobRecorder | None] | None = None,
    ) -> list[Row]:
        """Prefill new left-padded rows and merge them into the running batch.

        ``keys`` name the rows (default: their order of arrival); rows joining a running
        batch are how a server batches continuously. ``sampling``: one setting for all rows
        or one per row (default greedy); rows with different settings share the batch.
        ``logprobs``: per row, a recorder for its tokens' log-probabilities (None: not recorded).
        With ``prefill_chunk`` the rows only queue here: their prompts go through the next steps
        a chunk at a time, and each row's first token comes from the step that ends its prompt.
        """
        input_ids, attention_mask = as_batch(input_ids, attention_mask)
        check_ids(input_ids, attention_mask, self.vocab)
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
        for row, recorder in zip(rows, logprobs or [None] * count):
            if recorder is not None:
                self.logprobs[row] = recorder
        if self.prefill is not None:
            for row, row_references in zip(rows, references):
                self.prefill.queue(row, row_references)
            return rows
        cache, logits = prefill_padded(self.model, input_ids, attention_mask)
        for r, row in enumerate(rows):
            row.position = row.prompt_length
            self._first_token(row, logits[r, -1], references[r])
        self.packed.append_rows(cache, [row.prompt_length for row in rows])
        self.rows = self.rows + rows
        return rows

    def _new_rows(self, input_ids, attention_mask, max_new_tokens, keys, sampling, device) -> list[Row]:
        """The rows of left-padded prompts, with their budgets, keys and choosers; nothing in the cache yet."""
        count = input_ids.shape[0]
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * count
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
            )
            for r in range(count)
        ]

    def _first_token(self, row: Row, logits: torch.Tensor, references) -> list[int]:
        """The row's prompt is all in the cache: its first token, from the logits (V,) of its last
        prompt token (greedy as transformers does: fp32, the first maximum on ties); it starts drafting."""
        token = int(logits.float().argmax()) if row.chooser.plain else row.chooser.choose(row.prompt, logits)
        first = row.take([token], self.eos)
        recorder = self.logprobs.get(row)
        if recorder is not None:
            recorder.record(logits[None], first)
        self.drafter.start(row, references)
        return first

    def propose(self) -> list[DraftTree]:
        """Each row's draft tree, cut to the nodes that pay for themselves in this step; none at
        all above ``max_draft_rows`` rows."""
        if self.max_draft_rows is not None and len(self.rows) > self.max_draft_rows:
            return [DraftTree() for _ in self.rows]
        drafts = [row.acceptance.weigh(self._candidates(row)) for row in self.rows]
        counts = allocate(drafts, self.costs)
        return [draft.top(count) for draft, count in zip(drafts, counts)]

    def _candidates(self, row: Row) -> DraftTree:
        """The drafter's tree, cut to what the row may still accept (and to a chain without a tree mask)."""
        if not self.config.enabled or row.prefilling:
            return DraftTree()
        room = row.room - 1  # the bonus token needs no draft
        if room < 1:
            return DraftTree()
        draft = self.drafter.propose(row).limit_depth(room)
        return draft if self.tree_mask else draft.best_chain()

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
        logits, step = forward_feed(self.model, self.packed, feed)
        decoding = [r for r, row in enumerate(self.rows) if row not in chunks]
        found = self._accept(
            [self.rows[r] for r in decoding],
            logits[: feed.decoded],
            [feed.starts[r] for r in decoding],
            [drafts[r] for r in decoding],
        )
        accepted = dict(zip(decoding, found))
        for r, row in enumerate(self.rows):
            if row in chunks:  # a prompt chunk is kept whole: its root and every node of its chain
                accepted[r] = Accepted(list(range(len(chunks[row]) - 1)), [])
        keep_accepted(self.packed, start, step, [accepted[r] for r in range(len(self.rows))])
        gained = []
        for r, (row, draft) in enumerate(zip(self.rows, drafts)):
            if row in chunks:
                gained.append(self._prefilled(row, len(chunks[row]), logits, feed.starts[r]))
                continue
            result, offset = accepted[r], feed.starts[r]
            row.position += 1 + len(result.nodes)
            row.acceptance.observe(draft, result.nodes)
            gained.append(row.take(result.tokens, self.eos))
            recorder = self.logprobs.get(row)
            if recorder is not None:  # the logits that chose each token: the root's, then each accepted node's
                recorder.record(logits[[offset] + [offset + 1 + node for node in result.nodes]], gained[-1])
            self.drafter.observe(row, draft, result.nodes)
        if self.costs is not None and not chunks:  # the cost curve is of draft trees, not prompt chunks
            self.costs.observe(len(drafts), step.ids.shape[1], time.perf_counter() - tick)
        return gained

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
        return self._first_token(row, logits[start], self.prefill.references.pop(row, ()))

    def _accept(
        self, rows: list[Row], logits: torch.Tensor, offsets: list[int], drafts: list[DraftTree]
    ) -> list[Accepted]:
        """Each decoding row's accepted path (``logits``: theirs only, rows side by side): greedy rows
        from one argmax over all logits, the others by a walk that draws (or applies the repetition
        penalty) node by node."""
        ends = offsets[1:] + [logits.shape[0]]
        greedy = logits.float().argmax(dim=-1).tolist() if any(row.chooser.plain for row in rows) else []
        accepted = []
        for row, draft, start, end in zip(rows, drafts, offsets, ends):
            if row.chooser.plain:
                accepted.append(longest_path(draft, greedy[start:end]))
            else:
                accepted.append(row.chooser.walk(draft, logits[start:end], row.tokens, row.room, self.eos))
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
            if not row.prefilling:  # the drafter never saw a row that had no token yet
                self.drafter.retire(row)
            self.logprobs.pop(row, None)
        if len(stay) != len(self.rows):
            self.rows = [self.rows[i] for i in stay]
            self.packed.drop_rows(stay)
        return left


def left_pad(rows: Sequence[Sequence[int]], pad: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as a left-padded (ids, attention_mask) pair."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def _eos_set(model, eos_token_id) -> frozenset[int]:
    """The ids that end a row: the argument, else the model's generation config (no tokenizer here)."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(t) for t in eos_token_id)


def _pad_id(model, pad_token_id, eos: frozenset[int]) -> int:
    """The id that right-pads the output: the argument, else the model's, else an EOS id, else 0."""
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = min(eos) if eos else 0
    return int(pad_token_id)


def generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_new_tokens: int,
    config: LookaheadConfig | None = None,
    references: Sequence[Sequence[Sequence[int]]] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    output_pool: OutputPool | None = None,
    drafter: Drafter | None = None,
    on_tokens: Callable[[int, list[int]], bool | None] | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | Sequence[int] | None = None,
    generation_config=None,
    logprobs: int | None = None,
    prefill_chunk: int = 0,
) -> GenerationResult:
    """Lossless decoding, several tokens a forward where the drafts guess right.

    (Long only in its keywords, named as ``model.generate`` names them, and their description;
    the work is in ``_checked_inputs``, ``DecodeBatch`` and ``_decode``.)

    Greedy or sampled exactly as ``model.generate`` would for the same arguments: the sampling
    options (``do_sample`` ... ``repetition_penalty``, or a ``transformers.GenerationConfig``)
    default to the model's generation config, then transformers' defaults. Without ``seed`` a
    single row draws from torch's global generator in transformers' order, so after
    ``torch.manual_seed(s)`` the tokens equal ``model.generate``'s; with ``seed`` (an int for
    every row, or one per row) each row draws from its own generator and its tokens do not
    depend on the batch or on the drafts.

    input_ids: a list of ids, or a (batch, length) tensor left-padded per ``attention_mask``.
    references: per row, token-id sequences to draft from (passages that are not in the prompt;
        the trie drafter puts them in the row's context pool).
    output_pool: n-grams of earlier answers to draft from; defaults to one shared per model
        (and trie depth), kept in the model's ``ModelProfile``.
    drafter: what proposes the drafts (see ``drafter.Drafter``), e.g. ``PromptLookupDrafter()``;
        default: the trie drafter of ``config`` with ``output_pool``.
    on_tokens(row, tokens): called as each row's tokens are accepted; return True to end that
        row there (a stop string was seen, the client left).
    logprobs: record each new token's log-probability under the model (``results``) with the
        ``logprobs`` most likely tokens at its place (0: none); in ``result.logprobs``.
    prefill_chunk: prompt tokens per forward (chunked prefill, see ``prefill``; the same tokens);
        0: each prompt in one forward.
    """
    config = config or LookaheadConfig()
    positive_int("max_new_tokens", max_new_tokens)
    ids, mask, references = _checked_inputs(model, input_ids, attention_mask, references)
    params = resolve_sampling(
        model,
        generation_config,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    sampling = per_row(params, seed, ids.shape[0])
    eos = _eos_set(model, eos_token_id)
    pad = _pad_id(model, pad_token_id, eos)
    if drafter is None and output_pool is None and config.enabled and config.use_output_pool:
        output_pool = profile_of(model).output_pool(
            config.branch_length + config.max_key_length, config.output_pool_nodes
        )
    if ids.shape[0] > 1 and not supports_tree_mask(model):  # packed rows are kept apart by the mask
        settings = dict(
            config=config,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
            output_pool=output_pool,
            logprobs=logprobs,
            prefill_chunk=prefill_chunk,
        )
        return _row_by_row(
            model, ids, mask, references, on_tokens, sampling, max_new_tokens, drafter=drafter, **settings
        )

    stats = GenerationStats(rows=ids.shape[0], trace=[] if config.debug else None)
    batch = DecodeBatch(model, config, eos, output_pool, drafter, prefill_chunk=prefill_chunk)
    start = time.perf_counter()
    recorders = None if logprobs is None else [LogprobRecorder(logprobs) for _ in range(ids.shape[0])]
    batch.add(ids, mask, references, max_new_tokens, sampling=sampling, logprobs=recorders)
    stats.prefill_seconds = time.perf_counter() - start
    outputs = _decode(batch, stats, on_tokens)
    sequences = assemble(ids, [outputs[r] for r in range(ids.shape[0])], pad)
    return GenerationResult(sequences, stats, None if recorders is None else [r.entries for r in recorders])


def _checked_inputs(model, input_ids, attention_mask, references):
    """``(ids, mask, references)`` checked and on the model's input device; the longest row must
    leave room in the context window for at least one new token."""
    ids, mask = as_batch(input_ids, attention_mask)
    check_ids(ids, mask, vocab_size(model))
    references = check_references(references, ids.shape[0], vocab_size(model))
    device = input_device(model)
    ids, mask = ids.to(device), mask.to(device)
    limit = context_limit(model)
    longest = int(mask.sum(-1).max())
    if limit is not None and longest >= limit:
        raise InputError(f"the input has {longest} tokens but the model's context holds {limit}")
    return ids, mask, references


def _decode(
    batch: DecodeBatch, stats: GenerationStats, on_tokens: Callable[[int, list[int]], bool | None] | None
) -> dict[int, list[int]]:
    """Step the batch until every row is done or stopped; each row's new tokens by its index."""
    outputs: dict[int, list[int]] = {}

    def notify(row: Row, tokens: list[int]) -> bool:
        return bool(on_tokens(row.index, tokens)) if on_tokens is not None and tokens else False

    stopped = {row.index for row in batch.rows if notify(row, row.generated)}
    start = time.perf_counter()
    while True:
        for row in batch.retire(lambda row: row.index not in stopped):
            outputs[row.index] = row.generated
        if not batch.size:
            break
        tick = time.perf_counter()
        drafts = batch.propose()
        lookup = time.perf_counter() - tick
        gained = batch.verify_and_accept(drafts)
        for row, tokens in zip(batch.rows, gained):
            if notify(row, tokens):
                stopped.add(row.index)
        stats.record_step(drafts, gained, lookup, time.perf_counter() - tick)
    stats.decode_seconds = time.perf_counter() - start
    stats.new_tokens = sum(len(t) for t in outputs.values())
    return outputs


def _as_options(params: SamplingParams) -> dict:
    """A row's settings as ``generate`` keywords (top_k 0 = off, so it is not taken from defaults)."""
    return {
        "do_sample": params.do_sample,
        "temperature": params.temperature,
        "top_k": params.top_k or 0,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
    }


def _row_by_row(model, ids, mask, references, on_tokens, sampling, max_new_tokens, **settings) -> GenerationResult:
    """Models without tree masks cannot batch ragged rows; decode each row alone (``settings``:
    the batch's other ``generate`` keywords)."""
    outputs, total, logprobs = [], GenerationStats(rows=ids.shape[0]), []
    for r in range(ids.shape[0]):
        length = int(mask[r].sum())
        result = generate(
            model,
            ids[r : r + 1, ids.shape[1] - length :],
            max_new_tokens=max_new_tokens,
            references=[references[r]] if references else None,
            on_tokens=(lambda _row, tokens, r=r: on_tokens(r, tokens)) if on_tokens else None,
            **settings,
            **_as_options(sampling[r]),
        )
        outputs.append(result.sequences[0, length:].tolist())
        total.add(result.stats)
        logprobs.extend(result.logprobs or [])
    sequences = assemble(ids, outputs, pad=settings["pad_token_id"])
    return GenerationResult(sequences, total, logprobs if settings["logprobs"] is not None else None)
