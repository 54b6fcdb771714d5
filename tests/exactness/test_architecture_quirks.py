"""Architectures whose forward depends on more than the positions and the mask: each is decoded
exactly as ``model.generate`` decodes it (fp32, tiny random models), or kept off the path that
would change its tokens."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from tiny_models import build_tiny_model, padded, reference_generate

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.costs import _fit_window, cost_curve
from rag_lookahead.decoding.inputs import context_limit
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.verify import mask_blind_reason, supports_tree_mask
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.tiny import _COMMON

SMALL = {**_COMMON, "initializer_range": 0.3}  # the tiny models' sizes, with weights large enough to matter
SWITCH = 32  # where the tiny longrope model changes its rope factors


def _ready(model):
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None
    return model.float().eval()


def longrope_model():
    """Phi-3-128k style: short factors up to ``SWITCH`` tokens, long ones past it."""
    config = transformers.Phi3Config(
        **SMALL,
        original_max_position_embeddings=SWITCH,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [float(4**i) for i in range(8)],
        },
    )
    torch.manual_seed(0)
    return _ready(transformers.Phi3ForCausalLM(config))


def test_a_longrope_model_is_decoded_exactly_up_to_its_rope_switch():
    """transformers picks the short or long factors once per forward from its last position, and
    re-encodes everything on crossing: a verify step across the switch rotated its earlier
    positions with the long factors, and packed rows took the longest row's factors."""
    model = longrope_model()
    assert context_limit(model) == SWITCH
    prompts = [[10, 2, 5] * 7, [4, 8, 1] * 3, [6, 3] * 14]
    expected = [reference_generate(model, p, SWITCH - len(p), None) for p in prompts]
    references = [[p[-3:] + e + [7, 7, 7]] for p, e in zip(prompts, expected)]  # drafts run past the switch
    config = LookaheadConfig(budget="fixed", use_output_pool=False)
    for batch in ([0], [1], [2], [0, 1, 2]):
        sub_ids, sub_mask = padded([prompts[r] for r in batch])
        sub_width = sub_ids.shape[1]
        result = generate(
            model, sub_ids, sub_mask, max_new_tokens=40, config=config, references=[references[r] for r in batch]
        )
        for i, r in enumerate(batch):
            got = result.sequences[i, sub_width:].tolist()[: len(expected[r])]
            assert got == expected[r], (batch, r)
            assert int(result.sequences[i, sub_width + len(expected[r]) :].ne(0).sum()) == 0  # stops at the switch
    with pytest.raises(InputError, match="longrope"):
        generate(model, [5] * SWITCH, max_new_tokens=4)


def test_llama4_nope_layers_with_temperature_tuning_decode_rows_apart():
    """Llama-4's NoPE layers scale queries by the cache's length, not the positions: rows packed
    into one cache (lookahead on or off) got another scale than each row alone; the 8-position
    tree-mask probe does not see it at floor_scale 16."""
    config = transformers.Llama4TextConfig(
        **SMALL,
        head_dim=16,
        intermediate_size_mlp=128,
        num_local_experts=2,
        num_experts_per_tok=1,
        no_rope_layers=[0, 1],
        attn_temperature_tuning=True,
        floor_scale=16,
        attn_scale=0.5,
        layer_types=["full_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = _ready(transformers.Llama4ForCausalLM(config))
    assert mask_blind_reason(model) is not None
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 7, 8], [1, 2] * 6]
    expected = [reference_generate(model, p, 12, None) for p in prompts]
    ids, mask = padded(prompts)
    width = ids.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the chains-only warning
        for config in (LookaheadConfig(enabled=False), LookaheadConfig(budget="fixed", use_output_pool=False)):
            result = generate(model, ids, mask, max_new_tokens=12, config=config, references=[[p] for p in prompts])
            assert [result.sequences[r, width:].tolist() for r in range(3)] == expected


def gpt_neo_model(window: int, max_positions: int, layers: list) -> transformers.GPTNeoForCausalLM:
    config = transformers.GPTNeoConfig(
        vocab_size=96,
        hidden_size=64,
        num_layers=len(layers),
        num_heads=4,
        attention_types=[[layers, 1]],
        window_size=window,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = transformers.GPTNeoForCausalLM(config).float().eval()  # eager: GPT-Neo has no sdpa
    model.generation_config.eos_token_id = None
    return model


def test_gpt_neo_masking_by_cache_column_decodes_trees_and_batches_exactly():
    """GPT-Neo's attention slices a fixed causal (local layers: banded) table by the cache's
    length, not by the positions: a tree's and a packed row's columns run ahead of their
    positions, so a window of 32 hid keys a draft should see (tokens differed from the 29th; the
    8-position tree-mask probe passes any window over ~8), and a packed cache longer than the
    table broke the forward ("size of tensor a (64) must match ... (72)")."""
    windowed = gpt_neo_model(32, 256, ["global", "local"])
    config = LookaheadConfig(budget="fixed", use_output_pool=False)
    prompt = [3, 7, 1, 9, 4] * 8
    expected = reference_generate(windowed, prompt, 40, None)
    # the right continuation and wrong branches off it: wide trees, columns ahead of positions
    wrong = [prompt[-2:] + expected[:k] + [(expected[k] + j) % 95 + 1] * 3 for k in range(0, 30, 3) for j in (1, 2)]
    references = [[prompt[-2:] + expected, *wrong]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the chains-only warning
        result = generate(windowed, [prompt], max_new_tokens=40, config=config, references=references, pad_token_id=0)
        assert result.sequences[0, len(prompt) :].tolist() == expected, "trees under a window"
        short_table = gpt_neo_model(256, 64, ["global", "global"])
        prompts = [[5, 9, 14, 3, 22] * 5, [11, 4, 9, 4, 2] * 4, [3, 8, 1] * 8]  # 69 tokens together
        ids, mask = padded(prompts)
        result = generate(short_table, ids, mask, max_new_tokens=20, config=config, pad_token_id=0)
    expected = [reference_generate(short_table, p, 20, None) for p in prompts]
    assert [result.sequences[r, ids.shape[1] :].tolist() for r in range(3)] == expected
    assert mask_blind_reason(windowed) is not None


def test_a_causal_table_the_attention_never_reads_keeps_trees():
    """CLVP builds GPT-Neo's table and masks by the positions it is given: it keeps tree drafts."""
    config = transformers.ClvpDecoderConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        max_text_tokens=64,
        n_inner=128,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = transformers.ClvpForCausalLM(config).float().eval()
    assert any(getattr(m, "bias", None) is not None and m.bias.dtype == torch.bool for m in model.modules())
    assert mask_blind_reason(model) is None
    assert mask_blind_reason(gpt_neo_model(32, 64, ["global"])) is not None


def test_a_per_head_mask_doge_decodes_a_batch_row_by_row_exactly():
    """Doge hands sdpa a mask of its own per head; row-local attention sliced head 0's for every
    head, so each row of a batch went wrong from its second token (single rows were exact)."""
    config = transformers.DogeConfig(**{**SMALL, "hidden_size": 64}, keep_window_size=2048)
    torch.manual_seed(0)
    model = _ready(transformers.DogeForCausalLM(config))
    with torch.no_grad():  # trained heads differ (all-zero A, as initialised, gives every head one mask)
        for layer in model.model.layers:
            layer.self_attn.A.copy_(torch.randn(layer.self_attn.A.shape) * 2)
    prompts = [[5, 9, 3, 7, 2, 8] * 4, [4, 8, 1] * 5, [6, 3] * 9 + [2]]
    expected = [reference_generate(model, p, 16, None) for p in prompts]
    ids, mask = padded(prompts)
    result = generate(model, ids, mask, max_new_tokens=16, config=LookaheadConfig(budget="fixed"), pad_token_id=0)
    assert [result.sequences[r, ids.shape[1] :].tolist() for r in range(3)] == expected


def test_models_without_a_transformers_kv_cache_are_refused_before_any_forward():
    """OpenAI GPT's forward takes no cache (and a Mamba's cache has no length): they failed with an
    AttributeError in the packed cache, and hf_generate with a ValueError reading the cache given in."""
    from rag_lookahead import hf_generate

    gpt = _ready(transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(**SMALL, n_embd=64, n_head=4)))
    mamba = _ready(transformers.MambaForCausalLM(transformers.MambaConfig(**SMALL, state_size=4)))
    ids = torch.tensor([[5, 9, 3, 7, 2, 8] * 2])
    for model, said in ((gpt, "KV cache"), (mamba, "'linear_attention' layers")):
        with pytest.raises(NotImplementedError, match=said):
            generate(model, ids, max_new_tokens=4, pad_token_id=0)
        with pytest.raises(NotImplementedError, match=said):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, custom_generate=hf_generate)


def test_a_dory_keeping_its_last_loops_cache_is_refused():
    """Its forward of k new tokens differs from k forwards of one (logits ~5e-4 apart): it decoded
    other tokens than model.generate without a word, or crashed with a sliding layer."""
    config = transformers.DoryConfig(
        **{**SMALL, "hidden_size": 64, "num_hidden_layers": 4},
        n_input_layers=1,
        n_recurrent_layers=2,
        n_output_layers=1,
        n_recurrent_loops=2,
        layer_types=["full_attention"] * 4,
        recurrent_kv_cache_mode="last_loop",
    )
    model = _ready(transformers.DoryForCausalLM(config))
    with pytest.raises(NotImplementedError, match="per_loop"):
        generate(model, [6, 7, 4] * 3, max_new_tokens=4, pad_token_id=0)


def dory_model(**sections) -> transformers.DoryForCausalLM:
    """A per_loop Dory with DoryConfig's layer kinds (sliding but every 4th) and a window of 8."""
    config = transformers.DoryConfig(**{**SMALL, "hidden_size": 64, **sections}, sliding_window=8)
    torch.manual_seed(0)
    return _ready(transformers.DoryForCausalLM(config))


def test_a_dory_running_a_layer_twice_per_forward_is_refused_before_any_forward():
    """DoryConfig's 8 input and 8 output layers on a 2-layer model overlap: each layer ran twice per
    forward and wrote two cache columns per token, and a tree step failed in sdpa ("size of tensor a
    (32) must match ... (29)"; model.generate fails so on a padded batch). Sections that add up
    decode exactly, sliding layers past their window included."""
    overlapping = dory_model(num_hidden_layers=2)
    forwards = []
    overlapping.register_forward_pre_hook(lambda module, args: forwards.append(module))
    for config in (LookaheadConfig(enabled=False), LookaheadConfig(budget="fixed", use_output_pool=False)):
        with pytest.raises(NotImplementedError, match=r"layers \[0, 1\] twice.*add up to num_hidden_layers"):
            generate(overlapping, [10, 2, 5, 7] * 6, max_new_tokens=4, config=config, pad_token_id=0)
    assert forwards == []

    model = dory_model(num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1)
    prompts = [[10, 2, 5, 7] * 4, [4, 8, 1] * 3]
    expected = [reference_generate(model, p, 14, None) for p in prompts]
    wrong = [[p[-2:] + e[:k] + [(e[k] + 1) % 95 + 1] * 2 for k in (0, 4, 8)] for p, e in zip(prompts, expected)]
    references = [[p[-2:] + e, *w] for p, e, w in zip(prompts, expected, wrong)]
    ids, mask = padded(prompts)
    config = LookaheadConfig(budget="fixed", use_output_pool=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the chains-only warning
        result = generate(model, ids, mask, max_new_tokens=14, config=config, references=references, pad_token_id=0)
    assert [result.sequences[r, ids.shape[1] :].tolist() for r in range(2)] == expected
    torch.manual_seed(1)
    sampled = model.generate(ids, attention_mask=mask, do_sample=True, temperature=0.7, max_new_tokens=14)
    torch.manual_seed(1)
    ours = generate(model, ids, mask, max_new_tokens=14, do_sample=True, temperature=0.7, pad_token_id=0)
    assert torch.equal(ours.sequences, sampled)


def test_flex_attention_is_kept_from_tree_masks_without_a_forward():
    """flex attention's compiled CPU kernel read the probe's 4-D mask out of bounds and the heap
    corruption killed the process before the probe's ``try`` could catch anything."""
    model = longrope_model()
    model.config._attn_implementation = "flex_attention"
    assert "flex_attention" in mask_blind_reason(model)
    profile_of(model).reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert supports_tree_mask(model) is False


def test_the_cost_curve_fits_a_short_learned_position_table(tmp_path, monkeypatch):
    """The auto budget timed forwards at positions 256..383 whatever the window: GPT-2-style
    models with fewer positions died with IndexError (a device-side assert on CUDA)."""
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=200, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.generation_config.eos_token_id = None
    curve = cost_curve(model)
    assert curve.sizes[-1] <= 100 and len(curve.sizes) >= 2
    prompt = [5, 9, 3, 7, 2, 8] * 4
    expected = reference_generate(model, prompt, 30, None)
    assert generate(model, prompt, max_new_tokens=30).sequences[0, len(prompt) :].tolist() == expected
    assert _fit_window(256, (1, 4, 8, 16, 32, 64, 128), None) == (256, [1, 4, 8, 16, 32, 64, 128])
    assert _fit_window(256, (1, 4, 8, 16, 32, 64, 128), 4096) == (256, [1, 4, 8, 16, 32, 64, 128])
    assert _fit_window(256, (1, 4, 8, 16, 32, 64, 128), 200) == (136, [1, 4, 8, 16, 32, 64])
    assert _fit_window(256, (1, 4, 8), 3) == (1, [1, 2])


def test_a_window_under_another_name_is_the_context_limit():
    """MPT names its window ``max_seq_len`` (ChatGLM ``seq_length``): read only as
    ``max_position_embeddings``, it was no limit, and the cost curve's timing forwards ran past
    MPT's ALiBi table (a raw size error on a 5-token prompt, where ``model.generate`` works)."""
    config = transformers.MptConfig(
        vocab_size=96, d_model=64, n_heads=4, n_layers=2, max_seq_len=64, pad_token_id=0, eos_token_id=None
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MptForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    assert context_limit(model) == 64
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    result = generate(model, prompt, max_new_tokens=80)  # runs to the window's end, as generate may
    assert result.sequences[0, len(prompt) :].tolist() == reference_generate(model, prompt, 64 - len(prompt), None)


def test_a_multimodal_gemma3_decodes_text_exactly_with_the_default_budget():
    """``AutoModelForCausalLM`` gives gemma-3-4b-it style checkpoints as
    ``Gemma3ForConditionalGeneration``, whose top config holds no ``vocab_size``: the cost curve
    raised AttributeError, the mask probe failed to chains, and ``hf_generate`` refused the
    ``mm_encoder_outputs={}`` that transformers passes with every text-only call."""
    from rag_lookahead import hf_generate

    text = dict(_COMMON, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=95,
        boi_token_index=93,
        eoi_token_index=94,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    model.generation_config.eos_token_id = None
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    expected = reference_generate(model, prompt, 20, None)
    assert generate(model, prompt, max_new_tokens=20).sequences[0, len(prompt) :].tolist() == expected
    assert supports_tree_mask(model) and profile_of(model).cost_curve is not None
    ids = torch.tensor([prompt])
    got = model.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=hf_generate)
    assert got[0, len(prompt) :].tolist() == expected


_TINY_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


def _text_only(model):
    model = model.float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _greedy(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, **kwargs)


def test_paligemma_counting_positions_from_one_decodes_text_exactly():
    """PaliGemma numbers positions from 1 when given none; our one-row chain steps gave none while
    the prefill counted from 0, so its tokens differed from ``model.generate`` from the 3rd on."""
    from rag_lookahead import hf_generate
    from rag_lookahead.decoding.positions import position_origin

    text = dict(SMALL, model_type="gemma", head_dim=16)
    config = transformers.PaliGemmaConfig(
        text_config=text,
        vision_config=dict(model_type="siglip_vision_model", **_TINY_VISION),
        image_token_index=95,
        projection_dim=64,
        hidden_size=64,
    )
    torch.manual_seed(0)
    model = _text_only(transformers.PaliGemmaForConditionalGeneration(config))
    for prompts in ([[10, 2, 5] * 7], [[10, 2, 5] * 7, [4, 8, 1] * 3, [6, 3] * 9]):
        ids, mask = padded(prompts)
        expected = _greedy(model, ids, mask)
        assert torch.equal(generate(model, ids, mask, max_new_tokens=24).sequences, expected)
        references = [[p[-2:] + expected[r, ids.shape[1] :].tolist()] for r, p in enumerate(prompts)]
        drafted = generate(model, ids, mask, max_new_tokens=24, references=references)  # whole chains accepted
        assert torch.equal(drafted.sequences, expected)
    assert position_origin(model, torch.device("cpu")) == 1
    ids, mask = padded([[10, 2, 5] * 7])
    assert torch.equal(_greedy(model, ids, mask, custom_generate=hf_generate), _greedy(model, ids, mask))
    torch.manual_seed(1)
    sampled = model.generate(ids, attention_mask=mask, do_sample=True, temperature=0.7, max_new_tokens=24)
    torch.manual_seed(1)
    ours = generate(model, ids, mask, max_new_tokens=24, do_sample=True, temperature=0.7).sequences
    assert torch.equal(ours, sampled)


def test_qwen2_vl_text_decodes_exactly_after_a_batched_generate_and_through_hf_generate():
    """Qwen2-VL keeps ``rope_deltas`` from its last call; a step given no positions read them: after
    a batch of 3 in ``model.generate`` our next call failed inside the cache. And transformers hands
    ``hf_generate`` (sections, batch, length) M-RoPE positions, which it refused as custom."""
    from rag_lookahead import hf_generate

    text = dict(SMALL, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(
        depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
    )  # fmt: skip
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=95,
        video_token_id=94,
        vision_start_token_id=93,
        vision_end_token_id=92,
    )
    torch.manual_seed(0)
    model = _text_only(transformers.Qwen2VLForConditionalGeneration(config))
    batch = padded([[10, 2, 5] * 7, [4, 8, 1] * 3, [6, 3] * 9])
    single = padded([[10, 2, 5] * 7])
    expected_batch = _greedy(model, *batch)  # leaves rope_deltas of shape (3, 1) on the model
    expected_single = _greedy(model, *single)
    _greedy(model, *batch)
    assert torch.equal(generate(model, *single, max_new_tokens=24).sequences, expected_single)
    assert torch.equal(generate(model, *batch, max_new_tokens=24).sequences, expected_batch)
    for ids, mask in (single, batch):
        assert torch.equal(_greedy(model, ids, mask, custom_generate=hf_generate), _greedy(model, ids, mask))


@pytest.mark.parametrize("kind", ["t5", "mllama"])
def test_encoder_decoders_and_cross_attention_are_refused_before_any_forward(kind):
    if kind == "t5":
        config = transformers.T5Config(
            vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, pad_token_id=0,
            eos_token_id=1, decoder_start_token_id=0,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
    else:
        text = dict(SMALL, cross_attention_layers=[1], bos_token_id=1, eos_token_id=2)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        vision = dict(
            _TINY_VISION, num_global_layers=1, vision_output_dim=64, intermediate_layers_indices=[0], max_num_tiles=4
        )
        config = transformers.MllamaConfig(text_config=text, vision_config=vision, image_token_index=95)
        model = transformers.MllamaForConditionalGeneration(config)
    model = _text_only(model)
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(NotImplementedError, match="encoder-decoder|cross-attention"):
        generate(model, [10, 2, 5] * 5, max_new_tokens=8)
    assert forwards == []


@pytest.mark.parametrize("seed", range(4))
def test_a_decoder_counting_from_its_padding_index_is_fed_positions_from_zero(seed):
    """``RobertaForCausalLM`` counts from ``padding_idx + 1`` when given no positions; ``model.generate``
    feeds it 0, 1, 2... The origin probe took the nearer of 0 and 1, and picked 1 for some weights."""
    from rag_lookahead.decoding.positions import position_origin

    config = transformers.RobertaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=300, is_decoder=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = _ready(transformers.RobertaForCausalLM(config))
    ids, mask = padded([[10, 12, 5, 7, 30, 4, 8] * 3, [9, 3, 11] * 4])
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=1)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=24, pad_token_id=1).sequences, expected)
    assert position_origin(model, torch.device("cpu")) == 0


_BERT_SIZES = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.3,
)  # fmt: skip


@pytest.mark.parametrize("family", ["Roberta", "XLMRobertaXL"])
def test_a_roberta_decoder_padded_by_token_0_is_fed_positions_from_zero(family):
    """With ``padding_idx`` 0 a Roberta-style decoder numbers its own positions from 1, and the
    origin probe took that numbering; ``model.generate`` feeds it 0, 1, 2..., so the tokens
    differed from the first (Roberta, CamemBERT, XLM-R, XLM-R-XL, Data2Vec-text, Roberta-PreLN)."""
    from rag_lookahead.decoding.positions import position_origin

    config = getattr(transformers, f"{family}Config")(**_BERT_SIZES, is_decoder=True)
    torch.manual_seed(0)
    model = _ready(getattr(transformers, f"{family}ForCausalLM")(config))
    ids, mask = padded([[10, 2, 5, 7] * 6, [9, 3, 11] * 4])
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    references = [[[5, 7, *expected[0, ids.shape[1] :].tolist()]], []]
    config = LookaheadConfig(budget="fixed", use_output_pool=False)
    result = generate(model, ids, mask, max_new_tokens=12, config=config, references=references, pad_token_id=0)
    assert torch.equal(result.sequences, expected)
    assert position_origin(model, torch.device("cpu")) == 0


def _stateful_or_whole_sequence_model(kind: str):
    torch.manual_seed(0)
    if kind == "xlstm":  # declares full-attention layers, keeps a recurrent state in its own cache
        config = transformers.xLSTMConfig(
            vocab_size=96, hidden_size=64, embedding_dim=64, num_heads=4, num_blocks=2, num_hidden_layers=2,
            qk_dim_factor=1.0, v_dim_factor=1.0, pad_token_id=0, eos_token_id=None, bos_token_id=None,
        )  # fmt: skip
        return transformers.xLSTMForCausalLM(config)
    if kind == "cpmant":  # its forward takes the whole sequence and slices off the cached part
        config = transformers.CpmAntConfig(
            vocab_size=96, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128, num_hidden_layers=2,
            pad_token_id=0, eos_token_id=None, bos_token_id=None,
        )  # fmt: skip
        return transformers.CpmAntForCausalLM(config)
    config = transformers.XLMConfig(  # generate appends a mask token to the whole sequence every step
        vocab_size=96, emb_dim=64, n_layers=2, n_heads=4, max_position_embeddings=256, causal=kind == "xlm-causal",
        pad_index=0, pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    return transformers.XLMWithLMHeadModel(config)


@pytest.mark.parametrize(
    "kind, said",
    [
        ("xlstm", "recurrent state or a cache of its own"),
        ("cpmant", "the whole sequence on every step"),
        ("xlm", "the whole sequence on every step"),
        ("xlm-causal", "the whole sequence on every step"),
    ],
)
def test_models_fed_other_than_new_tokens_over_a_dynamic_cache_are_refused_before_any_forward(kind, said):
    """xLSTM failed with a raw AttributeError ('DynamicCache' object has no attribute 'rnn_state'),
    CPM-Ant and XLM with raw IndexError or RuntimeError deep inside the decoding."""
    from rag_lookahead import hf_generate

    model = _text_only(_stateful_or_whole_sequence_model(kind))
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    ids = torch.tensor([[10, 2, 5, 7] * 3])
    for config in (LookaheadConfig(enabled=False), LookaheadConfig(budget="fixed")):
        with pytest.raises(NotImplementedError, match=said):
            generate(model, ids, max_new_tokens=4, config=config, pad_token_id=0)
    with pytest.raises(NotImplementedError, match=said):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, custom_generate=hf_generate)
    assert forwards == []


@pytest.mark.parametrize("extra", [0, 1])
def test_a_decode_step_fed_even_one_token_past_the_new_one_is_refused(extra):
    """The probe reads how many tokens ``generate``'s decode step feeds: the new one and one more
    (a token of its own after it, as XLM appends) is already not what our forwards feed."""
    from rag_lookahead.decoding.generate_inputs import feeds_whole_sequence

    model = build_tiny_model("qwen2", seed=5)
    prepare = model.prepare_inputs_for_generation

    def fed(input_ids, *args, **kwargs):
        prepared = prepare(input_ids, *args, **kwargs)
        ids = prepared["input_ids"]
        prepared["input_ids"] = torch.cat([ids, ids[:, -1:].repeat(1, extra)], 1)
        return prepared

    model.prepare_inputs_for_generation = fed
    assert feeds_whole_sequence(model, torch.device("cpu")) is bool(extra)
    prompt, config = [10, 2, 5, 7] * 3, LookaheadConfig(budget="fixed")
    if extra:
        with pytest.raises(NotImplementedError, match="the whole sequence on every step"):
            generate(model, prompt, max_new_tokens=4, config=config)
    else:
        result = generate(model, prompt, max_new_tokens=4, config=config)
        assert result.sequences[0, len(prompt) :].tolist() == reference_generate(model, prompt, 4, None)


def _bidirectional_decoder(kind: str):
    torch.manual_seed(0)
    if kind == "rembert":
        config = transformers.RemBertConfig(**_BERT_SIZES, input_embedding_size=64, output_embedding_size=64)
        return transformers.RemBertForCausalLM(config)
    if kind == "bert-generation":
        return transformers.BertGenerationDecoder(transformers.BertGenerationConfig(**_BERT_SIZES))
    return transformers.RoFormerForCausalLM(transformers.RoFormerConfig(**_BERT_SIZES, embedding_size=64))


@pytest.mark.parametrize("kind", ["rembert", "bert-generation", "roformer"])
def test_a_bert_style_causal_lm_left_bidirectional_is_refused(kind):
    """A BERT-style ``...ForCausalLM`` whose config keeps ``is_decoder=False`` attends both ways and
    ``model.generate`` runs the whole sequence again each step: we decoded other tokens without a
    word (RemBert differed from the 13th of 20)."""
    model = _text_only(_bidirectional_decoder(kind))
    assert model.config.is_decoder is False
    with pytest.raises(ConfigError, match="is_decoder=True"):
        generate(model, [10, 2, 5, 7] * 3, max_new_tokens=4, pad_token_id=0)


def test_a_causal_model_whose_config_says_is_decoder_false_still_decodes():
    """GPT-NeoX (Pythia) configs say ``is_decoder=False`` and its attention is causal all the same."""
    config = transformers.GPTNeoXConfig(**_BERT_SIZES)
    torch.manual_seed(0)
    model = _ready(transformers.GPTNeoXForCausalLM(config))
    assert model.config.is_decoder is False
    prompt = [10, 2, 5, 7] * 3
    expected = reference_generate(model, prompt, 8, None)
    assert generate(model, prompt, max_new_tokens=8, pad_token_id=0).sequences[0, len(prompt) :].tolist() == expected


def test_a_model_numbering_its_own_positions_drafts_chains_and_decodes_to_the_context_end():
    """RoFormer's forward takes no ``position_ids`` and numbers a step's tokens from the cache's
    length: a tree's nodes got positions past their depths, and near the context end past its
    40-row sinusoid table (IndexError). With small weights the tree-mask probe could not see the
    wrong positions (a relative logit error under its tolerance), so trees were drafted."""
    config = transformers.RoFormerConfig(
        **{**_BERT_SIZES, "max_position_embeddings": 40, "initializer_range": 0.02}, embedding_size=64, is_decoder=True
    )
    torch.manual_seed(0)
    model = transformers.RoFormerForCausalLM(config).eval()  # its own attention: the probe passed it
    model.generation_config.eos_token_id = None
    assert mask_blind_reason(model) is not None and not supports_tree_mask(model)
    prompt = [5, 6, 7, 8, 9] * 3
    expected = reference_generate(model, prompt, 25, None)
    right = prompt[-3:] + expected
    partly = [t if j % 6 else t % 95 + 1 for j, t in enumerate(right)]  # drafts accepted in part
    config = LookaheadConfig(budget="fixed", use_output_pool=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the chains-only warning
        for references in ([[right]], [[partly]], None):
            result = generate(model, prompt, max_new_tokens=25, config=config, references=references, pad_token_id=0)
            assert result.sequences[0, len(prompt) :].tolist() == expected
        prompts = [prompt, [11, 4, 9, 4] * 3, [3, 8, 1] * 2]
        ids, mask = padded(prompts)
        result = generate(model, ids, mask, max_new_tokens=40 - ids.shape[1], config=config, pad_token_id=0)
    reference = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=40 - ids.shape[1], pad_token_id=0
    )
    assert result.sequences.tolist() == reference.tolist()


def test_a_forward_passing_position_ids_on_to_its_decoder_keeps_trees():
    """Evolla's forward names no ``position_ids`` but hands its ``**kwargs`` to a decoder that reads
    them: it is not one of the models that number positions themselves (it lost its trees)."""
    from rag_lookahead.decoding.forward_signature import ignores_position_ids

    config = transformers.EvollaConfig(
        protein_encoder_config=dict(
            vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        ),
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, aligner_num_add_layers=1, resampler_depth=1, resampler_dim_head=8, resampler_heads=2,
        resampler_num_latents=4,
    )  # fmt: skip
    torch.manual_seed(0)
    evolla = transformers.EvollaForProteinText2Text(config).eval()
    assert not ignores_position_ids(evolla)
    bart = transformers.BartConfig(
        vocab_size=96, d_model=64, decoder_layers=2, decoder_attention_heads=4, encoder_layers=1,
        encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64,
    )  # fmt: skip
    assert ignores_position_ids(transformers.BartForCausalLM(bart))
