"""A worker callback's trial inside a stage: Lightning's learning-rate finder.

Runs in each worker, on the loop thread. ``LearningRateFinder.lr_find`` (at ``on_fit_start``, or
where a subclass calls it) trains the live model on trial, restores it from a checkpoint and sets
the learning rate it found, as on each DDP rank. The controller's loop follows none of it: the
trial's gates pass unrecorded (``StageLoop.around``). The trial's last act sets the training data
up again (with its random draws undone), which the ``fit`` then takes as it is, where the
controller's loop sets its own up by calling the hook that gives the loader. So where the
worker's ``fit`` takes its data, it records that hook's gate with the loader the trial's last call
gave: the controller meets the gate where the worker records it, and the hook runs, and the random
generators draw, as often as under DDP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch import Trainer

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.wire.gates import Around
from lightning_monarch.wire.protocol import gate_id

#: The gates of the hook that gives the training data, on the module or on the datamodule.
_TRAIN_LOADER_GATES = (gate_id("module", "train_dataloader"), gate_id("datamodule", "train_dataloader"))


class Trial:
    """Runs in each worker, one per stage: the trial of a worker callback, while it runs and after.
    ``around`` is the stage loop's, which records a gate's entry."""

    def __init__(self, trainer: Trainer, around: Around) -> None:
        self._trainer = trainer
        self._around = around
        #: Whether a trial runs now (or failed: its gates pass on the way out, as a failure's do).
        self.running = False
        #: Whether Lightning's tuner ended the stage after the trial (``Tuner.lr_find``).
        self.tuner_exit = False
        self._loader: Optional[tuple[str, Any]] = None

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, the trial (``LearningRateFinder.lr_find``)."""
        self.running, self._loader = True, None
        try:
            result = fn(*args)
        except lightning_compat.TunerExit:
            self.tuner_exit = True
            raise
        self.running = False
        if self._loader is not None:
            self._record_where_data_is_taken(*self._loader)
        return result

    def through(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A gated hook called during the trial: run it, unrecorded, keeping the training loader it gives."""
        result = fn(*args, **kwargs)
        if gate in _TRAIN_LOADER_GATES:
            self._loader = (gate, result)
        return result

    def _record_where_data_is_taken(self, gate: str, loader: Any) -> None:
        """At the next ``setup_data`` of the ``fit`` loop, once: record ``gate``, giving ``loader``."""
        fit_loop = self._trainer.fit_loop
        setup_data = fit_loop.setup_data

        def recording_setup_data() -> None:
            fit_loop.setup_data = setup_data  # type: ignore[method-assign]
            self._around(gate, lambda *args, **kwargs: loader, (), {})
            setup_data()

        fit_loop.setup_data = recording_setup_data  # type: ignore[method-assign]
