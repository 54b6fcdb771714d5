"""``bench.retrieval --dataset FILE``: passage records are checked line by line, with one-line errors."""

import json

import pytest

from rag_lookahead.bench import retrieval as br
from rag_lookahead.errors import InputError

SURROGATE = (
    "line 1 holds '\\ud800', an unpaired UTF-16 surrogate, which is no character (write the character itself, "
    "or both halves of its pair)"
)


def _file(tmp_path, *lines: str) -> str:
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_records_are_read_with_ids_as_text_and_chinese_by_default(tmp_path):
    lines = [
        json.dumps({"id": 7, "passage": "p1", "questions": ["q1", "q2"]}),
        "",
        json.dumps({"id": "b", "lang": "en", "passage": "p2", "questions": ["q3"], "extra": True}),
    ]
    items = br.load_dataset(_file(tmp_path, *lines))
    assert items == [br.Item("7", "zh", "p1", ["q1", "q2"]), br.Item("b", "en", "p2", ["q3"])]


def test_a_flat_question_file_is_grouped_by_passage(tmp_path):
    """SQuAD-style lines (one question and its context each): the same passage is one item."""
    lines = [
        json.dumps({"context": "p1", "question": "q1"}),
        json.dumps({"context": "p2", "question": "q2", "lang": "en"}),
        json.dumps({"id": "x", "context": "p1", "question": "q3"}),
        json.dumps({"id": "y", "passage": "p2", "questions": ["q4", "q5"]}),
    ]
    items = br.load_dataset(_file(tmp_path, *lines))
    assert items == [br.Item("line-1", "zh", "p1", ["q1", "q3"]), br.Item("line-2", "en", "p2", ["q2", "q4", "q5"])]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("{oops", "line 1 is not JSON"),
        ("[1]", "line 1 is not a JSON object"),
        (json.dumps({"text": "p", "questions": ["q"]}), "(its keys: questions, text)"),
        (json.dumps({"id": 1, "passage": " ", "questions": ["q"]}), "non-empty passage"),
        (json.dumps({"id": 1, "passage": "p", "questions": "one question"}), "list of questions"),
        (json.dumps({"id": 1, "passage": "p", "questions": []}), "list of questions"),
        (json.dumps({"id": 1, "passage": "p", "questions": ["q", ""]}), "list of questions"),
        (json.dumps({"id": 1, "context": "p", "question": 3}), "list of questions (or one question)"),
        (json.dumps({"id": 1, "context": "p"}), "(its keys: context, id)"),
        # an escaped unpaired surrogate, in a question or the passage: a traceback after the model loaded
        (r'{"passage": "zebra", "questions": ["zebra \ud800?"]}', SURROGATE),
        (r'{"context": "zebra \ud800 text", "question": "zebra?"}', SURROGATE),
        # nested past Python's recursion limit: a RecursionError's traceback
        ('{"passage": "p", "questions": ["q"], "e": ' + "[" * 3000 + "]" * 3000 + "}", "nested too deeply"),
    ],
)
def test_a_bad_record_is_named_by_its_line(tmp_path, record, message):
    with pytest.raises(InputError, match="set.jsonl: line 1") as caught:
        br.load_dataset(_file(tmp_path, record))
    assert message in str(caught.value)


def test_unreadable_and_empty_datasets_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="known names: bundled"):
        br.load_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"id": 1, "passage": "caf\xe9", "questions": ["q"]}\n')
    with pytest.raises(InputError, match="cannot read dataset"):
        br.load_dataset(tmp_path / "latin1.jsonl")
    with pytest.raises(InputError, match="no passage records"):
        br.load_dataset(_file(tmp_path, "", "  "))


def test_the_command_prints_one_line_for_a_bad_dataset(tmp_path):
    path = _file(tmp_path, json.dumps({"id": 1, "passage": "p"}))
    with pytest.raises(SystemExit) as done:
        br.main(["--dataset", path])
    assert done.value.code == (
        f"error: dataset {path}: line 1 needs a non-empty passage (or context) and a non-empty list of questions"
        " (or one question) (its keys: id, passage)"
    )


@pytest.mark.parametrize("module", ["retrieval", "session"])
def test_a_surrogate_in_a_dataset_stops_the_command_with_one_line_before_any_model_loads(tmp_path, monkeypatch, module):
    """bench.session died with a UnicodeEncodeError traceback after its model loaded, bench.retrieval
    with a TypeError after embedding every chunk."""
    import importlib

    from rag_lookahead.bench import common

    bench = importlib.import_module(f"rag_lookahead.bench.{module}")
    loads = []
    for owner in (bench, common):
        monkeypatch.setattr(owner, "load_bench_model", lambda *a, **k: loads.append(a), raising=False)
    monkeypatch.setattr(br, "get_embedder", lambda *a, **k: loads.append(a))
    path = _file(
        tmp_path,
        r'{"passage": "zebra \ud800 text here", "questions": ["zebra?"]}',
        '{"passage": "o", "question": "o?"}',
    )
    with pytest.raises(SystemExit) as done:
        bench.main(["--dataset", path])
    assert done.value.code == f"error: dataset {path}: {SURROGATE}"
    assert loads == []


@pytest.mark.parametrize("n", [0, 1, 2, 7, 10])
def test_the_halves_share_out_every_question_once_and_the_same_for_a_seed(n):
    """Half A (tuning) has n // 2 questions, half B the rest; none in both, none left out; the
    seeded split is the same run after run (the held-out numbers are comparable)."""
    a, b = br.split_halves(n)
    assert (len(a), len(b)) == (n // 2, n - n // 2)
    assert sorted([*a.tolist(), *b.tolist()]) == list(range(n))
    again = br.split_halves(n)
    assert a.tolist() == again[0].tolist() and b.tolist() == again[1].tolist()


def test_a_set_of_two_passages_is_ranked_to_the_last_passage():
    """Rankings go as deep as the set has passages: one passage short, a question whose passage
    BM25 ranks second found it nowhere (recall@5 0.5 on a set of two)."""
    items = [
        br.Item("a", "en", "apple banana cherry", ["apple grape melon kiwi?"]),
        br.Item("b", "en", "grape melon kiwi", ["kiwi?"]),
    ]
    ranked = br.rank_dataset(br.chunk_dataset("t", items), {})
    assert ranked.bm25[0] == [1, 0]  # its own passage second
    assert br.method_table(ranked)["bm25 (jieba)"]["r@5"] == 1.0


def test_in_a_small_set_a_word_of_one_passage_only_makes_a_question_specific():
    """5% of 4 passages is no passage: every question counted as generic, however unique the word
    it shares with its passage. A word in one passage singles it out at any size."""
    items = [br.Item(f"i{i}", "en", f"common words here unique{i}zz", [f"what about unique{i}zz"]) for i in range(4)]
    items.append(br.Item("j", "en", "common words here", ["common words?"]))  # shares only words every passage has
    assert br.generic_questions(br.chunk_dataset("t", items)).tolist() == [False] * 4 + [True]
