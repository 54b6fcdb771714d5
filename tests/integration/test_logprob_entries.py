"""The server's log-probability entries, on tokenizers of several kinds: a stream's chunks carry
exactly the whole answer's entries (none of a stop string's start, whatever the blocks), and the
tokens' names and bytes spell the answer (sentencepiece's "▁word" and WordPiece's "##ing" too)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_text_tracker import _byte_fallback_tokenizer

from rag_lookahead.decoding.results import TokenLogprob
from rag_lookahead.serve.jobs import Answer
from rag_lookahead.serve.logprobs import AnswerLogprobs, LogprobFormat
from rag_lookahead.tokens import TextTracker


def _wordpiece_tokenizer():
    """BERT-style: words split on whitespace, "##" pieces inside a word, decoded with spaces between words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[SEP]": 1}
    for piece in ["run", "walk", "the", "a", "cat", "我", "们", "é"] + list("abcdefgh"):
        vocab.setdefault(piece, len(vocab))
        vocab.setdefault("##" + piece, len(vocab))
    vocab.update({"##ning": len(vocab), "##ed": len(vocab) + 1})
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[SEP]")


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    from rag_lookahead.models import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


_TOKENIZERS = {"byte-fallback": _byte_fallback_tokenizer, "wordpiece": _wordpiece_tokenizer}


def _entries(ids):
    return [TokenLogprob(t, -0.5 - i, ((t, -0.5 - i),)) for i, t in enumerate(ids)]


def _stream(tokenizer, ids, stops, cuts):
    """Run ``ids`` through a job's tracker and recorder in blocks ending at ``cuts``, as the engine
    does: (the entries the pieces carried, the answer's entries and those no piece carried)."""
    tracker = TextTracker(tokenizer, stops, frozenset({tokenizer.eos_token_id}))
    recorder, streamed, start = AnswerLogprobs(1), [], 0
    for end in [*cuts, len(ids)]:
        if end > start and not tracker.stopped:
            recorder.entries.extend(_entries(ids)[start:end])
            if tracker.add(ids[start:end]):
                streamed.extend(recorder.for_piece(tracker))
        start = end
    answer = Answer(tracker.final_text(), tracker.rest(), "stop", 0, len(tracker.ids), 0, 0.0, 0.0, True)
    answer = recorder.complete(answer, tracker)
    return streamed, answer


_QWEN_TEXT = st.text(st.sampled_from(list("ab xy,.") + list("原告签订了") + ["🙂"]), min_size=1, max_size=30)


@settings(max_examples=120, deadline=None)
@given(text=_QWEN_TEXT, data=st.data())
def test_streamed_entries_are_the_answers_whatever_the_blocks(qwen_tokenizer, text, data):
    """A block ending inside a stop string's start sent that start's entries, which the whole
    answer (cut at the stop a later block completed) does not hold."""
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    start = data.draw(st.integers(0, len(text) - 1))
    stops = [text[start : start + data.draw(st.integers(1, 4))] + data.draw(st.sampled_from(["", "x", "了"]))]
    cuts = sorted(data.draw(st.lists(st.integers(1, max(len(ids) - 1, 1)), max_size=6)))
    streamed, answer = _stream(qwen_tokenizer, ids, stops, cuts)
    assert streamed + list(answer.unsent_logprobs) == list(answer.logprobs)
    # one token a step keeps the same entries
    assert answer.logprobs == _stream(qwen_tokenizer, ids, stops, list(range(1, len(ids))))[1].logprobs


def test_a_held_back_stop_start_sends_no_entries(qwen_tokenizer):
    ids = qwen_tokenizer.encode("the cat sat. the end", add_special_tokens=False)
    stop = qwen_tokenizer.decode(ids[-2:-1]) + "!"  # " the" then something that never comes
    tracker = TextTracker(qwen_tokenizer, [stop], frozenset())
    recorder = AnswerLogprobs(0)
    recorder.entries.extend(_entries(ids[:-1]))
    assert tracker.add(ids[:-1]) == qwen_tokenizer.decode(ids[:-2])
    assert [e.token for e in recorder.for_piece(tracker)] == ids[:-2]  # " the" waits with its text
    recorder.entries.extend(_entries(ids)[-1:])
    assert tracker.add(ids[-1:])
    assert [e.token for e in recorder.for_piece(tracker)] == ids[-2:]


def _names(tokenizer, ids, cuts=()):
    """Completion and chat names of ``ids``' entries, whole or streamed in chunks ending at ``cuts``."""
    entries, form, chunks, start = _entries(ids), LogprobFormat(tokenizer), [], 0
    for end in [*cuts, len(ids)]:
        chunks.append(form.completion(entries[start:end], streamed=bool(cuts)))
        start = end
    chat = LogprobFormat(tokenizer).chat(entries)
    tokens = sum((c.tokens for c in chunks), [])
    offsets = sum((c.text_offset for c in chunks), [])
    return tokens, offsets, chat


@pytest.mark.parametrize("kind", sorted(_TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(["a", "bc", "run", "running", "walked", "the", "cat", "我们", "hé"]), min_size=1))
def test_token_names_spell_the_answer(kind, words):
    """Named alone, "▁cat" read "cat" and "##ning" read "##ning": the names missed the answer's
    spaces, offsets pointed at the wrong characters and the bytes held no 0x20."""
    tokenizer = _TOKENIZERS[kind]()
    text = " ".join(words)
    ids = tokenizer.encode(text, add_special_tokens=False)
    answer = tokenizer.decode(ids, skip_special_tokens=True)
    tokens, offsets, chat = _names(tokenizer, ids)
    assert b"".join(bytes(c.bytes) for c in chat.content) == answer.encode()
    if all(ord(c) < 128 for c in text):  # a byte token is named "�": only ASCII answers read whole
        assert "".join(tokens) == answer == "".join(c.token for c in chat.content)
        assert all(answer[o : o + len(t)] == t for t, o in zip(tokens, offsets))
    # a stream names its chunks' tokens as the whole answer does, wherever the chunks end
    assert _names(tokenizer, ids, cuts=range(1, len(ids)))[:2] == (tokens, offsets)
    # each entry's top token is the token itself (see _entries): named in the same context
    assert all([t.token for t in c.top_logprobs] == [c.token] for c in chat.content)


def test_byte_level_names_keep_their_bytes(qwen_tokenizer):
    """Qwen's tokens are named alone, with the raw bytes of a token that holds part of a character."""
    ids = qwen_tokenizer.encode("原告 签订 🙂 the cat", add_special_tokens=False)
    tokens, _, chat = _names(qwen_tokenizer, ids)
    assert tokens == [qwen_tokenizer.decode([t]) for t in ids]
    assert b"".join(bytes(c.bytes) for c in chat.content) == "原告 签订 🙂 the cat".encode()


@pytest.mark.parametrize("low", [-20000.0, float("-inf")])
def test_logprobs_below_openais_floor_read_minus_9999(qwen_tokenizer, low):
    """OpenAI's floor: a token the model all but rules out (or a sampler masked) reads -9999.0, in
    chat and completion entries and their top lists alike, so the JSON holds no -Infinity."""
    token = qwen_tokenizer.encode(" cat", add_special_tokens=False)[0]
    entry = TokenLogprob(token, low, ((token, low),))
    chat = LogprobFormat(qwen_tokenizer).chat([entry])
    assert chat.content[0].logprob == -9999.0 and [t.logprob for t in chat.content[0].top_logprobs] == [-9999.0]
    completion = LogprobFormat(qwen_tokenizer).completion([entry])
    assert completion.token_logprobs == [-9999.0] and completion.top_logprobs == [{" cat": -9999.0}]
    assert "Infinity" not in chat.model_dump_json() + completion.model_dump_json()
