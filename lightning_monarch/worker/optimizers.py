"""Rank 0's optimizers and LR schedulers as they ended a ``fit``, for the controller's Trainer.

Runs in the worker of rank 0, at the end of an unsharded ``fit`` (``worker.entries``). Under ``ddp``
the script's process is rank 0, so after ``trainer.fit`` its ``trainer.optimizers`` are the user's
optimizers (their classes, every param group a callback added, the last learning rates) and
``trainer.lr_scheduler_configs`` hold the user's schedulers (``get_last_lr()``, ``state_dict()``).
The controller's loop ran with stand-ins (``controller.loop.mirrors``); at the end it takes these.

They travel as a skeleton: pickled with the module's parameters named by their path in the module
(the controller's module holds the same parameters, with rank 0's final values), the module and the
Trainer named (a ``LambdaLR``'s lambda may hold them), and each optimizer's ``state`` left out: the
stage's final checkpoint state carries it, and the controller loads it
(``controller.loop.taken_back.take_optimizers``).
"""

from __future__ import annotations

import io
from typing import Any, Optional

import cloudpickle
from lightning.pytorch import Trainer

from lightning_monarch.wire.reports import SKELETON_MODULE, SKELETON_PARAMETER, SKELETON_STATE, SKELETON_TRAINER


class _SkeletonPickler(cloudpickle.Pickler):
    """Pickles optimizers and schedulers with what the controller holds itself named instead."""

    def __init__(self, file: io.BytesIO, trainer: Trainer) -> None:
        super().__init__(file)
        module = trainer.lightning_module
        self._named: dict[int, tuple[str, ...]] = {
            id(parameter): (SKELETON_PARAMETER, name)
            for name, parameter in module.named_parameters(remove_duplicate=False)
        }
        self._named.update({id(optimizer.state): (SKELETON_STATE,) for optimizer in trainer.optimizers})
        self._named[id(module)] = (SKELETON_MODULE,)
        self._named[id(trainer)] = (SKELETON_TRAINER,)

    def persistent_id(self, obj: Any) -> Optional[tuple[str, ...]]:
        return self._named.get(id(obj))


def skeleton(trainer: Trainer) -> bytes:
    """``trainer``'s optimizers and the schedulers of its LR scheduler configs, as a skeleton.
    Raises what pickling raises for one that cannot travel."""
    buffer = io.BytesIO()
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    _SkeletonPickler(buffer, trainer).dump((list(trainer.optimizers), schedulers))
    return buffer.getvalue()
