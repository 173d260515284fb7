"""Asynchronous validation on the workers: the training ranks hand their weights over, and a second
mesh validates them while training goes on (``MonarchStrategy(validation="async")``).

Runs in worker processes, on each stage's loop thread, of two meshes of one ``fit``:

- on each **training** worker, :class:`HandOff` stands in for the fit loop's validation: at each
  validation point (not the sanity check) it gives its validation worker (the one of the same rank)
  the module's weights, the loop's progress, the control state and its random generators, once that
  worker has finished the previous validation, and goes on training. It draws from the global torch
  generator what Lightning's validation loop would have drawn (each validation DataLoader's iterator
  takes its base seed from it), so that training's random numbers stay those of a synchronous run.
  Rank 0 then records :data:`HANDED_OFF_GATE` for the controller, with what it logged since its
  last gate (the training step's row comes before the validation's, as synchronously).
- on each **validation** worker, :class:`ValidationServer` stands in for the fit loop's run: it sets
  up the validation data once, then for each weights handed to it runs Lightning's own validation
  loop in the training rank's place, between rank 0's :data:`VALIDATION_BEGIN_GATE` and
  :data:`VALIDATION_END_GATE` (which carries its metric views), until the controller ends the stage. Its actor's endpoints reach it
  through the stage's loop (``StageLoop.serving``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch._compat.torch import tree_flatten
from lightning_monarch.wire.protocol import (
    HANDED_OFF_GATE,
    VALIDATION_BEGIN_GATE,
    VALIDATION_END_GATE,
    control_state,
    set_control_state,
)
from lightning_monarch.wire.specs import ValidationRequest

#: Records a mark for the controller (rank 0's, like an entry): its gate, its validation point's
#: number and whether it carries the metric views (read on every rank, as a gate's are).
Mark = Callable[[str, int, bool], None]

#: How often a training rank asks whether its validation worker finished the previous validation,
#: where a validation point comes before it did.
IDLE_POLL_S = 0.01

#: The fit loop state's keys of the validation loop's own progress, which a validation worker keeps.
_VAL_LOOP_PREFIX = "epoch_loop.val_loop."


class HandOff:
    """Runs on each training worker's loop thread, as ``trainer.fit_loop.epoch_loop.val_loop.run``."""

    def __init__(self, trainer: Trainer, validator: Any, mark: Mark) -> None:
        """``validator``: the actor of this rank's validation worker."""
        self._trainer = trainer
        self._validator = validator
        self._mark = mark
        self._run = trainer.fit_loop.epoch_loop.val_loop.run  # Lightning's own, for the sanity check
        self._number = 0
        #: The DataLoaders with persistent workers whose first iterator drew its base seed.
        self._persistent: list[DataLoader] = []

    def __call__(self) -> None:
        trainer = self._trainer
        if trainer.sanity_checking:
            return self._run()
        self._number += 1
        request = ValidationRequest(
            self._number,
            {name: _copied(value) for name, value in trainer.lightning_module.state_dict().items()},
            trainer.fit_loop.state_dict(),
            control_state(trainer),
            lightning_compat.rng_states(),
        )
        self._draw_as_validation_does()
        while not self._validator.validation_idle.call_one().get():
            time.sleep(IDLE_POLL_S)
        self._validator.validate.call_one(request).get()
        self._mark(HANDED_OFF_GATE, self._number, False)
        return None

    def _draw_as_validation_does(self) -> None:
        """Draw what Lightning's validation loop draws from the global generators: the base seed of
        each validation DataLoader's new iterator (torch's ``_BaseDataLoaderIter``), which a loader
        with persistent workers makes once."""
        loaders = [
            loader for loader in tree_flatten(self._trainer.val_dataloaders)[0] if isinstance(loader, DataLoader)
        ]
        for loader in loaders:
            persistent = loader.persistent_workers and loader.num_workers > 0
            if persistent and any(loader is seen for seen in self._persistent):
                continue
            if persistent:
                self._persistent.append(loader)
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


class ValidationServer:
    """Runs on each validation worker: its loop thread serves, as ``trainer.fit_loop.run``, the
    weights the endpoint thread takes from the training rank (:meth:`offer`)."""

    def __init__(self, trainer: Trainer, mark: Mark) -> None:
        self._trainer = trainer
        self._mark = mark
        self._cond = threading.Condition()
        self._request: Optional[ValidationRequest] = None
        self._running = False
        self._stopping = False
        #: Whether the loop thread waits for weights (read by the stage's fetch, ``worker.loop``).
        self.waiting = False

    # ----- endpoint thread -------------------------------------------------------------------

    def idle(self) -> bool:
        """Whether it takes new weights: it holds none, and validates none."""
        with self._cond:
            return self._request is None and not self._running

    def offer(self, request: Optional[ValidationRequest]) -> None:
        """Validate ``request`` next (the training rank asked :meth:`idle` first); ``None``: end the
        stage once the validation in progress ends."""
        with self._cond:
            if request is None:
                self._stopping = True
            else:
                self._request = request
            self.waiting = False
            self._cond.notify_all()

    # ----- loop thread -----------------------------------------------------------------------

    def __call__(self) -> None:
        trainer = self._trainer
        trainer.validating = True
        trainer.fit_loop.epoch_loop.val_loop.setup_data()
        trainer.training = True
        while True:
            with self._cond:
                self.waiting = self._request is None
                self._cond.wait_for(lambda: self._request is not None or self._stopping)
                request, self._request = self._request, None
                if request is None:
                    return
                self._running = True
            self._validate(request)

    def _validate(self, request: ValidationRequest) -> None:
        """Validate the training rank's weights in its place: with its loop's progress (but the
        validation loop's own, which runs here only), control state and random generators."""
        trainer = self._trainer
        trainer.lightning_module.load_state_dict(request.weights)
        progress = {key: value for key, value in request.fit_loop_state.items() if not key.startswith(_VAL_LOOP_PREFIX)}
        lightning_compat.carry_fit_progress(trainer, progress)
        set_control_state(trainer, request.control)
        lightning_compat.set_rng_states(request.rng)
        self._mark(VALIDATION_BEGIN_GATE, request.number, False)
        trainer.validating = True
        trainer.fit_loop.epoch_loop.val_loop.run()
        trainer.training = True
        with self._cond:
            self._running = False
            self.waiting = self._request is None and not self._stopping
        self._mark(VALIDATION_END_GATE, request.number, True)


def _copied(value: Any) -> Any:
    """A state dict's value as it travels: a tensor copied to the CPU, as it is at the hand-off."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
