"""The gates both sides share, the rules that keep the two sides' Lightning loops in step, and the
messages of a running stage: rank 0's entries, the controller's grants and releases.

Both sides import this module; nothing here talks to a mesh or runs a hook. What a stage is given
is in :mod:`lightning_monarch.wire.specs`, what the workers report besides entries in
:mod:`lightning_monarch.wire.reports`.

The run-ahead invariants, cited elsewhere as R1-R8:

R1. The controller runs Lightning's real loop for the stage; every worker runs Lightning's real
    ``Trainer`` for the same stage with ``DDPStrategy`` (``ModelParallelStrategy`` when sharded) on
    a loop thread. Both get the same flags, so both reach the same hooks in the same order. The
    workers make every one of Lightning's decisions (when to validate, to stop, to step the
    optimizer); the controller's loop follows them.
R2. A *gate* is a top-level call of a hook in :data:`GATES`, but of an elidable one
    (:attr:`Gate.elidable`) that the user's object does not override. Hooks called while another
    gated hook runs are *nested* and never gate.
R3. At each gate every worker runs the hook; rank 0 then records an :class:`Entry`: what the
    controller needs of that gate (the result where :data:`GATES` says the controller uses it, the
    nested results, the control state after it, the logger calls made since the last entry, ...).
    Entries reach the controller in order and in bulk; its loop consumes one per gate, and a gate
    that is not the entry's raises ``DivergenceError``.
R4. A worker runs ahead of the controller without waiting, except that it starts a training batch
    only within :attr:`RunAhead.max_ahead` batches of the last batch the controller has taken (a
    :class:`Grant` tells it; the batches of every loop count, but only a training batch waits for
    credit), and that after a *sync gate* it parks until the controller releases it (a
    :class:`Release`). ``max_ahead=0`` makes every gate a sync gate: lockstep.
R5. Sync gates are where a controller callback acts on the workers (:attr:`RunAhead.sync`): the
    control state it changes travels with the ``Release`` and applies before the workers go on,
    and what it reads live (metrics, checkpoint state, stats) is read while every worker is parked
    there. A worker serves such out-of-band requests only while parked at a sync gate, or after
    its stage ended.
R6. Between sync gates the controller knows of the workers only what the entries carry: the
    metric views at the gates where an observe-only callback reads them
    (:attr:`RunAhead.views`), the step outputs where a controller callback may read them
    (:attr:`RunAhead.outputs`), and rank 0's checkpoint state with the metric views where a
    ``ModelCheckpoint`` saves without acting on the workers otherwise (:attr:`RunAhead.states`;
    rank 0 keeps at most :data:`MAX_STAGED_STATES` of them unfetched, and waits for the controller
    to fetch one before it copies another). Any other read of live worker state there raises,
    and so does control state that the controller changed at a gate that is not a sync gate.
R7. User hooks run on the workers only. The controller runs only Lightning's base implementation
    of a hook, fed with the entry's result.
R8. A worker's failure ends its stage. The controller raises it after it has replayed every entry
    rank 0 recorded before it, so loggers and checkpoints are those of a ``ddp`` run that failed
    at that point.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any, Optional

from typing_extensions import override

from lightning_monarch.wire.codec import StorageKey
from lightning_monarch.wire.reports import CheckpointState, WorkerFailure, WorkerWarning

#: Hooks that both a ``LightningModule`` and a ``Callback`` have (the callback's take the Trainer
#: and the module first).
_SHARED_HOOKS: tuple[str, ...] = (
    tuple(
        f"on_{event}"
        for stage in ("fit", "train", "validation", "test", "predict")
        for event in (f"{stage}_start", f"{stage}_end")
    )
    + tuple(
        f"on_{stage}_{scope}_{event}"
        for stage in ("train", "validation", "test", "predict")
        for scope in ("epoch", "batch")
        for event in ("start", "end")
    )
    + ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")
)

#: Hooks of a ``LightningDataModule`` that gate (R2); a ``LightningModule`` has them too.
DATAMODULE_HOOKS: tuple[str, ...] = (
    "prepare_data",
    "setup",
    "teardown",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
)

#: The module's hooks that switch it to and from evaluation mode around an evaluation loop.
_MODEL_MODE_HOOKS: tuple[str, ...] = (
    "on_validation_model_zero_grad",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_test_model_eval",
    "on_test_model_train",
    "on_predict_model_eval",
)

#: Hooks of a ``LightningModule`` that gate (R2). ``on_save_checkpoint`` is absent: the controller
#: calls it while it writes a checkpoint, which the workers never do, so it runs out of band.
MODULE_HOOKS: tuple[str, ...] = (
    DATAMODULE_HOOKS
    + _SHARED_HOOKS
    + (
        "configure_callbacks",
        "configure_model",
        "configure_sharded_model",
        "configure_optimizers",
    )
    + _MODEL_MODE_HOOKS
    + (
        "training_step",
        "validation_step",
        "test_step",
        "predict_step",
        "optimizer_zero_grad",
        "backward",
        "configure_gradient_clipping",
        "optimizer_step",
        "lr_scheduler_step",
        "on_load_checkpoint",
    )
)

#: Callback hooks that gate (R2). Checkpoint hooks and ``on_exception`` are absent: the first run
#: out of band, the second runs on each side's own failure path.
CALLBACK_HOOKS: tuple[str, ...] = ("setup", "teardown", "on_sanity_check_start", "on_sanity_check_end") + _SHARED_HOOKS


@dataclass(frozen=True)
class Gate:
    """How one gate behaves on both sides: the gate table's row (R2-R4)."""

    #: What rank 0 records of the hook's result, for the controller's loop to use instead of
    #: Lightning's base implementation (R7; ``worker.describe`` encodes it, the session decodes it):
    #: ``"outputs"`` a step's outputs (only where :attr:`RunAhead.outputs` asks, else a placeholder),
    #: ``"optimizers"``, ``"loaders"`` and ``"callbacks"`` descriptions, ``"value"`` the value itself.
    #: ``None``: the controller runs the base implementation.
    result: Optional[str] = None
    #: The first gate of a batch of a batch loop: the unit of a worker's lead (R4).
    batch_start: bool = False
    #: A batch start where a worker waits for credit (R4): a training batch's. Evaluation and
    #: prediction batches record little (logged values; the predictions stay on the workers until
    #: the stage ends) and never wait for it, so the workers run through them at their own pace.
    credit: bool = False
    #: Lightning calls it on some ranks only (``prepare_data``, on local rank 0): never a sync gate,
    #: since the other ranks never park there.
    rank_local: bool = False
    #: A module or datamodule hook whose Lightning base implementation gives the controller nothing
    #: it must take from rank 0 (the empty list of ``configure_callbacks`` it gives itself) and
    #: changes nothing that either side must see at a gate (it moves a batch, switches the module
    #: to eval mode, steps a scheduler, or does nothing), and after which no sync gate or metric
    #: view need sit (``configure_callbacks`` syncs only for the plan that the callbacks it returns
    #: may grow): where the user's object does not override it, neither side gates it
    #: (``gates.install_hook_gates``), each side runs the base implementation as its own loop calls
    #: it, and what the worker callbacks changed before it (logger calls, control state) travels
    #: with the next gate, which the controller's loop reaches before it reads them. Five such hooks
    #: run for every evaluation batch, three for every training batch.
    elidable: bool = False


_PLAIN = Gate()


#: The module's and datamodule's hooks that go ungated where not overridden (:attr:`Gate.elidable`).
_ELIDABLE_HOOKS: tuple[str, ...] = _MODEL_MODE_HOOKS + (
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "prepare_data",
    "configure_callbacks",
    "configure_model",
    "configure_sharded_model",
    "optimizer_zero_grad",
    "backward",
    "configure_gradient_clipping",
    "lr_scheduler_step",
    "on_load_checkpoint",
)


def _gate_table() -> dict[str, Gate]:
    hooks_of = {"module": MODULE_HOOKS, "datamodule": DATAMODULE_HOOKS, "callback": CALLBACK_HOOKS}
    table = {gate_id(owner, hook): _PLAIN for owner, hooks in hooks_of.items() for hook in hooks}
    for step in ("training_step", "validation_step", "test_step"):
        table[gate_id("module", step)] = Gate(result="outputs")
    table[gate_id("module", "predict_step")] = Gate(result="prediction")
    table[gate_id("module", "on_train_batch_start")] = Gate(result="value")
    table[gate_id("module", "configure_optimizers")] = Gate(result="optimizers")
    table[gate_id("module", "configure_callbacks")] = Gate(result="callbacks")
    for owner in ("module", "datamodule"):
        for stage in ("train", "val", "test", "predict"):
            table[gate_id(owner, f"{stage}_dataloader")] = Gate(result="loaders")
        table[gate_id(owner, "prepare_data")] = Gate(rank_local=True)
        for hook in _ELIDABLE_HOOKS:
            if hook in hooks_of[owner]:
                gate = gate_id(owner, hook)
                table[gate] = replace(table[gate], elidable=True)
    for stage in ("train", "validation", "test", "predict"):
        table[gate_id("callback", f"on_{stage}_batch_start")] = Gate(batch_start=True, credit=stage == "train")
    return table


#: Trainer attributes (dotted paths) that steer the loop and that callbacks or module code may
#: change: every entry carries rank 0's (R3), and a ``Release`` the controller's changes (R5).
#: EarlyStopping sets ``should_stop``; GradientAccumulationScheduler sets
#: ``accumulate_grad_batches``; StochasticWeightAveraging adds an epoch to ``fit_loop.max_epochs``
#: to recompute batch-norm statistics, without backward (``fit_loop._skip_backward``, a private
#: attribute that ``_compat.lightning.PRIVATE_NAMES`` lists).
CONTROL_STATE: tuple[str, ...] = (
    "should_stop",
    "accumulate_grad_batches",
    "fit_loop.max_epochs",
    "fit_loop._skip_backward",
)


#: The gate where a training stage is snapshotted for recovery: the start of a training epoch,
#: the boundary from which Lightning resumes a checkpoint exactly (it cannot resume mid-epoch at
#: an exact batch). The snapshot is read while the workers are parked right after this gate.
SNAPSHOT_GATE = "callback.on_train_epoch_start"

#: The gate where, under elastic training on hosts that serve preemption notices
#: (``lightning_monarch.host``), every worker asks whether a host got one, after each optimizer step
#: (``worker.notices``): the end of a training batch, the point from which Lightning resumes a
#: checkpoint that ``ModelCheckpoint(every_n_train_steps=...)`` writes.
NOTICE_GATE = "callback.on_train_batch_end"

#: The marks of a ``fit`` with asynchronous validation, entries of no hook (their ``result`` is the
#: validation point's number, or a ``specs.HandedOff`` naming it): a training rank 0 records the
#: first at each try of its ranks to hand their weights over; the validation mesh's rank 0 records
#: the other two around each validation it runs. The controller's loop replays the validation
#: between them where its fit meets the first (``controller.loop.validation_replay``).
HANDED_OFF_GATE = "validation.handed_off"
VALIDATION_BEGIN_GATE = "validation.begin"
VALIDATION_END_GATE = "validation.end"


#: How many copies of its checkpoint state rank 0 keeps for the controller to fetch at most (R6):
#: each is a whole model and optimizer state in host memory.
MAX_STAGED_STATES = 2

#: The Trainer properties holding metrics that the controller's Trainer shows from rank 0.
METRIC_VIEWS: tuple[str, ...] = ("callback_metrics", "progress_bar_metrics", "logged_metrics")


def control_state(trainer: Any) -> dict[str, Any]:
    """The :data:`CONTROL_STATE` of ``trainer``."""
    return {name: attrgetter(name)(trainer) for name in CONTROL_STATE}


def set_control_state(trainer: Any, control: dict[str, Any]) -> None:
    """Set ``trainer``'s :data:`CONTROL_STATE` to the values in ``control``."""
    for name, value in control.items():
        owner, _, attribute = name.rpartition(".")
        setattr(attrgetter(owner)(trainer) if owner else trainer, attribute, value)


def gate_id(owner: str, hook: str) -> str:
    """The name of a gate on the wire: ``"module.training_step"``, ``"callback.on_fit_start"``."""
    return f"{owner}.{hook}"


#: Every gate, by name (R2), with how it behaves.
GATES: dict[str, Gate] = _gate_table()


@dataclass(frozen=True)
class LoggerCall:
    """A call rank 0 made on its stand-in for the controller's logger number ``logger_index``.

    ``method`` is ``"log_metrics"``, ``"log_hyperparams"`` or ``"experiment.<name>"`` for module
    code's ``self.logger.experiment.<name>(...)``.
    """

    logger_index: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class SyncRule:
    """When a gate is a sync gate (R5): decided by each worker, on its own Trainer, as it reaches
    the gate, and alike on every rank (the rules read state every rank shares)."""

    def due(self, trainer: Any) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class Always(SyncRule):
    """Every time."""

    @override
    def due(self, trainer: Any) -> bool:
        return True


@dataclass(frozen=True)
class EveryNTrainSteps(SyncRule):
    """When ``trainer.global_step`` is a multiple of ``n``: where ``ModelCheckpoint(every_n_train_steps=n)``
    may save and ``MeshStatsMonitor(logging_interval=n)`` reads."""

    n: int

    @override
    def due(self, trainer: Any) -> bool:
        return trainer.global_step % self.n == 0


@dataclass(frozen=True)
class SnapshotEpochs(SyncRule):
    """At the start of every ``every``-th training epoch after the first (or from the first, with
    ``first``): where the controller snapshots the workers for recovery, and keeps an elastic
    ``fit``'s resume point (``controller.features.elastic``), which exists from the first epoch on."""

    every: int
    first: bool = False

    @override
    def due(self, trainer: Any) -> bool:
        epoch = trainer.current_epoch
        return (epoch > 0 or self.first) and epoch % self.every == 0


@dataclass(frozen=True)
class WhileFitting(SyncRule):
    """``rule``, while the Trainer fits and does not check its validation loop (the sanity check):
    the only time ``ModelCheckpoint`` saves and ``EarlyStopping`` checks."""

    rule: SyncRule

    @override
    def due(self, trainer: Any) -> bool:
        return trainer.state.fn == "fit" and not trainer.sanity_checking and self.rule.due(trainer)


@dataclass(frozen=True)
class AnyOf(SyncRule):
    """When any of ``rules`` is due: several controller callbacks at one gate."""

    rules: tuple[SyncRule, ...]

    @override
    def due(self, trainer: Any) -> bool:
        return any(rule.due(trainer) for rule in self.rules)


@dataclass(frozen=True)
class RunAhead:
    """How far the workers may lead in a stage, where they wait, and what their entries carry
    (R4-R6). Made on the controller from its callbacks (``controller.loop.plan``), sent with the stage."""

    #: Batches a worker may start beyond the last one the controller took; ``None``: no limit (a
    #: whole epoch and more); ``0``: lockstep, every gate a sync gate.
    max_ahead: Optional[int]
    #: The gates that may be sync gates, and when.
    sync: dict[str, SyncRule]
    #: The gates whose entries carry rank 0's three metric views (an observe-only callback reads them).
    views: frozenset[str]
    #: The step gates whose entries carry the step's outputs (a controller callback on the batch's
    #: end may read them); elsewhere a placeholder loss stands in.
    outputs: frozenset[str]
    #: The gates whose entries carry, when due, rank 0's checkpoint state and the metric views: a
    #: ``ModelCheckpoint`` saves there without making the workers wait.
    states: dict[str, SyncRule] = field(default_factory=dict)
    #: Whether the workers ask, after each optimizer step, whether a host got a preemption notice,
    #: and park there if one did (:data:`NOTICE_GATE`): elastic training on hosts that serve them.
    notices: bool = False
    #: Whether rank 0's failure carries its checkpoint state as it failed: a controller callback
    #: saves a checkpoint on an exception (``OnExceptionCheckpoint``).
    saves_on_exception: bool = False

    def syncs_at(self, gate: str, trainer: Any) -> bool:
        """Whether ``gate`` is a sync gate now, on ``trainer``'s state."""
        if GATES[gate].rank_local:
            return False
        if self.max_ahead == 0:
            return True
        rule = self.sync.get(gate)
        return rule is not None and rule.due(trainer)

    def stages_state_at(self, gate: str, trainer: Any) -> bool:
        """Whether ``gate``'s entry carries the checkpoint state now (where the workers park, the
        controller reads it from them instead)."""
        rule = self.states.get(gate)
        return rule is not None and rule.due(trainer) and not self.syncs_at(gate, trainer)


class _Omitted:
    """The result of a step whose outputs no controller callback reads: the entry does not carry
    them (R6). Unpickled as the same object, so ``value is OMITTED`` holds on the controller."""

    def __reduce__(self) -> str:
        return "OMITTED"

    def __repr__(self) -> str:
        return "OMITTED"


#: What an entry carries for outputs left on the workers.
OMITTED = _Omitted()


@dataclass(frozen=True)
class Entry:
    """What rank 0 recorded at one gate (R3). The arrival fields were read when the worker reached
    the gate, before the hook ran; the others after it. ``gate=None`` marks the end of the stage,
    with the failure that ended it, if one did (R8)."""

    gate: Optional[str]
    #: Whether every worker parked after this gate until the controller releases them (R5).
    sync: bool = False
    #: Whether they parked because a host got a preemption notice (:data:`NOTICE_GATE`).
    notice: bool = False
    result: Any = None
    #: Results of the gated hooks the hook called itself, in order (R2).
    nested: list[tuple[str, Any]] = field(default_factory=list)
    control: dict[str, Any] = field(default_factory=dict)
    logger_calls: list[LoggerCall] = field(default_factory=list)
    #: Each optimizer's hyperparameters, at the gates ``LearningRateMonitor`` reads them.
    param_groups: Optional[list[list[dict[str, Any]]]] = None
    #: The LR scheduler configs (``specs.SchedulerConfigRef``), when they changed.
    lr_scheduler_configs: Optional[tuple[Any, ...]] = None
    #: The module's hyperparameters (``hparams``), when they changed: a learning-rate finder sets
    #: ``hparams.lr``, and the controller's checkpoints save them.
    hparams: Optional[dict[str, Any]] = None
    #: Manual optimization's step count (``trainer.global_step``), when it changed.
    manual_steps: Optional[dict[str, Any]] = None
    #: Rank 0's three metric views, where :attr:`RunAhead.views` or :attr:`RunAhead.states` asks.
    views: Optional[dict[str, dict[str, Any]]] = None
    #: A copy of rank 0's checkpoint state after the hook, where :attr:`RunAhead.states` asks.
    checkpoint: Optional[CheckpointState] = None
    #: Arrival: the values ``update_eval_epoch_metrics`` returned since the last entry.
    eval_outputs: list[dict[str, Any]] = field(default_factory=list)
    #: Arrival, when changed: per stage, the lengths of the loop's dataloaders.
    loader_lengths: Optional[dict[str, list[Optional[int]]]] = None
    #: Arrival, when changed: per stage, how many batches the loop's data fetcher has taken.
    fetched_batches: Optional[dict[str, int]] = None
    #: The warnings rank 0 showed since its last entry (``worker.held_warnings``).
    warnings: list[WorkerWarning] = field(default_factory=list)
    #: The end of a stage that ran to its end: rank 0's :class:`TakenBack`, pickled with
    #: cloudpickle (an attribute may be what only cloudpickle pickles, a lambda). That entry also
    #: carries rank 0's final metric views in :attr:`views` and, after an unsharded ``fit``, its
    #: final checkpoint state in :attr:`checkpoint`, so that the controller asks for none of them.
    attributes: Optional[bytes] = None
    #: The end of a stage that ran to its end: rank 0's random number generators (torch's CPU one,
    #: NumPy's, Python's), which the controller takes, as a ``ddp`` script's process is rank 0.
    rng: Optional[dict[str, Any]] = None
    #: The end of a stage that ran to its end: the keys of the storages rank 0 holds for the next
    #: stage (``worker.storages``), whose bytes the next stage's payload need not carry.
    held: tuple[StorageKey, ...] = ()
    failure: Optional[WorkerFailure] = None
    #: The end of a ``fit`` that Lightning's tuner ended at its start (``Tuner.lr_find``: its
    #: ``LearningRateFinder`` raises ``_TunerExitException`` after its trial), for the controller's
    #: loop to end its ``fit`` alike.
    tuner_exit: bool = False


@dataclass(frozen=True)
class Grant:
    """The controller has taken ``batches`` batch starts (R4): a worker may start batches up to
    ``batches + max_ahead``."""

    batches: int


@dataclass(frozen=True)
class Release:
    """Leave the sync gate you are parked at (R5), with the control state the controller changed
    there applied first, and the stage's plan from here on if it grew there (``controller.loop.plan``:
    ``configure_callbacks`` gave the controller callbacks, ``configure_optimizers`` schedulers)."""

    control: dict[str, Any]
    plan: Optional[RunAhead] = None


@dataclass(frozen=True)
class RankStatus:
    """How far one worker's stage got: the gates it has run, and the failure that ended it, if one did."""

    rank: int
    gates: int
    failure: Optional[WorkerFailure] = None
