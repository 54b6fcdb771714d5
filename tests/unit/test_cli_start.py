"""What a CLI start pays for: commands that need no LLM do not import transformers (~1 s here)."""

import os
import signal
import subprocess
import sys
import time

import pytest


def test_the_cli_imports_without_transformers():
    code = "import sys, rag_lookahead.cli; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_tiny_model_still_builds_from_the_lazy_import():
    from rag_lookahead.tiny import build_tiny_model

    model = build_tiny_model("qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_the_package_imports_without_torch():
    """``import rag_lookahead`` (what ``python -m rag_lookahead.ask`` runs first) imported torch,
    before any command could handle a Ctrl-C."""
    code = (
        "import sys, rag_lookahead; print('torch' in sys.modules); from rag_lookahead import generate, LookaheadConfig"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_misspelt_name_is_said_as_python_says_it():
    """The lazy ``__getattr__`` raised a bare ``AttributeError: genrate``."""
    import pytest

    import rag_lookahead

    with pytest.raises(AttributeError, match="^module 'rag_lookahead' has no attribute 'genrate'$") as raised:
        rag_lookahead.genrate  # noqa: B018
    assert raised.value.name == "genrate" and raised.value.obj is rag_lookahead
    assert not hasattr(rag_lookahead, "sys") and set(rag_lookahead.__all__) <= set(dir(rag_lookahead))


def test_ctrl_c_at_any_moment_of_a_start_exits_130_without_a_word(tmp_path):
    """Early, a Ctrl-C printed a traceback through ``import torch``; a little later, an import it
    cut short made transformers fail to find Qwen2ForCausalLM, and ask told the user to delete
    the converted model's folder (exit 1)."""
    import os
    import signal
    import time

    env = {**os.environ, "RAG_LOOKAHEAD_HOME": str(tmp_path)}
    for delay in (0.5, 0.8, 1.2, 1.8):  # past the interpreter's own start, however loaded the machine
        started = subprocess.Popen(
            [sys.executable, "-m", "rag_lookahead.ask", "x"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        time.sleep(delay)
        started.send_signal(signal.SIGINT)
        _, err = started.communicate(timeout=120)
        # past the imports on a quick machine, the first run's progress notes and bars come first
        # (a bar starts with "\r": an empty line after the note before it); nothing else
        said = [
            line
            for line in err.decode().splitlines()
            if line.strip() and not line.startswith(("rag_lookahead: ", "  note ", "embedding "))
        ]
        assert (started.returncode, said) == (130, []), (delay, err.decode()[-500:])


@pytest.mark.parametrize("module", ["rag_lookahead.bench", "rag_lookahead.bench.retrieval"])
def test_ctrl_c_while_a_benchmark_module_starts_exits_130_without_a_word(tmp_path, module):
    """``python -m rag_lookahead.bench.retrieval``: a Ctrl-C in its first second printed a traceback
    through ``import torch`` and the process died of SIGINT (the console script was quiet)."""
    import os
    import signal
    import time

    env = {**os.environ, "RAG_LOOKAHEAD_HOME": str(tmp_path)}
    for delay in (0.4, 0.9):  # during the imports, however loaded the machine (or just after them)
        started = subprocess.Popen(
            [sys.executable, "-m", module, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        time.sleep(delay)
        started.send_signal(signal.SIGINT)
        _, err = started.communicate(timeout=120)
        text = err.decode()
        assert started.returncode == 130 and "Traceback" not in text and "KeyboardInterrupt" not in text, (delay, text)


def _swallowing(signum: int = signal.SIGINT) -> str:
    """The start of a program whose ``Callback()``, once collected, sends ``signum`` from its
    ``__del__``: a finalizer, where Python cannot pass an exception on."""
    return f"""
import contextlib, os, signal, sys, threading, time
from rag_lookahead.interrupts import command_interrupts, stop_signals

class Callback:
    def __del__(self):
        os.kill(os.getpid(), {int(signum)})
        for _ in range(1000):  # the handler runs between bytecodes
            pass
"""


def test_a_ctrl_c_during_a_programs_imports_never_raises_into_the_code_it_lands_in(tmp_path):
    """The handler raised SystemExit wherever the signal landed; while torch imported, that was
    once a callback from C++ that cannot pass an exception on, and the process aborted (SIGABRT,
    "terminate called ... SystemExit: 130"). A ``__del__`` stands in for such a callback here: the
    exit must not be raised into it (there it was swallowed, and the import went on)."""
    marker = tmp_path / "went-on"
    program = (
        _swallowing()
        + f"""
with command_interrupts(own_process=True) as imported:
    Callback()
    open({str(marker)!r}, "w").close()
    imported()
"""
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr, marker.exists()) == (130, "", False)


def test_a_ctrl_c_as_the_imports_end_exits_130_without_a_word(tmp_path):
    """A Ctrl-C that landed just as ``imported()`` switched handlers (seen inside ``signal.signal``
    itself), before typer's handling of KeyboardInterrupt took over, left the program as a
    traceback and death by SIGINT (-2): a rare flake of the start test above, under load."""
    marker = tmp_path / "went-on"
    program = f"""
import os, signal
from rag_lookahead.interrupts import command_interrupts

with command_interrupts(own_process=True) as imported:
    imported()
    os.kill(os.getpid(), signal.SIGINT)
    open({str(marker)!r}, "w").close()
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr, marker.exists()) == (130, "", False)


def test_a_ctrl_c_as_a_benchmark_programs_imports_end_exits_130_without_a_word(tmp_path):
    """``python -m rag_lookahead.bench.X`` switched handlers (``program_imported``) before typer's
    handling of KeyboardInterrupt began: a Ctrl-C landing there escaped as a traceback. Here it
    lands as the switch returns."""
    marker = tmp_path / "went-on"
    program = f"""
import os, signal
from rag_lookahead.interrupts import program_importing
program_importing()
from rag_lookahead.bench import common

switch = common.program_imported
def switched():
    switch()
    os.kill(os.getpid(), signal.SIGINT)
common.program_imported = switched

def command():
    open({str(marker)!r}, "w").close()

common.run_command(command, [], "bench")
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr, marker.exists()) == (130, "", False)


@pytest.mark.parametrize(
    ("signum", "keeping", "ended"),
    [
        (signal.SIGINT, False, (130, "")),
        (signal.SIGINT, True, (130, "interrupted\n")),
        (signal.SIGTERM, True, (143, "terminated (SIGTERM)\n")),
    ],
)
def test_a_ctrl_c_landing_in_a_finalizer_still_stops_the_command(tmp_path, signum, keeping, ended):
    """After the imports, a Ctrl-C that landed in a ``__del__`` (the garbage collector runs them
    often while a model loads) raised KeyboardInterrupt where Python can only print "Exception
    ignored in ..." and go on: ``ask`` answered to the end and exited 0 (1 start in ~60 under
    load). The same for SIGTERM within ``stop_signals``."""
    marker = tmp_path / "went-on"
    program = (
        _swallowing(signum)
        + f"""
with command_interrupts(own_process=True) as imported:
    imported()
    with stop_signals(own_process=True) if {keeping} else contextlib.nullcontext():
        Callback()
        for _ in range(100):  # the command's work
            time.sleep(0.05)
        open({str(marker)!r}, "w").close()
"""
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr, marker.exists()) == (*ended, False)


def test_a_ctrl_c_swallowed_as_a_command_ends_ends_it_and_not_its_caller():
    """The Ctrl-C a finalizer swallowed was delivered again 10 ms later, whether or not the
    command's scope was still open: a caller of ``ask.main`` in its own process got a
    KeyboardInterrupt in its own code after the command had ended well (and a program ending
    within those 10 ms exited 0)."""
    program = (
        _swallowing()
        + """
try:
    with command_interrupts() as imported:
        imported()
        Callback()
    print("ended well")
except SystemExit as end:
    print("exit", end.code)
time.sleep(0.5)
print("the caller ran on")
"""
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "exit 130\nthe caller ran on\n", "")


def test_a_ctrl_c_swallowed_before_a_long_wait_ends_the_wait():
    """Delivered again with ``_thread.interrupt_main``, which only marks the signal, a swallowed
    Ctrl-C waited out whatever join or lock the main thread blocked in next (a model loading on a
    passing thread: the very wait a Ctrl-C must cut short)."""
    program = (
        _swallowing()
        + """
with command_interrupts(own_process=True) as imported:
    imported()
    Callback()
    worker = threading.Thread(target=time.sleep, args=(60,), daemon=True)
    worker.start()
    worker.join()
"""
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (130, "") and time.monotonic() - started < 30


def test_a_ctrl_c_caught_after_it_ended_source_text_exits_as_the_program_chose(tmp_path):
    """A Ctrl-C that landed in code run from source text (``exec`` of a string, as dataclasses
    build their methods while modules import) and was then caught and ended with 130 (typer's
    way) still killed a ``python -m`` program by SIGINT after its exit, without a word: CPython
    notes such an interrupt and acts on the note at exit (``ask``: -2 in 1 start of ~30, a Ctrl-C
    while it loaded the model)."""
    (tmp_path / "program_here.py").write_text(
        """
import os, signal
from rag_lookahead.interrupts import command_interrupts

with command_interrupts(own_process=True) as imported:
    imported()
    try:
        exec("import os, signal\\nos.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(1000): pass", {})
    except KeyboardInterrupt:
        raise SystemExit(130) from None
""",
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "program_here"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert (done.returncode, done.stderr) == (130, "")


def test_a_command_run_in_process_leaves_ctrl_c_as_it_was():
    """ask.main left its own SIGINT handler installed (asyncio.run then installed none), kept a
    Ctrl-C its caller had caught (every later error exited 130 without a word), and raised
    ValueError off the main thread."""
    import os
    import signal
    import threading

    import pytest

    from rag_lookahead.ask import main
    from rag_lookahead.interrupts import command_interrupts, interrupted

    signal.signal(signal.SIGINT, signal.default_int_handler)
    unraisable = sys.unraisablehook
    with command_interrupts() as imported:
        imported()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert interrupted()
    assert not interrupted() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert sys.unraisablehook is unraisable
    with pytest.raises(SystemExit):
        main(["--help"])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ended = []

    def in_a_thread():
        try:
            main(["--help"])
        except SystemExit as done:
            ended.append(done.code)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(60)
    assert ended == [0]


def test_a_command_run_in_process_leaves_the_excepthook_and_progress_bars_as_they_were(monkeypatch):
    """typer's app installed its own sys.excepthook for good, and ``ask --json`` turned
    transformers' progress bars off for the rest of the caller's process."""
    import sys

    import pytest
    from transformers.utils import logging as hf_logging

    from rag_lookahead import console
    from rag_lookahead.ask import _no_loading_bar, main

    def own_hook(*args):
        return sys.__excepthook__(*args)

    sys.excepthook = own_hook
    try:
        with pytest.raises(SystemExit):
            main(["--help"])
        assert sys.excepthook is own_hook
        monkeypatch.setattr(sys, "argv", ["rag_lookahead", "--help"])
        with pytest.raises(SystemExit):
            console.main()
        assert sys.excepthook is own_hook
    finally:
        sys.excepthook = sys.__excepthook__
    from rag_lookahead.interrupts import command_interrupts

    sys.excepthook = own_hook
    try:  # an unexpected error leaving the program keeps the hook typer set, so that it shows it
        for own_process, left in ((True, print), (False, own_hook)):
            with pytest.raises(RuntimeError), command_interrupts(own_process):
                sys.excepthook = print
                raise RuntimeError("a bug")
            assert sys.excepthook is left
            sys.excepthook = own_hook
    finally:
        sys.excepthook = sys.__excepthook__
    assert hf_logging.is_progress_bar_enabled()
    with _no_loading_bar(quiet=True):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the caller's own choice stays
    try:
        with _no_loading_bar(quiet=True):
            pass
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_a_second_ctrl_c_while_the_first_is_handled_does_not_cut_the_handling_short():
    """Within ``stop_signals`` a command saves what it made when stopped; a second Ctrl-C during
    that save raised again in it (at its fsync) and every answer made was lost. Real signals."""
    program = """
import os, signal, time
from rag_lookahead.interrupts import stop_signals
try:
    with stop_signals():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGINT)  # pressed again while the answers are saved
            for _ in range(50):
                time.sleep(0.002)
            print("saved", flush=True)
            raise
except SystemExit as end:
    print("exit", end.code)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "saved\nexit 130\n"), done.stderr[-2000:]


@pytest.mark.parametrize(
    ("entry", "first_import"),
    [
        ("from rag_lookahead.console import main; main()", "rag_lookahead.cli"),  # the console script
        ("import runpy; runpy.run_module('rag_lookahead.serve', run_name='__main__')", "rag_lookahead.serve.command"),
    ],
)
def test_the_program_entries_leave_at_once_on_a_ctrl_c_during_their_imports(entry, first_import):
    """The console script and ``python -m rag_lookahead.serve`` are the program: a Ctrl-C landing
    in a callback while their commands import (as torch's C++ callbacks do) ends the process there
    and then, without a word. Entered as a library's scope instead (``own_process`` off), the exit
    was raised into the callback, which cannot pass it on: an "Exception ignored ... SystemExit:
    130" traceback here, an abort (SIGABRT) in a C++ callback."""
    program = (
        _swallowing()
        + f"""
import importlib.abc

class SignalOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == {first_import!r}:
            Callback()  # collected at once: its __del__ sends the signal
        return None

sys.meta_path.insert(0, SignalOnImport())
sys.argv = ["rag_lookahead", "--help"]
{entry}
"""
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")
