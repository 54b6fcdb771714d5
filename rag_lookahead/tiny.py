"""Tiny randomly initialised causal LMs of the architectures we support, built from configs alone.

They need no download, decode hundreds of prompts in seconds on a CPU, and random weights give
no architecture a free pass: lossless decoding must match ``model.generate`` token for token.
The tests and ``gpu_check`` build them here, so both check the same models.
"""

from __future__ import annotations

import torch

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

#: architecture -> (config class, model class, config fields beyond the common ones)
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    # sliding-window attention, kept in a full cache and applied by the mask (``decoding/windows``);
    # windows shorter than the tests' prompts plus answers, so most decodes run past them
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


def build_tiny_model(
    arch: str, attn: str = "sdpa", seed: int = 0, *, device: str | torch.device = "cpu", max_positions: int = 256
):
    """A fresh fp32 tiny model in eval mode: the same weights for the same ``arch`` and ``seed``.

    Weights are drawn on the CPU and then moved, so a GPU gets the very weights a CPU test sees.
    """
    import transformers  # here, not at import: the CLI imports this module, and most commands never build one

    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**_COMMON, "max_position_embeddings": max_positions}, **extra)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device)
