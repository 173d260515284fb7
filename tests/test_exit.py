"""The controller's process ends with its own exit code after a correct run, even when Monarch's
driver thread is not scheduled within the 250 ms that Monarch's last exit handler gives it
(issue 58, ``controller.interpreter_exit``).

The schedule is forced, as a loaded machine would: an exit handler registered after the stage holds
Monarch's ``monarch-actor-driver`` thread for 2 s in a C signal handler (``sleep``), and an object
freed at finalization takes 3 s (as freeing a large model can). Without the guard, the thread
returns into Python while the interpreter finalizes and the process aborts with
``FATAL: exception not rethrown`` (exit code 134), after the right results: 4 in 4 runs."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(180)

#: argv: the import order (``lightning_monarch-first``, or ``monarch-first`` with a Monarch client
#: of the script's own made before ``lightning_monarch`` is imported), the stage, the ending
#: (``return``, or ``raise`` for an error raised to the user) and the exit's schedule (``forced``, or
#: ``natural`` for what the machine gives; ``benchmarks.exits`` runs both).
CONTROLLER = """
import atexit, ctypes, signal, sys, threading, time

order, stage, ending, schedule = sys.argv[1:]
if order == "monarch-first":
    from monarch.actor import this_host

    this_host()
import lightning as L
import lightning_monarch  # noqa: F401
from tests.models import Classifier


def hold_monarch_driver():
    libc = ctypes.CDLL(None)
    libc.signal(signal.SIGINT, ctypes.cast(libc.sleep, ctypes.c_void_p))  # sleep(signum): 2 s
    for thread in threading.enumerate():
        if thread.name == "monarch-actor-driver":
            signal.pthread_kill(thread.ident, signal.SIGINT)


class SlowFinalization:
    def __del__(self, sleep=ctypes.CDLL(None).sleep):
        sleep(3)


if schedule == "forced":
    freed_at_finalization = SlowFinalization()

trainer = L.Trainer(strategy="monarch", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                    enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
getattr(trainer, stage)(Classifier())
print("stage ended", time.time(), flush=True)
if schedule == "forced":
    atexit.register(hold_monarch_driver)
if ending == "raise":
    raise RuntimeError("the script's own error")
"""


#: Each test's controller: its import order, stage and ending.
RUNS = {"fit": ("lightning_monarch-first", "fit", "return"), "raise": ("monarch-first", "validate", "raise")}


@dataclass(frozen=True)
class Ended:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def ended() -> dict[str, Ended]:
    """Both controllers, run side by side (each spends 5 s of its exit holding or sleeping)."""
    with tempfile.TemporaryDirectory() as directory:
        outputs = {name: (Path(directory) / f"{name}.out", Path(directory) / f"{name}.err") for name in RUNS}
        running = {
            name: subprocess.Popen(
                [sys.executable, "-c", CONTROLLER, *arguments, "forced"],
                cwd=ROOT,
                stdout=outputs[name][0].open("w"),
                stderr=outputs[name][1].open("w"),
            )
            for name, arguments in RUNS.items()
        }
        try:
            codes = {name: process.wait(timeout=150) for name, process in running.items()}
        finally:
            for process in running.values():
                process.kill()
        return {name: Ended(codes[name], outputs[name][0].read_text(), outputs[name][1].read_text()) for name in RUNS}


def test_a_fit_ends_with_code_0_when_monarchs_driver_is_late(ended: dict[str, Ended]) -> None:
    run = ended["fit"]
    assert "stage ended" in run.stdout, run.stderr[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]
    assert "FATAL" not in run.stderr and "Aborted" not in run.stderr


def test_an_error_after_validate_ends_with_the_scripts_code_whatever_the_import_order(ended: dict[str, Ended]) -> None:
    run = ended["raise"]
    assert "stage ended" in run.stdout, run.stderr[-3000:]
    assert run.returncode == 1, run.stderr[-3000:]
    assert "RuntimeError: the script's own error" in run.stderr
    assert "FATAL" not in run.stderr and "Aborted" not in run.stderr
