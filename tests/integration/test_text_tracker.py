"""TextTracker, the one place accepted token blocks become text: what it keeps and emits must not
depend on how many tokens each step accepted (lookahead's blocks against one token a step), on the
default model's byte-level tokenizer, where a character may span tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_lookahead.tokens import TextTracker

_TEXT = st.text(
    st.sampled_from(list("abc xyz,.\n") + list("原告被告合同签订的了") + ["é", "🙂", "—", "\u3000"]),
    min_size=1,
    max_size=40,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rag_lookahead.models import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def _run(tokenizer, ids, stops, cuts):
    """Feed ``ids`` in blocks ending at ``cuts``; what the client saw, and the tracker."""
    tracker = TextTracker(tokenizer, stops, frozenset({tokenizer.eos_token_id}))
    pieces, start = [], 0
    for end in [*cuts, len(ids)]:
        if end > start:
            pieces.append(tracker.add(ids[start:end]))
            start = end
    pieces.append(tracker.rest())
    return "".join(pieces), tracker


@settings(max_examples=150, deadline=None)
@given(text=_TEXT, stop_at=st.tuples(st.integers(0, 40), st.integers(1, 4)), data=st.data())
def test_blocks_give_the_text_and_token_count_of_one_token_a_step(tokenizer, text, stop_at, data):
    ids = tokenizer.encode(text, add_special_tokens=False)
    start, length = stop_at
    stops = [text[start : start + length]] if text[start : start + length] else []
    stops += data.draw(st.lists(st.sampled_from(["合同", "z,", "\n", "🙂", "qq"]), max_size=2))
    cuts = sorted(data.draw(st.lists(st.integers(1, max(len(ids) - 1, 1)), max_size=6)))
    one_by_one, single = _run(tokenizer, ids, stops, list(range(1, len(ids))))
    blocks, tracker = _run(tokenizer, ids, stops, cuts)
    assert blocks == one_by_one == single.final_text()
    assert tracker.stopped == single.stopped
    # a stopped row counts the tokens up to the one that completed the stop string, whatever the blocks
    assert tracker.ids == single.ids
    if single.stopped:  # the last token kept is the one that completed a stop string
        kept = len(single.ids)
        assert _stop_in(single, kept, stops) and not _stop_in(single, kept - 1, stops)
    else:
        assert single.ids == ids


def _stop_in(tracker, count, stops):
    return any(s in tracker.text(count) for s in stops)


@settings(max_examples=60, deadline=None)
@given(
    text=_TEXT,
    stop=_TEXT.map(lambda s: s[:6]),
    taken=st.integers(0, 60),
    drawn=st.integers(1, 12),
)
def test_would_stop_reads_the_tail_as_the_whole_text_reads(tokenizer, text, stop, taken, drawn):
    """``would_stop`` decodes only the tail a stop string can lie in (the whole answer at every draw
    grew with its square); it must agree with the whole text, where a character spans tokens."""
    ids = tokenizer.encode(text * 4, add_special_tokens=False)
    taken = min(taken, len(ids) - 1)
    before, block = ids[:taken], ids[taken : taken + drawn]
    tracker = TextTracker(tokenizer, [stop], frozenset({tokenizer.eos_token_id}))
    tracker.add(before)
    if tracker.stopped:
        return
    whole = tokenizer.decode(before + block)
    assert tracker.would_stop(block) == (stop in whole)


#: words joined by spaces (BERT-style), or pieces joined as they are (byte-level BPE style), so
#: that a clean-up pattern can span two tokens or four (" n", "'", "t")
CLEANED_WORDS = ["<pad>", "<eos>", "a", "b", "c", "'", ",", ".", "n't", "'s", "?", "!"]
CLEANED_PIECES = ["<pad>", "<eos>", "I", " do", " n", "'", "t", " ", "r", "e", "m", "s", "v", ".", "?", ","]


def _cleaning_tokenizer(words):
    """A tokenizer with transformers' clean-up on: decode([a, "'", b]) is "a'b", but
    decode([a, "'"]) is "a '"; decode of " n", "'", "t" is "n't"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    if words is CLEANED_WORDS:
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        core.decoder = decoders.WordPiece(prefix="##")
    else:
        core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", clean_up_tokenization_spaces=True
    )


@pytest.mark.parametrize("words", [CLEANED_WORDS, CLEANED_PIECES], ids=["words", "pieces"])
@settings(max_examples=150, deadline=None)
@given(picks=st.lists(st.integers(2, 100), min_size=1, max_size=30), data=st.data())
def test_a_decode_that_cleans_up_spaces_streams_the_whole_text(words, picks, data):
    """A later token can rewrite the text before it (" ' " becomes "'", " n" "'" "t" becomes
    "n't"); everything after the first such rewrite was lost from the stream."""
    tokenizer = _cleaning_tokenizer(words)
    ids = [2 + p % (len(words) - 2) for p in picks]
    cuts = sorted(data.draw(st.lists(st.integers(1, max(len(ids) - 1, 1)), max_size=8)))
    for blocks in (cuts, list(range(1, len(ids)))):
        streamed, tracker = _run(tokenizer, ids, [], blocks)
        assert streamed == tracker.final_text() == tokenizer.decode(ids)
