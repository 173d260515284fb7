"""Asynchronous validation's second mesh (``MonarchStrategy(validation="async")``), and what it refuses.

Runs on the controller. A ``fit`` with asynchronous validation runs on two meshes: the training
workers, and as many validation workers on the same hosts (on GPUs, the ones after the training
workers') or on hosts of their own (:func:`validation_settings`), which validate the weights each training rank
hands its validation worker at each validation point while training goes on
(``worker.async_validation``). :class:`ValidationMesh` starts the second mesh and its serving stage
before the training stage, whose workers it names; the controller's loop replays each validation
from its entries (``controller.loop.validation_replay``). Input it cannot serve with the
synchronous run's results is refused before any worker starts: at ``Trainer(...)`` what the
strategy's settings ask (:func:`check_async_validation`), at ``fit`` the validation interval and
the callbacks (:func:`refuse_at_fit`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.features import preflight
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.controller.settings import StrategySettings
from lightning_monarch.devices import host_gpu_count
from lightning_monarch.wire.specs import StageSpec, Validators

_ASYNC = "`MonarchStrategy(validation='async')`"


def check_async_validation(settings: StrategySettings) -> None:
    """At ``Trainer(...)``: refuse what asynchronous validation does not serve yet, and validation
    workers' GPUs that this host does not have."""
    world = len(settings.devices) * settings.num_nodes
    refusals = [
        (
            settings.min_nodes is not None,
            "does not go on without lost hosts yet: its validation workers run on the training hosts. Drop"
            " `min_nodes=...`, or use `validation='sync'`",
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
    gpus = validation_settings(settings).gpu_indices or ()
    here = settings.hosts is None and settings.validation_hosts is None
    found = host_gpu_count() if here else None  # workers on other hosts check their own GPUs
    if found is not None and any(index >= found for index in gpus):
        raise MisconfigurationException(
            f"{_ASYNC} runs its {len(gpus)} validation workers on the GPUs after the training workers',"
            f" {list(gpus)}, but this host has {found} GPU(s). Train on fewer devices (`devices=`), or use"
            " `validation='sync'`."
        )


def validation_settings(settings: StrategySettings) -> StrategySettings:
    """The validation workers' settings: as many as train; on hosts of their own
    (``validation_hosts``) on the same devices, else on GPUs the ones after the training workers'
    highest (``devices=[0, 1]`` trains on GPUs 0 and 1 and validates on 2 and 3)."""
    if settings.validation_host_mesh is not None:
        return settings.connected(settings.validation_host_mesh)
    if settings.worker_accelerator != "cuda":
        return settings
    after = 1 + max(device.index or 0 for device in settings.devices)
    devices = tuple(torch.device("cuda", after + position) for position in range(len(settings.devices)))
    return dataclasses.replace(settings, devices=devices)


def refuse_at_fit(trainer: Trainer) -> None:
    """At ``fit``, before any worker starts: refuse a ``val_check_interval`` that validates after
    every training batch, where every validation point would wait for the one before, as
    synchronous validation waits; and a ``ModelCheckpoint(monitor=...)`` or an ``EarlyStopping``
    that decides at each training epoch's end: it does so with every rank's value of the metric it
    monitors (``controller.loop.collectives``), which the training ranks do not hold of a
    validation's metrics. At a validation's end the validation workers hold them."""
    if isinstance(trainer.val_check_interval, int) and trainer.val_check_interval == 1:
        raise MisconfigurationException(
            f"`Trainer(val_check_interval=1)` with {_ASYNC} validates after every training batch: every validation"
            " point would wait for the validation before it, as synchronous validation waits. Validate less often,"
            " or use `validation='sync'`."
        )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, EarlyStopping):
            flag, does = "check_on_train_epoch_end", "decides"
        elif isinstance(callback, ModelCheckpoint) and callback.monitor is not None:
            flag, does = "save_on_train_epoch_end", "ranks checkpoints"
        else:
            continue
        if not _at_validation_end(callback, trainer):
            raise MisconfigurationException(
                f"`{type(callback).__name__}(monitor={callback.monitor!r})` with {_ASYNC} {does} at each training"
                " epoch's end, on the training workers, which hold no validation's values. Pass"
                f" `{flag}=False`: it then {does} at each validation's end, on the validated step; or use"
                " `validation='sync'`."
            )


def _at_validation_end(callback: Union[EarlyStopping, ModelCheckpoint], trainer: Trainer) -> bool:
    """Whether ``callback`` decides at the end of a validation rather than of a training epoch, in a
    ``fit`` that validates, as Lightning decides it when the ``fit`` starts (a ``ModelCheckpoint``'s
    ``_should_save_on_train_epoch_end``, ``EarlyStopping.setup``)."""
    chosen = lightning_compat.at_train_epoch_end(callback)
    if chosen is not None:
        return not chosen
    return not (trainer.check_val_every_n_epoch == 1 and trainer.val_check_interval == 1.0)


def stops_early(trainer: Trainer) -> bool:
    """Whether the controller runs an ``EarlyStopping``, whose decision on a replayed validation
    reaches the training workers at their next batch (``worker.async_validation.HandOff``)."""
    return any(isinstance(callback, EarlyStopping) for callback in trainer.callbacks)  # type: ignore[attr-defined]


class ValidationMesh:
    """Runs on the controller: the validation workers of one ``fit``, and their stage; new ones
    where a validation failed (:meth:`replace`)."""

    def __init__(self, settings: StrategySettings, early_stopping: bool) -> None:
        """``early_stopping``: the controller runs one (:func:`stops_early`)."""
        self._settings = settings
        self.early_stopping = early_stopping
        self._mesh: Optional[WorkerMesh] = None
        #: How many times the validation workers were replaced (``specs.Validators``).
        self.generation = -1
        self._serving: Optional[StageSpec] = None
        #: The serving stage's traffic, once started.
        self.channel: Optional[StageChannel] = None

    def start(self, spec: StageSpec) -> StageSpec:
        """Start the validation workers, check them, and start their stage, which serves the
        checkpoint states of the training stage ``spec``; return that stage as it hands them to
        these workers, its workers free of credit (the next validation point bounds their lead)."""
        free = dataclasses.replace(spec.run_ahead, max_ahead=None)
        self._serving = dataclasses.replace(spec, serves_validation=True, run_ahead=free)
        return dataclasses.replace(spec, validators=self._serve(), run_ahead=free)

    def replace(self) -> Validators:
        """After a failed validation: stop these workers, whose stage failed or who died (any peer
        of a rank that failed may wait in a collective that never ends), and serve on new ones."""
        self.stop(failed=True)
        return self._serve()

    def _serve(self) -> Validators:
        key = validation_settings(self._settings).mesh_key()
        self._mesh = WorkerMesh.spawn(key.per_host, key.gpu_indices, key.hosts, key.output, key.hold_warnings)
        self._mesh.step_timeout = self._settings.step_timeout
        preflight.check(self._mesh, key.accelerator, key.process_group_backend, timeout=key.timeout)
        assert self._serving is not None  # made by ``start``
        self.channel = StageChannel(self._mesh, self._serving, shared_memory=self._settings.shared_memory)
        self.channel.start()
        self.generation += 1
        return Validators(self._mesh.rank_actors(), self.early_stopping, self.generation)

    def stop(self, failed: bool) -> None:
        """Stop the validation workers, killing them if the ``fit`` failed (they may be stuck)."""
        if self._mesh is not None:
            self._mesh.stop(kill=failed)
