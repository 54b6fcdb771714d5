"""Ask a question over the local index: ``python -m rag_lookahead.ask "decoding_length 应该怎么设置？"``.

The first run indexes the bundled ``corpora/`` into the index folder (default
``$RAG_LOOKAHEAD_HOME/index`` or ``~/.local/share/rag_lookahead/index``), then every run retrieves
passages, answers with the lookahead LLM, and prints the answer, its sources and the decoding
stats. ``--json`` prints one JSON object instead. Same options as ``rag_lookahead ask``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from rag_lookahead.errors import InputError, RagLookaheadError

__all__ = ["bundled_corpus", "ensure_index", "answer", "ask_command", "main"]


def bundled_corpus() -> Path:
    """The sample corpus: shipped inside the package if it was packaged, else the repository's ``corpora/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "corpora", here.parent / "corpora"):
        if candidate.is_dir():
            return candidate
    raise InputError(
        "no index yet and the bundled corpora/ folder was not found: build an index with `rag_lookahead index DIR`"
    )


def ensure_index(index_dir: Path, *, quiet: bool = False):
    """Load the index at ``index_dir``; build it from the bundled corpus first if there is none
    (``build_index`` refuses a non-empty folder that is not an index, so nothing of the user's is touched)."""
    from rag_lookahead.rag.index import MANIFEST, build_index, load_index

    if not (index_dir / MANIFEST).is_file():
        corpus = bundled_corpus()
        if not quiet:
            print(f"rag_lookahead: no index at {index_dir}; indexing the bundled corpus {corpus}", file=sys.stderr)
        report = build_index(corpus, index_dir, progress=not quiet)
        if not quiet:
            print(f"rag_lookahead: {report.summary()}", file=sys.stderr)
    return load_index(index_dir)


def answer(
    question: str,
    *,
    index_dir: Path | None = None,
    model: str = "default",
    k: int = 3,
    k_seed: int = 8,
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
    from rag_lookahead.rag.chains import build_rag_chain
    from rag_lookahead.rag.index import default_index_dir

    if not isinstance(question, str) or not question.strip():
        raise InputError(
            'the question is empty: ask something, e.g. rag_lookahead ask "decoding_length 应该怎么设置？"'
        )
    index = ensure_index(Path(index_dir).expanduser() if index_dir else default_index_dir(), quiet=quiet)
    if llm is None:
        from rag_lookahead.langchain.llm import LookaheadLLM

        placement = {"dtype": dtype, "device": device, "device_map": device_map}
        if trust_remote_code:  # an explicit opt-in: the model repo's own code runs
            from rag_lookahead.models import load_model

            loaded, tokenizer = load_model(model, trust_remote_code=True, **placement)
            llm = LookaheadLLM(model=loaded, tokenizer=tokenizer, model_name=str(model), max_new_tokens=max_new_tokens)
        else:
            llm = LookaheadLLM.from_model_id(model, max_new_tokens=max_new_tokens, **placement)
    chain = build_rag_chain(llm, index, k_prompt=k, k_seed=max(k, k_seed))
    sampling = {"temperature": temperature, "top_p": top_p, "seed": seed}
    result = chain.invoke(
        {"question": question, "enable_lookahead": lookahead, "max_new_tokens": max_new_tokens}
        | {name: value for name, value in sampling.items() if value is not None},
        config={"callbacks": callbacks} if callbacks else None,
    )
    return {"question": question.strip(), **result}


def _stream_handler():
    from langchain_core.callbacks import BaseCallbackHandler

    class _Print(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            sys.stdout.write(token)
            sys.stdout.flush()

    return _Print()


def _print_result(result: dict, streamed: bool) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if streamed:
        sys.stdout.write("\n")
    else:
        console.print(escape(result["answer"]))
    console.print()
    console.print("[bold]Sources[/bold]")
    for i, s in enumerate(result["sources"], start=1):
        mark = "" if s.get("in_prompt") else " [dim](seed only)[/dim]"
        console.print(f"  [{i}] [cyan]{escape(str(s['source']))}[/cyan]{mark}: {escape(s['snippet'])}")
    st = result["stats"]
    console.print()
    console.print(
        f"[bold]Stats[/bold] {st.get('new_tokens', 0)} tokens, {st.get('tokens_per_second', 0.0):.2f} tok/s,"
        f" mean accepted {st.get('mean_accepted', 0.0):.2f} tokens/forward, {st.get('forward_passes', 0)} forward passes,"
        f" lookahead {'on' if st.get('lookahead') else 'off'}"
    )


def ask_command(
    question: str = typer.Argument(..., help="The question (any language the model speaks)."),
    index_dir: Path | None = typer.Option(None, "--index-dir", help="Index folder (default: default_index_dir())."),
    model: str = typer.Option("default", "--model", help='"default", a hub id or a local model folder.'),
    k: int = typer.Option(3, "--k", min=1, help="Passages put into the prompt."),
    k_seed: int = typer.Option(8, "--k-seed", min=1, help="Passages retrieved to seed the draft trie (>= --k)."),
    stream: bool = typer.Option(False, "--stream", help="Print the answer as it is decoded."),
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
        None, "--dtype", help="bf16, fp16 or fp32 (default: bf16 where fast, fp16 on older GPUs)."
    ),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)."),
    device_map: str | None = typer.Option(
        None, "--device-map", help='accelerate device map, e.g. "auto" for several GPUs.'
    ),
) -> None:
    """Answer a question from the indexed documents (indexes the bundled corpus on first use)."""
    try:
        streaming = stream and not as_json
        result = answer(
            question,
            index_dir=index_dir,
            model=model,
            k=k,
            k_seed=k_seed,
            lookahead=not no_lookahead,
            max_new_tokens=max_new_tokens,
            callbacks=[_stream_handler()] if streaming else None,
            quiet=as_json,
            temperature=temperature or None,
            top_p=top_p,
            seed=seed,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            device=device,
            device_map=device_map,
        )
    except RagLookaheadError as e:
        fail(e)
    if as_json:
        out = dict(result)
        out["sources"] = [{k: v for k, v in s.items() if k != "text"} for s in result["sources"]]
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
    else:
        _print_result(result, streaming)


def fail(error: BaseException) -> None:
    """Print ``error`` as one red line on stderr and exit 1."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(
        f"[red]error: {escape(str(error).splitlines()[0] if str(error) else type(error).__name__)}[/red]",
        soft_wrap=True,
    )
    raise typer.Exit(1)


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False)
    app.command()(ask_command)
    app(args=argv, prog_name="python -m rag_lookahead.ask")


if __name__ == "__main__":
    main()
