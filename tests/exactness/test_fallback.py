"""Models whose attention ignores a custom 4-D mask: detected by the probe, decoded with chains."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import reference_generate, tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.verify import supports_tree_mask


def causal_only_attention(module, query, key, value, attention_mask, **kwargs):
    """Like a kernel that only knows causal attention: whatever mask it is given is ignored."""
    q_len, kv_len = query.shape[2], key.shape[2]
    rows = torch.arange(q_len, device=query.device)[:, None]
    cols = torch.arange(kv_len, device=query.device)[None, :]
    causal = (cols <= rows + (kv_len - q_len))[None, None]
    return sdpa_attention_forward(module, query, key, value, causal, **kwargs)


AttentionInterface.register("causal_only", causal_only_attention)
AttentionMaskInterface.register("causal_only", sdpa_mask)


def kernel_switching_attention(module, query, key, value, attention_mask, **kwargs):
    """Like sdpa on a GPU, where an unmasked call takes another kernel (flash) than a masked one
    (memory-efficient) and rounds differently: here its output is off by 2% without a mask."""
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return (out if attention_mask is not None else out * 1.02), weights


AttentionInterface.register("kernel_switching", kernel_switching_attention)
AttentionMaskInterface.register("kernel_switching", sdpa_mask)


def test_probe_judges_the_mask_not_the_kernel():
    """The probe's branch runs go through a 4-D mask like the tree step, so a kernel that only
    unmasked calls take cannot fail a model whose attention honours the mask (it did on an H200)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert supports_tree_mask(tiny_model("qwen2", attn="kernel_switching", seed=4)) is True


@pytest.fixture(scope="module")
def maskless_model():
    return tiny_model("qwen2", attn="causal_only", seed=3)


def test_probe_tells_mask_aware_from_mask_blind_models(maskless_model):
    assert supports_tree_mask(tiny_model("qwen2")) is True
    with pytest.warns(UserWarning, match="ignores the tree mask"):
        assert supports_tree_mask(maskless_model) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the answer is remembered per model
        assert supports_tree_mask(maskless_model) is False


def test_chain_drafts_stay_lossless_without_a_tree_mask(maskless_model):
    prompt = [4, 5, 6, 7, 4, 5, 6, 7, 4, 5]
    expected = reference_generate(maskless_model, prompt, 24, None)
    result = generate(
        maskless_model,
        prompt,
        max_new_tokens=24,
        config=LookaheadConfig(budget="fixed"),
        references=[[prompt + expected]],
    )
    assert result.sequences[0, len(prompt) :].tolist() == expected
    assert result.stats.mean_accepted > 1.5  # a chain from the reference is still accepted


@pytest.mark.parametrize("enabled", [True, False])
def test_batches_fall_back_to_row_by_row(maskless_model, enabled):
    """Rows share one packed cache that only the mask keeps apart, with or without drafts."""
    prompts = [[1, 2, 3, 1, 2, 3, 1], [9, 8]]
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1], [0, 0, 0, 0, 0, 9, 8]])
    mask = (ids != 0).long()
    config = LookaheadConfig(budget="fixed", enabled=enabled)
    result = generate(maskless_model, ids, mask, max_new_tokens=10, config=config, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        assert result.sequences[row, 7:].tolist() == reference_generate(maskless_model, prompt, 10, None)


@pytest.mark.parametrize("enabled", [True, False])
def test_decode_batch_refuses_a_second_row_on_a_mask_blind_model(maskless_model, enabled):
    """A caller driving DecodeBatch itself (a server) gets a clear error instead of rows that see each other."""
    from rag_lookahead.decoding.loop import DecodeBatch
    from rag_lookahead.errors import ConfigError

    batch = DecodeBatch(maskless_model, LookaheadConfig(budget="fixed", enabled=enabled), frozenset(), None)
    batch.add([[1, 2, 3]], None, None, 4)
    with pytest.raises(ConfigError, match="ignores custom masks"):
        batch.add([[4, 5, 6]], None, None, 4)


def test_prompt_lookup_batches_fall_back_to_row_by_row(maskless_model):
    """Another drafter takes the same row-by-row path, with its chains verified unmasked."""
    from rag_lookahead.decoding.drafter import PromptLookupDrafter

    prompts = [[1, 2, 3, 1, 2, 3, 1], [9, 8, 9, 8]]
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1], [0, 0, 0, 9, 8, 9, 8]])
    config = LookaheadConfig(budget="fixed")
    drafter = PromptLookupDrafter(max_ngram=3)
    result = generate(maskless_model, ids, (ids != 0).long(), max_new_tokens=12, config=config, drafter=drafter)
    for row, prompt in enumerate(prompts):
        assert result.sequences[row, 7:].tolist() == reference_generate(maskless_model, prompt, 12, None)


def test_row_by_row_keeps_the_calls_resolved_settings(maskless_model):
    """Each row is decoded with what the whole call resolved: the model's own config cannot undo
    the call's ``generation_config``, and ``min_length`` is judged against the padded width, as
    transformers judges it over a batch (both were refused per row). A mask-blind model's padded
    row is compared with the row run alone: in a batch its attention would see the pads."""
    from transformers import GenerationConfig

    prompts = [[5, 6, 7], [3, 4, 5, 6, 7]]
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = (ids != 0).long()

    def alone(prompt, **options):
        out = maskless_model.generate(torch.tensor([prompt]), max_new_tokens=8, **options)
        return out[0, len(prompt) :].tolist()

    own = maskless_model.generation_config
    saved = own.no_repeat_ngram_size, own.min_length
    try:
        own.no_repeat_ngram_size = 3
        config = GenerationConfig(do_sample=False, no_repeat_ngram_size=0, max_new_tokens=8, pad_token_id=0)
        ours = generate(maskless_model, ids, mask, max_new_tokens=8, generation_config=config, pad_token_id=0)
        for row, prompt in enumerate(prompts):
            assert ours.sequences[row, 5:].tolist() == alone(prompt, generation_config=config)
        own.no_repeat_ngram_size, own.min_length = 0, 4  # <= the padded width 5: holds nothing back
        ours = generate(maskless_model, ids, mask, max_new_tokens=8, pad_token_id=0, eos_token_id=2)
        for row, prompt in enumerate(prompts):
            assert ours.sequences[row, 5:].tolist() == alone(prompt, min_length=0, pad_token_id=0, eos_token_id=2)
    finally:
        own.no_repeat_ngram_size, own.min_length = saved


def test_an_attention_kernel_set_after_the_probe_is_judged_again():
    """The probe's verdict was kept per model whatever its attention became: probed under sdpa,
    then switched to a kernel that ignores custom masks (``set_attn_implementation``), packed rows
    saw each other's columns; switched to flex attention, its CPU kernel corrupted the heap."""
    model = tiny_model("qwen2", seed=3)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [9, 8]]
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1], [0, 0, 0, 0, 0, 9, 8]])
    config = LookaheadConfig(budget="fixed")
    generate(model, ids, (ids != 0).long(), max_new_tokens=4, config=config, pad_token_id=0)
    assert supports_tree_mask(model) is True
    model.set_attn_implementation("causal_only")
    with pytest.warns(UserWarning, match="ignores the tree mask"):
        result = generate(model, ids, (ids != 0).long(), max_new_tokens=10, config=config, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        assert result.sequences[row, 7:].tolist() == reference_generate(model, prompt, 10, None)
    model.set_attn_implementation("flex_attention")  # refused without a forward, as on a fresh model
    with pytest.warns(UserWarning, match="does not take a 4-D mask"):
        assert supports_tree_mask(model) is False


def test_a_composite_models_text_attention_is_judged_too():
    """``set_attn_implementation({"text_config": "flex_attention"})`` leaves the top config at
    "sdpa": judged by that alone, the probe ran flex attention's CPU kernel on a tree mask and the
    heap was corrupted. Refused without a forward, as a plain model running flex attention is."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config

    from rag_lookahead.decoding.verify import mask_blind_reason

    text = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28, patch_size=14
    )
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=63)
    config._attn_implementation = "sdpa"
    model = LlavaForConditionalGeneration(config).eval()
    assert mask_blind_reason(model) is None
    model.set_attn_implementation({"text_config": "flex_attention", "vision_config": "sdpa"})
    assert model.config._attn_implementation == "sdpa"
    assert "flex_attention" in mask_blind_reason(model)
    with pytest.warns(UserWarning, match="does not take a 4-D mask"):
        assert supports_tree_mask(model) is False
