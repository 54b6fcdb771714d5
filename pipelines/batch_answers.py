"""Answer a JSONL file of questions ({"question": ...} per line) into a JSONL of answers.

    python pipelines/batch_answers.py questions.jsonl answers.jsonl [--index-dir DIR] [--batch-size 4]

Each output line: {"question", "answer", "sources": [{source, chunk_id, score, in_prompt, snippet}], "stats"}
in input order. Questions are answered in batches through one batched generate call each
(``LookaheadLLM.generate``, like ``.batch``); the output file is written to a temporary sibling and renamed into
place, so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rag_args import open_index, rag_parser, run

from rag_lookahead.atomic import write_jsonl_atomic
from rag_lookahead.errors import InputError
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.rag.chains import as_retriever, make_prompt, retrieve, source_info


def read_questions(path: Path) -> list[str]:
    questions = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)["question"]
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"{path}:{lineno}: expected a JSON object with a 'question' ({e})") from None
            if not isinstance(q, str) or not q.strip():
                raise InputError(f"{path}:{lineno}: the question is empty")
            questions.append(q.strip())
    return questions


def main() -> None:
    ap = rag_parser(__doc__.splitlines()[0])
    ap.add_argument("questions", type=Path)
    ap.add_argument("answers", type=Path)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--no-lookahead", action="store_true")
    args = ap.parse_args()

    questions = read_questions(args.questions)
    retriever = as_retriever(open_index(args), args.k_seed)
    llm = LookaheadLLM.from_model_id(args.model, max_new_tokens=args.max_new_tokens)
    rows: list[dict] = []
    for start in range(0, len(questions), args.batch_size):
        group = questions[start : start + args.batch_size]
        docs = [retrieve(retriever, q, args.k_seed) for q in group]
        prompts = [make_prompt(q, d[: args.k]) for q, d in zip(group, docs)]
        refs = [[x.page_content for x in d[args.k :]] for d in docs]
        result = llm.generate(prompts, references=refs, enable_lookahead=not args.no_lookahead)
        for q, d, gens in zip(group, docs, result.generations):
            rows.append(
                {
                    "question": q,
                    "answer": gens[0].text.strip(),
                    "sources": [
                        {k: v for k, v in source_info(x, i < args.k).items() if k != "text"} for i, x in enumerate(d)
                    ],
                    "stats": gens[0].generation_info,
                }
            )
        print(f"answered {len(rows)}/{len(questions)}", file=sys.stderr)
    write_jsonl_atomic(args.answers, rows)
    print(f"wrote {len(rows)} answers to {args.answers}", file=sys.stderr)


if __name__ == "__main__":
    run(main)
