"""Liveness of the worker processes, checked by the controller while it waits for them.

Runs on the controller. Monarch's supervision reports a dead worker process within seconds in
most cases, but through its proc-agent watchdog only after about 30 s; and a worker that dies
inside a collective is first reported by its peers' gloo/NCCL error, which names the survivor.
Workers on this host are therefore also watched by process ID: a dead one is seen within one
poll of :data:`POLL_S`, and named.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Optional

import psutil

#: How often the controller checks on the workers while it waits for them.
POLL_S = 0.25
#: The states of a process that has ended but is not reaped yet.
_ENDED = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


class ProcessWatch:
    """Runs on the controller: tells which worker processes on this host have died.

    It never reaps the processes: their exit codes stay Monarch's.
    """

    def __init__(self, processes: list[tuple[int, int, str]]) -> None:
        """``processes``: ``(rank, pid, host)`` for every worker; those on other hosts are left to
        Monarch's supervision."""
        here = socket.gethostname()
        self.pids = {rank: pid for rank, pid, _ in processes}
        self._processes = {rank: _process(pid) for rank, pid, host in processes if host == here}

    def kill(self) -> None:
        """Kill the watched processes that still live (``psutil`` checks a process ID was not
        reused since)."""
        for process in self._processes.values():
            if process is not None and _alive(process):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()

    def watches(self, rank: int) -> bool:
        """Whether worker ``rank`` runs on this host."""
        return rank in self._processes

    @property
    def watches_all(self) -> bool:
        """Whether every worker runs on this host, where its process is watched."""
        return len(self._processes) == len(self.pids)

    def dead_ranks(self) -> list[int]:
        """The ranks whose process on this host has died, in rank order."""
        return sorted(rank for rank, process in self._processes.items() if not _alive(process))


def _process(pid: int) -> Optional[psutil.Process]:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _alive(process: Optional[psutil.Process]) -> bool:
    try:
        return process is not None and process.is_running() and process.status() not in _ENDED
    except psutil.NoSuchProcess:
        return False
