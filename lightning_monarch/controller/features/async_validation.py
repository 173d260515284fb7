"""Asynchronous validation's second mesh (``MonarchStrategy(validation="async")``), and what it refuses.

Runs on the controller. A ``fit`` with asynchronous validation runs on two meshes: the training
workers, and as many validation workers on this host, which validate the weights each training rank
hands its validation worker at each validation point while training goes on
(``worker.async_validation``). :class:`ValidationMesh` starts the second mesh and its serving stage
before the training stage, whose workers it names; the controller's loop replays each validation
from its entries (``controller.loop.validation_replay``). Input it cannot serve with the
synchronous run's results is refused before any worker starts: at ``Trainer(...)`` what the
strategy's settings ask (:func:`check_async_validation`), at ``fit`` the callbacks
(:func:`refuse_async_callbacks`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.features import preflight
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.controller.settings import StrategySettings
from lightning_monarch.wire.specs import StageSpec

_ASYNC = "`MonarchStrategy(validation='async')`"


def check_async_validation(settings: StrategySettings) -> None:
    """At ``Trainer(...)``: refuse what asynchronous validation does not serve yet."""
    world = len(settings.devices) * settings.num_nodes
    refusals = [
        (
            settings.worker_accelerator == "cuda",
            "runs its validation workers on CPUs only, for now. Use"
            " `accelerator='cpu'`, or `validation='sync'` on GPUs",
        ),
        (
            settings.hosts is not None,
            "runs both meshes on this host only, for now. Drop `hosts=...`, or use `validation='sync'`",
        ),
        (
            settings.max_restarts > 0,
            "does not recover from a worker's failure yet. Use `max_restarts=0`, or `validation='sync'`",
        ),
        (
            settings.validation_devices not in (None, world),
            f"validates on as many workers as train ({world}), so"
            " that each validates the shard of the validation set that the same rank validates synchronously and"
            f" the logged values are the synchronous run's; `validation_devices={settings.validation_devices}` would"
            f" shard it otherwise. Use `validation_devices={world}` or leave it out",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise MisconfigurationException(f"{_ASYNC} {why}.")


def refuse_async_callbacks(trainer: Trainer) -> None:
    """At ``fit``, before any worker starts: refuse the callbacks that would act on a validation's
    result where the synchronous run does, which the training workers have passed by then."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        name = type(callback).__name__
        if isinstance(callback, EarlyStopping):
            why = "would stop the training workers at the validation it decides on, which they passed by then"
        elif isinstance(callback, ModelCheckpoint) and callback.monitor is not None:
            why = f"ranks checkpoints by `{callback.monitor}`, which the training workers' state would not match"
        elif isinstance(callback, ModelCheckpoint) and lightning_compat.saves_at_validation_end(callback, trainer):
            why = "saves at the end of each validation, where the training workers' state has moved on"
        else:
            continue
        raise MisconfigurationException(
            f"`{name}` with {_ASYNC}: it {why}; asynchronous validation does not serve it yet. Use"
            " `validation='sync'`, or leave the callback out (`enable_checkpointing=False` for the default"
            " checkpoint callback; a `ModelCheckpoint` without `monitor` that saves at each training epoch's end"
            " works)."
        )


class ValidationMesh:
    """Runs on the controller: the validation workers of one ``fit``, and their stage."""

    def __init__(self, settings: StrategySettings) -> None:
        self._settings = settings
        self._mesh: Optional[WorkerMesh] = None
        #: The serving stage's traffic, once started.
        self.channel: Optional[StageChannel] = None

    def start(self, spec: StageSpec) -> StageSpec:
        """Start the validation workers, check them, and start their stage, which serves the weights
        of the training stage ``spec``; return that stage as it hands its weights to them, its
        workers free of credit (the next validation point bounds their lead)."""
        key = self._settings.mesh_key()
        self._mesh = WorkerMesh.spawn(key.per_host, hold_warnings=key.hold_warnings)
        self._mesh.step_timeout = self._settings.step_timeout
        preflight.check(self._mesh, key.accelerator, key.process_group_backend, timeout=key.timeout)
        free = dataclasses.replace(spec.run_ahead, max_ahead=None)
        self.channel = StageChannel(
            self._mesh,
            dataclasses.replace(spec, serves_validation=True, run_ahead=free),
            shared_memory=self._settings.shared_memory,
        )
        self.channel.start()
        return dataclasses.replace(spec, validators=self._mesh.rank_actors(), run_ahead=free)

    def stop(self, failed: bool) -> None:
        """Stop the validation workers, killing them if the ``fit`` failed (they may be stuck)."""
        if self._mesh is not None:
            self._mesh.stop(kill=failed)
