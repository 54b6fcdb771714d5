"""rag_lookahead: lossless lookahead decoding for local retrieval-augmented generation."""

from .config import LookaheadConfig
from .errors import ConfigError, InputError, ModelLoadError, RagLookaheadError
from .generate import GenerationResult, GenerationStats, generate

__all__ = [
    "ConfigError",
    "GenerationResult",
    "GenerationStats",
    "InputError",
    "LookaheadConfig",
    "ModelLoadError",
    "RagLookaheadError",
    "generate",
    "load_model",
]
__version__ = "0.1.0"


def __getattr__(name):  # load_model pulls in transformers lazily
    if name == "load_model":
        from .models import load_model

        return load_model
    raise AttributeError(name)
