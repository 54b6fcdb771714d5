"""What the example pipelines share: the flags that pick the index, the model and ``k``, opening the
index, and running the script (one-line errors; Ctrl-C, SIGTERM, SIGHUP).

The default index is built from the bundled corpora/ on first use (see ``rag_lookahead.ask.ensure_index``).
A pipeline imports this module first (pyproject's isort section "pipeline" keeps it there): from then
on a Ctrl-C exits 130 quietly, also while torch and LangChain are still importing (it printed a
20-line traceback through them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from rag_lookahead.interrupts import command_interrupts, stop_signals

_main_file = getattr(sys.modules["__main__"], "__file__", None)
# entered only where a pipeline is the program (not where a test imports this module), left in run()
_START = (
    command_interrupts(own_process=True)
    if _main_file and Path(_main_file).resolve().parent == Path(__file__).resolve().parent
    else None
)
_imports_done = _START.__enter__() if _START is not None else None

from rag_lookahead.ask import StdoutClosed, ensure_index, silence_stdout
from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.costs import recalibrate_asked
from rag_lookahead.errors import InputError, RagLookaheadError, first_line
from rag_lookahead.models import check_load_options
from rag_lookahead.paths import expand_user, refuse_blank_path
from rag_lookahead.rag.chains import check_k, check_question_text, seed_count
from rag_lookahead.rag.index import DocumentIndex, check_searchable, default_index_dir


class RagArgumentParser(argparse.ArgumentParser):
    """Checks ``--k`` and ``--k-seed`` as it parses, naming the flags, and RAG_LOOKAHEAD_RECALIBRATE
    where lookahead runs (before any index is built or model loads)."""

    def parse_args(self, *args, **kwargs):  # type: ignore[override]
        parsed = super().parse_args(*args, **kwargs)
        flags = ("--k", "--k-seed")
        if hasattr(parsed, "k_seed"):
            parsed.k_seed = seed_count(parsed.k, parsed.k_seed, names=flags)
        else:
            check_k(parsed.k, parsed.k, names=flags)
        questions = getattr(parsed, "questions", None)  # chat_stream's list (batch_answers': a file)
        if not isinstance(questions, list):
            questions = [parsed.question] if hasattr(parsed, "question") else []
        if any(not q.strip() for q in questions):  # said now, not after the model has loaded
            raise InputError('the question is empty: ask something, e.g. "What does budget do?"')
        for question in questions:
            check_question_text(question)  # argv bytes that were not UTF-8, with the terminal hint
            check_searchable(question, "the question")
        refuse_blank_path(parsed.index_dir, "--index-dir")  # "" (an unset variable) is no working folder
        for name in ("max_new_tokens", "max_tokens"):
            if hasattr(parsed, name):  # either spelling may have been typed
                positive_int("--max-tokens/--max-new-tokens", getattr(parsed, name))
        if not getattr(parsed, "no_lookahead", False):  # the first decode refused it, after the index and model
            recalibrate_asked()  # a RAG_LOOKAHEAD_RECALIBRATE that is neither yes nor no
        return parsed


def rag_parser(description: str, *, k_seed: bool = True) -> argparse.ArgumentParser:
    """A parser with ``--index-dir``, ``--model``, ``--k`` (passages in the prompt) and, unless
    ``k_seed`` is off, ``--k-seed`` (passages retrieved, the rest seed the draft trie)."""
    ap = RagArgumentParser(description=description)
    ap.add_argument("--index-dir", default=None)  # not type=Path: Path("") is the working folder
    ap.add_argument("--model", default="default")
    ap.add_argument("--k", type=int, default=3)
    if k_seed:
        ap.add_argument("--k-seed", type=int, default=None, help="default: the larger of --k and 8")
    return ap


def open_index(args: argparse.Namespace) -> DocumentIndex:
    """The index at ``--index-dir``, else ``default_index_dir()``, built from the bundled corpus
    first if there is none there. A named ``--index-dir`` must hold an index (as ``ask`` has it): a
    mistyped one was filled with the sample corpus, which then answered the question."""
    check_load_options(args.model)  # a bad --model or a missing optional one: said before the sample index is built
    given = expand_user(args.index_dir, "--index-dir") if args.index_dir is not None else None  # '--index-dir=~/x'
    return ensure_index(given or default_index_dir(), build_bundled=given is None)


def run(main: Callable[[], None], *, prints_answers: bool = True) -> None:
    """Run a pipeline's ``main``; our errors (no index, a model that will not load, a bad option)
    print one line and exit 1, as the ``rag_lookahead`` commands do; Ctrl-C says "interrupted"
    (exit 130), SIGTERM and SIGHUP stop it as Ctrl-C does ("terminated (SIGTERM)", exit 143; "hung
    up (SIGHUP)", exit 129; see ``stop_signals``), and a reader that left the pipe (``| head``)
    ends it quietly (exit 1), no traceback. A script that prints its answers (``prints_answers``)
    and is started with stdout closed (``>&-``) does no work: ``print`` would drop the answer unsaid."""
    global _START
    try:
        if _imports_done is not None and _START is not None:
            _imports_done()  # a Ctrl-C during the imports: exit 130; from here it raises KeyboardInterrupt
        if prints_answers and sys.stdout is None:
            raise RagLookaheadError("stdout is closed: there is nowhere to write the answer")
        with stop_signals(own_process=_START is not None):
            main()
    except RagLookaheadError as err:
        print(f"error: {first_line(err)}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except (BrokenPipeError, StdoutClosed):
        silence_stdout()
        raise SystemExit(1) from None
    except OSError as err:  # a disk that filled up, a folder that went away: one line, not a traceback
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if _START is not None:
            start, _START = _START, None
            start.__exit__(None, None, None)
