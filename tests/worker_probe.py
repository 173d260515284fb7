"""An actor that reports on the worker process it is spawned in: what it imported and installed
(``test_layout.py``), what its garbage collector walks (``test_warm_mesh.py``), and how it started
(``test_forkserver.py``).

It imports nothing of lightning_monarch but what every worker has (the package root and its
namespace finder, through ``tests/__init__``), so that what it finds is what the worker's own
start-up and stages imported.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings
from typing import Any

from lightning.pytorch import Callback
from monarch.actor import Actor, endpoint

#: Modules that only the controller may import.
CONTROLLER_MODULES = (
    "lightning_monarch.controller",
    "lightning_monarch.strategy",
    "lightning_monarch.fsdp",
    "lightning_monarch.cli",
)

#: The top-level package of this module's Lightning namespace: ``lightning``, or under ``tests.pl``
#: ``pytorch_lightning``.
LIGHTNING_PACKAGE = Callback.__module__.split(".")[0]


def side_effects() -> dict[str, Any]:
    """This process's lightning_monarch modules and what the controller's install step changes."""
    import monarch.actor
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    return {
        "modules": sorted(name for name in sys.modules if name.startswith("lightning_monarch")),
        "controller_modules": sorted(name for name in sys.modules if name.startswith(CONTROLLER_MODULES)),
        "registered": "monarch" in StrategyRegistry,
        "fault_hook": monarch.actor.unhandled_fault_hook.__module__,
        "accelerator_routed": getattr(_AcceleratorConnector.__init__, "__lightning_monarch__", False),
        "lightning_packages": sorted({name.split(".")[0] for name in sys.modules} & {"lightning", "pytorch_lightning"}),
    }


class WorkerProbe(Actor):
    @endpoint
    def side_effects(self) -> dict[str, Any]:
        return side_effects()

    @endpoint
    def garbage_collector(self) -> dict[str, int]:
        """How many objects the cyclic garbage collector leaves out (``gc.freeze``) and walks."""
        return {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}

    @endpoint
    def stage_settings(self) -> dict[str, Any]:
        """What a stage sets process-wide (``worker/stage_settings.py``): Lightning's logger levels,
        the warning filters about ``ckpt_path``, ``sys.path`` and the seed variables."""
        return {
            "levels": {name: logging.getLogger(name).level for name in ("lightning.pytorch", "lightning.fabric")},
            "filters": [str(entry) for entry in warnings.filters if "ckpt_path" in str(entry)],
            "path": list(sys.path),
            "seed": {name: os.environ.get(name) for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")},
        }

    @endpoint
    def start(self) -> dict[str, Any]:
        """What a process takes from how it was started, and a draw from NumPy's global generator."""
        import numpy

        main = sys.modules["__main__"]
        return {
            "parent": os.getppid(),
            "environment": dict(os.environ),
            "path": list(sys.path),
            "argv": list(sys.argv),
            "directory": os.getcwd(),
            "main": main.__spec__.name if main.__spec__ is not None else None,
            "numpy_draw": int(numpy.random.randint(2**31)),
            "cpu_seconds": sum(os.times()[:2]),
        }
