"""Worker processes on the controller's host, forked from a fork server (``worker/forkserver.py``).

Runs on the controller. A CPU worker on this host, on the hosts of a ``ProcessJob``, or on hosts at
addresses served on this machine (host processes of this machine, with this interpreter:
``hosts.runs_here``; :func:`forked_package`), is started by a bootstrap command that has the fork
server of its Lightning package fork it, ready imported, instead of importing torch and Lightning
itself (about 5 CPU-seconds a worker). :func:`forked_command` has the server fork a child for
another module (``controller.launch.fresh_settings`` reads a fresh worker's torch settings so). The server is started with the first such
mesh, from this process's environment and working directory, and another is started when either has
changed since: its imports must have seen what a new worker's would. The last :data:`KEPT` servers
of a package are kept, so that an environment changed for a while and then restored (a test's
patched variable, a notebook cell's) finds its server, and the workers of meshes started before the
change keep theirs. Servers stop at interpreter exit, after the warm mesh
(``controller.mesh.pool``), and die with this process.

Not used for GPU workers (each pins its device in a process whose CUDA or ROCm runtime must be
its own; forking is not yet measured on GPU machines), nor for hosts served elsewhere (other
machines, interpreters or namespaces: ``hosts.served_here``), nor off Linux.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
from monarch.actor import HostMesh, ProcMesh

from lightning_monarch import namespaces
from lightning_monarch._compat.monarch import bootstrap_command as monarch_bootstrap_command
from lightning_monarch.controller.mesh.hosts import runs_here
from lightning_monarch.worker import forkserver as worker_forkserver
from lightning_monarch.worker.forkserver import comparable_environment
from lightning_monarch.worker.process import LOCAL_DIMENSION, start_worker_process

log = logging.getLogger(__name__)

#: The script both roles of the fork server run (``serve`` and ``start``).
SCRIPT = str(Path(worker_forkserver.__file__))
#: What the server imports besides the workers' Lightning package: the rest of what every worker
#: imports before its first stage, except Monarch (whose runtime's threads would not survive a fork).
PRELOADED = ("torch", "torch.distributed", "cloudpickle", "psutil", "xxhash", "yaml")
#: How long stopping a server may take before it is killed.
_STOP_TIMEOUT_S = 5.0
#: How many fork servers of a Lightning package are kept, the most recently used first: each holds
#: the memory of its imports (shared with its workers), and the workers of one that is stopped die.
KEPT = 2


class ForkServerProcess:
    """Runs on the controller: one fork server, which imported ``preload`` in ``environment``."""

    def __init__(self, preload: Sequence[str], environment: Optional[Mapping[str, str]] = None) -> None:
        """Start a server that imports ``preload``, in ``environment`` (by default this process's,
        which it inherits whole: native code may have set variables that ``os.environ`` does not
        show, and Monarch's processes inherit them too) and this process's working directory."""
        self.seen = (comparable_environment(os.environ if environment is None else environment), os.getcwd())
        #: The name of its abstract Unix socket.
        self.address = address = f"lightning_monarch_forkserver_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        ready, told = os.pipe()
        with os.fdopen(ready, "rb") as listening:
            try:
                self._process = subprocess.Popen(
                    [sys.executable, SCRIPT, "serve", address, str(os.getpid()), str(told), *preload],
                    stdin=subprocess.DEVNULL,
                    env=None if environment is None else dict(environment),
                    pass_fds=(told,),
                )
            finally:
                os.close(told)
            listening.read(1)  # it listens: requests from now on wait for its imports
        self.command = monarch_bootstrap_command(sys.executable, self.start_arguments())

    def start_arguments(self, variables: Optional[Mapping[str, str]] = None, command: Sequence[str] = ()) -> list[str]:
        """The interpreter's arguments for a process that has this server fork it a child, which
        runs ``command`` (``MODULE ARG...``; Monarch's proc bootstrap if empty) with ``variables``
        set, as ``env NAME=VALUE python -m MODULE ARG...`` would."""
        assignments = [f"{name}={value}" for name, value in (variables or {}).items()]
        return ["-S", SCRIPT, "start", self.address, *assignments, *(["-m", *command] if command else [])]

    def running(self) -> bool:
        """Whether its process runs."""
        return self._process.poll() is None

    def current(self, environment: Optional[Mapping[str, str]] = None) -> bool:
        """Whether it runs, and saw ``environment`` (this process's by default) and the working
        directory that a new child would."""
        seen = comparable_environment(os.environ if environment is None else environment), os.getcwd()
        return self.running() and self.seen == seen

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


#: This process's fork servers, by the Lightning package their workers import, the most recently
#: used first.
_SERVERS: dict[str, list[ForkServerProcess]] = {}


def forked_package(hosts: Optional[HostMesh], gpu_indices: Optional[tuple[int, ...]]) -> Optional[str]:
    """The Lightning package of the workers this process's fork servers fork on ``hosts`` (``None``:
    this host) for ``gpu_indices`` (``None``: CPU workers): CPU workers on hosts that run here
    (``hosts.runs_here``), on Linux; ``None`` where Monarch's own bootstrap starts them."""
    if gpu_indices is None and runs_here(hosts) and sys.platform.startswith("linux"):
        return namespaces.namespace_of(__name__).pytorch
    return None


def forked_command(package: str, command: Sequence[str]) -> list[str]:
    """The command line of a process that has the fork server of ``package``'s workers fork it a
    child that runs ``command`` (``MODULE ARG...``) as ``python -m`` would."""
    return [sys.executable, *_server(package).start_arguments(command=command)]


def _server(package: str) -> ForkServerProcess:
    """The fork server of ``package``'s workers that saw this process's environment and directory,
    started here if need be."""
    servers = _SERVERS[package] = [server for server in _SERVERS.get(package, []) if server.running()]
    server = next((server for server in servers if server.current()), None)
    if server is None:
        if servers:
            log.debug("Starting another worker fork server: the environment or directory changed")
        server = ForkServerProcess((*PRELOADED, package))
    else:
        servers.remove(server)
    servers.insert(0, server)
    while len(servers) > KEPT:
        servers.pop().stop()
    return server


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
        cls, per_host: int, gpu_indices: Optional[tuple[int, ...]], hold_warnings: bool, forked: Optional[str]
    ) -> ProcessStart:
        """``per_host`` workers on each host, started as ``worker.process.start_worker_process``
        says, with a new run ID; forked where ``forked`` names their Lightning package
        (:func:`forked_package`)."""
        run_id = f"lightning_monarch-{uuid.uuid4().hex[:12]}"
        bootstrap = functools.partial(start_worker_process, run_id, per_host, gpu_indices, hold_warnings)
        return cls({LOCAL_DIMENSION: per_host}, bootstrap, forked)

    def spawn(self, hosts: HostMesh) -> ProcMesh:
        command = None if self.forked is None else _server(self.forked).command
        return hosts.spawn_procs(per_host=self.per_host, bootstrap=self.bootstrap, bootstrap_command=command)


def is_worker_process(process: psutil.Process) -> bool:
    """Whether ``process`` is a Monarch worker process or a child of one: started by Monarch's
    bootstrap, or forked by a fork server (whose command line it keeps, and whose child it is).
    Neither a fork server nor a ``start`` process is one: a ``start`` process ends as soon as its
    worker or the server has. Raises what ``psutil`` raises for a process that ended."""
    command = process.cmdline()
    if any(worker_forkserver.BOOTSTRAP_MODULE in part for part in command):
        return True
    if _role(command) in (None, "start"):
        return False
    parent = process.parent()
    return parent is not None and SCRIPT in parent.cmdline()


def is_start_process(process: psutil.Process) -> bool:
    """Whether ``process`` is a ``start`` process: what Monarch launched for a forked worker, which
    hands the worker its standard streams. Raises what ``psutil`` raises for a process that ended."""
    return _role(process.cmdline()) == "start"


def _role(command: Sequence[str]) -> Optional[str]:
    """The fork server script's role in the command line ``command`` (``serve`` or ``start``;
    ``serve`` too in a worker it forked, which keeps the server's); ``None`` if it runs no such script."""
    return command[command.index(SCRIPT) + 1] if SCRIPT in command else None


def fork_server_pids(package: Optional[str] = None) -> list[int]:
    """The process IDs of this process's fork servers (of ``package``'s workers, if given), each
    package's most recently used first."""
    return [server.pid for name, servers in _SERVERS.items() if package in (None, name) for server in servers]


def stop_fork_servers() -> None:
    """Stop this process's fork servers."""
    while _SERVERS:
        for server in _SERVERS.popitem()[1]:
            server.stop()


# registered at import, before any mesh exists, so that it runs after the pool stopped its mesh
atexit.register(stop_fork_servers)
