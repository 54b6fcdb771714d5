"""``rag_lookahead index | ask | bench | serve``.

Errors the user can fix (``RagLookaheadError``) print as one red line and exit 1.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

from rag_lookahead.ask import ask_command, fail
from rag_lookahead.errors import RagLookaheadError
from rag_lookahead.rag.index import LOCK_TIMEOUT_S, MAX_FILE_MB

app = typer.Typer(
    name="rag_lookahead",
    help="Lossless lookahead decoding for local retrieval-augmented generation.",
    add_completion=False,
    no_args_is_help=True,
)

app.command("ask")(ask_command)

_FORWARD = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command("index")
def index_command(
    corpus_dir: Path = typer.Argument(..., help="Folder of .txt/.md/.pdf files (searched recursively)."),
    index_dir: Path | None = typer.Option(
        None, "--index-dir", help="Index folder: new, empty, or an index built before (default: default_index_dir())."
    ),
    embedder: str | None = typer.Option(
        None, "--embedder", help="e5-small (default), use, or a sentence-transformers name."
    ),
    follow_symlinks: bool = typer.Option(
        False, "--follow-symlinks", help="Index the targets of symbolic links (off: links are skipped and reported)."
    ),
    max_file_mb: float = typer.Option(MAX_FILE_MB, "--max-file-mb", help="Skip (and report) files larger than this."),
    lock_timeout: float = typer.Option(
        LOCK_TIMEOUT_S, "--lock-timeout", help="Seconds to wait while another run writes the same index, then fail."
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Build or incrementally update the document index."""
    from rag_lookahead.rag.index import build_index

    try:
        report = build_index(
            corpus_dir,
            index_dir,
            embedder,
            progress=not no_progress,
            follow_symlinks=follow_symlinks,
            max_file_mb=max_file_mb,
            lock_timeout=lock_timeout,
        )
    except RagLookaheadError as e:
        fail(e)
    typer.echo(report.summary())


def _forward(module: str, ctx: typer.Context, what: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            fail(
                RagLookaheadError(f"`rag_lookahead {what}` is not available in this installation ({module} is missing)")
            )
        raise
    try:
        rc = mod.main(list(ctx.args))
    except RagLookaheadError as e:
        fail(e)
    raise typer.Exit(rc if isinstance(rc, int) and not isinstance(rc, bool) else 0)


@app.command("bench", context_settings=_FORWARD, add_help_option=False)
def bench_command(ctx: typer.Context) -> None:
    """Side-by-side benchmark (arguments go to rag_lookahead.bench.single; try `bench --help`)."""
    _forward("rag_lookahead.bench.single", ctx, "bench")


@app.command("gpu-check", context_settings=_FORWARD, add_help_option=False)
def gpu_check_command(ctx: typer.Context) -> None:
    """Exactness, speed and stress check of this machine's accelerator (arguments go to rag_lookahead.bench.gpu_check)."""
    _forward("rag_lookahead.bench.gpu_check", ctx, "gpu-check")


@app.command("serve", context_settings=_FORWARD, add_help_option=False)
def serve_command(ctx: typer.Context) -> None:
    """OpenAI-compatible server (arguments go to rag_lookahead.serve.server; try `serve --help`)."""
    _forward("rag_lookahead.serve.server", ctx, "serve")


if __name__ == "__main__":
    app()
