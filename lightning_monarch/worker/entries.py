"""What rank 0 records for the controller at each gate: its entries (R3).

Runs in each worker, on the loop thread. Rank 0 is the reference rank, as Lightning's rank 0 is
under DDP: its control state, logger calls, metric views and optimizer hyperparameters are what the
controller shows. The other ranks record empty entries, but read what every rank must read alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import cloudpickle
from lightning.pytorch import Trainer

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch._compat import loops as loops_compat
from lightning_monarch.wire.protocol import METRIC_VIEWS, Entry, LoggerCall, control_state
from lightning_monarch.wire.specs import SchedulerConfigRef
from lightning_monarch.worker.describe import param_group_hyperparameters, to_cpu
from lightning_monarch.worker.state import RankState

#: The gates whose entries carry the optimizers' hyperparameters: where ``LearningRateMonitor``
#: reads them on the controller.
_PARAM_GROUP_GATES = frozenset({"callback.on_train_batch_start", "callback.on_train_epoch_start"})


@dataclass(frozen=True)
class Arrival:
    """What a worker read when it reached a gate, before the hook ran (``Entry``'s arrival fields)."""

    eval_outputs: list[dict[str, Any]]
    loader_lengths: Optional[dict[str, list[Optional[int]]]]
    fetched_batches: Optional[dict[str, int]]


class EntryRecorder:
    """Runs in each worker: this rank's entries, one per gate (R3); rank 0's carry what the
    controller learns of its Trainer between sync gates (R6)."""

    def __init__(
        self,
        trainer: Trainer,
        rank: int,
        logger_calls: list[LoggerCall],
        state: RankState,
        final_state: bool = False,
        hparams: Optional[dict[str, Any]] = None,
    ) -> None:
        """``hparams``: the module's hyperparameters as the stage starts, which the controller's module holds."""
        self._trainer = trainer
        self._rank = rank
        self._logger_calls = logger_calls
        self._state = state
        #: Whether the stage's end entry carries rank 0's final checkpoint state (an unsharded ``fit``).
        self._final_state = final_state
        self._eval_outputs: list[dict[str, Any]] = []
        loops_compat.record_eval_epoch_metrics(trainer, self._eval_outputs.append)
        #: What the last entry carried of what is sent only when it changed.
        self._sent: dict[str, Any] = {"hparams": dict(hparams or {})}

    def arrival(self) -> Arrival:
        """What rank 0 tells the controller of a gate before its hook runs: the values
        ``update_eval_epoch_metrics`` returned, and the loops' dataloader lengths and fetch counts,
        when they changed (the controller's loop asks for them between gates)."""
        outputs, self._eval_outputs[:] = self._eval_outputs[:], []
        if self._rank != 0:
            return Arrival([], None, None)
        lengths = loops_compat.combined_loader_lengths(self._trainer)
        # the fetch counts matter for loaders without a length only, whose passes end where they do
        unsized = any(None in stage for stage in lengths.values())
        return Arrival(
            eval_outputs=to_cpu(outputs) if outputs else [],
            loader_lengths=self._changed("loader_lengths", lengths),
            fetched_batches=loops_compat.fetched_batches(self._trainer) if unsized else None,
        )

    def entry(
        self,
        gate: Optional[str],
        arrival: Arrival,
        result: Any,
        nested: list[tuple[str, Any]],
        sync: bool = False,
        views: bool = False,
        staged: bool = False,
    ) -> Entry:
        """Rank 0's entry for ``gate`` after its hook ran (R3), marked ``sync`` where every rank
        parks after it (R5), with the metric views if ``views`` or ``staged`` and a copy of its
        checkpoint state if ``staged`` (R6); on the other ranks one with the gate and ``sync`` only,
        but the metric views are read on every rank alike, since reading them may sync values across
        ranks."""
        metric_views = None
        if views or staged:
            metric_views = {view: to_cpu(dict(getattr(self._trainer, view))) for view in METRIC_VIEWS}
        if self._rank != 0:
            return Entry(gate, sync)
        calls, self._logger_calls[:] = self._logger_calls[:], []
        return Entry(
            gate=gate,
            sync=sync,
            result=result,
            nested=nested,
            control=control_state(self._trainer),
            logger_calls=calls,
            param_groups=[param_group_hyperparameters(optimizer) for optimizer in self._trainer.optimizers]
            if gate in _PARAM_GROUP_GATES
            else None,
            lr_scheduler_configs=self._changed(
                "lr_scheduler_configs",
                SchedulerConfigRef.describe(self._trainer.lr_scheduler_configs, self._trainer.optimizers),
            ),
            hparams=self._hyperparameters(),
            manual_steps=self._manual_steps(),
            views=metric_views,
            checkpoint=self._state.checkpoint_state(copy=True) if staged else None,
            eval_outputs=arrival.eval_outputs,
            loader_lengths=arrival.loader_lengths,
            fetched_batches=arrival.fetched_batches,
        )

    def end(self) -> Entry:
        """The entry that ends a stage that ran to its end (R3). Every rank reads the metric views,
        as they would be read where the controller's loop ends the stage; rank 0's entry carries
        them, its module's and worker callbacks' attributes and, after an unsharded ``fit``, its final checkpoint state:
        what the controller takes when the stage ends, in the message that ends it."""
        entry = self.entry(None, self.arrival(), None, [], views=True)
        if self._rank != 0:
            return entry
        return dataclasses.replace(
            entry,
            attributes=cloudpickle.dumps(self._state.taken_back(with_optimizers=self._final_state)),
            rng=lightning_compat.rng_states(include_cuda=False),
            checkpoint=self._state.checkpoint_state() if self._final_state else None,
        )

    def _hyperparameters(self) -> Optional[dict[str, Any]]:
        """The module's hyperparameters where they changed since the last entry."""
        module = self._trainer.lightning_module
        hparams = dict(module.hparams) if module is not None else {}
        try:
            same = bool(self._sent["hparams"] == hparams)
        except Exception:  # values whose comparison gives no truth value (tensors) are sent
            same = False
        if same:
            return None
        self._sent["hparams"] = hparams
        return to_cpu(hparams)

    def _manual_steps(self) -> Optional[dict[str, Any]]:
        """Manual optimization's step count where it changed: in a training loop whose module
        optimizes manually, the only place its optimizers step."""
        trainer = self._trainer
        if not trainer.training or trainer.lightning_module.automatic_optimization:
            return None
        return self._changed("manual_steps", lightning_compat.manual_step_progress(trainer).state_dict())

    def _changed(self, name: str, value: Any) -> Any:
        """``value`` if it differs from what the last entry carried under ``name``, else ``None``."""
        if self._sent.get(name) == value:
            return None
        self._sent[name] = value
        return value
