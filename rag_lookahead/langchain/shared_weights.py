"""Weights loaded once per model id, and one engine per loaded model, while LangChain models use them.

``ChatLookahead(model="default")`` and ``LookaheadLLM.from_model_id("default")`` in one process (as
the README's LangChain example builds them) each loaded their own copy of the weights: several GB
more for nothing. Both load through :func:`load_shared`, and decode through :func:`shared_engine`,
so their decodes take turns on the one model (an engine decodes one call at a time).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.langchain.engine import Engine, pool_shape

log = logging.getLogger(__name__)

#: models loaded by id, held weakly (the model goes with the last LangChain model that uses it), with
#: their tokenizers; keyed by the folder and dtype they resolve to ("bf16" and torch.bfloat16,
#: "./m" and "m/" loaded the same weights again, and every copy was kept for the process's life)
_LOADED: dict[tuple, tuple[weakref.ref, Any]] = {}
_LOCK = threading.Lock()
#: the engine of each loaded model in use, by the model's id: held weakly, so an engine (and the
#: model it holds) goes once no LangChain model uses it; while it lives, its model does, so no
#: other model can take that id (weak keys would never die: the engine holds its model)
_ENGINES: weakref.WeakValueDictionary[int, Engine] = weakref.WeakValueDictionary()


def load_shared(model_id: str, dtype: Any, device: Any, device_map: Any, trust_remote_code: bool) -> tuple[Any, Any]:
    """``load_model`` once per (model, dtype, device, remote-code opt-in) while a LangChain model
    uses it: chat models and ``LookaheadLLM.from_model_id`` built from the same id share the weights.
    The opt-in is part of the key for a folder or hub id, so a model built without it is refused a
    remote-code model another one loaded, as ``load_model`` refuses it; not for an embedded model,
    which has no code of its own to run (``load_model`` ignores the flag there), so
    ``model="default"`` with and without it loads once."""
    from rag_lookahead.embedded_model import EMBEDDED
    from rag_lookahead.models import load_model, placement, resolve_dtype
    from rag_lookahead.paths import expand_user

    embedded = model_id in EMBEDDED
    where = model_id  # "default" is the embedded model whatever folder of that name is here, as load_model reads it
    if not embedded and (folder := expand_user(model_id, "model")).is_dir():
        where = str(folder.resolve())
    remote_code = None if embedded else trust_remote_code
    # where the weights go, not how it was said: device None and "cpu" on a CPU (or "cuda" and
    # "cuda:0") loaded two copies
    key = (where, str(resolve_dtype(dtype, device, device_map)), repr(placement(device, device_map)), remote_code)
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


def shared_engine(model: Any, tokenizer: Any, config: LookaheadConfig) -> Engine:
    """One engine (so one output pool) per loaded model and tokenizer: one decode at a time on
    the model. A later model's pool settings cannot resize the shared pool, so they are said to be
    unused rather than dropped in silence."""
    with _LOCK:
        engine = _ENGINES.get(id(model))
        if engine is None or engine.model is not model or engine.tokenizer is not tokenizer:
            # the pool lives with the model (its profile), so chat models made one after another
            # (one a request, say) draft from the answers of those before
            pool = profile_of(model).output_pool(*pool_shape(config))
            engine = Engine(model, tokenizer, config, output_pool=pool)
            _ENGINES[id(model)] = engine
        elif (engine.output_pool.depth, engine.output_pool.max_nodes) != pool_shape(config):
            log.warning(
                "this model shares the engine of a model already in use, and its output pool "
                "(depth %d, max_nodes %d); this one's output_pool_nodes / branch_length + max_key_length "
                "(%d, %d) size no pool: build the first model with the settings you want",
                engine.output_pool.depth,
                engine.output_pool.max_nodes,
                config.output_pool_nodes,
                config.pool_depth,
            )
        return engine
