"""Weights loaded once per model id while a LangChain model uses them.

``ChatLookahead(model="default")`` and ``LookaheadLLM.from_model_id("default")`` in one process (as
the README's LangChain example builds them) each loaded their own copy of the weights: several GB
more for nothing. Both load through :func:`load_shared`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

#: models loaded by id, held weakly (the model goes with the last LangChain model that uses it), with
#: their tokenizers; keyed by the folder and dtype they resolve to ("bf16" and torch.bfloat16,
#: "./m" and "m/" loaded the same weights again, and every copy was kept for the process's life)
_LOADED: dict[tuple, tuple[weakref.ref, Any]] = {}
_LOCK = threading.Lock()


def load_shared(model_id: str, dtype: Any, device: Any, device_map: Any, trust_remote_code: bool) -> tuple[Any, Any]:
    """``load_model`` once per (model, dtype, device, remote-code opt-in) while a LangChain model
    uses it: chat models and ``LookaheadLLM.from_model_id`` built from the same id share the weights.
    The opt-in is part of the key for a folder or hub id, so a model built without it is refused a
    remote-code model another one loaded, as ``load_model`` refuses it; not for an embedded model,
    which has no code of its own to run (``load_model`` ignores the flag there), so
    ``model="default"`` with and without it loads once."""
    from rag_lookahead.embedded_model import EMBEDDED
    from rag_lookahead.models import load_model, resolve_dtype
    from rag_lookahead.paths import expand_user

    embedded = model_id in EMBEDDED
    where = model_id  # "default" is the embedded model whatever folder of that name is here, as load_model reads it
    if not embedded and (folder := expand_user(model_id, "model")).is_dir():
        where = str(folder.resolve())
    remote_code = None if embedded else trust_remote_code
    key = (where, str(resolve_dtype(dtype, device, device_map)), str(device), repr(device_map), remote_code)
    with _LOCK:
        held = _LOADED.get(key)
        model = held[0]() if held is not None else None
        if model is not None:
            return model, held[1]
        for gone in [k for k, (ref, _) in _LOADED.items() if ref() is None]:
            del _LOADED[gone]
        model, tokenizer = load_model(
            model_id, dtype=dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code
        )
        _LOADED[key] = (weakref.ref(model), tokenizer)
        return model, tokenizer
