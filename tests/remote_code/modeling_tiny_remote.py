"""A remote-code model for tests: what a hub repo with ``auto_map`` ships (as ChatGLM3 and Qwen-1 do).

``TinyRemoteForCausalLM`` is Qwen2 under another name, so its attention honours a 4-D mask
and tree drafts apply. ``MaskBlindForCausalLM`` drops a 4-D mask and attends causally, as
Qwen-1's attention did in the reference implementation: one branch would see the other, so
the mask probe must fall back to chains.
"""

from transformers import Qwen2Config, Qwen2ForCausalLM


class TinyRemoteConfig(Qwen2Config):
    model_type = "tiny_remote"


class TinyRemoteForCausalLM(Qwen2ForCausalLM):
    config_class = TinyRemoteConfig


class MaskBlindForCausalLM(TinyRemoteForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None  # causal attention over the whole cache, whatever the caller asked
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
