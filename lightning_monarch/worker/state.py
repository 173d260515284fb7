"""This rank's Trainer state as the controller reads, copies and restores it outside the entries.

Runs in each worker, on the loop thread, where it is parked at a sync gate or after its stage
ended (R5): the metric views and collectives a controller callback asks for, rank 0's checkpoint
state (read there, or copied into an entry, R6), the module's attributes at the end of a stage, and
the recovery snapshots every rank writes and a replacement worker restores.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import cloudpickle
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch.optim import Optimizer

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.wire.codec import reduce_without_new
from lightning_monarch.wire.gates import GateCallback, datamodule_saves
from lightning_monarch.wire.protocol import METRIC_VIEWS, MODULE_HOOKS
from lightning_monarch.wire.reports import Attributes, CheckpointState, RankValue, TakenBack
from lightning_monarch.wire.specs import RankSnapshot
from lightning_monarch.worker import optimizers
from lightning_monarch.worker.describe import cpu_copy, to_cpu
from lightning_monarch.worker.module_attributes import PlainAttributes


class RankState:
    """Runs in each worker: this rank's Trainer state for the controller's out-of-band requests
    (R5), its checkpoint state, and its recovery snapshots, written and restored."""

    def __init__(
        self,
        trainer: Trainer,
        rank: int,
        callbacks: list[Any],
        module: LightningModule,
        datamodule: Optional[LightningDataModule],
    ) -> None:
        """``callbacks``: the stage's worker callbacks, in the order its payload gave them;
        ``module`` and ``datamodule``: the stage's, as the controller sent them."""
        self._trainer = trainer
        self._rank = rank
        self._callbacks = callbacks
        #: Rank 0's: the plain attributes of the module's submodules as the stage starts.
        self._submodules = PlainAttributes(module, submodules_only=True)
        self._submodules_start = self._submodules.read() if rank == 0 else {}
        self._datamodule = datamodule
        #: Rank 0's: the datamodule's public attributes as the stage starts, by identity.
        self._datamodule_start = _identities(datamodule) if rank == 0 and datamodule is not None else {}
        #: A validation worker's: the training rank's checkpoint state of the step it validates,
        #: which stands for its own (``worker.async_validation``).
        self.validated: Optional[CheckpointState] = None

    @property
    def module(self) -> Any:
        """This rank's LightningModule."""
        return self._trainer.lightning_module

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

    def module_attributes(self) -> Attributes:
        """The module's public Python attributes (counters, lists, tensors that are not buffers)
        and its hyperparameters (``hparams``, which a learning-rate finder sets) that can travel:
        after a stage, the controller's module takes rank 0's, as the module in a DDP script's rank
        0 would have them. One created on the worker and bound to it (a file, a lock) stays there,
        and the controller is told which and why."""
        return _attributes(self.module, cloudpickle.dumps, also=("_hparams",))

    def taken_back(self, with_optimizers: bool) -> TakenBack:
        """What the controller's module, datamodule and worker callbacks take of this rank's at the
        end of a stage (the plain attributes of the module's submodules that the stage changed: a
        metric's states), and ``with_optimizers`` its optimizers and schedulers. A callback's attribute that
        holds this rank's live Trainer, module or optimizers stays here without a word: the
        controller's instance keeps its own."""
        skeleton, refused = None, None
        if with_optimizers:
            try:
                skeleton = optimizers.skeleton(self._trainer)
            except Exception as error:
                refused = f"{type(error).__name__}: {error}"
        callbacks = [
            _attributes(callback, _LiveRefusing.check, private=True, nested=_NESTED) for callback in self._callbacks
        ]
        saves = datamodule_saves(self._trainer.datamodule)  # type: ignore[attr-defined]
        datamodule_state = self._datamodule_state_after_teardown() if saves else None
        submodules = self._submodules.changed_since(self._submodules_start)
        datamodule, left = self._datamodule_set() if self._datamodule is not None else ({}, {})
        return TakenBack(
            self.module_attributes(), callbacks, submodules, datamodule_state, skeleton, refused, datamodule, left
        )

    def _datamodule_set(self) -> tuple[dict[str, bytes], dict[str, str]]:
        """The datamodule's public attributes that the stage set (new, or another object than at
        its start: what ``setup`` made), each pickled where it takes at most
        :data:`DATAMODULE_ATTRIBUTE_MIB`; and for each other one, why it stays here (its size, or
        its pickling error)."""
        values, left = {}, {}
        for name, value in vars(self._datamodule).items():
            if name.startswith("_") or self._datamodule_start.get(name) == id(value):
                continue
            try:
                values[name] = _CappedPickler.pickled(to_cpu(value))
            except _Live:
                continue
            except _TooLarge:
                left[name] = f"a `{type(value).__name__}` of over {DATAMODULE_ATTRIBUTE_MIB} MiB pickled"
            except Exception as error:
                left[name] = f"a `{type(value).__name__}` that cannot be pickled ({type(error).__name__}: {error})"
        return values, left

    def failure_state(self) -> Optional[CheckpointState]:
        """The checkpoint state as this rank failed (``OnExceptionCheckpoint`` on the controller
        writes it), or ``None`` where the failure left it unreadable."""
        try:
            return self.checkpoint_state()
        except Exception:  # anything reading it raises: the controller then writes nothing
            return None

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

    def datamodule_state_dict(self) -> dict[str, Any]:
        """The datamodule's ``state_dict``, as Lightning's ``dump_checkpoint`` reads it on a ``ddp``
        rank 0: from the datamodule that set up and served this rank's data."""
        return to_cpu(self._trainer.datamodule.state_dict())  # type: ignore[attr-defined]

    def _datamodule_state_after_teardown(self) -> Optional[dict[str, Any]]:
        """The datamodule's ``state_dict`` as the stage ends, after its ``teardown``; ``None`` where it
        cannot be read then (nequip's drops what it reads in ``teardown``): the controller's datamodule
        keeps its own state, and its ``state_dict`` fails as rank 0's would there under ``ddp``."""
        try:
            return self.datamodule_state_dict()
        except Exception:  # the datamodule's own error, which a ddp script would meet reading it here
            return None

    def snapshot(self, directory: Optional[str]) -> RankSnapshot:
        """This rank's part of a recovery snapshot (see ``specs.ResumePoint``). For a sharded
        module (``directory`` given), every rank takes part in writing the checkpoint into
        ``directory`` with its ``ModelParallelStrategy``, as Lightning's ``trainer.save_checkpoint``
        does: each rank its shards of the module and optimizers (DCP), rank 0 the metadata."""
        checkpoint = None
        if directory is not None:
            self._trainer.strategy.save_checkpoint(lightning_compat.dump_checkpoint(self._trainer), directory)
        elif self._rank == 0:
            buffer = io.BytesIO()
            torch.save(lightning_compat.dump_checkpoint(self._trainer), buffer)
            checkpoint = buffer.getvalue()
        return RankSnapshot(
            rank=self._rank,
            rng=lightning_compat.rng_states(),
            attributes=self.module_attributes().values,
            metrics=to_cpu(lightning_compat.stored_metrics(self._trainer)),
            checkpoint=checkpoint,
        )

    def resume(self, snapshot: RankSnapshot) -> None:
        """At the snapshot's gate on a replacement worker: run on as an ordinary loop, and take back
        this rank's random states, module attributes and stored metric values from ``snapshot``."""
        lightning_compat.end_restart(self._trainer)
        lightning_compat.set_rng_states(snapshot.rng)
        vars(self.module).update(snapshot.attributes)
        lightning_compat.restore_stored_metrics(self._trainer, snapshot.metrics)

    def checkpoint_state(self, copy: bool = False) -> CheckpointState:
        """The model, optimizer, LR-scheduler and precision state that a DDP rank 0 would put in a
        checkpoint; with ``copy``, a copy that training does not change afterwards. A validation
        worker's is its training rank's at the step it validates (:attr:`validated`)."""
        if self.validated is not None:
            return self.validated
        strategy = self._trainer.strategy
        state = {
            "model": strategy.lightning_module_state_dict(),
            "optimizers": [strategy.optimizer_state(optimizer) for optimizer in self._trainer.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in self._trainer.lr_scheduler_configs],
            "callbacks": callback_states(self._trainer),
            "precision": self._trainer.precision_plugin.state_dict(),
        }
        return CheckpointState(**(cpu_copy if copy else to_cpu)(state))


#: How deep a worker callback's objects that hold live ones travel as their own attributes.
_NESTED = 2
#: What a rank holds live: its Trainer, module, datamodule and optimizers.
_LIVE = (Trainer, LightningModule, LightningDataModule, Optimizer)


def _attributes(obj: Any, check: Any, also: tuple[str, ...] = (), private: bool = False, nested: int = 0) -> Attributes:
    """``obj``'s public attributes (and with ``private`` its private ones: a library callback's
    public properties read them, as FTS's ``curr_depth``), and those named in ``also``, that
    ``check`` pickles without an error; for each other one, why it cannot travel. A :class:`_Live`
    one is left out, or, ``nested`` levels deep, travels as its own :class:`Attributes` in turn
    where it is an object that holds a live one (FTS's state, beside its reference to the fit loop),
    for the controller's object there to take."""
    values: dict[str, Any] = {}
    dropped = {}
    for name, value in vars(obj).items():
        hidden = name.startswith("_") and not private and name not in also
        if hidden or name == "training" or _bound_here(name, value, obj):
            continue
        try:
            check(value)
        except _Live:
            if nested and hasattr(value, "__dict__") and not isinstance(value, (*_LIVE, type)):
                values[name] = _attributes(value, check, private=private, nested=nested - 1)
            continue
        except Exception as error:
            dropped[name] = f"{type(error).__name__}: {error}"
            continue
        values[name] = to_cpu(value)
    return Attributes(values, dropped)


class _Live(Exception):
    """A value holds a rank's live Trainer, module or optimizer (:class:`_LiveRefusing`)."""


class _LiveRefusing(cloudpickle.Pickler):
    """Pickles a worker callback's attribute to see that it can travel, and raises :class:`_Live`
    where it holds a Trainer, a LightningModule or an optimizer: this rank's live objects, which
    the controller's callback must not take a copy of (nor of a datamodule)."""

    @classmethod
    def check(cls, value: Any) -> None:
        cls(io.BytesIO()).dump(value)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _LIVE):
            raise _Live()
        return super().reducer_override(obj)


#: The most a datamodule attribute that a stage set may weigh, pickled, to come back to the
#: controller at the stage's end: metadata (class names, a vocabulary, a fitted scaler) does, a
#: dataset's data stays on the workers (and a read of it on the controller says so).
DATAMODULE_ATTRIBUTE_MIB = 16


class _TooLarge(Exception):
    """A value pickles to more than :data:`DATAMODULE_ATTRIBUTE_MIB` (:class:`_CappedPickler`)."""


class _CappedFile(io.BytesIO):
    """A file in memory that refuses to grow past a cap (:class:`_TooLarge`)."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self._cap = cap

    def write(self, data: Any) -> int:
        if self.tell() + memoryview(data).nbytes > self._cap:
            raise _TooLarge()
        return super().write(data)


class _CappedPickler(_LiveRefusing):
    """Pickles a value for the controller as the stage's payload pickles for the workers (an
    object whose class's ``__new__`` wants arguments is made blank there), stopping at the first
    byte past :data:`DATAMODULE_ATTRIBUTE_MIB` (:class:`_TooLarge`): a large dataset is never copied
    whole."""

    def reducer_override(self, obj: Any) -> Any:
        reduced = super().reducer_override(obj)  # raises :class:`_Live` for a live object
        without_new = reduce_without_new(obj, self.proto) if reduced is NotImplemented else None
        return without_new if without_new is not None else reduced

    @classmethod
    def pickled(cls, value: Any) -> bytes:
        file = _CappedFile(DATAMODULE_ATTRIBUTE_MIB * 2**20)
        cls(file, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return file.getvalue()


def _identities(obj: Any) -> dict[str, int]:
    """The identities of ``obj``'s public attributes, by name."""
    return {name: id(value) for name, value in vars(obj).items() if not name.startswith("_")}


def _bound_here(name: str, value: Any, module: Any) -> bool:
    """Whether an attribute of ``module`` is no state of its own: a method bound to it (Lightning
    sets ``forward`` so) or what this worker put on one of its hooks (a gate, ``gates``; the
    sharding wrapper, ``worker.sharding``)."""
    return getattr(value, "__self__", None) is module or name in MODULE_HOOKS


def worker_callbacks(trainer: Trainer) -> list[Any]:
    """The worker callbacks of a worker's Trainer: all but the gate callback."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    return [callback for callback in callbacks if not isinstance(callback, GateCallback)]


def callback_states(trainer: Trainer) -> dict[str, Any]:
    """The worker callbacks' state, as Lightning puts it in a checkpoint's ``callbacks``."""
    return {
        callback.state_key: to_cpu(state) for callback in worker_callbacks(trainer) if (state := callback.state_dict())
    }
