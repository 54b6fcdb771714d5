"""The on-disk cache of BM25's words: it returns exactly what ``tokenize`` returns, and only saves time."""

from __future__ import annotations

import hashlib
import os
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_lookahead.rag import lexical, token_cache

TEXTS = [
    "原告与被告签订了房屋租赁合同，约定租金每月三千元。",
    "The branch_length option bounds each draft branch.",
    "",
    "被告辩称：原告主张的利息过高。Interest 24%",
]

# scripts and separators a chunk may hold, including characters str.splitlines() would split on
_ALPHABET = st.sampled_from(
    list(string.ascii_letters + string.digits + "_ .,;:!?-\n\t")
    + list("的了是在原告被告合同签订租金利息法院判决")
    + ["\u2028", "\x1c", "\x85", "é", "ß", "Ж", "한", "ア", "🙂", "\u3000", "，", "。"]
)


def _cut(texts):
    return [lexical.tokenize(t) for t in texts]


def _files(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _rechecked(change):
    """A damage to the file's body with its checksum line rewritten to match."""

    def damage(text):
        body = change(text.partition("\n")[2])
        return token_cache._HEADER + hashlib.sha256(body.encode("utf-8")).hexdigest() + "\n" + body

    return damage


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(_ALPHABET, max_size=60), min_size=1, max_size=6))
def test_words_read_back_are_the_words_cut(tmp_path_factory, texts):
    folder = tmp_path_factory.mktemp("bm25")
    first = token_cache.cached_tokens(texts, folder, min_chunks=1)
    assert first == _cut(texts)
    assert len(_files(folder)) == 1
    assert token_cache.cached_tokens(texts, folder, min_chunks=1) == first


def test_a_second_read_does_not_cut_and_another_corpus_misses(tmp_path, monkeypatch):
    first = token_cache.cached_tokens(TEXTS, tmp_path, min_chunks=1)
    other = TEXTS[:-1] + ["被告辩称：原告主张的利息过高。Interest 25%"]
    expected = _cut(other)
    real = lexical.tokenize
    calls = []
    monkeypatch.setattr(lexical, "tokenize", lambda t: calls.append(t) or real(t))
    assert token_cache.cached_tokens(TEXTS, tmp_path, min_chunks=1) == first
    assert calls == []  # read back, not cut
    assert token_cache.cached_tokens(other, tmp_path, min_chunks=1) == expected
    assert len(calls) == len(other) and len(_files(tmp_path)) == 2


@settings(max_examples=80, deadline=None)
@given(st.lists(st.text(st.sampled_from(["a", "b", " ", "\0", "词"]), max_size=6), min_size=2, max_size=4), st.data())
def test_texts_that_join_alike_do_not_share_a_file(tmp_path_factory, texts, data):
    """The key joined the texts with "\0": ["alpha\0bravo", "charlie"] and ["alpha", "bravo\0charlie"]
    made the same key, and an edited chunk was searched with the words of the old one (a chunk
    holds "\0" where a file has one past the 8 KB that binary detection reads)."""
    folder = tmp_path_factory.mktemp("bm25")
    token_cache.cached_tokens(texts, folder, min_chunks=1)
    cut = data.draw(st.integers(min_value=0, max_value=len(texts) - 2))
    joined = texts[cut] + "\0" + texts[cut + 1]  # split again at any "\0": the same bytes, joined so
    at = data.draw(st.sampled_from([n for n, c in enumerate(joined) if c == "\0"]))
    other = [*texts[:cut], joined[:at], joined[at + 1 :], *texts[cut + 2 :]]
    assert token_cache.cached_tokens(other, folder, min_chunks=1) == _cut(other)


def test_the_reported_collision_misses(tmp_path):
    token_cache.cached_tokens(["kilo lima mike alpha\0bravo", "charlie"], tmp_path, min_chunks=1)
    other = ["kilo lima mike alpha", "bravo\0charlie"]
    assert token_cache.cached_tokens(other, tmp_path, min_chunks=1) == _cut(other)


def test_a_small_corpus_is_cut_without_a_file(tmp_path):
    assert token_cache.cached_tokens(TEXTS, tmp_path, min_chunks=len(TEXTS) + 1) == _cut(TEXTS)
    assert _files(tmp_path) == []


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s[: len(s) // 2],  # truncated
        lambda s: s.replace("合同", "合约", 1),  # a word changed, the line count kept
        lambda s: s + "extra\n",  # a chunk too many
        lambda s: "",  # empty
        _rechecked(lambda b: b[: b.rstrip("\n").rfind("\n") + 1]),  # a chunk short, checksum matching
        _rechecked(lambda b: b + "extra\n"),  # a chunk too many, checksum matching
    ],
)
def test_a_damaged_file_is_cut_again_and_rewritten(tmp_path, damage):
    """A file whose checksum matches but holds another number of chunks than asked is cut again:
    else its words are given to the wrong chunks (or too few lists for the corpus)."""
    token_cache.cached_tokens(TEXTS, tmp_path, min_chunks=1)
    (path,) = tmp_path.iterdir()
    path.write_text(damage(path.read_text(encoding="utf-8")), encoding="utf-8")
    assert token_cache.cached_tokens(TEXTS, tmp_path, min_chunks=1) == _cut(TEXTS)
    assert token_cache._read(path, len(TEXTS)) == _cut(TEXTS)  # rewritten whole


def test_words_cut_by_another_tokenizer_are_cut_again(tmp_path, monkeypatch):
    """The key hashes lexical.py's source: without it, words cut by an older ``tokenize`` were read
    back after an upgrade changed how words are cut, and BM25 searched with the old words."""
    folder = tmp_path / "bm25"
    first = token_cache.cached_tokens(TEXTS, folder, min_chunks=1)
    key = token_cache._key(TEXTS)
    edited = tmp_path / "lexical.py"
    edited.write_bytes(Path(lexical.__file__).read_bytes() + b"\n# how words are cut changed\n")
    monkeypatch.setattr(lexical, "__file__", str(edited))
    assert token_cache._key(TEXTS) != key
    real = lexical.tokenize
    calls = []
    monkeypatch.setattr(lexical, "tokenize", lambda t: calls.append(t) or real(t))
    assert token_cache.cached_tokens(TEXTS, folder, min_chunks=1) == first
    assert len(calls) == len(TEXTS) and len(_files(folder)) == 2  # cut again, saved under the new key


def test_a_fifo_at_the_files_name_is_cut_around_without_waiting(tmp_path):
    """The reader opened whatever was at the name and waited for good on a FIFO."""
    from hang_guard import returned

    token_cache.cached_tokens(TEXTS, tmp_path, min_chunks=1)
    (path,) = tmp_path.iterdir()
    path.unlink()
    os.mkfifo(path)
    assert returned(lambda: token_cache.cached_tokens(TEXTS, tmp_path, 1)) == _cut(TEXTS)


def test_a_folder_that_cannot_be_written_only_costs_time(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a user's file\n")
    assert token_cache.cached_tokens(TEXTS, blocked / "bm25", min_chunks=1) == _cut(TEXTS)
    assert blocked.read_text() == "a user's file\n"


def test_only_the_most_recent_of_our_files_are_kept_and_nothing_else_is_touched(tmp_path):
    foreign = ["notes.txt", "abc.words", "0" * 40 + ".words.bak"]
    for name in foreign:
        (tmp_path / name).write_text("keep me")
    (tmp_path / ("f" * 40 + ".words")).symlink_to(tmp_path / "notes.txt")
    corpora = [[f"{i} {t}" for t in TEXTS] for i in range(4)]
    names = [token_cache._key(c) + ".words" for c in corpora]
    for i, texts in enumerate(corpora[:3]):
        token_cache.cached_tokens(texts, tmp_path, min_chunks=1, keep=3)
        os.utime(tmp_path / names[i], (100 * (i + 1), 100 * (i + 1)))
    token_cache.cached_tokens(corpora[0], tmp_path, min_chunks=1, keep=3)  # a hit: now the most recent
    token_cache.cached_tokens(corpora[3], tmp_path, min_chunks=1, keep=3)  # a fourth: the least recent goes
    ours = {p.name for p in tmp_path.iterdir() if p.name not in foreign and not p.is_symlink()}
    assert ours == {names[0], names[2], names[3]}
    for name in foreign:
        assert (tmp_path / name).read_text() == "keep me"
    assert (tmp_path / ("f" * 40 + ".words")).is_symlink()


def test_the_temporary_files_of_a_killed_writer_are_pruned_once_stale(tmp_path):
    """A process killed while writing its words left a ``.KEY.words.XXXXXXXX`` file as large as
    the cache file, and no later run removed it. One left long ago goes with the next prune; one a
    live writer may still hold, and anything not of our naming, stay."""
    key = "a" * 40
    old, fresh = tmp_path / f".{key}.words.0123abcd", tmp_path / f".{key}.words.4567cdef"
    odd = [tmp_path / f".{key}.words.notours", tmp_path / f"{key}.words.0123abcd"]
    for path in (old, fresh, *odd):
        path.write_text("words")
    long_ago = os.stat(old).st_mtime - 2 * 86400  # two days
    for path in (old, *odd):
        os.utime(path, (long_ago, long_ago))
    token_cache.cached_tokens(TEXTS, tmp_path, min_chunks=1)
    assert not old.exists() and fresh.exists() and all(path.exists() for path in odd)


def test_jieba_keeps_its_dictionary_cache_in_our_cache_not_in_the_shared_tmp(tmp_path):
    """jieba's default is $TMPDIR/jieba.cache, shared by all users: it loaded any marshal file
    planted there, and where another user's was there it printed a traceback and left 9 MB behind."""
    import subprocess
    import sys

    shared, ours = tmp_path / "tmp", tmp_path / "cache"
    shared.mkdir()
    env = dict(os.environ, TMPDIR=str(shared), RAG_LOOKAHEAD_CACHE=str(ours))
    code = "from rag_lookahead.rag import lexical; print(lexical.tokenize('原告与被告签订了房屋租赁合同'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "被告" in done.stdout, done.stderr
    assert list(shared.iterdir()) == []
    assert (ours / "jieba" / "jieba.cache").is_file()


def test_a_jieba_dump_killed_before_its_rename_leaves_no_9_mb_file_for_good(tmp_path):
    """jieba dumps its dictionary to a ``mkstemp`` file and renames it: a process killed between
    (``kill -9``; its dump catches only ``Exception``, so a Ctrl-C too) left a 9 MB ``tmpXXXXXXXX`` in
    our jieba folder that nothing removed. An hour-old one goes; a fresh one (a dump under way)
    and files of other names stay."""
    import subprocess
    import sys
    import time

    folder = tmp_path / "cache" / "jieba"
    folder.mkdir(parents=True)
    killed, running, theirs = folder / "tmplmnj6wv0", folder / "tmp8k2_d9qa", folder / "mine.txt"
    for path in (killed, running, theirs):
        path.write_bytes(b"x")
    long_ago = time.time() - 2 * 3600
    for path in (killed, theirs):
        os.utime(path, (long_ago, long_ago))
    env = dict(os.environ, RAG_LOOKAHEAD_CACHE=str(tmp_path / "cache"))
    code = "from rag_lookahead.rag import lexical; print(lexical.tokenize('原告与被告签订了房屋租赁合同'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "被告" in done.stdout, done.stderr
    assert not killed.exists() and running.exists() and theirs.exists()


def test_cached_words_follow_the_dictionary_jieba_has_loaded(tmp_path):
    """The key held jieba's version, not its dictionary: after ``jieba.add_word`` (or a rebuilt
    dictionary cache) the cached words were the old dictionary's while queries were cut with the new."""
    import jieba

    word = "甲乙丙丁戊己公司"  # in no other test's text: jieba's dictionary is one per process
    texts = [f"第{i}号 被告{word}违约" for i in range(4)]
    before = token_cache.cached_tokens(texts, tmp_path, min_chunks=1)
    jieba.add_word(word)
    try:
        after = token_cache.cached_tokens(texts, tmp_path, min_chunks=1)
        assert after == [lexical.tokenize(t) for t in texts] != before
        assert word in after[0]
    finally:
        jieba.del_word(word)
    assert token_cache.cached_tokens(texts, tmp_path, min_chunks=1) == [lexical.tokenize(t) for t in texts]


def test_an_english_corpus_never_loads_jiebas_dictionary(tmp_path):
    """The dictionary's state is in the key only where jieba cuts something: a cache hit on 300
    English chunks took ~0.55 s and 60 MB more for a dictionary no text needed (13 ms without)."""
    import subprocess
    import sys

    code = (
        "import sys, jieba\n"
        "from rag_lookahead.rag import token_cache\n"
        "texts = [f'chunk {i} about the budget option' for i in range(300)]\n"
        "token_cache.cached_tokens(texts, __import__('pathlib').Path(sys.argv[1]))\n"
        "print(jieba.dt.initialized)\n"
    )
    for _ in range(2):  # a miss, then a hit
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
