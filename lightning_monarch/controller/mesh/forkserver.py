"""Worker processes on the controller's host, forked from a fork server (``worker/forkserver.py``).

Runs on the controller. A CPU worker on this host is started by the bootstrap command
:func:`bootstrap_command` gives, which has the fork server of its Lightning package fork it, ready
imported, instead of importing torch and Lightning itself (about 5 CPU-seconds a worker). The
server is started with the first such mesh, from this process's environment and working
directory, and started again when either has changed since: its imports must have seen what a new
worker's would. It stops at interpreter exit, after the warm mesh (``controller.mesh.pool``), and
dies with this process.

Not used for GPU workers (each pins its device in a process whose CUDA or ROCm runtime must be
its own; forking is not yet measured on GPU machines), nor for other hosts, whose processes are
started by their own host process, nor off Linux.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import psutil
from monarch.actor import HostMesh, ProcMesh

from lightning_monarch import namespaces
from lightning_monarch._compat.monarch import bootstrap_command as monarch_bootstrap_command
from lightning_monarch.worker import forkserver as worker_forkserver
from lightning_monarch.worker.forkserver import comparable_environment
from lightning_monarch.worker.process import LOCAL_DIMENSION, start_worker_process

if TYPE_CHECKING:
    from lightning_monarch._compat.monarch import BootstrapCommand

log = logging.getLogger(__name__)

#: The script both roles of the fork server run (``serve`` and ``start``).
SCRIPT = str(Path(worker_forkserver.__file__))
#: What the server imports besides the workers' Lightning package: the rest of what every worker
#: imports before its first stage, except Monarch (whose runtime's threads would not survive a fork).
PRELOADED = ("torch", "torch.distributed", "cloudpickle", "psutil", "xxhash", "yaml")
#: How long stopping a server may take before it is killed.
_STOP_TIMEOUT_S = 5.0


class ForkServerProcess:
    """Runs on the controller: one fork server, for the workers of one Lightning package."""

    def __init__(self, package: str) -> None:
        """Start a server that imports ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
        self.seen = (comparable_environment(os.environ), os.getcwd())
        #: The name of its abstract Unix socket.
        self.address = address = f"lightning_monarch_forkserver_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        ready, told = os.pipe()
        with os.fdopen(ready, "rb") as listening:
            try:
                self._process = subprocess.Popen(
                    [sys.executable, SCRIPT, "serve", address, str(os.getpid()), str(told), *PRELOADED, package],
                    stdin=subprocess.DEVNULL,
                    pass_fds=(told,),
                )
            finally:
                os.close(told)
            listening.read(1)  # it listens: requests from now on wait for its imports
        self.command = monarch_bootstrap_command(sys.executable, ["-S", SCRIPT, "start", address])

    def current(self) -> bool:
        """Whether it runs, and saw the environment and working directory a new worker would."""
        return self._process.poll() is None and self.seen == (comparable_environment(os.environ), os.getcwd())

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        """End the server (its remaining workers die with it)."""
        self._process.terminate()
        try:
            self._process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


#: This process's fork servers, by the Lightning package their workers import.
_SERVERS: dict[str, ForkServerProcess] = {}


def bootstrap_command(package: str) -> Optional[BootstrapCommand]:
    """The bootstrap command for CPU workers on this host that import ``package``: one that forks
    them from a fork server, started here if need be; ``None`` (Monarch's own) off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    server = _SERVERS.get(package)
    if server is None or not server.current():
        if server is not None:
            log.debug("Starting the worker fork server again: the environment or directory changed")
            server.stop()
        server = _SERVERS[package] = ForkServerProcess(package)
    return server.command


@dataclass(frozen=True)
class ProcessStart:
    """Runs on the controller: how a mesh's worker processes start on a host: ``per_host`` of them
    (by dimension), each running ``bootstrap`` first (``worker.process``). With ``forked``, the
    Lightning package of this host's CPU workers, they are forked from its fork server; else
    Monarch's own bootstrap starts them."""

    per_host: dict[str, int]
    bootstrap: Callable[[], None]
    forked: Optional[str] = None

    @classmethod
    def of(
        cls, per_host: int, gpu_indices: Optional[tuple[int, ...]], hold_warnings: bool, local: bool
    ) -> ProcessStart:
        """``per_host`` workers on each host, started as ``worker.process.start_worker_process``
        says, with a new run ID; forked where ``local`` (the hosts are this one) and CPU workers."""
        run_id = f"lightning_monarch-{uuid.uuid4().hex[:12]}"
        bootstrap = functools.partial(start_worker_process, run_id, per_host, gpu_indices, hold_warnings)
        forked = namespaces.namespace_of(__name__).pytorch if local and gpu_indices is None else None
        return cls({LOCAL_DIMENSION: per_host}, bootstrap, forked)

    def spawn(self, hosts: HostMesh) -> ProcMesh:
        command = None if self.forked is None else bootstrap_command(self.forked)
        return hosts.spawn_procs(per_host=self.per_host, bootstrap=self.bootstrap, bootstrap_command=command)


def is_worker_process(process: psutil.Process) -> bool:
    """Whether ``process`` is a Monarch worker process or a child of one: started by Monarch's
    bootstrap, or forked by a fork server (whose command line it keeps, and whose child it is).
    Neither a fork server nor a ``start`` process is one: a ``start`` process ends as soon as its
    worker or the server has. Raises what ``psutil`` raises for a process that ended."""
    command = process.cmdline()
    if any(worker_forkserver.BOOTSTRAP_MODULE in part for part in command):
        return True
    if SCRIPT not in command or command[command.index(SCRIPT) + 1] == "start":
        return False
    parent = process.parent()
    return parent is not None and SCRIPT in parent.cmdline()


def fork_server_pids() -> list[int]:
    """The process IDs of this process's fork servers."""
    return [server.pid for server in _SERVERS.values()]


def stop_fork_servers() -> None:
    """Stop this process's fork servers."""
    while _SERVERS:
        _SERVERS.popitem()[1].stop()


# registered at import, before any mesh exists, so that it runs after the pool stopped its mesh
atexit.register(stop_fork_servers)
