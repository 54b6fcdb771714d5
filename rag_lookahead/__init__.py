"""rag_lookahead: lossless lookahead decoding for local retrieval-augmented generation."""

from .config import LookaheadConfig
from .errors import ConfigError, InputError, ModelLoadError, RagLookaheadError
from .generate import GenerationResult, GenerationStats, generate
from .sampling import SamplingParams

__all__ = [
    "ChatLookahead",
    "ConfigError",
    "GenerationResult",
    "GenerationStats",
    "InputError",
    "LookaheadConfig",
    "ModelLoadError",
    "LookaheadGenerateOutput",
    "RagLookaheadError",
    "SamplingParams",
    "chat",
    "generate",
    "hf_generate",
    "load_model",
]
__version__ = "0.1.0"


def __getattr__(name):  # these pull in transformers (or LangChain) lazily
    if name == "load_model":
        from .models import load_model

        return load_model
    if name in ("hf_generate", "LookaheadGenerateOutput"):
        from . import hf_entry

        return getattr(hf_entry, name)
    if name == "chat":
        from .chat_api import chat

        return chat
    if name == "ChatLookahead":
        from .chat_model import ChatLookahead

        return ChatLookahead
    raise AttributeError(name)
