"""LookaheadLLM behaviour on the real default model (small max_new_tokens to keep CPU time down)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
from langchain_core.callbacks import BaseCallbackHandler

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import InputError
from rag_lookahead.langchain.llm import LookaheadLLM

pytestmark = pytest.mark.slow

PASSAGE = (
    "decoding_length 是一次前向计算中最多验证的草稿词元总数，默认值为 64。"
    '在 CPU 上改用 budget="fixed" 时，建议把 decoding_length 设在 8 到 16 左右。'
)
PROMPTS = [
    "List three primary colors, separated by commas.",
    "用一句话介绍北京。",
    f"资料：{PASSAGE}\n问题：在 CPU 上 decoding_length 建议设为多少？请引用原文回答。",
    "Write the numbers from 1 to 10 separated by spaces.",
]


class Collect(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def _default_llm(weights) -> LookaheadLLM:
    model, tokenizer = weights
    return LookaheadLLM(
        model=model,
        tokenizer=tokenizer,
        model_name="default",
        max_new_tokens=24,
        lookahead=LookaheadConfig(budget="fixed", decoding_length=16),
    )


@pytest.fixture(scope="module")
def llm(default_model):
    return _default_llm(default_model)


@pytest.fixture(scope="module")
def singles(llm):
    return [llm.invoke(p) for p in PROMPTS]


def test_batch_equals_single_invokes(llm, singles):
    assert all(s.strip() for s in singles)
    assert llm.batch(PROMPTS) == singles


def test_answer_only_no_prompt(llm, singles):
    assert "List three" not in singles[0] and "<|im_start|>" not in singles[0]


def test_lookahead_on_off_identical(llm, singles):
    assert llm.invoke(PROMPTS[2], enable_lookahead=False) == singles[2]
    assert llm.invoke(PROMPTS[3], enable_lookahead=False, references=["1 2 3 4 5 6 7 8 9 10"]) == singles[3]


def test_stop_honoured_and_excluded(llm, singles):
    text = singles[3]
    stop = " 5"
    assert stop in text
    out = llm.invoke(PROMPTS[3], stop=[stop])
    assert out == text[: text.index(stop)]
    # the stop is cut even when it ends inside a multi-token block, and in the streamed text too
    streamed = "".join(llm.stream(PROMPTS[3], stop=[stop, "never-there"]))
    assert streamed == out
    result = llm.generate([PROMPTS[3]], stop=[stop])
    assert result.generations[0][0].generation_info["stopped_by"] == "stop"
    # the same as a field, as ChatLookahead takes it; a call's own stop list replaces it
    fixed = LookaheadLLM(model=llm.model, tokenizer=llm.tokenizer, model_name="default", max_new_tokens=24, stop=[stop])
    assert fixed.invoke(PROMPTS[3]) == out and "".join(fixed.stream(PROMPTS[3])) == out
    assert fixed.invoke(PROMPTS[3], stop=["never-there"]) == text
    assert fixed._identifying_params["default_stop"] == [stop]  # the LLM cache keeps the two apart


def test_stream_concatenates_to_invoke(llm, singles):
    for prompt, text in zip(PROMPTS[1:3], singles[1:3]):
        chunks = list(llm._stream(prompt))
        assert "".join(c.text for c in chunks) == text
        assert len(chunks) > 2
        assert all("\ufffd" not in c.text for c in chunks)
        assert all(c.generation_info is None for c in chunks[:-1])
        info = chunks[-1].generation_info
        assert info["new_tokens"] > 0 and info["forward_passes"] >= 1 and "tokens_per_second" in info
        assert "".join(llm.stream(prompt)) == text


def test_callbacks_in_invoke_and_stream(llm, singles):
    handler = Collect()
    assert llm.invoke(PROMPTS[1], config={"callbacks": [handler]}) == singles[1]
    assert len(handler.tokens) > 1 and "".join(handler.tokens) == singles[1]
    handler = Collect()
    assert "".join(llm.stream(PROMPTS[1], config={"callbacks": [handler]})) == singles[1]
    assert "".join(handler.tokens) == singles[1]


def test_generation_info_has_stats(llm, singles):
    result = llm.generate(PROMPTS[:2])
    for gens, text in zip(result.generations, singles[:2]):
        info = gens[0].generation_info
        assert gens[0].text == text
        for key in ("new_tokens", "forward_passes", "mean_accepted", "tokens_per_second", "batch_size"):
            assert key in info
        assert info["batch_size"] == 2 and info["new_tokens"] >= 1
    assert result.llm_output["stats"]["rows"] == 2


def test_references_shapes(llm, singles):
    assert llm.invoke(PROMPTS[2], references=[PASSAGE]) == singles[2]  # flat list, one prompt
    assert llm.batch(PROMPTS[:2], references=[[PASSAGE], []]) == singles[:2]
    with pytest.raises(InputError):
        llm.generate(PROMPTS[:2], references=[PASSAGE])
    with pytest.raises(InputError):
        llm.invoke(PROMPTS[0], references=[[PASSAGE], [PASSAGE]])


def test_per_input_references_go_with_their_inputs_into_each_part_of_a_batch(llm, singles):
    """With ``max_concurrency``, or with a bad input set aside under ``return_exceptions``, the
    whole references list reached a part of the batch: every row failed ("references has 3 lists
    but there are 2 prompts")."""
    import asyncio

    references = [[PASSAGE], [], [PASSAGE]]
    parted = {"max_concurrency": 2}
    assert llm.batch(PROMPTS[1:4], parted, references=references) == singles[1:4]
    assert asyncio.run(llm.abatch(PROMPTS[1:4], parted, references=references)) == singles[1:4]
    answers = llm.batch([PROMPTS[2], " ", PROMPTS[3]], return_exceptions=True, references=references)
    assert answers[0] == singles[2] and answers[2] == singles[3] and isinstance(answers[1], InputError)
    with pytest.raises(InputError, match="one list of passages but there are 2 prompts"):  # not one each
        llm.batch(PROMPTS[:2], {"max_concurrency": 1}, references=[PASSAGE])


def test_empty_prompt_is_an_input_error(llm):
    for bad in ("", "   \n"):
        with pytest.raises(InputError, match="empty"):
            llm.invoke(bad)
        with pytest.raises(InputError, match="empty"):
            list(llm.stream(bad))


def test_a_bad_prompt_fails_alone_in_a_batch(llm, singles):
    """BaseLLM decodes a batch in one generate: a blank prompt, or one past the context window,
    failed every row even with return_exceptions=True."""
    import asyncio

    from rag_lookahead.decoding.inputs import context_limit

    too_long = "word " * (context_limit(llm.model) + 10)
    prompts = [PROMPTS[0], "  ", PROMPTS[2], too_long]
    for answers in (
        llm.batch(prompts, return_exceptions=True),
        asyncio.run(llm.abatch(prompts, return_exceptions=True)),
    ):
        assert answers[0] == singles[0] and answers[2] == singles[2]
        assert isinstance(answers[1], InputError) and "empty" in str(answers[1])
        assert isinstance(answers[3], InputError) and "context holds" in str(answers[3])
    with pytest.raises(InputError, match="empty"):  # without return_exceptions: raised, as LangChain does
        llm.batch(prompts)


def test_the_llm_cache_keys_on_each_calls_options(llm):
    """LangChain's LLM cache keys on the model's fields and stop only: a cached 4-token answer came
    back for max_new_tokens=8, and a greedy one for a seeded sample."""
    from langchain_core.caches import InMemoryCache

    cache = InMemoryCache()
    cached = llm.model_copy(update={"cache": cache})
    short = cached.invoke(PROMPTS[3], max_new_tokens=4)
    longer = cached.invoke(PROMPTS[3], max_new_tokens=8)
    assert longer == llm.invoke(PROMPTS[3], max_new_tokens=8) and longer != short
    assert cached.invoke(PROMPTS[3], max_new_tokens=4) == short and len(cache._cache) == 2  # a hit, no new entry
    cached.invoke(PROMPTS[3], max_new_tokens=4, temperature=0.9, seed=1)
    assert len(cache._cache) == 3
    assert "call_options" not in llm._identifying_params  # only while a call reads them


def test_identifying_params_and_serialization(llm):
    assert llm._llm_type == "rag_lookahead"
    params = dict(llm._identifying_params)
    assert params == {
        "model_name": "default",
        "max_new_tokens": 24,
        "system_prompt": None,
        "default_stop": None,
        "weights": params["weights"],
        "prompt_format": params["prompt_format"],
    }
    assert len(params["weights"]) == 16  # a digest of the weights: two models of one name stay apart
    dumped = llm.model_dump()
    assert "model" not in dumped and "tokenizer" not in dumped
    other = LookaheadLLM(
        model=llm.model,
        tokenizer=llm.tokenizer,
        model_name="default",
        max_new_tokens=24,
        lookahead=LookaheadConfig(decoding_length=8),
    )
    assert other._identifying_params == llm._identifying_params  # draft settings share the LLM cache
    assert other.output_pool is not llm.output_pool


def test_sampling_with_a_seed_is_reproducible_and_lossless(default_model_fp32):
    # fp32, where lossless is promised: in bf16 a verify forward's shape may change the rounding
    # (on CPUs with AVX512-BF16 and no AMX, bf16 rows above 16 are summed by another kernel)
    llm = _default_llm(default_model_fp32)
    prompt = PROMPTS[2]
    first = llm.invoke(prompt, temperature=0.8, top_p=0.9, seed=7)
    assert llm.invoke(prompt, temperature=0.8, top_p=0.9, seed=7) == first
    assert llm.invoke(prompt, temperature=0.8, top_p=0.9, seed=7, enable_lookahead=False) == first
    # each row of a batch draws from its own generator: the same text as alone
    assert llm.batch([prompt, PROMPTS[0]], temperature=0.8, top_p=0.9, seed=7)[0] == first


def test_a_seedless_sample_draws_nothing_past_its_stop_string(default_model_fp32):
    """Without a seed a sampled row draws from torch's global generator, as transformers does; a
    block was drawn whole and then cut at the stop string, so the draws past the cut moved the
    generator and the caller's next sample differed from what one-token-a-step decoding leaves."""
    import torch

    llm = _default_llm(default_model_fp32)
    prompt, options = PROMPTS[2], {"temperature": 0.3, "max_new_tokens": 32}
    torch.manual_seed(11)
    whole = llm.generate([prompt], **options).generations[0][0]
    assert whole.generation_info["mean_accepted"] > 2  # blocks of several draws, so a cut can fall inside one
    stop = whole.text[len(whole.text) // 3 :][:2]
    after = {}
    for lookahead in (False, True):  # off: one draw a step, the draws model.generate makes
        torch.manual_seed(11)
        text = llm.invoke(prompt, stop=[stop], enable_lookahead=lookahead, **options)
        after[lookahead] = (text, torch.rand(4).tolist())
    assert after[True] == after[False] and after[True][0] == whole.text[: whole.text.find(stop)]


def test_sampling_fields_and_bad_values(default_model):
    model, tokenizer = default_model
    hot = LookaheadLLM(model=model, tokenizer=tokenizer, max_new_tokens=8, temperature=1.0, seed=3)
    assert hot._identifying_params["temperature"] == 1.0
    assert hot.invoke(PROMPTS[0]) == hot.invoke(PROMPTS[0])
    from rag_lookahead.errors import ConfigError

    with pytest.raises(ValueError, match="top_p must be a number"):  # pydantic wraps the ConfigError
        LookaheadLLM(model=model, tokenizer=tokenizer, temperature=0.7, top_p=1.7)
    # greedy too: a warper kept for later calls was taken and refused only at the first sampled call
    from rag_lookahead.langchain.chat_model import ChatLookahead

    bad = {"top_p": 1.5, "top_k": -2, "min_p": 5.0}
    for name, value in bad.items():
        with pytest.raises(ConfigError, match=f"{name} must be"):
            LookaheadLLM(model=model, tokenizer=tokenizer, **{name: value})
        with pytest.raises(ConfigError, match=f"{name} must be"):
            ChatLookahead(model=model, tokenizer=tokenizer, **{name: value})
        with pytest.raises(ConfigError, match=f"{name} must be"):
            hot.invoke(PROMPTS[0], temperature=0, **{name: value})
    with pytest.raises(ConfigError, match="unknown option"):
        hot.invoke(PROMPTS[0], temprature=0.5)
    # at construction too: a misspelt or foreign setting was dropped in silence (greedy text)
    for extra in ({"temprature": 0.5}, {"max_tokens": 3}, {"model_kwargs": {"temperature": 1.5}}):
        with pytest.raises(ConfigError, match=f"invalid LookaheadLLM setting {next(iter(extra))}"):
            LookaheadLLM(model=model, tokenizer=tokenizer, **extra)
    with pytest.raises(ConfigError, match="invalid LookaheadLLM setting stop"):
        LookaheadLLM(model=model, tokenizer=tokenizer, stop="three")
    # tools and structured output belong to the chat model: said so (an empty message, an AttributeError)
    with pytest.raises(NotImplementedError, match="ChatLookahead.from_llm"):
        hot.bind_tools([])
    with pytest.raises(NotImplementedError, match="ChatLookahead.from_llm"):
        hot.with_structured_output({"type": "object"})
    # per call as at construction: 0 tokens is refused (it was read as "not given"), a bare string
    # is not a list of stop strings (it was split into characters)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        hot.invoke(PROMPTS[0], max_new_tokens=0)
    with pytest.raises(ConfigError, match="stop must be a list of strings"):
        hot.invoke(PROMPTS[0], stop="three")
    with pytest.raises(ConfigError, match="stop must be a list of strings"):
        hot.batch(PROMPTS[:2], stop=(s for s in ["three"]))  # read once: the second row had no stop


def test_tokenizer_without_pad_is_left_untouched(default_model, llm):
    import copy

    model, tokenizer = default_model
    bare = copy.deepcopy(tokenizer)
    bare.pad_token = None
    padless = LookaheadLLM(
        model=model, tokenizer=bare, max_new_tokens=4, lookahead=LookaheadConfig(budget="fixed", decoding_length=16)
    )
    assert bare.pad_token is None  # the caller's tokenizer is not written to
    # rows of different lengths still pad (with an EOS id) and answer as they do alone
    prompts = [PROMPTS[0], PROMPTS[2]]
    assert padless.batch(prompts) == [llm.invoke(p, max_new_tokens=4) for p in prompts]
    assert bare.pad_token is None


@contextlib.contextmanager
def transformers_warnings() -> Iterator[list[str]]:
    """The messages transformers logs meanwhile (its logger does not propagate to pytest's)."""

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    records = Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        yield records.messages
    finally:
        logging.getLogger("transformers").removeHandler(records)


def _fresh_tokenizer():
    """The default model's tokenizer loaded afresh: transformers warns once per tokenizer."""
    from transformers import AutoTokenizer

    from rag_lookahead.models import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def test_a_prompt_past_the_context_is_refused_in_our_words_only(default_model):
    """A question past the context got transformers' "Token indices sequence length is longer than
    the specified maximum" warning before our one-line refusal (``batch_answers`` printed both)."""
    model, _ = default_model
    llm = LookaheadLLM(model=model, tokenizer=_fresh_tokenizer(), max_new_tokens=4)
    with transformers_warnings() as messages:
        with pytest.raises(InputError, match="the input has .* tokens but the model's context holds"):
            llm.invoke("word " * 33_000)
    assert not [m for m in messages if "sequence length is longer" in m]


def test_a_passage_longer_than_the_context_seeds_drafts_without_a_warning(default_model):
    """A reference passage only seeds drafts, and its length is no error: transformers' "will result
    in indexing errors" warning was printed for it (and for ``get_num_tokens`` of a long text)."""
    import torch

    from rag_lookahead import hf_generate

    model, tokenizer = default_model
    short_limit = _fresh_tokenizer()
    short_limit.model_max_length = 64  # what transformers warns past; the model's context is not read for passages
    llm = LookaheadLLM(model=model, tokenizer=short_limit, max_new_tokens=2)
    long_text = "word " * 100
    with transformers_warnings() as messages:
        assert llm.get_num_tokens(long_text) > 64
        llm.invoke("Say hi.", references=[long_text])
    assert not [m for m in messages if "sequence length is longer" in m]
    ids = torch.tensor([tokenizer.encode("Say hi.")])
    with transformers_warnings() as messages:  # transformers' entry, text passages with lookahead_tokenizer
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=2,
            custom_generate=hf_generate,
            references=[[long_text]],
            lookahead_tokenizer=short_limit,
        )
    assert not [m for m in messages if "sequence length is longer" in m]
