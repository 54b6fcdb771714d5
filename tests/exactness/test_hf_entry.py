"""``model.generate(custom_generate=hf_generate)`` equals ``model.generate`` for the same arguments,
takes the article's GenerationConfig keys, and refuses what it cannot reproduce."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, build_tiny_model, padded, tiny_model
from tiny_tokenizer import tiny_tokenizer
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import QuantizedCache
from transformers.generation.logits_process import (
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from rag_lookahead import LookaheadConfig, generate
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.hf_entry import LookaheadGenerateOutput, hf_generate

tokens = st.integers(min_value=1, max_value=12)


def lookahead(**keys) -> GenerationConfig:
    """The article's config: lookahead keys next to the usual ones."""
    return GenerationConfig(**{"use_lookahead": True, "decoding_length": 64, "branch_length": 24, **keys})


#: drafts from the references alone, every node verified: what a step accepts shows what was drafted
ISOLATED = LookaheadConfig(budget="fixed", use_output_pool=False)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(tokens, min_size=1, max_size=20), min_size=1, max_size=3),
    max_new=st.integers(1, 30),
    eos_at=st.none() | st.integers(0, 29),
)
def test_greedy_equals_model_generate(arch, prompts, max_new, eos_at):
    model = tiny_model(arch)
    ids, mask = padded(prompts)
    plain = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
    eos = None
    if eos_at is not None:  # an EOS the first row really produces, so rows end at different steps
        new = plain[0, ids.shape[1] :].tolist()
        eos = new[min(eos_at, len(new) - 1)]
    expected = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, eos_token_id=eos
    )
    references = [[p + expected[r, ids.shape[1] :].tolist()] for r, p in enumerate(prompts)]  # drafts that get accepted
    got = model.generate(
        input_ids=ids,
        attention_mask=mask,
        custom_generate=hf_generate,
        generation_config=lookahead(max_new_tokens=max_new, do_sample=False, eos_token_id=eos),
        references=references,
    )
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "glm4"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(tokens, min_size=2, max_size=20),
    max_new=st.integers(1, 30),
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.3, 1.5),
    top_p=st.floats(0.5, 1.0),
    penalty=st.floats(1.0, 1.5),
)
def test_sampling_equals_model_generate_under_the_same_seed(arch, prompt, max_new, seed, temperature, top_p, penalty):
    model = tiny_model(arch)
    ids = torch.tensor([prompt])
    options = dict(
        do_sample=True, temperature=temperature, top_p=top_p, top_k=30, min_p=0.02, repetition_penalty=penalty
    )
    torch.manual_seed(seed)
    expected = model.generate(input_ids=ids, max_new_tokens=max_new, **options)
    torch.manual_seed(seed)
    got = model.generate(
        input_ids=ids,
        custom_generate=hf_generate,
        generation_config=lookahead(max_new_tokens=max_new, **options),
        references=[[prompt + expected[0, len(prompt) :].tolist()]],
    )
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_repetition_penalty_on_a_padded_batch_equals_model_generate(arch):
    """transformers skips each row's left padding in the penalty (prompt_ignore_length); so do our
    rows, whose histories hold no padding. Was refused as a differing processor before."""
    model = tiny_model(arch)
    ids, mask = padded([[4, 9, 4, 9, 4, 9, 11, 5], [7, 2, 7]])
    keys = dict(max_new_tokens=20, do_sample=False, repetition_penalty=2.5)
    expected = model.generate(input_ids=ids, attention_mask=mask, **keys)
    got = model.generate(
        input_ids=ids, attention_mask=mask, custom_generate=hf_generate, generation_config=lookahead(**keys)
    )
    assert got.tolist() == expected.tolist()


def test_a_users_own_repetition_penalty_processor_is_refused_on_a_padded_batch_only():
    """transformers uses a processor passed in ``logits_processor`` instead of its own, and that
    one penalises the pad ids of the left padding: on a padded batch model.generate's tokens
    follow it (ours differed), so it is refused, saying what to pass; unpadded, it is exact."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from rag_lookahead.errors import ConfigError

    model = tiny_model("qwen2")
    keys = dict(
        max_new_tokens=12,
        do_sample=False,
        repetition_penalty=2.0,
        logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)]),
    )
    ids, mask = padded([[4, 9, 4, 9, 4, 9, 11, 5, 6, 7], [7, 2, 7]])
    with pytest.raises(ConfigError, match="penalises the left padding.*pass repetition_penalty="):
        model.generate(ids, attention_mask=mask, custom_generate=hf_generate, **keys)
    ids, mask = padded([[4, 9, 4, 9, 4, 9, 11, 5, 6, 7]])
    expected = model.generate(ids, attention_mask=mask, **keys)
    assert model.generate(ids, attention_mask=mask, custom_generate=hf_generate, **keys).tolist() == expected.tolist()


def repeating_case(arch="qwen2", max_new=24):
    """A prompt, its greedy continuation, and a reference holding that continuation."""
    model = tiny_model(arch)
    prompt = [7, 3, 9, 4, 11, 2, 8]
    expected = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)
    answer = expected[0, len(prompt) :].tolist()
    return model, prompt, answer, expected


def test_references_and_lengths_are_taken_from_the_call():
    model, prompt, answer, expected = repeating_case()
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        custom_generate=hf_generate,
        generation_config=lookahead(max_new_tokens=24, do_sample=False, return_dict_in_generate=True),
        references=[[prompt[-2:] + answer]],
        lookahead_config=ISOLATED,
    )
    assert out.sequences.tolist() == expected.tolist()
    assert out.lookahead_stats.accepted_histogram == {23: 1}  # after the prefill's token, the rest in one step
    short = model.generate(
        input_ids=torch.tensor([prompt]),
        custom_generate=hf_generate,
        generation_config=lookahead(max_new_tokens=24, do_sample=False, branch_length=3, return_dict_in_generate=True),
        references=[[prompt[-2:] + answer]],
        lookahead_config=ISOLATED,
    )
    assert short.sequences.tolist() == expected.tolist()
    assert max(short.lookahead_stats.accepted_histogram) <= 4  # branch_length 3 + the bonus token


def test_use_lookahead_false_decodes_one_token_a_step():
    model, prompt, answer, expected = repeating_case()
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        custom_generate=hf_generate,
        generation_config=GenerationConfig(
            use_lookahead=False, max_new_tokens=24, do_sample=False, return_dict_in_generate=True
        ),
        references=[[prompt[-2:] + answer]],
    )
    assert out.sequences.tolist() == expected.tolist()
    assert out.lookahead_stats.draft_tokens == 0 and set(out.lookahead_stats.accepted_histogram) == {1}


def test_return_dict_is_what_model_generate_returns_plus_stats():
    model, prompt, answer, expected = repeating_case()
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        custom_generate=hf_generate,
        generation_config=lookahead(
            max_new_tokens=24, do_sample=False, return_dict_in_generate=True, debug_lookahead=True
        ),
    )
    assert isinstance(out, GenerateDecoderOnlyOutput) and isinstance(out, LookaheadGenerateOutput)
    assert out.sequences.tolist() == expected.tolist()
    assert out.lookahead_stats.new_tokens == 24 and out.lookahead_stats.trace  # debug_lookahead keeps the trace


def test_max_length_counts_the_padded_width_as_transformers_does():
    model = tiny_model("llama")
    ids, mask = padded([[4, 5, 6, 7, 8, 9], [4, 5]])
    expected = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_length=15)
    got = model.generate(
        input_ids=ids,
        attention_mask=mask,
        custom_generate=hf_generate,
        generation_config=lookahead(max_length=15, do_sample=False),
    )
    assert got.tolist() == expected.tolist() and got.shape[1] == 15


def test_the_shortest_of_several_max_length_criteria_ends_the_answer():
    """A caller's own ``MaxLengthCriteria`` list: transformers lets the first replace its own and
    keeps the others, and stops at whichever is reached first. Taking the last one read decoded
    past the shorter limit (14 tokens where ``model.generate`` gave 10)."""
    model = tiny_model("llama")
    ids = torch.tensor([[4, 5, 6, 7, 8, 9]])

    def criteria():
        return StoppingCriteriaList([MaxLengthCriteria(max_length=10), MaxLengthCriteria(max_length=14)])

    want = model.generate(input_ids=ids, do_sample=False, max_new_tokens=20, stopping_criteria=criteria())
    got = model.generate(
        input_ids=ids,
        custom_generate=hf_generate,
        generation_config=lookahead(max_new_tokens=20, do_sample=False),
        stopping_criteria=criteria(),
    )
    assert got.tolist() == want.tolist() and want.shape[1] == 10


def test_pad_and_eos_come_from_the_generation_config():
    """Two EOS ids and a pad id other than both: a row that ends early is filled as transformers fills it."""
    model = tiny_model("qwen3")
    ids, mask = padded([[5, 9, 5, 9, 5], [8, 2, 6]])
    plain = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    first, second = (plain[r, ids.shape[1] :].tolist() for r in (0, 1))
    ending = next(t for i, t in enumerate(first) if i >= 2 and t not in first[:i] and t not in second)
    unused = next(t for t in range(1, 95) if t not in first + second)
    keys = dict(max_new_tokens=20, do_sample=False, eos_token_id=[unused, ending], pad_token_id=95)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(**keys))
    got = model.generate(
        input_ids=ids, attention_mask=mask, custom_generate=hf_generate, generation_config=lookahead(**keys)
    )
    assert got.tolist() == expected.tolist()
    assert got[0, -1].item() == 95 and got[1, -1].item() != 95  # the first row ended early and was padded


class Recorder:
    """A streamer that records every put() and end()."""

    def __init__(self) -> None:
        self.calls: list = []

    def put(self, value) -> None:
        self.calls.append(value.tolist())

    def end(self) -> None:
        self.calls.append("end")


def test_streamer_receives_what_model_generate_gives_it():
    """transformers does not hand a streamer to a callable custom_generate; without reading it
    from the calling frame the streamer saw the prompt and never a token or end()."""
    model, prompt, answer, expected = repeating_case()
    want, got = Recorder(), Recorder()
    model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=24, streamer=want)
    model.generate(
        input_ids=torch.tensor([prompt]),
        custom_generate=hf_generate,
        generation_config=lookahead(max_new_tokens=24, do_sample=False),
        references=[[prompt[-2:] + answer]],
        streamer=got,
    )
    assert got.calls == want.calls
    assert got.calls[-1] == "end" and len(got.calls) == 1 + 24 + 1  # prompt, one put per token, end


class StopAfter(StoppingCriteria):
    """Stops a row once it holds ``length`` tokens; counts its calls."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_custom_stopping_criteria_cut_inside_an_accepted_block():
    model, prompt, answer, expected = repeating_case()
    theirs, ours = StopAfter(len(prompt) + 7), StopAfter(len(prompt) + 7)
    want = model.generate(
        input_ids=torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=24,
        stopping_criteria=StoppingCriteriaList([theirs]),
    )
    got = model.generate(
        input_ids=torch.tensor([prompt]),
        custom_generate=hf_generate,
        generation_config=lookahead(max_new_tokens=24, do_sample=False, return_dict_in_generate=True),
        references=[[prompt[-2:] + answer]],  # the whole answer arrives as one block; the criterion cuts it
        stopping_criteria=StoppingCriteriaList([ours]),
    )
    assert got.sequences.tolist() == want.tolist() and want.shape[1] == len(prompt) + 7
    assert ours.calls == theirs.calls == 7
    assert got.lookahead_stats.new_tokens == 7


def test_a_criterion_returning_a_plain_bool_stops_as_in_model_generate():
    """transformers ORs a criterion's verdict into a tensor, so a plain bool works there (it was an
    AttributeError here)."""

    class LastIs(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[0, -1].item() == stop_token

    model, prompt, answer, _ = repeating_case()
    stop_token = answer[5]
    call = dict(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=24)
    want = model.generate(**call, stopping_criteria=StoppingCriteriaList([LastIs()]))
    got = model.generate(
        **call,
        custom_generate=hf_generate,
        references=[[prompt[-2:] + answer]],
        stopping_criteria=StoppingCriteriaList([LastIs()]),
    )
    assert got.tolist() == want.tolist() and want.shape[1] < len(prompt) + 24


def test_a_criterion_that_cuts_a_sampled_block_leaves_the_generator_where_model_generate_does():
    """Sampled blocks were drawn whole and cut by the criterion afterwards: the tokens matched, but
    the draws past the cut moved torch's generator, so the next call under the same seed differed."""
    model = tiny_model("qwen2")
    ids = torch.tensor([[7, 3, 9, 4, 11, 2, 8] * 2])
    cut = ids.shape[1] + 5
    torch.manual_seed(123)  # references that hold what sampling will give, so long blocks are accepted
    references = [[model.generate(input_ids=ids, max_new_tokens=20, do_sample=True)[0].tolist() for _ in range(3)]]

    def session(**ours):
        torch.manual_seed(123)
        criteria = [StopAfter(cut) for _ in range(3)]
        outputs = [
            model.generate(
                input_ids=ids, max_new_tokens=20, do_sample=True, stopping_criteria=StoppingCriteriaList([c]), **ours
            ).tolist()
            for c in criteria
        ]
        return outputs, torch.rand(1).item(), [c.calls for c in criteria]

    ours = session(custom_generate=hf_generate, references=references, lookahead_config=ISOLATED)
    assert ours == session()
    assert all(len(o[0]) == cut for o in ours[0])


class StopOnceShown(StoppingCriteria):
    """Stops once a streamer has shown ``count`` new tokens (a UI that stops what it has displayed)."""

    def __init__(self, streamer: Recorder, count: int) -> None:
        self.streamer, self.count = streamer, count

    def __call__(self, input_ids, scores, **kwargs):
        shown = sum(1 for call in self.streamer.calls if call != "end") - 1  # less the prompt
        return torch.full((input_ids.shape[0],), shown >= self.count, dtype=torch.bool)


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_criterion_judges_a_token_before_it_is_streamed_as_in_model_generate(do_sample):
    """transformers calls the criteria on a token and only then streams it. Each token was streamed
    first, so a criterion reading the streamer stopped a token early ([9, 31, 15, 15, 15] against
    [9, 31, 15, 15, 15, 15]); sampled, the generator was left elsewhere too."""
    model = tiny_model("qwen2")
    ids = torch.tensor([[7, 3, 9, 4, 11, 2, 8] * 2])
    torch.manual_seed(5)  # references holding what will be generated: long blocks, cut by the criterion
    runs = [model.generate(input_ids=ids, max_new_tokens=20, do_sample=do_sample)[0].tolist() for _ in range(2)]

    def run(**ours):
        torch.manual_seed(5)
        outputs, calls = [], []
        for _ in range(2):
            streamer = Recorder()
            criteria = StoppingCriteriaList([StopOnceShown(streamer, 6)])
            out = model.generate(
                input_ids=ids,
                max_new_tokens=20,
                do_sample=do_sample,
                streamer=streamer,
                stopping_criteria=criteria,
                **ours,
            )
            outputs.append(out.tolist())
            calls.append(streamer.calls)
        return outputs, calls, torch.rand(1).item()

    ours = run(custom_generate=hf_generate, references=[runs], lookahead_config=ISOLATED)
    assert ours == run()
    assert all(len(out[0]) == ids.shape[1] + 7 for out in ours[0])  # 6 shown, the 7th judged on that, streamed


def test_a_criterion_that_raises_leaves_the_streamer_where_model_generate_does():
    """The token whose criteria raised was streamed here before they were called; transformers never streams it."""

    class RaiseAt(StoppingCriteria):
        def __init__(self, call: int) -> None:
            self.call, self.calls = call, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if self.calls == self.call:
                raise RuntimeError("criterion failed")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model, prompt, answer, _ = repeating_case()
    streamed = []
    for ours in ({}, dict(custom_generate=hf_generate, references=[[prompt[-2:] + answer]])):
        streamer = Recorder()
        with pytest.raises(RuntimeError, match="criterion failed"):
            model.generate(
                input_ids=torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=24,
                streamer=streamer,
                stopping_criteria=StoppingCriteriaList([RaiseAt(5)]),
                **ours,
            )
        streamed.append([call for call in streamer.calls if call != "end"])  # we end it on failure too
    assert streamed[1] == streamed[0] and len(streamed[0]) == 1 + 4  # the prompt, four tokens


def _pieces_tokenizer():
    """Tokens of one to four characters joined as they are, so a stop string may end inside a
    token or span several (the word tokenizer's spaces keep transformers' stop strings from working)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from rag_lookahead.tiny import VOCAB

    pieces = ["<pad>", "<unk>", "<s>", "<eos>", *"abcdefghijklmnop", "ab", "bc", "abc", "cd", "end", ". ", "op!"]
    pieces += [f"z{i}" for i in range(VOCAB - len(pieces))]
    core = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def test_a_stopping_criterion_on_a_batch_without_eos_is_refused():
    """Without EOS transformers does not pad a row a criterion stopped: it decodes on until every
    row has stopped. The loop would have padded it (a silent difference), so that case is refused;
    with EOS (where transformers pads too) the batch runs."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    model, tokenizer = tiny_model("qwen2"), _pieces_tokenizer()
    ids, mask = padded([[4, 5, 6], [7, 8]])
    call = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=5)
    stops = StoppingCriteriaList([StopStringCriteria(tokenizer, ["zz"])])
    with pytest.raises(ConfigError, match="need an EOS token"):
        model.generate(**call, custom_generate=hf_generate, stopping_criteria=stops)
    want = model.generate(**call, eos_token_id=3, stopping_criteria=stops)
    got = model.generate(**call, eos_token_id=3, custom_generate=hf_generate, stopping_criteria=stops)
    assert got.tolist() == want.tolist()


def test_a_time_limit_on_a_batch_is_refused():
    """transformers' MaxTimeCriteria ends every row on the same step; it was taken as a per-row
    criterion, so a row it stopped at its own block came back padded (74 pad ids in one row)."""
    from transformers.generation.stopping_criteria import MaxTimeCriteria

    with pytest.raises(ConfigError, match="time limit"):
        _two_rows_stopped_by(MaxTimeCriteria(600))


def _two_rows_stopped_by(criterion):
    """Greedy ``hf_generate`` on a padded batch of two rows with one stopping criterion."""
    ids, mask = padded([[4, 5, 6], [7, 8]])
    return tiny_model("qwen2").generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=5,
        eos_token_id=3,
        custom_generate=hf_generate,
        stopping_criteria=StoppingCriteriaList([criterion]),
    )


@pytest.mark.parametrize("max_time", [600.0, 1e-9])
def test_max_time_at_batch_size_1_is_taken_as_model_generate_takes_it(max_time):
    """``max_time=`` was refused as an option the loop does not implement, though transformers hands
    it over as a MaxTimeCriteria, which was taken (1e-9 s: one token, then stop)."""
    model = tiny_model("qwen2")
    call = dict(input_ids=torch.tensor([[5, 6, 7, 8, 5, 6]]), do_sample=False, max_new_tokens=8, max_time=max_time)
    expected = model.generate(**call)
    assert model.generate(**call, custom_generate=hf_generate).tolist() == expected.tolist()
    ids, mask = padded([[4, 5, 6], [7, 8]])
    with pytest.raises(ConfigError, match="time limit"):  # on a batch, as the criterion is
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=5,
            eos_token_id=3,
            max_time=60.0,
            custom_generate=hf_generate,
        )


def test_a_batch_with_eos_from_a_criterion_and_no_pad_id_is_refused():
    """No pad id and no EOS in the config, EOS only from the caller's criterion: rows that ended
    early were filled with token 0 (model.generate fails there with a TypeError)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria

    model = build_tiny_model("qwen2")
    model.generation_config.pad_token_id = None
    ids, mask = padded([[5, 6, 7, 8, 5, 6], [9, 10, 11]])
    with pytest.raises(ConfigError, match="pad_token_id"):
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=10,
            custom_generate=hf_generate,
            stopping_criteria=StoppingCriteriaList([EosTokenCriteria(38)]),
        )


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_strings_end_each_row_where_model_generate_does(arch, data):
    """Stop strings taken from the plain answer (ending inside a token, spanning tokens), on a
    padded batch with references drafting whole blocks the stop then cuts."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    model, tokenizer = tiny_model(arch), _pieces_tokenizer()
    prompts = data.draw(st.lists(st.lists(st.integers(4, 40), min_size=2, max_size=6), min_size=1, max_size=3))
    ids, mask = padded(prompts)
    call = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=3)
    plain = model.generate(**call)
    text = tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True)
    start = data.draw(st.integers(0, max(len(text) - 1, 0)))
    stop = text[start : start + data.draw(st.integers(1, 5))] or "zz"
    stops = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])
    want = model.generate(**call, stopping_criteria=stops)
    references = [[plain[r, ids.shape[1] :].tolist()] for r in range(len(prompts))]
    got = model.generate(
        **call,
        custom_generate=hf_generate,
        stopping_criteria=stops,
        references=references,
        lookahead_config=ISOLATED,
    )
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize(
    "lengths",
    [
        dict(min_new_tokens=0),  # transformers makes it min_length = the prompt's width
        dict(min_new_tokens=0, eos_token_id=3),
        dict(min_length=2, eos_token_id=3),  # shorter than the prompt
        dict(min_new_tokens=4),  # no EOS: transformers adds no processor
    ],
)
def test_minimum_lengths_that_hold_nothing_back_are_exact(lengths):
    """They were refused, naming a min_length the caller never set."""
    model = tiny_model("qwen2")
    call = dict(input_ids=torch.tensor([[7, 3, 9, 4, 11]]), do_sample=False, max_new_tokens=6, **lengths)
    assert model.generate(**call, custom_generate=hf_generate).tolist() == model.generate(**call).tolist()
    config = GenerationConfig(**lengths, do_sample=False)
    ours = generate(model, [7, 3, 9, 4, 11], max_new_tokens=6, generation_config=config)
    assert ours.sequences.tolist() == model.generate(**call).tolist()
    with pytest.raises(ConfigError, match="min_length"):
        generate(model, [7, 3], max_new_tokens=6, generation_config=GenerationConfig(min_length=4), eos_token_id=3)


@pytest.mark.parametrize("lengths", [dict(min_length=15), dict(min_new_tokens=5)])
def test_a_minimum_with_eos_only_from_the_callers_criterion_is_exact(lengths):
    """EOS from an EosTokenCriteria alone (none in the generation config): transformers holds
    nothing back, and the call was refused by the loop, which read the criterion's EOS as the config's."""
    from transformers.generation.stopping_criteria import EosTokenCriteria

    model = tiny_model("qwen2")
    call = dict(input_ids=torch.tensor([[7, 3, 9, 4, 11, 2, 8, 7, 3, 9]]), do_sample=False, max_new_tokens=10)
    eos = next(t for t in model.generate(**call)[0, 10:].tolist()[:4] if t not in (7, 3, 9, 4, 11, 2, 8))
    criteria = StoppingCriteriaList([EosTokenCriteria(eos)])
    want = model.generate(**call, **lengths, stopping_criteria=criteria)
    assert want.shape[1] < 20  # stopped at that EOS, inside the minimum
    got = model.generate(**call, **lengths, stopping_criteria=criteria, custom_generate=hf_generate)
    assert got.tolist() == want.tolist()


def test_text_references_and_stop_words_need_the_tokenizer():
    model, prompt, answer, expected = repeating_case()
    tokenizer = tiny_tokenizer()
    text = tokenizer.decode(prompt[-2:] + answer)
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        custom_generate=hf_generate,
        generation_config=lookahead(
            max_new_tokens=24, do_sample=False, return_dict_in_generate=True, stop_words=["t5", 4]
        ),
        references=[[text]],
        lookahead_tokenizer=tokenizer,
        lookahead_config=ISOLATED,
    )
    assert out.sequences.tolist() == expected.tolist()
    assert out.lookahead_stats.accepted_histogram == {23: 1}
    with pytest.raises(InputError, match="lookahead_tokenizer"):
        model.generate(
            input_ids=torch.tensor([prompt]),
            custom_generate=hf_generate,
            generation_config=lookahead(max_new_tokens=4),
            references=[[text]],
        )
    with pytest.raises(ConfigError, match="lookahead_tokenizer"):
        model.generate(
            input_ids=torch.tensor([prompt]),
            custom_generate=hf_generate,
            generation_config=lookahead(max_new_tokens=4, stop_words=["t3"]),
        )
    with pytest.raises(ConfigError, match="lookahead_tokenizer must be the model's tokenizer"):  # a TypeError
        model.generate(
            input_ids=torch.tensor([prompt]),
            custom_generate=hf_generate,
            generation_config=lookahead(max_new_tokens=4),
            references=[[text]],
            lookahead_tokenizer="tokenizer",
        )


def test_lookahead_config_is_the_base_the_keys_override():
    model, prompt, answer, expected = repeating_case()
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        custom_generate=hf_generate,
        generation_config=GenerationConfig(
            max_new_tokens=24, do_sample=False, return_dict_in_generate=True, branch_length=2
        ),
        lookahead_config=ISOLATED.replace(decoding_length=8),
        references=[[prompt[-2:] + answer]],
    )
    assert out.sequences.tolist() == expected.tolist()
    assert max(out.lookahead_stats.accepted_histogram) == 3


def test_a_lookahead_config_keeps_its_stop_words_when_a_tokenizer_is_passed():
    """The tokenizer's punctuation is the default only where no ``lookahead_config`` is given: a
    config's own ``stop_words`` (none at all, too) must not be replaced because
    ``model.generate`` was also handed the tokenizer (for stop strings, say)."""
    from rag_lookahead.hf_entry import lookahead_settings, stop_word_ids

    tokenizer = tiny_tokenizer()
    assert lookahead_settings(GenerationConfig(), None, tokenizer).stop_words == stop_word_ids(tokenizer) != frozenset()
    base = LookaheadConfig(stop_words=frozenset({7}))
    assert lookahead_settings(GenerationConfig(), base, tokenizer).stop_words == frozenset({7})
    assert lookahead_settings(GenerationConfig(), LookaheadConfig(), tokenizer).stop_words == frozenset()


@pytest.mark.parametrize(
    "call, message",
    [
        (
            dict(logits_processor=LogitsProcessorList([NoBadWordsLogitsProcessor([[5]], eos_token_id=None)])),
            "NoBadWords",
        ),
        (dict(prefix_allowed_tokens_fn=lambda batch, ids: [1, 2]), "PrefixConstrained"),
        (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
        (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
        (dict(num_beams=2), "num_beams"),
        # a rounded cache changes model.generate's tokens; ours is full-precision (it was ignored)
        (dict(cache_implementation="quantized", cache_config={"backend": "fp8"}), "quantized cache"),
        (dict(past_key_values=QuantizedCache(backend="fp8", config=tiny_model("qwen2").config)), "quantized cache"),
        (dict(min_new_tokens=3, eos_token_id=3), r"min_length=6 \(what transformers makes of min_new_tokens=3\)"),
        (dict(position_ids=torch.tensor([[0, 2, 4]])), "position_ids"),
        (dict(generation_config=GenerationConfig(decoding_mode="par")), "decoding_mode"),
        (dict(generation_config=GenerationConfig(use_lookahead="yes")), "use_lookahead"),
        (dict(generation_config=GenerationConfig(branch_length=0)), "branch_length"),
        (dict(generation_config=GenerationConfig(stop_words="t5")), "lookahead_tokenizer"),
        (
            dict(generation_config=GenerationConfig(stop_words=5)),
            "stop_words must be a list of token ids or words, got 5",
        ),
        # it advised LookaheadConfig().with_tokenizer, which model.generate does not take
        (
            dict(generation_config=GenerationConfig(stop_words=[-3])),
            r"got -3 \(words are given as text, with lookahead_",
        ),
    ],
)
def test_what_cannot_be_reproduced_is_refused(call, message):
    model = tiny_model("qwen2")
    with pytest.raises(ConfigError, match=message):
        model.generate(input_ids=torch.tensor([[4, 5, 6]]), custom_generate=hf_generate, max_new_tokens=5, **call)


def test_a_filled_cache_is_refused():
    """``past_key_values`` holding an earlier forward's keys: transformers feeds only the uncached
    tail of ``input_ids``, while lookahead decoding prefills its own full-precision cache from all
    of them; the caller is told to pass the whole text instead."""
    model = tiny_model("qwen2")
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        cache = model(input_ids=ids[:, :2], use_cache=True).past_key_values
    assert cache.get_seq_length() == 2
    with pytest.raises(ConfigError, match="a filled cache cannot be continued"):
        model.generate(input_ids=ids, custom_generate=hf_generate, max_new_tokens=5, past_key_values=cache)


@pytest.mark.parametrize(
    "options",
    [
        dict(suppress_tokens=[], begin_suppress_tokens=[]),  # transformers still builds their processors
        dict(output_scores=True, output_logits=True),  # without return_dict_in_generate: ignored by transformers
        dict(output_attentions=True, output_hidden_states=True),
    ],
)
def test_settings_transformers_makes_nothing_of_are_taken(options):
    """Each was refused here, where ``model.generate`` returns its plain tokens."""
    model = tiny_model("qwen2")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, **options)
    got = model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=hf_generate, **options)
    assert got.tolist() == expected.tolist()


def test_a_row_of_pad_ids_only_is_refused_as_empty():
    """With a repetition penalty the processor check came first and blamed the processors."""
    model = tiny_model("qwen2")
    for options in ({}, {"repetition_penalty": 1.2}):
        with pytest.raises(InputError, match="row of input_ids is empty"):
            model.generate(
                torch.tensor([[0, 0, 0], [5, 6, 7]]),
                max_new_tokens=4,
                pad_token_id=0,
                custom_generate=hf_generate,
                **options,
            )


def test_generate_refuses_per_step_outputs_and_a_rounded_cache_it_would_ignore():
    """``rag_lookahead.generate`` returns sequences and stats: a generation config asking for
    per-step tensors, or for a quantized cache, was accepted and silently ignored."""
    model = tiny_model("qwen2")
    for config, message in (
        (GenerationConfig(output_logits=True, return_dict_in_generate=True), "output_logits=True with return_dict"),
        (GenerationConfig(cache_implementation="quantized"), "cache_implementation='quantized'"),
    ):
        with pytest.raises(ConfigError, match=message):
            generate(model, [5, 6, 7], max_new_tokens=4, generation_config=config)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_run_past_the_context_window_is_refused_and_one_up_to_it_is_exact(arch):
    """model.generate decodes past max_position_embeddings with a warning; the decode loop stops at
    the window. So a call whose max_length passes the window is refused (it returned fewer tokens,
    and in a padded batch a pad where transformers has a token); one ending at the window is exact."""
    model = tiny_model(arch)
    window = model.config.max_position_embeddings
    ids, mask = padded([[4 + i % 7 for i in range(window - 6)], [5, 6, 7]])
    with pytest.raises(ConfigError, match="at most 6"):
        model.generate(input_ids=ids, attention_mask=mask, custom_generate=hf_generate, max_new_tokens=7)
    expected = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    got = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, custom_generate=hf_generate
    )
    assert got.tolist() == expected.tolist()


def test_sampling_a_batch_is_refused():
    """A fuzzer found batches of 2 sampled under torch.manual_seed giving other tokens than
    model.generate (33 of 35 cases): transformers draws for every row, finished ones too, once a
    step from the global generator, an order rows accepting several tokens a step cannot keep."""
    model = tiny_model("qwen2")
    ids, mask = padded([[9, 12], [3, 4]])
    with pytest.raises(ConfigError, match="seed=\\[one seed per row\\]"):
        model.generate(
            input_ids=ids, attention_mask=mask, custom_generate=hf_generate, do_sample=True, max_new_tokens=3
        )
    # one prompt's several samples are rows too: the same reason, not "not supported by lookahead"
    with pytest.raises(ConfigError, match="^num_return_sequences=2 with sampling .*seed=\\[one seed per row\\]"):
        model.generate(input_ids=ids[:1], custom_generate=hf_generate, do_sample=True, num_return_sequences=2)
    torch.manual_seed(5)  # one row still samples exactly as transformers does
    expected = model.generate(input_ids=ids[:1], do_sample=True, max_new_tokens=6)
    torch.manual_seed(5)
    got = model.generate(input_ids=ids[:1], do_sample=True, max_new_tokens=6, custom_generate=hf_generate)
    assert got.tolist() == expected.tolist()


def test_batch_level_stopping_criteria_and_streamers_are_refused_on_batches():
    model = tiny_model("qwen2")
    ids, mask = padded([[4, 5, 6], [7, 8]])
    with pytest.raises(ConfigError, match="StopAfter"):
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            custom_generate=hf_generate,
            max_new_tokens=5,
            stopping_criteria=StoppingCriteriaList([StopAfter(9)]),
        )

    class Quiet(Recorder):
        def put(self, value) -> None:  # transformers puts the prompt before calling us; a batch of rows is fine here
            pass

    with pytest.raises(ConfigError, match="streamer"):
        model.generate(
            input_ids=ids, attention_mask=mask, custom_generate=hf_generate, max_new_tokens=5, streamer=Quiet()
        )


def test_called_directly_it_says_how_to_call_it():
    with pytest.raises(ConfigError, match="custom_generate"):
        hf_generate(tiny_model("qwen2"), torch.tensor([[4, 5]]))


@pytest.mark.slow
def test_default_model_fp32_equals_model_generate(default_model_fp32):
    """The bar of the issue: the article's config on the default model gives model.generate's tokens."""
    model, tokenizer = default_model_fp32
    passage = "The budget option sizes each draft from the measured cost of a forward pass and the trie's estimate."
    messages = [{"role": "user", "content": f"{passage}\n\nRepeat the passage above word for word."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = model.generate(**inputs, do_sample=False, max_new_tokens=40)
    got = model.generate(
        **inputs,
        custom_generate=hf_generate,
        generation_config=lookahead(max_new_tokens=40, do_sample=False, return_dict_in_generate=True),
        references=[[passage]],
        lookahead_tokenizer=tokenizer,
    )
    assert got.sequences.tolist() == expected.tolist()
    assert got.lookahead_stats.mean_accepted > 1.5  # the passage was drafted and accepted


def test_a_refused_call_still_ends_its_streamer():
    """transformers puts the prompt into the streamer before calling us; a refusal raised before
    ``end()`` left a ``TextIteratorStreamer`` reader waiting forever (the measured hang)."""
    import threading

    from transformers import TextIteratorStreamer

    model = tiny_model("qwen2")
    streamer = TextIteratorStreamer(tiny_tokenizer(), timeout=30)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            model.generate(
                input_ids=torch.tensor([[4, 5, 6]]),
                custom_generate=hf_generate,
                max_new_tokens=5,
                output_scores=True,  # refused: we keep no scores
                return_dict_in_generate=True,
                streamer=streamer,
            )
        except ConfigError as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    pieces = list(streamer)  # ends once end() is called; without it, queue.Empty after 30 s
    assert all(isinstance(p, str) for p in pieces)
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1 and "output_scores" in str(errors[0])


def test_a_prompt_as_long_as_the_window_is_an_input_error():
    """It said "lower max_new_tokens to at most 0"; the prompt is what is too long."""
    model = tiny_model("qwen2")
    window = model.config.max_position_embeddings
    with pytest.raises(InputError, match=f"^the prompt is {window} tokens and .* context window is {window}"):
        model.generate(
            input_ids=torch.tensor([[4 + i % 7 for i in range(window)]]), custom_generate=hf_generate, max_new_tokens=1
        )
    rows = torch.tensor([[4 + i % 7 for i in range(window)]] * 2)  # a batch: its width is the padded one
    with pytest.raises(InputError, match=f"^the prompts' padded width is {window} tokens"):
        model.generate(input_ids=rows, custom_generate=hf_generate, max_new_tokens=1)


# ---------------------------------------------------------------- arguments transformers does not pass on

PROMPT = torch.tensor([[7, 3, 9, 4, 11, 2, 8]])


@pytest.fixture
def fresh_model():
    return build_tiny_model("qwen2")  # not the cached one: these tests change its generation_config


def _both(model, seed=1, **kw):
    """(model.generate's output, hf_generate's output or the ConfigError it raised)."""
    torch.manual_seed(seed)
    expected = model.generate(input_ids=PROMPT, **kw)
    torch.manual_seed(seed)
    try:
        got = model.generate(input_ids=PROMPT, custom_generate=hf_generate, **kw)
    except ConfigError as err:
        got = err
    return expected, got


@pytest.mark.parametrize("assisted", ["prompt_lookup", "assistant_model"])
def test_assisted_sampling_is_refused(fresh_model, assisted):
    """transformers samples through its assisted decoding when prompt_lookup_num_tokens or an
    assistant_model is given, with other draws than plain sampling; hf_generate never saw either
    argument and returned plain sampling's tokens."""
    extra = dict(prompt_lookup_num_tokens=3) if assisted == "prompt_lookup" else dict(assistant_model=fresh_model)
    expected, got = _both(fresh_model, seed=3, max_new_tokens=12, do_sample=True, **extra)
    assert isinstance(got, ConfigError) and "assisted generation" in str(got), got
    torch.manual_seed(3)
    plain = fresh_model.generate(input_ids=PROMPT, max_new_tokens=12, do_sample=True)
    assert plain.tolist() != expected.tolist()  # (what the old code returned was not transformers' answer)


def test_assisted_greedy_stays_exact(fresh_model):
    expected, got = _both(fresh_model, max_new_tokens=12, prompt_lookup_num_tokens=3)
    assert not isinstance(got, ConfigError) and got.tolist() == expected.tolist()


def test_an_assistant_ensemble_weight_is_refused():
    """With ``assistant_ensemble_weight`` transformers' greedy assisted decoding accepts the argmax of
    a mix of the two models' probabilities, not the model's own tokens; hf_generate answered with
    plain greedy tokens (with prompt lookup, where transformers raises, too)."""
    from rag_lookahead.tiny import build_tiny_model

    model, assistant = build_tiny_model("qwen2"), build_tiny_model("qwen2", seed=1)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    plain = model.generate(ids, max_new_tokens=20, do_sample=False)
    mixed = model.generate(
        ids, max_new_tokens=20, do_sample=False, assistant_model=assistant, assistant_ensemble_weight=0.2
    )
    assert not torch.equal(mixed, plain)  # (what the old code returned was plain greedy)
    for extra in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=3), dict(assistant_early_exit=1)):
        with pytest.raises(ConfigError, match="assistant_ensemble_weight"):
            model.generate(ids, max_new_tokens=20, assistant_ensemble_weight=0.2, custom_generate=hf_generate, **extra)


@pytest.mark.parametrize("assisted", ["prompt_lookup", "assistant_model"])
def test_assisted_generation_on_a_batch_is_refused_as_model_generate_refuses_it(fresh_model, assisted):
    """model.generate raises for assisted generation on two rows; hf_generate decoded them greedily."""
    extra = dict(prompt_lookup_num_tokens=3) if assisted == "prompt_lookup" else dict(assistant_model=fresh_model)
    ids, mask = torch.cat([PROMPT, PROMPT]), torch.ones(2, PROMPT.shape[1], dtype=torch.long)
    with pytest.raises(ValueError, match="batch_size = 1"):
        fresh_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **extra)
    with pytest.raises(ConfigError, match="batch size 1"):
        fresh_model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, custom_generate=hf_generate, **extra
        )


def test_use_mtp_without_mtp_layers_is_refused(fresh_model):
    with pytest.raises(ConfigError, match="num_mtp_layers"):
        fresh_model.generate(input_ids=PROMPT, max_new_tokens=4, use_mtp=True, custom_generate=hf_generate)


def test_synced_gpus_is_refused_though_transformers_does_not_pass_it_on(fresh_model):
    """transformers 5.2x hands a callable custom_generate only the keywords _sample lacks, so
    synced_gpus=True never reached the refusal and ranks in step would have decoded apart."""
    with pytest.raises(ConfigError, match="synced_gpus"):
        fresh_model.generate(input_ids=PROMPT, max_new_tokens=4, synced_gpus=True, custom_generate=hf_generate)


def test_do_sample_none_is_greedy_as_in_model_generate(fresh_model):
    """An explicit do_sample=None makes model.generate greedy; hf_generate refilled do_sample=True from
    the model's generation config and sampled."""
    fresh_model.generation_config.update(do_sample=True, top_k=0)
    expected, got = _both(fresh_model, max_new_tokens=8, do_sample=None)
    assert not isinstance(got, ConfigError), got
    assert got.tolist() == expected.tolist()


QWEN_INSTRUCT = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)


@pytest.mark.parametrize(
    "model_config, call",
    [
        ({}, dict(do_sample=True, top_k=None)),
        (QWEN_INSTRUCT, dict(temperature=None)),
        (QWEN_INSTRUCT, dict(do_sample=False, repetition_penalty=None)),
    ],
)
def test_an_explicit_none_turns_an_option_off_as_in_model_generate(fresh_model, model_config, call):
    """Refused with "logits processors [...] differ from the sampling settings": the None was refilled
    from the model's config or transformers' defaults."""
    fresh_model.generation_config.update(**model_config)
    expected, got = _both(fresh_model, max_new_tokens=8, **call)
    assert not isinstance(got, ConfigError), got
    assert got.tolist() == expected.tolist()


def test_greedy_ignores_a_renormalisation_as_model_generate_does():
    """transformers adds ``LogitNormalization`` to greedy's processors too; it keeps every argmax,
    so greedy decoding ignores it (the README said so; ``hf_generate`` refused it)."""
    model = tiny_model("qwen2")
    ids = torch.tensor([[4, 5, 6, 4, 5, 6, 4]])
    expected = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, renormalize_logits=True)
    got = model.generate(
        input_ids=ids, max_new_tokens=12, do_sample=False, renormalize_logits=True, custom_generate=hf_generate
    )
    assert got.tolist() == expected.tolist()
    with pytest.raises(ConfigError, match="renormalize_logits"):  # sampling: not ours to apply
        model.generate(
            input_ids=ids, max_new_tokens=4, do_sample=True, renormalize_logits=True, custom_generate=hf_generate
        )


def test_right_padding_is_refused_with_advice_that_keeps_the_output():
    """The advice was "pass an all-ones attention_mask", which makes the model attend the pads."""
    model = tiny_model("qwen2")
    ids, mask = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(InputError, match="padding_side = 'left'"):
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, custom_generate=hf_generate
        )


# --- a user's subclass of one of transformers' own criteria or processors is the user's own ---------------

SUBCLASS_PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


class LengthOrToken(MaxLengthCriteria):
    """A maximum length, or stop once ``token`` is generated (the built-in would read as the length only)."""

    def __init__(self, max_length: int, token: int) -> None:
        super().__init__(max_length)
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return super().__call__(input_ids, scores) | (input_ids[:, -1] == self.token)


class EosAfterThree(EosTokenCriteria):
    """EOS counts only once three tokens are generated (the built-in would read as EOS from the first)."""

    def __init__(self, eos_token_id: int, prompt_length: int) -> None:
        super().__init__(eos_token_id)
        self.prompt_length = prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        return super().__call__(input_ids, scores) & (input_ids.shape[-1] >= self.prompt_length + 3)


def _first_new_tokens(model, count: int) -> list[int]:
    plain = model.generate(input_ids=torch.tensor([SUBCLASS_PROMPT]), do_sample=False, max_new_tokens=count)
    return plain[0, len(SUBCLASS_PROMPT) :].tolist()


@pytest.mark.parametrize("kind", ["max_length", "eos"])
def test_a_subclass_of_a_builtin_criterion_is_called_as_the_users_own(kind):
    """Subclasses of MaxLengthCriteria / EosTokenCriteria were read as the built-ins (their length,
    their EOS ids) and their own ``__call__`` never ran: the tokens differed from model.generate's
    (30 tokens past the subclass's stop token; EOS taken at the first token, not after three)."""
    model = tiny_model("qwen2")
    new = _first_new_tokens(model, 30)
    if kind == "max_length":
        criterion = LengthOrToken(len(SUBCLASS_PROMPT) + 30, token=new[9])  # stops well before the length
    else:
        eos = new[0]  # generated first, and again later: the built-in would stop after one token
        criterion = EosAfterThree(eos, len(SUBCLASS_PROMPT))
    call = dict(input_ids=torch.tensor([SUBCLASS_PROMPT]), do_sample=False, max_new_tokens=30)
    expected = model.generate(**call, stopping_criteria=StoppingCriteriaList([criterion]))
    got = model.generate(**call, custom_generate=hf_generate, stopping_criteria=StoppingCriteriaList([criterion]))
    assert got.tolist() == expected.tolist()
    assert len(SUBCLASS_PROMPT) + 1 < expected.shape[1] < len(SUBCLASS_PROMPT) + 30  # the subclass's own stop


@pytest.mark.parametrize("kind", ["max_length", "stop_strings"])
def test_a_subclass_of_a_builtin_criterion_is_refused_on_a_batch(kind):
    """On a batch a user's criterion is refused (it may judge the batch, which rows cut apart at their
    own blocks cannot match); a subclass was taken as the built-in: its length, or row-wise stop strings."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    class StopStringsOfTheBatch(StopStringCriteria):
        """Stops every row once any row ends with a stop string."""

        def __call__(self, input_ids, scores, **kwargs):
            return super().__call__(input_ids, scores).any().expand(input_ids.shape[0])

    criterion = (
        LengthOrToken(9, token=13) if kind == "max_length" else StopStringsOfTheBatch(_pieces_tokenizer(), ["zz"])
    )
    with pytest.raises(ConfigError, match=f"custom stopping criteria \\({type(criterion).__name__}\\)"):
        _two_rows_stopped_by(criterion)


def _banning(base: type, token: int) -> type:
    """A subclass of ``base`` that also bans ``token`` (its settings alone make the built-in change nothing)."""

    def __call__(self, input_ids, scores):
        scores = base.__call__(self, input_ids, scores).clone()
        scores[:, token] = -float("inf")
        return scores

    return type(f"Banning{base.__name__}", (base,), {"__call__": __call__})


@pytest.mark.parametrize(
    "base, arguments, sampling",
    [
        (MinLengthLogitsProcessor, dict(min_length=0, eos_token_id=3), {}),
        (MinNewTokensLengthLogitsProcessor, dict(prompt_length_to_skip=11, min_new_tokens=0, eos_token_id=3), {}),
        (SuppressTokensLogitsProcessor, dict(suppress_tokens=[]), {}),
        (SuppressTokensAtBeginLogitsProcessor, dict(begin_suppress_tokens=[], begin_index=11), {}),
        (LogitNormalization, {}, {}),
        (TemperatureLogitsWarper, dict(temperature=0.7), dict(do_sample=True, temperature=0.7)),
    ],
)
def test_a_subclass_of_a_builtin_processor_is_refused_as_unknown(base, arguments, sampling):
    """Subclasses of processors that change nothing with their settings (a minimum the prompt already
    has, an empty suppression list, greedy's renormalisation) were dropped as the built-ins, their own
    ``__call__`` skipped: other tokens than model.generate's. They are refused, as any processor of
    the user's own is."""
    model = tiny_model("qwen2")
    banned = _first_new_tokens(model, 1)[0]
    processor = _banning(base, banned)(**arguments)
    call = dict(input_ids=torch.tensor([SUBCLASS_PROMPT]), max_new_tokens=8, **({"do_sample": False} | sampling))
    torch.manual_seed(0)
    expected = model.generate(**call, logits_processor=LogitsProcessorList([processor]))
    assert banned not in expected[0, len(SUBCLASS_PROMPT) :].tolist()  # the subclass changes model.generate's tokens
    with pytest.raises(ConfigError, match=f"not supported by lookahead decoding: {type(processor).__name__}"):
        model.generate(**call, custom_generate=hf_generate, logits_processor=LogitsProcessorList([processor]))


@pytest.mark.parametrize("tokenizer", [True, False])
@pytest.mark.parametrize("references", [["t5 t6 t7"], {"q": [["t5 t6 t7"]]}, "t5 t6 t7"])
def test_references_nested_otherwise_say_how_they_nest(references, tokenizer):
    """``references=["text"]`` (one row without its list of passages) with lookahead_tokenizer said
    "references are token ids: encode each passage", though text is taken with the tokenizer; a dict
    got the same message (its keys read as text rows)."""
    with pytest.raises(InputError, match=r"one row: references=\[\[passage\]\]") as refused:
        tiny_model("qwen2").generate(
            input_ids=torch.tensor([[5, 6, 7, 8]]),
            max_new_tokens=3,
            custom_generate=hf_generate,
            references=references,
            lookahead_tokenizer=tiny_tokenizer() if tokenizer else None,
        )
    assert "encode" not in str(refused.value)
    if isinstance(references, dict):
        assert "got dict" in str(refused.value)
