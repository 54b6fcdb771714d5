"""A RAG session: many questions asked one after another through one LLM, so one output pool.

The output pool keeps the n-grams of earlier answers, and a session is where it should pay: a
user or a help desk asks question after question over the same corpus. This benchmark asks
``--questions`` questions of a dataset's own corpus in a fixed shuffled order (cycled when the
set has fewer), through the RAG chain ``ask`` uses, and reports per block of ``--block``
questions the decode speed, the mean accepted tokens per forward and the pool's size: does the
pool warm up? Every ``--control-every``-th question is asked again with an empty pool, so the
two can be compared on the same question: does the pool ever slow a request down (a bigger
trie to search, drafts from earlier answers that the model rejects)? The two answers must be
identical (the pool changes drafts, never tokens).

    python -m rag_lookahead.bench.session --questions 200 --block 20 --json session.json
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated

import typer

from rag_lookahead.bench.common import (
    DeviceMapOption,
    DeviceOption,
    DtypeOption,
    JsonOption,
    ModelOption,
    TrustRemoteCodeOption,
    accepted,
    check_bench_model,
    check_output_path,
    check_positive,
    decode_speed,
    dtype_label,
    fresh_acceptance,
    given_or_temporary_index,
    keeps_report_despite_stdout,
    load_bench_model,
    passage_counts,
    print_rows,
    run_command,
    run_record,
    same_answer,
    write_report,
)
from rag_lookahead.errors import InputError

PROG = "python -m rag_lookahead.bench.session"


def session_questions(items, count: int, seed: int = 0) -> list[str]:
    """``count`` of the dataset's distinct questions in a fixed shuffled order, cycled (with a
    warning) when it has fewer: a repeated question drafts from its own earlier answer in the pool,
    which no new user's question can."""
    questions = list(dict.fromkeys(q for item in items for q in item.questions))
    if not questions:
        raise InputError("the dataset has no questions")
    if count > len(questions):
        print(
            f"warning: the dataset has {len(questions)} distinct questions; past that they repeat, and a"
            " repeat drafts from its own earlier answer",
            file=sys.stderr,
        )
    random.Random(seed).shuffle(questions)
    return [questions[i % len(questions)] for i in range(count)]


def write_corpus(items, corpus: Path) -> list[Path]:
    """Each passage as one file in ``corpus``, named by its position (``00000.txt``, ...), never by
    its dataset id: an id may repeat, hold a "/" or climb out of the folder ("../x")."""
    corpus.mkdir(parents=True, exist_ok=True)
    paths = [corpus / f"{n:05d}.txt" for n in range(len(items))]
    for path, item in zip(paths, items):
        path.write_text(item.passage, encoding="utf-8")
    return paths


def index_items(items, folder: Path, progress: bool = True):
    """Each passage as one file of a corpus in ``folder``, indexed with the defaults, and opened."""
    from rag_lookahead.rag.build import build_index
    from rag_lookahead.rag.index import load_index

    write_corpus(items, folder / "corpus")
    build_index(folder / "corpus", folder / "index", progress=progress)
    return load_index(folder / "index")


def session_index(items, index_dir: str | None) -> AbstractContextManager:
    """The index ``index_dir``, or the items indexed into a temporary folder removed at the end."""
    return given_or_temporary_index(index_dir, lambda folder: index_items(items, folder), prefix="rag-session-")


def summarize_blocks(records: list[dict], block: int) -> list[dict]:
    """One row per block of ``block`` questions: speed, acceptance, pool size, and the controls in it."""
    rows = []
    for start in range(0, len(records), block):
        part = records[start : start + block]
        controls = [r for r in part if "fresh" in r]
        row = {
            "questions": f"{start + 1}-{start + len(part)}",
            "decode tok/s": round(decode_speed(part), 2),
            "mean accepted": round(accepted(part), 3),
            "mean new tokens": round(statistics.mean(r["new_tokens"] for r in part), 1),
            "pool nodes": part[-1]["pool_nodes"],
        }
        if controls:
            row["controls: pool / empty tok/s"] = (
                f"{decode_speed(controls):.2f} / {decode_speed(r['fresh'] for r in controls):.2f}"
            )
            row["identical"] = f"{sum(r['identical'] for r in controls)}/{len(controls)}"
        rows.append(row)
    return rows


def ask_session(
    model,
    tokenizer,
    index,
    questions,
    *,
    model_name: str,
    k_prompt: int,
    k_seed: int,
    max_new_tokens: int,
    control_every: int,
) -> list[dict]:
    """Every question through one session LLM, with an empty-pool control every ``control_every``-th."""
    from tqdm import tqdm

    from rag_lookahead.langchain.llm import LookaheadLLM
    from rag_lookahead.rag.chains import build_rag_chain

    def chain(llm):
        return build_rag_chain(llm, index, k_prompt=k_prompt, k_seed=k_seed)

    def fresh_llm() -> LookaheadLLM:
        return LookaheadLLM(model=model, tokenizer=tokenizer, model_name=model_name, max_new_tokens=max_new_tokens)

    chain(fresh_llm()).invoke(questions[0])  # warm-up: the cost curve and the kernels, outside the session
    session = fresh_llm()
    records = []

    def run_control(question: str) -> dict:
        # from the session's learned rates (only the pool differs), which the control leaves as they were
        with fresh_acceptance(model, clear=False):
            return chain(fresh_llm()).invoke(question)

    controls = 0
    for i, question in enumerate(tqdm(questions, desc="questions", unit="q")):
        controlled = bool(control_every) and (i + 1) % control_every == 0
        early = run_control(question) if controlled and controls % 2 else None  # every other control first
        result = chain(session).invoke(question)
        record = run_record(result) | {"question": question, "pool_nodes": session.output_pool.nodes}
        if controlled:
            control = early if early is not None else run_control(question)
            controls += 1
            record["fresh"] = run_record(control)
            record["identical"] = same_answer(control, result)
        records.append(record)
        tqdm.write(json.dumps(record, ensure_ascii=False))
    return records


@keeps_report_despite_stdout
def session(
    model: ModelOption = "default",
    dtype: DtypeOption = "auto",
    device: DeviceOption = None,
    device_map: DeviceMapOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    dataset: Annotated[
        str, typer.Option(help="realistic-zh, realistic-en, bundled (the retrieval sets), or a JSONL of that shape")
    ] = "realistic-zh",
    index_dir: Annotated[
        str | None, typer.Option(help="an index of the dataset's passages (default: built into a temp dir)")
    ] = None,
    questions: Annotated[int, typer.Option(min=1, help="how many questions the session asks")] = 200,
    block: Annotated[int, typer.Option(min=1, help="questions per reported block")] = 20,
    control_every: Annotated[
        int, typer.Option(min=0, help="ask every N-th question again with an empty pool (0: never)")
    ] = 10,
    k_prompt: int = 3,
    k_seed: int | None = None,
    max_new_tokens: int = 64,
    seed: Annotated[int, typer.Option(help="order of the questions")] = 0,
    json_path: JsonOption = None,
) -> dict:
    """A RAG session: many questions asked one after another through one LLM, so one output pool."""
    from rag_lookahead.bench.retrieval import load_dataset

    check_positive({"--max-new-tokens": max_new_tokens})
    k_seed = passage_counts(k_prompt, k_seed)
    seen = check_output_path(json_path)
    check_bench_model(
        model, dtype, device, device_map, trust_remote_code
    )  # a bad option is said before the index is built
    items = load_dataset(dataset)
    asked = session_questions(items, questions, seed)
    with session_index(items, index_dir) as index:  # a missing index is said before the model loads
        loaded, tokenizer = load_bench_model(model, dtype, device, device_map, trust_remote_code)
        dtype = dtype_label(loaded, dtype)  # what ran, not the option
        records = ask_session(
            loaded,
            tokenizer,
            index,
            asked,
            model_name=model,
            k_prompt=k_prompt,
            k_seed=k_seed,
            max_new_tokens=max_new_tokens,
            control_every=control_every,
        )
    blocks = summarize_blocks(records, block)
    print_rows(f"session of {len(asked)} questions over {dataset}, {model} {dtype}, one output pool", blocks)
    report = {
        "model": model,
        "dtype": dtype,
        "dataset": dataset,
        "k_prompt": k_prompt,
        "k_seed": k_seed,
        "max_new_tokens": max_new_tokens,
        "blocks": blocks,
        "questions": records,
    }
    if json_path:
        write_report(json_path, report, seen=seen)
    return report


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench.session [options]``: the report (an exit code for --help)."""
    return run_command(session, argv, PROG)


if __name__ == "__main__":
    main()
