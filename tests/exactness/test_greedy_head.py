"""The int8-screened output layer (``greedy_head``): the same greedy tokens as the full layer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, DECODE_CASES, build_tiny_model, reference_generate

import rag_lookahead
from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.decoding.costs import CostCurve
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.sampling import longest_paths
from rag_lookahead.greedy_head import (
    MOST_POSITIONS,
    _build,
    capture_hidden,
    full_output_layer,
    greedy_head_of,
    restore_greedy_head,
    screen_greedy_head,
    unsupported_reason,
)


class _Head(torch.nn.Module):
    """The smallest transformers-like model: an output layer and the accessor the screen reads."""

    __module__ = "transformers.tests_stand_in"  # the screen accepts transformers' classes only

    def __init__(self, weight: torch.Tensor, bias: bool = False) -> None:
        super().__init__()
        self.config = type("Config", (), {})()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
        self.lm_head.weight.data = weight

    def get_output_embeddings(self):
        return self.lm_head


def _screened(weight: torch.Tensor):
    model = _Head(weight)
    assert screen_greedy_head(model)
    return greedy_head_of(model)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vocab=st.integers(min_value=2, max_value=3000),
    width=st.integers(min_value=2, max_value=96),
    rows=st.integers(min_value=1, max_value=12),
    outliers=st.integers(min_value=0, max_value=3),
    spread=st.floats(min_value=0.0, max_value=3.0),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_screened_argmax_equals_the_full_argmax(vocab, width, rows, outliers, spread, seed):
    """``spread``: rows' scales differ by up to e^±spread, so rows' own error bounds differ (``narrow``)."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.exp(spread * (2 * torch.rand(vocab, 1, generator=generator) - 1))
    weight = torch.randn(vocab, width, generator=generator) * 0.05 * scales
    hidden = torch.randn(rows, width, generator=generator) * 3
    hidden[:, :outliers] *= 40  # a few huge dimensions, as real hidden states have
    head = _screened(weight)
    assert list(head.argmax(hidden)) == (hidden @ weight.T).argmax(-1).tolist()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vocab=st.integers(min_value=1, max_value=40000),
    width=st.integers(min_value=1, max_value=24),
    magnitude=st.sampled_from([1e-30, 1e-6, 1.0, 1e6]),
    zero_rows=st.integers(min_value=0, max_value=3),
    seed=st.integers(min_value=0, max_value=2**16),
)
@example(vocab=15050, width=20, magnitude=1e6, zero_rows=0, seed=22)  # the measurement's own rounding (below)
def test_the_build_bounds_each_rows_error_and_size_on_the_digits_it_packed(vocab, width, magnitude, zero_rows, seed):
    """What the screen's proof rests on, checked in float64 on the packed digits themselves (over
    16,384 rows: more than one block), for rows of any size, all-zero rows too."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=generator) * magnitude
    weight[:zero_rows] = 0
    built = _build(weight)
    assert built is not None
    packed, row_errors, row_l1s = built
    quantized = torch.ops.quantized.linear_unpack(packed)[0]
    digits, scales = quantized.int_repr().double(), quantized.q_per_channel_scales().double()
    assert digits.abs().max() <= 127
    exact = weight.double()
    assert bool((row_errors >= (exact - digits * scales.float().double()[:, None]).abs().amax(1)).all())
    # and tight: half a step, the 2^-22 |W|max the build adds for the fp32 difference, and the fp32
    # rounding of digits x scale it measured on (half an ulp of up to |W|max: <= 2^-24 of it; at
    # |W| ~ 1.7e6 that is 0.06, which the 1e-5 of a 6604 half step did not cover: hypothesis found it)
    largest = exact.abs().amax(1)
    assert bool((row_errors <= scales * 0.5 * (1 + 1e-5) + (2.0**-22 + 2.0**-23) * largest).all())
    sizes = exact.abs().sum(1)
    assert bool((row_l1s >= sizes).all()) and bool((row_l1s <= sizes * (1 + 1e-3)).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(min_value=1, max_value=MOST_POSITIONS + 20), data=st.data())
def test_positions_read_in_any_groups_and_order_equal_the_full_argmax(rows, data):
    """A walk screens some positions together (one level), reads others alone, in any order;
    groups above ``MOST_POSITIONS`` take the full layer's argmax."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(500, 32, generator=generator) * 0.05
    hidden = torch.randn(rows, 32, generator=generator) * 3
    tokens = _screened(weight).argmax(hidden)
    full = (hidden @ weight.T).argmax(-1).tolist()
    order = data.draw(st.permutations(range(rows)))
    cut = data.draw(st.integers(min_value=0, max_value=rows))
    tokens.prefetch(order[:cut])
    assert [tokens[i] for i in order] == [full[i] for i in order]


def test_a_walk_screens_a_level_with_its_guesses_and_rows_together_at_once():
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(400, 24, generator=generator) * 0.05
    hidden = torch.randn(8, 24, generator=generator)
    head = _screened(weight)
    full = (hidden @ weight.T).argmax(-1).tolist()
    # row 0 (positions 0-4): the root's likelier child is wrong (with a child of its own), the other
    # one is the greedy token and has a child; row 1 (positions 5-6): one wrong child
    first = DraftTree(
        tokens=[(full[0] + 1) % 400, full[0], full[2], 7],
        parents=[-1, -1, 1, 0],
        depths=[1, 1, 2, 2],
        probs=[0.9, 0.5, 0.4, 0.3],
    )
    second = DraftTree(tokens=[(full[5] + 1) % 400], parents=[-1], depths=[1], probs=[1.0])
    screened = []
    real_screen = head.screen

    def screen(x):
        screened.append(sorted(int((hidden - row).abs().sum(1).argmin()) for row in x))
        return real_screen(x)

    head.screen = screen
    alone = longest_paths([first], head.argmax(hidden[:5]), [0])
    assert alone == longest_paths([first], full[:5], [0]) and alone[0].nodes == [1, 2]
    # the root with its likeliest line (wrong); then level 1 with its guess, which covers level 2
    assert screened == [[0, 1, 4], [2, 3]]
    screened.clear()
    both = longest_paths([first, second], head.argmax(hidden), [0, 5])
    assert both == longest_paths([first, second], full, [0, 5]) and both[1].nodes == []
    assert screened == [list(range(8))]  # several rows: one product


def test_a_walk_down_a_long_accepted_chain_screens_it_in_blocks():
    """A 20-node chain the model accepts whole: the walk screens the root's position with the next
    7 down the line, and again only where it reaches a position not screened yet, so 21 positions
    take 3 products (refilling the line at every level took 14: 8 positions, then one a level)."""
    from rag_lookahead.greedy_head import SCREEN_WIDTH

    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(300, 24, generator=generator) * 0.05
    hidden = torch.randn(21, 24, generator=generator)
    head = _screened(weight)
    full = (hidden @ weight.T).argmax(-1).tolist()
    chain = DraftTree(tokens=full[:20], parents=[-1, *range(19)], depths=list(range(1, 21)), probs=[0.9] * 20)
    sizes = []
    real_screen = head.screen

    def screen(x):
        sizes.append(x.shape[0])
        return real_screen(x)

    head.screen = screen
    walked = longest_paths([chain], head.argmax(hidden), [0])
    assert walked == longest_paths([chain], full, [0]) and walked[0].nodes == list(range(20))
    assert sizes == [SCREEN_WIDTH, SCREEN_WIDTH, 21 - 2 * SCREEN_WIDTH]


def test_bf16_logits_that_round_together_resolve_like_the_bf16_layer():
    """A bf16 layer's logits are fp32 sums rounded to bf16, so tokens apart in fp32 can tie; the
    screen must then give the first of them, as the bf16 layer's argmax does, not the fp32 best.
    Weights on the int8 grid and integer hidden states make the screen's own bound tiny, so only
    the output-rounding term keeps such ties open (without it this test fails)."""
    generator = torch.Generator().manual_seed(5)
    base = torch.randint(-100, 101, (1, 16), generator=generator)
    weight = (base + torch.randint(-3, 4, (2000, 16), generator=generator)).float() / 64  # logits close together
    weight[:, 0] = 127 / 64  # every row's scale exactly 1/64: int8 holds the weights exactly
    hidden = torch.randint(-63, 64, (MOST_POSITIONS, 16), generator=generator).float()  # screened, not the full layer
    hidden[:, 0] = 63  # the two digits hold it exactly
    weight, hidden = weight.bfloat16(), hidden.bfloat16()  # all exact in bf16
    layer = torch.nn.functional.linear(hidden, weight).float().argmax(-1).tolist()
    in_fp32 = (hidden.float() @ weight.float().T).argmax(-1).tolist()
    assert layer != in_fp32  # ties at bf16's spacing happen in this set
    assert list(_screened(weight).argmax(hidden)) == layer


def test_rows_own_bounds_narrow_the_candidates_without_losing_the_best():
    """One row with 50x larger weights sets the screen's shared bound; each row's own bound then
    rules out most of the candidates the shared one left, and never the true argmax."""
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(3000, 32, generator=generator) * 0.05
    weight[0] *= 50
    hidden = torch.randn(16, 32, generator=generator) * 3
    head = _screened(weight)
    tokens, threshold, estimate, terms = head.screen(hidden)
    full = (hidden @ weight.T).argmax(-1)
    narrowed = 0
    for p, token in enumerate(tokens):
        if token is not None:
            continue
        candidates = (estimate[p] >= threshold[p]).nonzero()[:, 0]
        kept = head.narrow(candidates, estimate[p, candidates], terms[p])
        assert int(full[p]) in kept.tolist() and set(kept.tolist()) <= set(candidates.tolist())
        narrowed += len(kept) < len(candidates)
    assert narrowed >= 4
    assert list(head.argmax(hidden)) == full.tolist()


def test_exact_ties_resolve_to_the_first_index_like_argmax():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(400, 32, generator=generator) * 0.05
    weight[250] = weight[17] = weight[300]  # three identical rows: equal logits
    hidden = weight[300:301] * 50  # ... and the largest ones
    tokens = _screened(weight).argmax(hidden)
    assert tokens[0] == 17 == int((hidden @ weight.T).argmax())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("channel", [0, 5])
def test_hidden_states_with_inf_or_nan_take_the_full_layers_argmax(bad, channel):
    """A non-finite hidden state (a broken or overflowing model) must give what argmax over the
    full layer's logits gives, and leave its batch-mates screened exactly: it broke the int8
    product's input range ("min should be less than or equal to max") in channel 0."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 16, generator=generator) * 0.05
    hidden = torch.randn(4, 16, generator=generator) * 3
    hidden[0, channel] = bad
    hidden[3, channel] = bad
    head = _screened(weight)
    tokens, *_ = head.screen(hidden)
    assert tokens[0] is None and tokens[3] is None and tokens[1] is not None and tokens[2] is not None
    assert list(head.argmax(hidden)) == (hidden @ weight.T).argmax(-1).tolist()


def test_a_row_left_with_too_many_candidates_is_computed_in_full():
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(1, 16, generator=generator)
    weight = base + 1e-3 * torch.randn(5000, 16, generator=generator)  # logits apart, yet all within the bound
    hidden = torch.randn(3, 16, generator=generator)
    head = _screened(weight)
    tokens, *_ = head.screen(hidden)
    assert tokens == [None, None, None]  # the screen decides none of them
    assert list(head.argmax(hidden)) == (hidden @ weight.T).argmax(-1).tolist()


def test_reads_resolve_lazily_and_slices_share_them():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(2000, 24, generator=generator) * 0.05
    hidden = torch.randn(6, 24, generator=generator)
    tokens = _screened(weight).argmax(hidden)
    full = (hidden @ weight.T).argmax(-1).tolist()
    part = tokens[2:5]
    assert len(part) == 3 and part[0] == full[2] and part[-1] == full[4]
    assert tokens[2] == full[2] and list(tokens[::2]) == full[::2]
    with pytest.raises(IndexError):
        part[3]


def test_applies_only_where_sound_and_undoes():
    weight = torch.randn(300, 16) * 0.05
    assert unsupported_reason(_Head(weight)) is None
    assert "bias" in unsupported_reason(_Head(weight, bias=True))
    assert unsupported_reason(_Head(weight.to(torch.bfloat16))) is None
    assert "fp32 or bf16" in unsupported_reason(_Head(weight.to(torch.float16)))
    capped = _Head(weight)
    capped.config.final_logit_softcapping = 30.0
    assert "softcapping" in unsupported_reason(capped)
    assert not screen_greedy_head(_Head(weight, bias=True))

    model = _Head(weight)
    profile_of(model).cost_curve = CostCurve([1, 2], [0.1, 0.2])
    assert screen_greedy_head(model) and screen_greedy_head(model)  # again: no change
    assert greedy_head_of(model) is not None
    assert profile_of(model).cost_curve is None  # costs timed with the full layer are forgotten
    hidden = torch.randn(1, 2, 16)
    with capture_hidden() as captured:
        out = model.lm_head(hidden)
    assert out.shape == (1, 0, 300) and captured[0] is hidden
    restore_greedy_head(model)
    assert greedy_head_of(model) is None
    with capture_hidden() as captured:
        out = model.lm_head(hidden)
    assert out.shape == (1, 2, 300) and not captured  # the full layer again


def test_a_lazy_screen_is_built_on_first_use_and_can_be_undone_before():
    weight = torch.randn(300, 16) * 0.05
    model = _Head(weight)
    assert screen_greedy_head(model, lazy=True) and screen_greedy_head(model, lazy=True)
    hidden = torch.randn(1, 2, 16)
    with capture_hidden() as captured:
        out = model.lm_head(hidden)
    assert out.shape == (1, 2, 300) and not captured  # nothing built or hooked yet
    profile_of(model).cost_curve = CostCurve([1, 2], [0.1, 0.2])
    head = greedy_head_of(model)  # the first greedy step builds it
    assert head is not None and greedy_head_of(model) is head
    assert profile_of(model).cost_curve is None  # and forgets costs timed with the full layer
    assert list(head.argmax(hidden[0])) == (hidden[0] @ weight.T).argmax(-1).tolist()
    screened, full = CostCurve([1, 2], [0.1, 0.3]), CostCurve([1, 2], [0.2, 0.4])
    profile_of(model).cost_curve = screened
    for switch in range(2):  # each layer keeps its own costs across switches (forgotten, every run's first
        with full_output_layer(model) as set_aside:  # step went plain): benchmarks, the screen kept
            assert set_aside and greedy_head_of(model) is None
            assert profile_of(model).cost_curve is (full if switch else None)
            profile_of(model).cost_curve = full
            with capture_hidden() as captured:
                assert model.lm_head(hidden).shape == (1, 2, 300) and not captured
        assert profile_of(model).cost_curve is screened
    assert greedy_head_of(model) is head  # hooked in again, not rebuilt
    with capture_hidden() as captured:
        assert model.lm_head(hidden).shape == (1, 0, 300) and captured

    pending = _Head(weight)
    assert screen_greedy_head(pending, lazy=True)
    assert restore_greedy_head(pending)  # undone before it was ever built
    assert greedy_head_of(pending) is None and not restore_greedy_head(pending)
    assert not screen_greedy_head(_Head(weight, bias=True), lazy=True)  # unsound: refused at once

    converted = _Head(weight)
    assert screen_greedy_head(converted, lazy=True)
    converted.half()  # after the lazy check and before the first step: fp16 is no dtype it screens
    assert greedy_head_of(converted) is None and not restore_greedy_head(converted)


def test_code_outside_transformers_keeps_the_full_layer():
    class Remote(_Head):
        __module__ = "transformers_modules.some_repo.modeling"

    assert "transformers" in unsupported_reason(Remote(torch.randn(10, 4)))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**DECODE_CASES)
def test_lookahead_with_the_screened_head_matches_generate(arch, prompt, max_new, budget):
    model = build_tiny_model(arch, "sdpa", 0)  # its own instance: the shared tiny models stay unscreened
    stock = reference_generate(model, prompt, max_new, None)
    assert screen_greedy_head(model)
    try:
        result = generate(model, prompt, max_new_tokens=max_new, config=LookaheadConfig(budget=budget), pad_token_id=0)
        assert result.sequences[0, len(prompt) :].tolist() == stock
    finally:
        restore_greedy_head(model)


def test_batched_rows_and_sampled_rows_with_the_screened_head():
    model = build_tiny_model("qwen2", "sdpa", 1)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 10, 7, 8, 9], [1, 2, 1, 2, 1, 2, 1, 2, 1]]
    greedy = [reference_generate(model, p, 24, None) for p in prompts]
    torch.manual_seed(5)
    ids = torch.tensor([prompts[0]])
    sampled = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=16, pad_token_id=0
    )
    assert screen_greedy_head(model)
    try:
        width = max(map(len, prompts))
        padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = (padded != 0).long()
        result = generate(model, padded, mask, max_new_tokens=24, pad_token_id=0)
        assert [row[width:].tolist() for row in result.sequences] == greedy
        torch.manual_seed(5)
        ours = generate(model, ids, max_new_tokens=16, do_sample=True, pad_token_id=0)
        assert ours.sequences[0].tolist() == sampled[0].tolist()  # sampling rows keep the full layer
    finally:
        restore_greedy_head(model)


def _decodes_as_the_full_layer(model, prompt: list[int]) -> None:
    with full_output_layer(model):
        stock = reference_generate(model, prompt, 24, None)
    result = generate(model, prompt, max_new_tokens=24, pad_token_id=0)
    assert result.sequences[0, len(prompt) :].tolist() == stock


@pytest.mark.parametrize("change", ["in_place", "replaced", "load_state_dict", "data", "data_add", "data_copy"])
def test_a_changed_output_layer_is_screened_afresh(change):
    """Weights changed after the screen was built (fine-tuning, a loaded checkpoint, a new
    Parameter, peft's merge of an adapter: ``weight.data += delta``, which bumps no version
    counter): the next greedy tokens are the changed model's, never the stale screen's."""
    model = build_tiny_model("qwen2", "sdpa", 2)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    assert screen_greedy_head(model)
    try:
        generate(model, prompt, max_new_tokens=4, pad_token_id=0)  # the screen is built and used
        layer = model.get_output_embeddings()
        generator = torch.Generator().manual_seed(3)
        new = torch.randn(layer.weight.shape, generator=generator) * 3
        with torch.no_grad():
            if change == "in_place":
                layer.weight.copy_(new)
            elif change == "replaced":
                layer.weight = torch.nn.Parameter(new)
            elif change == "data":  # same object and version, new storage
                layer.weight.data = new
            elif change == "data_add":  # same object, version and storage: only the values move
                layer.weight.data += new
            elif change == "data_copy":
                layer.weight.data.copy_(new)
            else:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                for key in [k for k in state if state[k].shape == new.shape]:
                    state[key] = new
                model.load_state_dict(state)
        _decodes_as_the_full_layer(model, prompt)
    finally:
        restore_greedy_head(model)


def test_weights_made_in_inference_mode_are_screened():
    """Inference tensors have no version counter: the screen's change check must not need one,
    and an edit of them in inference mode is seen by the values it samples."""
    with torch.inference_mode():
        model = build_tiny_model("qwen2", "sdpa", 2)
    assert model.get_output_embeddings().weight.is_inference()
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    with torch.inference_mode():
        stock = reference_generate(model, prompt, 16, None)
    assert screen_greedy_head(model)
    try:
        result = generate(model, prompt, max_new_tokens=16, pad_token_id=0)
        assert greedy_head_of(model) is not None
        assert result.sequences[0, len(prompt) :].tolist() == stock
        with torch.inference_mode():
            model.get_output_embeddings().weight.mul_(-1)
            stock = reference_generate(model, prompt, 16, None)
        result = generate(model, prompt, max_new_tokens=16, pad_token_id=0)
        assert result.sequences[0, len(prompt) :].tolist() == stock
    finally:
        restore_greedy_head(model)


def test_forget_weight_copies_catches_an_edit_the_sample_misses():
    """A few rows edited through ``.data`` may fall between the sampled ones: the screen then
    answers for the old rows until ``forget_weight_copies`` drops it."""
    model = build_tiny_model("qwen2", "sdpa", 2)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    assert screen_greedy_head(model)
    try:
        generate(model, prompt, max_new_tokens=4, pad_token_id=0)
        layer = model.get_output_embeddings()
        head = greedy_head_of(model)
        view = head.sample.view
        sampled = torch.arange(view.numel()) * view.stride(0) + view.storage_offset()
        values = layer.weight.data.view(-1)
        kept = values[sampled].clone()
        values.mul_(-3)  # every value but the sampled ones
        values[sampled] = kept
        assert greedy_head_of(model) is head  # unseen
        assert rag_lookahead.forget_weight_copies(model) >= 1
        _decodes_as_the_full_layer(model, prompt)
        assert greedy_head_of(model) is not head
    finally:
        restore_greedy_head(model)


def test_a_screened_model_with_copied_output_rows_decodes_as_model_generate():
    """Candidates' logits came from a product of their rows alone, which sums in another order
    than the full layer: bit-identical rows came out an ulp apart and the later id won, where the
    layer ties them exactly and its argmax takes the first. A tiny model whose output rows 48..95
    copy 0..47 took the copy's id on 18 of 20 prompts once screened (the default model's output
    layer has 161 groups of identical rows)."""
    import random

    model = build_tiny_model("qwen2")
    with torch.no_grad():
        model.lm_head.weight[48:96] = model.lm_head.weight[0:48].clone()
    assert screen_greedy_head(model)
    rng = random.Random(2)
    for _ in range(12):
        prompt = [rng.randrange(1, 96) for _ in range(rng.randrange(1, 60))]
        new = rng.randrange(1, 40)
        expected = reference_generate(model, prompt, new, None)
        got = generate(model, [prompt], max_new_tokens=new, references=[[prompt[-2:] + expected]], pad_token_id=0)
        assert got.sequences[0, len(prompt) :].tolist() == expected, prompt
