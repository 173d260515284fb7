"""Crashes leave nothing behind: a controller killed with SIGKILL at each moment of a stage leaves
no worker process, and it and a served host killed so leave no file of ours in shared memory or in
the temporary directory (``lightning_monarch.memory_files``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from lightning_monarch.controller.mesh.hosts import reachable
from tests.conftest import ROOT, worker_processes
from tests.served_hosts import ServedHost

pytestmark = pytest.mark.timeout(180)

#: The prefix of every name we give a file or directory.
OURS = "lightning_monarch_"
SHARED_MEMORY = Path("/dev/shm")

KILLED_CONTROLLER = """
import os, signal, sys, time
import lightning as L, torch
from lightning_monarch import MonarchStrategy
from tests.models import Classifier

moment = sys.argv[1]


class Big(L.LightningModule):
    '''400 MiB of weights, whose shipping to the workers takes a while.'''

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(10240, 10240)

    def validation_step(self, batch, batch_idx):
        time.sleep(60)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(4, 10240), batch_size=2)


class Slow(Classifier):
    def training_step(self, batch, batch_idx):
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


class Moments(L.Callback):
    '''Kills worker 1 at step 8 (in epoch 1) and says when training goes on after its replacement.'''

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            print("training", flush=True)
        if trainer.global_step == 8 and moment == "replaced":
            os.kill(trainer.strategy.worker_pids[1], signal.SIGKILL)
        if trainer.global_step == 10:
            print("replaced", flush=True)


trainer = L.Trainer(strategy=MonarchStrategy(max_restarts=1), accelerator="cpu", devices=2, max_epochs=1000,
                    logger=False, enable_progress_bar=False, enable_checkpointing=False, callbacks=[Moments()])
if moment == "shipping":
    trainer.validate(Big())
else:
    trainer.fit(Slow())
"""


def _ours(directories: list[Path]) -> set[Path]:
    return {path for directory in directories for path in directory.glob(f"{OURS}*")}


def _storage_bytes(process: psutil.Process) -> int:
    """The size of the files of stage storages that ``process`` holds open, or that are named in
    shared memory."""
    found = sum(path.stat().st_size for path in SHARED_MEMORY.glob(f"{OURS}storages*/*"))
    try:
        for entry in Path(f"/proc/{process.pid}/fd").iterdir():
            if f"{OURS}storages" in os.readlink(entry):
                found += entry.stat().st_size
    except OSError:  # ended, or the file closed meanwhile
        pass
    return found


def _wait_for_moment(controller: subprocess.Popen, moment: str) -> None:
    """Until the controller is at ``moment``: it says so, or (``shipping``) half of the module's
    storages are in a file for the workers."""
    if moment != "shipping":
        assert controller.stdout is not None
        next(line for line in controller.stdout if line.strip() == moment)
        time.sleep(0.3)
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _storage_bytes(psutil.Process(controller.pid)) >= 200 * 2**20:
            return
        time.sleep(0.01)
    raise AssertionError("the stage's storages never left the controller")


def _left_after(kill: subprocess.Popen, scratch: Path, before: set[Path], workers_before: set[int]) -> Leftovers:
    """SIGKILL ``kill``; give the worker processes it started (those not in ``workers_before``) 15 s
    to end, then what is left: of them, and of ours in shared memory and in ``scratch`` (its
    temporary directory) that was not there ``before``. A name another test made at the same time
    and removes a moment later does not count."""
    started = {process.pid for process in worker_processes()} - workers_before
    kill.kill()
    kill.wait()
    killed_at = time.monotonic()
    while any(process.pid in started for process in worker_processes()) and time.monotonic() - killed_at < 15:
        time.sleep(0.1)
    workers = sorted(process.pid for process in worker_processes() if process.pid in started)
    left = _ours([SHARED_MEMORY, scratch]) - before
    time.sleep(1)
    return Leftovers(sorted(str(path) for path in left & _ours([SHARED_MEMORY, scratch])), workers, len(started))


@dataclass
class Leftovers:
    """What a killed controller left: files of ours, and the worker processes (of ``started``)
    still running 15 s after the kill."""

    files: list[str]
    workers: list[int]
    started: int


@pytest.mark.parametrize("moment", ["shipping", "training", "replaced"])
def test_a_controller_killed_at_any_moment_of_a_stage_leaves_no_file(tmp_path: Path, moment: str) -> None:
    """``shipping``: while a 400 MiB module's storages go to the workers; ``training``: in the
    middle of a fit; ``replaced``: after a worker was replaced, while the others hold the
    checkpoint they resumed from."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    before = _ours([SHARED_MEMORY, scratch])
    workers_before = {process.pid for process in worker_processes()}
    controller = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONTROLLER, moment],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(scratch)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_moment(controller, moment)
    except BaseException:
        controller.kill()
        controller.wait()
        raise
    left = _left_after(controller, scratch, before, workers_before)
    print(f"files of ours left after SIGKILL of the controller ({moment}): {len(left.files)}")
    assert not left.files
    # nothing ran the controller's teardown: its workers end by themselves, even re-parented
    assert left.started >= 2 and not left.workers


def test_a_killed_served_host_leaves_no_file(tmp_path: Path) -> None:
    """``lightning-monarch serve`` killed with SIGKILL: its preemption notice leaves nothing behind."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    host = ServedHost(env={**os.environ, "TMPDIR": str(scratch)}, notices=True)
    try:
        host.start()
        assert reachable(host.address)
    finally:
        host.stop()
    assert not _ours([scratch])
