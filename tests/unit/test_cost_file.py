"""The cost-curve file is a cache: whatever is at its path, decoding goes on.

Measured bugs: a read-only cache folder (the converted model mounted read-only) made the first
``generate()`` raise a raw OSError; ``cost_curves.json`` as a folder raised IsADirectoryError, a
JSON list TypeError. The curve is measured, used, and kept when the file can be written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading

import pytest
from hang_guard import returned
from tiny_models import tiny_model

from rag_lookahead.decoding.costs import cost_curve
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.errors import ConfigError


def _model(name: str, monkeypatch):
    model = tiny_model("qwen2")  # one object per architecture: forget what an earlier case measured
    monkeypatch.setattr(model.config, "_name_or_path", name)  # a key for the file (in-memory models have none)
    profile_of(model).reset()
    return model


@pytest.mark.parametrize("kind", ["folder", "list", "bad-entry", "text", "infinite-size", "nan-size", "deep", "fifo"])
def test_a_broken_curve_file_is_measured_around(tmp_path, monkeypatch, caplog, kind):
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.delenv("RAG_LOOKAHEAD_RECALIBRATE", raising=False)
    path = tmp_path / "cost_curves.json"
    model = _model(f"tiny-{kind}", monkeypatch)
    if kind == "folder":
        path.mkdir()
    elif kind == "list":
        path.write_text("[1, 2]", encoding="utf-8")
    elif kind == "text":
        path.write_text("not json", encoding="utf-8")
    elif kind == "fifo":  # the reader waited for a writer for good
        os.mkfifo(path)
    elif kind == "deep":  # RecursionError escaped the reader
        path.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    elif kind.endswith("-size"):  # int() of Infinity raised OverflowError, of NaN ValueError
        from rag_lookahead.decoding.costs import _curve_key

        size = "Infinity" if kind == "infinite-size" else "NaN"
        path.write_text(f'{{"{_curve_key(model)}": {{"sizes": [1, {size}], "seconds": [0.1, 0.2]}}}}', encoding="utf-8")
    else:  # an entry for this very model that is not a curve
        from rag_lookahead.decoding.costs import _curve_key

        path.write_text(json.dumps({_curve_key(model): {"sizes": "x", "seconds": [1]}}), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="rag_lookahead.decoding.costs"):
        curve = returned(lambda: cost_curve(model))
    assert curve(1) > 0 and curve(64) >= curve(1)
    if kind == "folder":  # not ours to replace: left as it is, and the user is told
        assert path.is_dir() and "could not keep the measured cost curve" in caplog.text
        # and the failed write took its temporary file with it (``.cost_curves.json.XXXXXXXX`` stayed)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cost_curves.json", "cost_curves.json.lock"]
    else:  # rewritten with the measured curve, which the next process reads back
        stored = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(stored, dict) and len(stored) == 1
        again = _model(model.config._name_or_path, monkeypatch)  # as a new process would: from the file
        assert cost_curve(again).seconds == curve.seconds
    profile_of(model).reset()  # the shared tiny model leaves with no curve of this test


def test_the_curve_file_keeps_the_newest_curves_only(tmp_path, monkeypatch):
    """Every model folder measured once adds a key (a test's temporary copy of a model too): the file
    keeps the newest MAX_STORED_CURVES and drops the oldest, so the cache never grows without bound."""
    from rag_lookahead.decoding import costs

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.delenv("RAG_LOOKAHEAD_RECALIBRATE", raising=False)
    monkeypatch.setattr(costs, "MAX_STORED_CURVES", 3)
    path = tmp_path / "cost_curves.json"
    keys = []
    for i in range(5):
        model = _model(f"tiny-{i}", monkeypatch)
        cost_curve(model)
        keys.append(costs._curve_key(model))
        stored = json.loads(path.read_text(encoding="utf-8"))
        assert list(stored) == keys[-3:]  # oldest first, newest last
    first = _model("tiny-2", monkeypatch)
    monkeypatch.setenv("RAG_LOOKAHEAD_RECALIBRATE", "1")  # measured again: it moves to the newest place
    cost_curve(first)
    assert list(json.loads(path.read_text(encoding="utf-8"))) == [keys[3], keys[4], keys[2]]
    profile_of(first).reset()


def test_recalibrate_is_asked_by_1_not_by_0(tmp_path, monkeypatch):
    """Any value of RAG_LOOKAHEAD_RECALIBRATE re-measured, "0" and "false" too: every process
    measured its curve again and rewrote the stored one. Then any value but 1/true/yes/on was a
    silent no ("y", "2"): such a value is refused now."""
    from rag_lookahead.decoding import costs

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    path = tmp_path / "cost_curves.json"
    monkeypatch.delenv("RAG_LOOKAHEAD_RECALIBRATE", raising=False)
    cost_curve(_model("tiny-recal-a", monkeypatch))
    cost_curve(_model("tiny-recal-b", monkeypatch))
    stored = lambda: list(json.loads(path.read_text(encoding="utf-8")))  # noqa: E731
    a, b = stored()  # a curve measured again moves to the end
    for value in ("0", "false", "no", "OFF", " ", ""):
        monkeypatch.setenv("RAG_LOOKAHEAD_RECALIBRATE", value)
        cost_curve(_model("tiny-recal-a", monkeypatch))
        assert stored() == [a, b], value  # the stored curve was read
    for value in ("y", "2", "enable", "of"):  # were a silent no, whatever was meant
        monkeypatch.setenv("RAG_LOOKAHEAD_RECALIBRATE", value)
        message = (
            "RAG_LOOKAHEAD_RECALIBRATE must be 1, true, yes or on (measure the cost curve again) "
            f"or 0, false, no or off, got {value!r}"
        )
        with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
            cost_curve(_model("tiny-recal-a", monkeypatch))
        assert stored() == [a, b], value
    monkeypatch.setenv("RAG_LOOKAHEAD_RECALIBRATE", "1")
    cost_curve(_model("tiny-recal-a", monkeypatch))
    assert stored() == [b, a]
    monkeypatch.setenv("RAG_LOOKAHEAD_RECALIBRATE", "TRUE")
    cost_curve(_model("tiny-recal-b", monkeypatch))
    assert stored() == [a, b]
    profile_of(_model("tiny-recal-a", monkeypatch)).reset()


@pytest.mark.parametrize("seconds", [0.0, -0.01, float("nan"), float("inf")])
def test_a_stored_curve_of_impossible_times_is_measured_again(tmp_path, monkeypatch, seconds):
    """A curve of 0 s passed the shape check, and the auto budget then divided by it
    (ZeroDivisionError in ``StepCosts``); NaN never drafted again."""
    import math

    from rag_lookahead.decoding.costs import _curve_key

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.delenv("RAG_LOOKAHEAD_RECALIBRATE", raising=False)
    model = _model(f"tiny-impossible-{seconds}", monkeypatch)
    path = tmp_path / "cost_curves.json"
    path.write_text(json.dumps({_curve_key(model): {"sizes": [1, 4, 8], "seconds": [seconds] * 3}}), encoding="utf-8")
    curve = cost_curve(model)
    assert all(math.isfinite(t) and t > 0 for t in curve.seconds)
    profile_of(model).reset()


def test_a_curve_another_process_kept_meanwhile_is_not_lost(tmp_path, monkeypatch):
    """Two processes measuring at once: each read the file, measured, and wrote back what it had
    read plus its own curve, so the one that wrote last dropped the other's. The file is now read
    again under its lock before the write."""
    from rag_lookahead.decoding import costs

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.delenv("RAG_LOOKAHEAD_RECALIBRATE", raising=False)
    path = tmp_path / "cost_curves.json"
    other = {"sizes": [1, 4], "seconds": [0.01, 0.02]}
    measure = costs.measure_cost

    def measured_while_another_process_kept_its_curve(model, **kwargs):
        curve = measure(model, **kwargs)
        path.write_text(json.dumps({"other-model": other}), encoding="utf-8")  # the other process's write
        return curve

    monkeypatch.setattr(costs, "measure_cost", measured_while_another_process_kept_its_curve)
    model = _model("tiny-concurrent", monkeypatch)
    cost_curve(model)
    stored = json.loads(path.read_text(encoding="utf-8"))
    assert stored["other-model"] == other and costs._curve_key(model) in stored
    profile_of(model).reset()


def test_a_held_curve_lock_costs_only_the_keeping(tmp_path, monkeypatch, caplog):
    """A process stuck holding the file's lock never stops decoding: the curve is used, not kept."""
    import fcntl

    from rag_lookahead.decoding import costs

    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.delenv("RAG_LOOKAHEAD_RECALIBRATE", raising=False)
    monkeypatch.setattr(costs, "CURVE_LOCK_TIMEOUT_S", 0.3)
    model = _model("tiny-held-lock", monkeypatch)
    with open(tmp_path / "cost_curves.json.lock", "a+") as holder:  # another process's open file
        fcntl.flock(holder, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger="rag_lookahead.decoding.costs"):
            curve = cost_curve(model)
    assert curve(1) > 0 and "could not keep the measured cost curve" in caplog.text
    assert not (tmp_path / "cost_curves.json").exists()
    profile_of(model).reset()


def test_a_writer_killed_mid_write_leaves_no_temporary_file_for_good(tmp_path, monkeypatch):
    """``kill -9`` during the curves file's atomic write left ``.cost_curves.json.XXXXXXXX`` beside
    it, and nothing removed it (one more a kill). The next write, under the lock every writer
    holds, removes them; a user's file of another name stays."""
    monkeypatch.setenv("RAG_LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.delenv("RAG_LOOKAHEAD_RECALIBRATE", raising=False)
    killed = [tmp_path / ".cost_curves.json.064722b6", tmp_path / ".cost_curves.json.ac23bff0"]
    theirs = [tmp_path / ".cost_curves.json.bak", tmp_path / "cost_curves.json.0123abcd", tmp_path / "notes.txt"]
    for path in killed + theirs:
        path.write_text("{", encoding="utf-8")
    model = _model("tiny-killed-writer", monkeypatch)
    cost_curve(model)
    assert not any(path.exists() for path in killed)
    assert all(path.read_text(encoding="utf-8") == "{" for path in theirs)
    assert json.loads((tmp_path / "cost_curves.json").read_text(encoding="utf-8"))
    profile_of(model).reset()
