"""A stage's run-ahead plan: where the workers wait for the controller and what their entries carry
(R4-R6 in ``protocol``), from the controller's callbacks.

Runs on the controller, when a stage starts and again at the sync gates where its callbacks or
LR schedulers became known (``configure_callbacks``, ``configure_optimizers``). Each of
Lightning's built-in callbacks declares precisely where it acts on the workers (``ModelCheckpoint``
and ``EarlyStopping`` only while fitting, not in ``validate`` nor in the sanity check, where they
do nothing):

| callback | sync gates (the workers wait) | entries carry |
|---|---|---|
| ``ModelCheckpoint`` without ``monitor`` or ``train_time_interval`` | never | where it may save (train batch ends every ``every_n_train_steps`` steps, train epoch ends or validation ends as its ``save_on_train_epoch_end`` says, both where it is ``None``, the train end with ``save_last``): rank 0's checkpoint state and the metric views |
| other ``ModelCheckpoint`` | where it may save: as above, and every train batch end with ``train_time_interval`` | |
| ``EarlyStopping`` | where it checks: train epoch ends or validation ends as its ``check_on_train_epoch_end`` says, both where it is ``None`` | |
| ``GradientAccumulationScheduler`` | train epoch starts | |
| ``Timer`` | every hook it overrides (every train batch end) | |
| ``MeshStatsMonitor`` | the train start and every ``logging_interval`` steps | |
| progress bars, ``LearningRateMonitor`` | never | the metric views, at their hooks |
| ``ModelSummary``, ``RichModelSummary`` | never | |

Any other callback on the controller waits for the workers at every hook it overrides, unless it
is declared observe-only (:func:`observe_only`): then its hooks never wait, the entries carry the
metric views there, and it must not change what the workers would act on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, TypeVar, Union, cast

from lightning.pytorch import Callback, LightningDataModule, LightningModule
from lightning.pytorch.callbacks import (
    Checkpoint,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    OnExceptionCheckpoint,
    ProgressBar,
    Timer,
)
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.features.stats import MeshStatsMonitor
from lightning_monarch.controller.loop.callbacks import callback_class
from lightning_monarch.wire.gates import datamodule_saves
from lightning_monarch.wire.protocol import (
    CALLBACK_HOOKS,
    SNAPSHOT_GATE,
    Always,
    AnyOf,
    EveryNTrainSteps,
    RunAhead,
    SnapshotEpochs,
    SyncRule,
    WhileFitting,
    gate_id,
)

C = TypeVar("C")

_OBSERVE_ONLY = "_lightning_monarch_observe_only"

#: The step gate whose outputs a callback hook receives.
_OUTPUTS = {
    "on_train_batch_end": "module.training_step",
    "on_validation_batch_end": "module.validation_step",
    "on_test_batch_end": "module.test_step",
    "on_predict_batch_end": "module.predict_step",
}
#: Gates that wait once per stage, so that the plan can grow from their results: the callbacks
#: ``configure_callbacks`` returns, the LR schedulers ``configure_optimizers`` returns.
PLAN_GATES = ("module.configure_callbacks", "module.configure_optimizers")


def observe_only(callback: C) -> C:
    """Declare a controller callback (a ``Callback`` instance or class) observe-only: its hooks
    never make the workers wait for the controller under ``strategy="monarch"``.

    Runs on the controller. An observe-only callback reads what the workers' entries carry at its
    hooks (``trainer.callback_metrics``, ``progress_bar_metrics``, ``logged_metrics``, a step's
    ``outputs``) and writes only to the controller's own state: its loggers, files, its own
    attributes. It must not change what the workers act on (``trainer.should_stop``,
    ``trainer.accumulate_grad_batches``) nor read the module's weights or save a checkpoint: that
    raises, naming it, the hook and the attribute. Usable as a decorator::

        @lightning_monarch.observe_only
        class ThroughputPrinter(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                print(trainer.global_step, trainer.progress_bar_metrics.get("loss"))
    """
    callback_class(
        callback, "observe_only", "declares a Lightning `Callback` (an instance or its class) observe-only", __name__
    )
    setattr(callback, _OBSERVE_ONLY, True)
    return callback


def is_observe_only(callback: Callback) -> bool:
    """Whether ``callback`` never makes the workers wait (declared, or a built-in that only observes)."""
    return getattr(callback, _OBSERVE_ONLY, False) or isinstance(
        callback, (ProgressBar, LearningRateMonitor, ModelSummary)
    )


def _overridden(callback: Callback) -> list[str]:
    return [hook for hook in CALLBACK_HOOKS if is_overridden(hook, callback, Callback)]


def _gate(callback: Callback, hook: str) -> str:
    """The gate after which ``callback``'s ``hook`` runs on the controller. Lightning calls
    ``on_train_epoch_end`` of checkpoint and early-stopping callbacks after the module's."""
    if hook == "on_train_epoch_end" and isinstance(callback, (Checkpoint, EarlyStopping)):
        return gate_id("module", hook)
    return gate_id("callback", hook)


def sync_rules(callback: Callback) -> dict[str, SyncRule]:
    """Where ``callback`` acts on the workers: the gates it must find them parked at, and when."""
    if is_observe_only(callback):
        return {}
    if isinstance(callback, ModelCheckpoint):
        return _saves(callback)
    if isinstance(callback, EarlyStopping):
        return {gate: WhileFitting(Always()) for gate in _epoch_or_validation_ends(callback)}
    if isinstance(callback, GradientAccumulationScheduler):
        return {_gate(callback, "on_train_epoch_start"): Always()}
    if isinstance(callback, MeshStatsMonitor):
        return {
            _gate(callback, "on_train_start"): Always(),
            _gate(callback, "on_train_batch_end"): EveryNTrainSteps(callback.logging_interval),
        }
    return {_gate(callback, hook): Always() for hook in _overridden(callback)}


def _saves(callback: ModelCheckpoint) -> dict[str, SyncRule]:
    """Where ``callback`` may save, while fitting (not in ``validate``, nor in the sanity check):
    train batch ends (every ``every_n_train_steps`` steps, or every batch with
    ``train_time_interval``), train epoch ends and validation ends (one of them where its
    ``save_on_train_epoch_end`` says), and the train end with ``save_last``."""
    every, time_interval = lightning_compat.checkpoint_schedule(callback)
    rules: dict[str, SyncRule] = dict.fromkeys(_epoch_or_validation_ends(callback), Always())
    if time_interval is not None:
        rules[_gate(callback, "on_train_batch_end")] = Always()
    elif every:
        rules[_gate(callback, "on_train_batch_end")] = EveryNTrainSteps(every)
    if callback.save_last:
        rules[_gate(callback, "on_train_end")] = Always()
    return {gate: WhileFitting(rule) for gate, rule in rules.items()}


def _epoch_or_validation_ends(callback: Union[ModelCheckpoint, EarlyStopping]) -> list[str]:
    """Where a ``ModelCheckpoint`` saves or an ``EarlyStopping`` checks: at training epoch ends, at
    validation ends, or (Lightning decides when the ``fit`` starts) either."""
    at_epoch_end = lightning_compat.at_train_epoch_end(callback)
    return [
        *([_gate(callback, "on_train_epoch_end")] if at_epoch_end is not False else []),
        *([_gate(callback, "on_validation_end")] if not at_epoch_end else []),
    ]


def saves_from_entries(callback: Callback) -> bool:
    """Whether ``callback`` is a ``ModelCheckpoint`` that needs nothing of the workers but rank 0's
    state and metric views where it saves, so that the entries there carry them and the workers do
    not wait (R6): it monitors no metric (whose decision every rank takes part in) and saves on a
    schedule of steps or epochs, not of time (which would copy the state at every batch)."""
    return (
        isinstance(callback, ModelCheckpoint)
        and callback.monitor is None
        and lightning_compat.checkpoint_schedule(callback)[1] is None
    )


def states_can_travel(
    module: LightningModule,
    datamodule: Optional[LightningDataModule],
    worker_callbacks: Iterable[Callback],
    sharded: bool,
) -> bool:
    """Whether rank 0's checkpoint state can travel in entries: the module is not sharded (its
    state is gathered by every rank) and no hook of a worker's adds to checkpoints
    (:func:`saves_on_workers`), which runs where the workers wait."""
    return not sharded and not saves_on_workers(module, datamodule, worker_callbacks)


def saves_on_workers(
    module: LightningModule, datamodule: Optional[LightningDataModule], worker_callbacks: Iterable[Callback]
) -> bool:
    """Whether writing a checkpoint runs a hook on the workers' rank 0: the module's or a worker
    callback's ``on_save_checkpoint``, or the datamodule's ``state_dict``."""
    return (
        is_overridden("on_save_checkpoint", module, LightningModule)
        or datamodule_saves(datamodule)
        or any(is_overridden("on_save_checkpoint", callback, Callback) for callback in worker_callbacks)
    )


def make_plan(
    callbacks: Iterable[Callback],
    max_ahead: Optional[int],
    snapshots: Optional[SnapshotEpochs],
    plateau_intervals: Iterable[str] = (),
    states_travel: bool = False,
) -> RunAhead:
    """The run-ahead plan for a stage whose controller runs ``callbacks``: ``max_ahead`` as given
    (``MonarchStrategy(max_ahead=...)``), a sync gate at every snapshot (``snapshots``, with
    restarts or elastic training), the metric views where Lightning's own loop reads them for
    ``ReduceLROnPlateau`` schedulers stepped every ``"epoch"`` or ``"step"`` (``plateau_intervals``),
    and, where ``states_travel`` (:func:`states_can_travel`), rank 0's checkpoint state in the
    entries where a ``ModelCheckpoint`` saves from them (:func:`saves_from_entries`)."""
    callbacks = list(callbacks)
    rules: dict[str, list[SyncRule]] = {gate: [Always()] for gate in PLAN_GATES}
    states: dict[str, list[SyncRule]] = {}
    views: set[str] = set()
    outputs: set[str] = set()
    if snapshots is not None:
        rules.setdefault(SNAPSHOT_GATE, []).append(snapshots)
    for callback in callbacks:
        staged = states_travel and saves_from_entries(callback)
        # ``saves_from_entries`` holds only for a ``ModelCheckpoint``
        for gate, rule in (_saves(cast(ModelCheckpoint, callback)) if staged else sync_rules(callback)).items():
            (states if staged else rules).setdefault(gate, []).append(rule)
        overridden = _overridden(callback)
        if is_observe_only(callback):
            views.update(_gate(callback, hook) for hook in overridden)
        if not isinstance(callback, (ProgressBar, LearningRateMonitor, ModelSummary, Checkpoint, EarlyStopping, Timer)):
            outputs.update(_OUTPUTS[hook] for hook in overridden if hook in _OUTPUTS)
    for interval in plateau_intervals:
        views.add(gate_id("module", "on_train_epoch_end" if interval == "epoch" else "on_train_batch_end"))
    return RunAhead(
        max_ahead=max_ahead,
        sync={gate: _any_of(found) for gate, found in rules.items()},
        views=frozenset(views),
        outputs=frozenset(outputs),
        states={gate: _any_of(found) for gate, found in states.items()},
        saves_on_exception=any(isinstance(callback, OnExceptionCheckpoint) for callback in callbacks),
    )


def _any_of(rules: list[SyncRule]) -> SyncRule:
    return rules[0] if len(rules) == 1 else AnyOf(tuple(rules))


def plateau_intervals(scheduler_configs: Iterable[Any]) -> list[str]:
    """The intervals (``"epoch"``, ``"step"``) of the ``ReduceLROnPlateau`` schedulers among a
    Trainer's LR scheduler configs: Lightning reads ``trainer.callback_metrics`` to step them."""
    return sorted({config.interval for config in scheduler_configs if config.reduce_on_plateau})
