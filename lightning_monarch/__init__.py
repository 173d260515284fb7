"""lightning_monarch: PyTorch Lightning's single-controller strategy on PyTorch Monarch.

``import lightning_monarch`` makes your process the controller
(:func:`lightning_monarch.controller.install.install`): it registers
``Trainer(strategy="monarch")`` (:class:`MonarchStrategy`),
``Trainer(strategy="monarch_model_parallel")`` (:class:`MonarchModelParallelStrategy`) and
``Trainer(strategy="monarch_fsdp")`` (:class:`MonarchFSDPStrategy`). The controller runs
Lightning's loops, callbacks, loggers and checkpoints once, while one Monarch worker per device
runs the LightningModule with DDP (or sharded: tensor parallel and FSDP2, or FSDP2 alone).

In a process that Monarch launched for a worker mesh the package is imported for its shared
modules and ``worker/`` only: nothing of the controller is installed there, and its modules are
imported only if the user's own code asks for one of their names.

``lightning_monarch.pl`` is this package for ``pytorch_lightning``: the same names, whose
classes subclass ``pytorch_lightning``'s (:mod:`lightning_monarch.namespaces`). Both namespaces'
strategy names are registered: ``pytorch_lightning``'s as soon as it is imported.
"""

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from lightning_monarch import namespaces  # noqa: F401 - makes lightning_monarch.pl importable
from lightning_monarch._compat import monarch as monarch_compat

__version__ = "0.1.0"

if TYPE_CHECKING:  # for type checkers and the API reference; at run time, __getattr__ below
    from lightning_monarch.controller.features.rehearsal import RehearsalReport, rehearse
    from lightning_monarch.controller.features.stats import MeshStatsMonitor
    from lightning_monarch.controller.launch.accelerator import WorkerGPUAccelerator
    from lightning_monarch.controller.loop.callbacks import on_controller, on_workers
    from lightning_monarch.controller.loop.checkpoints import convert_sharded_checkpoint
    from lightning_monarch.controller.loop.plan import observe_only
    from lightning_monarch.controller.mesh.pool import stop_meshes
    from lightning_monarch.errors import (
        DivergenceError,
        HostsLostError,
        MeshFailureError,
        PreflightError,
        RehearsalError,
        UnreachableHostsError,
        ValidationFailedWarning,
        WorkerError,
        WorkerTimeoutError,
    )
    from lightning_monarch.fsdp import MonarchFSDPStrategy
    from lightning_monarch.model_parallel import MonarchModelParallelStrategy
    from lightning_monarch.strategy import MonarchStrategy

#: The public names, by the module that defines them. They are imported on first use
#: (:func:`__getattr__`), so that a worker that imports a user's module which imports one of them
#: gets it without running the controller's install step, and a worker of one namespace imports
#: nothing of the other (``lightning_monarch.pl``'s workers no ``lightning.pytorch``).
_PUBLIC_NAMES = {
    **dict.fromkeys(
        (
            "DivergenceError",
            "HostsLostError",
            "MeshFailureError",
            "PreflightError",
            "RehearsalError",
            "UnreachableHostsError",
            "ValidationFailedWarning",
            "WorkerError",
            "WorkerTimeoutError",
        ),
        "lightning_monarch.errors",
    ),
    "MeshStatsMonitor": "lightning_monarch.controller.features.stats",
    "MonarchFSDPStrategy": "lightning_monarch.fsdp",
    "MonarchModelParallelStrategy": "lightning_monarch.model_parallel",
    "MonarchStrategy": "lightning_monarch.strategy",
    "WorkerGPUAccelerator": "lightning_monarch.controller.launch.accelerator",
    "convert_sharded_checkpoint": "lightning_monarch.controller.loop.checkpoints",
    "observe_only": "lightning_monarch.controller.loop.plan",
    "on_controller": "lightning_monarch.controller.loop.callbacks",
    "on_workers": "lightning_monarch.controller.loop.callbacks",
    "RehearsalReport": "lightning_monarch.controller.features.rehearsal",
    "rehearse": "lightning_monarch.controller.features.rehearsal",
    "stop_meshes": "lightning_monarch.controller.mesh.pool",
}

__all__ = [
    "DivergenceError",
    "HostsLostError",
    "MeshFailureError",
    "MeshStatsMonitor",
    "MonarchFSDPStrategy",
    "MonarchModelParallelStrategy",
    "MonarchStrategy",
    "PreflightError",
    "RehearsalError",
    "RehearsalReport",
    "UnreachableHostsError",
    "ValidationFailedWarning",
    "WorkerError",
    "WorkerGPUAccelerator",
    "WorkerTimeoutError",
    "convert_sharded_checkpoint",
    "observe_only",
    "on_controller",
    "on_workers",
    "rehearse",
    "stop_meshes",
]


def __getattr__(name: str) -> Any:
    """``lightning_monarch.MonarchStrategy`` and the other public names, imported on first use."""
    if name not in _PUBLIC_NAMES:
        raise AttributeError(f"module 'lightning_monarch' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC_NAMES[name]), name)


def _strategies() -> tuple[type, ...]:
    """The strategies ``import lightning_monarch`` registers, imported when its install step asks."""
    from lightning_monarch.fsdp import MonarchFSDPStrategy
    from lightning_monarch.model_parallel import MonarchModelParallelStrategy
    from lightning_monarch.strategy import MonarchStrategy

    return MonarchStrategy, MonarchModelParallelStrategy, MonarchFSDPStrategy


def _serving() -> bool:
    """Whether this process runs ``lightning-monarch serve`` (``python -m lightning_monarch serve``
    too): a worker host's main process, which only relays, and imports neither Lightning nor torch."""
    command = sys.orig_argv[1:]  # the interpreter's options, then ``-m MODULE`` or the script, then its arguments
    for index, argument in enumerate(command):
        if argument == "-m":
            return command[index + 1 : index + 3] == [__name__, "serve"]
        if not argument.startswith("-"):
            return os.path.basename(argument) == "lightning-monarch" and command[index + 1 : index + 2] == ["serve"]
    return False


if not (monarch_compat.launched_by_monarch() or _serving()):
    from lightning_monarch.controller.install import install

    install(_strategies)
