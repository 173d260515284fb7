"""What the controller's module, datamodule and worker callbacks take of rank 0's at the end of a stage.

Runs on the controller, for ``StageSession.finish``. Under DDP the script's process is rank 0, so
after a stage its module, datamodule and callbacks hold what rank 0's hold. The end entry of a stage
carries rank 0's public attributes of the module (with its ``hparams``) and the attributes of each
worker callback (``worker.state``): the controller's objects take them, and keep their own of those
that could not travel, with a warning that names them. A datamodule with a ``state_dict`` of its own
loads rank 0's, and the controller's datamodule takes the attributes the stage set on rank 0's
(:func:`left_on_workers` for those too large to). After an unsharded ``fit``, the controller's Trainer also takes rank 0's optimizers
and LR schedulers in place of its stand-ins (:func:`take_optimizers`), and its precision plugin rank
0's state (a gradient scaler's).
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_monarch.wire.reports import (
    SKELETON_MODULE,
    SKELETON_PARAMETER,
    SKELETON_STATE,
    SKELETON_TRAINER,
    Attributes,
    CheckpointState,
    TakenBack,
)


def take_attributes(
    taken: TakenBack, module: Any, datamodule: Optional[LightningDataModule], worker_callbacks: list[Any]
) -> None:
    """Give ``module`` (its submodules too) and ``worker_callbacks`` (in the stage's order) rank 0's attributes, and
    ``datamodule`` rank 0's state through its own ``load_state_dict``, where its class defines a
    ``state_dict``: a checkpoint written after the stage holds rank 0's, as under ``ddp``."""
    _take(module, taken.module, "module")
    submodules = dict(module.named_modules())
    for (path, name), data in taken.submodules.items():
        if path in submodules:  # not where ``configure_model`` made it on the workers only
            setattr(submodules[path], name, pickle.loads(data))
    if datamodule is not None:
        left = dict(taken.datamodule_left)
        for name, data in taken.datamodule_set.items():
            try:
                vars(datamodule)[name] = pickle.loads(data)
            except Exception as error:  # anything reading it back raises: it stays on the workers
                left[name] = f"it cannot be read back in this process ({type(error).__name__}: {error})"
        left_on_workers(datamodule, left)
    if datamodule is not None and taken.datamodule_state is not None:
        datamodule.load_state_dict(taken.datamodule_state)
    for callback, attributes in zip(worker_callbacks, taken.callbacks, strict=True):
        _take(callback, attributes, "callback")


#: Where a datamodule keeps, between stages, why each attribute the last stage set stayed on the
#: workers; on the class, what marks the subclass that reads it (:func:`left_on_workers`).
_LEFT = "_lightning_monarch_left_on_workers"


def left_on_workers(datamodule: LightningDataModule, left: dict[str, str]) -> None:
    """Make reading each of ``left`` (the datamodule attributes the stage set on the workers that
    stay there, each with why) on ``datamodule`` raise an ``AttributeError`` that says so, until the
    next stage (:func:`back_to_its_class`): it becomes an instance of a subclass of its class, with
    the same name, that has a ``__getattr__`` for them and pickles as its class."""
    back_to_its_class(datamodule)
    if left:
        vars(datamodule)[_LEFT] = dict(left)
        cls: Any = type(datamodule)
        datamodule.__class__ = _reading_left(cls)


def back_to_its_class(datamodule: Optional[LightningDataModule]) -> None:
    """Undo :func:`left_on_workers`: before a stage packs ``datamodule`` for the workers."""
    if datamodule is not None and vars(type(datamodule)).get(_LEFT, False):
        vars(datamodule).pop(_LEFT, None)
        datamodule.__class__ = type(datamodule).__mro__[1]


@functools.cache
def _reading_left(cls: Any) -> Any:
    def __getattr__(self: Any, name: str) -> Any:
        why = vars(self).get(_LEFT, {}).get(name)
        if why is None:
            raise AttributeError(f"'{cls.__name__}' object has no attribute '{name}'")
        raise AttributeError(
            f"`{cls.__name__}.{name}` was set by the last stage on the workers (in `setup` or a hook), where"
            f" it stays under strategy='monarch': {why}. Under ddp the script's datamodule is rank 0's and"
            f" holds it. Call `datamodule.setup(stage)` in your script to build it in this process, or read"
            " it in a hook, which runs on the workers."
        )

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # pickled as an instance of its class: a copy of it, without what this subclass adds
        copy = cls.__new__(cls)
        vars(copy).update({name: value for name, value in vars(self).items() if name != _LEFT})
        return copy.__reduce_ex__(protocol)

    namespace = {
        "__getattr__": __getattr__,
        "__reduce_ex__": __reduce_ex__,
        "__slots__": (),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        _LEFT: True,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


def _take(obj: Any, attributes: Attributes, kind: str) -> None:
    """Give ``obj`` rank 0's ``attributes``; an object's own :class:`Attributes` (it held live
    objects on the worker) go to the object ``obj`` holds there, if it holds one."""
    for name, value in attributes.values.items():
        if not isinstance(value, Attributes):
            vars(obj)[name] = value
        elif hasattr(mine := vars(obj).get(name), "__dict__"):
            _take(mine, value, kind)
    if attributes.dropped:
        reasons = "; ".join(f"`{name}` ({why})" for name, why in sorted(attributes.dropped.items()))
        taken, keep_out = (
            ("public attributes", ", or keep them out of the public attributes (a name that starts with `_`)")
            if kind == "module"
            else ("attributes", "")
        )
        rank_zero_warn(
            f"`{type(obj).__name__}`: the workers' {kind} has {taken} that cannot be pickled:"
            f" {reasons}. After the stage, the controller's {kind} takes rank 0's {taken}, as"
            f" the {kind} of a `ddp` script's rank 0 would have them, but not these: it keeps its own. Make"
            f" them picklable{keep_out}."
        )


def take_final_state(
    taken: TakenBack,
    trainer: Trainer,
    module: LightningModule,
    state: CheckpointState,
    ask_rank0: Callable[[str], Any],
) -> None:
    """After an unsharded ``fit``: ``module`` takes rank 0's final weights from ``state`` (and first
    rank 0's submodules, asked of it with ``ask_rank0``, where ``configure_model`` changed the
    module on the workers: compiled, wrapped or grew layers, as DDP's rank 0 has them), and
    ``trainer`` its optimizers and schedulers (:func:`take_optimizers`). ``state.model`` then holds
    the module's own tensors, as a ``ddp`` rank 0's checkpoint after ``fit`` would read them: no
    second copy of the weights for as long as the Trainer lives. The precision plugin takes rank 0's
    state: a gradient scaler's scale."""
    if set(state.model) != set(module.state_dict()):
        for name, child in ask_rank0("module_children").items():
            setattr(module, name, child)
    module.load_state_dict(state.model)
    state.model.update(module.state_dict())
    take_optimizers(taken, trainer, module, state)
    if state.precision:  # a gradient scaler's (``16-mixed`` on GPUs)
        trainer.precision_plugin.load_state_dict(state.precision)


def take_optimizers(taken: TakenBack, trainer: Trainer, module: LightningModule, state: CheckpointState) -> None:
    """Give ``trainer`` rank 0's optimizers and schedulers as a ``fit`` ended them: built from their
    skeleton (``worker.optimizers``) over ``module``'s parameters, which hold rank 0's final values,
    each optimizer's state loaded from the final checkpoint ``state``. Where the skeleton could not
    be pickled, the stand-ins stay, with a warning that says why."""
    if taken.optimizers is None:
        if taken.optimizers_refused is not None:
            rank_zero_warn(
                "After `fit`, the controller's `trainer.optimizers` and `trainer.lr_scheduler_configs` stay"
                " stand-ins that hold rank 0's learning rates but not its optimizers' state: rank 0's could not be"
                f" pickled ({taken.optimizers_refused}). Read the optimizers' state from a checkpoint"
                " (`trainer.save_checkpoint`), or keep what cannot be pickled out of them and of the schedulers."
            )
        return
    optimizers, schedulers = _SkeletonUnpickler(io.BytesIO(taken.optimizers), trainer, module).load()
    for optimizer, optimizer_state in zip(optimizers, state.optimizers, strict=True):
        optimizer.load_state_dict(optimizer_state)
    trainer.strategy.optimizers = optimizers
    for config, scheduler in zip(trainer.lr_scheduler_configs, schedulers, strict=True):
        config.scheduler = scheduler


class _SkeletonUnpickler(pickle.Unpickler):
    """Reads a skeleton with the controller's own parameters, module and Trainer in it, and an
    empty state for each optimizer."""

    def __init__(self, file: io.BytesIO, trainer: Trainer, module: LightningModule) -> None:
        super().__init__(file)
        self._parameters = dict(module.named_parameters(remove_duplicate=False))
        self._trainer, self._module = trainer, module

    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        if kind == SKELETON_PARAMETER:
            return self._parameters[rest[0]]
        if kind == SKELETON_STATE:
            return collections.defaultdict(dict)
        if kind == SKELETON_MODULE:
            return self._module
        if kind == SKELETON_TRAINER:
            return self._trainer
        raise pickle.UnpicklingError(f"unknown persistent ID {pid!r}")
