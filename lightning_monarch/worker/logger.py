"""The loggers a worker's Trainer writes to: recorders whose calls the controller replays.

Runs in each worker. Lightning decides on each rank when to log (``log_every_n_steps``, epoch
ends) and calls the loggers on rank 0 only; recording those calls, and module code's calls on
``self.logger.experiment``, and replaying them on the controller's real loggers gives the
controller exactly the writes DDP's rank 0 would make. A worker gets one recorder per controller
logger, so ``self.loggers`` has the same length as under DDP.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from typing import Any, Optional, Union

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_monarch.wire.protocol import LoggerCall
from lightning_monarch.wire.specs import LoggerIdentity
from lightning_monarch.worker.describe import to_cpu


class _ExperimentRecorder:
    """Stands in for a logger's ``experiment`` on rank 0: every method call is recorded."""

    def __init__(self, record: Callable[[str, tuple, dict], None]) -> None:
        self._record = record

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> None:
            self._record(f"experiment.{name}", args, kwargs)

        return call


class RecordingLogger(Logger):
    """Runs in each worker: records the calls rank 0 makes on the controller logger it stands for."""

    def __init__(self, index: int, identity: LoggerIdentity, sink: list[LoggerCall]) -> None:
        super().__init__()
        self._index = index
        self._identity = identity
        self._sink = sink

    @property
    @override
    def name(self) -> Optional[str]:
        return self._identity.name

    @property
    @override
    def version(self) -> Any:
        return self._identity.version

    @property
    @override
    def save_dir(self) -> Optional[str]:
        return self._identity.save_dir

    @property
    @override
    def log_dir(self) -> Optional[str]:
        return self._identity.log_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        return _ExperimentRecorder(self._record)

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self._record("log_metrics", (dict(metrics), step), {})

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        self._record("log_hyperparams", (params, *args), kwargs)

    def _record(self, method: str, args: tuple, kwargs: dict) -> None:
        self._sink.append(LoggerCall(self._index, method, to_cpu(args), to_cpu(kwargs)))


def recording_loggers(identities: list[LoggerIdentity]) -> tuple[list[RecordingLogger], list[LoggerCall]]:
    """One recorder per controller logger, all writing to the returned call list."""
    calls: list[LoggerCall] = []
    return [RecordingLogger(index, identity, calls) for index, identity in enumerate(identities)], calls
