"""What the benchmarks share: prompts, chat ids, model options and loading, EOS/pad, tables, typer entry.

One copy of each so the benchmarks cannot drift apart: they once picked the pad id differently,
and two of them carried their own ``cut_at_eos``. EOS, pad and chat encoding come from
:mod:`rag_lookahead.tokens`, as in the server and the LangChain wrapper.
"""

from __future__ import annotations

import contextvars
import copy
import errno
import functools
import importlib.util
import json
import os
import resource
import sys
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import EllipsisType
from typing import Annotated, Any, NoReturn

import torch
import typer

from rag_lookahead.bench import plots
from rag_lookahead.bench.kernels import transformers_kernels
from rag_lookahead.checks import positive_int
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.costs import recalibrate_asked
from rag_lookahead.decoding.inputs import context_limit, limit_words
from rag_lookahead.decoding.loop import left_pad
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.verify import input_device
from rag_lookahead.errors import (
    SURROGATE,
    ConfigError,
    InputError,
    RagLookaheadError,
    first_line,
    quoted_path,
    shown_path,
)
from rag_lookahead.file_reads import PROMPT_SETS, jsonl_lines, shipped_text
from rag_lookahead.interrupts import program_imported
from rag_lookahead.output_files import FileState, PathTaken, check_output_file, is_report, save_report
from rag_lookahead.paths import expand_user, refuse_blank_path
from rag_lookahead.rag.corpus import read_input_text
from rag_lookahead.tokens import encode_messages, eos_ids, pad_id

__all__ = [
    "BranchLengthOption",
    "DeviceMapOption",
    "DeviceOption",
    "DtypeOption",
    "ExtraBranchLengthOption",
    "IdsOption",
    "JsonOption",
    "ModelOption",
    "PlotOption",
    "PromptsOption",
    "TrustRemoteCodeOption",
    "chat_ids",
    "check_bench_model",
    "check_method_list",
    "check_output_path",
    "check_plot",
    "check_positive",
    "context_fitted_ids",
    "checked_config",
    "accepted",
    "copied_fraction",
    "cut_at_eos",
    "eos_pad",
    "extra_depth_methods",
    "fresh_acceptance",
    "given_or_temporary_index",
    "hf_batched",
    "jsonl_lines",
    "jsonl_object",
    "load_bench_model",
    "load_prompts",
    "peak_rss_gb",
    "print_rows",
    "prompts_file",
    "keeps_report_despite_stdout",
    "report_despite_stdout",
    "run_record",
    "same_answer",
    "run_command",
    "write_report",
]

# ---------------------------------------------------------------- options several benchmarks take

ModelOption = Annotated[str, typer.Option("--model", help='"default", "quality", a hub id or a local model folder')]
DtypeOption = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="bf16, fp16, fp32 or auto (GPU: bf16 where native, else fp16; CPU: bf16 only with AMX)",
    ),
]
DeviceOption = Annotated[
    str | None, typer.Option("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
]
DeviceMapOption = Annotated[
    str | None, typer.Option("--device-map", help='accelerate device map, e.g. "auto" to spread over GPUs')
]
PROMPTS_HELP = (
    f"a prompt set shipped with the package ({', '.join(PROMPT_SETS)}; default: bundled) "
    "or a JSONL file with context/question per line"
)
PromptsOption = Annotated[str | None, typer.Option("--prompts", help=PROMPTS_HELP)]
JsonOption = Annotated[str | None, typer.Option("--json", help="write the results here")]
TrustRemoteCodeOption = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="run the modeling code a model repo or folder ships (ChatGLM3, Qwen-1); only for sources you trust",
    ),
]
IdsOption = Annotated[str | None, typer.Option("--ids", help="use only these prompt ids (comma-separated)")]
BranchLengthOption = Annotated[int, typer.Option("--branch-length")]
ExtraBranchLengthOption = Annotated[
    str,
    typer.Option(
        "--extra-branch-length",
        help="also run lookahead with these branch_lengths (comma-separated; methods lookahead_bN), side by side",
    ),
]
PlotOption = Annotated[
    bool, typer.Option("--plot", help="also write PNG charts next to the --json file (needs matplotlib)")
]

DEFAULT_BRANCH_LENGTH = LookaheadConfig.branch_length


def run_command(command: Callable[..., Any], argv: Sequence[str] | None, prog_name: str) -> Any:
    """Run a typer command function on ``argv`` (None: the process's arguments) and return its value.

    Why not ``typer.run``: callers such as ``rag_lookahead bench`` and the tests want the report
    back. A ``typer.Exit`` the command raises gives its exit code; ``--help`` gives 0; a usage
    error is printed the typer way and exits 2 (SystemExit); one of our errors (:class:`RagLookaheadError`)
    prints as one line and exits 1.
    """
    returned: list[Any] = []

    @functools.wraps(command)
    def keep_result(*args: Any, **kwargs: Any) -> None:
        # within typer's handling, which ends a KeyboardInterrupt with 130: a Ctrl-C from here raises
        # one (before, the program's imports' handler exits 130; called outside typer, one that
        # landed as the handlers switched escaped as a traceback)
        program_imported()
        try:
            returned.append(command(*args, **kwargs))
        except typer.Exit as done:
            returned.append(done.exit_code)
            raise
        except RagLookaheadError as e:  # something the user can fix: one line, no traceback
            raise SystemExit(f"error: {first_line(e)}") from None

    app = typer.Typer(add_completion=False)
    app.command()(keep_result)
    try:
        typer.main.get_command(app).main(args=None if argv is None else list(argv), prog_name=prog_name)
    except SystemExit as done:
        if returned:
            return returned[0]
        if done.code in (0, None):
            return 0
        raise
    return returned[0] if returned else 0


def check_plot(plot: bool, json_path: str | None, charts: Sequence[str] = ()) -> None:
    """Refuse ``--plot`` without ``--json`` (the charts go next to it), without matplotlib, or where
    one of its ``charts`` would replace a file we did not draw for this report (another report's
    chart too: see ``plots.check_chart``), before any model is loaded rather than after a long run."""
    if not plot:
        return
    if not json_path:
        raise typer.BadParameter("the charts are written next to the --json file: give --json too", param_hint="--plot")
    if importlib.util.find_spec("matplotlib") is None:
        raise typer.BadParameter(
            "needs matplotlib: pip install 'rag-lookahead[plot]' (or: pip install matplotlib)", param_hint="--plot"
        )
    for name in charts:
        plots.check_chart(plots.chart_path(json_path, name), json_path, "--plot")


def check_positive(options: Mapping[str, int | None]) -> None:
    """Refuse any option (name -> value; None: not given) below 1, before any model is loaded."""
    for name, value in options.items():
        if value is not None:
            positive_int(name, value)


def passage_counts(k_prompt: int, k_seed: int | None) -> int:
    """``--k-seed`` as the RAG benchmarks use it (not given: the larger of ``--k-prompt`` and 8, as
    ``ask`` takes it), checked with ``--k-prompt`` before any model or index loads."""
    from rag_lookahead.rag.chains import seed_count

    return seed_count(k_prompt, k_seed, names=("--k-prompt", "--k-seed"))


def check_method_list(chosen: Sequence[str], extra_depths: Mapping[str, int], methods: str, branch_length: int) -> None:
    """``--methods`` (with ``--extra-branch-length``) must name a method, and none twice: an extra
    depth equal to ``--branch-length`` beside ``lookahead`` would run lookahead twice."""
    if not chosen and not extra_depths:
        raise typer.BadParameter(f"names no method: {methods!r}", param_hint="--methods")
    if len(set(chosen)) < len(chosen):
        raise typer.BadParameter(f"names a method twice: {methods!r}", param_hint="--methods")
    if "lookahead" in chosen and branch_length in extra_depths.values():
        raise typer.BadParameter(
            f"{branch_length} is --branch-length, which the method lookahead runs already",
            param_hint="--extra-branch-length",
        )


#: what a tiny-model smoke run (``bench.interference --tiny``, ``gpu_check --tiny-only``) replaces,
#: and the values it runs with: an option given another value with it was ignored, unsaid (the
#: report's settings still recorded it). Each command names those its run replaces.
_TINY_REPLACES = {
    "prompts": ((None,), "--prompts", "its prompts are random tokens"),
    "model": (("default",), "--model", "it runs tiny random models only"),
    "device_map": ((None,), "--device-map", "the tiny models run whole on --device"),
    "dtype": (("auto", "fp32", "float32"), "--dtype", "the tiny model runs in fp32"),
    "device": ((None, "cpu"), "--device", "the tiny model runs on the CPU"),
    "trust_remote_code": ((False,), "--trust-remote-code", "tiny random models ship no code of their own"),
}


def refuse_with_tiny(flag: str, **given: str | bool | None) -> None:
    """A usage error for an option the tiny run of ``flag`` replaces (see ``_TINY_REPLACES``) given
    with it, unless its value is what the tiny run uses anyway (``--device cpu``, ``--dtype fp32``)."""
    for name, value in given.items():
        kept, option, why = _TINY_REPLACES[name]
        if (value.strip().lower() if isinstance(value, str) else value) not in kept:
            raise typer.BadParameter(f"does not apply with {flag} ({why})", param_hint=option)


@contextmanager
def given_or_temporary_index(index_dir: str | None, build: Callable[[Path], Any], prefix: str) -> Iterator:
    """The index at ``index_dir``; without one, what ``build(folder)`` makes in a temporary folder
    (named from ``prefix``) that is removed when the block ends. A blank ``index_dir`` is refused
    (an unset variable ran on the temporary index)."""
    from rag_lookahead.rag.index import load_index

    if index_dir is not None:
        refuse_blank_path(index_dir, "--index-dir", "name an index, or leave the option out")
        yield load_index(Path(index_dir))
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield build(Path(folder))


def check_output_path(
    path: str | None, option: str = "--json", inputs: Sequence[str | None] = ()
) -> FileState | EllipsisType:
    """Refuse a report path that could not be written or would replace a file the benchmarks did not
    write (see ``output_files``; ``inputs``: the run's own input files), before the run rather than
    after it. Returns what is at the path now (``...`` without a path), for :func:`write_report`'s
    ``seen``: a report another run writes there meanwhile is then kept, not replaced unsaid."""
    if path is None:
        return ...
    return check_output_file(path, option, ours=is_report, inputs=inputs)


def extra_depth_methods(extra_branch_length: str) -> dict[str, int]:
    """The extra methods asked for with ``--extra-branch-length``, ``lookahead_bN`` -> N."""
    try:
        depths = [int(n) for n in extra_branch_length.split(",") if n.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"takes integers separated by commas, not {extra_branch_length!r}", param_hint="--extra-branch-length"
        ) from None
    if len(set(depths)) < len(depths):  # the dict below would merge them without a word
        raise typer.BadParameter(
            f"names a branch length twice: {extra_branch_length!r}", param_hint="--extra-branch-length"
        )
    return {f"lookahead_b{n}": n for n in depths}


def checked_config(extra_depths: Mapping[str, int], methods: Sequence[str], **settings: Any) -> LookaheadConfig:
    """``LookaheadConfig(**settings)``, with each ``--extra-branch-length`` depth tried on it, so
    that a bad value fails before the model loads (add the tokenizer's stop words after); so does a
    ``RAG_LOOKAHEAD_RECALIBRATE`` that is neither yes nor no, where one of ``methods`` (the methods
    to run) decodes with lookahead on ``budget="auto"``, which reads it (the first lookahead decode
    refused it, after the model loaded). Only the ``lookahead*`` methods do: transformers' methods,
    ``plain`` and ``prompt_lookup_ours`` (budget fixed) never read it, and were refused it."""
    config = LookaheadConfig(**settings)
    if config.budget == "auto" and any(m.startswith("lookahead") for m in methods):
        recalibrate_asked()
    for depth in extra_depths.values():
        config.replace(branch_length=depth)
    return config


# ---------------------------------------------------------------- model, prompts, tokens


def _loader_dtype(dtype: Any) -> Any:
    """The ``--dtype`` option as ``load_model`` takes it (``"auto"``: None, the loader picks)."""
    return None if dtype == "auto" else dtype


def check_bench_model(
    model: str, dtype: Any, device: str | None, device_map: str | None, trust_remote_code: bool = False
) -> None:
    """Refuse now what :func:`load_bench_model` would refuse before reading any weights (a model name
    that is no embedded model, local folder or hub id; a hub id out of reach and not in the cache; an
    embedded model not installed; an unknown dtype; a device torch does not see), and a
    ``RAG_LOOKAHEAD_RECALIBRATE`` that is neither yes nor no, which the first lookahead decode
    refused. For the benchmarks that index a corpus before the model loads (``bench.rag``,
    ``bench.session``, ``bench.quality``): they said ``--dtype bf17`` or ``--device cuda`` without
    a GPU only after 23-45 s of indexing, as ``ask`` once did."""
    from rag_lookahead.models import check_load_options

    recalibrate_asked()
    check_load_options(
        model,
        dtype=_loader_dtype(dtype),
        device=device,
        device_map=device_map,
        hub=True,
        trust_remote_code=trust_remote_code,
    )


def load_bench_model(
    model: str, dtype: Any, device: str | None, device_map: str | None, trust_remote_code: bool = False, **extra: Any
):
    """The model and tokenizer the options name (``dtype="auto"``: the loader picks;
    ``trust_remote_code``: ``--trust-remote-code``, run the modeling code a folder or hub repo ships)."""
    from rag_lookahead.models import load_model

    return load_model(
        model,
        dtype=_loader_dtype(dtype),
        device=device,
        device_map=device_map,
        trust_remote_code=trust_remote_code,
        **extra,
    )


_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_label(model, asked: Any) -> str:
    """The dtype a report measured: the model's own, and the option where the loader chose it
    ("fp32 (auto)": auto is bf16 only on CPUs with AMX, so the option alone did not say)."""
    name = str(model.dtype).removeprefix("torch.")
    name = _DTYPE_NAMES.get(name, name)
    return f"{name} (auto)" if asked in (None, "auto") else name


def draft_shape(model) -> str:
    """What our loop drafted on ``model`` in this process: "trees", or "single chains" with the tree-mask
    probe's reason (a mask-blind attention, or a probe that failed on this machine), "not probed"
    if no lookahead run asked. Reports carry it, so a run that fell back to chains says so."""
    profile = profile_of(model)
    if profile.tree_mask is None:
        return "not probed"
    return "trees" if profile.tree_mask else f"single chains ({profile.tree_mask_reason})"


def chains_note(shape: str) -> str:
    """A table title's warning when a run drafted single chains, else nothing."""
    return f", drafts: {shape}" if shape.startswith("single chains") else ""


def eos_pad(model, tokenizer) -> tuple[list[int], int]:
    """The ids that end an answer (sorted) and the pad id, read as every front end reads them."""
    eos = eos_ids(model, tokenizer)
    return sorted(eos), pad_id(model, tokenizer, eos)


def load_prompts(path: str | None, ids: str | None = None) -> list[dict]:
    """The prompt set (default: the bundled one), optionally only the comma-separated ``ids``.

    ``path`` is the name of a set shipped in the package (:data:`PROMPT_SETS`, read wherever the
    process runs; a name comes before a file of that name, as in ``bench.retrieval --dataset``) or a
    file. Each line of a ``--prompts`` file is a JSON object with a ``question`` (a non-empty string)
    and a ``context`` (the passage, a string; may be empty; or ``passage``), optionally an ``id`` (a
    string), a ``reference`` answer and anything else. A line without an ``id`` gets ``line-N``.
    Reports and charts group by id, so no two prompts may share one, and ``ids`` selects by id, so
    an id must be one it can name (not empty, no comma, no whitespace at either end). A file that breaks these
    rules raises :class:`InputError` naming the first bad line, so the benchmarks check it before
    loading a model. An empty ``path`` is refused: it is no file, not a wish for the bundled set.
    """
    path = "bundled" if path is None else path
    text = shipped_text(PROMPT_SETS, path)
    if text is not None:
        name = f"the {path} prompts"
    else:
        text, name = _prompts_file_text(path), shown_path(path)  # a newline in it: the error was cut there
    prompts = _read_prompts(text, name)
    if not prompts:
        raise InputError(f"{name}: no prompts (one JSON object with context and question per line)")
    if ids is not None:
        wanted = [i.strip() for i in ids.split(",") if i.strip()]
        if not wanted:
            raise InputError(f"--ids {ids!r} names no prompt id (give ids separated by commas)")
        unknown = sorted(set(wanted) - {p["id"] for p in prompts})
        if unknown:
            raise InputError(f"unknown prompt ids: {', '.join(unknown)}")
        prompts = [p for p in prompts if p["id"] in wanted]
    return prompts


def prompts_file(path: str | None) -> str | None:
    """The file ``--prompts`` names: None for a shipped set's name (no file of the run's, then)."""
    return None if path is None or path in PROMPT_SETS else path


def _prompts_file_text(path: str) -> str:
    """The text of a ``--prompts`` file; :class:`InputError` saying why not, and the names of the
    shipped sets where nothing is at the path (a misspelt name, or a path to them from another folder)."""
    refuse_blank_path(
        path, "--prompts", "name a file or a shipped set, or leave the option out for the bundled prompts"
    )
    try:
        return read_input_text(path)
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError, so is a ~ naming no user
        why = getattr(e, "strerror", None) or str(e)
        if not isinstance(e, ConfigError) and _nothing_at(expand_user(path, "--prompts")):
            why = f"no such file, and no prompt set shipped with the package has that name ({', '.join(PROMPT_SETS)})"
        raise InputError(f"cannot read the prompts file {quoted_path(path)}: {why}") from None


def _nothing_at(path: Path) -> bool:
    """True where no file is at ``path``; False where one may be but cannot be seen (a folder one
    may not search: its reason, Permission denied, is the one to give)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def _read_prompts(text: str, name: str) -> list[dict]:
    """The prompts of a ``--prompts`` text, each checked, and no id given twice: a given id and the
    ``line-N`` of a line without one may not meet either."""
    prompts, first_line_of = [], {}
    for n, line in jsonl_lines(text):
        prompt = _prompt(line, n, name)
        first = first_line_of.setdefault(prompt["id"], n)
        if first != n:
            raise InputError(
                f"{name}: line {n}: the prompt id {prompt['id']!r} is line {first}'s too (a line without an id "
                "is named line-N); give each prompt an id of its own"
            )
        prompts.append(prompt)
    return prompts


def jsonl_object(line: str, where: str, fields: str) -> dict:
    """One line of a JSONL input file as a JSON object, else :class:`InputError` saying ``where``
    (e.g. ``"prompts.jsonl: line 3"``) and which ``fields`` the object should have. An escaped
    unpaired surrogate (``"\\ud800"``) is refused here too: it is no character, and the run that
    took it died printing or saving it, after the model had loaded. A line nested past Python's
    recursion limit (``[[[[...``) is refused in one line too: it raised RecursionError, a traceback."""
    try:
        value = json.loads(line)
        # its strings, keys too, in one text (the dump recurses as well: a line just under the
        # parser's limit went past it here)
        text = json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else ""
    except ValueError as e:
        raise InputError(f"{where} is not JSON ({e})") from None
    except RecursionError:
        raise InputError(f"{where} is nested too deeply to read ({fields})") from None
    if not isinstance(value, dict):
        raise InputError(f"{where} is not a JSON object ({fields})")
    lone = SURROGATE.search(text)
    if lone is not None:
        raise InputError(
            f"{where} holds {ascii(lone.group())}, an unpaired UTF-16 surrogate, which is no character "
            "(write the character itself, or both halves of its pair)"
        )
    return value


def _prompt(line: str, lineno: int, name: str) -> dict:
    """One ``--prompts`` line, checked (see :func:`load_prompts`)."""
    prompt = jsonl_object(line, f"{name}: line {lineno}", "context, question")
    if "context" not in prompt and "passage" in prompt:  # the retrieval sets' name for it
        prompt["context"] = prompt["passage"]
    for key, may_be_empty in (("context", True), ("question", False)):
        value = prompt.get(key)
        if not isinstance(value, str) or not (may_be_empty or value.strip()):
            keys = ", ".join(sorted(prompt)) or "none"
            raise InputError(
                f"{name}: line {lineno} needs {key!r} as a {'string' if may_be_empty else 'non-empty string'} "
                f"(its keys: {keys})"
            )
    given = prompt.get("id")
    if given is not None and (isinstance(given, bool) or not isinstance(given, str | int)):
        raise InputError(f"{name}: line {lineno}: the id must be a string or an integer, not {json.dumps(given)}")
    prompt["id"] = str(given) if given is not None else f"line-{lineno}"  # 1 and "1" meet as duplicates
    if prompt["id"] != prompt["id"].strip() or not prompt["id"] or "," in prompt["id"] or "\x00" in prompt["id"]:
        # --ids splits at commas and trims each id (and no argument holds a NUL): such a prompt
        # ran only with every other one
        raise InputError(
            f"{name}: line {lineno}: the prompt id {prompt['id']!r} could never be chosen with --ids (ids separated "
            "by commas, whitespace trimmed): give one that is not empty, holds no comma or NUL and neither starts nor "
            "ends with whitespace"
        )
    return prompt


def chat_ids(tokenizer, prompt: dict, *, with_context: bool = True) -> list[int]:
    """The prompt (passage, blank line, question; or the question alone) as the chat's user turn."""
    content = f"{prompt['context']}\n\n{prompt['question']}" if with_context else prompt["question"]
    return encode_messages(tokenizer, [{"role": "user", "content": content}])


def context_fitted_ids(
    model,
    tokenizer,
    prompts: Sequence[dict],
    max_new_tokens: int,
    *,
    with_context: bool = True,
    flag: str = "--max-new-tokens",
) -> list[list[int]]:
    """Each prompt's chat ids (as :func:`chat_ids` builds them), once every prompt with an answer of
    ``max_new_tokens`` fits the model's context; else :class:`InputError` naming the longest prompt
    and what to do. Why before any timed run: lookahead stopped mid-run at a prompt that did not
    fit, after the others were measured, naming none; and past the window transformers decodes on
    where our loop stops, so the tables compared answers of unequal length."""
    ids = [chat_ids(tokenizer, prompt, with_context=with_context) for prompt in prompts]
    limit = context_limit(model)
    longest = max(range(len(ids)), key=lambda n: len(ids[n]), default=None)
    if limit is None or longest is None or len(ids[longest]) + max_new_tokens <= limit:
        return ids
    over = sum(len(i) + max_new_tokens > limit for i in ids)
    room = limit - len(ids[longest])
    fix = (
        f"an answer of {flag} {max_new_tokens} does not fit; lower it to {room} or drop the prompt"
        if room > 0
        else "no room is left for an answer; drop the prompt"
    )
    raise InputError(
        f"prompt {prompts[longest]['id']!r}{f' (and {over - 1} more)' if over > 1 else ''} is {len(ids[longest])} "
        f"tokens with the chat template, and the model's context holds {limit_words(model, limit)}, prompt and "
        f"answer together: {fix}"
    )


def prompts_then_model(
    prompts: str | None,
    ids: str | None,
    limit: int | None,
    max_new_tokens: int,
    json_path: str | None,
    model: str,
    dtype: Any,
    device: str | None,
    device_map: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[list[dict], Any, Any, LookaheadConfig, FileState | EllipsisType]:
    """The chosen prompts, then the model, its tokenizer and the drafter config ``bench`` runs (the
    tokenizer's stop words too), and what the report's path held (:func:`check_output_path`); bad
    options and files fail before the model loads, prompts that do not fit its context
    (:func:`context_fitted_ids`) right after."""
    check_positive({"--limit": limit, "--max-new-tokens": max_new_tokens})
    recalibrate_asked()  # a bad value, said now: the first lookahead decode read it, after the model loaded
    seen = check_output_path(json_path, inputs=[prompts_file(prompts)])
    chosen = load_prompts(prompts, ids)[:limit]
    loaded, tokenizer = load_bench_model(model, dtype, device, device_map, trust_remote_code)
    context_fitted_ids(loaded, tokenizer, chosen, max_new_tokens)
    return chosen, loaded, tokenizer, LookaheadConfig().with_tokenizer(tokenizer), seen


def fresh_pool_answers(model, tokenizer, prompts: Sequence[dict], config: LookaheadConfig, max_new_tokens: int):
    """Each prompt's chat ids and our loop's greedy result (lossless), each with a fresh output
    pool, so that no answer drafts from another's; yielded one prompt at a time."""
    from rag_lookahead.decoding.loop import generate
    from rag_lookahead.decoding.trie import OutputPool

    eos, pad = eos_pad(model, tokenizer)
    for prompt in prompts:
        ids = chat_ids(tokenizer, prompt)
        result = generate(
            model,
            ids,
            max_new_tokens=max_new_tokens,
            config=config,
            eos_token_id=eos,
            pad_token_id=pad,
            output_pool=OutputPool(config.pool_depth),
        )
        yield ids, result


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` starting at ``shift`` (modulo their count). The benchmarks turn their methods' order
    from one prompt (or pass) to the next: on a machine whose speed drifts within minutes, and
    where the run before leaves caches warm or cold, a method always run first or last is
    favoured or penalised in every comparison."""
    if not items:
        return []
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def in_turn(keys: Sequence[Any], shift: int, run: Callable[..., Any], *args: Any) -> dict[Any, Any]:
    """``run(key, *args)`` for every key, in the order :func:`rotated` gives for ``shift``; the
    results keyed in the order of ``keys``, so reports list them as asked whatever order they ran in."""
    ran = {key: run(key, *args) for key in rotated(keys, shift)}
    return {key: ran[key] for key in keys}


def decode_speed(stats: Iterable[dict]) -> float:
    """Decode tokens/s over runs' stats (``new_tokens``, ``decode_seconds``): the tokens after each
    answer's first, which comes with the prefill, over the time after it."""
    stats = list(stats)
    tokens = sum(max(s.get("new_tokens", 0) - 1, 0) for s in stats)
    seconds = sum(s.get("decode_seconds", 0.0) for s in stats)
    return tokens / seconds if seconds else 0.0


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GiB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_record(result: dict) -> dict:
    """What one answer contributes to a block: its tokens, decode time and decode forwards."""
    stats = result["stats"]
    return {
        "new_tokens": stats.get("new_tokens", 0),
        "decode_seconds": stats.get("decode_seconds", 0.0),
        "steps": stats.get("forward_passes", 0),
    }


def accepted(records: Sequence[dict]) -> float:
    """Tokens after each answer's first (which comes with the prefill) per decode forward."""
    steps = sum(r["steps"] for r in records)
    return sum(max(r["new_tokens"] - 1, 0) for r in records) / steps if steps else 0.0


@contextmanager
def fresh_acceptance(model, clear: bool = True) -> Iterator[None]:
    """Run the block from the acceptance prior a new process starts with (``clear=False``: from
    the rates learned so far); the model's learned rates (``ModelProfile.drafts_met``) are put
    back afterwards, whatever the block learned."""
    from rag_lookahead.decoding.profile import profile_of

    profile = profile_of(model)
    learned = copy.deepcopy(profile.drafts_met)
    if clear:
        profile.drafts_met.clear()
    try:
        yield
    finally:
        profile.drafts_met.clear()
        profile.drafts_met.update(learned)


def same_answer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two RAG chain results hold the same answer: the same text from the same number of tokens
    (a chain hands back text, not ids; two token sequences of one text would differ in count)."""
    return a["answer"] == b["answer"] and a["stats"].get("new_tokens") == b["stats"].get("new_tokens")


def cut_at_eos(tokens: list[int], eos: Collection[int]) -> list[int]:
    """The tokens up to and including the first EOS (drops any padding after it)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def copied_fraction(answer: list[int], source: list[int], n: int = 4) -> float:
    """Share of the answer's tokens that lie in a run of >= n tokens also found in ``source``.

    Tells how much an answer quotes its passage, i.e. how much any drafter could copy.
    """
    if len(answer) < n:
        return 0.0
    grams = {tuple(source[i : i + n]) for i in range(len(source) - n + 1)}
    covered = [False] * len(answer)
    for i in range(len(answer) - n + 1):
        if tuple(answer[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(answer)


@torch.inference_mode()
def hf_batched(
    model, requests: list[list[int]], max_new_tokens: int, eos: Sequence[int], pad: int, stock: bool = False
) -> list[list[int]]:
    """transformers' plain greedy decoding of ``requests`` as one left-padded batch (one request:
    unpadded), built on the model's input device; each output cut after its first EOS. Plain: a
    repetition penalty in the model's generation config (hub Qwen2.5 ships 1.05-1.1) is turned off,
    as in the engine's greedy rows it is compared with. ``stock``: see ``transformers_kernels``."""
    ids, mask = left_pad(requests, pad, input_device(model))
    with transformers_kernels(model, stock):
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            repetition_penalty=1.0,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos) or None,
            pad_token_id=pad,
        )
    return [cut_at_eos(out[r, ids.shape[1] :].tolist(), eos) for r in range(len(requests))]


# ---------------------------------------------------------------- output


def write_report(
    json_path: str | Path,
    report: dict[str, Any],
    draw: Callable[[dict, Path], list[Path]] | None = None,
    charts: Sequence[str] = (),
    *,
    seen: FileState | EllipsisType,
) -> Path:
    """Save ``report`` (see ``save_report``), draw its charts with ``draw`` (``--plot``; ``charts``:
    the names it may draw) and say where each went, then remove the charts of ours beside it that
    this run did not draw: a rerun without ``--plot``, or another benchmark's report at the same
    path, left the earlier charts beside a report they did not describe. A report that cannot be
    written (a full disk) is printed on stdout instead (``save_or_print``); a chart that cannot, is
    one :class:`RagLookaheadError` naming it (both were a traceback). Returns where the report
    went: a report that moves to a free name takes one whose chart paths are free too (they were
    checked before the run for the path asked only). ``seen``: what :func:`check_output_path`
    returned before the run (required: without it a report another run wrote to the path during
    this one was replaced, unsaid)."""
    names = charts if draw is not None else ()
    written = save_report(json_path, report, charts=lambda path: [plots.chart_path(path, n) for n in names], seen=seen)
    drawn: list[Path] = []
    try:
        drawn = draw(report, written) if draw is not None else []
    except PathTaken as e:  # something took a chart's path since save_report looked
        raise ConfigError(
            f"{e.path} appeared during the run and this command did not write it: it was left as it is and no "
            f"chart was drawn; the report is saved as {written}"
        ) from None
    except OSError as e:  # a full disk, a quota: said in one line, with where the report is
        raise RagLookaheadError(
            f"{e.strerror or e}; the report is saved (as {shown_path(written)}), its charts are not"
        ) from None
    finally:
        plots.remove_undrawn(written, drawn)
    for path in drawn:
        print(f"wrote {path}")
    _SAVED_REPORT.set(written)
    return written


def print_json_line(row: Mapping[str, Any]) -> None:
    """One result row on stdout as a JSON line (non-ASCII text as is), flushed: the per-prompt rows
    of ``bench``, ``bench.batch``, ``bench.rag`` and ``bench.quality``."""
    print(json.dumps(row, ensure_ascii=False), flush=True)


def table_columns(rows: Iterable[dict]) -> list:
    """Every key of the rows, in the order they first appear (a later row may have more)."""
    return list(dict.fromkeys(key for row in rows for key in row))


def cell(value: Any) -> str:
    """A table cell: "-" for a missing value (None), else the value as text."""
    return "-" if value is None else str(value)


def times(value: float | None) -> str:
    """A speed ratio as "1.23x"; "-" where there is none (its baseline did not run, or measured 0)."""
    return f"{value:.2f}x" if value else "-"


def print_rows(title: str, rows: list[dict]) -> None:
    """A rich table of dicts; a column per key of any row, "-" where a row has no value."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = table_columns(rows)
    for column in columns:
        table.add_column(str(column), justify="right")
    for row in rows:
        table.add_row(*(cell(row.get(column)) for column in columns))
    # as wide as the table needs: at 160 columns bench.batch's names were cut ("speedup_vs_…" twice)
    wide = Console(width=100_000)
    Console(width=max(160, wide.measure(table).maximum)).print(table)


class _StdoutFailed(BaseException):
    """stdout failed and no report is being made, so the run stops. A BaseException: no ``except
    Exception`` between the print and the command may swallow it."""


class _WatchedStdout:
    """``sys.stdout`` during a run: the first failed write or flush is kept in ``error`` and every
    later one is dropped (``keep_going``), or the run stops there (:class:`_StdoutFailed`)."""

    def __init__(self, stream: Any, keep_going: bool) -> None:
        self.stream, self.keep_going = stream, keep_going
        self.error: OSError | ValueError | None = None

    def write(self, text: str) -> int:
        self._guarded(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    def _guarded(self, call: Callable[..., Any], *args: Any) -> None:
        if self.error is not None:
            return
        try:
            call(*args)
        except (OSError, ValueError) as e:  # ValueError: a closed file, a character its encoding lacks
            self.error = e
            if not self.keep_going:
                raise _StdoutFailed from e

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno ... as the stream has them
        return getattr(self.stream, name)


def keeps_report_despite_stdout(command: Callable[..., Any]) -> Callable[..., Any]:
    """A benchmark command run within :func:`report_despite_stdout` of its ``json_path`` (a command
    without one prints its results: a failed stdout is one line and exit 1, not a traceback)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        with report_despite_stdout(kwargs.get("json_path")):
            return command(*args, **kwargs)

    return run


# where write_report put the report (a free name when another file took the path during the run),
# for the line that ends a run whose stdout failed
_SAVED_REPORT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("saved_report", default=None)


@contextmanager
def report_despite_stdout(json_path: str | None) -> Iterator[None]:
    """Within: a failed write to stdout (a full disk, ``> /dev/full``; a reader that left, ``| head``)
    no longer ends a run that makes a ``--json`` report. The tables are dropped from then on, the
    run goes on and saves the report, and the command then exits 1: with one line, or quietly where
    the reader left (as the CLI does). Without ``--json`` it stops at once, the same way. Why: the
    report is what a long run is for, and it was lost to a traceback or to a silent exit 1."""
    real = sys.stdout
    if real is None:  # started with stdout closed: print() writes nothing, nothing can fail
        yield
        return
    watched = _WatchedStdout(real, keep_going=bool(json_path))
    _SAVED_REPORT.set(None)
    sys.stdout = watched
    try:
        yield
        watched.flush()  # what is still buffered fails here, not in Python's flush at exit
    except _StdoutFailed:
        pass
    finally:
        sys.stdout = real
        if watched.error is not None:
            from rag_lookahead.ask import silence_stdout

            silence_stdout()  # Python's flush at exit would fail on the same stdout
    if watched.error is not None:
        _stdout_failed(watched.error, json_path)


def _stdout_failed(error: OSError | ValueError, json_path: str | None) -> NoReturn:
    """End the command after stdout failed (see :func:`report_despite_stdout`)."""
    if isinstance(error, BrokenPipeError) or getattr(error, "errno", None) == errno.EPIPE:
        raise SystemExit(1)
    where = _SAVED_REPORT.get() or json_path
    saved = f"; the report was saved all the same (as {where})" if json_path else ""
    raise RagLookaheadError(f"cannot write the results to stdout: {getattr(error, 'strerror', None) or error}{saved}")
