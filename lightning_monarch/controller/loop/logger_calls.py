"""Rank 0's logger calls, made on the controller's loggers.

Runs on the controller, for a stage's ``StageSession``: each entry carries the calls rank 0 made on
its stand-ins for the controller's loggers (``worker.logger``), which are made here as the entry is
taken (R3), so that every logger runs once, in the user's process.

What controller callbacks log with ``pl_module.log`` at an evaluation epoch's end is not in rank
0's calls: under DDP rank 0 logs it in the same ``log_metrics`` call as the module's epoch
metrics (Lightning's ``log_eval_end_metrics``), one row. :meth:`LoggerCalls.log_at_eval_end` keeps
it until rank 0's call arrives, in the entry the controller's loop takes next.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch import Trainer

from lightning_monarch.wire.protocol import LoggerCall


class LoggerCalls:
    """Runs on the controller: makes rank 0's recorded logger calls on the Trainer's loggers."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._eval_end: dict[str, Any] = {}

    def log_at_eval_end(self, metrics: dict[str, Any]) -> None:
        """Log ``metrics``, which controller callbacks logged at an evaluation epoch's end, with rank
        0's epoch metrics: in the first ``log_metrics`` call of the next entry."""
        self._eval_end.update(convert_tensors_to_scalars(metrics))

    def make(self, calls: list[LoggerCall]) -> None:
        """Make ``calls``, an entry's, on the loggers they were made on."""
        eval_end, self._eval_end = self._eval_end, {}
        for call in calls:
            logger = self._trainer.loggers[call.logger_index]
            target = logger.experiment if call.method.startswith("experiment.") else logger  # type: ignore[attr-defined]
            args = call.args
            if call.method == "log_metrics" and eval_end:
                args, eval_end = ({**args[0], **eval_end}, *args[1:]), {}
            getattr(target, call.method.rsplit(".", 1)[-1])(*args, **call.kwargs)
            if call.method == "log_metrics":
                logger.save()
