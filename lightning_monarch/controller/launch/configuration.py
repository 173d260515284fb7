"""What a Monarch strategy's Trainer arguments ask of the mesh, checked at ``Trainer(...)`` time.

Runs on the controller, called by the strategies (``MonarchStrategy._check_configuration``, when
Lightning configures the launcher) and by the commands that start a mesh as the Trainer would
(``lightning-monarch preflight``, ``info``): the accelerator, the hosts, ``min_nodes``, the GPUs
of this host and the precision plugin are checked before any worker starts, and
:func:`mesh_key` says which mesh the strategy's stages run on.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch.controller.launch.accelerator import WorkerGPUAccelerator
from lightning_monarch.controller.mesh.hosts import host_mesh
from lightning_monarch.controller.mesh.output import WorkerOutput
from lightning_monarch.controller.mesh.pool import MeshKey
from lightning_monarch.devices import host_gpu_count, pin
from lightning_monarch.wire.specs import worker_backend

if TYPE_CHECKING:
    from lightning_monarch.strategy import MonarchStrategy


def check_configuration(strategy: MonarchStrategy) -> None:
    """Reject Trainer arguments that cannot work with a Monarch mesh, and connect to
    ``strategy.hosts``: the strategy keeps their ``HostMesh`` (``None``: this host)."""
    accelerator = strategy.accelerator
    if not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator, WorkerGPUAccelerator)):
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', accelerator={type(accelerator).__name__})`: Monarch workers run"
            " on CPUs or on CUDA/ROCm GPUs. Use `accelerator='cpu'` or `accelerator='gpu'`."
        )
    if strategy.hosts is None and strategy.num_nodes != 1:
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', num_nodes={strategy.num_nodes})`: without `MonarchStrategy(hosts=...)` the"
            " workers run on this host only. Give the hosts, e.g. `MonarchStrategy(hosts=SlurmJob(...))`, or"
            " use `num_nodes=1`."
        )
    if strategy.min_nodes is not None:
        _check_min_nodes(strategy)
    if strategy.hosts is not None:
        strategy._host_mesh = host_mesh(
            strategy.hosts, strategy.num_nodes, strategy._gpus_per_host, strategy.connect_timeout
        )
    _check_gpus_here(strategy)
    precision = strategy.precision_plugin
    if not type(precision).__module__.startswith("lightning.pytorch.plugins.precision"):
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', plugins=[{type(precision).__name__}(...)])`: the workers build their"
            " precision plugin from the `precision=` flag, so a custom precision plugin would not reach"
            " them. Pass `precision='bf16-mixed'` (or another precision string) instead."
        )


def mesh_key(strategy: MonarchStrategy) -> MeshKey:
    """What a warm mesh must match to run ``strategy``'s next stage."""
    hosts = strategy._host_mesh
    devices = strategy.parallel_devices or ()
    gpu_indices = tuple(device.index or 0 for device in devices) if strategy.worker_accelerator == "cuda" else None
    return MeshKey(
        strategy.worker_accelerator,
        worker_backend(strategy.worker_accelerator, strategy.process_group_backend),
        hosts,
        len(devices),
        gpu_indices,
        _pins_here(gpu_indices) if hosts is None else None,
        WorkerOutput(strategy.aggregate_window_sec) if hosts is not None else None,
        hold_warnings=strategy.aggregate_window_sec is not None,
    )


def _pins_here(gpu_indices: Optional[tuple[int, ...]]) -> Optional[tuple[tuple[str, str], ...]]:
    """For GPU workers on this host: the visibility variable each local rank will pin itself
    with (``worker.process``), from this process's environment, which they inherit. A mask
    that cannot give every worker its GPU raises here, before any worker starts."""
    if gpu_indices is None:
        return None
    return tuple(pin(index, os.environ, rocm=torch.version.hip is not None) for index in gpu_indices)


def _check_min_nodes(strategy: MonarchStrategy) -> None:
    """``min_nodes`` counts hosts the run may go on with: some of the ``num_nodes`` it asks for."""
    if strategy.hosts is None:
        raise MisconfigurationException(
            f"`MonarchStrategy(min_nodes={strategy.min_nodes})` lets a run go on when hosts are lost, but without"
            " `MonarchStrategy(hosts=...)` every worker runs on this host, the controller's, which the run"
            " cannot go on without. Give the hosts (a Monarch job or worker addresses), or drop `min_nodes`."
        )
    if strategy.min_nodes is not None and strategy.min_nodes > strategy.num_nodes:
        raise MisconfigurationException(
            f"`MonarchStrategy(min_nodes={strategy.min_nodes})` is more than `Trainer(num_nodes={strategy.num_nodes})`:"
            f" the run may go on with at most the {strategy.num_nodes} host(s) it asks for. Use"
            f" `min_nodes<={strategy.num_nodes}`."
        )


def _check_gpus_here(strategy: MonarchStrategy) -> None:
    """GPU workers on this host need a GPU each: refuse a mask that cannot give them one, or
    more devices than the host has (counted by NVML or AMD SMI, which initialize no GPU)."""
    key = mesh_key(strategy)
    found = host_gpu_count()
    if key.pins is None or found is None:
        return
    missing = sorted({int(device) for _, device in key.pins if device.isdigit() and int(device) >= found})
    if missing:
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', accelerator='gpu', devices={strategy._devices_argument()})` pins worker"
            f" processes to GPU(s) {missing}, but this host has {found} GPU(s). Ask for `devices={found}` or"
            " fewer, or give `MonarchStrategy(hosts=...)` to run the workers on other hosts."
        )
