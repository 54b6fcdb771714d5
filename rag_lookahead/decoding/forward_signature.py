"""Refuse a model whose ``forward`` cannot take the KV cache under transformers 5's name, ``cache``.

Why: every forward of ours passes ``cache=`` (the name transformers 5 gives it). Remote code written
for transformers 4 (ChatGLM2/3's ``modeling_chatglm.py``, many hub repos) names it
``past_key_values``. Without a ``**kwargs`` its forward raised a bare TypeError at the first
step (after the tree-mask probe had failed on it and warned that chains were "still lossless"),
and a server started and answered 503 to every request; with one, the cache was swallowed and
never filled, and the decode failed later. Read from the signature before any forward, once per
call: ~20 µs, against a step's milliseconds.
"""

from __future__ import annotations

import inspect

from rag_lookahead.errors import ConfigError

__all__ = ["check_forward_signature"]


def check_forward_signature(model) -> None:
    """Raise ConfigError if ``model.forward`` has no ``cache`` parameter and either names
    ``past_key_values`` (code written for transformers 4: a ``**kwargs`` beside it would swallow
    ``cache`` unread) or takes no ``**kwargs`` at all. A forward whose signature cannot be read
    (a C function, a wrapper without ``__wrapped__``) is left to run."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return
    if "cache" in parameters:
        return
    name = type(model).__name__
    if "past_key_values" in parameters:
        raise ConfigError(
            f"{name}'s forward takes past_key_values (code written for transformers 4), not cache, the name"
            " transformers 5 and rag_lookahead pass the KV cache under: its modeling code does not run here;"
            " use a checkpoint with a native transformers class (GLM-4 -hf, Qwen2.5) or modeling code written"
            " for transformers 5"
        )
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        raise ConfigError(
            f"{name}'s forward takes no cache argument (nor **kwargs), so it cannot decode from a KV cache,"
            " which lookahead decoding needs"
        )
