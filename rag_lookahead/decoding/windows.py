"""Sliding-window attention (Mistral, Phi-3 with a window, Gemma 3, Qwen2 with ``use_sliding_window``):
every column kept in the cache, the window applied by the mask.

Why: transformers gives a sliding layer a cache that keeps only its last window of tokens, and
once that window is full it cannot take back a step's columns (``crop`` fails: the older ones
are gone). A verify step always writes columns that are then dropped: the rejected nodes. So
here every layer gets a plain ``DynamicLayer`` that keeps every column, and the window becomes
part of the step's mask: a query at position p sees the keys at positions above p - window, as
transformers' own sliding mask says (``sliding_window_overlay``). The tokens are those of
``generate``; the cache's memory grows with the context as a full-attention model's does.

A model whose layers all slide takes the windowed mask itself (its forward passes a 4-D mask
through as it is); a model with both kinds of layer (``config.layer_types``) takes one mask per
kind, as ``generate`` hands it ``create_masks_for_generate``'s dict. Other layer kinds (Llama 4's
chunked attention, linear attention) are refused before any forward (``check_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rag_lookahead.decoding.forward_signature import check_forward_signature

__all__ = ["SlidingWindow", "check_layers", "full_cache", "ignored_window", "sliding_window", "text_config"]

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class SlidingWindow:
    """A model's sliding layers: each query sees ``size`` positions, itself included."""

    size: int
    by_layer_type: bool  # the forward takes {FULL: mask, SLIDING: mask}; else every layer slides

    def reaches(self, last_position: int) -> bool:
        """Whether a query at ``last_position`` (the step's furthest) has keys outside its window."""
        return last_position >= self.size

    def near(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """(Q, K) bool: key j is inside query i's window (by position, whoever owns it)."""
        return key_positions > (query_positions - self.size)[:, None]

    def masks(self, allowed: torch.Tensor, near: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """What the forward takes for the (Q, K) ``allowed`` mask: windowed, or one mask per layer kind."""
        windowed = allowed & near
        return {FULL: allowed, SLIDING: windowed} if self.by_layer_type else windowed


def text_config(model):
    """The config of the model's (text) decoder: a composite model's text config, else its own."""
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _layer_types(model) -> list[str]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    return list(get_layer_types_and_kwargs(text_config(model))[0])


def sliding_window(model) -> SlidingWindow | None:
    """The model's sliding window; None if no layer slides."""
    config = text_config(model)
    size = getattr(config, "sliding_window", None)
    declared = getattr(config, "layer_types", None)
    if size is None or (declared is not None and SLIDING not in declared):
        return None
    return SlidingWindow(int(size), by_layer_type=declared is not None and FULL in declared)


def ignored_window(model) -> int | None:
    """A ``config.sliding_window`` that the model's attention never applies (a key left over in a
    converted Llama config, say); None where there is none or the model honours it.

    transformers still builds sliding cache layers from it (no ``layer_types`` declared), so
    ``generate`` attends over the whole prompt and then, decoding, only over the last window:
    past the window its tokens follow the cache, not the model. We decode up to the window (see
    ``inputs.context_limit``), where both agree. A transformers model honours a window when one
    of its modules' code builds sliding masks (a composite model's text decoder may live in
    another file than the model); code from elsewhere is trusted to honour its config."""
    config = text_config(model)
    size = getattr(config, "sliding_window", None)
    if size is None or getattr(config, "layer_types", None) is not None:
        return None
    return None if _may_slide(model) else int(size)


def _may_slide(model) -> bool:
    """Whether any of the model's own modules comes from code that builds sliding masks, or is a
    model class from code outside transformers (remote code). Asked of the model itself, not
    cached by its class: a composite class (Llava) builds a Llama or a Mistral decoder, as its
    config says. Layers added from elsewhere that are not models (a LoRA adapter's, a quantized
    linear's, torch's own) say nothing of the attention and are not trusted to slide."""
    import sys

    from transformers import PreTrainedModel

    files = {
        sys.modules.get(type(m).__module__)
        for m in model.modules()
        if isinstance(m, PreTrainedModel) or type(m).__module__.startswith("transformers.")
    }
    return any(
        f is None or not f.__name__.startswith("transformers.") or hasattr(f, "create_sliding_window_causal_mask")
        for f in files
    )


def check_layers(model) -> list[str]:
    """Refuse, before any forward, a model with a layer kind the packed cache cannot crop or compact
    by slicing: chunked attention (a chunk mask, not a window), linear attention, state-space
    layers, a recurrent state or a cache of the model's own, a Dory that runs a layer twice per
    forward; and a model that ``generate`` feeds the whole sequence on every step. Then refuse one
    that attends both ways (``causality``: where its config says ``is_decoder=False``, two short
    forwards tell, once per model). First of all, one whose forward cannot take the KV cache as
    ``cache`` (``forward_signature``: ``past_key_values`` without ``**kwargs``, remote code written
    before transformers 5.24). Returns each layer's kind."""
    check_forward_signature(model)
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"rag_lookahead supports decoder-only models; {type(model).__name__} is an encoder-decoder"
        )
    config = text_config(model)
    if getattr(config, "cross_attention_layers", None):
        # Mllama: without an image those layers keep no cache, which the packed cache cannot crop or pack
        raise NotImplementedError(
            f"rag_lookahead does not support cross-attention layers; {type(model).__name__} has them"
        )
    if getattr(config, "recurrent_kv_cache_mode", None) == "last_loop":
        # Dory: the earlier loops of a forward read the last loop's cached keys for past tokens but
        # their own for its new ones, so a forward of k tokens is not k forwards of one
        raise NotImplementedError(
            f"{type(model).__name__} with recurrent_kv_cache_mode='last_loop' gives other logits for several new"
            " tokens at once than one at a time, which verifying drafts needs; use 'per_loop'"
        )
    _check_sections_apart(model, config)
    kinds = _layer_types(model)
    unsupported = sorted(set(kinds) - {FULL, SLIDING})
    if unsupported:
        raise NotImplementedError(
            f"rag_lookahead supports full-attention and sliding-window layers only; "
            f"{type(model).__name__} has {', '.join(map(repr, unsupported))} layers"
        )
    if _keeps_own_state(model):
        # xLSTM declares full-attention layers, yet its forward reads a recurrent state from the cache
        raise NotImplementedError(
            f"rag_lookahead supports full-attention and sliding-window layers only; {type(model).__name__} keeps "
            "a recurrent state or a cache of its own (not transformers' DynamicCache), which cannot be taken back "
            "to before a rejected draft"
        )
    _check_fed_new_tokens(model)
    from rag_lookahead.decoding.causality import check_causal

    check_causal(model)
    return kinds


def _check_sections_apart(model, config) -> None:
    """Refuse a Dory whose input, recurrent and output sections share layers. Its forward runs them
    as slices of its layer list, and its config accepts a negative section (Dory's defaults of 8
    input and 8 output layers on a model cut to 2 layers leave -14 recurrent ones): the slices then
    overlap and a layer runs twice per forward, writing two cache columns per token, which a mask
    sized to one column per token cannot cover (a raw size error in the attention, with lookahead
    on, or off once a sliding window applies; ``model.generate`` fails so on a padded batch)."""
    sizes = [getattr(config, name, None) for name in ("n_input_layers", "n_recurrent_layers", "n_output_layers")]
    if not all(isinstance(size, int) for size in sizes):
        return
    n_input, n_recurrent, n_output = sizes
    layers = range(config.num_hidden_layers)
    sections = [layers[:n_input], layers[n_input : n_input + n_recurrent], layers[len(layers) - n_output :]]
    twice = sorted({i for a, b in ((0, 1), (0, 2), (1, 2)) for i in set(sections[a]) & set(sections[b])})
    if twice:
        raise NotImplementedError(
            f"{type(model).__name__} runs layers {twice} twice in one forward (n_input_layers={n_input},"
            f" n_recurrent_layers={n_recurrent}, n_output_layers={n_output} of num_hidden_layers={len(layers)}),"
            " writing two KV cache columns per token, which verifying drafts cannot mask; set the three sections"
            " to sizes of 0 or more that add up to num_hidden_layers"
        )


def _keeps_own_state(model) -> bool:
    """Whether transformers itself keeps the model from ``generate``'s rollback or its DynamicCache:
    a stateful model (no assisted decoding: its state cannot be cropped), or one whose ``generate``
    does not start from a DynamicCache (xLSTM, RWKV, Reformer, XLNet)."""
    cls = type(model)
    supports_dynamic = getattr(cls, "_supports_default_dynamic_cache", None)
    return bool(getattr(cls, "_is_stateful", False)) or (callable(supports_dynamic) and not supports_dynamic())


def _check_fed_new_tokens(model) -> None:
    """Refuse a model that ``generate`` hands the whole sequence on every step (CPM-Ant slices off the
    cached part in its forward, XLM appends a mask token and predicts at it, OpenAI GPT keeps no
    cache): fed only the new tokens, as every forward of ours is, they failed deep inside their
    attention (OpenAI GPT only at the packed cache, after the prefill's forward)."""
    from rag_lookahead.decoding.generate_inputs import feeds_whole_sequence
    from rag_lookahead.decoding.profile import profile_of
    from rag_lookahead.decoding.verify import input_device

    profile = profile_of(model)
    if profile.fed_whole_sequence is None:  # read once per model: a prepare_inputs call costs ~0.3 ms
        profile.fed_whole_sequence = feeds_whole_sequence(model, input_device(model))
    if profile.fed_whole_sequence:
        raise NotImplementedError(
            f"rag_lookahead feeds a forward only the tokens after those in its KV cache; model.generate feeds "
            f"{type(model).__name__} the whole sequence on every step (it keeps no KV cache, or its forward slices "
            "off the cached part itself), which verifying drafts cannot do"
        )


def full_cache(model):
    """A ``DynamicCache`` for ``model`` whose sliding layers keep every column (see the module note):
    plain ``DynamicLayer``s only, which the packed cache crops and compacts by slicing."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    kinds = check_layers(model)
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if kind == SLIDING else layer for kind, layer in zip(kinds, cache.layers)]
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"rag_lookahead supports full-attention dynamic caches only; this model uses {type(layer).__name__}"
            )
    return cache
