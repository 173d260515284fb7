"""The door to Monarch's private API: every private Monarch name lightning_monarch uses.

Checked against torchmonarch 0.7 (:data:`CHECKED_WITH`); ``tests/test_compat.py`` resolves every
name in :data:`PRIVATE_NAMES`. Importing it imports no part of Monarch (``import lightning_monarch``
asks :func:`launched_by_monarch` before Monarch may start): ``SupervisionError`` is imported when
first asked for.
"""

from __future__ import annotations

import gc
import os
import re
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
    from monarch._src.actor.debugger.pdb_wrapper import DebuggerWrite, PdbWrapper
    from monarch.actor import ProcMesh
    from monarch.job import ProcessJob, SlurmJob

__all__ = [
    "ACTOR_THREADS",
    "CHECKED_WITH",
    "DEBUGGER_NAME",
    "DebuggerWrite",
    "PdbWrapper",
    "SupervisionError",
    "bootstrap_command",
    "failed_rank",
    "flush_forwarded_output",
    "launched_by_monarch",
    "job_meshes",
    "process_job_addresses",
    "runtime_exit_handler",
    "sync_calls",
    "slurm_addresses",
    "slurm_gpus_per_node",
    "slurm_tasks_per_node",
]

#: The Monarch release this door was last checked against.
CHECKED_WITH = "torchmonarch 0.7"
#: Every private attribute this module reads, by the class whose instances have it.
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "SlurmJob": ("_meshes", "_ntasks_per_node", "_gpus_per_node", "_port", "_all_hostnames"),
    "ProcessJob": ("_meshes", "_host_to_pid"),
    "ProcMesh": ("_logging_manager",),
}
#: The names of the threads Monarch starts in a process that uses it as a client: its event loop,
#: and a driver for each sync actor that runs in the process (``_sync_dispatch_loop`` in
#: ``monarch._src.actor.actor_mesh``; ours is the loader feed), Python daemon threads that wait in
#: Rust calls without the GIL.
ACTOR_THREADS = ("monarch-actor-event-loop", "monarch-actor-driver")
#: What Monarch's proc launcher sets in the environment of every process it launches for a proc
#: mesh (``monarch._src.actor.proc_launcher.LaunchOptions``), and nowhere else.
PROC_MESH_VARIABLE = "HYPERACTOR_MESH_BOOTSTRAP_MODE"
#: The name under which Monarch's ``debug_controller()`` finds the root client's debugger (and spawns
#: its own ``DebugController`` when none has it): a worker's pdb sends its reads and writes there.
DEBUGGER_NAME = "debug_controller"


def launched_by_monarch() -> bool:
    """Whether Monarch launched this process for a proc mesh: here, a worker of ours."""
    return PROC_MESH_VARIABLE in os.environ


def __getattr__(name: str) -> Any:
    """``SupervisionError``, ``PdbWrapper`` and ``DebuggerWrite``, imported on first use: importing
    Monarch here, at ``import lightning_monarch``, would start it before ``controller.install``
    configured it."""
    if name == "SupervisionError":  # what a call raises when a process of its mesh died
        from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

        return SupervisionError
    if name in ("PdbWrapper", "DebuggerWrite"):  # Monarch's pdb over a debugger's endpoints, and its messages
        from monarch._src.actor.debugger import pdb_wrapper

        return getattr(pdb_wrapper, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sync_calls() -> Any:
    """A context in which a call's ``.get()`` may block, even on an actor's endpoint thread (Monarch's
    own pdb makes its calls to the debugger in one)."""
    from monarch._src.actor.sync_state import fake_sync_state

    return fake_sync_state()


def bootstrap_command(program: str, args: list[str]) -> BootstrapCommand:
    """A proc bootstrap command for ``HostMesh.spawn_procs(bootstrap_command=...)``: ``program``
    with ``args``, in the environment the host gives its procs (the class of Monarch's own
    ``default_bootstrap_cmd()``, which the public API names only in type hints)."""
    from monarch.actor import default_bootstrap_cmd

    return type(default_bootstrap_cmd())(program, None, args, {})


def job_meshes(job: Any) -> Optional[dict[str, Any]]:
    """A Monarch job's mesh specification (mesh name to host count, or a mesh config on
    Kubernetes), as its constructor keeps it; ``None`` for an object that keeps none."""
    meshes = getattr(job, "_meshes", None)
    return meshes if isinstance(meshes, dict) else None


def slurm_tasks_per_node(job: SlurmJob) -> int:
    """``SlurmJob(ntasks_per_node=...)``."""
    return job._ntasks_per_node


def slurm_gpus_per_node(job: SlurmJob) -> Optional[int]:
    """``SlurmJob(gpus_per_node=...)``."""
    return job._gpus_per_node


def slurm_addresses(job: SlurmJob) -> list[str]:
    """The workers' addresses of a running ``SlurmJob``: its allocated hostnames and port."""
    return [f"tcp://{hostname}:{job._port}" for hostname in job._all_hostnames]


def process_job_addresses(job: ProcessJob, mesh: str) -> list[str]:
    """The workers' addresses of a running ``ProcessJob``'s ``mesh``: each host process's Unix
    socket, in the order of the mesh's hosts."""
    return [job._host_to_pid[f"{mesh}_{index}"].channel for index in range(job._meshes[mesh])]


async def flush_forwarded_output(procs: ProcMesh) -> None:
    """Flush the log forwarders of ``procs``: once it returns, they have taken every message sent
    to them before, the logging mode included."""
    await procs._logging_manager.flush_async()


def runtime_exit_handler() -> Optional[Callable[[], None]]:
    """The exit handler Monarch's bindings register when they are imported: the Rust function
    ``shutdown_tokio_runtime``, which stops its runtimes and gives :data:`ACTOR_THREADS` 250 ms to
    end. No module names it, so it is found among the live objects (about 0.1 s in a process that
    imported torch and Lightning); ``None`` when Monarch's bindings were never imported."""
    for candidate in gc.get_objects():
        if type(candidate) is types.BuiltinFunctionType and candidate.__name__ == "shutdown_tokio_runtime":
            return candidate
    return None


#: The point Monarch's supervision report names (``{'hosts': 1/2, 'gpus': 0/4}``).
_POINT = re.compile(r"\{((?:'\w+': \d+/\d+(?:, )?)+)\}")
_COORDINATE = re.compile(r"'\w+': (\d+)/(\d+)")


def failed_rank(report: str) -> Optional[int]:
    """The global rank of the worker that Monarch's supervision ``report`` names, from the point it
    gives (``{'hosts': 1/2, 'gpus': 0/4}``): the row-major index over every dimension, which is the
    ``RANK`` the mesh gave that process when it started (``controller.mesh.world``; after an elastic
    change of the world, a worker on another host may have another). ``None`` if it names no point."""
    point = _POINT.search(report)
    if point is None:
        return None
    rank = 0
    for index, size in _COORDINATE.findall(point.group(1)):
        rank = rank * int(size) + int(index)
    return rank
