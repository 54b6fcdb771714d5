"""transformers' own entry point: ``model.generate(..., custom_generate=rag_lookahead.hf_generate)``.

transformers 5.x prepares the call (generation config, attention mask, logits processors,
stopping criteria) and hands it to a callable ``custom_generate``; this module is that
callable, running ``rag_lookahead.decoding.loop`` instead of transformers' token-by-token loop, so
the output equals ``model.generate``'s for the same arguments (and, when sampling, under the
same ``torch.manual_seed``).

The Lookahead article's keys are read from the ``GenerationConfig``, which keeps keys it does
not know::

    GenerationConfig(use_lookahead=True, decoding_length=64, branch_length=24,
                     stop_words={...token ids...}, debug_lookahead=False, max_new_tokens=256)

Extra keywords of ``model.generate`` that transformers passes on to us: ``references``
(per row, the passages to draft from: token-id lists, or text with ``lookahead_tokenizer``),
``lookahead_tokenizer`` (transformers keeps ``tokenizer=`` for itself and does not pass it on)
and ``lookahead_config`` (a whole ``LookaheadConfig``; the config's keys override it).

What would change the output and cannot be reproduced exactly is refused with
``ConfigError``, never ignored: logits processors other than the sampling ones transformers
builds from the config, per-step scores/attentions in the output, custom stopping criteria
on batches (a batch-level criterion sees other rows; per row we cannot know what it means; a
subclass of one of transformers' own criteria or processors counts as the caller's own),
transformers' own row-wise criteria on a batch without EOS (transformers decodes a stopped row on),
EOS from the criteria alone on a batch with no pad id to fill its ended rows (transformers fails
there, at batch size 1 too; one row needs no padding and is decoded),
a ``max_length`` past the model's context window (transformers goes on past it with a
warning; our loop stops at the window), sampling a batch of more than one row (transformers'
draws from the global generator interleave the rows a token a step), and a ``streamer`` on a
batch (rows advance by different numbers of tokens a step). A streamer gets one token a ``put``,
also where transformers' assisted generation would put a block: the same text, finer pieces.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from rag_lookahead.decoding.config import LookaheadConfig, checked_stop_word_ids, stop_word_ids
from rag_lookahead.decoding.inputs import context_limit, left_padded, limit_words
from rag_lookahead.decoding.loop import generate
from rag_lookahead.decoding.results import GenerationStats
from rag_lookahead.decoding.sampling import build_processors, refuse_assisted_sampling, resolve_sampling
from rag_lookahead.decoding.windows import check_layers
from rag_lookahead.errors import ConfigError, InputError

#: model inputs transformers prepares for every decoder-only call; anything else is refused
_PREPARED_INPUTS = frozenset(
    # (per-step outputs asked without return_dict_in_generate: ignored, as transformers ignores them)
    {
        "attention_mask",
        "position_ids",
        "logits_to_keep",
        "cache",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
    }
)


@dataclass
class LookaheadGenerateOutput(GenerateDecoderOnlyOutput):
    """``model.generate``'s ``return_dict_in_generate`` output plus the decoding stats.

    ``scores``, ``logits``, ``attentions``, ``hidden_states`` are refused up front rather than
    left empty; ``cache`` is None (the decode loop packs rows into its own cache).
    """

    lookahead_stats: GenerationStats | None = None


def hf_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    references: Sequence[Sequence[Sequence[int] | str]] | None = None,
    lookahead_tokenizer=None,
    lookahead_config: LookaheadConfig | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | LookaheadGenerateOutput:
    """Lookahead decoding as a ``custom_generate`` callable for ``model.generate``.

    Use it through ``model.generate(**inputs, custom_generate=hf_generate, generation_config=...)``:
    transformers resolves the generation config and builds the processors and criteria this
    function checks. Returns what ``model.generate`` returns: the sequences tensor, or a
    ``LookaheadGenerateOutput`` (a ``GenerateDecoderOnlyOutput``) with ``lookahead_stats``
    when ``return_dict_in_generate`` is set.
    """
    if generation_config is None or logits_processor is None or stopping_criteria is None:
        raise ConfigError("hf_generate is called by transformers: use model.generate(..., custom_generate=hf_generate)")
    caller = sys._getframe(1)
    streamer = streamer if streamer is not None else _argument_of_caller(caller, "streamer")
    assistant_model = _argument_of_caller(caller, "assistant_model")
    synced_gpus = synced_gpus or _synced_gpus_of_caller(caller, model)
    try:  # the streamer already holds the prompt: end it on a refusal too, or its reader waits forever
        return _lookahead_generate(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus,
            streamer,
            references,
            lookahead_tokenizer,
            lookahead_config,
            model_kwargs,
            assistant_model,
        )
    finally:
        if streamer is not None:
            streamer.end()


def _lookahead_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool,
    streamer,
    references,
    lookahead_tokenizer,
    lookahead_config: LookaheadConfig | None,
    model_kwargs: dict[str, Any],
    assistant_model=None,
) -> torch.LongTensor | LookaheadGenerateOutput:
    """:func:`hf_generate` once the streamer is known (it ends the streamer, whatever happens here)."""
    _check_call(model, synced_gpus)
    mask = _attention_mask(input_ids, model_kwargs)
    rows = input_ids.shape[0]
    if streamer is not None and rows > 1:
        raise ConfigError(
            "a streamer needs batch size 1 here: lookahead rows advance by different numbers of tokens "
            "a step, so there is no per-step column of tokens to stream (transformers streams one)"
        )

    has_eos = getattr(generation_config, "_eos_token_tensor", None) is not None
    inner = _config_for_the_loop(generation_config, has_eos)
    returned = getattr(generation_config, "num_return_sequences", None) or 1
    if generation_config.do_sample and returned > 1 and (generation_config.num_beams or 1) == 1:  # rows of one prompt
        raise _sampled_batch(f"num_return_sequences={returned} with sampling")
    params = resolve_sampling(model, inner, prompt_width=input_ids.shape[1], has_eos=has_eos)
    refuse_assisted_sampling(generation_config, assistant_model)  # resolve_sampling saw no assistant_model
    _refuse_what_generate_refuses(model, generation_config, assistant_model, rows)
    if params.do_sample and rows > 1:
        raise _sampled_batch("sampling a batch")
    _check_processors(logits_processor, build_processors(params), mask, params.do_sample)
    max_length, eos, custom = _read_criteria(stopping_criteria, rows)
    limit = context_limit(model)
    width = "the prompts' padded width" if rows > 1 else "the prompt"  # one prompt has no padding to speak of
    if limit is not None and input_ids.shape[1] >= limit:
        raise InputError(
            f"{width} is {input_ids.shape[1]} tokens and the model's context window is "
            f"{limit_words(model, limit)}: shorten the prompt"
        )
    if limit is not None and max_length > limit:
        # transformers decodes on past the window (with a warning); our loop stops at it
        raise ConfigError(
            f"this call may run to {max_length} tokens ({width} + max_new_tokens) but the "
            f"model's context window is {limit_words(model, limit)}; lookahead decoding stops at the "
            f"window where model.generate would go on past it, so end the call by {limit} tokens (max_new_tokens "
            f"at most {max(limit - input_ids.shape[1], 0)}, and no MaxLengthCriteria past {limit})"
        )
    _check_tokenizer(lookahead_tokenizer)
    config = lookahead_settings(generation_config, lookahead_config, lookahead_tokenizer)
    references = _encode_references(references, lookahead_tokenizer)
    pad = generation_config._pad_token_tensor
    if pad is None and eos and rows > 1:
        # transformers sets no pad id from the criteria's EOS (only from the config's) and fails with a
        # TypeError here; a row that ends early would have been filled with token 0
        raise ConfigError(
            "a batch whose rows may end early (EOS from the stopping criteria) needs a pad id to fill them, and"
            " none is set: pass pad_token_id= (or eos_token_id= in the generation config)"
        )
    pad_id = int(pad) if pad is not None else 0  # no row ends early here: nothing is padded

    watcher = _RowWatcher(input_ids, custom, streamer)
    result = generate(
        model,
        input_ids,
        mask,
        max_new_tokens=max(1, max_length - input_ids.shape[1]),  # as transformers: max_length counts padding
        config=config,
        references=references,
        eos_token_id=sorted(eos),
        pad_token_id=pad_id,
        on_tokens=watcher.on_tokens,
        stop_check=watcher.stop_check if custom else None,
        generation_config=inner,
    )
    sequences = watcher.sequences(pad_id)
    result.stats.new_tokens = sum(len(tokens) for tokens in watcher.generated)
    if generation_config.return_dict_in_generate:
        return LookaheadGenerateOutput(sequences=sequences, lookahead_stats=result.stats)
    return sequences


def _config_for_the_loop(generation_config, has_eos: bool):
    """The generation config the decode loop is given: transformers' own, less what transformers
    has already turned into the stopping criteria we are handed, or made nothing of.

    ``max_time``: transformers built a ``MaxTimeCriteria`` from it, which the watcher calls as it
    calls any criterion (refused on a batch in ``_read_criteria``); the loop's own option check
    would have refused it as a setting it does not implement. ``min_length``/``min_new_tokens``:
    without the config's EOS transformers applies neither; the loop, which is given the criteria's
    EOS ids, would have read them as holding EOS back and refused the call."""
    unused_minimum = not has_eos and (generation_config.min_length or generation_config.min_new_tokens)
    if generation_config.max_time is None and not unused_minimum:
        return generation_config
    inner = copy.deepcopy(generation_config)
    inner.max_time = None
    if unused_minimum:
        inner.min_length, inner.min_new_tokens = 0, None
    return inner


def lookahead_settings(generation_config, base: LookaheadConfig | None = None, tokenizer=None) -> LookaheadConfig:
    """The ``LookaheadConfig`` a GenerationConfig asks for with the article's keys.

    use_lookahead: False decodes one token a forward through the same loop (default True).
    decoding_length, branch_length: as in ``LookaheadConfig``.
    stop_words: token ids (or words, with a tokenizer); default: the usual punctuation when a
        tokenizer is given, else none.
    debug_lookahead: keep the per-step trace in the stats.
    decoding_mode: only the article's "hier" (tree drafts) exists here.
    """
    if base is not None and not isinstance(base, LookaheadConfig):
        raise ConfigError(f"lookahead_config must be a LookaheadConfig, got {type(base).__name__}")
    config = copy.deepcopy(base) if base is not None else LookaheadConfig()
    changes: dict[str, Any] = {}
    use = getattr(generation_config, "use_lookahead", None)
    if use is not None:
        changes["enabled"] = _flag("use_lookahead", use)
    for name in ("decoding_length", "branch_length"):
        value = getattr(generation_config, name, None)
        if value is not None:
            changes[name] = value
    debug = getattr(generation_config, "debug_lookahead", None)
    if debug is not None:
        changes["debug"] = _flag("debug_lookahead", debug)
    mode = getattr(generation_config, "decoding_mode", None)
    if mode not in (None, "hier"):
        raise ConfigError(f"decoding_mode={mode!r} is not supported: drafts are always trees ('hier')")
    words = getattr(generation_config, "stop_words", None)
    if words is not None:
        changes["stop_words"] = _stop_words(words, tokenizer)
    elif tokenizer is not None and base is None:
        changes["stop_words"] = stop_word_ids(tokenizer)
    return config.replace(**changes) if changes else config


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _stop_words(words, tokenizer) -> frozenset[int]:
    """Token ids as given; words become the ids they encode to as a single token."""
    if isinstance(words, (str, bytes)):
        words = [words]
    try:
        words = list(words)
    except TypeError:  # a single id: iterating it failed with "'int' object is not iterable"
        raise ConfigError(f"stop_words must be a list of token ids or words, got {words!r}") from None
    text = [w for w in words if isinstance(w, str)]
    if text and tokenizer is None:
        raise ConfigError("stop_words given as text need lookahead_tokenizer=tokenizer in model.generate")
    ids = checked_stop_word_ids(
        [w for w in words if not isinstance(w, str)], "words are given as text, with lookahead_tokenizer=tokenizer"
    )
    return ids | (stop_word_ids(tokenizer, text) if text else frozenset())


#: how ``references`` nest in ``model.generate``, for the errors that find them nested otherwise
_REFERENCES_SHAPE = (
    "references=[[passage, ...], ...] (rows -> passages; one row: references=[[passage]]), each passage"
    " token ids or, with lookahead_tokenizer=tokenizer, text"
)


def _check_tokenizer(tokenizer) -> None:
    """``lookahead_tokenizer``: None or a tokenizer (a str has ``encode`` too, and failed inside it)."""
    if tokenizer is not None and (
        isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "encode", None))
    ):
        raise ConfigError(
            f"lookahead_tokenizer must be the model's tokenizer (e.g. AutoTokenizer.from_pretrained(...)),"
            f" got {type(tokenizer).__name__}"
        )


def _encode_references(references, tokenizer):
    """Passages given as text are encoded (without special tokens); ids pass through to the checks.

    The nesting is explained here, not left to the loop's checks: they see token ids only, and would
    tell a caller whose text is accepted (with ``lookahead_tokenizer``) to encode it."""
    if references is None:
        return None
    if isinstance(references, (str, bytes)) or not isinstance(references, Sequence):
        raise InputError(
            f"references must be a list with one entry per row, each a list of passages, got "
            f"{type(references).__name__}: {_REFERENCES_SHAPE}"
        )
    out = []
    for r, row in enumerate(references):
        if isinstance(row, (str, bytes)):
            raise InputError(f"references[{r}] is text, but each row is a list of passages: {_REFERENCES_SHAPE}")
        if row is None or not isinstance(row, (list, tuple)):
            out.append(row)
            continue
        passages = []
        for passage in row:
            if isinstance(passage, str):
                if tokenizer is None:
                    raise InputError(
                        f"references[{r}] holds text: pass lookahead_tokenizer=tokenizer to model.generate, "
                        "or token ids"
                    )
                passage = tokenizer.encode(passage, add_special_tokens=False, verbose=False)  # drafts only
            passages.append(passage)
        out.append(passages)
    return out


def _argument_of_caller(frame, name: str) -> Any:
    """An argument given to ``model.generate`` that it does not pass on (``streamer``, ``assistant_model``).

    transformers 5.2x does not pass ``streamer`` on to a callable ``custom_generate`` (it
    rebuilds the keywords from the callable's own parameters), although it has already put
    the prompt into it. Dropping it would leave a ``TextIteratorStreamer`` waiting forever, so
    we read it from the calling ``generate`` frame.
    """
    code = frame.f_code
    if code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils":
        return frame.f_locals.get(name)
    return None


def _refuse_what_generate_refuses(model, generation_config, assistant_model, rows: int) -> None:
    """Assisted-generation settings ``model.generate`` would refuse (it checks them only on its
    own paths, after handing over to a callable ``custom_generate``): lookahead would ignore them
    and answer where transformers raises."""
    from transformers.generation.configuration_utils import GenerationMode

    if generation_config.get_generation_mode(assistant_model) != GenerationMode.ASSISTED_GENERATION:
        return
    if rows > 1:
        raise ConfigError(
            "assisted generation (assistant_model, prompt_lookup_num_tokens, assistant_early_exit, use_mtp) takes"
            " batch size 1 in model.generate: drop it (lookahead drafts on its own) or generate one row per call"
        )
    if getattr(generation_config, "use_mtp", False) and (
        getattr(model.config.get_text_config(), "num_mtp_layers", None) is None  # as transformers checks
    ):
        raise ConfigError(
            "use_mtp=True needs a model with multi-token-prediction layers (num_mtp_layers); this has none"
        )


def _synced_gpus_of_caller(frame, model) -> bool:
    """``synced_gpus`` as ``model.generate`` resolves it, which transformers 5.2x does not pass on
    to a callable ``custom_generate`` either: the caller's value, else on when DeepSpeed ZeRO-3 or
    FSDP shards the model over more than one process (ranks then forward in step)."""
    given = _argument_of_caller(frame, "synced_gpus")
    if given is not None:
        return bool(given)
    try:
        from transformers.generation import utils

        sharded = utils.is_deepspeed_zero3_enabled() or utils.is_fsdp_managed_module(model)
        return bool(sharded and utils._get_torch_distributed_world_size() > 1)
    except (AttributeError, ImportError):  # another transformers: only an explicit value is seen
        return False


def _sampled_batch(what: str) -> ConfigError:
    """Why several sampled rows are refused: transformers draws one token for every row (finished
    ones too) from the global generator at each step, and rows that accept different numbers of
    tokens a step cannot keep that order."""
    return ConfigError(
        f"{what} through model.generate cannot give transformers' tokens for the same"
        " torch.manual_seed (its draws interleave the rows one token a step): sample one row per call,"
        " or use rag_lookahead.generate(..., do_sample=True, seed=[one seed per row]), where each row"
        " draws from a generator of its own"
    )


def _check_call(model, synced_gpus: bool) -> None:
    """Refuse what the loop cannot do: several processes in step, encoder-decoder models (per-step
    outputs: ``sampling.check_supported``)."""
    if synced_gpus:
        raise ConfigError("synced_gpus is not supported by lookahead decoding")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError("lookahead decoding supports decoder-only models only")
    check_layers(model)  # before the cache given in is read (a state-space one has no length)


def _empty(value) -> bool:
    """An input that holds nothing: None, or an empty dict or list (a multimodal model's
    ``generate`` passes ``mm_encoder_outputs={}`` with a text-only call)."""
    return value is None or (isinstance(value, (dict, list, tuple)) and not value)


def _attention_mask(input_ids: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
    """The 2-D mask transformers prepared (it drops an all-ones mask); other model inputs are refused."""
    unknown = sorted(k for k, v in model_kwargs.items() if k not in _PREPARED_INPUTS and not _empty(v))
    if unknown:
        raise ConfigError(f"model inputs not supported by lookahead decoding: {', '.join(unknown)}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InputError("input_ids must be a non-empty (batch, length) tensor (inputs_embeds are not supported)")
    cache = model_kwargs.get("cache")
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise ConfigError("a filled cache cannot be continued by lookahead decoding; pass the whole text as input_ids")
    if cache is not None and any("Quantized" in type(c).__name__ for c in (cache, *getattr(cache, "layers", ()))):
        raise ConfigError(
            "a quantized cache changes the tokens (its keys and values are rounded), and lookahead decoding keeps"
            " a full-precision cache: drop past_key_values to get the model's own tokens"
        )
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    if mask.dim() == 2 and bool((mask.long().sum(-1) == 0).any()):
        raise InputError(
            "a row of input_ids is empty: its attention mask is all zeros (without an attention_mask, "
            "transformers masks out every pad_token_id, so a row of pad ids only is empty)"
        )
    if mask.dim() == 2 and not left_padded(mask.long()):
        # the mask may be one transformers inferred (every pad id masked out), so say where zeros come from
        raise InputError(
            "the attention mask has zeros after the first token of a row (without an attention_mask, "
            "transformers masks out every pad_token_id, inside a row too): lookahead decoding takes "
            "left padding only: pad on the left (tokenizer.padding_side = 'left'); if those zeros are "
            "pad_token_id tokens that belong to the text, pass an all-ones attention_mask"
        )
    positions = model_kwargs.get("position_ids")
    if positions is not None:
        expected = (mask.long().cumsum(-1) - 1).clamp_min(0)[mask.bool()]
        # M-RoPE models (Qwen2-VL...) get (sections, batch, length): for text, every section is the text's
        sections = positions if positions.dim() == mask.dim() + 1 else positions.unsqueeze(0)
        if sections.shape[1:] != mask.shape or not all(torch.equal(s[mask.bool()], expected) for s in sections):
            raise ConfigError(
                "position_ids other than the text's own (0, 1, 2... after the padding) are not supported "
                "by lookahead decoding"
            )
    return mask


def _is_builtin(obj, *kinds: type) -> bool:
    """Whether ``obj`` is one of transformers' own processors or criteria ``kinds``, exactly: a user's
    subclass overrides what it does (its ``__call__``), so reading its settings as the built-in's would
    decode other tokens than ``model.generate``; a subclass is judged as the user's own (a custom
    criterion, an unknown processor), as transformers' own merge of the lists compares exact types too."""
    return type(obj) in kinds


def _check_processors(given, ours, mask: torch.Tensor, do_sample: bool) -> None:
    """The prepared processors must be exactly those our sampling applies (same kinds, same settings),
    less those that change nothing (a minimum length the prompt already has; in greedy decoding a
    renormalisation, which keeps every argmax)."""
    given = [
        p
        for p in given
        if not _holds_nothing_back(p, mask.shape[-1])
        and not _suppresses_nothing(p)
        and (do_sample or not _is_builtin(p, LogitNormalization))
    ]
    extra = [type(p).__name__ for p in given if type(p) not in {type(o) for o in ours}]
    if extra:
        raise ConfigError(f"logits processors not supported by lookahead decoding: {', '.join(extra)}")
    pads = (mask == 0).sum(-1)
    if bool(pads.any()) and any(_penalises_padding(p) for p in given):
        raise ConfigError(
            "a RepetitionPenaltyLogitsProcessor passed in logits_processor penalises the left padding of "
            "a padded batch (transformers' own skips it; lookahead's rows hold no padding): pass "
            "repetition_penalty= instead"
        )
    if [type(p) for p in given] != [type(p) for p in ours] or not all(_same(a, b, pads) for a, b in zip(given, ours)):
        names = ", ".join(type(p).__name__ for p in given)
        raise ConfigError(f"logits processors [{names}] differ from the sampling settings of the generation config")


def _holds_nothing_back(processor, width: int) -> bool:
    """A minimum-length processor that never masks EOS here: ``min_length`` at most the input's
    (padded) width, which transformers compares with (as it makes of ``min_new_tokens=0``)."""
    if _is_builtin(processor, MinLengthLogitsProcessor):
        return processor.min_length <= width
    return _is_builtin(processor, MinNewTokensLengthLogitsProcessor) and processor.min_new_tokens <= 0


def _suppresses_nothing(processor) -> bool:
    """A suppression processor transformers builds for an empty list (``suppress_tokens=[]``)."""
    for kind, tokens in (
        (SuppressTokensLogitsProcessor, "suppress_tokens"),
        (SuppressTokensAtBeginLogitsProcessor, "begin_suppress_tokens"),
    ):
        if _is_builtin(processor, kind):
            return getattr(processor, tokens).numel() == 0
    return False


def _penalises_padding(processor) -> bool:
    """A repetition penalty made without ``prompt_ignore_length`` (a user's own: transformers then
    uses it instead of its own), which counts the pad ids of each row's left padding."""
    return (
        _is_builtin(processor, RepetitionPenaltyLogitsProcessor)
        and getattr(processor, "prompt_ignore_length", None) is None
    )


def _same(given, ours, pads: torch.Tensor) -> bool:
    """Same settings. transformers tells the repetition penalty to skip each row's left padding
    (``prompt_ignore_length`` = pad counts); our rows' histories hold no padding, which is the same."""
    state = dict(vars(given))
    skip = state.get("prompt_ignore_length")
    if _is_builtin(given, RepetitionPenaltyLogitsProcessor) and isinstance(skip, torch.Tensor):
        if skip.shape == pads.shape and torch.equal(skip.to(pads.device), pads):
            state["prompt_ignore_length"] = None
    try:
        return bool(state == vars(ours))
    except (RuntimeError, TypeError):  # other tensors in the state
        return False


def _read_criteria(criteria, rows: int) -> tuple[int, frozenset[int], list]:
    """max_length and EOS ids from transformers' criteria; the rest are checked per token as rows grow."""
    from transformers.generation.stopping_criteria import (
        EosTokenCriteria,
        MaxLengthCriteria,
        MaxTimeCriteria,
        StopStringCriteria,
    )

    max_length, eos, custom = None, set(), []
    for criterion in criteria:
        if _is_builtin(criterion, MaxLengthCriteria):
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif _is_builtin(criterion, EosTokenCriteria):
            eos.update(int(t) for t in criterion.eos_token_id.reshape(-1).tolist())
        else:
            custom.append(criterion)
    if max_length is None:
        raise ConfigError("no max_length: set max_new_tokens or max_length in the generation config")
    # transformers' stop strings judge each row by its own tokens; a time limit judges the batch
    # (transformers stops every row on the same step), which rows cut apart at their own blocks
    # cannot match
    row_wise = (StopStringCriteria,)  # a subclass may judge the batch: a custom criterion
    if rows > 1 and any(_is_builtin(c, MaxTimeCriteria) for c in custom):
        raise ConfigError(
            "a time limit (MaxTimeCriteria) needs batch size 1 with lookahead decoding: model.generate ends every"
            " row on the same step, and lookahead rows end at their own blocks"
        )
    if rows > 1 and any(not _is_builtin(c, *row_wise) for c in custom):
        names = ", ".join(type(c).__name__ for c in custom if not _is_builtin(c, *row_wise))
        raise ConfigError(f"custom stopping criteria ({names}) need batch size 1 with lookahead decoding")
    if rows > 1 and custom and not eos:
        # transformers pads a stopped row only where EOS is set; without it the row decodes on
        names = ", ".join(type(c).__name__ for c in custom)
        raise ConfigError(
            f"stopping criteria ({names}) on a batch need an EOS token with lookahead decoding: without one,"
            " model.generate keeps decoding a row they stop until every row has stopped; set eos_token_id,"
            " or generate one row per call"
        )
    return max_length, frozenset(eos), custom


class _RowWatcher:
    """Follows each row token by token as blocks are accepted: applies the stopping criteria
    transformers would call after each token, streams the token, and cuts a block where one says stop.

    The order is transformers' (``_sample``): the criteria judge a token before the streamer gets
    it (the stopping token is streamed too), so a criterion that reads what a streamer has shown
    sees what it sees there. Every row asks the criteria as its tokens are chosen
    (``stop_check``), so nothing is drawn past a stop; a token is judged and streamed once, when it
    is first seen (a sampled row's drawn tokens are all accepted: the walk stops at a stop, at EOS
    and at the row's room), so every criterion is still called once a token."""

    def __init__(self, input_ids: torch.Tensor, criteria: list, streamer) -> None:
        self.input_ids = input_ids
        self.criteria = criteria
        self.streamer = streamer
        self.generated: list[list[int]] = [[] for _ in range(input_ids.shape[0])]  # accepted tokens
        self.stopped: set[int] = set()
        # per row, one verdict for each token judged (and streamed) so far: True = stop after it
        self._verdicts: list[list[bool]] = [[] for _ in range(input_ids.shape[0])]

    def stop_check(self, row: int, block: list[int]) -> bool:
        """Whether the criteria stop ``row`` after the tokens of the step's ``block`` drawn so far."""
        return self._follow(row, self.generated[row] + block)

    def on_tokens(self, row: int, tokens: list[int]) -> bool:
        if row in self.stopped:
            return True
        for token in tokens:
            self.generated[row].append(token)
            if self._follow(row, self.generated[row]):
                self.stopped.add(row)
                return True
        return False

    def _follow(self, row: int, tokens: list[int]) -> bool:
        """Judge, then stream, each of the row's ``tokens`` not seen yet; whether to stop after the last."""
        verdicts = self._verdicts[row]
        for length in range(len(verdicts) + 1, len(tokens) + 1):
            verdicts.append(bool(self.criteria) and self._should_stop(row, tokens[:length]))
            if self.streamer is not None:
                self.streamer.put(torch.tensor([tokens[length - 1]]))
        return verdicts[len(tokens) - 1]

    def _should_stop(self, row: int, generated: list[int]) -> bool:
        ids = torch.tensor([self.input_ids[row].tolist() + generated], dtype=torch.long, device=self.input_ids.device)
        verdicts = [  # all, as transformers calls them; a plain bool counts as one for every row, as there
            bool(torch.as_tensor(criterion(ids, None)).reshape(-1)[0]) for criterion in self.criteria
        ]
        return any(verdicts)

    def sequences(self, pad: int) -> torch.LongTensor:
        """The prompt as given plus each row's tokens, right-padded with ``pad`` as transformers pads finished rows."""
        width = max(len(tokens) for tokens in self.generated)
        new = torch.full((len(self.generated), width), pad, dtype=torch.long, device=self.input_ids.device)
        for r, tokens in enumerate(self.generated):
            new[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return torch.cat([self.input_ids, new], dim=1)
