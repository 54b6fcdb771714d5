"""Checks on what callers hand the decode loop, so bad input fails with one clear line.

Why here and not in the model: an out-of-vocabulary id reaches the embedding as an index
error on a CPU and as a device-side assert on CUDA (which poisons the whole process), and a
string where token ids belong would otherwise be inserted into the trie character by
character. Every front end (``generate``, ``DecodeBatch``, the server) funnels through these.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from numbers import Integral

import torch

from rag_lookahead.decoding.windows import ignored_window
from rag_lookahead.errors import ConfigError, InputError, NoRoomError, no_room_message


def check_model(model) -> None:
    """A loaded model, not its name or nothing: ``generate("default", ids)`` failed with
    "'str' object has no attribute 'config'" deep in the layer checks."""
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        raise ConfigError(
            f"model must be a loaded model, not the name {name!r}: load it first, e.g."
            f" model, tokenizer = load_model({name!r}) (from rag_lookahead import load_model)"
        )
    if getattr(model, "config", None) is None:
        raise ConfigError(
            "model must be a loaded causal language model (rag_lookahead.load_model, or transformers'"
            f" AutoModelForCausalLM.from_pretrained), got {type(model).__name__}"
        )


def vocab_size(model) -> int:
    """Rows of the input embedding: the ids the model can take."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    return int(model.config.vocab_size)


def context_limit(model) -> int | None:
    """The longest sequence (prompt + answer) the model's positions cover; None: no stated limit.

    For longrope (Phi-3-128k style) it is where the rope factors switch: transformers picks the
    short or the long factors once per forward, from the forward's last position, and on crossing
    re-encodes the whole sequence with the long ones. A verify step past the switch would rotate
    its earlier positions with the long factors, and rows packed into one forward would share
    the longest row's factors; up to the switch every forward uses the short ones, as in
    ``model.generate``. A ``sliding_window`` the model's attention ignores is a limit too
    (``windows.ignored_window``). The window's name varies where a config maps no
    ``max_position_embeddings`` to it (MPT's ``max_seq_len``, ChatGLM's ``seq_length``)."""
    limit = next((getattr(model.config, name) for name in _WINDOW_NAMES if getattr(model.config, name, None)), None)
    for cut in (longrope_switch(model.config), ignored_window(model)):
        if cut is not None and (limit is None or cut < limit):
            limit = cut
    return limit


#: config fields that hold a model's context window, in the order they are read
_WINDOW_NAMES = ("max_position_embeddings", "max_seq_len", "n_positions", "max_sequence_length", "seq_length")


def limit_words(model, limit: int) -> str:
    """How an error names the context limit, saying why where it is a longrope switch."""
    if longrope_switch(model.config) == limit:
        return f"{limit} (where its longrope rope factors switch, which decoding cannot cross token for token)"
    if ignored_window(model) == limit:
        where = "model.config" + (".text_config" if getattr(model.config, "text_config", None) is not None else "")
        return (
            f"{limit} (config.sliding_window, which {type(model).__name__}'s attention ignores but transformers' "
            f"cache applies past it; set {where}.sliding_window = None to decode with full attention)"
        )
    return str(limit)


def longrope_switch(config) -> int | None:
    """The length past which a longrope model changes its rope factors (None: not longrope)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, Mapping) or not params:
        return None
    per_layer_type = all(isinstance(v, Mapping) for v in params.values())
    switches = [
        p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        for p in (params.values() if per_layer_type else [params])
        if p.get("rope_type", p.get("type")) == "longrope"
    ]
    switches = [int(n) for n in switches if n]
    return min(switches) if switches else None


def check_room(model, attention_mask: torch.Tensor) -> None:
    """Refuse rows whose prompt leaves no room in the context window for a new token: such a row
    would end with no tokens at all (and a sampled one would still spend a draw)."""
    check_prompt_room(model, int(attention_mask.sum(-1).max()))


def check_prompt_room(model, length: int, what: str = "the input", advice: str = "") -> None:
    """:func:`check_room` for one prompt of ``length`` tokens (front ends check each input alone,
    so that a batch fails a too-long input alone); ``what`` and ``advice`` as :func:`no_room_words`
    takes them."""
    limit = context_limit(model)
    if limit is not None and length >= limit:
        raise NoRoomError(length, limit_words(model, limit), what, advice)


def no_room_words(model, length: int, limit: int, what: str = "the input", advice: str = "") -> str:
    """How a prompt of ``length`` tokens that leaves no room for an answer in ``model``'s context
    ``limit`` is refused: ``what`` names the prompt, ``advice`` ("; ...") says how to shorten it
    where the caller built it (the server's ``/v1/rag``, ``ask`` and the RAG chains: the question
    with its passages, :func:`rag_lookahead.rag.chains.passage_prompt_words`)."""
    return no_room_message(length, limit_words(model, limit), what, advice)


def as_batch(input_ids, attention_mask=None, masked_pad: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` as (batch, length) long tensors, each row left-padded and non-empty.

    ``input_ids`` may also be what a tokenizer returns (a ``BatchEncoding`` or a dict with
    ``input_ids`` and perhaps ``attention_mask``), as ``apply_chat_template`` does in transformers 5.
    Without a mask, ``masked_pad`` (a pad id that is no EOS id) is masked out wherever it stands,
    as ``model.generate`` infers the mask; else every token counts."""
    if isinstance(input_ids, Mapping):  # BatchEncoding is a Mapping
        if "input_ids" not in input_ids:
            keys = ", ".join(map(str, input_ids))
            raise InputError(f"input_ids is a mapping without 'input_ids' (its keys: {keys})")
        if attention_mask is None:
            attention_mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    if isinstance(input_ids, str) or (
        isinstance(input_ids, (list, tuple)) and any(isinstance(t, str) for t in _flat(input_ids))
    ):
        raise InputError("input_ids must be token ids, not text: encode the text with the tokenizer first")
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError) as err:
        raise InputError(f"input_ids must be a list of token ids or a (batch, length) tensor ({err})") from None
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.numel() == 0:
        raise InputError("input_ids must be a non-empty list of token ids or a (batch, length) tensor")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(f"input_ids must be integers, got {ids.dtype}")
    ids = ids.long()
    if attention_mask is None:
        mask = torch.ones_like(ids) if masked_pad is None else (ids != masked_pad).long()
        if masked_pad is not None and not left_padded(mask):
            raise InputError(
                f"the pad id {masked_pad} stands inside a row of input_ids, where transformers masks it out; "
                "lookahead decoding takes left padding only: pass an attention_mask, or remove those tokens"
            )
    else:
        mask = torch.as_tensor(attention_mask).long().to(ids.device)
        if mask.dim() == 1:
            mask = mask[None]
        if mask.shape != ids.shape:
            raise InputError(f"attention_mask shape {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    check_mask(mask)
    return ids, mask


def check_mask(mask: torch.Tensor) -> None:
    """Each row is zeros then ones: left padding only, no holes, at least one token."""
    if bool(((mask != 0) & (mask != 1)).any()):
        raise InputError("attention_mask must hold only 0 and 1")
    if bool((mask.sum(-1) == 0).any()):
        raise InputError("a row of input_ids is empty (its attention_mask is all zeros)")
    if not left_padded(mask):
        raise InputError(
            "attention_mask has zeros after the first token of a row: rows must be left-padded, with no holes"
        )


def left_padded(mask: torch.Tensor) -> bool:
    """No row has a zero after a one."""
    return not (mask.shape[1] > 1 and bool((mask[:, 1:] < mask[:, :-1]).any()))


def check_ids(ids: torch.Tensor, vocab: int) -> None:
    """Every id the model will read lies in ``[0, vocab)`` (pad positions too: they are embedded)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = ids[(ids < 0) | (ids >= vocab)][0].item()
        raise InputError(f"input_ids holds token id {bad}, outside the model's vocabulary [0, {vocab})")


def check_references(references, rows: int, vocab: int) -> list[list[list[int]]] | None:
    """Per row, a list of token-id sequences; returned as plain lists of ints."""
    if references is None:
        return None
    if isinstance(references, (str, bytes)) or not isinstance(references, Sequence):
        raise InputError("references must be a list with one entry per row, each a list of token-id lists")
    if len(references) != rows:
        raise InputError(f"references has {len(references)} rows but input_ids has {rows}")
    return [_row_references(r, row, vocab) for r, row in enumerate(references)]


def _row_references(r: int, row, vocab: int) -> list[list[int]]:
    if row is None:
        return []
    if isinstance(row, (str, bytes)):
        raise InputError(
            f"references[{r}] is text; references are token ids (rows -> passages -> ids): encode each passage"
        )
    if not isinstance(row, (Sequence, torch.Tensor)):
        raise InputError(f"references[{r}] must be a list of token-id lists, got {type(row).__name__}")
    out = []
    for j, sequence in enumerate(row):
        where = f"references[{r}][{j}]"
        if isinstance(sequence, (str, bytes)):
            raise InputError(f"{where} is text; references are token ids: encode each passage with the tokenizer")
        if isinstance(sequence, torch.Tensor):
            sequence = sequence.tolist()
        if not isinstance(sequence, Sequence):
            raise InputError(f"{where} must be a list of token ids (references are nested: rows -> passages -> ids)")
        tokens = []
        for token in sequence:
            if isinstance(token, bool) or not isinstance(token, Integral):
                raise InputError(f"{where} holds {token!r}; token ids must be integers")
            if not 0 <= token < vocab:
                raise InputError(f"{where} holds token id {token}, outside the model's vocabulary [0, {vocab})")
            tokens.append(int(token))
        out.append(tokens)
    return out


def _flat(value, limit: int = 10_000):
    """The leaves of a nested list, up to ``limit`` of them (enough to catch text passed as ids)."""
    stack, seen = [value], 0
    while stack and seen < limit:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            seen += 1
            yield item
