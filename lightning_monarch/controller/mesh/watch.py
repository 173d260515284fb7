"""Liveness of the worker processes, checked by the controller while it waits for them.

Runs on the controller. Monarch's supervision reports a dead worker process within seconds in
most cases, but through its proc-agent watchdog only after about 30 s; and a worker that dies
inside a collective is first reported by its peers' gloo/NCCL error, which names the survivor.
Every worker is therefore also watched by its lifeline (``controller.mesh.lifelines``), on any
host, and those on this host by process ID too: a dead one is seen within one poll of
:data:`POLL_S`, and named with its host.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Optional

import psutil

from lightning_monarch.controller.mesh.lifelines import LIFELINES

#: How often the controller checks on the workers while it waits for them.
POLL_S = 0.25
#: The states of a process that has ended but is not reaped yet.
_ENDED = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


class ProcessWatch:
    """Runs on the controller: tells which worker processes on this host have died.

    It never reaps the processes: their exit codes stay Monarch's.
    """

    def __init__(self, processes: list[tuple[int, int, str]], lifelines: Optional[str] = None) -> None:
        """``processes``: ``(rank, pid, host)`` for every worker; ``lifelines``: the group of their
        lifelines (``controller.mesh.lifelines``), without which those on other hosts are left to
        Monarch's supervision."""
        here = socket.gethostname()
        self.pids = {rank: pid for rank, pid, _ in processes}
        self.hosts = {rank: host for rank, _, host in processes}
        self._processes = {rank: _process(pid) for rank, pid, host in processes if host == here}
        self._lifelines = lifelines

    def kill(self) -> None:
        """Kill the watched processes that still live (``psutil`` checks a process ID was not
        reused since)."""
        for process in self._processes.values():
            if process is not None and _alive(process):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()

    def forget(self) -> None:
        """Stop watching the lifelines: the mesh is being stopped on purpose."""
        if self._lifelines is not None:
            LIFELINES.forget(self._lifelines)

    def watches(self, rank: int) -> bool:
        """Whether worker ``rank`` runs on this host."""
        return rank in self._processes

    @property
    def watches_all(self) -> bool:
        """Whether every worker runs on this host, where its process is watched."""
        return len(self._processes) == len(self.pids)

    @property
    def sees_every_death(self) -> bool:
        """Whether the death of any worker shows here within a poll: by its lifeline, or by its process ID."""
        return self._lifelines is not None or self.watches_all

    def dead_ranks(self) -> list[int]:
        """The ranks whose process has died (on this host) or whose lifeline ended, in rank order."""
        dead = {rank for rank, process in self._processes.items() if not _alive(process)}
        if self._lifelines is not None:
            dead.update(LIFELINES.ended(self._lifelines))
        return sorted(dead)

    def unreachable_ranks(self) -> list[int]:
        """The ranks among the dead whose host stopped answering (their lifeline's keepalive gave
        up), rather than their process ending, in rank order."""
        return LIFELINES.ended(self._lifelines, silently=True) if self._lifelines is not None else []


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
