"""Ask a question over the local index: ``python -m rag_lookahead.ask "decoding_length 应该怎么设置？"``.

The first run indexes the bundled ``corpora/`` into the default index folder
(``$RAG_LOOKAHEAD_HOME/index``, else ``$XDG_DATA_HOME/rag_lookahead/index``, else
``~/.local/share/rag_lookahead/index``; a folder named with
``--index-dir`` must hold an index already), then every run retrieves
passages, answers with the lookahead LLM, and prints the answer, its sources and the decoding
stats. ``--json`` prints one JSON object instead. Same options as ``rag_lookahead ask``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rag_lookahead.errors import ConfigError, IndexLoadError, InputError, one_line, shown_path
from rag_lookahead.paths import expand_user
from rag_lookahead.progress import status_line

__all__ = [
    "StdoutClosed",
    "bundled_corpus",
    "ensure_index",
    "answer",
    "print_result",
    "silence_stdout",
    "token_printer",
    "main",
]


def bundled_corpus() -> Path:
    """The sample corpus: shipped inside the package if it was packaged, else the repository's ``corpora/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "corpora", here.parent / "corpora"):
        if candidate.is_dir():
            return candidate
    raise InputError(
        "no index yet and the bundled corpora/ folder was not found: build an index with `rag_lookahead index DIR`"
    )


def ensure_index(index_dir: Path, *, quiet: bool = False, build_bundled: bool = True):
    """Load the index at ``index_dir``; build it from the bundled corpus first if there is none and
    ``build_bundled`` (``build_index`` refuses a non-empty folder that is not an index, so nothing
    of the user's is touched). Without ``build_bundled`` a missing index is an
    :class:`~rag_lookahead.errors.IndexLoadError`: a folder the user named (perhaps mistyped)
    must not quietly answer from the sample corpus."""
    from rag_lookahead.rag.index import build_index, holds_index, load_index, no_index_error
    from rag_lookahead.rag.store import MANIFEST, check_target

    if not build_bundled and holds_index(index_dir):
        return load_index(index_dir)  # a damaged index of the user's: load_index says what is missing
    if not (index_dir / MANIFEST).is_file():
        if not build_bundled:
            raise IndexLoadError(
                f"{no_index_error(index_dir, 'YOUR_DOCS')} (without --index-dir, the bundled sample corpus"
                " is indexed into the default folder)"
            )
        corpus = bundled_corpus()
        # index's advice (another --index-dir) would not do here: ask --index-dir needs an index in it
        check_target(
            index_dir,
            advice="ask puts its sample index there only when it is empty: build your own with"
            " `rag_lookahead index YOUR_DOCS --index-dir DIR` and ask with --index-dir DIR,"
            " or set RAG_LOOKAHEAD_HOME to another folder",
        )
        if not quiet:
            status_line(f"rag_lookahead: no index at {shown_path(index_dir)}; indexing the bundled corpus {corpus}")
        report = build_index(corpus, index_dir, progress=not quiet, if_missing=True)
        if not quiet:
            done = "another run published an index there meanwhile; using it" if report is None else report.summary()
            status_line(f"rag_lookahead: {done}")
    return load_index(index_dir)


#: a question this long gets a note before the silent read of the prompt (a 51,000-character
#: question, ~35,000 tokens, took 5.5 minutes here before its first token, and looked hung)
LONG_QUESTION_TOKENS = 2048


def _check_a_long_question(llm: Any, question: str, note: bool) -> None:
    """A question the model's context cannot hold is refused now, in one line (transformers'
    "sequence length is longer" warning and our "can take minutes" note came before the refusal);
    one that fits but is long gets a note (with ``note``)."""
    from rag_lookahead.rag.chains import check_question_fits

    tokens = check_question_fits(llm, question)
    if note and tokens is not None and tokens >= LONG_QUESTION_TOKENS:
        status_line(
            f"note: a {tokens:,}-token question; the model reads all of it before the first token of the"
            " answer, which can take minutes on a CPU"
        )


@contextlib.contextmanager
def _no_loading_bar(quiet: bool) -> Iterator[None]:
    """With ``quiet`` (--json: nothing but the answer's JSON), no "Loading weights" bar; transformers'
    bars are back on afterwards, as the caller of :func:`answer` had them."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def answer(
    question: str,
    *,
    index_dir: str | Path | None = None,
    model: str = "default",
    k: int = 3,
    k_seed: int | None = None,
    lookahead: bool = True,
    max_new_tokens: int = 256,
    llm: Any = None,
    callbacks: list | None = None,
    quiet: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    trust_remote_code: bool = False,
    dtype: str | None = None,
    device: str | None = None,
    device_map: str | None = None,
) -> dict:
    """Answer ``question``: ``{"question", "answer", "sources", "stats"}``.

    ``temperature`` > 0 samples (lossless: the model's own distribution); ``seed`` makes it
    reproducible."""
    from rag_lookahead.rag.chains import build_rag_chain, seed_count
    from rag_lookahead.rag.index import default_index_dir

    if not isinstance(question, str) or not question.strip():
        raise InputError(
            'the question is empty: ask something, e.g. rag_lookahead ask "decoding_length 应该怎么设置？"'
        )
    from rag_lookahead.rag.chains import check_question_text

    check_question_text(question)  # before anything loads
    from rag_lookahead.rag.index import check_searchable

    check_searchable(question, "the question")
    _check_sampling(temperature, top_p, seed)
    if lookahead:
        from rag_lookahead.decoding.costs import recalibrate_asked

        recalibrate_asked()  # a bad value, said now: the first decode reads it, after the index and the model
    k_seed = seed_count(k, k_seed, names=("--k", "--k-seed"))  # one below --k was raised to it in silence
    # a blank index_dir (an unset variable) is refused by expand_user, not taken for the default
    folder = expand_user(index_dir, "--index-dir") if index_dir is not None else default_index_dir()
    if llm is None:
        from rag_lookahead.models import check_load_options

        # a bad --model, --dtype or --device, a missing optional model, a hub id that cannot be
        # fetched: said before the sample index is built (a minute on a fresh machine, and the
        # index was left behind)
        check_load_options(
            model, dtype=dtype, device=device, device_map=device_map, hub=True, trust_remote_code=trust_remote_code
        )
    # only the default folder gets the sample
    index = ensure_index(folder, quiet=quiet, build_bundled=index_dir is None)
    if llm is None:
        from rag_lookahead.langchain.llm import LookaheadLLM
        from rag_lookahead.models import load_model, reported_name

        # trust_remote_code: an explicit opt-in, the model repo's own code runs. No output-layer
        # screen: one question's answer never pays back its build (3.3 s more for a 30-token
        # answer here, against 0.2 s saved; it pays after ~200 steps, in a server or a session).
        with _no_loading_bar(quiet):
            loaded, tokenizer = load_model(
                model,
                trust_remote_code=trust_remote_code,
                greedy_head=False,
                dtype=dtype,
                device=device,
                device_map=device_map,
            )
        llm = LookaheadLLM(
            model=loaded, tokenizer=tokenizer, model_name=reported_name(model), max_new_tokens=max_new_tokens
        )
    _check_a_long_question(llm, question, note=not quiet)
    # a prompt its --k passages make too long is refused naming --k, before decoding
    chain = build_rag_chain(llm, index, k_prompt=k, k_seed=k_seed, names=("--k", "--k-seed"))
    sampling = {"temperature": temperature, "top_p": top_p, "seed": seed}
    result = chain.invoke(
        {"question": question, "enable_lookahead": lookahead, "max_new_tokens": max_new_tokens}
        | {name: value for name, value in sampling.items() if value is not None},
        config={"callbacks": callbacks} if callbacks else None,
    )
    return {"question": question.strip(), **result}


def _check_sampling(temperature: float | None, top_p: float | None, seed: int | None) -> None:
    """Refuse bad sampling settings, and ones greedy decoding would silently ignore."""
    from rag_lookahead.decoding.sampling import SamplingParams

    if not temperature:
        ignored = [name for name, value in (("--top-p", top_p), ("--seed", seed)) if value is not None]
        if ignored:
            verb, them = ("apply", "them") if len(ignored) > 1 else ("applies", "it")
            raise ConfigError(
                f"{' and '.join(ignored)} {verb} only when sampling; greedy decoding (--temperature 0, the"
                f" default) would ignore {them}: add --temperature, e.g. 0.7"
            )
        return
    SamplingParams(do_sample=True, temperature=temperature, top_p=1.0 if top_p is None else top_p, seed=seed)


class StdoutClosed(BaseException):
    """stdout could not take the streamed answer: its reader went away (``ask --stream | head``),
    or the write failed (a full disk: ``> /dev/full``); ``error`` says which. Not an
    ``Exception``: LangChain's callback manager logs and swallows those, once per block, and the
    decode went on to --max-new-tokens with nobody reading."""

    def __init__(self, error: OSError | ValueError) -> None:
        super().__init__(str(error))
        self.error = error


def silence_stdout() -> None:
    """stdout's reader went away: point stdout at /dev/null, so Python's final flush at exit does
    not print a BrokenPipeError of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives until exit)


def token_printer():
    """A callback handler that prints each accepted block of the answer as it is decoded."""
    from langchain_core.callbacks import BaseCallbackHandler

    class _Print(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            try:
                sys.stdout.write(token)
                sys.stdout.flush()
            except (OSError, ValueError) as e:  # ValueError: a closed file
                raise StdoutClosed(e) from e

    return _Print()


def print_result(result: dict, streamed: bool) -> None:
    """The answer (unless it was ``streamed``), its sources and the decoding stats, for a terminal."""
    from rich.console import Console
    from rich.text import Text

    # soft_wrap: lines are never broken at the console's width (80 when piped), so `ask ... > file`
    # holds the answer as the model wrote it; a terminal wraps long lines itself
    console = Console(soft_wrap=True, emoji=False)
    sys.stdout.write(("" if streamed else result["answer"]) + "\n")
    sys.stdout.flush()
    console.print()
    console.print("[bold]Sources[/bold]")
    for i, s in enumerate(result["sources"], start=1):
        mark = ("", "") if s.get("in_prompt") else (" (seed only)", "dim")
        # Text pieces, not markup: escape() doubles a backslash that ends a snippet (C:\Tools\)
        line = Text.assemble(f"  [{i}] ", (one_line(str(s["source"])), "cyan"), mark, ": ", one_line(s["snippet"]))
        console.print(line)
    st = result["stats"]
    console.print()
    console.print(
        f"[bold]Stats[/bold] {st.get('new_tokens', 0)} tokens, {st.get('tokens_per_second', 0.0):.2f} tok/s,"
        f" mean accepted {st.get('mean_accepted', 0.0):.2f} tokens/forward,"
        f" {st.get('forward_passes', 0)} forward passes,"
        f" lookahead {'on' if st.get('lookahead') else 'off'}"
    )


def main(argv: list[str] | None = None, *, own_process: bool = False) -> None:
    """``python -m rag_lookahead.ask QUESTION [options]``: the ``rag_lookahead ask`` command on its own."""
    from rag_lookahead.interrupts import command_interrupts

    with command_interrupts(own_process) as imported:  # the command imports torch first
        import typer

        from rag_lookahead.cli import ask_command

        imported()
        app = typer.Typer(add_completion=False)
        app.command()(ask_command)
        app(args=argv, prog_name="python -m rag_lookahead.ask")


if __name__ == "__main__":
    main(own_process=True)
