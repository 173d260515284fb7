"""The boundary between a Monarch strategy and the controller's modules: settings down, outcomes back.

Runs on the controller. When Lightning configures a Monarch strategy's launcher (at
``Trainer(...)`` time), the strategy freezes its options, devices, nodes and hosts into
:class:`StrategySettings` and hands them to the launcher, with itself as :class:`StrategyHooks`:
the few calls that a subclass changes (``MonarchFSDPStrategy`` shards) or that tell the strategy
what a stage produced (:class:`StageOutcome`, which the strategy records). The launcher and the
features read the settings and call the hooks; they import neither ``strategy.py`` nor its
subclasses' modules, and write none of the strategy's attributes (``tests/test_layout.py``). The
model is torch elastic's ``agent/server/api.py``: a frozen ``WorkerSpec`` down, a ``RunResult`` back.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch
from monarch.actor import HostMesh

from lightning_monarch.controller.mesh.output import WorkerOutput
from lightning_monarch.controller.mesh.pool import MeshKey
from lightning_monarch.devices import pin
from lightning_monarch.wire.specs import worker_backend

if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.strategies import Strategy

    from lightning_monarch.controller.features.rehearsal import RehearsalReport
    from lightning_monarch.controller.loop.session import StageSession
    from lightning_monarch.controller.mesh.snapshots import SnapshotDirectory
    from lightning_monarch.wire.specs import ShardingSpec


@dataclass(frozen=True)
class StrategySettings:
    """What a Monarch strategy asks of its workers, frozen when Lightning configures its launcher:
    the constructor's options as checked, and what Lightning's connector gave (devices, nodes,
    accelerator, ``sync_batchnorm``)."""

    #: Makes a strategy of the same class and arguments, but the keyword arguments it is given,
    #: for a rehearsal's Trainer (it reads the arguments then: ``MonarchStrategy._arguments``).
    twin: Callable[..., Strategy]
    #: ``hosts=`` as the user gave it, and its ``HostMesh`` once connected (``None``: this host).
    hosts: Any
    host_mesh: Optional[HostMesh]
    connect_timeout: float
    aggregate_window_sec: Optional[int]
    process_group_backend: Optional[str]
    worker_callbacks: Sequence[Callback]
    max_restarts: int
    snapshot_every_n_epochs: int
    min_nodes: Optional[int]
    keep_global_batch: bool
    step_timeout: Optional[float]
    max_ahead: Optional[int]
    keep_warm: bool
    shared_memory: bool
    rehearse: bool
    post_mortem: bool
    timeout: Optional[timedelta]
    #: ``"sync"``, or ``"async"``: a ``fit`` validates on ``validation_devices`` further workers
    #: (``controller.features.async_validation``); ``None`` devices: as many as train. Their hosts
    #: as the user gave them, and connected (``None``: the training hosts).
    validation: str
    validation_devices: Optional[int]
    validation_hosts: Any
    validation_host_mesh: Optional[HostMesh]
    #: Whether these are a rehearsal's settings (``controller.features.rehearsal``).
    rehearsing: bool
    ddp_kwargs: Mapping[str, Any]
    #: The accelerator the workers' Trainers use: ``"cuda"`` (CUDA or ROCm) or ``"cpu"``.
    worker_accelerator: str
    #: Each host's devices, as ``Trainer(devices=...)`` selected them.
    devices: tuple[torch.device, ...]
    num_nodes: int
    sync_batchnorm: bool

    @property
    def gpu_indices(self) -> Optional[tuple[int, ...]]:
        """GPU workers: the ``devices=`` index of each local rank; ``None`` for CPU workers."""
        return tuple(device.index or 0 for device in self.devices) if self.worker_accelerator == "cuda" else None

    @property
    def gpus_per_host(self) -> int:
        """How many GPUs each host's workers use: ``devices`` for GPU workers, 0 for CPU ones."""
        return len(self.devices) if self.worker_accelerator == "cuda" else 0

    @property
    def devices_argument(self) -> Any:
        """``Trainer(devices=...)`` as it selects these devices: a count, or GPU indices."""
        indices = self.gpu_indices or ()
        return list(indices) if indices and list(indices) != list(range(len(indices))) else len(self.devices)

    def mesh_key(self) -> MeshKey:
        """What a warm mesh must match to run these settings' next stage (read from this process's
        environment now: GPU workers on this host inherit it)."""
        gpu_indices, hosts = self.gpu_indices, self.host_mesh
        pins = None
        if hosts is None and gpu_indices is not None:
            pins = tuple(pin(index, os.environ, rocm=torch.version.hip is not None) for index in gpu_indices)
        return MeshKey(
            self.worker_accelerator,
            worker_backend(self.worker_accelerator, self.process_group_backend),
            hosts,
            len(self.devices),
            gpu_indices,
            pins,
            WorkerOutput(self.aggregate_window_sec) if hosts is not None else None,
            hold_warnings=self.aggregate_window_sec is not None,
            timeout=self.timeout,
        )

    def connected(self, host_mesh: Optional[HostMesh]) -> StrategySettings:
        """These settings, on ``host_mesh``."""
        return dataclasses.replace(self, host_mesh=host_mesh)


@dataclass(frozen=True)
class StageOutcome:
    """What a stage, or a part of it, produced, for the strategy to record: counts to add, and
    values that replace the strategy's (``None``: unchanged)."""

    #: How many times the stage replaced its worker processes after a failure.
    restarts: int = 0
    #: The bytes sent the workers in the stage's messages, by endpoint.
    sent_bytes: Optional[Mapping[str, int]] = None
    #: How many times an elastic ``fit``'s world changed.
    world_changes: int = 0
    #: How many hosts an elastic ``fit``'s world has now (its own ``num_nodes`` again at the end).
    num_nodes: Optional[int] = None
    #: The report of the rehearsal before a ``fit``.
    rehearsal: Optional[RehearsalReport] = None


@runtime_checkable
class StrategyHooks(Protocol):
    """What the launcher and the features call on a Monarch strategy: the hooks its subclasses
    change, and where it records what they produced."""

    def _sharding_for_stage(self, module: LightningModule, ckpt_path: Any) -> Optional[ShardingSpec]:
        """How the workers shard ``module``; ``None``: a replica each."""

    def _snapshot_directory(self) -> Optional[SnapshotDirectory]:
        """Where the workers write recovery snapshots; ``None``: they send them to the controller."""

    def _attach(self, session: Optional[StageSession]) -> None:
        """The session of the stage in progress, or ``None`` after it."""

    def _keep_until_exception_handled(self, undo: Optional[Callable[[], None]]) -> None:
        """Hold ``undo`` until Lightning has run its exception hooks."""

    def _record(self, outcome: StageOutcome) -> None:
        """Keep what ``outcome`` says."""


def settings_of(strategy: Any) -> Optional[StrategySettings]:
    """The settings a Monarch strategy handed its launcher when its Trainer was made; ``None`` for
    any other strategy."""
    settings = getattr(getattr(strategy, "launcher", None), "settings", None)
    return settings if isinstance(settings, StrategySettings) else None
