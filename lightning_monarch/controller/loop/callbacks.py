"""Where each callback runs under strategy="monarch": placed before any worker starts.

Runs on the controller. The controller's module is a mirror without live parameters, gradients,
batches or devices, so a callback runs where what it touches lives:

- on the workers, on every rank as under DDP, when it reads or changes the live model or batches:
  Lightning's own callbacks that do so by their class (:data:`_NEED_LIVE_MODEL`), any callback that
  overrides a hook that sees live gradients (:data:`GRADIENT_HOOKS`) or whose batch hook reads its
  ``batch`` (:func:`batch_reader`: the controller's loop iterates batch numbers), and those the user
  places there with :func:`on_workers` or ``MonarchStrategy(worker_callbacks=[...])``;
- on the controller, once, when it reads metrics, steers the loop, writes rank-0 files or draws:
  every other callback, and those the user places there with :func:`on_controller`.

The workers' Trainer gets the worker callbacks; the controller's Trainer does without them while
the stage runs (:class:`CallbackPlacement`) and has them back afterwards, in their places.
"""

from __future__ import annotations

import dis
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Optional, TypeVar, Union

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BasePredictionWriter,
    BatchSizeFinder,
    Checkpoint,
    DeviceStatsMonitor,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelCheckpoint,
    ModelPruning,
    OnExceptionCheckpoint,
    ProgressBar,
    SpikeDetection,
    StochasticWeightAveraging,
    ThroughputMonitor,
    WeightAveraging,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_monarch import namespaces
from lightning_monarch.controller.features.stats import MeshStatsMonitor
from lightning_monarch.errors import WorkerError
from lightning_monarch.wire.protocol import CALLBACK_HOOKS

C = TypeVar("C")

#: Callback hooks that see live gradients: Lightning calls them inside backward and the step.
GRADIENT_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")

#: Lightning's callbacks that change or read the live model, device, batches or each rank's
#: outputs, and why; they run on the workers.
_NEED_LIVE_MODEL = {
    BaseFinetuning: "freezes and unfreezes parameters and adds them to the optimizer",
    ModelPruning: "prunes the live parameters",
    WeightAveraging: "averages the live parameters",
    BasePredictionWriter: "writes each rank's predictions with their batch indices, which exist on the workers",
    DeviceStatsMonitor: "reads the stats of the device it runs on",
    ThroughputMonitor: "measures the batches, which only the workers hold",
    SpikeDetection: "watches each rank's own loss and combines the ranks' findings",
    StochasticWeightAveraging: "averages the live parameters and swaps the LR schedulers",
    LearningRateFinder: "trains the live model on trial, restores it and sets the learning rate it found",
}

#: Callbacks that change the loop itself on the workers in a way the controller's loop cannot
#: follow, with what to do instead.
_UNSUPPORTED = {
    BatchSizeFinder: (
        "runs trial fits inside `trainer.fit`",
        "Find the batch size with `BatchSizeFinder` under `Trainer(devices=1)` first, then set it on your datamodule",
    ),
}

#: Callbacks that draw or steer the run once, on the controller, even beside their library's
#: worker callbacks (:class:`CallbackPlacement`).
_DRAWS_OR_STEERS_ONCE = (ProgressBar, GradientAccumulationScheduler, MeshStatsMonitor)
#: Callbacks that must see the whole run once: on the controller only, unless they run beside
#: their library's worker callbacks.
_CONTROLLER_ONLY = (Checkpoint, EarlyStopping, *_DRAWS_OR_STEERS_ONCE)

#: Top-level packages whose callbacks are no library's companions (:class:`CallbackPlacement`).
_NOT_LIBRARIES = frozenset({"lightning", "pytorch_lightning", "lightning_fabric", "lightning_monarch", "__main__"})

#: The attribute :func:`on_workers` and :func:`on_controller` set: ``"workers"`` or ``"controller"``.
_PLACED = "_lightning_monarch_placed"


def on_workers(callback: C) -> C:
    """Run ``callback`` (a ``Callback`` instance or class) on every worker under
    ``strategy="monarch"``, as each DDP rank runs it, wherever it is given: in
    ``Trainer(callbacks=[...])`` or returned by ``configure_callbacks``.

    Runs on the controller. For a callback of your own that touches the live model, batches or
    devices in hooks the rule does not place on the workers by itself (see
    ``docs/migration.md``). What it logs with ``pl_module.log`` reaches the controller's loggers
    once, as rank 0's. Usable as a decorator on the class.
    """
    return _place(callback, "workers", "on_workers")


def on_controller(callback: C) -> C:
    """Run ``callback`` (a ``Callback`` instance or class) once, on the controller, under
    ``strategy="monarch"``, although Lightning's class or a gradient hook would place it on the
    workers: for a callback that only reads metrics, writes files or draws. A hook that sees live
    gradients never runs on the controller, so a callback that overrides one is refused.

    Runs on the controller. Usable as a decorator on the class.
    """
    return _place(callback, "controller", "on_controller")


def _place(callback: C, where: str, name: str) -> C:
    kind = callback_class(callback, name, "places a Lightning `Callback` (an instance or its class)", __name__)
    hook = _gradient_hook(callback)
    if where == "controller" and hook is not None:
        raise MisconfigurationException(
            f"`lightning_monarch.on_controller({kind.__name__})`: it overrides `{hook}`, which Lightning calls"
            " inside backward and the optimizer step, on the workers: on the controller it would never run."
            " Leave it on the workers (drop `on_controller`)."
        )
    if where == "controller" and issubclass(kind, LearningRateFinder):
        raise MisconfigurationException(
            f"`lightning_monarch.on_controller({kind.__name__})`: it {_NEED_LIVE_MODEL[LearningRateFinder]},"
            " which only the workers hold. Leave it on the workers (drop `on_controller`)."
        )
    setattr(callback, _PLACED, where)
    return callback


def callback_class(given: Any, name: str, does: str, home: str) -> type:
    """The ``Callback`` class of ``given`` (an instance or a class), which the public function
    ``lightning_monarch.<name>`` of module ``home`` (a ``__name__``) was given and ``does`` something
    to; a ``TypeError`` naming what to give for anything else, or a callback of the other namespace."""
    namespaces.refuse_other_namespace(name, given, home)
    kind = given if isinstance(given, type) else type(given)
    if not (isinstance(kind, type) and issubclass(kind, Callback)):
        raise TypeError(
            f"`lightning_monarch.{name}({given!r})`: it {does}; give one, e.g. `{name}(MyCallback())` or"
            f" `@{name}` on `class MyCallback(Callback)`."
        )
    return kind


def _library(callback: Callback) -> Optional[str]:
    """The top-level package of ``callback``'s class, unless it is Lightning's, this package's or a script's."""
    package = type(callback).__module__.split(".")[0]
    return None if package in _NOT_LIBRARIES else package


def _gradient_hook(callback: Any) -> Optional[str]:
    return next((hook for hook in GRADIENT_HOOKS if is_overridden(hook, callback, Callback)), None)


#: Lightning's batch hooks, by where their ``batch`` argument is among those after ``self``.
BATCH_HOOKS = {
    f"on_{stage}_batch_{when}": 2 if when == "start" else 3
    for stage in ("train", "validation", "test", "predict")
    for when in ("start", "end")
}


def batch_reader(callback: Any) -> Optional[str]:
    """The first batch hook that ``callback`` overrides and whose code reads its ``batch`` argument
    (by position, whatever its name; a nested function's read counts), or ``None``. The workers
    hold the batches: the controller's loop iterates batch numbers."""
    for hook, position in BATCH_HOOKS.items():
        if not is_overridden(hook, callback, Callback):
            continue
        function = getattr(callback, hook)
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        argument = _argument_at(function, position)
        if code is None or argument is None:
            continue
        if argument in code.co_cellvars or any(
            _loads(instruction, argument) for instruction in dis.get_instructions(code)
        ):
            return hook
    return None


def _argument_at(function: Callable[..., Any], position: int) -> Optional[str]:
    """The name of ``function``'s parameter that takes the positional argument at ``position``
    (``args`` of a ``*args`` before it), or ``None`` where none does."""
    for index, parameter in enumerate(inspect.signature(function).parameters.values()):
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return parameter.name
        if index == position:
            return parameter.name if parameter.kind is not inspect.Parameter.KEYWORD_ONLY else None
    return None


def _loads(instruction: dis.Instruction, name: str) -> bool:
    """Whether ``instruction`` reads the local variable ``name`` (Python 3.13 reads two at once)."""
    if not instruction.opname.startswith("LOAD_"):
        return False
    value = instruction.argval
    return value == name or (isinstance(value, tuple) and name in value)


def runs_on_workers(callback: Callback) -> bool:
    """Whether ``callback``, given to the controller's Trainer, runs on the workers."""
    placed = getattr(callback, _PLACED, None)
    if placed is not None:
        return placed == "workers"
    if isinstance(callback, tuple(_NEED_LIVE_MODEL)) or _gradient_hook(callback) is not None:
        return True
    return not isinstance(callback, _CONTROLLER_ONLY) and batch_reader(callback) is not None


class CallbackPlacement:
    """Runs on the controller, once per stage: the Trainer's callbacks split by where they run.

    ``workers`` are the Trainer's callbacks that run on the workers, in their order, and then
    ``MonarchStrategy(worker_callbacks=[...])``; the rest run on the controller. Each is checked here,
    so that a callback that can run on neither side is refused before any worker starts.

    Companions stay together: a library's callbacks find each other through ``trainer.callbacks``
    (finetuning-scheduler's ``FinetuningScheduler`` refuses to run without its ``FTSEarlyStopping``
    and ``FTSCheckpoint``), so the callbacks of a library that has one on the workers run there
    too, checkpoint and early-stopping subclasses included: those then decide on every rank as
    under DDP, rank 0 writing the files. Progress bars and the accumulation scheduler stay on the
    controller. A library is the top-level package of the callback's class, other than Lightning's,
    this package's and a script's ``__main__``; ``on_controller`` keeps one on the controller.
    """

    def __init__(self, trainer_callbacks: Iterable[Callback], worker_callbacks: Iterable[Callback]) -> None:
        callbacks = list(trainer_callbacks)
        for callback in callbacks:
            _reject_unsupported(callback)
        libraries = {_library(callback) for callback in callbacks if runs_on_workers(callback)} - {None}
        companions = [
            callback
            for callback in callbacks
            if _library(callback) in libraries
            and not runs_on_workers(callback)
            and getattr(callback, _PLACED, None) is None
            and not isinstance(callback, _DRAWS_OR_STEERS_ONCE)
        ]
        placed = [callback for callback in callbacks if runs_on_workers(callback) or callback in companions]
        self.workers: list[Callback] = [*placed, *worker_callbacks]
        #: How many of ``workers`` come before the first callback that stays here, in the Trainer's
        #: order: on the workers they run before the gate callback, so at each hook the controller's
        #: callbacks see what those did there, as under DDP (``LearningRateMonitor`` the param groups
        #: a finetuning callback adds at an epoch's start).
        self.before_gate = next((i for i, callback in enumerate(callbacks) if callback not in placed), len(placed))
        self._here = [callback for callback in callbacks if callback not in placed]
        for callback in callbacks:
            if callback not in self.workers and (hook := batch_reader(callback)) is not None:
                _reject_batch_reader(callback, hook)
        check_worker_callbacks([callback for callback in self.workers if callback not in companions])
        for callback in self._here:
            if isinstance(callback, OnExceptionCheckpoint):
                _writes_where_rank_0_raised(callback)

    def gate_first(self, why: str) -> int:
        """The gate's place on the workers where it must come first (``why``: recovery snapshots,
        which must be rank 0's state before any callback's ``on_train_epoch_start``, as a replacement
        worker runs those hooks again): 0, with a warning where a controller callback then sees the
        changes of a worker callback listed before it one hook late."""
        late = sorted(
            {
                f"`{type(here).__name__}.{hook}` after `{type(there).__name__}`"
                for hook in CALLBACK_HOOKS
                for there in self.workers[: self.before_gate]
                if is_overridden(hook, there, Callback)
                for here in self._here
                if is_overridden(hook, here, Callback)
            }
        )
        if late:
            rank_zero_warn(
                f"With {why}, each hook of the controller's callbacks runs before the same hook of the worker"
                f" callbacks, so {', '.join(late)} sees that callback's changes one hook late, not as under"
                " ddp. List the controller's callbacks first in `Trainer(callbacks=[...])` to have ddp's order."
            )
        return 0

    @property
    def holds_checkpoints(self) -> bool:
        """Whether a checkpoint callback runs on the workers (a library's, beside its companions)."""
        return any(isinstance(callback, Checkpoint) for callback in self.workers)

    def take_back(self, states: dict[str, Any]) -> None:
        """After a ``fit``: give the checkpoint and early-stopping callbacks that ran on the workers
        rank 0's state (``states``, by state key), as a DDP script's own instances hold it, so that
        ``ckpt_path="best"`` and ``best_model_path`` work on the controller. Lightning's own
        ``load_state_dict`` loads it: a subclass's may expect the callbacks it set up on the workers."""
        for callback in self.workers:
            state = states.get(callback.state_key)
            if state is None:
                continue
            if isinstance(callback, ModelCheckpoint):
                callback.dirpath = state.get("dirpath", callback.dirpath)
                ModelCheckpoint.load_state_dict(callback, state)
            elif isinstance(callback, EarlyStopping):
                EarlyStopping.load_state_dict(callback, state)

    @contextmanager
    def applied(self, trainer: Trainer) -> Iterator[None]:
        """The controller's Trainer without the worker callbacks while the stage runs; afterwards
        with them back in their places, beside those Lightning added (``configure_callbacks``)."""
        given = list(trainer.callbacks)  # type: ignore[attr-defined]
        trainer.callbacks = [callback for callback in given if callback not in self.workers]  # type: ignore[attr-defined]
        try:
            yield
        finally:
            now = trainer.callbacks  # type: ignore[attr-defined]
            kept = [callback for callback in given if callback in self.workers or callback in now]
            trainer.callbacks = kept + [callback for callback in now if callback not in given]  # type: ignore[attr-defined]


#: Marks an ``OnExceptionCheckpoint`` that :func:`_writes_where_rank_0_raised` made so.
_RANK_0_ONLY = "_lightning_monarch_rank_0_only"


def _writes_where_rank_0_raised(callback: OnExceptionCheckpoint) -> None:
    """Make ``callback`` (on the controller) write only where rank 0's own code raised, as a ddp
    rank 0 does: its file then holds rank 0's state as it failed (the failure carries it, the
    plan's ``saves_on_exception``). For another rank's exception (rank 0 waits in a collective
    under ddp), a worker's death or an interrupt of this process it writes nothing, and says so."""
    if vars(callback).get(_RANK_0_ONLY):
        return
    own = callback.on_exception

    def on_exception(trainer: Trainer, module: Any, exception: BaseException) -> None:
        if isinstance(exception, WorkerError) and exception.rank == 0 and exception.failure.checkpoint is not None:
            own(trainer, module, exception)
            return
        rank_zero_warn(
            f"`OnExceptionCheckpoint` writes nothing for this `{type(exception).__name__}` under strategy='monarch':"
            " it is no exception of rank 0's code (another rank's, a worker's death, or an interrupt of this"
            " process), and under ddp only a rank 0 whose code raised writes the file. Resume from the last"
            " checkpoint `ModelCheckpoint(save_last=True)` wrote."
        )

    vars(callback).update({"on_exception": on_exception, _RANK_0_ONLY: True})


def set_aside_refused(trainer: Trainer) -> Callable[[], None]:
    """Take the callbacks :class:`CallbackPlacement` refuses out of ``trainer`` until Lightning has
    run its exception hooks for the refusal, with ``OnExceptionCheckpoint`` (no rank ran, and the
    module is not yet attached), and return what puts them back: a refused callback acts on nothing."""
    given = list(trainer.callbacks)  # type: ignore[attr-defined]
    trainer.callbacks = [  # type: ignore[attr-defined]
        callback for callback in given if _refusal(callback) is None and not isinstance(callback, OnExceptionCheckpoint)
    ]

    def put_back() -> None:
        trainer.callbacks = given  # type: ignore[attr-defined]

    return put_back


def check_controller_callbacks(callbacks: Union[Callback, list[Callback], tuple[Callback, ...]]) -> None:
    """Reject callbacks returned by ``configure_callbacks`` (one, or a list) that cannot run on the
    controller, naming where they can run: the module's own callbacks stay on the controller."""
    for callback in callbacks if isinstance(callbacks, (list, tuple)) else (callbacks,):
        _reject_unsupported(callback)
        if runs_on_workers(callback):
            name = type(callback).__name__
            raise MisconfigurationException(
                f"`{name}`, returned by `configure_callbacks`, touches the live model and runs on the workers under"
                f" strategy='monarch', where the module's `configure_callbacks` gives the workers' Trainer none."
                f" Pass it to `Trainer(callbacks=[{name}(...)])` instead."
            )


def check_worker_callbacks(callbacks: Iterable[Callback]) -> None:
    """Reject worker callbacks that must run once, on the controller."""
    for callback in callbacks:
        _reject_unsupported(callback)
        if isinstance(callback, _CONTROLLER_ONLY):
            name = type(callback).__name__
            raise MisconfigurationException(
                f"`{name}` steers the loop or writes files for the whole run, which the controller does once under"
                f" strategy='monarch'; it cannot run on the workers. Pass it to `Trainer(callbacks=[{name}(...)])`"
                " without `lightning_monarch.on_workers` or `MonarchStrategy(worker_callbacks=...)`."
            )


def _reject_batch_reader(callback: Callback, hook: str) -> None:
    """Refuse a callback that stays on the controller (placed there, or one that must see the whole
    run once) and reads the batch in ``hook``, which the controller does not hold."""
    name = type(callback).__name__
    fix = (
        f"Let it run on the workers, as every ddp rank runs it: drop `lightning_monarch.on_controller({name})`."
        if getattr(callback, _PLACED, None) == "controller"
        else "Read what it needs of the step from `outputs` (rank 0's step outputs) or `trainer.callback_metrics`."
    )
    raise MisconfigurationException(
        f"`{name}.{hook}` reads its `batch`, which only the workers hold under strategy='monarch' (the"
        f" controller's loop iterates batch numbers), and `{name}` runs on the controller. {fix}"
    )


def _refusal(callback: Callback) -> Optional[tuple[str, str]]:
    """Why ``callback`` can run neither on the controller nor on the workers, and the fix; or ``None``."""
    return next((refusal for kind, refusal in _UNSUPPORTED.items() if isinstance(callback, kind)), None)


def _reject_unsupported(callback: Callback) -> None:
    refusal = _refusal(callback)
    if refusal is not None:
        reason, fix = refusal
        raise MisconfigurationException(
            f"`{type(callback).__name__}` {reason}, which the controller's loop under strategy='monarch'"
            f" cannot follow. {fix}."
        )
