"""Tiny randomly initialised causal LMs of several architectures native to transformers.

They are small enough to decode hundreds of prompts in seconds, and random weights give
no architecture a free pass: lossless decoding must match ``model.generate`` token for token.
"""

from __future__ import annotations

import functools

import torch
import transformers

VOCAB = 96

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=None,
    bos_token_id=None,
)

ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.5}),
}


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str, attn: str = "sdpa", seed: int = 0):
    """A deterministic fp32 tiny model; cached so every test reuses the same weights."""
    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**_COMMON, **extra)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


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
