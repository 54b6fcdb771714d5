"""The decode loop: prefill, then (propose -> verify -> accept) until every row is done.

``generate`` is greedy and lossless: each row's tokens are exactly what
``model.generate(do_sample=False)`` gives for it, but a step may accept several tokens when
the drafted tree guessed them. ``DecodeBatch`` holds the state of the rows being decoded
(KV cache, which cache columns each row may see, each row's trie) so that a server can drive
the same loop step by step.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import Trust, allocate, step_costs
from rag_lookahead.decoding.draft import DraftTree, propose
from rag_lookahead.decoding.inputs import as_batch, check_ids, check_references, vocab_size
from rag_lookahead.decoding.packed_cache import PackedCache
from rag_lookahead.decoding.sampling import (
    Accepted,
    SamplingParams,
    TokenChooser,
    longest_path,
    per_row,
    resolve_sampling,
)
from rag_lookahead.decoding.trie import ContextPool, OutputPool
from rag_lookahead.decoding.verify import check_cache, forward_tree, input_device, keep_accepted, supports_tree_mask
from rag_lookahead.errors import ConfigError, InputError


@dataclass
class GenerationStats:
    rows: int = 0
    forward_passes: int = 0  # decode forwards after the prefill
    new_tokens: int = 0  # over all rows, the prefill's token included
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    lookup_seconds: float = 0.0  # trie lookups, draft building and sizing
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


@dataclass
class GenerationResult:
    sequences: torch.LongTensor  # the prompt as given + new tokens, right-padded with the pad id
    stats: GenerationStats


@dataclass
class _Row:
    index: object  # the row's key: its row in generate's batch, a request id in a server
    context: ContextPool  # its stream is the row's text so far: prompt + generated
    trust: Trust
    max_new_tokens: int
    chooser: TokenChooser
    prompt_length: int = 0
    generated: list[int] = field(default_factory=list)
    position: int = 0  # cache entries this row owns = position id of its pending token
    done: bool = False

    @property
    def length(self) -> int:
        """Tokens of the row's text so far: prompt + generated."""
        return self.prompt_length + len(self.generated)

    @property
    def pending(self) -> int:
        return self.generated[-1]


_OUTPUT_POOLS: weakref.WeakKeyDictionary[torch.nn.Module, OutputPool] = weakref.WeakKeyDictionary()


def default_output_pool(model, config: LookaheadConfig) -> OutputPool:
    """The output pool shared by every call on this model that does not bring its own."""
    pool = _OUTPUT_POOLS.get(model)
    if pool is None:
        pool = _OUTPUT_POOLS[model] = OutputPool(config.branch_length + config.max_key_length, config.output_pool_nodes)
    return pool


def _eos_set(model, eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(t) for t in eos_token_id)


def _context_limit(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


class DecodeBatch:
    """Rows decoded together: one KV cache, a validity mask over its columns, a trie per row."""

    def __init__(self, model, config: LookaheadConfig, eos: frozenset[int], output_pool: OutputPool | None) -> None:
        self.model = model
        self.config = config
        self.eos = eos
        self.output_pool = output_pool if config.use_output_pool else None
        self.tree_mask = supports_tree_mask(model)  # also what keeps packed rows apart
        self.costs = step_costs(model) if config.enabled and config.budget == "auto" else None
        self.context_limit = _context_limit(model)
        self.vocab = vocab_size(model)
        self.rows: list[_Row] = []
        self._arrivals = 0
        self.packed = PackedCache()  # every row's KV entries, side by side

    @torch.inference_mode()
    def add(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        references=None,
        max_new_tokens: int | Sequence[int] = 1,
        keys: Sequence | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[_Row]:
        """Prefill new left-padded rows and merge them into the running batch.

        ``keys`` name the rows (default: their order of arrival); rows joining a running
        batch are how a server batches continuously. ``sampling``: one setting for all rows
        or one per row (default greedy); rows with different settings share the batch.
        """
        from transformers import DynamicCache

        depth = self.config.branch_length + self.config.max_key_length
        input_ids, attention_mask = as_batch(input_ids, attention_mask)
        check_ids(input_ids, attention_mask, self.vocab)
        count = input_ids.shape[0]
        if not self.tree_mask and len(self.rows) + count > 1:
            raise ConfigError(
                f"{type(self.model).__name__}'s attention ignores custom masks, so rows cannot share a batch: "
                "decode one row at a time (generate() does this by itself)"
            )
        references = check_references(references, count, self.vocab)
        device = input_device(self.model)  # callers may build ids on the CPU
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * count
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * count
        if len(sampling) != count:
            raise ConfigError(f"sampling has {len(sampling)} entries for {count} rows")
        if keys is None:
            keys = list(range(self._arrivals, self._arrivals + count))
        self._arrivals += count
        cache = DynamicCache(config=self.model.config)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        check_cache(cache)
        greedy = logits[:, -1].float().argmax(-1).tolist()  # as transformers does: fp32 logits, first maximum on ties
        lengths = attention_mask.sum(-1).tolist()
        rows = []
        for r in range(count):
            prompt = input_ids[r, input_ids.shape[1] - lengths[r] :].tolist()
            context = ContextPool(depth, references[r] if references else ())
            context.extend(prompt)
            chooser = TokenChooser(sampling[r], device)
            row = _Row(
                keys[r], context, Trust(), max_new_tokens[r], chooser, prompt_length=lengths[r], position=lengths[r]
            )
            first = greedy[r] if chooser.plain else chooser.choose(prompt, logits[r, -1])
            self._take(row, [first])
            rows.append(row)
        self.packed.append_rows(cache, lengths)
        self.rows = self.rows + rows
        return rows

    def _room(self, row: _Row) -> int:
        """Tokens the row may still gain: its token budget, and the context window, which holds
        ``context_limit`` tokens (prompt + generated) in all."""
        room = row.max_new_tokens - len(row.generated)
        if self.context_limit is not None:
            room = min(room, self.context_limit - row.length)
        return max(room, 0)

    def _take(self, row: _Row, tokens: list[int]) -> list[int]:
        """Append accepted tokens, cut at EOS, the token budget or the context end.

        The room is counted before the tokens are added; a block cut short always ends the row,
        so a running row's KV cache and ``generated`` stay in step.
        """
        room = self._room(row)
        tokens = tokens[:room]
        for i, token in enumerate(tokens):
            if token in self.eos:
                tokens = tokens[: i + 1]
                break
        row.generated.extend(tokens)
        row.context.extend(tokens)
        if not tokens or tokens[-1] in self.eos or self._room(row) == 0:
            row.done = True
        return tokens

    def propose(self) -> list[DraftTree]:
        """Each row's draft tree, cut to the nodes that pay for themselves in this step."""
        drafts = [row.trust.weigh(self._candidates(row)) for row in self.rows]
        counts = allocate(drafts, self.costs)
        return [draft.top(count) for draft, count in zip(drafts, counts)]

    def _candidates(self, row: _Row) -> DraftTree:
        if not self.config.enabled:
            return DraftTree()
        room = self._room(row) - 1  # the bonus token needs no draft
        if room < 1:
            return DraftTree()
        draft = propose(row.context, self.output_pool, self.config).limit_depth(room)
        return draft if self.tree_mask else draft.best_chain()

    @torch.inference_mode()
    def verify_and_accept(self, drafts: list[DraftTree]) -> list[list[int]]:
        """One forward over all trees; returns the tokens each row gained."""
        tick = time.perf_counter()
        start = self.packed.length
        pending = [row.pending for row in self.rows]
        logits, step = forward_tree(self.model, self.packed, pending, drafts, [row.position for row in self.rows])
        accepted = self._accept(logits, step.offsets, drafts)
        keep_accepted(self.packed, start, step, accepted)
        gained = []
        for row, draft, result in zip(self.rows, drafts, accepted):
            row.position += 1 + len(result.nodes)
            row.trust.observe(draft, result.nodes)
            gained.append(self._take(row, result.tokens))
        if self.costs is not None:
            self.costs.observe(len(drafts), step.ids.shape[1], time.perf_counter() - tick)
        return gained

    def _accept(self, logits: torch.Tensor, offsets: list[int], drafts: list[DraftTree]) -> list[Accepted]:
        """Each row's accepted path: greedy rows from one argmax over all logits, the others by a
        walk that draws (or applies the repetition penalty) node by node."""
        ends = offsets[1:] + [logits.shape[0]]
        greedy = logits.float().argmax(dim=-1).tolist() if any(row.chooser.plain for row in self.rows) else []
        accepted = []
        for row, draft, start, end in zip(self.rows, drafts, offsets, ends):
            if row.chooser.plain:
                accepted.append(longest_path(draft, greedy[start:end]))
            else:
                accepted.append(
                    row.chooser.walk(draft, logits[start:end], row.context.stream, self._room(row), self.eos)
                )
        return accepted

    def finish(self, keep: Callable[[_Row], bool] | None = None) -> list[_Row]:
        """Drop the finished rows (and any that ``keep`` rejects) from the batch; return them."""
        keep = keep or (lambda row: True)
        stay = [i for i, row in enumerate(self.rows) if not row.done and keep(row)]
        if len(stay) == len(self.rows):
            return []
        staying = set(stay)
        left = [row for i, row in enumerate(self.rows) if i not in staying]
        for row in left:
            row.done = True
            if self.output_pool is not None:
                self.output_pool.add(row.generated)
        self.rows = [self.rows[i] for i in stay]
        self.packed.drop_rows(stay)
        return left


def left_pad(rows: Sequence[Sequence[int]], pad: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as a left-padded (ids, attention_mask) pair."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def _pad_id(model, pad_token_id, eos: frozenset[int]) -> int:
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
    on_tokens: Callable[[int, list[int]], bool | None] | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | Sequence[int] | None = None,
    generation_config=None,
) -> GenerationResult:
    """Lossless decoding, several tokens a forward where the trie guesses right.

    Greedy or sampled exactly as ``model.generate`` would for the same arguments: the sampling
    options (``do_sample`` ... ``repetition_penalty``, or a ``transformers.GenerationConfig``)
    default to the model's generation config, then transformers' defaults. Without ``seed`` a
    single row draws from torch's global generator in transformers' order, so after
    ``torch.manual_seed(s)`` the tokens equal ``model.generate``'s; with ``seed`` (an int for
    every row, or one per row) each row draws from its own generator and its tokens do not
    depend on the batch or on the drafts.

    input_ids: a list of ids, or a (batch, length) tensor left-padded per ``attention_mask``.
    references: per row, token-id sequences seeding that row's context pool (passages that
        are not in the prompt).
    output_pool: n-grams of earlier answers to draft from; defaults to one shared per model.
    on_tokens(row, tokens): called as each row's tokens are accepted; return True to end that
        row there (a stop string was seen, the client left).
    """
    config = config or LookaheadConfig()
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    device = input_device(model)
    ids, mask = as_batch(input_ids, attention_mask)
    check_ids(ids, mask, vocab_size(model))
    references = check_references(references, ids.shape[0], vocab_size(model))
    ids, mask = ids.to(device), mask.to(device)
    limit = _context_limit(model)
    longest = int(mask.sum(-1).max())
    if limit is not None and longest >= limit:
        raise InputError(f"the input has {longest} tokens but the model's context holds {limit}")
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
    if output_pool is None and config.enabled and config.use_output_pool:
        output_pool = default_output_pool(model, config)

    if ids.shape[0] > 1 and not supports_tree_mask(model):  # packed rows are kept apart by the mask
        return _row_by_row(
            model, ids, mask, max_new_tokens, config, references, eos, pad, output_pool, on_tokens, sampling
        )

    stats = GenerationStats(rows=ids.shape[0], trace=[] if config.debug else None)
    batch = DecodeBatch(model, config, eos, output_pool)
    start = time.perf_counter()
    batch.add(ids, mask, references, max_new_tokens, sampling=sampling)
    stats.prefill_seconds = time.perf_counter() - start
    outputs: dict[int, list[int]] = {}

    def notify(row: _Row, tokens: list[int]) -> bool:
        return bool(on_tokens(row.index, tokens)) if on_tokens is not None and tokens else False

    stopped = {row.index for row in batch.rows if notify(row, row.generated)}
    start = time.perf_counter()
    while True:
        for row in batch.finish(lambda row: row.index not in stopped):
            outputs[row.index] = row.generated
        if not batch.rows:
            break
        tick = time.perf_counter()
        drafts = batch.propose()
        lookup = time.perf_counter() - tick
        gained = batch.verify_and_accept(drafts)
        stats.forward_passes += 1
        stats.lookup_seconds += lookup
        for row, draft, tokens in zip(batch.rows, drafts, gained):
            stats.draft_tokens += len(draft)
            stats.accepted_histogram[len(tokens)] = stats.accepted_histogram.get(len(tokens), 0) + 1
            if notify(row, tokens):
                stopped.add(row.index)
        if stats.trace is not None:
            stats.trace.append(
                {
                    "step": stats.forward_passes,
                    "draft": [len(d) for d in drafts],
                    "gained": [len(t) for t in gained],
                    "lookup_ms": round(lookup * 1e3, 3),
                    "step_ms": round((time.perf_counter() - tick) * 1e3, 3),
                }
            )
    stats.decode_seconds = time.perf_counter() - start
    stats.new_tokens = sum(len(t) for t in outputs.values())
    return GenerationResult(_assemble(ids, [outputs[r] for r in range(ids.shape[0])], pad), stats)


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


def _assemble(ids: torch.Tensor, outputs: list[list[int]], pad: int) -> torch.LongTensor:
    width = max(len(o) for o in outputs)
    new = torch.full((ids.shape[0], width), pad, dtype=torch.long, device=ids.device)
    for r, tokens in enumerate(outputs):
        new[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return torch.cat([ids, new], dim=1)


def _row_by_row(model, ids, mask, max_new_tokens, config, references, eos, pad, output_pool, on_tokens, sampling):
    """Models without tree masks cannot batch ragged rows; decode each row alone."""
    outputs, total = [], GenerationStats(rows=ids.shape[0])
    for r in range(ids.shape[0]):
        length = int(mask[r].sum())
        result = generate(
            model,
            ids[r : r + 1, ids.shape[1] - length :],
            max_new_tokens=max_new_tokens,
            config=config,
            references=[references[r]] if references else None,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
            output_pool=output_pool,
            on_tokens=(lambda _row, tokens, r=r: on_tokens(r, tokens)) if on_tokens else None,
            **_as_options(sampling[r]),
        )
        outputs.append(result.sequences[0, length:].tolist())
        for name in (
            "forward_passes",
            "new_tokens",
            "prefill_seconds",
            "decode_seconds",
            "lookup_seconds",
            "draft_tokens",
        ):
            setattr(total, name, getattr(total, name) + getattr(result.stats, name))
        for k, n in result.stats.accepted_histogram.items():
            total.accepted_histogram[k] = total.accepted_histogram.get(k, 0) + n
    return GenerationResult(_assemble(ids, outputs, pad), total)
