"""The controller Trainer's metrics, read from rank 0 of the workers when something reads them.

Runs on the controller. ``trainer.callback_metrics``, ``progress_bar_metrics`` and
``logged_metrics`` are properties that Lightning recomputes on every read, and a read under DDP
updates the copy Lightning keeps. Forwarding each read to the workers, at the point both loops
have reached, gives the controller rank 0's values and keeps rank 0's copy evolving exactly as
DDP's rank 0 would.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch
from lightning.pytorch import Trainer
from typing_extensions import override

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.loop.logger_calls import LoggerCalls


class MetricsSource(Protocol):
    """What the mirror needs from the stage session."""

    logger_calls: LoggerCalls

    def read_metrics(self, view: str) -> dict[str, Any]: ...

    def next_eval_outputs(self) -> dict[str, Any]: ...


class _MirroredLoggerConnector(lightning_compat.LoggerConnector):
    """Lightning's logger connector whose metric views come from the workers."""

    _monarch_source: MetricsSource

    def _mirror(self, view: str) -> dict[str, Any]:
        # Update, not replace: controller callbacks write into these dicts too (LearningRateMonitor
        # adds its learning rates to ``callback_metrics``), as they would into rank 0's under DDP.
        stored = lightning_compat.metric_store(self, view)
        stored.update(self._monarch_source.read_metrics(view))
        return stored

    @property
    @override
    def callback_metrics(self) -> dict[str, Any]:
        return self._mirror("callback_metrics")

    @property
    @override
    def progress_bar_metrics(self) -> dict[str, Any]:
        return self._mirror("progress_bar_metrics")

    @property
    @override
    def logged_metrics(self) -> dict[str, Any]:
        return self._mirror("logged_metrics")

    @override
    def update_eval_epoch_metrics(self) -> dict[str, Any]:
        """Rank 0's epoch metrics, and what controller callbacks logged here (at the epoch's end),
        as one rank 0 under DDP holds both, and logs both in one row."""
        logged_here = super().update_eval_epoch_metrics()
        self._monarch_source.logger_calls.log_at_eval_end(logged_here)
        return {**self._monarch_source.next_eval_outputs(), **logged_here}

    @override
    def log_eval_end_metrics(self, metrics: dict[str, Any]) -> None:
        """The workers' own call reaches the controller's loggers through the recording logger."""


class MetricOrigins:
    """Runs on the controller: which metric each tensor the workers' metric views sent stands for.

    Under DDP a callback on every rank holds its own value of ``trainer.callback_metrics["loss"]``;
    the controller holds rank 0's. A collective on one of these tensors can therefore run where
    all its counterparts live, on the workers (``MonarchStrategy.reduce``), while a tensor made on
    the controller has no counterpart anywhere. Entries go when their tensor does.
    """

    def __init__(self) -> None:
        self._origins: dict[int, tuple[weakref.ref, str, str]] = {}

    def remember(self, view: str, values: dict[str, Any]) -> None:
        """The values rank 0 sent for ``trainer.<view>``, by key."""
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                forget = functools.partial(self._origins.pop, id(value), None)

                def forget_when_collected(_: weakref.ref, forget: Callable[[], Any] = forget) -> Any:
                    return forget()

                self._origins[id(value)] = (weakref.ref(value, forget_when_collected), view, key)

    def origin(self, tensor: Any) -> Optional[tuple[str, str]]:
        """``(view, key)`` of a tensor the workers sent, as it was sent; ``None`` for any other."""
        entry = self._origins.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1], entry[2]


def mirror_metrics(trainer: Trainer, source: MetricsSource) -> Callable[[], None]:
    """Route ``trainer``'s metric views to ``source`` until the returned undo is called."""
    connector, restore_class = lightning_compat.logger_connector_class(trainer, _MirroredLoggerConnector)
    connector._monarch_source = source  # type: ignore[attr-defined]

    def undo() -> None:
        restore_class()
        del connector._monarch_source  # type: ignore[attr-defined]

    return undo
