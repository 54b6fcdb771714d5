"""Answer a JSONL file of questions ({"question": ...} per line) into a JSONL of answers.

    python pipelines/batch_answers.py questions.jsonl answers.jsonl [--index-dir DIR] [--batch-size 4] [--resume]

Each output line: {"question", "answer", "sources": [{source, chunk_id, score, in_prompt, snippet}], "stats"}
in input order. Questions are answered in batches through one batched generate call each
(``LookaheadLLM.generate``, like ``.batch``); the output file is written to a temporary sibling and renamed into
place, so an interrupted run never leaves a half-written file; an existing file at that path is replaced only
if it is an earlier answers file of this pipeline. A run stopped part way (Ctrl-C, SIGTERM or SIGHUP, an error)
writes the answers it made, the first questions' in order (beside an earlier run's answers file, never over it,
unless resuming it), and ``--resume`` answers the rest after them; a further signal while the answers are
saved waits until they are. Where the file cannot be
written (a full disk), the answers are printed on stdout instead, and one error line names the file.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from rag_args import open_index, rag_parser, run

from tqdm import tqdm

from rag_lookahead.atomic import jsonl_text
from rag_lookahead.checks import positive_int
from rag_lookahead.errors import InputError, first_line, shell_word, shown_path
from rag_lookahead.interrupts import hold_signals
from rag_lookahead.langchain.llm import LookaheadLLM
from rag_lookahead.output_files import MOST_BYTES_READ, check_output_file, free_name, output_target, save_or_print
from rag_lookahead.paths import refuse_blank_path
from rag_lookahead.progress import status_line
from rag_lookahead.rag.chains import as_retriever, make_prompt, retrieve, source_info
from rag_lookahead.rag.corpus import read_input_text
from rag_lookahead.rag.index import check_searchable

ANSWER_KEYS = {"question", "answer", "sources", "stats"}  # each output record's keys, as main() writes them


def read_questions(path: str | Path) -> list[tuple[int, str]]:
    """The questions of a JSONL file with their line numbers; any bad line is refused here, before
    the model loads, naming ``path:line``."""
    name = shown_path(path)  # a name holding a newline was cut there in the one-line error
    try:
        lines = re.split(r"\r\n|\r|\n", read_input_text(path))  # not splitlines: U+2028 is JSON text
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise InputError(f"cannot read the questions file {str(path)!r}: {e}") from None
    questions = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)["question"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # [[[[... nested past Python's limit
            raise InputError(f"{name}:{lineno}: expected a JSON object with a 'question' ({e})") from None
        if not isinstance(q, str):
            raise InputError(f"{name}:{lineno}: the question must be a string, got {type(q).__name__}")
        if not q.strip():
            raise InputError(f"{name}:{lineno}: the question is empty")
        check_searchable(q, f"{name}:{lineno}: the question")  # not in the middle of the run
        questions.append((lineno, q.strip()))
    if not questions:  # before the model loads, and no empty answers file its own rerun would refuse
        raise InputError(f"{name} holds no questions (one JSON object with a 'question' a line)")
    return questions


def is_answers_file(path: Path) -> bool:
    """Whether ``path`` is an earlier output of this pipeline (every line an answer record), which
    a rerun may replace; any other file at the output path is refused, never overwritten."""
    # line by line, each at most MOST_BYTES_READ: a whole-file cap refused our own answers to ~10k
    # questions (over 64 MB); exactly the keys main() writes, and at least one record: a user's
    # Q&A set (question, answer, sources) or an empty file is not ours
    records = 0
    try:
        with open(path, encoding="utf-8", newline="\n") as f:
            while line := f.readline(MOST_BYTES_READ):
                if not line.endswith("\n") and len(line) >= MOST_BYTES_READ:
                    return False  # no line of ours is that long
                if not line.strip():
                    continue
                record = json.loads(line)
                if not (isinstance(record, dict) and record.keys() == ANSWER_KEYS):
                    return False
                records += 1
    except (OSError, ValueError, RecursionError):
        return False
    return records > 0


def answered_before(path: str, questions: list[str]) -> list[dict]:
    """The records of an earlier run's answers file at ``path`` (``--resume``): they must answer
    the first questions of this file, in order, or the run is refused (another questions file's
    answers would be kept under these questions). No file there: none."""
    target = Path(path).expanduser()
    if not target.exists():
        return []
    if not is_answers_file(target):
        raise InputError(f"--resume: {shown_path(path)} is not an answers file of this pipeline")
    with open(target, encoding="utf-8", newline="\n") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if len(records) > len(questions):
        raise InputError(
            f"--resume: {shown_path(path)} holds {len(records)} answers, more than the {len(questions)} questions"
        )
    for number, (record, question) in enumerate(zip(records, questions), start=1):
        if record["question"] != question:
            raise InputError(
                f"--resume: answer {number} of {shown_path(path)} is to another question than question {number} of"
                " this file: give the questions file it answered, or leave --resume out to answer all anew"
            )
    return records


def main() -> None:
    ap = rag_parser(__doc__.splitlines()[0])
    ap.add_argument("questions")  # not type=Path: Path("") is the working folder
    ap.add_argument("answers")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=256)
    ap.add_argument("--no-lookahead", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the answers file's answers and answer the rest")
    args = ap.parse_args()
    positive_int("--batch-size", args.batch_size)
    refuse_blank_path(args.questions, "questions")  # an unset variable
    seen = check_output_file(args.answers, "answers", ours=is_answers_file, inputs=[args.questions])

    numbered = read_questions(args.questions)
    questions = [q for _, q in numbered]
    rows: list[dict] = answered_before(args.answers, questions) if args.resume else []
    if len(rows) == len(questions):
        print(f"all {len(rows)} questions are answered in {shown_path(args.answers)}", file=sys.stderr)
        return
    numbered, resumed = numbered[len(rows) :], len(rows)
    retriever = as_retriever(open_index(args), args.k_seed)
    llm = LookaheadLLM.from_model_id(args.model, max_new_tokens=args.max_new_tokens)
    # every prompt is built and checked before the first decode: one too long for the context
    # ended the run after hours of answers, and named no line
    found, prompts = [], []
    for lineno, q in tqdm(numbered, desc="retrieving and checking", unit="question", file=sys.stderr):
        found.append(retrieve(retriever, q, args.k_seed))
        prompts.append(make_prompt(q, found[-1][: args.k]))
        try:
            llm.check_prompt(prompts[-1])
        except InputError as err:
            raise InputError(f"{shown_path(args.questions)}:{lineno}: {first_line(err)}") from None
    try:
        for start in range(0, len(numbered), args.batch_size):
            group = slice(start, start + args.batch_size)
            result = llm.generate(
                prompts[group],
                references=[[x.page_content for x in d[args.k :]] for d in found[group]],
                enable_lookahead=not args.no_lookahead,
            )
            rows.extend(answer_records(args, [q for _, q in numbered[group]], found[group], result))
            print(f"answered {len(rows)}/{len(questions)}", file=sys.stderr)
    except BaseException:  # Ctrl-C, SIGTERM, a failed batch: what was answered is kept, and --resume goes on
        hold_signals()  # a second Ctrl-C in the save (at its fsync) lost every answer
        if len(rows) > resumed:
            target = save_answers(args, rows, seen, partial=True)
            there = (
                "" if target == Path(args.answers).expanduser() else f" {shell_word(target)} as the answers file and"
            )
            status_line(  # not print: after a SIGHUP the terminal may be gone
                f"stopped: wrote the {len(rows)} answers made of {len(questions)} to {target}; rerun with{there}"
                " --resume to answer the rest"
            )
        raise
    hold_signals()  # all answered: a Ctrl-C now must not lose them
    target = save_answers(args, rows, seen, partial=False)
    print(f"wrote {len(rows)} answers to {target}", file=sys.stderr)


def save_answers(args, rows: list[dict], seen, partial: bool) -> Path:
    """Write ``rows`` where the answers go (checked again: the run may have been long), and return
    where that is. A ``partial`` run's answers go beside an earlier run's whole answers file, not
    over it, unless they resume it."""
    target = output_target(args.answers, is_answers_file, seen)
    if partial and seen is not None and not args.resume and target == Path(args.answers).expanduser():
        target = free_name(target)
    save_or_print(target, jsonl_text(rows), "the answers")
    return target


def answer_records(args, questions: list[str], docs: list, result) -> list[dict]:
    """One output record per question of a batch, as the module docstring lists them."""
    rows = []
    for q, d, gens in zip(questions, docs, result.generations):
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
    return rows


if __name__ == "__main__":
    run(main, prints_answers=False)  # answers go to a file, progress to stderr
