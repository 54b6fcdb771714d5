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
    stops += data.draw(st.lists(st.sampled_from(["合同", "z,", "\n", "🙂", "qq", "\ufffd"]), max_size=2))
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
    """``would_stop`` must agree with the whole text, where a character spans tokens."""
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


def _byte_fallback_tokenizer():
    """Llama-2/Mistral's decoder over a vocabulary of letters and the 256 byte tokens: a run of
    ``<0x..>`` tokens that is not valid UTF-8 decodes to one U+FFFD per byte, the characters
    already whole in it included, so a later byte rewrites text decoded before it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3}
    for letter in "abcdefgh":
        vocab[letter] = len(vocab)
        vocab["\u2581" + letter] = len(vocab)
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    core.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _check_any_blocks(tokenizer, ids, stops, cuts):
    """What every front end relies on, whatever the tokenizer: the stream is the final text, the
    blocks change nothing (text, ids kept, stopped), no stop string is emitted, and ``would_stop``
    says what ``add`` then does."""
    eos = frozenset({tokenizer.eos_token_id})
    results = []
    for blocks in (cuts, list(range(1, len(ids)))):
        tracker, pieces, start = TextTracker(tokenizer, stops, eos), [], 0
        for end in [*blocks, len(ids)]:
            if end > start and not tracker.stopped:
                # a sampled row asks after each draw, and draws no more once told to stop
                asked = next((j for j in range(1, end - start + 1) if tracker.would_stop(ids[start : start + j])), None)
                taken = len(tracker.ids)
                pieces.append(tracker.add(ids[start:end]))
                assert tracker.stopped == (asked is not None)
                assert asked is None or len(tracker.ids) == taken + asked
            start = end
        emitted = "".join(pieces)
        assert not any(s in emitted for s in stops)
        assert emitted + tracker.rest() == tracker.final_text()
        results.append((tracker.final_text(), tracker.ids, tracker.stopped))
    assert results[0] == results[1]
    return results[0]


_BYTE_TEXT = st.text(st.sampled_from(list("abc ") + list("我们好原告") + ["é", "🙂"]), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    text=_BYTE_TEXT, stray=st.lists(st.tuples(st.integers(0, 60), st.integers(0x80, 0xFF)), max_size=2), data=st.data()
)
def test_byte_fallback_runs_stream_their_final_text_whatever_the_blocks(text, stray, data):
    """A byte after a whole character made the stream stall for good: '我' was emitted, then the
    text decoded to '����' and nothing more (nor the rest of the answer) reached the client. A
    stop string completed inside a byte run was matched on text a later byte rewrote."""
    tokenizer = _byte_fallback_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    for at, byte in stray:  # a sampled model may draw a lone byte anywhere
        ids.insert(min(at, len(ids)), tokenizer.convert_tokens_to_ids(f"<0x{byte:02X}>"))
    stops = data.draw(st.lists(st.sampled_from(["们", "好原", "a", "\ufffd", "c 我"]), max_size=2))
    cuts = sorted(data.draw(st.lists(st.integers(1, max(len(ids) - 1, 1)), max_size=6)))
    final, kept, stopped = _check_any_blocks(tokenizer, ids, stops, cuts)
    if not stopped:
        assert final == tokenizer.decode(ids) if not stops else kept == ids


def test_a_stray_byte_after_a_whole_character_loses_no_text():
    tokenizer = _byte_fallback_tokenizer()
    ids = tokenizer.encode("\u2581我", add_special_tokens=False)
    ids += [tokenizer.convert_tokens_to_ids("<0xE4>"), *tokenizer.encode(" and", add_special_tokens=False)]
    streamed, tracker = _run(tokenizer, ids, [], list(range(1, len(ids))))
    assert streamed == tracker.final_text() == tokenizer.decode(ids)
    assert streamed.endswith("and")


@pytest.mark.parametrize("words", [CLEANED_WORDS, CLEANED_PIECES], ids=["words", "pieces"])
@settings(max_examples=150, deadline=None)
@given(picks=st.lists(st.integers(2, 100), min_size=1, max_size=30), data=st.data())
def test_stops_on_text_a_clean_up_rewrites_do_not_depend_on_the_blocks(words, picks, data):
    """Stop " '" was matched on "I don '" one token a step (the text then read "I don't"), but
    not when "'" and "t" came in one block: the answer depended on how many tokens a step accepted."""
    tokenizer = _cleaning_tokenizer(words)
    ids = [2 + p % (len(words) - 2) for p in picks]
    stops = data.draw(st.lists(st.sampled_from([" '", "'", "n't", " n", "a '", "?", " ."]), min_size=1, max_size=2))
    cuts = sorted(data.draw(st.lists(st.integers(1, max(len(ids) - 1, 1)), max_size=8)))
    _check_any_blocks(tokenizer, ids, stops, cuts)


def test_a_stop_on_text_the_clean_up_rewrites_is_matched_as_one_token_a_step_sees_it():
    """ "a '" holds the stop " '" until "b" makes it "a'b": one token a step stopped there, a
    block of "'" and "b" did not, so the answer depended on how many tokens a step accepted."""
    tokenizer = _cleaning_tokenizer(CLEANED_WORDS)
    ids = [CLEANED_WORDS.index(w) for w in ("a", "'", "b")]
    assert _check_any_blocks(tokenizer, ids, [" '"], [2]) == ("a", ids[:2], True)


def test_a_stop_completed_by_the_last_token_taken_ends_the_row_there():
    """Stops were sought in settled text only, so one a byte run or the clean-up might still
    rewrite (Llama-2's newline is the byte token <0x0A>) was seen a token late, or never when it
    was the row's last: the text was cut but the answer said "length" and counted the tokens past."""
    tokenizer = _byte_fallback_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "<0x0A>")]
    tracker = TextTracker(tokenizer, ["\n"], frozenset({tokenizer.eos_token_id}))
    assert not tracker.would_stop(ids[:2]) and tracker.would_stop(ids)
    pieces = [tracker.add([t]) for t in ids]
    assert tracker.stopped and tracker.ids == ids and "".join(pieces) + tracker.rest() == "ab"


def test_a_clean_up_flag_transformers_ignores_does_not_hold_text_back(tokenizer):
    """Llama 3's tokenizer config sets clean_up_tokenization_spaces, which transformers 5 ignores
    for BPE tokenizers: the last token's text was held back as if a clean-up could rewrite it."""
    from transformers import AutoTokenizer

    flagged = AutoTokenizer.from_pretrained(tokenizer.name_or_path, clean_up_tokenization_spaces=True)
    ids = flagged.encode("Hello world. Answer: 42", add_special_tokens=False)
    tracker = TextTracker(flagged, [" 42"], frozenset({flagged.eos_token_id}))
    assert not tracker.cleans_up
    pieces = [tracker.add([t]) for t in ids]
    assert tracker.stopped and tracker.ids == ids and "".join(pieces) == "Hello world. Answer:"


def test_logprobs_of_a_stopped_row_cover_its_text_where_a_byte_run_shrinks_it():
    """The answer's token count was bisected over the text's length, which a byte run that is
    not yet whole makes shrink (5, 4, 7, 8, 5 characters): 'ab 我' got the logprobs of 'ab ��'."""
    from rag_lookahead.serve.logprobs import _tokens_for_text

    tokenizer = _byte_fallback_tokenizer()
    ids = tokenizer.encode("ab 我们cd", add_special_tokens=False)
    tracker = TextTracker(tokenizer, ["们"], frozenset({tokenizer.eos_token_id}))
    for token in ids:
        tracker.add([token])
    kept = _tokens_for_text(tracker, len(tracker.ids))
    assert tracker.final_text() == "ab 我" == tokenizer.decode(tracker.ids[:kept])
    assert tokenizer.decode(tracker.ids[: kept - 1]) != "ab 我"


def _stream(tokenizer, ids, stops=None):
    tracker = TextTracker(tokenizer, stops, frozenset({tokenizer.eos_token_id}))
    pieces = [tracker.add([t]) for t in ids]
    return "".join(pieces) + tracker.rest(), tracker


def test_a_dropped_control_token_inside_a_byte_run_does_not_end_it():
    """A special token ``all_special_ids`` does not list (an added control token) ended the byte
    run, though decode joins the bytes across it: '我' was streamed, then a lone byte turned the
    whole run into U+FFFDs."""
    from tokenizers import AddedToken

    tokenizer = _byte_fallback_tokenizer()
    tokenizer.add_tokens([AddedToken("[CTL]", special=True)])
    byte = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE6, 0x88, 0x91, 0xE4)]
    ids = [*byte[:3], tokenizer.convert_tokens_to_ids("[CTL]"), byte[3], tokenizer.convert_tokens_to_ids("b")]
    streamed, tracker = _stream(tokenizer, ids)
    assert streamed == tracker.final_text() == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("words", [["I", " ", " ", "'", " ", "s"], [" ", " ", "'", " ", "s"]])
def test_a_clean_up_that_rewrites_a_run_of_spaces_and_quotes_is_not_streamed_early(words):
    """The clean-up's replacements run one after another (" ' " -> "'", then " 's" -> "'s"): one
    token rewrote text two tokens back, and the stream read 'I s' for "I's"."""
    tokenizer = _cleaning_tokenizer(CLEANED_PIECES)
    ids = [CLEANED_PIECES.index(w) for w in words]
    streamed, tracker = _stream(tokenizer, ids)
    assert streamed == tracker.final_text() == tokenizer.decode(ids)


def test_logprobs_of_a_stopped_row_reach_past_tokens_that_add_no_text():
    from rag_lookahead.serve.logprobs import _tokens_for_text

    tokenizer = _byte_fallback_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("\u2581a", "b", *["<unk>"] * 12, "c")]
    _, tracker = _stream(tokenizer, ids, ["bc"])
    assert tracker.stopped and tracker.final_text() == "a"
    assert _tokens_for_text(tracker, len(tracker.ids)) == 1
