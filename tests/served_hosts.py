"""Monarch hosts served at TCP addresses of this machine, as cluster nodes serve them: for the tests
of ``MonarchStrategy(hosts=[...])`` and the elastic benchmark; and the host processes of a ``ProcessJob``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Optional

import psutil

from lightning_monarch.controller.mesh.hosts import reachable

ROOT = Path(__file__).resolve().parent.parent


def closed_port() -> int:
    """A TCP port of this machine that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServedHost:
    """A Monarch host serving at a TCP address of this machine, as ``run_worker_loop_forever``
    does on a cluster node (or, with ``notices``, ``lightning-monarch serve``, which takes SIGTERM
    as a preemption notice): in a session of its own, so that :meth:`stop` ends it and every worker
    process it started, by its process ID; :meth:`start` serves again at the same address after a
    stop. ``python`` and ``env`` are the host's interpreter and environment (this process's by
    default)."""

    def __init__(
        self, python: str = sys.executable, env: Optional[dict[str, str]] = None, notices: bool = False
    ) -> None:
        self.address = f"tcp://127.0.0.1:{closed_port()}"
        self._python, self._env, self._notices = python, env, notices
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        """Serve, and wait until the address accepts a connection."""
        self.stop()
        serve = (
            ["-m", "lightning_monarch", "serve", self.address]
            if self._notices
            else [
                "-c",
                "from monarch.actor import run_worker_loop_forever;"
                f" run_worker_loop_forever(address={self.address!r}, ca='trust_all_connections')",
            ]
        )
        self.process = subprocess.Popen([self._python, *serve], cwd=ROOT, env=self._env, start_new_session=True)
        deadline = time.monotonic() + 30
        while not reachable(self.address) and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def process_job_host(index: int) -> int:
    """The process ID of host ``index`` of the ``ProcessJob`` that this process started: Monarch
    names each host process's address after its host, ``.../hosts_<index>``. (Its workers' parent
    is the fork server they were forked from, not their host.)"""
    found = [
        child.pid
        for child in psutil.Process().children()
        if any("run_worker_loop_forever" in part and f"/hosts_{index}'" in part for part in child.cmdline())
    ]
    assert len(found) == 1, f"{len(found)} ProcessJob host processes named hosts_{index}"
    return found[0]
