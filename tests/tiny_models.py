"""The tiny random-weight models of ``rag_lookahead.tiny``, cached per test session, and a reference decoder."""

from __future__ import annotations

import functools

import torch
from hypothesis import strategies as st

from rag_lookahead.decoding.drafter import TrieDrafter
from rag_lookahead.tiny import ARCHITECTURES, VOCAB, build_tiny_model

__all__ = [
    "ARCHITECTURES",
    "DECODE_CASES",
    "VOCAB",
    "PairedDrafter",
    "build_tiny_model",
    "padded",
    "real_vocab_model",
    "reference_generate",
    "tiny_model",
]

#: one decode on a tiny model: a short prompt over a small alphabet (repeats give drafts), a budget
DECODE_CASES = dict(
    prompt=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=40),
    max_new=st.integers(min_value=1, max_value=40),
    budget=st.sampled_from(["fixed", "auto"]),
)


@functools.cache
def tiny_model(arch: str, attn: str = "sdpa", seed: int = 0):
    """A deterministic fp32 tiny model; cached so every test reuses the same weights."""
    return build_tiny_model(arch, attn, seed)


def real_vocab_model():
    """``(model, tokenizer)``: a tiny random Qwen2 over the default model's tokenizer, for what needs
    a real one (transformers' stop strings, the chat template's tool calls); its answers are noise."""
    import transformers
    from transformers import AutoTokenizer

    from rag_lookahead.models import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def reference_generate(model, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """The new tokens of transformers' own greedy decoding for one unpadded prompt."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of the prompts left-padded with 0 to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


class PairedDrafter(TrieDrafter):
    """The trie drafter, checking that every row it retires is one it started, once."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.started: set = set()

    def start(self, row, references) -> None:
        self.started.add(row.index)
        super().start(row, references)

    def retire(self, row) -> None:
        self.started.remove(row.index)  # KeyError: retired without a start, or twice
        super().retire(row)
