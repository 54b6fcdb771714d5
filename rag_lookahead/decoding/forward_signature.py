"""Refuse a model whose ``forward`` cannot take the KV cache under the name we pass it, ``cache``.

Why: every forward of ours passes ``cache=`` (the name transformers 5.24 gave it). Remote code
written before transformers 5.24 (ChatGLM2/3's ``modeling_chatglm.py``, many hub repos) names it
``past_key_values``. Without a ``**kwargs`` its forward raised a bare TypeError at the first
step (after the tree-mask probe had failed on it and warned that chains were "still lossless"),
and a server started and answered 503 to every request. That case is certain from the signature,
read before any forward, once per call: ~20 µs, against a step's milliseconds.

A forward with ``past_key_values`` and a ``**kwargs`` is not refused here: remote code written for
transformers 5.0-5.23 that subclasses a native class passes its ``**kwargs`` (our ``cache=``) on
to the native forward, which takes it, and decodes as ``model.generate`` does. One whose
``**kwargs`` swallow the cache is told apart after its first forward, which leaves the cache
empty (``empty_cache_error``).
"""

from __future__ import annotations

import inspect

from rag_lookahead.errors import ConfigError

__all__ = [
    "EMPTY_CACHE",
    "cache_left_empty",
    "check_cache_filled",
    "check_forward_signature",
    "empty_cache_error",
    "ignores_position_ids",
    "takes_position_ids",
]

BEFORE_CACHE_NAME = "code written before transformers 5.24"
#: what a forward that left the cache empty is told where its signature gives no cause
EMPTY_CACHE = "rag_lookahead needs a model that fills transformers' KV cache; this one left it empty"


def _parameters(model) -> dict[str, inspect.Parameter] | None:
    """``model.forward``'s parameters; None where its signature cannot be read (a C function, a
    wrapper without ``__wrapped__``)."""
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (AttributeError, TypeError, ValueError):
        return None


def takes_position_ids(model) -> bool:
    """Whether ``model.forward`` names a ``position_ids`` parameter (False where its signature
    cannot be read)."""
    return "position_ids" in (_parameters(model) or {})


def ignores_position_ids(model) -> bool:
    """Whether the model numbers its positions itself, by cache column, whatever ``position_ids`` we
    pass: a transformers class whose forward names none, nor does its decoder (RoFormer, the
    Bart-family decoders, Bloom, MPT; ``**kwargs`` take ours unread). Evolla's forward names none
    but passes its ``**kwargs`` to a decoder that reads them. Remote code is not judged so: its
    ``**kwargs`` may pass them on to a native forward."""
    if not type(model).__module__.startswith("transformers.") or _parameters(model) is None:
        return False
    if takes_position_ids(model):
        return False
    try:
        decoder = model.get_decoder()
    except Exception:  # no decoder to ask (or one it cannot name)
        return True
    return decoder is model or decoder is None or not takes_position_ids(decoder)


def check_forward_signature(model) -> None:
    """Raise ConfigError if ``model.forward`` has neither a ``cache`` parameter nor ``**kwargs``: our
    ``cache=`` would be a TypeError at its first call. A forward whose signature cannot be read is
    left to run."""
    parameters = _parameters(model)
    if parameters is None or "cache" in parameters:
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return  # it may pass cache= on (a subclass of a native class); an empty cache tells otherwise
    name = type(model).__name__
    if "past_key_values" in parameters:
        raise ConfigError(
            f"{name}'s forward takes past_key_values ({BEFORE_CACHE_NAME}), not cache, the name"
            " transformers 5.24 and rag_lookahead pass the KV cache under: its modeling code does not run here;"
            " use a checkpoint with a native transformers class (GLM-4 -hf, Qwen2.5) or modeling code written"
            " for transformers 5.24 or later"
        )
    raise ConfigError(
        f"{name}'s forward takes no cache argument (nor **kwargs), so it cannot decode from a KV cache,"
        " which lookahead decoding needs"
    )


def empty_cache_error(model) -> Exception:
    """The error for a forward that left the KV cache we passed it empty. Where its forward names
    ``past_key_values`` (and ``**kwargs``, which took our ``cache=`` unread) that is the cause, and a
    ConfigError says so; otherwise (OpenAI GPT keeps no cache) a NotImplementedError."""
    parameters = _parameters(model) or {}
    if "cache" not in parameters and "past_key_values" in parameters:
        return ConfigError(
            f"{type(model).__name__}'s forward takes past_key_values ({BEFORE_CACHE_NAME}) and **kwargs, which"
            " took the cache rag_lookahead passes as cache= and left it empty: its modeling code does not run"
            " here; use a checkpoint with a native transformers class (GLM-4 -hf, Qwen2.5) or modeling code"
            " written for transformers 5.24 or later"
        )
    return NotImplementedError(EMPTY_CACHE)


def cache_left_empty(cache) -> bool:
    """Whether a forward given ``cache`` left some layer of it unfilled."""
    return any(getattr(layer, "keys", None) is None for layer in cache.layers)


def check_cache_filled(model, cache) -> None:
    """Raise ``empty_cache_error`` if the forward just run on ``cache`` did not fill it."""
    if cache_left_empty(cache):
        raise empty_cache_error(model)
