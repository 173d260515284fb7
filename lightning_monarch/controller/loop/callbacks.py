"""Where each callback may run under strategy="monarch", checked before any worker starts.

Runs on the controller. Callbacks passed to the Trainer run on the controller, once; the
controller's module is a mirror without live parameters or gradients, so a callback that needs
them must run on the workers (``MonarchStrategy(worker_callbacks=[...])``), where each rank runs
it as under DDP. Callbacks that drive the loop or write files stay on the controller.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BasePredictionWriter,
    BatchSizeFinder,
    Checkpoint,
    DeviceStatsMonitor,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelPruning,
    OnExceptionCheckpoint,
    ProgressBar,
    StochasticWeightAveraging,
    ThroughputMonitor,
    WeightAveraging,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_monarch.controller.features.stats import MeshStatsMonitor

#: Callback hooks that see live gradients: Lightning calls them inside backward and the step.
GRADIENT_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")

#: Callbacks that change or read the live model, device or batches, and why; they run on the workers.
_NEED_LIVE_MODEL = {
    BaseFinetuning: "freezes and unfreezes parameters and adds them to the optimizer",
    ModelPruning: "prunes the live parameters",
    WeightAveraging: "averages the live parameters",
    BasePredictionWriter: "writes each rank's predictions with their batch indices, which exist on the workers",
    DeviceStatsMonitor: "reads the stats of the device it runs on",
    ThroughputMonitor: "measures the batches, which only the workers hold,",
}

#: Callbacks that change the loop itself on the workers in a way the controller's loop cannot
#: follow, with what to do instead.
_UNSUPPORTED = {
    BatchSizeFinder: (
        "runs trial fits inside `trainer.fit`",
        "Find the batch size with `BatchSizeFinder` under `Trainer(devices=1)` first, then set it on your datamodule",
    ),
    LearningRateFinder: (
        "runs trial fits inside `trainer.fit`",
        "Find the learning rate with `LearningRateFinder` under `Trainer(devices=1)` first, then set it on your module",
    ),
    OnExceptionCheckpoint: (
        "saves the workers' state after a failure, when a failed worker can no longer give it",
        "Keep `ModelCheckpoint(save_last=True)` to resume from the last good checkpoint",
    ),
    StochasticWeightAveraging: (
        "swaps the LR schedulers on the workers mid-training",
        "Average the weights in your module with `torch.optim.swa_utils.AveragedModel`, or use strategy='ddp'",
    ),
}

#: Callbacks that must see the whole run once: on the controller only.
_CONTROLLER_ONLY = (Checkpoint, EarlyStopping, ProgressBar, GradientAccumulationScheduler, MeshStatsMonitor)


def check_controller_callbacks(callbacks: Iterable[Callback]) -> None:
    """Reject Trainer callbacks that cannot run on the controller, naming where they can run."""
    for callback in callbacks:
        name = type(callback).__name__
        _reject_unsupported(callback)
        reason = next((why for kind, why in _NEED_LIVE_MODEL.items() if isinstance(callback, kind)), None)
        hook = next((hook for hook in GRADIENT_HOOKS if is_overridden(hook, callback, Callback)), None)
        if reason is None and hook is not None:
            reason = f"overrides `{hook}`, which needs live gradients,"
        if reason is not None:
            raise MisconfigurationException(
                f"`{name}` {reason} and cannot run on the controller under strategy='monarch', whose module"
                f" holds no live parameters or gradients. Pass it in `MonarchStrategy(worker_callbacks=[{name}(...)])`"
                " to run it on every worker, as under DDP."
            )


def check_worker_callbacks(callbacks: Iterable[Callback]) -> None:
    """Reject worker callbacks that must run once, on the controller."""
    for callback in callbacks:
        _reject_unsupported(callback)
        if isinstance(callback, _CONTROLLER_ONLY):
            name = type(callback).__name__
            raise MisconfigurationException(
                f"`MonarchStrategy(worker_callbacks=[{name}(...)])`: `{name}` steers the loop or writes files for"
                f" the whole run, which the controller does once. Pass it to `Trainer(callbacks=[{name}(...)])`."
            )


def _reject_unsupported(callback: Callback) -> None:
    for kind, (reason, fix) in _UNSUPPORTED.items():
        if isinstance(callback, kind):
            raise MisconfigurationException(
                f"`{type(callback).__name__}` {reason}, which the controller's loop under strategy='monarch'"
                f" cannot follow. {fix}."
            )
