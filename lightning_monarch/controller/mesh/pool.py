"""Warm worker meshes: kept between Trainer stages and Trainers in the same process.

Runs on the controller. Spawning a mesh takes seconds; a notebook user who calls ``fit``, then
``validate``, then ``fit`` again with a new Trainer should pay that once. A mesh goes back to the
pool only after a stage that ended cleanly; after any failure it is stopped, so a broken or
half-finished worker is never reused. One idle mesh is kept at a time, in this process, whichever
of Lightning's namespaces its Trainer was (``lightning_monarch.pl`` has a pool of its own, whose
workers run ``pytorch_lightning``): a stage of one namespace stops the other's idle mesh first.
``stop_meshes()`` stops both, and so does interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

from monarch.actor import HostMesh

from lightning_monarch import namespaces
from lightning_monarch.controller.mesh.cells import blocks_the_cell
from lightning_monarch.controller.mesh.output import WorkerOutput
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshKey:
    """What a worker process fixes for its lifetime, so a mesh is reused only when all agree.

    The ``torch.distributed`` process group is created by a worker's first stage and kept (as on
    a DDP rank that runs several stages), so its backend belongs here; so does the GPU each
    process pinned itself to when it started.
    """

    accelerator: str
    #: The backend the workers' process group uses: the one chosen, else Lightning's default for
    #: the device (``specs.worker_backend``), so that ``gloo`` by name and by default share a mesh.
    process_group_backend: str
    #: The ``HostMesh`` the workers run on; ``None`` for this host. Compared by identity
    #: (:attr:`host_identity`): Monarch's own equality cannot compare a mesh with ``None``.
    hosts: Optional[HostMesh] = field(compare=False)
    #: Worker processes per host.
    per_host: int
    #: GPU workers: the ``devices=`` index of each local rank; ``None`` for CPU workers.
    gpu_indices: Optional[tuple[int, ...]]
    #: GPU workers on this host: each local rank's pinned visibility variable and value, which
    #: its process computes from the environment it inherits from this one (a changed mask needs
    #: new processes). ``None`` elsewhere: each host pins its workers from its own environment.
    pins: Optional[tuple[tuple[str, str], ...]] = None
    #: How the output of workers on other hosts reaches the controller; ``None`` on this host.
    output: Optional[WorkerOutput] = None
    #: Whether the workers hold their Python warnings for the controller to show once
    #: (``worker.held_warnings``), which each process sets up when it starts.
    hold_warnings: bool = True
    #: The process group's timeout (``MonarchStrategy(timeout=...)``), fixed when the group starts.
    timeout: Optional[timedelta] = None
    host_identity: Optional[int] = field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_identity", None if self.hosts is None else id(self.hosts))


class MeshPool:
    """Runs on the controller: hands out worker meshes and keeps one warm between stages."""

    def __init__(self) -> None:
        self._idle: Optional[tuple[MeshKey, WorkerMesh]] = None
        self._stops_at_exit = False

    def acquire(self, key: MeshKey) -> WorkerMesh:
        """The idle mesh if it matches ``key`` and still answers; else a new one. The other
        namespace's idle mesh is stopped first."""
        other = other_namespace_pool()
        if other is not None:
            other.stop()
        idle, self._idle = self._idle, None
        if idle is not None:
            idle_key, mesh = idle
            if idle_key != key:
                mesh.stop()
            elif mesh.answers():
                return mesh
            else:  # a worker that does not answer may be stuck and would not stop when asked
                mesh.stop(kill=True)
        return WorkerMesh.spawn(key.per_host, key.gpu_indices, key.hosts, key.output, key.hold_warnings)

    def release(self, key: MeshKey, mesh: WorkerMesh, keep: bool, failed: bool) -> None:
        """Take ``mesh`` back after a stage: keep it warm if ``keep`` and the stage did not fail,
        else stop it, killing its processes if the stage failed."""
        if keep and not failed:
            try:
                mesh.end_stage()
            except Exception as error:  # a mesh that cannot end its stage is not worth keeping
                log.warning("Stopping the worker mesh instead of keeping it warm: %s", error)
                failed = True
            else:
                self.stop()
                self._idle = (key, mesh)
                self._stop_at_exit()
                return
        mesh.stop(kill=failed)

    def _stop_at_exit(self) -> None:
        """Stop the idle mesh at interpreter exit. Registered once a mesh exists, after Monarch
        registered its own client shutdown, so that it runs first (``atexit`` runs in reverse)."""
        if not self._stops_at_exit:
            atexit.register(self.stop)
            self._stops_at_exit = True

    def idle(self, key: MeshKey) -> Optional[WorkerMesh]:
        """The idle mesh, if the next stage with ``key`` would get it."""
        return self._idle[1] if self._idle is not None and self._idle[0] == key else None

    def worker_pids(self) -> list[int]:
        """The process IDs of the idle mesh's workers."""
        return self._idle[1].pids if self._idle is not None else []

    def stop(self) -> None:
        """Stop the idle mesh, if there is one."""
        idle, self._idle = self._idle, None
        if idle is not None:
            idle[1].stop()


#: The controller process's pool; ``launcher`` takes its meshes from here.
MESHES = MeshPool()


def other_namespace_pool() -> Optional[MeshPool]:
    """The pool of the other Lightning namespace's copy of this module, if it was imported."""
    return getattr(sys.modules.get(namespaces.counterpart(__name__)), "MESHES", None)


@blocks_the_cell
def stop_meshes() -> None:
    """Stop the warm worker mesh that ``strategy="monarch"`` keeps between stages, if any, in
    either of Lightning's namespaces.

    The next ``fit``/``validate``/``test``/``predict`` then starts a new one. Interpreter exit
    stops it too.
    """
    MESHES.stop()
    other = other_namespace_pool()
    if other is not None:
        other.stop()
