"""lightning_monarch: PyTorch Lightning's single-controller strategy on PyTorch Monarch.

``import lightning_monarch`` registers ``Trainer(strategy="monarch")`` and
``Trainer(strategy="monarch_fsdp")``. The user's process becomes the controller: it runs
Lightning's loops, callbacks, loggers and checkpoints once, while one Monarch worker per device
runs the LightningModule with DDP (or, under ``"monarch_fsdp"``, sharded with FSDP2).
"""

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_monarch import _compat
from lightning_monarch.accelerator import WorkerGPUAccelerator
from lightning_monarch.controller.checkpoints import convert_sharded_checkpoint
from lightning_monarch.controller.plan import observe_only
from lightning_monarch.controller.pool import stop_meshes
from lightning_monarch.controller.stats import MeshStatsMonitor
from lightning_monarch.errors import (
    DivergenceError,
    MeshFailureError,
    UnreachableHostsError,
    WorkerError,
    WorkerTimeoutError,
)
from lightning_monarch.strategy import MonarchStrategy

__all__ = [
    "DivergenceError",
    "MeshFailureError",
    "MeshStatsMonitor",
    "MonarchStrategy",
    "WorkerError",
    "WorkerGPUAccelerator",
    "WorkerTimeoutError",
    "UnreachableHostsError",
    "convert_sharded_checkpoint",
    "observe_only",
    "stop_meshes",
]
__version__ = "0.1.0"

StrategyRegistry.register(
    MonarchStrategy.strategy_name,
    MonarchStrategy,
    description="Single-controller training on a PyTorch Monarch worker mesh",
    override=True,
)
#: The registered name of ``MonarchStrategy(parallelism="fsdp")``.
SHARDED_STRATEGY_NAME = "monarch_fsdp"

StrategyRegistry.register(
    SHARDED_STRATEGY_NAME,
    MonarchStrategy,
    description="Single-controller training on a PyTorch Monarch worker mesh, the module sharded with FSDP2",
    override=True,
    parallelism="fsdp",
)


def _route_gpu_to_workers(strategy: Any, accelerator: Any) -> Any:
    """Under strategy="monarch", ``accelerator="gpu"``/``"cuda"`` names the workers' GPUs."""
    is_monarch = strategy in (MonarchStrategy.strategy_name, SHARDED_STRATEGY_NAME) or isinstance(strategy, MonarchStrategy)
    if is_monarch and isinstance(accelerator, str) and accelerator in ("gpu", "cuda"):
        WorkerGPUAccelerator.check_available(accelerator)
        return WorkerGPUAccelerator()
    return accelerator


_compat.route_accelerator(_route_gpu_to_workers)
