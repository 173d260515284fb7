"""Hosts the controller cannot see: a dead worker is reported within seconds, and no worker
outlives its controller (issue 57).

Each host is a ``lightning-monarch serve`` in UTS and PID namespaces of its own, with a host name
that resolves to this machine (``tests.served_hosts.HiddenHost``): to the controller it is a
second machine, whose host name it does not share and whose processes it cannot see by their IDs.
The workers' lifelines (``worker.lifeline``, ``controller.mesh.lifelines``) carry both reports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch

import lightning_monarch
from lightning_monarch import MeshFailureError, MonarchStrategy
from tests.models import Classifier
from tests.served_hosts import ROOT, HiddenHost, hiding_refused

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(hiding_refused() is not None, reason=f"hidden hosts need `unshare`: {hiding_refused()}"),
]

#: Host names that resolve to this machine and are not its own (``getent hosts NAME``).
NAMES = ("localhost", "runsc")


@pytest.fixture
def hidden_hosts() -> Iterator[list[HiddenHost]]:
    hosts = [HiddenHost(name) for name in NAMES]
    try:
        for host in hosts:
            host.start()
        yield hosts
    finally:
        lightning_monarch.stop_meshes()
        for host in hosts:
            host.stop()


class SlowClassifier(Classifier):
    """50 ms steps, as a real model's, so that a fit runs long enough to be interrupted."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


class Training(L.Callback):
    """Sets ``started`` at the controller's third training batch."""

    def __init__(self) -> None:
        self.started = threading.Event()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= 3:
            self.started.set()


def _trainer(hosts: list[HiddenHost], **kwargs: Any) -> L.Trainer:
    options = dict(
        strategy=MonarchStrategy(hosts=[host.address for host in hosts]),
        accelerator="cpu",
        devices=1,
        num_nodes=len(hosts),
        max_epochs=1000,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**options, **kwargs})


def test_a_killed_worker_on_a_hidden_host_is_reported_within_5_s(hidden_hosts: list[HiddenHost]) -> None:
    training = Training()
    killed: list[float] = []

    def kill_rank_1() -> None:
        if training.started.wait(60):
            (worker,) = hidden_hosts[1].worker_processes()
            killed.append(time.monotonic())
            worker.kill()

    killer = threading.Thread(target=kill_rank_1)
    killer.start()
    with pytest.raises(MeshFailureError, match=rf"rank 1 \(pid \d+ on {NAMES[1]}\) died") as error:
        _trainer(hidden_hosts, callbacks=[training]).fit(SlowClassifier())
    reported = time.monotonic()
    killer.join()
    assert killed, "the fit ended before the worker was killed"
    assert reported - killed[0] < 5, f"reported {reported - killed[0]:.1f} s after the kill"
    assert error.value.ranks == (1,)


CONTROLLER = """
import sys, time
import lightning as L
from torch.utils.data import DataLoader
from lightning_monarch import MonarchStrategy
from tests.models import ClassificationData
from tests.test_hidden_hosts import SlowClassifier

class Loaders(SlowClassifier):
    def train_dataloader(self):
        return DataLoader(ClassificationData(96), batch_size=8, num_workers=1, persistent_workers=True)

class Announce(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            print("TRAINING", flush=True)

L.Trainer(
    strategy=MonarchStrategy(hosts=sys.argv[1:]), accelerator="cpu", devices=1, num_nodes=len(sys.argv) - 1,
    max_epochs=1000, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, callbacks=[Announce()],
).fit(Loaders())
"""


def test_no_worker_outlives_a_killed_controller(hidden_hosts: list[HiddenHost]) -> None:
    controller = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CONTROLLER), *(host.address for host in hidden_hosts)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert controller.stdout is not None
        for line in controller.stdout:
            if line.startswith("TRAINING"):
                break
        workers = [process for host in hidden_hosts for process in host.worker_processes()]
        assert len(workers) >= 6, "each worker, its DataLoader worker and that worker's fork server"
        os.killpg(controller.pid, signal.SIGKILL)
        controller.wait()
        deadline = time.monotonic() + 15
        while any(host.worker_processes() for host in hidden_hosts) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [process.pid for host in hidden_hosts for process in host.worker_processes()]
        assert not left, f"worker processes left 15 s after the controller's SIGKILL: {left}"
    finally:
        if controller.poll() is None:
            os.killpg(controller.pid, signal.SIGKILL)
            controller.wait()
    model = Classifier()
    _trainer(hidden_hosts, max_epochs=1, limit_train_batches=2).fit(model)
    assert model.trainer.global_step == 2, "the served hosts train a second controller's fit"


class SleepsOnRank1(Classifier):
    """Rank 1 holds its second step 20 s, as a step in a debugger or a long one would."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.global_rank == 1:
            time.sleep(20)
        return super().training_step(batch, batch_idx)


def test_a_worker_in_a_long_step_is_not_reported_dead(hidden_hosts: list[HiddenHost]) -> None:
    """Liveness is the process's, not its progress: a lifeline stays up while its worker sleeps."""
    started = time.monotonic()
    trainer = _trainer(hidden_hosts, max_epochs=1, limit_train_batches=3)
    trainer.fit(SleepsOnRank1())
    assert trainer.global_step == 3 and time.monotonic() - started > 20
