"""The controller's side of a stage: Lightning's real loop here follows the workers' entries (R1-R8).

Runs on the controller. A :class:`StageSession` puts gates on the user's LightningModule and
LightningDataModule and a gate callback first in the Trainer's callbacks, so that Lightning's loop
here meets the gates the workers met, in the same order. At each gate it takes rank 0's entry for
it, applies what rank 0 recorded (control state, logger calls, hyperparameters, metric views), and
runs only Lightning's base implementation of the hook, fed with the entry's result (R7). It
releases the workers from a sync gate once the controller's callbacks there have run, with the
control state they changed, and grants the workers credit as it takes their batches (R4, R5).

It also wraps the controller's callbacks' hooks, to know which one is running: a read of live
worker state or a change of control state where the workers did not wait is an error that names
the callback, the hook and what it read or changed (R6).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import cloudpickle
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.features.elastic import AtNotice, ElasticFit
from lightning_monarch.controller.loop.attribution import CallbackAttribution
from lightning_monarch.controller.loop.bulk import take_in_bulk
from lightning_monarch.controller.loop.callbacks import check_controller_callbacks
from lightning_monarch.controller.loop.entries import EntryQueue
from lightning_monarch.controller.loop.logger_calls import LoggerCalls
from lightning_monarch.controller.loop.metrics import MetricOrigins, mirror_metrics
from lightning_monarch.controller.loop.mirror_guard import MirrorGuard
from lightning_monarch.controller.loop.mirrors import WorkerLoaders, follow_optimizers, stand_in
from lightning_monarch.controller.loop.other_ranks import OTHER_RANKS
from lightning_monarch.controller.loop.plan import (
    PLAN_GATES,
    is_observe_only,
    make_plan,
    plateau_intervals,
    saves_on_workers,
    states_can_travel,
)
from lightning_monarch.controller.loop.predictions import PredictionCollector
from lightning_monarch.controller.loop.requests import WorkerRequests
from lightning_monarch.controller.loop.taken_back import take_attributes, take_final_state
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.storages import KeptShards
from lightning_monarch.controller.mesh.worker_warnings import WorkerWarnings
from lightning_monarch.errors import DivergenceError
from lightning_monarch.wire.gates import GateCallback, datamodule_saves, install_hook_gates
from lightning_monarch.wire.protocol import (
    DATAMODULE_HOOKS,
    GATES,
    METRIC_VIEWS,
    MODULE_HOOKS,
    SNAPSHOT_GATE,
    Entry,
    Release,
    RunAhead,
    SnapshotEpochs,
    control_state,
    gate_id,
    set_control_state,
)
from lightning_monarch.wire.reports import CheckpointState
from lightning_monarch.wire.specs import mark_number

_BASES = {"module": LightningModule, "datamodule": LightningDataModule}


class StageSession:
    """Runs on the controller: one stage, its loop following the workers' entries."""

    def __init__(
        self,
        trainer: Trainer,
        channel: StageChannel,
        module: LightningModule,
        datamodule: Optional[LightningDataModule],
        worker_callbacks: list[Callback],
        plan: RunAhead,
        snapshots: Optional[SnapshotEpochs] = None,
        elastic: Optional[ElasticFit] = None,
        sharded: bool = False,
        warned: Optional[WorkerWarnings] = None,
    ) -> None:
        self._trainer = trainer
        self._channel = channel
        #: Whether the workers shard the module (``MonarchModelParallelStrategy``): its weights never come here.
        self.sharded = sharded
        #: The callbacks the workers' Trainer runs (``controller.loop.callbacks``).
        self.worker_callbacks = worker_callbacks
        self._module = module
        self._datamodule = datamodule
        self._gate_callback = GateCallback(self.around)
        self._notice_callback = AtNotice(self.at_notice)
        self._plan = plan
        #: When the workers wait for a snapshot; and an elastic ``fit``, which keeps its resume points there.
        self._snapshots, self._elastic = snapshots, elastic
        #: Shows rank 0's warnings as its entries are taken (``controller.mesh.worker_warnings``).
        self._warned = warned if warned is not None else WorkerWarnings(channel.mesh.num_workers)
        #: Makes rank 0's logger calls on the controller's loggers as entries are taken.
        self.logger_calls = LoggerCalls(trainer)
        #: Entries fetched and not taken yet, and the last one taken.
        self._queue = EntryQueue(
            channel, plan.max_ahead, self._warned, lambda: f"after {self._current}, {self._released=}"
        )
        self._current: Optional[Entry] = None
        #: The gates taken since the last batch start, in order: the batch the loop last ran.
        self._batch_gates: list[str] = []
        self._released = True
        #: The control state the workers go on with after the current entry (R5).
        self._control: dict[str, Any] = {}
        self._views: Optional[dict[str, dict[str, Any]]] = None
        #: While the controller's loop runs a gated hook: the results of the hooks the workers ran
        #: inside it (the entry's ``nested``), in their order, taken as the controller calls them.
        self._nested_results: Optional[deque[tuple[str, Any]]] = None
        #: Results of hooks the workers ran inside another, taken when the controller's loop calls them
        #: (``estimated_stepping_batches`` makes a worker build its train dataloader early).
        self._early_results: dict[str, deque[Any]] = {}
        self._eval_outputs: deque[dict[str, Any]] = deque()
        #: The last entry whose arrival fields were taken.
        self._arrived: Optional[Entry] = None
        #: Rank 0's checkpoint state and the entry it belongs to (R5, R6).
        self._state: Optional[tuple[Optional[Entry], CheckpointState]] = None
        #: The controller callback whose hook runs now, and those that ran since the last gate.
        self._attribution = CallbackAttribution(MirrorGuard(trainer, module))
        self._undo: list[Callable[[], None]] = []
        self._ended: Optional[Entry] = None
        self.loaders = WorkerLoaders(self.peek)
        self.predictions = PredictionCollector()
        #: Metric values under those the entries carry: another mesh's, which the workers lack,
        #: as a worker that validated itself holds them (``controller.loop.validation_replay``).
        self.beneath: dict[str, dict[str, Any]] = {}
        #: Which metric each tensor of the controller's metric views stands for.
        self.metric_origins = MetricOrigins()
        #: What the controller's code asks of every worker where they wait (R5).
        self.requests = WorkerRequests(channel, self._require_parked)
        self.final_state: Optional[CheckpointState] = None
        #: What ended the controller's ``fit`` where the workers' tuner ended theirs (``Tuner.lr_find``).
        self.tuner_exit: Optional[BaseException] = None

    @contextmanager
    def installed(self) -> Iterator[StageSession]:
        """Gates, the metrics mirror, the gate callback and the callback wrappers for the stage."""
        module, datamodule = self._module, self._datamodule
        self._undo = [install_hook_gates(module, "module", MODULE_HOOKS, self.around)]
        if datamodule is not None:
            self._undo.append(install_hook_gates(datamodule, "datamodule", DATAMODULE_HOOKS, self.around))
        if saves_on_workers(module, datamodule, self.worker_callbacks):
            self._undo.append(
                install_hook_gates(module, "checkpoint", ["on_save_checkpoint"], self.requests.on_save_checkpoint)
            )
        if datamodule_saves(datamodule):
            self._undo.append(
                install_hook_gates(datamodule, "checkpoint", ["state_dict"], self.requests.datamodule_state_dict)
            )
        self._undo.append(mirror_metrics(self._trainer, self))
        self._undo.append(take_in_bulk(self._trainer, self))
        callbacks = self._trainer.callbacks  # type: ignore[attr-defined]
        self._attribution.wrap(callbacks, self._undo)
        callbacks.insert(0, self._gate_callback)
        if self._plan.notices:
            callbacks.append(self._notice_callback)
        try:
            yield self
        finally:
            callbacks.remove(self._gate_callback)
            if self._notice_callback in callbacks:
                callbacks.remove(self._notice_callback)
            for step in reversed(self._undo):
                step()

    # ----- gates -----------------------------------------------------------------------------

    def around(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs at every gated hook call on the controller (R2, R3, R7)."""
        if self._nested_results is not None:
            return self._nested(gate, fn, args, kwargs)
        if self._early_results.get(gate):
            return self._materialize(gate, self._early_results[gate].popleft())
        self._leave()
        entry = self._take(gate)
        if gate == "callback.on_train_start":
            self._undo.extend(OTHER_RANKS.start(self._trainer, self._channel.mesh.num_workers, lambda: self.requests))
        if gate == SNAPSHOT_GATE and entry.sync and self._snapshots is not None:
            if self._elastic is not None:
                self._elastic.at_resume_point(self._trainer)
            self._channel.snapshot(self._trainer.current_epoch)
        self._nested_results = deque(entry.nested)
        try:
            if GATES[gate].result is not None:
                return self._result(gate, entry.result)
            return self._base(gate, fn)(*args, **kwargs)
        finally:
            for nested_gate, value in self._nested_results:
                self._early_results.setdefault(nested_gate, deque()).append(value)
            self._nested_results = None

    def _base(self, gate: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Lightning's own implementation of a gated hook, bound to the controller's object; for a
        callback gate, the gate's no-op ``fn``."""
        owner, hook = gate.split(".", 1)
        if owner not in _BASES:
            return fn
        return getattr(_BASES[owner], hook).__get__(self._module if owner == "module" else self._datamodule)

    def _nested(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        assert self._nested_results is not None
        if GATES[gate].result is None:
            return self._base(gate, fn)(*args, **kwargs)
        if not self._nested_results or self._nested_results[0][0] != gate:
            recorded = self._nested_results[0][0] if self._nested_results else "nothing"
            raise DivergenceError(f"The controller called `{gate}` inside a hook where the workers called {recorded}.")
        return self._materialize(gate, self._nested_results.popleft()[1])

    def closure_runs(self) -> int:
        """How many times the workers ran the optimizer closure in the hook whose nested results are taken."""
        return sum(gate == "module.training_step" for gate, _ in self._nested_results or ())

    def _result(self, gate: str, value: Any) -> Any:
        if gate == "module.configure_callbacks":
            check_controller_callbacks(value)
        return self._materialize(gate, value)

    def _materialize(self, gate: str, value: Any) -> Any:
        return stand_in(gate, value, self.closure_runs, self.checkpoint_state, self.loaders)

    # ----- entries ---------------------------------------------------------------------------

    def _leave(self) -> None:
        """The controller's loop leaves the current entry's gate: after a sync gate, release the
        workers with the control state the controller's callbacks changed there (and the grown plan,
        after ``configure_*``); elsewhere such a change is an error (R5, R6)."""
        current = self._current
        if current is None:
            return
        changes = {
            name: value for name, value in control_state(self._trainer).items() if self._control.get(name) != value
        }
        if not self._released:
            self._channel.release(Release(changes, self._grown_plan() if current.gate in PLAN_GATES else None))
            self._released = True
            self._control.update(changes)
        elif changes:
            raise DivergenceError(
                f"{self._attribution.named_ran()} changed {', '.join(f'`trainer.{name}`' for name in changes)} where the workers do not wait"
                f" for the controller under strategy='monarch' (after `{current.gate}`), so they already went on"
                " without it. A callback that steers the loop must not be declared observe-only"
                " (`lightning_monarch.observe_only`): then the workers wait at each of its hooks."
            )

    def _take(self, gate: str) -> Entry:
        """Rank 0's entry for ``gate``, applied (R3)."""
        entry = self._queue.first(ending=self._ended is not None)
        self._queue.pop()
        if entry.gate != gate:
            raise DivergenceError(
                f"The controller's loop reached `{gate}` but the workers' rank 0 recorded `{entry.gate}` there:"
                " the two Lightning loops diverged. This is a bug in lightning_monarch, or a hook that changes"
                " the loop's control flow differently on each side."
            )
        self._apply(entry)
        if entry.checkpoint is not None:
            self._state = (entry, entry.checkpoint)
        self._current, self._released, self._attribution.ran = entry, not entry.sync, []
        self._control = dict(entry.control)
        if GATES[gate].batch_start:
            self._queue.took_batch()
            self._batch_gates = []
        self._batch_gates.append(gate)
        return entry

    def take_mark(self, gate: str, number: int) -> Entry:
        """Take and apply the next entry: ``gate``, a mark of no hook, for validation point ``number``."""
        self._leave()
        entry = self._queue.first(ending=False)
        if (entry.gate, mark_number(entry.result)) != (gate, number):
            raise DivergenceError(f"The controller expected `{gate}` {number}; the workers recorded `{entry.gate}`.")
        self._apply(self._queue.pop())
        return entry

    @contextmanager
    def following(self, queue: EntryQueue, channel: StageChannel) -> Iterator[None]:
        """Let the loop take ``queue``'s entries and release ``channel``'s workers, another mesh's
        (``controller.loop.validation_replay``), then go on with this stage's where it left them."""
        self._leave()
        kept = (self._queue, self._channel, self.requests, self._current, self._control, self._views)
        self._queue, self._channel, self._current = queue, channel, None
        self.requests = WorkerRequests(channel, self._require_parked)
        try:
            yield
            self._leave()
        finally:
            self._queue, self._channel, self.requests, self._current, self._control, self._views = kept
            self._released = True

    def take_batches(self, stage: str, limit: int) -> int:
        """Take the entries of up to ``limit`` whole batches of the ``stage`` loop (``validation``,
        ``test``, ``predict``) without running any hook here (``controller.loop.bulk``); how many
        were taken. A batch is whole when the next one's start has arrived (fetched if need be); one
        with a sync gate or nested results, or with other gates than the batch the loop just ran (each
        gate compared), is left to the loop's step."""
        start, expected, taken = gate_id("callback", f"on_{stage}_batch_start"), self._batch_gates, 0
        while taken < limit:
            entries = self._queue.whole_batch(start)
            if entries is None and self._queue.fetch_more():
                continue
            if entries != len(expected):
                break
            for gate in expected:
                self._leave()
                self._take(gate)
            taken += 1
        return taken

    def _apply(self, entry: Entry) -> None:
        trainer = self._trainer
        self._warned.show_rank0(entry.warnings)
        set_control_state(trainer, entry.control)
        self.logger_calls.make(entry.logger_calls)
        follow_optimizers(trainer, entry.param_groups, entry.lr_scheduler_configs, self.checkpoint_state)
        if entry.manual_steps is not None:
            lightning_compat.manual_step_progress(trainer).load_state_dict(entry.manual_steps)
        if entry.hparams is not None:
            self._module.hparams.clear()
            self._module.hparams.update(entry.hparams)
        self._views = entry.views
        self._arrive(entry)

    def _arrive(self, entry: Entry) -> None:
        """Take what a worker read when it reached ``entry``'s gate (``Entry``'s arrival fields): its
        evaluation results once, though a peek and the gate's own take may both arrive there."""
        if entry is not self._arrived:
            self._arrived = entry
            self._eval_outputs.extend(entry.eval_outputs)
        self.loaders.update(entry.loader_lengths, entry.fetched_batches)

    def peek(self) -> None:
        """Let the workers run to their next gate, if they wait after the current one, and take what
        they read on arriving there (dataloader lengths, evaluation results): the controller's loop
        asks for it between two gates, after the current gate's callbacks ran."""
        self._leave()
        entry = self._queue.first(ending=self._ended is not None)
        self._arrive(entry)

    def next_eval_outputs(self) -> dict[str, Any]:
        """The next value the workers' ``update_eval_epoch_metrics`` returned on rank 0."""
        if not self._eval_outputs:
            self.peek()
        if not self._eval_outputs:
            raise DivergenceError("The controller's evaluation loop ended an epoch that the workers did not end.")
        return self._eval_outputs.popleft()

    # ----- controller callbacks --------------------------------------------------------------

    def _grown_plan(self) -> Optional[RunAhead]:
        """The plan with the callbacks ``configure_callbacks`` added and the ``ReduceLROnPlateau``
        schedulers ``configure_optimizers`` returned; ``None`` if it did not change."""
        trainer_callbacks = self._trainer.callbacks  # type: ignore[attr-defined]
        self._attribution.wrap([c for c in trainer_callbacks if c is not self._gate_callback], self._undo)
        callbacks = [callback for callback in trainer_callbacks if callback is not self._gate_callback]
        plan = make_plan(
            callbacks,
            self._plan.max_ahead,
            self._snapshots,
            plateau_intervals(self._trainer.lr_scheduler_configs),
            states_can_travel(self._module, self._datamodule, self.worker_callbacks, self.sharded),
        )
        plan = dataclasses.replace(plan, notices=self._plan.notices)
        if plan == self._plan:
            return None
        self._plan = plan
        return plan

    def at_notice(self) -> None:
        """After the controller's callbacks ran at the end of a training batch: if every worker
        parked there because hosts got a preemption notice, go on without them from here
        (``ElasticFit.at_notice`` raises)."""
        if self._elastic is not None and self._current is not None and self._current.notice:
            self._elastic.at_notice(self._trainer)

    @property
    def parked(self) -> bool:
        """Whether every worker waits after the gate the controller's loop is at (R5)."""
        return self._current is not None and self._current.sync and not self._released

    def _require_parked(self, what: str) -> None:
        """Raise unless the workers wait at the controller's gate, or the stage has ended (R6)."""
        if self.parked or self._ended is not None:
            return
        gate = self._current.gate if self._current is not None else "the start of the stage"
        calling = self._attribution.calling
        who = f"`{type(calling[0]).__name__}.{calling[1]}`" if calling is not None else "The controller's loop"
        raise DivergenceError(
            f"{who} reads {what} after `{gate}`, where the workers do not wait for the controller under"
            " strategy='monarch': they have already moved on, and what they hold now belongs to a later batch."
            + (
                " An observe-only callback (`lightning_monarch.observe_only`) may read only the metric views its"
                " hooks are given; remove the declaration to make the workers wait at its hooks."
                if calling is not None and is_observe_only(calling[0])
                else ""
            )
        )

    # ----- out-of-band requests (R5) ---------------------------------------------------------

    def read_metrics(self, view: str) -> dict[str, Any]:
        """Rank 0's ``trainer.<view>`` at the gate the controller's loop is at: from the entry where
        it carries the views, else read from the workers parked there (R5, R6)."""
        if self._views is not None:
            values = self._views[view]
        else:
            self._require_parked(f"`trainer.{view}`")
            values = self._channel.ask_rank0("read_metrics", view, journal=True, everyone=True)
        values = {**self.beneath.get(view, {}), **values}
        self.metric_origins.remember(view, values)
        return values

    def checkpoint_state(self) -> CheckpointState:
        """Rank 0's model, optimizer and scheduler state at the gate the controller's loop is at:
        from the entry where it carries it, else read from the workers parked there, once per gate
        (R5, R6). After a training stage, the state it ended with."""
        if self.final_state is not None:
            return self.final_state
        if self._state is None or self._state[0] is not self._current:
            self._require_parked("the module's weights or the optimizers' state (a checkpoint)")
            self._state = (self._current, self._channel.ask_rank0("checkpoint_state"))
        return self._state[1]

    # ----- the end of the stage --------------------------------------------------------------

    def finish(self, stage: str) -> None:
        """The controller's loop finished ``stage``: take the workers' end of it (nothing may follow),
        their final metrics and rank 0's module attributes, after training their final state, which
        the controller's module and Trainer then hold (``taken_back.take_final_state``), and after predicting every rank's predictions. A sharded
        module's weights stay on the workers: the controller's module goes to the meta device."""
        self._leave()
        self._ended = Entry(None)  # from here the controller's loop expects no gate
        entry = self._queue.first(ending=self._ended is not None)
        if entry.gate is not None:
            raise DivergenceError(
                f"The workers' rank 0 recorded `{entry.gate}` after the controller's loop ended"
                " the stage: the two Lightning loops diverged."
            )
        self._apply(entry)
        for view in METRIC_VIEWS:
            getattr(self._trainer, view)  # rank 0's final views, which the end entry carries
        self._current, self._views = None, None
        self._channel.close()
        self._channel.mesh.held = frozenset(entry.held)
        module = self._module
        assert entry.attributes is not None  # rank 0's end entry of a stage that ran to its end has them
        taken = cloudpickle.loads(entry.attributes)
        take_attributes(taken, module, self._datamodule, self.worker_callbacks)
        if entry.rng is not None:
            lightning_compat.set_rng_states(entry.rng)
        if stage == "predict":
            self.predictions.add(self._channel.mesh.predictions())
        if stage == "fit" and self.sharded:
            module.to("meta")
        if self.sharded and all(tensor.is_meta for tensor in (*module.parameters(), *module.buffers())):
            self._channel.mesh.kept_shards = KeptShards.of(module)
        elif stage == "fit" and not self.sharded:
            assert entry.checkpoint is not None  # the end entry of an unsharded ``fit`` has it
            self.final_state = entry.checkpoint
            take_final_state(taken, self._trainer, module, self.final_state, self._channel.ask_rank0)
