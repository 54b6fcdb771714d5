"""The built wheel holds what an installed ``rag_lookahead`` needs: every module, the data files, and
the sample corpus as ``rag_lookahead/corpora`` (``ask`` indexes it on first use, outside a checkout)."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def working_tree_files() -> list[str]:
    """Tracked and new (not ignored) files: what a commit of this checkout would hold."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listing.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built from a copy of the working tree (the build writes build/ and egg-info where it runs)."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the working tree")
    source = tmp_path_factory.mktemp("source")
    for name in working_tree_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(out)]
    if _has_setuptools(77):  # build with the installed backend (pyproject asks 77); else pip fetches one (needs PyPI)
        command.append("--no-build-isolation")
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    (built,) = out.glob("rag_lookahead-*.whl")
    return zipfile.ZipFile(built)


def _has_setuptools(major: int) -> bool:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) >= major
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False


@pytest.mark.slow
def test_the_corpus_ships_as_rag_lookahead_corpora(wheel):
    names = set(wheel.namelist())
    corpus = [name for name in working_tree_files() if name.startswith("corpora/")]
    assert corpus, "the checkout has no corpora/"
    for name in corpus:
        packaged = f"rag_lookahead/{name}"
        assert packaged in names, f"{name} is not in the wheel"
        assert wheel.read(packaged) == (REPO / name).read_bytes()


@pytest.mark.slow
def test_every_module_and_data_file_ships(wheel):
    """The package list in pyproject is explicit (for the corpus mapping): a new subpackage left
    out of it would install without its modules."""
    names = set(wheel.namelist())
    package = [name for name in working_tree_files() if name.startswith("rag_lookahead/")]
    missing = [name for name in package if name not in names]
    assert not missing, f"not in the wheel: {missing}"


@pytest.mark.slow
def test_the_wheel_is_marked_typed(wheel):
    """PEP 561: without py.typed a user's mypy skips the package (every name Any)."""
    assert "rag_lookahead/py.typed" in wheel.namelist()


@pytest.mark.slow
def test_the_wheel_carries_the_licence_it_declares(wheel):
    """The metadata said Apache-2.0 but no licence text shipped (the licence asks for a copy with
    every redistribution)."""
    metadata = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
    fields = wheel.read(metadata).decode().split("\n\n", 1)[0].splitlines()
    assert "License-Expression: Apache-2.0" in fields and "License-File: LICENSE" in fields
    (shipped,) = [name for name in wheel.namelist() if name.endswith(".dist-info/licenses/LICENSE")]
    text = wheel.read(shipped)
    assert text == (REPO / "LICENSE").read_bytes() and b"Apache License" in text and b"Version 2.0" in text
