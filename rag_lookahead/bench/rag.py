"""RAG benchmark: the retrieval chain over an index, with and without trie seeding.

For each question of the set the chain runs four ways, one after the other in one process:
  off         lookahead disabled (plain greedy through the same loop)
  prompt      lookahead, trie seeded by the prompt only (k_seed = k_prompt), empty output pool
  seeded      lookahead, plus the k_seed - k_prompt retrieved passages not shown to the model
  session     seeded, and the output pool kept across the questions (a user asking follow-ups)
and reports decode tokens/s, mean accepted tokens per forward, and whether each answer is
identical to the "off" answer.

    python -m rag_lookahead.bench.rag --json rag.json
"""

from __future__ import annotations

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
    in_turn,
    keeps_report_despite_stdout,
    load_bench_model,
    passage_counts,
    print_json_line,
    print_rows,
    run_command,
    run_record,
    same_answer,
    write_report,
)

PROG = "python -m rag_lookahead.bench.rag"
QUESTIONS = [
    "decoding_length 应该怎么设置？",
    "branch_length 是什么意思，对速度有什么影响？",
    "索引文件夹里有哪些文件，分别保存什么？",
    "How should I set decoding_length on a CPU?",
    "Why is lookahead decoding lossless?",
    "What does the budget option do?",
]

MODES = ("off", "prompt", "seeded", "session")


def open_index(index_dir: str | None) -> AbstractContextManager:
    """The index to ask: ``index_dir``, or the bundled corpus indexed into a temporary folder that
    is removed when the block ends."""
    return given_or_temporary_index(index_dir, _bundled_index, prefix="rag-bench-index-")


def _bundled_index(folder: Path):
    from rag_lookahead.ask import bundled_corpus
    from rag_lookahead.rag.index import build_index, load_index

    build_index(bundled_corpus(), folder, progress=False)
    return load_index(folder)


def ask_every_way(model, tokenizer, index, model_name: str, k_prompt: int, k_seed: int, max_new_tokens: int):
    """Each question in the four modes; the rows printed as they come, and per mode ``(stats, same)``
    pairs (``same``: the answer equals the "off" answer)."""
    from rag_lookahead.langchain.llm import LookaheadLLM
    from rag_lookahead.rag.chains import build_rag_chain

    def llm() -> LookaheadLLM:  # a fresh output pool
        return LookaheadLLM(model=model, tokenizer=tokenizer, model_name=model_name, max_new_tokens=max_new_tokens)

    def chain(language_model, seed_k):
        return build_rag_chain(language_model, index, k_prompt=k_prompt, k_seed=seed_k)

    session = llm()
    chain(llm(), k_seed).invoke(QUESTIONS[0])  # warm-up
    rows, per_mode = [], {m: [] for m in MODES}
    asked = {
        "off": lambda q: chain(llm(), k_prompt).invoke({"question": q, "enable_lookahead": False}),
        "prompt": lambda q: chain(llm(), k_prompt).invoke(q),
        "seeded": lambda q: chain(llm(), k_seed).invoke(q),
        "session": lambda q: chain(session, k_seed).invoke(q),
    }

    def ask_fresh(mode: str, question: str):
        with fresh_acceptance(model):  # each mode from the same prior, not the one learned just before
            return asked[mode](question)

    for n, question in enumerate(QUESTIONS):
        runs = in_turn(list(asked), n, ask_fresh, question)  # none always first
        row = {"question": question}
        for mode, result in runs.items():
            stats = result["stats"]
            same = None if mode == "off" else same_answer(result, runs["off"])  # not "off" against itself
            per_mode[mode].append((stats, same))
            row[mode] = {
                "new_tokens": stats.get("new_tokens"),
                "mean_accepted": stats.get("mean_accepted"),
                "decode_seconds": stats.get("decode_seconds"),
                "identical_to_off": same,
            }
        rows.append(row)
        print_json_line(row)
    return rows, per_mode


def summarize_modes(per_mode: dict[str, list]) -> list[dict]:
    summary = []
    for mode in MODES:
        items = per_mode[mode]
        summary.append(
            {
                "mode": mode,
                "decode tok/s": round(decode_speed(s for s, _ in items), 2),
                "mean accepted": round(accepted([run_record({"stats": s}) for s, _ in items]), 3),  # pooled
                "identical to off": "-" if mode == "off" else f"{sum(same for _, same in items)}/{len(items)}",
            }
        )
    return summary


@keeps_report_despite_stdout
def rag(
    model: ModelOption = "default",
    dtype: DtypeOption = "auto",
    device: DeviceOption = None,
    device_map: DeviceMapOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    index_dir: Annotated[
        str | None, typer.Option(help="an index to use (default: the bundled corpus, indexed into a temp dir)")
    ] = None,
    k_prompt: int = 2,
    k_seed: int | None = None,
    max_new_tokens: int = 192,
    json_path: JsonOption = None,
) -> dict:
    """RAG benchmark: the retrieval chain over an index, with and without trie seeding."""
    check_positive({"--max-new-tokens": max_new_tokens})
    k_seed = passage_counts(k_prompt, k_seed)
    seen = check_output_path(json_path)
    check_bench_model(
        model, dtype, device, device_map, trust_remote_code
    )  # a bad option is said before the index is built
    with open_index(index_dir) as index:  # a missing index is said before the model loads
        loaded, tokenizer = load_bench_model(model, dtype, device, device_map, trust_remote_code)
        dtype = dtype_label(loaded, dtype)  # what ran, not the option
        rows, per_mode = ask_every_way(loaded, tokenizer, index, model, k_prompt, k_seed, max_new_tokens)
    summary = summarize_modes(per_mode)
    print_rows(f"RAG chain, {model} {dtype}, k_prompt={k_prompt}, k_seed={k_seed}", summary)
    report = {
        "model": model,
        "dtype": dtype,
        "k_prompt": k_prompt,
        "k_seed": k_seed,
        "summary": summary,
        "questions": rows,
    }
    if json_path:
        write_report(json_path, report, seen=seen)
    return report


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench.rag [options]``: the report (an exit code for --help)."""
    return run_command(rag, argv, PROG)


if __name__ == "__main__":
    main()
