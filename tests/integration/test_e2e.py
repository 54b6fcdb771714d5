"""End to end: index the bundled corpora/, answer through the RAG chain and the CLI with the real model.

The exactness check (lookahead on == off) runs the fp32 weights: in bf16 one verify forward over a
k-token tree and k single-token forwards round differently, and a near-tie between two tokens can
flip (seen here: "set to 4" vs "set to 8" for the English question), which is a numerical, not a
logical, difference.
"""

from __future__ import annotations

import json
from difflib import SequenceMatcher
from pathlib import Path

import pytest

from rag_lookahead.ask import bundled_corpus
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.rag.chains import build_rag_chain, build_retrieval_qa
from rag_lookahead.rag.index import load_index

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parents[2] / "corpora"
QUESTIONS = {
    # the tuning guide answers both; for the Chinese question its English twin may rank first
    "zh": ("decoding_length 应该怎么设置？", ("zh/参数调优.md", "en/tuning.md")),
    "en": ("How should I set branch_length for open-ended chat?", ("en/tuning.md",)),
}


def longest_common(a: str, b: str) -> int:
    m = SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b))
    return m.size


@pytest.fixture(scope="module")
def index(bundled_index_dir, e5_embedder):
    """The session's index of the bundled corpus (CORPUS), opened with the session's embedder."""
    assert CORPUS == bundled_corpus()
    return load_index(bundled_index_dir, e5_embedder)


@pytest.fixture(scope="module")
def llm32(default_model_fp32):
    model, tokenizer = default_model_fp32
    return LookaheadLLM(model=model, tokenizer=tokenizer, model_name="default", max_new_tokens=48)


@pytest.mark.parametrize("lang", ["zh", "en"])
def test_chain_answers_from_the_passage_and_is_lossless(index, llm32, lang):
    question, source = QUESTIONS[lang]
    chain = build_rag_chain(llm32, index, k_prompt=3, k_seed=8)
    on = chain.invoke({"question": question, "max_new_tokens": 96})
    off = chain.invoke({"question": question, "enable_lookahead": False, "max_new_tokens": 96})
    assert on["answer"] == off["answer"]
    assert on["stats"]["new_tokens"] == off["stats"]["new_tokens"]
    assert off["stats"]["mean_accepted"] == 1.0
    assert on["stats"]["forward_passes"] <= off["stats"]["forward_passes"]
    assert len(on["sources"]) == 8 and sum(s["in_prompt"] for s in on["sources"]) == 3
    assert on["sources"][0]["source"] in source
    shown = [s["text"] for s in on["sources"] if s["in_prompt"]]
    # the answer quotes a passage that was in the prompt
    assert max(longest_common(on["answer"], text) for text in shown) >= 12, on["answer"]
    if lang == "en":
        assert "branch_length" in on["answer"]
        assert any(n in on["answer"] for n in ("4", "8"))
    else:
        assert "decoding_length" in on["answer"]


def test_retrieval_qa_matches_lcel(index, llm32):
    question = QUESTIONS["en"][0]
    qa = build_retrieval_qa(llm32, index, k_prompt=3, k_seed=8)
    out = qa.invoke({"query": question})
    assert len(out["source_documents"]) == 3
    assert "branch_length" in out["result"]
    # the seeding retriever registered the 5 passages kept out of the prompt
    prompt_docs = [d.page_content for d in out["source_documents"]]
    seeded = llm32.engine.seeds.lookup("\n".join(prompt_docs))
    assert len(seeded) == 5 and not set(seeded) & set(prompt_docs)


def test_retrieval_qa_prompts_the_model_as_ask_does(index, llm32):
    """RetrievalQA's "stuff" chain joined bare passages, where ``ask`` heads each "[1] (source)":
    the pipelines answered one question two ways."""
    from langchain_core.callbacks import BaseCallbackHandler

    from rag_lookahead.rag.chains import make_prompt, retrieve

    class Prompts(BaseCallbackHandler):
        seen: list[str] = []

        def on_llm_start(self, serialized, prompts, **kwargs) -> None:
            self.seen.extend(prompts)

    question = QUESTIONS["zh"][0]
    seen = Prompts()
    qa = build_retrieval_qa(llm32.model_copy(update={"max_new_tokens": 2}), index, k_prompt=3, k_seed=8)
    qa.invoke({"query": question}, config={"callbacks": [seen]})
    shown = retrieve(index.as_retriever(k=8), question, 8)[:3]
    assert seen.seen == [make_prompt(question, shown)]
    assert "[1] (" in seen.seen[0] and "[3] (" in seen.seen[0]


@pytest.fixture
def cli_home(tmp_path, monkeypatch, shared_embedder):
    """A fresh RAG_LOOKAHEAD_HOME (`ask` indexes the bundled corpus there and loads the default model;
    the embedder is the session's, loaded once)."""
    monkeypatch.setenv("RAG_LOOKAHEAD_HOME", str(tmp_path))
    return tmp_path


def test_cli_ask_json(cli_home, monkeypatch):
    from typer.testing import CliRunner

    from rag_lookahead import models
    from rag_lookahead.cli import app
    from rag_lookahead.greedy_head import greedy_head_of

    loaded = []
    real_load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: loaded.append(real_load(*a, **kw)) or loaded[-1])
    tmp_path = cli_home
    runner = CliRunner()
    result = runner.invoke(app, ["ask", QUESTIONS["en"][0], "--json", "--max-new-tokens", "32", "--k", "3"])
    assert result.exit_code == 0, result.output
    # one question never pays back the output-layer screen's build: ask's own model has none
    assert len(loaded) == 1 and greedy_head_of(loaded[0][0]) is None
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(out) == {"question", "answer", "sources", "stats"}
    assert out["question"] == QUESTIONS["en"][0] and out["answer"]
    assert out["sources"][0]["source"] == "en/tuning.md" and "snippet" in out["sources"][0]
    assert {"tokens_per_second", "mean_accepted", "forward_passes"} <= set(out["stats"])
    assert (tmp_path / "index" / "manifest.json").is_file()  # indexed the bundled corpus on first use

    bad = runner.invoke(app, ["ask", "   "])
    assert bad.exit_code == 1
    assert "question is empty" in bad.stderr and "Traceback" not in bad.output

    typo = tmp_path / "my-idx"  # a folder the user named: no sample index is built there
    missing = runner.invoke(app, ["ask", QUESTIONS["en"][0], "--index-dir", str(typo)])
    assert missing.exit_code == 1 and "Traceback" not in missing.output
    assert f"no index at {typo}" in missing.stderr and "rag_lookahead index" in missing.stderr
    assert not typo.exists()


def test_cli_ask_stream_prints_blocks_then_sources_then_a_speed_line(cli_home, monkeypatch, default_model):
    from typer.testing import CliRunner

    from rag_lookahead import ask, models
    from rag_lookahead.cli import app

    monkeypatch.setattr(models, "load_model", lambda name, **options: default_model)  # loaded once per session

    blocks: list[str] = []
    printer = ask.token_printer

    def counting_printer():
        handler = printer()
        write = handler.on_llm_new_token
        handler.on_llm_new_token = lambda token, **kw: (blocks.append(token), write(token, **kw))
        return handler

    monkeypatch.setattr(ask, "token_printer", counting_printer)
    result = CliRunner().invoke(app, ["ask", QUESTIONS["en"][0], "--stream", "--max-new-tokens", "32", "--k", "3"])
    assert result.exit_code == 0, result.output
    answer, _, rest = result.stdout.partition("\nSources")
    assert len(blocks) > 1 and answer.strip() == "".join(blocks).strip()  # printed as accepted, not at the end
    stats = " ".join(rest[rest.rindex("\nStats") :].split())  # the last block (the terminal may wrap it)
    assert stats.startswith("Stats") and "tok/s" in stats and "mean accepted" in stats, stats
    assert stats.endswith(("lookahead on", "lookahead off")), stats


def test_batch_answers_refuses_a_question_past_the_context_before_decoding_any(
    index, tmp_path, monkeypatch, capsys, default_model, shared_embedder
):
    """Line 3's prompt was too long for the context: the run failed after answering lines 1-2,
    wrote nothing and named no line. (The script runs in this process, as ``python
    pipelines/batch_answers.py`` runs it, on the session's default model: a process of its own
    loaded the model and the embedder again.)"""
    import sys

    from rag_lookahead import models

    questions = tmp_path / "q.jsonl"
    # 33,000 tokens: past the default model's 32,768 (each word of it is also embedded for the search)
    lines = [QUESTIONS["en"][0], QUESTIONS["zh"][0], "word " * 33_000 + "?"]
    questions.write_text("".join(json.dumps({"question": q}) + "\n" for q in lines), encoding="utf-8")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "pipelines"))
    import rag_args

    import batch_answers

    loads: list[str] = []
    monkeypatch.setattr(models, "load_model", lambda name, **options: loads.append(name) or default_model)
    monkeypatch.setattr(
        sys,
        "argv",
        ["batch_answers.py", str(questions), str(tmp_path / "a.jsonl"), "--index-dir", str(index.index_dir)],
    )
    with pytest.raises(SystemExit) as exit_info:
        rag_args.run(batch_answers.main, prints_answers=False)  # the script's own ``__main__`` line
    err = capsys.readouterr().err
    assert exit_info.value.code == 1, err
    assert loads == ["default"]  # the script's own model: the default one
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {questions}:3: the input has") and "context" in last, err
    assert "answered" not in err and not (tmp_path / "a.jsonl").exists()


def test_batch_answers_keeps_the_answers_made_when_stopped_and_resumes_after_them(
    index, tmp_path, monkeypatch, capsys, default_model, shared_embedder
):
    """A Ctrl-C (or a failed batch) after hours of answers lost them all: nothing was written.
    The answers made are written (beside an earlier run's whole answers, not over them), and
    ``--resume`` answers the rest after them; it refuses an answers file of other questions. On
    the session's default model, in this process."""
    import sys

    from rag_lookahead import models
    from rag_lookahead.langchain.llm import LookaheadLLM

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "pipelines"))
    import rag_args

    import batch_answers

    monkeypatch.setattr(models, "load_model", lambda name, **options: default_model)
    questions, answers = tmp_path / "q.jsonl", tmp_path / "a.jsonl"
    asked = [QUESTIONS["en"][0], QUESTIONS["zh"][0], "What does the budget option do?"]
    questions.write_text("".join(json.dumps({"question": q}) + "\n" for q in asked), encoding="utf-8")
    argv = ["batch_answers.py", str(questions), str(answers), "--index-dir", str(index.index_dir)]
    argv += ["--batch-size", "1", "--max-new-tokens", "6"]
    real_generate, calls = LookaheadLLM.generate, []

    def interrupted_on_the_second_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as Ctrl-C inside a decode
        return real_generate(self, *args, **kwargs)

    def records() -> list[dict]:
        return [json.loads(line) for line in answers.read_text(encoding="utf-8").splitlines()]

    monkeypatch.setattr(LookaheadLLM, "generate", interrupted_on_the_second_batch)
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        rag_args.run(batch_answers.main, prints_answers=False)
    err = capsys.readouterr().err
    assert stopped.value.code == 130 and "rerun with --resume" in err, err
    first = records()
    assert [r["question"] for r in first] == asked[:1] and first[0]["answer"]
    monkeypatch.setattr(LookaheadLLM, "generate", real_generate)
    monkeypatch.setattr(sys, "argv", argv + ["--resume"])
    rag_args.run(batch_answers.main, prints_answers=False)
    resumed = records()
    assert [r["question"] for r in resumed] == asked and resumed[0] == first[0]
    calls.clear()  # stopped again, not resuming: the whole earlier answers are kept, the part beside them
    monkeypatch.setattr(LookaheadLLM, "generate", interrupted_on_the_second_batch)
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        rag_args.run(batch_answers.main, prints_answers=False)
    assert records() == resumed and f"rerun with {tmp_path / 'a.1.jsonl'} as" in capsys.readouterr().err
    beside = (tmp_path / "a.1.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["question"] for line in beside] == asked[:1]
    monkeypatch.setattr(LookaheadLLM, "generate", real_generate)
    other = tmp_path / "other.jsonl"
    other.write_text(
        "".join(json.dumps({"question": q}) + "\n" for q in ["another question?", *asked]), encoding="utf-8"
    )
    monkeypatch.setattr(sys, "argv", ["batch_answers.py", str(other), str(answers), "--resume"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        rag_args.run(batch_answers.main, prints_answers=False)
    assert refused.value.code == 1 and "is to another question" in capsys.readouterr().err
    assert records() == resumed  # nothing changed


def test_the_seeding_retriever_returns_the_documents_it_found_with_their_headings():
    """Its copies lost each Document's id (LangChain's document identity)."""
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    from rag_lookahead.rag.chains import SeedingRetriever

    class Fixed(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager):
            return [
                Document(page_content=f"text {i}", id=f"doc-{i}", metadata={"source": f"d{i}.md"}) for i in range(4)
            ]

    docs = SeedingRetriever(retriever=Fixed(), k_prompt=2, k_seed=4).invoke("q")
    assert [d.id for d in docs] == ["doc-0", "doc-1"]
    assert [d.metadata for d in docs] == [
        {"source": "d0.md", "context_label": "[1] (d0.md)"},
        {"source": "d1.md", "context_label": "[2] (d1.md)"},
    ]
