"""Models side by side on the bundled corpus (by default the two embedded ones): grounded answers and speed.

Each model (``default``: Qwen2.5-Coder-0.5B-Instruct; ``quality``: Qwen2.5-Coder-1.5B-Instruct,
the ``rag-lookahead[quality]`` extra) answers the same questions about our user guide through the
RAG chain ``ask`` uses (the bundled ``corpora/`` indexed into a temporary folder, as
``rag_lookahead index corpora/`` would), greedy, lookahead on, up to 128 new tokens. Per
question it records whether the answer is grounded, the decode speed and the mean accepted
tokens per forward; it prints a markdown table and writes JSON.

The grounded check, written down: every question names its gold passage (the corpus file that
answers it) and a few key terms taken from that passage which the question itself does not
contain. An answer counts as grounded when it contains at least one of them, compared
case-insensitively with backticks and runs of spaces ignored. The terms say what the passage
says, not only what it is about: "The budget option does not do anything." (what the 0.5B model
once said) and an answer that describes branch_length under the budget's name hold none of
"measures the cost", "cost of a forward", "pay off", "always verifies", "sizes each draft", so
both fail. The check is still lenient (a right term in a wrong sentence passes); it separates
answers that use the passage from answers that ignore it.
``gold retrieved`` says whether the gold file was among the passages shown to the model, so a
retrieval miss is not blamed on the model.

    python -m rag_lookahead.bench.quality --json quality.json
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Annotated

import typer

from rag_lookahead.bench.common import (
    DeviceOption,
    DtypeOption,
    JsonOption,
    TrustRemoteCodeOption,
    accepted,
    check_bench_model,
    check_output_path,
    check_positive,
    dtype_label,
    keeps_report_despite_stdout,
    load_bench_model,
    passage_counts,
    peak_rss_gb,
    print_json_line,
    run_command,
    write_report,
)
from rag_lookahead.bench.rag import open_index
from rag_lookahead.errors import ConfigError

PROG = "python -m rag_lookahead.bench.quality"


@dataclass(frozen=True)
class Question:
    """A question the bundled corpus answers, its gold passage file, and the key terms of the check."""

    text: str
    gold: str
    key_terms: tuple[str, ...]


QUESTIONS: tuple[Question, ...] = (
    Question(
        "What does the budget option do?",
        "tuning.md",
        ("measures the cost", "cost of a forward", "pay off", "always verifies", "sizes each draft"),
    ),
    Question("What is the default value of decoding_length?", "tuning.md", ("64",)),
    Question(
        "Why is lookahead decoding lossless?",
        "lookahead-decoding.md",
        ("identical", "own greedy prediction", "greedy decoding would", "verified", "agrees with"),
    ),
    Question("Where is the index stored by default?", "quickstart.md", ("RAG_LOOKAHEAD_HOME", ".local/share")),
    Question("Why is the first run slow?", "troubleshooting.md", ("convert", "GGUF", "cache")),
    Question("How does retrieval find the passages?", "quickstart.md", ("BM25", "e5", "rank fusion", "jieba")),
    Question("decoding_length 在 CPU 上应该设成多少？", "参数调优.md", ("8 到 16", "8-16", "8~16", "auto")),
    Question("branch_length 的默认值是多少？", "参数调优.md", ("48",)),
    Question("索引文件夹里有哪些文件？", "索引格式说明.txt", ("manifest.json", "index.faiss", "docstore.jsonl")),
    Question("输出池有什么作用？", "参数调优.md", ("n-gram", "以往回答", "历次回答", "共享")),
    Question("为什么开启前瞻解码后输出和普通解码一样？", "常见问题.md", ("无损", "贪心", "验证")),
    Question("前瞻解码的草稿从哪里来？", "前瞻解码原理.md", ("前缀树", "trie", "n-gram", "上下文池", "输出池")),
)


def _normal(text: str) -> str:
    return " ".join(text.replace("`", "").lower().split())


def terms_found(answer: str, question: Question) -> int:
    """How many of the question's key terms the answer holds (a fuller answer quotes more of them)."""
    said = _normal(answer)
    return sum(_normal(term) in said for term in question.key_terms)


def grounded(answer: str, question: Question) -> bool:
    """The check above: the answer holds at least one key term of the gold passage."""
    return terms_found(answer, question) > 0


def ask_all(model, tokenizer, index, name: str, max_new_tokens: int, k_prompt: int, k_seed: int) -> list[dict]:
    """Every question through a fresh chain (a fresh output pool), after one warm-up answer."""
    from rag_lookahead.langchain.llm import LookaheadLLM
    from rag_lookahead.models import reported_name
    from rag_lookahead.rag.chains import build_rag_chain

    def chain():
        llm = LookaheadLLM(
            model=model, tokenizer=tokenizer, model_name=reported_name(name), max_new_tokens=max_new_tokens
        )
        return build_rag_chain(llm, index, k_prompt=k_prompt, k_seed=k_seed)

    chain().invoke({"question": QUESTIONS[0].text, "max_new_tokens": 8})  # warm-up
    rows = []
    for question in QUESTIONS:
        result = chain().invoke({"question": question.text, "max_new_tokens": max_new_tokens})
        stats = result["stats"]
        tokens, seconds = stats.get("new_tokens", 0), stats.get("decode_seconds", 0.0)
        shown = [PurePath(str(s["source"])).name for s in result["sources"] if s.get("in_prompt")]
        rows.append(
            {
                "model": name,
                "question": question.text,
                "grounded": grounded(result["answer"], question),
                "key terms": f"{terms_found(result['answer'], question)}/{len(question.key_terms)}",
                "gold retrieved": question.gold in shown,
                "new tokens": tokens,
                # the first token comes from the prefill forward, as in the other benchmarks
                "decode tok/s": round((tokens - 1) / seconds, 2) if seconds and tokens > 1 else 0.0,
                "mean accepted": round(stats.get("mean_accepted", 0.0), 2),
                "decode forwards": stats.get("forward_passes", 0),  # for the pooled figure (summarize)
                "answer": result["answer"],
            }
        )
        print_json_line(rows[-1])  # a JSON line, as bench prints its rows (it was a Python dict)
    return rows


def summarize(rows: list[dict]) -> dict:
    """One model's totals: grounded count, decode tok/s and mean accepted over all its answers
    (pooled, as bench and bench.rag count it: the mean of each answer's own ratio counted a 1-token
    answer, which no decode forward made, as 0)."""
    tokens = sum(r["new tokens"] - 1 for r in rows if r["decode tok/s"])
    seconds = sum((r["new tokens"] - 1) / r["decode tok/s"] for r in rows if r["decode tok/s"])
    return {
        "grounded": f"{sum(r['grounded'] for r in rows)}/{len(rows)}",
        "key terms": _fraction_sum(r["key terms"] for r in rows),
        "mean new tokens": round(statistics.mean(r["new tokens"] for r in rows), 1),
        "gold retrieved": f"{sum(r['gold retrieved'] for r in rows)}/{len(rows)}",
        "decode tok/s": round(tokens / seconds, 2) if seconds else 0.0,
        "mean accepted": round(
            accepted([{"new_tokens": r["new tokens"], "steps": r["decode forwards"]} for r in rows]), 2
        ),
    }


def markdown(rows: list[dict], summaries: dict[str, dict]) -> str:
    """The per-question table, then one line per model."""
    lines = ["| model | question | grounded | key terms | gold retrieved | new tokens | decode tok/s | mean accepted |"]
    lines.append("| --- | --- | --- | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        yes = {True: "yes", False: "no"}
        lines.append(
            f"| {r['model']} | {r['question']} | {yes[r['grounded']]} | {r['key terms']} | {yes[r['gold retrieved']]} |"
            f" {r['new tokens']} | {r['decode tok/s']} | {r['mean accepted']} |"
        )
    head = "| model | grounded | key terms | gold retrieved | mean new tokens | decode tok/s | mean accepted |"
    lines += ["", head + " load s | peak RSS GB |", "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, s in summaries.items():
        lines.append(
            f"| {name} | {s['grounded']} | {s['key terms']} | {s['gold retrieved']} | {s['mean new tokens']} |"
            f" {s['decode tok/s']} | {s['mean accepted']} | {s['load seconds']} | {s['peak rss gb']} |"
        )
    return "\n".join(lines)


def _fraction_sum(fractions) -> str:
    pairs = [tuple(int(n) for n in f.split("/")) for f in fractions]
    return f"{sum(a for a, _ in pairs)}/{sum(b for _, b in pairs)}"


def model_names(
    models: str, dtype: str = "auto", device: str | None = None, trust_remote_code: bool = False
) -> list[str]:
    """The ``--models`` names, each checked with ``--dtype`` and ``--device`` before the index is
    built and the first model runs: none empty or repeated, and each one ``load_model`` would take
    (an embedded model installed, a local folder that exists, a name that can be a hub id). Only
    the embedded ones were checked, so a misspelt folder second failed after the first model's
    whole run, with no report."""
    names = [m.strip() for m in models.split(",") if m.strip()]
    if not names:
        raise ConfigError(f"--models {models!r} names no model")
    if len(set(names)) < len(names):
        raise ConfigError(f"--models {models!r} names a model twice")
    for name in names:
        check_bench_model(
            name, dtype, device, None, trust_remote_code
        )  # ModelLoadError, with the pip command, for a missing extra
    return names


@keeps_report_despite_stdout
def quality(
    models: Annotated[
        str,
        typer.Option(
            "--models",
            help='models to compare, comma-separated: "default", "quality", hub ids or local model folders',
        ),
    ] = "default,quality",
    dtype: DtypeOption = "auto",
    device: DeviceOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
    max_new_tokens: int = 128,
    k_prompt: int = 3,
    k_seed: int | None = None,
    index_dir: Annotated[
        str | None, typer.Option(help="an index to use (default: the bundled corpus, indexed into a temp dir)")
    ] = None,
    json_path: JsonOption = None,
) -> dict:
    """Models compared on the bundled corpus: grounded answers, decode speed, mean accepted."""
    # over 40 lines only because typer declares the options in the signature; the work is ask_all
    names = model_names(models, dtype, device, trust_remote_code)
    check_positive({"--max-new-tokens": max_new_tokens})
    k_seed = passage_counts(k_prompt, k_seed)
    seen = check_output_path(json_path)
    rows: list[dict] = []
    summaries: dict[str, dict] = {}
    with open_index(index_dir) as index:
        for name in names:
            start = time.perf_counter()
            model, tokenizer = load_bench_model(name, dtype, device, None, trust_remote_code)  # converts on first use
            load_seconds = round(time.perf_counter() - start, 1)
            model_rows = ask_all(model, tokenizer, index, name, max_new_tokens, k_prompt, k_seed)
            # peak RSS is the process's so far: the earlier models' peaks are included
            summaries[name] = summarize(model_rows) | {
                "dtype": dtype_label(model, dtype),
                "load seconds": load_seconds,
                "peak rss gb": round(peak_rss_gb(), 2),
            }
            rows += model_rows
            del model, tokenizer
            gc.collect()
    table = markdown(rows, summaries)
    print(table)
    ran = {name: s["dtype"] for name, s in summaries.items()}
    report = {
        "models": names,
        # what ran, not the option: one label, or each model's where they differ
        "dtype": ran[names[0]] if len(set(ran.values())) == 1 else ", ".join(f"{n}: {d}" for n, d in ran.items()),
        "max_new_tokens": max_new_tokens,
        "k_prompt": k_prompt,
        "k_seed": k_seed,
        "summary": summaries,
        "questions": rows,
        "markdown": table,
    }
    if json_path:
        write_report(json_path, report, seen=seen)
    return report


def main(argv: Sequence[str] | None = None) -> dict | int:
    """``python -m rag_lookahead.bench.quality [options]``: the report (an exit code for --help)."""
    return run_command(quality, argv, PROG)


if __name__ == "__main__":
    main()
