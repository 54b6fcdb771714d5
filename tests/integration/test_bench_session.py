"""The session benchmark on the real default model and a real index: one pool across questions, controls."""

from __future__ import annotations

import pytest

from rag_lookahead.bench.retrieval import Item
from rag_lookahead.bench.session import ask_session, index_items, session_questions, summarize_blocks
from rag_lookahead.errors import InputError

ITEMS = [
    Item("a", "zh", "长城始建于春秋战国时期，今天看到的砖石城墙大多是明朝修筑的。", ["长城是哪个朝代修的砖墙？"]),
    Item("b", "zh", "故宫始建于明朝永乐年间，1925年起作为博物院对公众开放。", ["故宫什么时候开放？"]),
    Item(
        "c",
        "en",
        "The warranty covers parts and labour for two years from the date of purchase.",
        ["How long is the warranty?"],
    ),
]


def test_questions_are_shuffled_the_same_way_and_cycled():
    first = session_questions(ITEMS, 7, seed=3)
    assert first == session_questions(ITEMS, 7, seed=3)
    assert sorted(first[:3]) == sorted(q for it in ITEMS for q in it.questions)
    assert first[3:6] == first[:3] and first[6] == first[0]
    with pytest.raises(InputError, match="no questions"):
        session_questions([Item("x", "en", "text", [])], 3)


def test_one_pool_grows_across_questions_and_controls_answer_the_same(default_model, tmp_path, shared_embedder):
    model, tokenizer = default_model
    index = index_items(ITEMS, tmp_path, progress=False)  # with the session's embedder (shared_embedder)
    questions = session_questions(ITEMS, 4)
    records = ask_session(
        model,
        tokenizer,
        index,
        questions,
        model_name="default",
        k_prompt=1,
        k_seed=2,
        max_new_tokens=8,
        control_every=2,
    )
    assert [r["question"] for r in records] == questions
    pools = [r["pool_nodes"] for r in records]
    assert pools[0] > 0 and pools == sorted(pools) and pools[-1] > pools[0]  # earlier answers stay in the pool
    controls = [i for i, r in enumerate(records) if "fresh" in r]
    assert controls == [1, 3]
    assert all(records[i]["identical"] for i in controls)  # the pool changes drafts, never tokens
    assert all(r["steps"] >= 1 and r["new_tokens"] - 1 >= r["steps"] for r in records)

    blocks = summarize_blocks(records, 3)
    assert [b["questions"] for b in blocks] == ["1-3", "4-4"]
    assert blocks[0]["identical"] == "1/1" and blocks[1]["identical"] == "1/1"
    assert blocks[-1]["pool nodes"] == pools[-1]
    assert all(b["decode tok/s"] > 0 and b["mean accepted"] >= 1.0 for b in blocks)
