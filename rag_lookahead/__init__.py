"""rag_lookahead: lossless lookahead decoding for local retrieval-augmented generation."""

from typing import TYPE_CHECKING

from rag_lookahead.errors import ConfigError, InputError, ModelLoadError, RagLookaheadError

if TYPE_CHECKING:  # what __getattr__ hands out, for type checkers; at run time only when asked for (torch)
    from rag_lookahead.chat_api import chat
    from rag_lookahead.decoding.config import LookaheadConfig
    from rag_lookahead.decoding.loop import GenerationResult, GenerationStats, generate
    from rag_lookahead.decoding.sampling import SamplingParams
    from rag_lookahead.hf_entry import LookaheadGenerateOutput, hf_generate
    from rag_lookahead.langchain.chat_model import ChatLookahead
    from rag_lookahead.langchain.llm import LookaheadLLM
    from rag_lookahead.models import load_model
    from rag_lookahead.weight_watch import forget_weight_copies

__all__ = [
    "ChatLookahead",
    "ConfigError",
    "GenerationResult",
    "GenerationStats",
    "InputError",
    "LookaheadConfig",
    "LookaheadLLM",
    "ModelLoadError",
    "LookaheadGenerateOutput",
    "RagLookaheadError",
    "SamplingParams",
    "chat",
    "forget_weight_copies",
    "generate",
    "hf_generate",
    "load_model",
]
__version__ = "0.1.0"


def __dir__():  # the lazy names too, for completion
    return sorted({*globals(), *__all__})


if not TYPE_CHECKING:  # seen by a type checker, it made every misspelled name Any

    def __getattr__(name):  # these pull in torch, transformers or LangChain, so only when asked for
        if name == "LookaheadConfig":
            from rag_lookahead.decoding.config import LookaheadConfig

            return LookaheadConfig
        if name in ("GenerationResult", "GenerationStats", "generate"):
            from rag_lookahead.decoding import loop

            return getattr(loop, name)
        if name == "SamplingParams":
            from rag_lookahead.decoding.sampling import SamplingParams

            return SamplingParams
        if name == "load_model":
            from rag_lookahead.models import load_model

            return load_model
        if name in ("hf_generate", "LookaheadGenerateOutput"):
            from rag_lookahead import hf_entry

            return getattr(hf_entry, name)
        if name == "forget_weight_copies":
            from rag_lookahead.weight_watch import forget_weight_copies

            return forget_weight_copies
        if name == "chat":
            from rag_lookahead.chat_api import chat

            return chat
        if name == "ChatLookahead":
            from rag_lookahead.langchain.chat_model import ChatLookahead

            return ChatLookahead
        if name == "LookaheadLLM":
            from rag_lookahead.langchain.llm import LookaheadLLM

            return LookaheadLLM
        import sys  # here, so that it is not one of the package's names

        raise AttributeError(f"module 'rag_lookahead' has no attribute {name!r}", name=name, obj=sys.modules[__name__])


del TYPE_CHECKING  # not one of the package's names
