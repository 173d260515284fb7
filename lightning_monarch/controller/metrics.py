"""The controller Trainer's metrics, read from rank 0 of the workers when something reads them.

Runs on the controller. ``trainer.callback_metrics``, ``progress_bar_metrics`` and
``logged_metrics`` are properties that Lightning recomputes on every read, and a read under DDP
updates the copy Lightning keeps. Forwarding each read to the workers, at the point both loops
have reached, gives the controller rank 0's values and keeps rank 0's copy evolving exactly as
DDP's rank 0 would.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from lightning.pytorch import Trainer

from lightning_monarch import _compat


class MetricsSource(Protocol):
    """What the mirror needs from the stage session."""

    def read_metrics(self, view: str) -> dict[str, Any]: ...

    def next_eval_outputs(self) -> dict[str, Any]: ...


class _MirroredLoggerConnector(_compat.LoggerConnector):
    """Lightning's logger connector whose metric views come from the workers."""

    _monarch_source: MetricsSource

    def _mirror(self, view: str, stored: dict[str, Any]) -> dict[str, Any]:
        # Update, not replace: controller callbacks write into these dicts too (LearningRateMonitor
        # adds its learning rates to ``callback_metrics``), as they would into rank 0's under DDP.
        stored.update(self._monarch_source.read_metrics(view))
        return stored

    @property
    def callback_metrics(self) -> dict[str, Any]:
        return self._mirror("callback_metrics", self._callback_metrics)

    @property
    def progress_bar_metrics(self) -> dict[str, Any]:
        return self._mirror("progress_bar_metrics", self._progress_bar_metrics)

    @property
    def logged_metrics(self) -> dict[str, Any]:
        return self._mirror("logged_metrics", self._logged_metrics)

    def update_eval_epoch_metrics(self) -> dict[str, Any]:
        return self._monarch_source.next_eval_outputs()

    def log_eval_end_metrics(self, metrics: dict[str, Any]) -> None:
        """The workers' own call reaches the controller's loggers through the recording logger."""


def mirror_metrics(trainer: Trainer, source: MetricsSource) -> Callable[[], None]:
    """Route ``trainer``'s metric views to ``source`` until the returned undo is called."""
    connector = trainer._logger_connector
    original = type(connector)
    connector.__class__ = _MirroredLoggerConnector
    connector._monarch_source = source

    def undo() -> None:
        connector.__class__ = original
        del connector._monarch_source

    return undo
