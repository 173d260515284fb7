"""Reads the state of a worker's Trainer that the controller mirrors.

Runs in each worker, on the loop thread. Rank 0 is the reference rank, as Lightning's rank 0 is
under DDP: its metrics, logger calls and optimizer hyperparameters are what the controller shows.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Optional

import cloudpickle
import torch
from lightning.pytorch import Trainer

from lightning_monarch import _compat
from lightning_monarch.gates import GateCallback
from lightning_monarch.protocol import (
    METRIC_VIEWS,
    CheckpointState,
    Entry,
    LoggerCall,
    ModuleAttributes,
    RankSnapshot,
    RankValue,
    RunAhead,
    control_state,
)
from lightning_monarch.worker.describe import cpu_copy, param_group_hyperparameters, to_cpu



#: The gates whose entries carry the optimizers' hyperparameters: where ``LearningRateMonitor``
#: reads them on the controller.
_PARAM_GROUP_GATES = frozenset({"callback.on_train_batch_start", "callback.on_train_epoch_start"})


@dataclass
class Arrival:
    """What a worker read when it reached a gate, before the hook ran (``Entry``'s arrival fields)."""

    eval_outputs: list[dict[str, Any]]
    loader_lengths: Optional[dict[str, list[Optional[int]]]]
    fetched_batches: Optional[dict[str, int]]


class StateReader:
    """Runs in each worker: what the controller learns of this rank's Trainer, in entries (R3) and
    in out-of-band answers (R5)."""

    def __init__(self, trainer: Trainer, rank: int, logger_calls: list[LoggerCall], plan: RunAhead) -> None:
        self._trainer = trainer
        self._rank = rank
        self._plan = plan
        self._logger_calls = logger_calls
        self._eval_outputs: list[dict[str, Any]] = []
        _compat.record_eval_epoch_metrics(trainer, self._eval_outputs.append)
        #: What the last entry carried of what is sent only when it changed.
        self._sent: dict[str, Any] = {}

    @property
    def module(self) -> Any:
        """This rank's LightningModule."""
        return self._trainer.lightning_module

    def update_plan(self, plan: RunAhead) -> None:
        """The controller's plan, grown at a sync gate (``controller.plan``)."""
        self._plan = plan

    def arrival(self) -> Arrival:
        """What rank 0 tells the controller of a gate before its hook runs: the values
        ``update_eval_epoch_metrics`` returned, and the loops' dataloader lengths and fetch counts,
        when they changed (the controller's loop asks for them between gates)."""
        outputs, self._eval_outputs[:] = self._eval_outputs[:], []
        if self._rank != 0:
            return Arrival([], None, None)
        lengths = _compat.combined_loader_lengths(self._trainer)
        # the fetch counts matter for loaders without a length only, whose passes end where they do
        unsized = any(None in stage for stage in lengths.values())
        return Arrival(
            eval_outputs=to_cpu(outputs),
            loader_lengths=self._changed("loader_lengths", lengths),
            fetched_batches=_compat.fetched_batches(self._trainer) if unsized else None,
        )

    def entry(self, gate: Optional[str], arrival: Arrival, result: Any, nested: list[tuple[str, Any]],
              staged: bool = False) -> Entry:
        """Rank 0's entry for ``gate`` after its hook ran (R3), with a copy of its checkpoint state if
        ``staged`` (R6); on the other ranks an empty one, but the metric views are read on every rank
        alike, since reading them may sync values across ranks."""
        views = None
        if gate in self._plan.views or staged:
            views = {view: to_cpu(dict(getattr(self._trainer, view))) for view in METRIC_VIEWS}
        if self._rank != 0:
            return Entry(gate)
        calls, self._logger_calls[:] = self._logger_calls[:], []
        return Entry(
            gate=gate,
            result=result,
            nested=nested,
            control=control_state(self._trainer),
            logger_calls=calls,
            param_groups=[param_group_hyperparameters(optimizer) for optimizer in self._trainer.optimizers]
            if gate in _PARAM_GROUP_GATES else None,
            manual_steps=self._changed("manual_steps", _compat.manual_step_progress(self._trainer).state_dict()),
            views=views,
            checkpoint=self.checkpoint_state(copy=True) if staged else None,
            eval_outputs=arrival.eval_outputs,
            loader_lengths=arrival.loader_lengths,
            fetched_batches=arrival.fetched_batches,
        )

    def _changed(self, name: str, value: Any) -> Any:
        """``value`` if it differs from what the last entry carried under ``name``, else ``None``."""
        if self._sent.get(name) == value:
            return None
        self._sent[name] = value
        return value

    def read_metrics(self, view: str) -> Optional[dict[str, Any]]:
        """Read a metrics property as a callback on DDP rank 0 would at this point.

        Every rank reads, since computing epoch values with ``sync_dist`` is a collective; the
        read updates Lightning's stored copy exactly as the same read under DDP would.
        """
        if view not in METRIC_VIEWS:
            raise ValueError(f"Unknown metrics view {view!r}; expected one of {METRIC_VIEWS}.")
        values = getattr(self._trainer, view)
        return to_cpu(dict(values)) if self._rank == 0 else None

    def collective(self, kind: str, view: str, key: str, options: dict[str, Any]) -> Any:
        """Run ``trainer.strategy.<kind>`` (``reduce`` or ``all_gather``) on this rank's own
        ``trainer.<view>[key]``: what a callback on each DDP rank does when it passes that value.
        Every rank takes part; rank 0's result returns."""
        result = getattr(self._trainer.strategy, kind)(getattr(self._trainer, view)[key], **options)
        return to_cpu(result) if self._rank == 0 else None

    def metric(self, view: str, key: str) -> RankValue:
        """This rank's ``trainer.<view>[key]`` (``None`` if it has none)."""
        return RankValue(self._rank, to_cpu(getattr(self._trainer, view).get(key)))

    def module_attributes(self) -> ModuleAttributes:
        """The module's public Python attributes (counters, lists, tensors that are not buffers)
        that can travel: after a stage, the controller's module takes rank 0's, as the module in a
        DDP script's rank 0 would have them. One created on the worker and bound to it (a file, a
        lock) stays there, and the controller is told which and why."""
        values, dropped = {}, {}
        for name, value in vars(self.module).items():
            if name.startswith("_") or name == "training" or _bound_here(value, self.module):
                continue
            try:
                cloudpickle.dumps(value)
            except Exception as error:
                dropped[name] = f"{type(error).__name__}: {error}"
                continue
            values[name] = to_cpu(value)
        return ModuleAttributes(values, dropped)

    def module_children(self) -> dict[str, Any]:
        """The module's direct submodules (on CPU after the stage's teardown): the controller takes
        them when ``configure_model`` changed the module's structure on the workers."""
        return dict(self.module.named_children())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Run the worker callbacks' and then the module's ``on_save_checkpoint`` on a checkpoint
        the controller is writing, in the order Lightning's ``dump_checkpoint`` calls them."""
        for callback in worker_callbacks(self._trainer):
            callback.on_save_checkpoint(self._trainer, self.module, checkpoint)
        self.module.on_save_checkpoint(checkpoint)
        return to_cpu(checkpoint)  # what a GPU worker's hooks add must load where the controller has no GPU

    def snapshot(self, directory: Optional[str]) -> RankSnapshot:
        """This rank's part of a recovery snapshot (see ``protocol.ResumePoint``). For a sharded
        module (``directory`` given), every rank takes part in writing the checkpoint into
        ``directory`` with its ``ModelParallelStrategy``, as Lightning's ``trainer.save_checkpoint``
        does: each rank its shards of the module and optimizers (DCP), rank 0 the metadata."""
        checkpoint = None
        if directory is not None:
            self._trainer.strategy.save_checkpoint(_compat.dump_checkpoint(self._trainer), directory)
        elif self._rank == 0:
            buffer = io.BytesIO()
            torch.save(_compat.dump_checkpoint(self._trainer), buffer)
            checkpoint = buffer.getvalue()
        return RankSnapshot(
            rank=self._rank,
            rng=_compat.rng_states(),
            attributes=self.module_attributes().values,
            metrics=to_cpu(_compat.stored_metrics(self._trainer)),
            checkpoint=checkpoint,
        )

    def resume(self, snapshot: RankSnapshot) -> None:
        """At the snapshot's gate on a replacement worker: run on as an ordinary loop, and take back
        this rank's random states, module attributes and stored metric values from ``snapshot``."""
        _compat.end_restart(self._trainer)
        _compat.set_rng_states(snapshot.rng)
        vars(self.module).update(snapshot.attributes)
        _compat.restore_stored_metrics(self._trainer, snapshot.metrics)

    def checkpoint_state(self, copy: bool = False) -> CheckpointState:
        """The model, optimizer, LR-scheduler and precision state that a DDP rank 0 would put in a
        checkpoint; with ``copy``, a copy that training does not change afterwards."""
        strategy = self._trainer.strategy
        state = {
            "model": strategy.lightning_module_state_dict(),
            "optimizers": [strategy.optimizer_state(optimizer) for optimizer in self._trainer.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in self._trainer.lr_scheduler_configs],
            "callbacks": callback_states(self._trainer),
            "precision": self._trainer.precision_plugin.state_dict(),
        }
        return CheckpointState(**(cpu_copy if copy else to_cpu)(state))


def _bound_here(value: Any, module: Any) -> bool:
    """Whether an attribute of ``module`` is no state of its own: a method bound to it (Lightning
    sets ``forward`` so) or a gate on one of its hooks (``gates``)."""
    return getattr(value, "__self__", None) is module or getattr(value, "_lightning_monarch_gate", False)


def worker_callbacks(trainer: Trainer) -> list[Any]:
    """The worker callbacks of a worker's Trainer: all but the gate callback."""
    return [callback for callback in trainer.callbacks if not isinstance(callback, GateCallback)]


def callback_states(trainer: Trainer) -> dict[str, Any]:
    """The worker callbacks' state, as Lightning puts it in a checkpoint's ``callbacks``."""
    return {
        callback.state_key: to_cpu(state) for callback in worker_callbacks(trainer) if (state := callback.state_dict())
    }
