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

import argparse
import statistics
import tempfile
from pathlib import Path

from rag_lookahead.atomic import write_json_atomic
from rag_lookahead.bench.single import _print_rows, add_model_arguments, load_bench_model

QUESTIONS = [
    "decoding_length 应该怎么设置？",
    "branch_length 是什么意思，对速度有什么影响？",
    "索引文件夹里有哪些文件，分别保存什么？",
    "How should I set decoding_length on a CPU?",
    "Why is lookahead decoding lossless?",
    "What does the budget option do?",
]

MODES = ("off", "prompt", "seeded", "session")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m rag_lookahead.bench.rag", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--index-dir", default=None, help="an index to use (default: the bundled corpus, indexed into a temp dir)"
    )
    parser.add_argument("--k-prompt", type=int, default=2)
    parser.add_argument("--k-seed", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)

    from rag_lookahead.ask import bundled_corpus
    from rag_lookahead.langchain.llm import LookaheadLLM
    from rag_lookahead.rag.chains import build_rag_chain
    from rag_lookahead.rag.index import build_index, load_index

    model, tokenizer = load_bench_model(args)
    if args.index_dir:
        index = load_index(Path(args.index_dir))
    else:
        folder = Path(tempfile.mkdtemp(prefix="rag-bench-index-"))
        build_index(bundled_corpus(), folder, progress=False)
        index = load_index(folder)

    def llm() -> LookaheadLLM:  # a fresh output pool
        return LookaheadLLM(model=model, tokenizer=tokenizer, model_name=args.model, max_new_tokens=args.max_new_tokens)

    session = llm()
    build_rag_chain(llm(), index, k_prompt=args.k_prompt, k_seed=args.k_seed).invoke(QUESTIONS[0])  # warm-up
    rows, per_mode = [], {m: [] for m in MODES}
    for question in QUESTIONS:
        runs = {
            "off": build_rag_chain(llm(), index, k_prompt=args.k_prompt, k_seed=args.k_prompt).invoke(
                {"question": question, "enable_lookahead": False}
            ),
            "prompt": build_rag_chain(llm(), index, k_prompt=args.k_prompt, k_seed=args.k_prompt).invoke(question),
            "seeded": build_rag_chain(llm(), index, k_prompt=args.k_prompt, k_seed=args.k_seed).invoke(question),
            "session": build_rag_chain(session, index, k_prompt=args.k_prompt, k_seed=args.k_seed).invoke(question),
        }
        row = {"question": question}
        for mode, result in runs.items():
            stats = result["stats"]
            per_mode[mode].append((stats, result["answer"] == runs["off"]["answer"]))
            row[mode] = {
                "new_tokens": stats.get("new_tokens"),
                "mean_accepted": stats.get("mean_accepted"),
                "decode_seconds": stats.get("decode_seconds"),
                "identical_to_off": result["answer"] == runs["off"]["answer"],
            }
        rows.append(row)
        print(row, flush=True)

    summary = []
    for mode in MODES:
        items = per_mode[mode]
        tokens = sum(s.get("new_tokens", 0) - 1 for s, _ in items)
        seconds = sum(s.get("decode_seconds", 0.0) for s, _ in items)
        summary.append(
            {
                "mode": mode,
                "decode tok/s": round(tokens / seconds, 2) if seconds else 0.0,
                "mean accepted": round(statistics.mean(s.get("mean_accepted", 0.0) for s, _ in items), 3),
                "identical to off": f"{sum(same for _, same in items)}/{len(items)}",
            }
        )
    _print_rows(f"RAG chain, {args.model} {args.dtype}, k_prompt={args.k_prompt}, k_seed={args.k_seed}", summary)
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "k_prompt": args.k_prompt,
        "k_seed": args.k_seed,
        "summary": summary,
        "questions": rows,
    }
    if args.json_path:
        write_json_atomic(args.json_path, report)
    return report


if __name__ == "__main__":
    main()
