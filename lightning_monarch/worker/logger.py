"""The loggers a worker's Trainer writes to: the user's, whose rank-0 calls the controller replays.

Runs in each worker. Each of the controller's loggers travels to the workers pickled (as it would to
a ``ddp_spawn`` rank), so module code reads its own attributes there as on a DDP rank, and
``trainer.log_dir`` is the controller's. Lightning decides on each rank when to log
(``log_every_n_steps``, epoch ends) and calls the loggers on every rank; Lightning's loggers write
on rank 0 only (their methods are ``rank_zero_only``). On rank 0, the calls that write
(``log_metrics``, ``log_hyperparams``, and module code's calls on ``self.logger.experiment``) are
recorded and replayed on the controller's loggers, which gives the controller exactly the writes
DDP's rank 0 would make; the user's own code of each Logger method still runs on every rank, as
under DDP, with its rank-zero-only parts left to the controller (:func:`_writes_left_to_controller`).
A logger that cannot be pickled is a stand-in here, with its name, version and folders.
"""

from __future__ import annotations

import inspect
from argparse import Namespace
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Optional, Union

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_monarch.wire.protocol import LoggerCall
from lightning_monarch.wire.specs import LoggerIdentity
from lightning_monarch.worker.describe import to_cpu

#: The Logger methods that may write, which run on rank 0 with their rank-zero-only parts skipped.
_WRITING_METHODS = ("log_graph", "save", "finalize", "after_save_checkpoint")

#: What ``rank_zero_only.rank`` reads while rank 0 runs the user's logger code: any rank but 0.
_NOT_RANK_ZERO = 1

#: Where Lightning keeps this process's global rank for its ``rank_zero_only`` functions (``.rank``).
_RANK: Any = rank_zero_only


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


class _StandIn(Logger):
    """A controller logger that cannot be pickled, as workers see it: its name, version and folders
    (:func:`_recording` answers them), and calls that only record."""

    def __init__(self, identity: LoggerIdentity) -> None:
        super().__init__()
        self._identity = identity

    @property
    @override
    def name(self) -> Optional[str]:
        return self._identity.name

    @property
    @override
    def version(self) -> Any:
        return self._identity.version

    @property
    @rank_zero_experiment
    def experiment(self) -> None:
        """Rank 0's is the recorder (:func:`_recording`), the other ranks' Lightning's stand-in."""

    @override
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        """Nothing beside the record: the controller's logger writes."""

    @override
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        """Nothing beside the record: the controller's logger writes."""


@contextmanager
def _writes_left_to_controller() -> Iterator[None]:
    """On rank 0, around the user's logger code: ``rank_zero_only`` functions are skipped, as on
    another rank, since the controller makes rank 0's writes. Runs on the hook's thread."""
    rank = _RANK.rank
    if rank != 0:
        yield
        return
    _RANK.rank = _NOT_RANK_ZERO
    try:
        yield
    finally:
        _RANK.rank = rank


def _answered_by(identity: LoggerIdentity, name: str) -> property:
    """A property whose value is the controller logger's, ``identity``'s field ``name``."""
    return property(lambda self: getattr(identity, name))


def _recording(logger: Logger, identity: LoggerIdentity, record: Callable[[str, tuple, dict], None]) -> Logger:
    """``logger``, made an instance of a subclass of its own class (same name) that records rank 0's
    writing calls with ``record`` and answers the controller's name, version and folders."""
    cls = type(logger)

    def log_metrics(self: Logger, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if _RANK.rank == 0:
            record("log_metrics", (dict(metrics), step), {})
        with _writes_left_to_controller():
            cls.log_metrics(self, metrics, step)

    def log_hyperparams(self: Logger, params: Union[dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        if _RANK.rank == 0:
            record("log_hyperparams", (params, *args), kwargs)
        with _writes_left_to_controller():
            cls.log_hyperparams(self, params, *args, **kwargs)

    def writing(method: str) -> Callable[..., Any]:
        def call(self: Logger, *args: Any, **kwargs: Any) -> Any:
            with _writes_left_to_controller():
                return getattr(cls, method)(self, *args, **kwargs)

        return call

    namespace: dict[str, Any] = {
        "__slots__": (),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "log_metrics": log_metrics,
        "log_hyperparams": log_hyperparams,
        **{method: writing(method) for method in _WRITING_METHODS},
        **{field.name: _answered_by(identity, field.name) for field in fields(identity)},
    }
    experiment = inspect.getattr_static(cls, "experiment", None)
    if isinstance(experiment, property):

        def experiment_here(self: Logger) -> Any:
            return _ExperimentRecorder(record) if _RANK.rank == 0 else experiment.__get__(self, cls)

        # a logger whose ``experiment`` is a method of its own (not Lightning's property) keeps it
        namespace["experiment"] = property(experiment_here)
    metaclass: Any = type(cls)
    logger.__class__ = metaclass(cls.__name__, (cls,), namespace)
    return logger


def recording_loggers(
    identities: list[LoggerIdentity], loggers: list[Optional[Logger]]
) -> tuple[list[Logger], list[LoggerCall]]:
    """The controller's ``loggers`` as they travelled (``None`` for one that cannot be pickled: a
    stand-in), each recording into the returned call list."""
    calls: list[LoggerCall] = []

    def recorder(index: int) -> Callable[[str, tuple, dict], None]:
        def record(method: str, args: tuple, kwargs: dict) -> None:
            calls.append(LoggerCall(index, method, to_cpu(args), to_cpu(kwargs)))

        return record

    return [
        _recording(logger if logger is not None else _StandIn(identity), identity, recorder(index))
        for index, (identity, logger) in enumerate(zip(identities, loggers, strict=True))
    ], calls
