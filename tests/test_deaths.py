"""How the controller tells a peer's death from a worker's own error (``controller.mesh.deaths``),
with real processes on this host: a survivor's collective error arrives while its dead peer's
process may still be exiting, and a loaded host can take a while to end it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from lightning_monarch.controller.mesh import deaths
from lightning_monarch.controller.mesh.watch import ProcessWatch
from lightning_monarch.errors import MeshFailureError
from lightning_monarch.wire.reports import WorkerFailure

RESET = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:34710: Connection reset by peer."


def _failure(message: str) -> WorkerFailure:
    return WorkerFailure(
        rank=0, host="here", hook="module.optimizer_step", exception_type="RuntimeError", message=message, traceback=""
    )


def _no_statuses() -> Iterator[object]:
    raise AssertionError("with every worker on this host, the watch alone decides")


@pytest.fixture
def peer() -> Iterator[Callable[[float], subprocess.Popen]]:
    """Start a process that ends ``seconds`` from now, as a killed worker's exit may end a while
    after its sockets closed; every one started is killed and reaped at the end."""
    started: list[subprocess.Popen] = []

    def start(seconds: float) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"]))
        return started[-1]

    try:
        yield start
    finally:
        for process in started:
            process.kill()
            process.wait()


def _watch(peer: subprocess.Popen) -> ProcessWatch:
    """The controller's watch over this process as rank 0 and ``peer`` as rank 1, both on this host."""
    here = socket.gethostname()
    return ProcessWatch([(0, os.getpid(), here), (1, peer.pid, here)])


def test_a_peer_seen_dead_after_its_survivors_error_is_named(peer: Callable[[float], subprocess.Popen]) -> None:
    dying = peer(1.0)
    with pytest.raises(MeshFailureError) as raised:
        deaths.raise_if_a_death_caused(_failure(RESET), _watch(dying), 2, _no_statuses)
    assert raised.value.ranks == (1,)
    assert f"rank 1 (pid {dying.pid} on {socket.gethostname()})" in str(raised.value)


def test_a_workers_own_error_is_not_held_for_a_death(peer: Callable[[float], subprocess.Popen]) -> None:
    dying = peer(1.0)
    started = time.monotonic()
    deaths.raise_if_a_death_caused(_failure("loss is nan"), _watch(dying), 2, _no_statuses)
    assert time.monotonic() - started < 0.5
    assert dying.poll() is None  # it lived all along


def test_a_peer_lost_error_with_every_peer_alive_is_the_workers_own(peer: Callable[[float], subprocess.Popen]) -> None:
    alive = peer(60.0)
    started = time.monotonic()
    deaths.raise_if_a_death_caused(_failure(RESET), _watch(alive), 2, _no_statuses)
    assert deaths._EXIT_GRACE_S <= time.monotonic() - started < deaths._EXIT_GRACE_S + 1
