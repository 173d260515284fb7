"""What a Monarch strategy's Trainer arguments ask of the mesh, checked at ``Trainer(...)`` time.

Runs on the controller, called by the strategies (``MonarchStrategy._check_configuration``, when
Lightning configures the launcher): the accelerator, the hosts, ``min_nodes``, asynchronous
validation, the GPUs of this host and the precision plugin are checked, from the strategy's
settings, before any worker starts.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.actor import HostMesh

from lightning_monarch.controller.features.async_validation import check_async_validation
from lightning_monarch.controller.launch.accelerator import WorkerGPUAccelerator
from lightning_monarch.controller.mesh.hosts import host_mesh
from lightning_monarch.controller.settings import StrategySettings
from lightning_monarch.devices import host_gpu_count


class HostMeshes(NamedTuple):
    """The hosts a strategy's workers run on, connected: the training workers', and asynchronous
    validation's where it has hosts of its own (``None``: this host; the training hosts)."""

    training: Optional[HostMesh]
    validation: Optional[HostMesh]


def check_configuration(settings: StrategySettings, accelerator: Any, precision: Any) -> HostMeshes:
    """Reject Trainer arguments that cannot work with a Monarch mesh (``accelerator`` and
    ``precision`` are the plugins Lightning gave the strategy), and connect to the hosts."""
    if not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator, WorkerGPUAccelerator)):
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', accelerator={type(accelerator).__name__})`: Monarch workers run"
            " on CPUs or on CUDA/ROCm GPUs. Use `accelerator='cpu'` or `accelerator='gpu'`."
        )
    if settings.hosts is None and settings.num_nodes != 1:
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', num_nodes={settings.num_nodes})`: without `MonarchStrategy(hosts=...)` the"
            " workers run on this host only. Give the hosts, e.g. `MonarchStrategy(hosts=SlurmJob(...))`, or"
            " use `num_nodes=1`."
        )
    if settings.min_nodes is not None:
        _check_min_nodes(settings)
    if settings.validation == "async":
        check_async_validation(settings)
    hosts = HostMeshes(*(_connected(given, settings) for given in (settings.hosts, settings.validation_hosts)))
    _check_gpus_here(settings.connected(hosts.training))
    if not type(precision).__module__.startswith("lightning.pytorch.plugins.precision"):
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', plugins=[{type(precision).__name__}(...)])`: the workers build their"
            " precision plugin from the `precision=` flag, so a custom precision plugin would not reach"
            " them. Pass `precision='bf16-mixed'` (or another precision string) instead."
        )
    return hosts


def _connected(hosts: Any, settings: StrategySettings) -> Optional[HostMesh]:
    """The ``HostMesh`` of ``hosts`` as given (``None``: none given), ``num_nodes`` of them."""
    if hosts is None:
        return None
    return host_mesh(hosts, settings.num_nodes, settings.gpus_per_host, settings.connect_timeout)


def _check_min_nodes(settings: StrategySettings) -> None:
    """``min_nodes`` counts hosts the run may go on with: some of the ``num_nodes`` it asks for."""
    if settings.hosts is None:
        raise MisconfigurationException(
            f"`MonarchStrategy(min_nodes={settings.min_nodes})` lets a run go on when hosts are lost, but without"
            " `MonarchStrategy(hosts=...)` every worker runs on this host, the controller's, which the run"
            " cannot go on without. Give the hosts (a Monarch job or worker addresses), or drop `min_nodes`."
        )
    if settings.min_nodes is not None and settings.min_nodes > settings.num_nodes:
        raise MisconfigurationException(
            f"`MonarchStrategy(min_nodes={settings.min_nodes})` is more than `Trainer(num_nodes={settings.num_nodes})`:"
            f" the run may go on with at most the {settings.num_nodes} host(s) it asks for. Use"
            f" `min_nodes<={settings.num_nodes}`."
        )


def _check_gpus_here(settings: StrategySettings) -> None:
    """GPU workers on this host need a GPU each: refuse a mask that cannot give them one, or
    more devices than the host has (counted by NVML or AMD SMI, which initialize no GPU)."""
    key = settings.mesh_key()
    found = host_gpu_count()
    if key.pins is None or found is None:
        return
    missing = sorted({int(device) for _, device in key.pins if device.isdigit() and int(device) >= found})
    if missing:
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', accelerator='gpu', devices={settings.devices_argument})` pins worker"
            f" processes to GPU(s) {missing}, but this host has {found} GPU(s). Ask for `devices={found}` or"
            " fewer, or give `MonarchStrategy(hosts=...)` to run the workers on other hosts."
        )
