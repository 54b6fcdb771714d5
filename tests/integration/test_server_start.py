"""``python -m rag_lookahead.serve`` starting, as an operator runs it: the address it serves at is
said (also the port ``--port 0`` took), and a Ctrl-C while the model loads ends it at once. A real
server process over a tiny random-weight Qwen2 saved to a folder."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import tokenizer  # noqa: F401 - a fixture
from tiny_models import tiny_model

# the real entry point, with the model's load slowed down by work in torch (as a large model's
# load, or its first conversion, is busy in torch: where Python exited with torch running on the
# load's thread, the C++ runtime aborted, SIGABRT)
SLOW_LOAD = r"""
import runpy, sys, time
import torch
from rag_lookahead.serve import engine

real_load, pause = engine._load, float(sys.argv.pop(1))

def slow_load(config):
    print("loading", file=sys.stderr, flush=True)
    a, end = torch.randn(256, 256), time.monotonic() + pause
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
    return real_load(config)

engine._load = slow_load
sys.argv[0] = "rag_lookahead.serve"
runpy.run_module("rag_lookahead.serve", run_name="__main__")
"""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer):  # noqa: F811 - the fixture imported above
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_model("qwen2").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def start(model_folder, load_seconds: float, *flags: str):
    stderr = tempfile.TemporaryFile("w+")
    command = [sys.executable, "-c", SLOW_LOAD, str(load_seconds), f"--model={model_folder}", "--port=0", *flags]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    return child, stderr


def said(stderr) -> str:
    stderr.seek(0)
    return stderr.read()


def test_the_address_is_said_and_answers_with_port_0(model_folder):
    """uvicorn names no address for a socket it is handed: with ``--port 0`` nobody learnt the port."""
    child, stderr = start(model_folder, 0)
    try:
        deadline, found = time.monotonic() + 180, None
        while found is None:
            assert child.poll() is None and time.monotonic() < deadline, said(stderr)
            time.sleep(0.2)
            found = re.search(r"serving \S+ at (http://127\.0\.0\.1:(\d+))", said(stderr))
        assert int(found.group(2)) > 0
        while True:  # the address said is the one that answers
            try:
                if httpx.get(found.group(1) + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert child.poll() is None and time.monotonic() < deadline, said(stderr)
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGINT)
        child.wait(60)
        stderr.close()


def test_a_ctrl_c_while_the_model_loads_ends_the_server_at_once(model_folder):
    """The load runs on a thread of its own, and the Ctrl-C waited for it: a minute and more while
    the default model converted on its first run."""
    child, stderr = start(model_folder, 60)
    try:
        deadline = time.monotonic() + 120
        while "loading" not in said(stderr):
            assert child.poll() is None and time.monotonic() < deadline, said(stderr)
            time.sleep(0.1)
        time.sleep(0.5)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        code = child.wait(60)
        seconds = time.monotonic() - sent
        text = said(stderr)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        stderr.close()
    assert (code, "Traceback" in text) == (130, False) and seconds < 10, (code, seconds, text[-800:])


def test_a_named_index_that_is_not_there_is_said_before_the_model_loads(tmp_path):
    """``serve --index-dir`` with a typo loaded the whole model first (23 s and 4 GB for the default
    one), and only then said "no index at ..."; ``ask`` checks the index first. Here the model
    named does not exist either: the error the server ends with shows which it looked at first."""
    missing = tmp_path / "my_indx"
    command = [sys.executable, "-m", "rag_lookahead.serve", f"--model={tmp_path / 'no_model'}", "--port=0"]
    done = subprocess.run(
        [*command, f"--index-dir={missing}"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: no index at {missing}: build one with "), (
        done.stderr[-2000:]
    )
    assert not missing.exists()


# the real entry point, where a Ctrl-C lands while the address is taken (a slow name lookup) and
# what it interrupted then fails with an error of its own (as a library that catches the
# KeyboardInterrupt does)
INTERRUPTED_BIND = r"""
import os, runpy, signal, sys, time
from rag_lookahead.errors import ConfigError
from rag_lookahead.serve import command

def interrupted_bind(host, port):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    except KeyboardInterrupt:
        pass
    raise ConfigError(f"cannot listen on {host}:{port}: interrupted")

command.listening_socket = interrupted_bind
sys.argv[0] = "rag_lookahead.serve"
runpy.run_module("rag_lookahead.serve", run_name="__main__")
"""


def test_an_error_after_a_ctrl_c_while_starting_exits_130_without_a_word(tmp_path):
    """The operator pressed Ctrl-C: what failed because of it is no error of theirs to be told
    about ("error: ..." and exit 1), the server just ends, 130, as for any Ctrl-C."""
    command = [sys.executable, "-c", INTERRUPTED_BIND, f"--model={tmp_path / 'no_model'}", "--port=0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert (done.returncode, "error:" in done.stderr, "Traceback" in done.stderr) == (130, False, False), done.stderr[
        -2000:
    ]
