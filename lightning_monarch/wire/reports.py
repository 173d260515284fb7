"""What the workers report to the controller besides their entries: failures, warnings,
checkpoint state, stats, predictions and their answers to a preflight.

Both sides import this module; the entries that carry most of these are in
:mod:`lightning_monarch.wire.protocol`.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class WorkerReport:
    """One worker's answer to a :class:`PreflightSpec`: where it runs, what it sees, how fast its
    all-reduce was, every problem found (empty when all is well) and every warning."""

    rank: int
    host: str
    pid: int
    device: str
    device_memory_gib: Optional[float]
    versions: dict[str, Optional[str]]
    visible_devices: dict[str, str]
    all_reduce_s: Optional[float]
    problems: list[str]
    #: Settings known to cause hangs (RCCL's, on ROCm); reported, not fatal.
    warnings: list[str]


@dataclass(frozen=True)
class PredictionShard:
    """One rank's ``predict_step`` output for one batch, with the dataset indices of its samples."""

    output: Any
    batch_indices: list[int]
    dataloader_idx: int


@dataclass(frozen=True)
class WorkerFailure:
    """An exception raised on a worker, with where it happened and the remote traceback."""

    rank: int
    host: str
    hook: Optional[str]
    exception_type: str
    message: str
    traceback: str
    #: The memory the worker had in use when it failed, in MiB: its GPU's allocated memory, or on a
    #: CPU worker its process's resident size.
    memory_mib: Optional[float] = None
    #: Where no hook raised it: the last hook that had returned (Lightning's own code, or a loader's,
    #: raised it after that hook: wrapping the module in DDP after ``configure_model``).
    after: Optional[str] = None
    #: The exception's class, ``module:qualname``, for the controller to raise one of its own.
    exception_class: Optional[str] = None
    #: The exception pickled (its class by reference, its arguments and attributes), where it pickles.
    pickled: Optional[bytes] = None
    #: Rank 0's checkpoint state as it failed, where a controller callback saves on an exception
    #: (``RunAhead.saves_on_exception``): what ``OnExceptionCheckpoint`` writes, as under ``ddp``.
    checkpoint: Optional[CheckpointState] = None
    #: Where no hook raised it, the step of Lightning's or torch's own code that did, where its
    #: traceback tells (:func:`_step`): wrapping the module in DDP, a collective.
    step: Optional[str] = None

    @property
    def where(self) -> str:
        """Where it was raised, as a message says it: in the hook, in the step of Lightning's or
        torch's code, after the hook that returned last, or nothing where none is known."""
        if self.hook is not None:
            return f" in `{self.hook}`"
        after = f"after `{self.after}` returned" if self.after is not None else ""
        if self.step is not None:
            return f" in {self.step}" + (f" ({after})" if after else "")
        return f" {after}" if after else ""

    @classmethod
    def capture(
        cls, error: BaseException, rank: int, hook: Optional[str], memory_mib: float, last: Optional[str] = None
    ) -> WorkerFailure:
        """Describe ``error``, raised on this host at rank ``rank`` in ``hook`` (``None``: outside any
        hook, after ``last``, the last hook that ran, returned) with ``memory_mib`` in use
        (``worker.stats.memory_in_use_mib``), with its traceback."""
        return cls(
            rank=rank,
            host=socket.gethostname(),
            hook=hook,
            exception_type=type(error).__name__,
            message=str(error),
            traceback="".join(traceback.format_exception(error)),
            memory_mib=memory_mib,
            after=last if hook is None else None,
            exception_class=class_name(type(error)),
            pickled=_pickled(error),
            step=_step(error) if hook is None else None,
        )


def class_name(cls: type) -> str:
    """``module:qualname`` of ``cls``: how a class travels by name between the workers and the
    controller, where the class itself may not unpickle (one defined in the user's script lives in
    the worker under another ``__main__``). Read back with :func:`class_named`."""
    return f"{cls.__module__}:{cls.__qualname__}"


def class_named(name: str) -> Optional[type]:
    """The class :func:`class_name` gave ``name``, where this process has imported its module
    (nothing is imported here); ``None`` elsewhere."""
    module, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def _step(error: BaseException) -> Optional[str]:
    """The step of torch's own code that ``error``'s traceback passes through, outermost first:
    wrapping a module in ``DistributedDataParallel``, or a collective of ``torch.distributed``;
    ``None`` where it passes through neither."""
    frame = error.__traceback__
    while frame is not None:
        code, frame = frame.tb_frame.f_code, frame.tb_next
        path = code.co_filename.replace(os.sep, "/")
        if path.endswith("torch/nn/parallel/distributed.py") and code.co_name == "__init__":
            return "the wrapping of the module in `DistributedDataParallel` (Lightning's DDP setup)"
        if path.endswith("torch/distributed/distributed_c10d.py") and not code.co_name.startswith("_"):
            return f"the collective `torch.distributed.{code.co_name}`"
    return None


def _pickled(error: BaseException) -> Optional[bytes]:
    """``error`` pickled, or ``None`` where it does not pickle (an attribute that cannot be)."""
    try:
        return pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # anything pickling raises: the controller names the class alone
        return None


@dataclass(frozen=True)
class WorkerWarning:
    """A Python warning a worker process showed, held for the controller to show once
    (``worker.held_warnings``, ``controller.mesh.worker_warnings``): what ``warnings.showwarning`` got,
    the class named ``module:qualname`` (:func:`class_name`)."""

    category: str
    message: str
    filename: str
    lineno: int


@dataclass(frozen=True)
class CheckpointState:
    """Rank 0's model, optimizer, LR-scheduler, worker-callback and precision-plugin state (the
    gradient scaler's under ``precision="16-mixed"``), for a checkpoint or the end of a stage."""

    model: dict[str, Any]
    optimizers: list[dict[str, Any]]
    lr_schedulers: list[dict[str, Any]]
    callbacks: dict[str, Any]
    precision: dict[str, Any]


@dataclass(frozen=True)
class RankValue:
    """One rank's value of something every rank has (a metric), for the controller to compare."""

    rank: int
    value: Any


@dataclass(frozen=True)
class Attributes:
    """An object's public Python attributes on a rank that can travel, and for every other one
    why it cannot (its pickling error)."""

    values: dict[str, Any]
    dropped: dict[str, str]


#: The persistent IDs of an optimizers skeleton (``worker.optimizers``, read by
#: ``controller.loop.taken_back``): a parameter by its path in the module, an optimizer's state, the
#: LightningModule and the Trainer, which the controller holds itself.
SKELETON_PARAMETER, SKELETON_STATE, SKELETON_MODULE, SKELETON_TRAINER = "parameter", "state", "module", "trainer"


@dataclass(frozen=True)
class TakenBack:
    """What the controller's objects take of rank 0's at the end of a stage, as a ``ddp`` script's
    rank 0 holds its own: the module's attributes, and each worker callback's, in the order the
    stage's payload gave them; the datamodule's ``state_dict`` where it has one of its own, and the
    attributes the stage set on it; after an unsharded ``fit``, its optimizers and schedulers
    (``worker.optimizers``)."""

    module: Attributes
    callbacks: list[Attributes]
    #: The plain attributes of the module's submodules that the stage changed (a metric's states),
    #: pickled, by the submodule's path and the attribute's name (``worker.module_attributes``).
    submodules: dict[tuple[str, str], bytes] = field(default_factory=dict)
    #: Rank 0's datamodule's ``state_dict``, where its class defines one.
    datamodule_state: Optional[dict[str, Any]] = None
    #: The skeleton of rank 0's optimizers and schedulers after an unsharded ``fit``.
    optimizers: Optional[bytes] = None
    #: Why that skeleton could not be pickled (its error), where it could not.
    optimizers_refused: Optional[str] = None
    #: The datamodule's public attributes that the stage set (``setup``'s), each pickled, by name.
    datamodule_set: dict[str, bytes] = field(default_factory=dict)
    #: The others the stage set, which stay on the workers, each with why (too large, not picklable).
    datamodule_left: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RankStats:
    """One worker's answer to a stats read for ``MeshStatsMonitor`` (see ``worker.stats``), taken
    where its loop is parked: named values with their unit in the name (``rss_mib``,
    ``step_time_ms``, ...), and, once per worker process, why a GPU tool gives nothing (``None``
    when nothing is missing)."""

    rank: int
    values: dict[str, float]
    missing: Optional[str] = None
