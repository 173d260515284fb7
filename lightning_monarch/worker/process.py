"""A worker process's start-up: the environment it runs every stage in.

Runs once in each worker process, as Monarch's proc bootstrap (``HostMesh.spawn_procs(bootstrap=...)``),
before any actor of ours and before anything touches a GPU. It makes the process what a
``torchrun`` rank is, with one GPU of its own:

- Its intra-op threads are those a Lightning launcher gives a rank (the host's CPUs over its
  workers, unless ``OMP_NUM_THREADS`` is set), whatever strategy its stages run.
- ``TORCHELASTIC_RUN_ID`` is set, as torchrun sets it. The ranks (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ...) come later, from the controller (:func:`torch_elastic_env`), but not this;
  Lightning reads it to know
  that each process of an elastic launch may see one GPU only, and otherwise parses
  ``devices=8`` against the one GPU a pinned worker sees and refuses it.
- A GPU worker pins itself to its device (``lightning_monarch.devices.pin``), from the
  environment its own host gave it: on this host the controller's, on a SLURM node the mask
  SLURM set there. The process's Python interpreter stays the host's own (a ``SlurmJob``'s
  ``python_exe``), as no bootstrap command is imposed on it.
- On a host that serves preemption notices (``lightning-monarch serve``), the process ignores
  SIGTERM, which its host process takes as the notice (``worker.notices``).
- ``breakpoint()`` and ``pdb.set_trace()`` open pdb on the controller's terminal
  (``worker.breakpoints``): under Monarch's own hook, which waits for a remote debugger to attach
  from another terminal, they hung the fit.
- Unless the strategy shows every line the workers print (``aggregate_window_sec=None``), the
  process holds its Python warnings for the controller to show once (``worker.held_warnings``),
  from here on: before any stage runs, and before the user's module is unpickled.

A mask that leaves this worker no GPU hides every GPU from it (it must not take another
worker's) and keeps the reason for the preflight check to report (:data:`pinning_problem`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.actor import current_rank

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.devices import pin
from lightning_monarch.wire.specs import WorldSpec, worker_backend
from lightning_monarch.worker import breakpoints
from lightning_monarch.worker.held_warnings import HELD
from lightning_monarch.worker.notices import ignore_sigterm

#: The variable torchrun sets for every rank of an elastic launch.
RUN_ID_VARIABLE = "TORCHELASTIC_RUN_ID"
#: The per-host dimension of the workers' process mesh: one process per device.
LOCAL_DIMENSION = "gpus"

#: Why this GPU worker could not be pinned to its device (``None`` when it was, or is a CPU worker).
pinning_problem: Optional[str] = None


def start_worker_process(
    run_id: str, per_host: int, gpu_indices: Optional[tuple[int, ...]], hold_warnings: bool
) -> None:
    """Monarch's bootstrap of one worker process: the elastic run ID, the threads a Lightning
    launcher gives each of ``per_host`` ranks, SIGTERM ignored where the host takes it as a
    preemption notice, ``breakpoint()`` relayed to the controller, the warnings held for the controller (``hold_warnings``) and, for GPU
    workers (``gpu_indices``: the ``devices=...`` index of each local rank), the pinned device."""
    global pinning_problem
    os.environ[RUN_ID_VARIABLE] = run_id
    lightning_compat.set_threads_as_launched(per_host)
    ignore_sigterm()
    breakpoints.install()
    if hold_warnings:
        HELD.install()
    if gpu_indices is None:
        return
    rocm = torch.version.hip is not None
    try:
        variable, device = pin(gpu_indices[current_rank()[LOCAL_DIMENSION]], os.environ, rocm)
    except MisconfigurationException as error:
        pinning_problem = str(error)
        variable, device = ("HIP_VISIBLE_DEVICES" if rocm else "CUDA_VISIBLE_DEVICES"), ""
    os.environ[variable] = device


def ensure_process_group(accelerator: str, backend: Optional[str], timeout: Optional[timedelta]) -> None:
    """Start this process's default ``torch.distributed`` group, with the backend Lightning's DDP
    would pick (``specs.worker_backend``) and the strategy's ``timeout`` (torch's default if
    ``None``), unless one runs: the preflight check and a stage's storages need it before the
    stage's Trainer starts, which then finds it and keeps it, with its timeout."""
    if not dist.is_initialized():
        dist.init_process_group(worker_backend(accelerator, backend), timeout=timeout)


def leave_process_group() -> None:
    """Destroy this process's default ``torch.distributed`` group, if it has one: after a peer's
    host was lost, the group cannot run another collective, and the next stage's ``DDPStrategy``
    forms a new one only where none is initialized. A gloo group with a dead peer is destroyed in
    milliseconds (measured); NCCL and RCCL groups are not yet measured in that state."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def torch_elastic_env(world: WorldSpec, host: int, local_rank: int) -> dict[str, str]:
    """torchrun's environment for the worker with ``local_rank`` on the host at coordinate ``host``
    of its mesh, in ``world``: the variables Monarch's ``setup_torch_elastic_env`` sets, which
    Lightning's ``TorchElasticEnvironment`` and ``torch.distributed`` read."""
    group_rank = world.group_ranks[host]
    rank = group_rank * world.local_world_size + local_rank
    world_size = world.group_world_size * world.local_world_size
    return {
        "MASTER_ADDR": world.master_addr,
        "MASTER_PORT": str(world.master_port),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(world.local_world_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(world.group_world_size),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "rank",
        "WORLD_SIZE": str(world_size),
    }
