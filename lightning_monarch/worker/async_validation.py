"""Asynchronous validation on the workers: the training ranks hand their weights over, and a second
mesh validates them while training goes on (``MonarchStrategy(validation="async")``).

Runs in worker processes, on each stage's loop thread, of two meshes of one ``fit``:

- on each **training** worker, :class:`HandOff` stands in for the fit loop's validation: at each
  validation point (not the sanity check) it gives its validation worker (the one of the same rank)
  its checkpoint state (the weights, the optimizers' and schedulers' state), the loop's progress,
  the control state, its random generators and the module's plain attributes that training changed
  (``worker.module_attributes``), once that worker has finished the previous validation, and goes
  on training. Every rank hands its weights to validation workers of the same generation, or none
  does: the ranks agree that each took them, on a gloo group of the stage's own, and where one could
  not (it died, or its stage ended), they wait for the controller's new validation workers
  (:meth:`HandOff.replace`) and hand them over again to those. It draws from the global torch generator what Lightning's
  validation loop would have drawn (each validation DataLoader's iterator takes its base seed from
  it), so that training's random numbers stay those of a synchronous run. Rank 0 then records
  :data:`HANDED_OFF_GATE` for the controller, with what it logged since its last gate (the training
  step's row comes before the validation's, as synchronously) and its metric views. Where the
  controller runs ``EarlyStopping``, which decides on a validation when the controller replays it,
  the controller's request to stop (:meth:`HandOff.stop`) takes effect at the first training batch
  that starts after it reached any rank: at each batch start the ranks agree on it in a one-element
  all-reduce, on that group.
- on each **validation** worker, :class:`ValidationServer` stands in for the fit loop's run: it sets
  up the validation data once, then for each weights handed to it runs Lightning's own validation
  loop in the training rank's place, between rank 0's :data:`VALIDATION_BEGIN_GATE` and
  :data:`VALIDATION_END_GATE` (which carries its metric views), until the controller ends the stage.
  The training rank's checkpoint state stands for its own meanwhile (``RankState.validated``): a
  checkpoint written where the validation ends holds the validated step's optimizer state.

The actor's endpoints reach either through the stage's loop (``StageLoop.validation``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch._compat.torch import tree_flatten
from lightning_monarch.wire.protocol import (
    HANDED_OFF_GATE,
    VALIDATION_BEGIN_GATE,
    VALIDATION_END_GATE,
    control_state,
    set_control_state,
)
from lightning_monarch.wire.specs import HandedOff, ValidationRequest, Validators
from lightning_monarch.worker.module_attributes import Key, PlainAttributes
from lightning_monarch.worker.state import RankState

log = logging.getLogger(__name__)

#: Records a mark for the controller (rank 0's, like an entry): its gate, its result (the validation
#: point's number, or a ``HandedOff``) and whether it carries the metric views (read on every rank,
#: as a gate's are).
Mark = Callable[[str, Any, bool], None]

#: How often a training rank asks whether its validation worker finished the previous validation,
#: where a validation point comes before it did.
IDLE_POLL_S = 0.01

#: How often a training rank waiting for its validation worker's answer looks for newer ones.
_ANSWER_POLL_S = 0.25

#: How long a validation worker has to answer whether it is idle (a lock's read) before its training
#: rank takes it as gone: a call to a dead actor from a process other than the one that started it
#: may never end, and Monarch reports the death to the controller alone.
IDLE_ANSWER_S = 10.0

#: The fit loop state's keys of the validation loop's own progress, which a validation worker keeps.
_VAL_LOOP_PREFIX = "epoch_loop.val_loop."


class _Unanswered(Exception):
    """This rank's validation worker did not answer: its actor failed (its process died), or the
    controller replaced it while the rank waited (a call to a killed actor may not end)."""


class HandOff(Callback):
    """Runs on each training worker's loop thread, as ``trainer.fit_loop.epoch_loop.val_loop.run``,
    and as a callback: it reads the module's plain attributes as the ``fit`` starts, and where the
    controller runs ``EarlyStopping``, takes its decision at a batch start."""

    def __init__(self, trainer: Trainer, state: RankState, validators: Validators, mark: Mark) -> None:
        """``validators``: the validation workers (this rank's is ``actors[rank]``), and whether the
        controller runs an ``EarlyStopping``, whose decision the ranks take at a batch start."""
        self._trainer = trainer
        self._early_stopping = validators.early_stopping
        #: The module's plain attributes, and as they were at the ``fit``'s start (``on_fit_start``).
        self._attributes: Optional[PlainAttributes] = None
        self._at_start: dict[Key, bytes] = {}
        self._state = state
        #: The validation workers this rank hands to; the newest the controller gave (:meth:`replace`).
        self._validators = validators
        self._newest = validators
        self._replaced = threading.Condition()
        self._awaiting = False
        self._mark = mark
        #: Set by the endpoint thread when the controller's ``EarlyStopping`` decided to stop.
        self._stop = threading.Event()
        self._group: Any = None
        self._run = trainer.fit_loop.epoch_loop.val_loop.run  # Lightning's own, for the sanity check
        self._number = 0
        #: The DataLoaders with persistent workers whose first iterator drew its base seed.
        self._persistent: list[DataLoader] = []

    def __call__(self) -> None:
        trainer = self._trainer
        if trainer.sanity_checking:
            return self._run()
        self._number += 1
        assert self._attributes is not None  # read at ``on_fit_start``, before any validation point
        request = ValidationRequest(
            number=self._number,
            state=self._state.checkpoint_state(copy=True),
            fit_loop_state=trainer.fit_loop.state_dict(),
            restarting=trainer.fit_loop.epoch_loop.val_loop.restarting,
            control=control_state(trainer),
            rng=lightning_compat.rng_states(),
            attributes=self._attributes.changed_since(self._at_start),
        )
        self._draw_as_validation_does()
        while True:
            generation = self._validators.generation
            taken = self._agreed(self._handed(request))
            self._mark(HANDED_OFF_GATE, HandedOff(self._number, generation, taken), taken)
            if taken:
                return None
            self._validators = self._newer_than(generation)

    def _newer_than(self, generation: int) -> Validators:
        """The validation workers that replace those of ``generation``, once the controller gave them."""
        with self._replaced:
            self._awaiting = True
            self._replaced.wait_for(lambda: self._newest.generation > generation)
            self._awaiting = False
            return self._newest

    @property
    def awaiting_validators(self) -> bool:
        """Whether the loop thread waits for the controller's new validation workers, in a batch
        that does not end until they come: the controller needs rank 0's entries so far at once, its
        mark of the failed try among them (read by the stage's fetch, ``worker.loop``). Not a wait
        for the controller's loop: the controller sends them as it takes that mark, or has already."""
        with self._replaced:
            return self._awaiting

    def _handed(self, request: ValidationRequest) -> bool:
        """Hand ``request`` to this rank's validation worker once it finished the validation before;
        ``False`` where it cannot: a validation failed (its server ended, or the process died), and
        the controller replaces the validation workers when it replays that validation or takes
        this try's mark. A worker that died as it took the request (its answer lost) may have
        taken it: the ranks' agreement makes that try fail on every rank."""
        validator = self._validators.actors[self._trainer.global_rank]
        try:
            while not self._answer(validator.validation_idle.call_one(), IDLE_ANSWER_S):
                time.sleep(IDLE_POLL_S)
            self._answer(validator.validate.call_one(request))
        except _Unanswered as error:
            log.debug("Rank %d could not hand its validation over: %s", self._trainer.global_rank, error)
            return False
        return True

    def _answer(self, future: Any, limit: Optional[float] = None) -> Any:
        """The validation worker's answer; :class:`_Unanswered` where its actor failed (died), the
        controller replaced it first (a call to a killed actor may not end), or it did not answer
        within ``limit`` seconds. An error in sending the call (a state that cannot be pickled) is
        raised as it is."""
        started = time.monotonic()
        while True:
            try:
                return future.get(timeout=_ANSWER_POLL_S)
            except TimeoutError:
                if self._newest.generation > self._validators.generation:
                    raise _Unanswered("the controller replaced the validation worker") from None
                if limit is not None and time.monotonic() - started > limit:
                    raise _Unanswered(f"no answer within {limit:g} s: its process is gone") from None
            except Exception as error:  # the actor's failure, as Monarch reports it
                raise _Unanswered(f"{type(error).__name__}: {error}") from error

    def _agreed(self, handed: bool) -> bool:
        """Whether every training rank ``handed`` its weights over: where one could not, the
        others' validation workers would wait for its in their collectives, so every rank hands
        them again, to the same new validation workers."""
        taken = torch.tensor([float(handed)])
        dist.all_reduce(taken, op=dist.ReduceOp.MIN, group=self._group)
        return bool(taken.item())

    def replace(self, validators: Validators) -> None:
        """Runs on the endpoint thread: the controller replaced the validation workers."""
        with self._replaced:
            if validators.generation > self._newest.generation:
                self._newest = validators
            self._replaced.notify_all()

    def stop(self) -> None:
        """Runs on the endpoint thread: the controller's ``EarlyStopping`` decided to stop."""
        self._stop.set()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._group = dist.new_group(backend="gloo")

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The module's plain attributes once its ``setup`` and ``configure_*`` hooks ran, as they
        ran on the validation workers too: what training changes after is what they lack."""
        self._attributes = PlainAttributes(pl_module)
        self._at_start = self._attributes.read()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._group is not None:
            dist.destroy_process_group(self._group)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Stop after this batch where the controller's request to stop reached any rank."""
        if not self._early_stopping:
            return
        stop = torch.tensor([float(self._stop.is_set())])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=self._group)
        if stop.item():
            trainer.should_stop = True

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

    def __init__(self, trainer: Trainer, state: RankState, mark: Mark) -> None:
        self._trainer = trainer
        self._state = state
        self._mark = mark
        #: The module's plain attributes, once the ``fit`` attached it.
        self._attributes: Optional[PlainAttributes] = None
        self._cond = threading.Condition()
        self._request: Optional[ValidationRequest] = None
        self._running = False
        self._stopping = False
        self._ended = False

    # ----- endpoint thread -------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """Whether the loop thread waits for weights, which only a training rank sends: its entries
        so far are all the controller gets until then (read by the stage's fetch, ``worker.loop``)."""
        with self._cond:
            return self._request is None and not self._running and not self._stopping and not self._ended

    def idle(self) -> bool:
        """Whether it takes new weights: it holds none, validates none, and serves (its stage has
        not ended, by the controller's request or a failed validation)."""
        with self._cond:
            return self._request is None and not self._running and not self._ended

    def offer(self, request: Optional[ValidationRequest]) -> None:
        """Validate ``request`` next (the training rank asked :meth:`idle` first); ``None``: end the
        stage once the validation in progress ends."""
        with self._cond:
            if request is None:
                self._stopping = True
            else:
                self._request = request
            self._cond.notify_all()

    # ----- loop thread -----------------------------------------------------------------------

    def __call__(self) -> None:
        trainer = self._trainer
        self._attributes = PlainAttributes(trainer.lightning_module)
        trainer.validating = True
        trainer.fit_loop.epoch_loop.val_loop.setup_data()
        trainer.training = True
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._request is not None or self._stopping)
                    request, self._request = self._request, None
                    if request is None:
                        return
                    self._running = True
                self._validate(request)
        finally:
            with self._cond:
                self._ended = True

    def _validate(self, request: ValidationRequest) -> None:
        """Validate the training rank's weights in its place: with its checkpoint state, loop's
        progress, control state and random generators. The validation loop's progress is its own,
        since it runs here only, but where the rank's resumes from a checkpoint: then the rank's
        (as its resume left it, and Lightning's training loop after it)."""
        trainer = self._trainer
        trainer.lightning_module.load_state_dict(request.state.model)
        self._state.validated = request.state
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        progress = request.fit_loop_state
        if not request.restarting:
            progress = {key: value for key, value in progress.items() if not key.startswith(_VAL_LOOP_PREFIX)}
        lightning_compat.carry_fit_progress(trainer, progress)
        val_loop.restarting = request.restarting
        set_control_state(trainer, request.control)
        lightning_compat.set_rng_states(request.rng)
        assert self._attributes is not None  # made as the server started
        before = self._attributes.take(request.attributes)
        self._mark(VALIDATION_BEGIN_GATE, request.number, False)
        trainer.validating = True
        val_loop.run()
        trainer.training = True
        self._attributes.check_unshared(before, request.attributes)
        with self._cond:
            self._running = False
        self._mark(VALIDATION_END_GATE, request.number, True)
