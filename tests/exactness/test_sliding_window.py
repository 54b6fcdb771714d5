"""Sliding-window attention: decoded exactly as ``model.generate`` decodes it (fp32, tiny random
models), past the window, with the window's mask built per layer kind; other cache layers refused
before any forward. (The tiny ``mistral`` and ``gemma3`` of ``rag_lookahead.tiny`` also run every
parametrized exactness test.)"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import padded, reference_generate, tiny_model

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.verify import step_inputs, step_mask, supports_tree_mask
from rag_lookahead.decoding.windows import SLIDING, full_cache, sliding_window
from rag_lookahead.tiny import _COMMON

SMALL = {**_COMMON, "initializer_range": 0.3}

#: configs beyond the tiny set: a sliding model with attention sinks and experts, Qwen2 with its
#: windowed upper layers, Phi-3 and Cohere 2 with windows
EXTRA = {
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
        "eager",
    ),
    "qwen2_windowed": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        "sdpa",
    ),
    "phi3_windowed": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8}, "sdpa"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"sliding_window": 8}, "sdpa"),
    "mistral_eager": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}, "eager"),
}

PROMPTS = [
    [3, 4, 5, 6, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 9, 10, 3, 4, 5, 6, 3, 4, 5],
    [7, 8, 9, 7, 8, 9, 2] * 3,
    [1, 2] * 12,
]


def _build(name: str):
    config_name, model_name, extra, attn = EXTRA[name]
    config = getattr(transformers, config_name)(**SMALL, **extra)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sorted(EXTRA))
def test_windowed_models_decode_exactly_past_the_window(name):
    model = _build(name)
    assert sliding_window(model) is not None
    expected = [reference_generate(model, p, 40, None) for p in PROMPTS]
    references = [[p + e] for p, e in zip(PROMPTS, expected)]  # drafts that run far past the window
    for config in (LookaheadConfig(enabled=False), LookaheadConfig(budget="fixed", use_output_pool=False)):
        for batch in ([0], [1, 2], [0, 1, 2]):
            ids, mask = padded([PROMPTS[r] for r in batch])
            width = ids.shape[1]
            result = generate(
                model, ids, mask, max_new_tokens=40, config=config, references=[references[r] for r in batch]
            )
            for i, r in enumerate(batch):
                assert result.sequences[i, width:].tolist() == expected[r], (config.enabled, batch, r)


@pytest.mark.parametrize(("name", "window"), [("LlamaForCausalLM", 16), ("GemmaForCausalLM", 20)])
def test_a_window_the_attention_ignores_is_where_decoding_stops(name, window):
    """A ``sliding_window`` left in a config whose attention never reads it: transformers'
    cache still drops keys past it, so ``generate``'s tokens past the window follow the cache,
    and ours (on or off) differed from them and from each other. Decoding stops at the window,
    where all agree; a prompt that fills it is refused, saying why."""
    from rag_lookahead.decoding.inputs import context_limit
    from rag_lookahead.decoding.windows import ignored_window
    from rag_lookahead.errors import InputError

    config = getattr(transformers, name.replace("ForCausalLM", "Config"))(**SMALL, sliding_window=window)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).float().eval()
    model.generation_config.eos_token_id = None
    assert ignored_window(model) == window == context_limit(model)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6]
    room = window - len(prompt)
    expected = reference_generate(model, prompt, room, None)
    for config in (LookaheadConfig(enabled=False), LookaheadConfig(budget="fixed")):
        result = generate(model, prompt, max_new_tokens=40, config=config, references=[[prompt + expected]])
        assert result.sequences[0, len(prompt) :].tolist() == expected
    with pytest.raises(InputError, match="sliding_window, which .* ignores"):
        generate(model, list(range(1, window + 1)), max_new_tokens=4)
    assert ignored_window(tiny_model("mistral")) is None and ignored_window(_build("qwen2_windowed")) is None
    # a composite model whose Mistral text decoder lives in another file than the model (Mistral 3,
    # Pixtral-style): its window is honoured, not taken for a stray one
    text = dict(SMALL, sliding_window=8, model_type="mistral")
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    composite = transformers.Mistral3ForConditionalGeneration(
        transformers.Mistral3Config(text_config=text, vision_config={**vision, "head_dim": 16})
    )
    assert ignored_window(composite) is None


def test_a_composite_class_is_judged_by_the_decoder_it_holds():
    """One composite class (Llava) holds a Llama or a Mistral decoder as its config says: the
    verdict was cached per class, so the first model seen decided for the next. The limit's
    message names the text config, where the window of such a model is set."""
    from rag_lookahead.decoding.inputs import context_limit, limit_words
    from rag_lookahead.decoding.windows import ignored_window

    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )

    def llava(text):
        config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=95)
        return transformers.LlavaForConditionalGeneration(config)

    stray = transformers.LlamaConfig(**SMALL)
    stray.sliding_window = 16
    for _ in range(2):  # either order
        mistral, llama = llava(transformers.MistralConfig(**SMALL, sliding_window=16)), llava(stray)
        assert ignored_window(mistral) is None and ignored_window(llama) == 16 == context_limit(llama)
    assert "model.config.text_config.sliding_window = None" in limit_words(llama, 16)


class _Adapter(torch.nn.Module):
    """A layer added around a linear from outside transformers, as a LoRA adapter (peft) or a
    quantized linear (bitsandbytes) is: it says nothing of how the attention treats a window."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x)


def test_an_adapter_layer_does_not_make_a_stray_window_honoured():
    """Any module from outside transformers made the whole model trusted to slide, so a Llama with
    a stray window and an adapter decoded past the window, where ``generate`` follows its cache."""
    from rag_lookahead.decoding.inputs import context_limit
    from rag_lookahead.decoding.windows import ignored_window

    config = transformers.LlamaConfig(**SMALL, sliding_window=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    attention = model.model.layers[0].self_attn
    attention.q_proj = _Adapter(attention.q_proj)
    assert ignored_window(model) == 16 == context_limit(model)


def test_the_window_changes_the_tokens_so_the_tests_can_see_it():
    """Without it the model decodes other tokens: the exactness tests above would notice a lost window."""
    windowed = tiny_model("mistral")
    config = transformers.MistralConfig(**{**windowed.config.to_dict(), "sliding_window": None})
    unwindowed = transformers.MistralForCausalLM(config).float().eval()
    unwindowed.load_state_dict(windowed.state_dict())
    unwindowed.generation_config.eos_token_id = None
    assert reference_generate(windowed, PROMPTS[0], 40, None) != reference_generate(unwindowed, PROMPTS[0], 40, None)


def test_step_mask_hides_keys_outside_the_window_per_layer_kind():
    """Two rows packed in one cache; the step's last position is past the window of 8."""
    model = tiny_model("gemma3")
    window = sliding_window(model)
    assert (window.size, window.by_layer_type) == (8, True)
    owned = torch.zeros((2, 15), dtype=torch.bool)
    owned[0, [0, 2, 4, 6, 8, 10, 12, 13, 14]] = True  # row 0: positions 0..8, interleaved with row 1
    owned[1, [1, 3, 5, 7, 9, 11]] = True  # row 1: positions 0..5
    draft = DraftTree(tokens=[5, 6, 7], parents=[-1, 0, -1], depths=[1, 2, 1], probs=[1.0] * 3)
    step = step_inputs([1, 2], [draft, DraftTree.chain([])], [9, 6], torch.device("cpu"))
    masks = step_mask(model, owned, step)
    full, slid = masks["full_attention"][0, 0], masks[SLIDING][0, 0]
    assert full.dtype == torch.bool and slid.dtype == torch.bool
    # row 0's root at position 9 sees positions 2..9 under the window, 0..9 without it
    assert full[0, :15].nonzero().flatten().tolist() == [0, 2, 4, 6, 8, 10, 12, 13, 14]
    assert slid[0, :15].nonzero().flatten().tolist() == [4, 6, 8, 10, 12, 13, 14]
    # its node at depth 2 (position 11) sees positions 4..11: the cache from position 4 on, then its path
    assert slid[2, :15].nonzero().flatten().tolist() == [8, 10, 12, 13, 14]
    assert slid[2, 15:].nonzero().flatten().tolist() == [0, 1, 2]
    # row 1 (position 6) is inside its window: both masks agree, and it never sees row 0
    assert torch.equal(full[4], slid[4])
    assert full[4, :15].nonzero().flatten().tolist() == [1, 3, 5, 7, 9, 11]


def test_a_step_inside_the_window_takes_one_mask():
    model = tiny_model("gemma3")
    owned = torch.ones((1, 3), dtype=torch.bool)
    step = step_inputs([1], [DraftTree.chain([2, 3])], [3], torch.device("cpu"))
    assert isinstance(step_mask(model, owned, step), torch.Tensor)


def test_a_query_at_exactly_the_window_already_slides():
    """A query at position ``size`` sees positions 1..size: key 0 is the first to leave its window.
    A step whose furthest query sat there took no window mask, and its rows read key 0 too."""
    model = tiny_model("gemma3")
    window = sliding_window(model)
    assert window.size == 8 and window.reaches(8) and not window.reaches(7)
    owned = torch.ones((1, 8), dtype=torch.bool)
    step = step_inputs([1], [DraftTree.chain([])], [8], torch.device("cpu"))  # the root at position 8
    masks = step_mask(model, owned, step)
    assert masks[SLIDING][0, 0, 0].tolist() == [False] + [True] * 8
    assert masks["full_attention"][0, 0, 0].tolist() == [True] * 9


#: two-row batches whose first verify step's furthest query sits at exactly the window (the first
#: row's prompt fills it): decoded with key 0 in view, each pair's first row changes its tokens
AT_THE_WINDOW = {
    "mistral": [  # window 16
        [
            [46, 52, 39, 58, 10, 20, 7, 47, 5, 58, 55, 44, 22, 31, 36, 7],
            [23, 28, 21, 40, 41, 59, 14, 36, 31, 29, 56, 34, 17, 4],
        ],
        [
            [6, 58, 45, 60, 54, 35, 44, 26, 54, 46, 34, 18, 34, 52, 16, 55],
            [14, 58, 44, 38, 53, 27, 38, 18, 29, 32, 43, 42, 45, 59],
        ],
    ],
    "gemma3": [  # window 8
        [[59, 35, 46, 52, 39, 58, 10, 20], [7, 47, 5, 58, 55]],
        [[44, 22, 31, 36, 7, 23, 28, 21], [40, 41, 59, 14]],
    ],
}


@pytest.mark.parametrize("arch", sorted(AT_THE_WINDOW))
def test_batches_reaching_exactly_the_window_decode_exactly(arch):
    """One row alone runs the model's own causal mask; rows side by side take ours, so a step of
    two rows whose furthest query sits at the window is where ours must slide already."""
    model = tiny_model(arch)
    assert sliding_window(model).size == len(AT_THE_WINDOW[arch][0][0])
    config = LookaheadConfig(budget="fixed", use_output_pool=False)
    for prompts in AT_THE_WINDOW[arch]:
        ids, mask = padded(prompts)
        result = generate(model, ids, mask, max_new_tokens=3, config=config)
        for i, prompt in enumerate(prompts):
            assert result.sequences[i, ids.shape[1] :].tolist() == reference_generate(model, prompt, 3, None), i


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_the_probe_passes_and_the_cache_keeps_every_column(arch):
    model = tiny_model(arch)
    assert supports_tree_mask(model)
    cache = full_cache(model)
    assert {type(layer).__name__ for layer in cache.layers} == {"DynamicLayer"}


def test_chunked_attention_is_refused_before_any_forward():
    """Llama 4's chunked layers would need a chunk mask, not a window: a clear error, not a crash in crop."""
    config = transformers.Llama4TextConfig(
        **SMALL,
        head_dim=16,
        intermediate_size_mlp=128,
        num_local_experts=2,
        num_experts_per_tok=1,
        attention_chunk_size=8,
        layer_types=["chunked_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).float().eval()
    model.config._attn_implementation = "sdpa"
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(NotImplementedError, match="Llama4ForCausalLM has .chunked_attention. layers"):
        generate(model, PROMPTS[0], max_new_tokens=4, config=LookaheadConfig(budget="fixed"))
    assert calls == []
