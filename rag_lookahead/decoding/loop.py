"""The decode loop: prefill, then propose -> verify -> accept until every row is done.

``generate`` is lossless: each row's tokens are exactly what ``model.generate`` gives for it
(greedy, or sampled under the same seed), but a step may accept several tokens when the draft
guessed them. The rows' state and the steps themselves are ``decode_batch.DecodeBatch``, which a
server drives step by step; ``generate`` fills one batch and steps it until every row is done.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeAlias

import torch

from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.config import LookaheadConfig, config_or_default
from rag_lookahead.decoding.decode_batch import DecodeBatch
from rag_lookahead.decoding.drafter import Drafter
from rag_lookahead.decoding.inputs import as_batch, check_ids, check_model, check_references, check_room, vocab_size
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.results import GenerationResult, GenerationStats, LogprobRecorder, assemble
from rag_lookahead.decoding.rows import Row
from rag_lookahead.decoding.sampling import (
    UNSET,
    SamplingParams,
    per_row,
    resolve_sampling,
)
from rag_lookahead.decoding.trie import OutputPool
from rag_lookahead.decoding.verify import input_device, supports_tree_mask
from rag_lookahead.decoding.windows import check_layers
from rag_lookahead.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from rag_lookahead.checks import Integer

    #: ``eos_token_id`` as ``_eos_ids`` reads it: one id or a list of them, or a numpy or tensor value
    TokenIds: TypeAlias = Integer | Sequence[Integer | torch.Tensor] | torch.Tensor | npt.NDArray[np.integer[Any]]
    #: ``seed`` as ``sampling.per_row`` reads it: one for every row, or one per row, in the same forms
    Seeds: TypeAlias = TokenIds

__all__ = ["DecodeBatch", "GenerationResult", "GenerationStats", "Row", "generate", "left_pad"]


def left_pad(rows: Sequence[Sequence[int]], pad: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as a left-padded (ids, attention_mask) pair."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def _eos_ids(model, eos_token_id=UNSET, generation_config=None) -> tuple[int, ...]:
    """The ids that end a row, in the order given (the first pads, as in transformers): the
    argument, else ``generation_config``'s, else the model's (no tokenizer here). An int, a list,
    a numpy integer or a tensor."""
    value = _setting(model, "eos_token_id", eos_token_id, generation_config)
    if value is None:
        return ()
    value = _flat(value)
    ids = [value] if isinstance(value, Integral) else value
    if isinstance(ids, (list, tuple)):  # items may be tensors too ([torch.tensor(5), ...])
        ids = [t for item in ids for t in (_flat(item) if hasattr(item, "tolist") else [item])]
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
        raise ConfigError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(dict.fromkeys(int(t) for t in ids))


def _flat(value):
    """A tensor, numpy value or array of any shape as a flat list, as ``model.generate`` reads it."""
    if hasattr(value, "reshape") and hasattr(value, "tolist"):
        return value.reshape(-1).tolist()
    return value.tolist() if hasattr(value, "tolist") else value


def _setting(model, name: str, value, generation_config):
    """A token setting as ``model.generate`` resolves it: the argument, else the config passed in,
    else the model's own generation config (a passed config's EOS was ignored: the measured bug).
    An explicit None is transformers' "off" (``model.generate(eos_token_id=None)`` ignores the
    model's EOS); :data:`UNSET` (left out) falls back as above."""
    if value is not UNSET:
        return value
    value = None
    for source in (generation_config, getattr(model, "generation_config", None)):
        if value is None:
            value = getattr(source, name, None)
    return value


def _one_id(name: str, value) -> int | None:
    """One token id (an int, a numpy integer, a one-element tensor or array), or None; a list, a
    float or text is a ConfigError (``int()`` took 0.7 as 0 and "3" as 3, and a list raised a bare
    TypeError)."""
    if value is None:
        return None
    flat = _flat(value)
    if isinstance(flat, list) and len(flat) == 1 and hasattr(value, "tolist"):
        flat = flat[0]
    if not isinstance(flat, Integral) or isinstance(flat, bool):
        raise ConfigError(f"{name} must be one token id, got {value!r}")
    return int(flat)


def _pad_id(pad_token_id: int | None, eos: Sequence[int]) -> int:
    """The id that right-pads the output: the pad id set (``_setting``), else the first EOS id (as
    transformers has it: a list's smallest padded differently), else 0."""
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return int(pad_token_id)


def generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_new_tokens: SupportsIndex,
    config: LookaheadConfig | None = None,
    references: Sequence[Sequence[Sequence[int]]] | None = None,
    eos_token_id: TokenIds | None = UNSET,
    pad_token_id: SupportsIndex | None = UNSET,
    output_pool: OutputPool | None = None,
    drafter: Drafter | None = None,
    on_tokens: Callable[[int, list[int]], bool | None] | None = None,
    stop_check: Callable[[int, list[int]], bool] | None = None,
    do_sample: bool | None = UNSET,
    temperature: float | None = UNSET,
    top_k: int | None = UNSET,
    top_p: float | None = UNSET,
    min_p: float | None = UNSET,
    repetition_penalty: float | None = UNSET,
    seed: Seeds | None = None,
    generation_config=None,
    logprobs: int | None = None,
    prefill_chunk: int = 0,
) -> GenerationResult:
    """Lossless decoding, several tokens a forward where the drafts guess right.

    (Long only in its keywords, named as ``model.generate`` names them, and their description;
    the work is in ``_checked_inputs``, ``DecodeBatch`` and ``_decode``.)

    Greedy or sampled exactly as ``model.generate`` would for the same arguments: the sampling
    options (``do_sample`` ... ``repetition_penalty``, or a ``transformers.GenerationConfig``)
    default to the model's generation config, then transformers' defaults; an explicit None is
    transformers' "off" (``top_k=None``: no top-k; ``do_sample=None``: greedy). Without ``seed`` a
    single row draws from torch's global generator in transformers' order, so after
    ``torch.manual_seed(s)`` the tokens equal ``model.generate``'s; with ``seed`` (an int for
    every row, or one per row) each row draws from its own generator and its tokens do not
    depend on the batch or on the drafts.

    input_ids: a list of ids, or a (batch, length) tensor left-padded per ``attention_mask``.
    references: per row, token-id sequences to draft from (passages that are not in the prompt;
        the trie drafter puts them in the row's context pool).
    output_pool: n-grams of earlier answers to draft from; defaults to one shared per model
        (per trie depth and ``output_pool_nodes``), kept in the model's ``ModelProfile``.
    drafter: what proposes the drafts (see ``drafter.Drafter``), e.g. ``PromptLookupDrafter()``;
        default: the trie drafter of ``config`` with ``output_pool``.
    on_tokens(row, tokens): called as each row's tokens are accepted; return True to end that
        row there (a stop string was seen, the client left).
    stop_check(row, tokens): asked after each token a row chooses (its first and each step's
        last included), with the tokens chosen so far in that step; True ends the row at that
        token, as a transformers ``StoppingCriteria`` does: its output ends there and nothing more
        is drawn, so a sampled row's random generator stands where ``model.generate`` leaves it
        (``on_tokens`` then sees the block up to that token).
    logprobs: record each new token's log-probability under the model (``results``) with the
        ``logprobs`` most likely tokens at its place (0: none); in ``result.logprobs``.
    prefill_chunk: prompt tokens per forward (chunked prefill, see ``prefill``; the same tokens);
        0: each prompt in one forward.
    """
    check_model(model)
    config = config_or_default(config)
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    eos_order = _eos_ids(model, eos_token_id, generation_config)
    eos = frozenset(eos_order)
    pad_set = _one_id("pad_token_id", _setting(model, "pad_token_id", pad_token_id, generation_config))
    masked_pad = None if pad_set is None or pad_set in eos else pad_set  # as transformers infers a mask
    ids, mask, references = _checked_inputs(model, input_ids, attention_mask, references, masked_pad)
    params = resolve_sampling(
        model,
        generation_config,
        prompt_width=ids.shape[1],
        has_eos=bool(eos),
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    sampling = per_row(params, seed, ids.shape[0])
    pad = _pad_id(pad_set, eos_order)
    if drafter is None and output_pool is None and config.enabled and config.use_output_pool:
        output_pool = profile_of(model).output_pool(config.pool_depth, config.output_pool_nodes)
    new_batch = functools.partial(DecodeBatch, model, config, eos, output_pool, drafter, prefill_chunk=prefill_chunk)
    run = functools.partial(_decode_rows, new_batch, max_new_tokens=max_new_tokens, pad=pad, logprobs=logprobs)
    if ids.shape[0] > 1 and not supports_tree_mask(model):  # packed rows are kept apart by the mask
        return _row_by_row(run, ids, mask, references, sampling, (on_tokens, stop_check), pad, logprobs)
    return run(ids, mask, references, sampling, (on_tokens, stop_check))


def _decode_rows(
    new_batch: Callable[[], DecodeBatch],
    ids: torch.Tensor,
    mask: torch.Tensor,
    references,
    sampling: list[SamplingParams],
    callbacks: tuple,
    *,
    max_new_tokens: int,
    pad: int,
    logprobs: int | None,
) -> GenerationResult:
    """Checked and resolved rows decoded in one fresh batch (``callbacks``: ``on_tokens`` and
    ``stop_check``, called with the rows' indices in ``ids``)."""
    on_tokens, stop_check = callbacks
    batch = new_batch()
    stats = GenerationStats(rows=ids.shape[0], trace=[] if batch.config.debug else None)
    start = time.perf_counter()
    recorders = None if logprobs is None else [LogprobRecorder(logprobs) for _ in range(ids.shape[0])]
    batch.add(ids, mask, references, max_new_tokens, sampling=sampling, logprobs=recorders, stop_check=stop_check)
    stats.prefill_seconds = time.perf_counter() - start
    outputs = _decode(batch, stats, on_tokens)
    sequences = assemble(ids, [outputs[r] for r in range(ids.shape[0])], pad)
    return GenerationResult(sequences, stats, None if recorders is None else [r.entries for r in recorders])


def _checked_inputs(model, input_ids, attention_mask, references, masked_pad: int | None = None):
    """``(ids, mask, references)`` checked and on the model's input device; the longest row must
    leave room in the context window for at least one new token (``masked_pad``: see ``as_batch``)."""
    check_layers(model)  # before any forward (the tree-mask probe's, the cost curve's)
    ids, mask = as_batch(input_ids, attention_mask, masked_pad)
    check_ids(ids, vocab_size(model))
    references = check_references(references, ids.shape[0], vocab_size(model))
    device = input_device(model)
    ids, mask = ids.to(device), mask.to(device)
    check_room(model, mask)
    return ids, mask, references


def _decode(
    batch: DecodeBatch, stats: GenerationStats, on_tokens: Callable[[int, list[int]], bool | None] | None
) -> dict[int, list[int]]:
    """Step the batch until every row is done or stopped; each row's new tokens by its index."""
    outputs: dict[int, list[int]] = {}

    def notify(row: Row, tokens: list[int]) -> bool:
        return bool(on_tokens(row.index, tokens)) if on_tokens is not None and tokens else False

    stopped = {row.index for row in batch.rows if notify(row, list(row.generated))}  # a copy: the row goes on
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
        batch.raise_row_failure()  # one caller owns every row: the call fails as a whole
        for row, tokens in zip(batch.rows, gained):
            if notify(row, tokens):
                stopped.add(row.index)
        stats.record_step(drafts, gained, lookup, time.perf_counter() - tick)
    stats.decode_seconds = time.perf_counter() - start
    stats.new_tokens = sum(len(t) for t in outputs.values())
    return outputs


def _row_by_row(run, ids, mask, references, sampling, callbacks, pad, logprobs) -> GenerationResult:
    """Models without tree masks cannot batch ragged rows; ``run`` (``_decode_rows``) decodes each
    row alone, with the settings the whole call resolved (a row's own width must not change what
    ``min_length`` holds back, nor the model's config undo the call's)."""
    on_tokens, stop_check = callbacks
    outputs, total, entries = [], GenerationStats(rows=ids.shape[0]), []
    for r in range(ids.shape[0]):
        length = int(mask[r].sum())
        row = ids[r : r + 1, ids.shape[1] - length :]
        row_callbacks = (
            (lambda _row, tokens, r=r: on_tokens(r, tokens)) if on_tokens else None,
            (lambda _row, tokens, r=r: stop_check(r, tokens)) if stop_check else None,
        )
        # the row's own tokens, pad ids among them too (no mask to infer)
        result = run(
            row, torch.ones_like(row), [references[r]] if references else None, sampling[r : r + 1], row_callbacks
        )
        outputs.append(result.sequences[0, length:].tolist())
        total.add(result.stats)
        entries.extend(result.logprobs or [])
    sequences = assemble(ids, outputs, pad)
    return GenerationResult(sequences, total, entries if logprobs is not None else None)
