"""Fixtures shared by the test suite: a leak check around every test, and the ``ddp`` reference.

Tests share the warm worker mesh that ``strategy="monarch"`` keeps between stages, as a notebook
user's cells do; the leak check counts every other worker process as left behind.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from lightning_monarch.controller.pool import MESHES
from tests.parity_cases import environment_for_ddp

ROOT = Path(__file__).resolve().parent.parent


def worker_processes() -> list[psutil.Process]:
    """Monarch worker processes started by this (controller) process and still running."""
    return [process for process in psutil.Process().children(recursive=True) if "bootstrap_main" in _command(process)]


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):  # ended, not yet reaped by its parent
        return ""


def stray_workers() -> list[psutil.Process]:
    """Worker processes that are not the warm mesh's."""
    warm = set(MESHES.worker_pids())
    return [process for process in worker_processes() if process.pid not in warm]


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    """Every test, passing or failing, must leave no Monarch worker process behind but the warm mesh."""
    yield
    deadline = time.monotonic() + 10
    while stray_workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = stray_workers()
    for process in left:
        process.kill()
    assert not left, f"worker processes left behind: {[process.pid for process in left]}"


def run_ddp_reference(out_dir: Path, cases: list[str]) -> Path:
    """Run parity cases under Lightning's own ``strategy="ddp"`` (2 CPU processes) in a subprocess.

    ``ddp`` re-executes the running command for each rank, which inside pytest would be pytest
    itself, so the reference runs as ``python -m tests.ddp_reference``.
    """
    subprocess.run(
        [sys.executable, "-m", "tests.ddp_reference", str(out_dir), *cases],
        cwd=ROOT,
        env=environment_for_ddp(),
        check=True,
        timeout=900,
    )
    return out_dir
