"""The door to Lightning's private API: every private Lightning name lightning_monarch uses.

Checked against lightning 2.6.6 (:data:`CHECKED_WITH`); ``tests/test_compat.py`` resolves every
name in :data:`PRIVATE_NAMES` and fails, naming the missing ones, when an upgrade removes one.
When Lightning changes one of these, this file is the only one to change.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, Optional

import torch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.connectors import callback_connector
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.trainer.connectors.callback_connector import _load_external_callbacks
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import _TunerExitException
from lightning.pytorch.utilities.types import LRSchedulerTypeTuple

from lightning_monarch.wire.specs import TrainerSubclass

__all__ = [
    "CHECKED_WITH",
    "LR_SCHEDULER_TYPES",
    "Launcher",
    "LoggerConnector",
    "TunerExit",
    "carry_fit_progress",
    "checkpoint_every_n_epochs",
    "checkpoint_schedule",
    "checks_loader_lengths",
    "decision_caller",
    "dump_checkpoint",
    "end_restart",
    "keeps_top_k_only",
    "logger_connector_class",
    "metric_store",
    "manual_step_progress",
    "resolve_ckpt_path",
    "restore_stored_metrics",
    "rng_states",
    "route_accelerator",
    "set_launcher",
    "set_lightning_module",
    "set_precision_plugin",
    "set_rng_states",
    "set_threads_as_launched",
    "stage_of",
    "stepped_this_batch",
    "stored_metrics",
    "top_k_decision",
    "top_k_update",
    "trainer_flags",
    "trainer_subclass",
    "without_external_callbacks",
]

#: The Lightning release this door was last checked against.
CHECKED_WITH = "lightning 2.6.6"
#: The private attributes of a validation loop (in ``fit``, and ``trainer.validate``'s) this module uses.
_VALIDATION_LOOP_NAMES = (
    "_combined_loader",
    "_data_fetcher",
    "_evaluation_step",
    "_has_run",
    "_seen_batches_per_dataloader",
)
#: Every private attribute this module reads or writes, by where it is found, starting from a
#: Trainer (``trainer.fit_loop``, ...) or a ``ModelCheckpoint``: ``tests/test_compat.py`` checks
#: that each one still exists. The private classes and functions imported above fail at import.
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "trainer": (
        "_fit_impl",
        "_validate_impl",
        "_test_impl",
        "_predict_impl",
        "_logger_connector",
        "_checkpoint_connector",
        "_accelerator_connector",
        "_detect_anomaly",
    ),
    "trainer.strategy": ("_launcher", "_lightning_module", "_precision_plugin"),
    "trainer._logger_connector": ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics"),
    "trainer._checkpoint_connector": ("_parse_ckpt_path",),
    "trainer.fit_loop": (
        "_skip_backward",  # in the control state (``protocol.CONTROL_STATE``)
        "_load_from_state_dict",
        "_restarting",
        "_loaded_from_state_dict",
        "_resuming_from_checkpoint",
        "_combined_loader",
        "_data_fetcher",
    ),
    "trainer.fit_loop.epoch_loop.val_loop": _VALIDATION_LOOP_NAMES,
    "trainer.validate_loop": _VALIDATION_LOOP_NAMES,
    "trainer.test_loop": ("_combined_loader", "_data_fetcher", "_evaluation_step"),
    "trainer.predict_loop": ("_combined_loader", "_data_fetcher", "_predict_step"),
    "model_checkpoint": (
        "_save_on_train_epoch_end",
        "_every_n_train_steps",
        "_train_time_interval",
        "_every_n_epochs",
        "_update_best_and_save",
        "_get_metric_interpolated_filepath_name",
        "_save_checkpoint",
        "_should_remove_checkpoint",
        "_remove_checkpoint",
    ),
    "early_stopping": ("_evaluate_stopping_criteria", "_check_on_train_epoch_end"),
    "trainer.fit_loop.epoch_loop": ("_should_accumulate",),
}

LR_SCHEDULER_TYPES = LRSchedulerTypeTuple
#: What Lightning's tuner raises to end a ``fit`` after its trial (``Tuner.lr_find``), and
#: Lightning's ``_call_and_handle_interrupt`` handles as a finished ``fit``.
TunerExit = _TunerExitException
Launcher = _Launcher
LoggerConnector = _LoggerConnector

#: Trainer flags that shape the loop; a worker's Trainer receives the controller's values.
_LOOP_FLAGS = (
    "min_steps",
    "max_steps",
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "overfit_batches",
    "fast_dev_run",
    "val_check_interval",
    "check_val_every_n_epoch",
    "num_sanity_val_steps",
    "log_every_n_steps",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "reload_dataloaders_every_n_epochs",
    "barebones",
    "default_root_dir",
)


def trainer_flags(trainer: Trainer) -> dict[str, Any]:
    """The controller Trainer's loop-shaping flags, as keyword arguments for a worker's Trainer.

    Runs on the controller. Lightning keeps no copy of its constructor's arguments, so they are
    read back from where the constructor stored them.
    """
    flags = {name: getattr(trainer, name) for name in _LOOP_FLAGS}
    algorithm = trainer.gradient_clip_algorithm
    # ``deterministic`` and ``benchmark`` live in torch's process-wide settings, where the
    # constructor put them (``_set_torch_flags``)
    deterministic = torch.are_deterministic_algorithms_enabled()
    flags.update(
        deterministic="warn"
        if deterministic and torch.is_deterministic_algorithms_warn_only_enabled()
        else deterministic,
        benchmark=torch.backends.cudnn.benchmark,
        max_epochs=trainer.fit_loop.max_epochs,
        min_epochs=trainer.fit_loop.min_epochs,
        gradient_clip_algorithm=algorithm.value if algorithm is not None else None,
        inference_mode=trainer.predict_loop.inference_mode,
        use_distributed_sampler=trainer._accelerator_connector.use_distributed_sampler,
        detect_anomaly=trainer._detect_anomaly,
    )
    return flags


@contextlib.contextmanager
def without_external_callbacks() -> Iterator[None]:
    """Build Trainers that load no callbacks from installed packages' entry points (the
    ``lightning.pytorch.callbacks_factory`` group).

    Runs in each worker, around its Trainer's construction. Those callbacks are the controller's:
    its own Trainer loaded them and runs them once. Loading them again reads the metadata of every
    installed distribution, some 10 ms on every stage of a warm worker.
    """
    callback_connector._load_external_callbacks = _no_external_callbacks
    try:
        yield
    finally:
        callback_connector._load_external_callbacks = _load_external_callbacks


def _no_external_callbacks(group: str) -> list[Any]:
    return []


def carry_fit_progress(trainer: Trainer, state: dict[str, Any]) -> None:
    """Give ``trainer``'s fit loop the progress in ``state`` (another fit loop's ``state_dict()``).

    Unlike ``load_state_dict``, this does not mark the loops as restarting: the worker's Trainer
    goes on where the controller's Trainer is, as the same Trainer object would under DDP.
    """

    def carry(loop: _Loop, prefix: str) -> None:
        loop._load_from_state_dict(state.copy(), prefix)
        for name, child in vars(loop).items():
            if isinstance(child, _Loop):
                carry(child, f"{prefix}{name}.")

    carry(trainer.fit_loop, "")


def dump_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """The checkpoint ``trainer.save_checkpoint`` would write, as a dict (runs the
    ``on_save_checkpoint`` hooks, as a save does)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def as_stopped_before_epoch(checkpoint: dict[str, Any]) -> None:
    """Make ``checkpoint``, taken at the start of a training epoch (where its first
    ``on_train_epoch_start`` hook is called), resume as the checkpoint that ``trainer.save_checkpoint``
    writes after a ``fit`` that stopped at the end of the previous epoch.

    Lightning counts an epoch as ready just before those hooks (``_FitLoop.on_advance_start``) and
    resumes a checkpoint of a ready epoch as one restarted in the middle of it, where the previous
    epoch's batches count as this one's, so it would run none. With the epoch not counted, a resumed
    Trainer begins it anew (its sampler epoch, its hooks, its batches), as a stopped run resumed does.
    """
    for counts in checkpoint["loops"]["fit_loop"]["epoch_progress"].values():
        if counts["ready"] != counts["started"] + 1:
            raise RuntimeError(
                f"Expected a checkpoint taken at the start of a training epoch; its epoch counts: {counts}"
            )
        counts["ready"] -= 1


def stepped_this_batch(trainer: Trainer) -> bool:
    """At the end of a training batch (``on_train_batch_end``): whether the optimizers stepped in it,
    which is where a checkpoint resumes with no accumulated gradient lost: every batch without
    accumulation, else the last batch of each accumulation window and of the epoch."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def end_restart(trainer: Trainer) -> None:
    """From here on, let a Trainer resumed from a checkpoint run its fit loops as ordinary loops:
    clear the restart flags that loading the checkpoint set, as the end of an iteration does.
    Called at the start of a training epoch, where the resumed loops have reached what the
    original loops had; ordinary loops then reset the epoch and make its data iterator (which
    draws from the random state) exactly as the original did."""

    def clear(loop: _Loop) -> None:
        loop._restarting = False
        loop._loaded_from_state_dict = False
        loop._resuming_from_checkpoint = False
        loop.reset_restart_stage()
        for child in vars(loop).values():
            if isinstance(child, _Loop):
                clear(child)

    clear(trainer.fit_loop)


def rng_states(include_cuda: bool = True) -> dict[str, Any]:
    """This process's torch, CUDA (unless not ``include_cuda``), numpy and Python random states."""
    return _collect_rng_states(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """Set this process's random states to ``states`` from :func:`rng_states`."""
    _set_rng_states(states)


#: Where the logger connector keeps the values behind ``trainer.callback_metrics`` and the like.
_METRIC_STORES = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")


def stored_metrics(trainer: Trainer) -> dict[str, dict[str, Any]]:
    """Copies of the metric values the Trainer holds between epochs (not in a checkpoint)."""
    return {name: dict(getattr(trainer._logger_connector, name)) for name in _METRIC_STORES}


def restore_stored_metrics(trainer: Trainer, stored: dict[str, dict[str, Any]]) -> None:
    """Put back the values :func:`stored_metrics` copied."""
    for name, values in stored.items():
        store = getattr(trainer._logger_connector, name)
        store.clear()
        store.update(values)


def manual_step_progress(trainer: Trainer) -> Any:
    """The progress counter that ``optimizer.step()`` calls in manual optimization advance; the
    Trainer's ``global_step`` under manual optimization."""
    return trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress


def resolve_ckpt_path(trainer: Trainer, fn: TrainerFn, ckpt_path: Any, model_provided: bool) -> Optional[str]:
    """Turn ``"best"``/``"last"`` into the file the controller's callbacks know, and no ``ckpt_path``
    into the one Lightning takes then (``"best"`` for an evaluation without a model). Runs on the
    controller."""
    path = trainer._checkpoint_connector._parse_ckpt_path(
        fn, ckpt_path, model_provided=model_provided, model_connected=trainer.lightning_module is not None
    )
    return None if path is None else str(path)


#: What torch's GradScaler says when it is built in a process without a GPU.
_SCALER_WITHOUT_CUDA = "torch.cuda.amp.GradScaler is enabled, but CUDA is not available"


def checks_loader_lengths() -> bool:
    """Whether the ``strategy.reduce`` being served (the caller of this function's caller) is Lightning's
    check that a dataloader has batches on some rank (``has_len_all_ranks``), which every worker's
    own Lightning makes too, with a real all-reduce."""
    frame = sys._getframe(2)
    module = frame.f_globals.get("__name__")
    return frame.f_code.co_name == "has_len_all_ranks" and module == "lightning.pytorch.utilities.data"


def decision_caller() -> tuple[Any, str]:
    """The object and the function that called the ``strategy.reduce_boolean_decision`` being
    served (the caller of this function's caller), to tell which of Lightning's callbacks decides what:
    ``ModelCheckpoint.file_exists`` decides on rank 0 alone (the other ranks pass ``False``);
    ``EarlyStopping`` and ``ModelCheckpoint``'s top-k decide from the metric they monitor."""
    frame = sys._getframe(2)
    return frame.f_locals.get("self"), frame.f_code.co_name


#: What Lightning's Trainer sets on itself after its ``__init__`` (the time-based validation clock).
_SET_LATER = frozenset({"_last_val_time", "_train_start_time"})


@functools.cache
def _lightnings_own(cls: type) -> frozenset[str]:
    """The instance attributes that Lightning's ``cls`` (its ``Trainer``) sets on itself."""
    quiet = logging.getLogger(cls.__module__.split(".")[0])
    level, quiet.level = quiet.level, logging.ERROR
    try:
        plain = cls(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    finally:
        quiet.setLevel(level)
    return frozenset(vars(plain)) | _SET_LATER


def trainer_subclass(trainer: Trainer) -> Optional[TrainerSubclass]:
    """``trainer``'s class and the attributes it adds to Lightning's, where it is a subclass of
    Lightning's ``Trainer`` (a library's, e.g. PINA's); ``None`` for Lightning's own."""
    cls = type(trainer)
    if cls is Trainer:
        return None
    own = _lightnings_own(Trainer)
    return TrainerSubclass(cls, {name: value for name, value in vars(trainer).items() if name not in own})


def stopping_decision(callback: Any, current: Any) -> bool:
    """Whether an ``EarlyStopping`` would stop on ``current``, its state updated as its check updates it."""
    return callback._evaluate_stopping_criteria(current)[0]


#: What a top-k check of another rank's ``ModelCheckpoint`` reads of its Trainer: a strategy whose
#: ``reduce_boolean_decision`` keeps the rank's own decision, to be combined with the others' after.
_ONE_RANK = SimpleNamespace(strategy=SingleDeviceStrategy(torch.device("cpu")))


def keeps_top_k_only(callback: Any) -> None:
    """Make ``callback`` (a ``ModelCheckpoint`` of the controller's own, standing for another rank's)
    keep its top-k scores without touching files or printing: ``top_k_update`` names its
    checkpoints, and rank 0's callback writes and removes them, as under DDP."""
    callback.verbose = False
    vars(callback).update(
        _save_checkpoint=_no_file, _remove_checkpoint=_no_file, _should_remove_checkpoint=lambda *args: False
    )


def _no_file(*args: Any) -> None:
    """No file: a ``ModelCheckpoint`` standing for another rank writes and removes none."""


def top_k_decision(callback: Any, current: Any) -> bool:
    """Whether a ``ModelCheckpoint``'s top-k takes ``current`` by its own scores alone (its
    ``check_monitor_top_k``, before the ranks' decisions combine)."""
    return callback.check_monitor_top_k(_ONE_RANK, current)


def top_k_update(callback: Any, current: Any, filepath: str) -> None:
    """Update a ``ModelCheckpoint`` prepared by ``keeps_top_k_only`` with ``current``, as its
    ``_update_best_and_save`` does on its rank, the checkpoint named ``filepath`` (rank 0's name)."""
    callback._get_metric_interpolated_filepath_name = lambda *args: filepath
    callback._update_best_and_save(current, _ONE_RANK, {})


def checkpoint_schedule(callback: Any) -> tuple[int, Any]:
    """A ``ModelCheckpoint``'s ``every_n_train_steps`` and ``train_time_interval``, as it keeps them
    (a count of 0 when it saves at epoch ends instead)."""
    return callback._every_n_train_steps, callback._train_time_interval


def checkpoint_every_n_epochs(callback: Any) -> int:
    """A ``ModelCheckpoint``'s ``every_n_epochs``, as it keeps it (0 when it saves by steps or time)."""
    return callback._every_n_epochs


def at_train_epoch_end(callback: Any) -> Optional[bool]:
    """Whether a ``ModelCheckpoint`` saves (its ``save_on_train_epoch_end``) or an ``EarlyStopping``
    checks (its ``check_on_train_epoch_end``) at a training epoch's end rather than at a
    validation's end, as it keeps it (``None``: Lightning decides when the ``fit`` starts)."""
    if isinstance(callback, EarlyStopping):
        return callback._check_on_train_epoch_end
    return callback._save_on_train_epoch_end


def set_threads_as_launched(processes_per_host: int) -> None:
    """Give this process the intra-op threads that Lightning's launchers give each of
    ``processes_per_host`` ranks (the host's CPUs shared out, unless ``OMP_NUM_THREADS`` is set).

    A worker's ``DDPStrategy`` would set them at its first stage, through its launcher, but
    ``ModelParallelStrategy`` under torchrun's environment has no launcher: without this, a sharded
    stage ran with every CPU's threads in a fresh worker and one in a worker that had run a DDP
    stage, and its arithmetic differed between the two.
    """
    _set_num_threads_if_needed(num_processes=processes_per_host)


def route_accelerator(choose: Callable[[Any, Any], Any]) -> None:
    """Let ``choose(strategy, accelerator)`` replace the ``accelerator`` flag of every new Trainer.

    Runs once, at ``import lightning_monarch``. Lightning resolves ``accelerator="gpu"`` against
    the local machine before a strategy is consulted, and the controller of a Monarch mesh need
    not have a GPU: the workers do. ``choose`` returns the flag unchanged for other strategies.
    """
    original = _AcceleratorConnector.__init__
    if getattr(original, "__lightning_monarch__", False):
        return

    @functools.wraps(original)
    def __init__(self: _AcceleratorConnector, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("accelerator", "auto")
        kwargs["accelerator"] = choose(kwargs.get("strategy", "auto"), given)
        with warnings.catch_warnings():
            if kwargs["accelerator"] is not given:
                # the workers own the GPUs: the "16-mixed" scaler Lightning builds here finds none in this
                # process, and the strategy replaces it with a mirror of the workers' own
                warnings.filterwarnings("ignore", message=_SCALER_WITHOUT_CUDA)
            original(self, *args, **kwargs)

    __init__.__lightning_monarch__ = True  # type: ignore[attr-defined]
    _AcceleratorConnector.__init__ = __init__  # type: ignore[method-assign]


#: The Trainer's private method behind each public stage method: what Lightning hands the launcher.
_STAGE_METHODS = {"_fit_impl": "fit", "_validate_impl": "validate", "_test_impl": "test", "_predict_impl": "predict"}


def stage_of(function: Callable[..., Any]) -> str:
    """The Trainer method (``"fit"``, ...) whose body ``function`` is: Lightning passes the launcher
    the Trainer's private ``_<stage>_impl``."""
    return _STAGE_METHODS[function.__name__]


def metric_store(connector: _LoggerConnector, view: str) -> dict[str, Any]:
    """The dict Lightning keeps behind ``trainer.<view>`` (``callback_metrics``, ...)."""
    return getattr(connector, f"_{view}")


def logger_connector_class(trainer: Trainer, cls: type) -> tuple[_LoggerConnector, Callable[[], None]]:
    """Make ``trainer``'s logger connector an instance of ``cls`` (a subclass of Lightning's);
    return it and the undo."""
    connector = trainer._logger_connector
    original = type(connector)
    connector.__class__ = cls

    def undo() -> None:
        connector.__class__ = original

    return connector, undo


def set_launcher(strategy: Any, launcher: _Launcher) -> None:
    """What a strategy's ``_configure_launcher`` does, as Lightning's own strategies do it."""
    strategy._launcher = launcher


def set_precision_plugin(strategy: Any, plugin: Any) -> None:
    """What Lightning's ``precision_plugin`` setter stores."""
    strategy._precision_plugin = plugin


def set_lightning_module(strategy: Any, module: Any) -> None:
    """Attach ``module`` to ``strategy`` (or detach, with ``None``) without Lightning's setter's
    side effects."""
    strategy._lightning_module = module
