"""A remote-code model for tests: what a hub repo with ``auto_map`` ships (as ChatGLM3 and Qwen-1 do).

``TinyRemoteForCausalLM`` is Qwen2 under another name, so its attention honours a 4-D mask
and tree drafts apply. ``MaskBlindForCausalLM`` drops a 4-D mask and attends causally, as
Qwen-1's attention did in the reference implementation: one branch would see the other, so
the mask probe must fall back to chains. ``LegacyCacheForCausalLM`` and
``LegacyKwargsForCausalLM`` are code written before transformers 5.24, as ChatGLM2/3's is: the
forward names the KV cache ``past_key_values`` (without and with a ``**kwargs`` that swallows
anything else), and only their own ``prepare_inputs_for_generation`` lets ``model.generate`` run
them on transformers 5.24. ``PassesKwargsOnForCausalLM`` is remote code written for transformers
5.0-5.23 that subclasses a native class: ``past_key_values`` in its signature, and ``**kwargs``
(the ``cache=`` of 5.24) passed on to the native forward, which takes it. ``SlowForCausalLM``
takes 50 ms more per forward (a stream that lasts seconds); ``KilledOnLoadForCausalLM`` kills its
own process (and a Serve controller beside it) as it is built, as Ray's memory monitor does.
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


class _PastKeyValuesInputs(TinyRemoteForCausalLM):
    def prepare_inputs_for_generation(self, *args, **kwargs):
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        if "cache" in inputs:
            inputs["past_key_values"] = inputs.pop("cache")
        return inputs


class LegacyCacheForCausalLM(_PastKeyValuesInputs):
    """ChatGLM3's forward signature: ``past_key_values``, no ``**kwargs``."""

    def forward(
        self,
        input_ids=None,
        position_ids=None,
        attention_mask=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        return_last_logit=False,
    ):
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
        )


class LegacyKwargsForCausalLM(_PastKeyValuesInputs):
    """The same with a ``**kwargs`` that swallows anything else (many 4.x hub files have one)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=past_key_values
        )


class PassesKwargsOnForCausalLM(TinyRemoteForCausalLM):
    """A subclass of a native class with the signature of transformers 5.0-5.23, passing ``**kwargs`` on."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,  # 5.24's forward warns that it takes cache= (in kwargs) instead
            **kwargs,
        )


class SlowForCausalLM(TinyRemoteForCausalLM):
    """Each forward takes 50 ms more: a stream of a few hundred tokens lasts seconds, long enough to
    signal a server while it runs."""

    def forward(self, *args, **kwargs):
        import time

        time.sleep(0.05)
        return super().forward(*args, **kwargs)



class KilledOnLoadForCausalLM(TinyRemoteForCausalLM):
    """Its process is killed (SIGKILL) as the model is built, and under Ray Serve the Serve
    controller beside it too: what Ray's memory monitor did to a model too big for memory (it
    killed the replica and the controller, each new controller started the replica again, and
    Ray's constructor retries never ran out), without using any memory."""

    def __init__(self, config) -> None:
        import os
        import signal

        import psutil

        for sibling in psutil.Process().parent().children():  # the raylet's workers: ours only
            try:
                if sibling.name().startswith("ray::ServeController"):
                    sibling.kill()
            except psutil.Error:
                pass
        os.kill(os.getpid(), signal.SIGKILL)
