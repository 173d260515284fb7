"""Hosts the controller cannot see: a dead worker is reported within seconds, and no worker
outlives its controller (issue 57).

Each host is a ``lightning-monarch serve`` in UTS and PID namespaces of its own, with a host name
that resolves to this machine (``tests.served_hosts.HiddenHost``): to the controller it is a
second machine, whose host name it does not share and whose processes it cannot see by their IDs.
The workers' lifelines (``worker.lifeline``, ``controller.mesh.lifelines``) carry both reports.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_monarch
from lightning_monarch import MeshFailureError, MonarchStrategy
from tests.models import Classifier
from tests.served_hosts import ROOT, HiddenHost, NetworkHost, hiding_refused, network_refused

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(hiding_refused() is not None, reason=f"hidden hosts need `unshare`: {hiding_refused()}"),
]

#: Host names that resolve to this machine and are not its own (``getent hosts NAME``).
NAMES = ("localhost", "runsc")


def _served(hosts: list[HiddenHost]) -> Iterator[list[HiddenHost]]:
    try:
        for host in hosts:
            host.start()
        yield hosts
    finally:
        lightning_monarch.stop_meshes()
        for host in hosts:
            host.stop()


@pytest.fixture
def hidden_hosts() -> Iterator[list[HiddenHost]]:
    """Hidden hosts of this test's own: a worker killed on one stays its host's (unreaped) child."""
    yield from _served([HiddenHost(name) for name in NAMES])


@pytest.fixture(scope="module")
def served_hidden_hosts() -> Iterator[list[HiddenHost]]:
    """Hidden hosts for the tests whose workers all end cleanly: a host serves the next test."""
    yield from _served([HiddenHost(name) for name in NAMES])


@pytest.fixture
def shared_hidden_hosts(served_hidden_hosts: list[HiddenHost]) -> Iterator[list[HiddenHost]]:
    """The served hidden hosts, with no worker of this test's left on them after it."""
    try:
        yield served_hidden_hosts
    finally:
        lightning_monarch.stop_meshes()


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
from lightning_monarch import MeshFailureError, MonarchStrategy
from tests.models import ClassificationData
from tests.test_hidden_hosts import SlowClassifier

class Loaders(SlowClassifier):
    def train_dataloader(self):
        return DataLoader(ClassificationData(96), batch_size=8, num_workers=1, persistent_workers=True)

class Announce(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            print("TRAINING", flush=True)

trainer = L.Trainer(
    strategy=MonarchStrategy(hosts=sys.argv[1:]), accelerator="cpu", devices=1, num_nodes=len(sys.argv) - 1,
    max_epochs=1000, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, callbacks=[Announce()],
)
try:
    trainer.fit(Loaders())
except MeshFailureError as error:
    print("FAILED", error, flush=True)
"""


@contextlib.contextmanager
def training_controller(
    command: list[str], env: Optional[dict[str, str]] = None
) -> Iterator[tuple[subprocess.Popen, Iterator[str]]]:
    """Run a controller's ``command`` (:data:`CONTROLLER`'s, or one that prints ``TRAINING`` as it
    does) until its fit trains; yield the process and the rest of its output's lines. It is killed,
    by process group, on the way out."""
    controller = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert controller.stdout is not None
        lines = iter(controller.stdout)
        assert any(line.startswith("TRAINING") for line in lines), "the fit did not start"
        yield controller, lines
    finally:
        if controller.poll() is None:
            os.killpg(controller.pid, signal.SIGKILL)
        controller.wait()


def left_after(hosts: list[HiddenHost], seconds: float) -> list[int]:
    """The worker processes of ``hosts`` still there after up to ``seconds``, by process ID."""
    deadline = time.monotonic() + seconds
    while any(host.worker_processes() for host in hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [process.pid for host in hosts for process in host.worker_processes()]


def test_no_worker_outlives_a_killed_controller(shared_hidden_hosts: list[HiddenHost]) -> None:
    hidden_hosts = shared_hidden_hosts
    command = [sys.executable, "-c", textwrap.dedent(CONTROLLER), *(host.address for host in hidden_hosts)]
    with training_controller(command) as (controller, _):
        workers = [process for host in hidden_hosts for process in host.worker_processes()]
        assert len(workers) >= 6, "each worker, its DataLoader worker and that worker's fork server"
        os.killpg(controller.pid, signal.SIGKILL)
        controller.wait()
        left = left_after(hidden_hosts, 15)
        assert not left, f"worker processes left 15 s after the controller's SIGKILL: {left}"
    model = Classifier()
    _trainer(hidden_hosts, max_epochs=1, limit_train_batches=2).fit(model)
    assert model.trainer.global_step == 2, "the served hosts train a second controller's fit"


class SleepsOnRank1(Classifier):
    """Rank 1 holds its second step 6 s, as a step in a debugger or a long one would: half as long
    again as the 4 s in which a lifeline's keepalive gives up on a host that stopped answering."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.global_rank == 1:
            time.sleep(6)
        return super().training_step(batch, batch_idx)


def test_a_worker_in_a_long_step_is_not_reported_dead(shared_hidden_hosts: list[HiddenHost]) -> None:
    """Liveness is the process's, not its progress: a lifeline stays up while its worker sleeps."""
    started = time.monotonic()
    trainer = _trainer(shared_hidden_hosts, max_epochs=1, limit_train_batches=3)
    trainer.fit(SleepsOnRank1())
    assert trainer.global_step == 3 and time.monotonic() - started > 6


def _network_host() -> NetworkHost:
    """A host across a network, not started; the test is skipped where there can be none."""
    refused = network_refused()
    if refused is not None:
        pytest.skip(f"a host across a network needs network namespaces: {refused}")
    return NetworkHost(NAMES[1])


@pytest.fixture
def network_host() -> Iterator[NetworkHost]:
    host = _network_host()
    try:
        host.start()
        yield host
    finally:
        host.stop()


def report_of_a_cut(host: NetworkHost) -> tuple[float, str, list[int]]:
    """Cut ``host`` off while a controller trains on it (:data:`CONTROLLER`): the seconds from the
    cut to the controller's ``MeshFailureError``, its message, and the host's worker processes left
    15 s after it. The controller must then end with exit code 0."""
    with training_controller(host.controller([sys.executable, "-c", textwrap.dedent(CONTROLLER), host.address])) as (
        controller,
        lines,
    ):
        assert len(host.worker_processes()) >= 2, "the worker and its DataLoader worker"
        host.cut()
        cut = time.monotonic()
        failed = next((line for line in lines if line.startswith("FAILED")), "")
        reported = time.monotonic() - cut
        left = left_after([host], 15)
        assert controller.wait(timeout=30) == 0
    return reported, failed, left


def test_a_host_cut_off_silently_is_reported_within_10_s(network_host: NetworkHost) -> None:
    """No FIN and no RST: the lifelines' keepalive on both ends sees the host gone. The controller
    reports it, and the host's workers (and their DataLoader workers) end themselves."""
    reported, failed, left = report_of_a_cut(network_host)
    assert re.search(rf"rank 0 \(pid \d+ on {NAMES[1]}\) stopped answering: host {NAMES[1]} is unreachable", failed)
    assert reported < 10, f"reported {reported:.1f} s after the cut"
    assert not left, f"the cut host's workers outlived their lifeline: {left}"


LATE_TRANSPORT = """
import sys
import lightning as L
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.actor import this_host
from lightning_monarch import MonarchStrategy

this_host()  # Monarch starts here on its local transport
try:
    L.Trainer(strategy=MonarchStrategy(hosts=sys.argv[1:]), accelerator="cpu", devices=1)
except MisconfigurationException as error:
    print("REFUSED", error, flush=True)
"""


def test_hosts_on_other_machines_need_tcp_from_monarchs_first_call() -> None:
    """Workers across a network answer the controller over TCP, which Monarch takes only before
    its first call in a process: after it, the strategy refuses at once, naming the fix, before it
    reaches a host (none serves here)."""
    network_host = _network_host()
    late = subprocess.run(
        network_host.controller([sys.executable, "-c", textwrap.dedent(LATE_TRANSPORT), network_host.address]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "REFUSED" in late.stdout, late.stderr[-2000:]
    assert "a process keeps its first transport" in late.stdout
    assert "monarch.actor.enable_transport('tcp')" in late.stdout


def test_a_host_name_that_only_loopback_answers_is_refused_for_other_machines() -> None:
    """Monarch names the controller's actors by its host name: one that resolves only to loopback
    cannot be reached from another machine, and is refused before anything starts."""
    name = socket.gethostname()
    if not all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(name, None)):
        pytest.skip(f"this machine's host name {name} resolves to a network address")
    with pytest.raises(MisconfigurationException, match=rf"{name}' resolves only to loopback addresses"):
        L.Trainer(strategy=MonarchStrategy(hosts=["tcp://10.255.0.2:26600"]), accelerator="cpu", devices=1)
