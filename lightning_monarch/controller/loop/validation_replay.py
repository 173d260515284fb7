"""The controller's side of asynchronous validation: its ``fit`` loop replays each validation where a
synchronous run validates, from the validation mesh's entries.

Runs on the controller, in a ``fit`` with ``MonarchStrategy(validation="async")``. The training
workers never validate: at each validation point they hand their weights to the validation mesh and
go on (``worker.async_validation``), free of credit (the training stage's ``max_ahead`` is lifted:
what holds them back is the next validation point, where a validation still in progress makes them
wait). The controller's loop follows the training rank 0's entries and so reaches the same point
later. There its fit loop's validation is :class:`ValidationReplay`: it takes the training rank 0's
:data:`HANDED_OFF_GATE`, then runs Lightning's own validation loop following the validation mesh's
rank 0 between that validation's begin and end marks, with the Trainer at the step of the weights
validated. Loggers, the progress bar and ``callback_metrics`` so get what the synchronous run's
validation gave them, at the same step; then the loop follows the training workers again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch.controller.features.async_validation import ValidationMesh
from lightning_monarch.controller.loop.entries import EntryQueue
from lightning_monarch.controller.loop.session import StageSession
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.worker_mesh import Message
from lightning_monarch.controller.mesh.worker_warnings import WorkerWarnings
from lightning_monarch.errors import MeshFailureError, SharedAttributeError, ValidationFailedWarning, WorkerError
from lightning_monarch.wire.protocol import (
    HANDED_OFF_GATE,
    METRIC_VIEWS,
    VALIDATION_BEGIN_GATE,
    VALIDATION_END_GATE,
    Entry,
    Release,
)


class ValidationReplay:
    """Runs on the controller: one ``fit``'s validations, taken from the stage of ``validation``'s
    workers as the ``session``'s loop reaches them."""

    def __init__(
        self, session: StageSession, validation: ValidationMesh, training: StageChannel, warned: WorkerWarnings
    ) -> None:
        """``training``: the training stage's channel, whose workers a replayed decision to stop and
        new validation workers reach."""
        self._session = session
        self._validation = validation
        self._training = training
        #: Whether a replayed validation stopped the ``fit``: the training workers stop next.
        self._stopped = False
        self._warned = warned
        #: The validation points replayed so far; the one being replayed.
        self._number = 0
        self._queue = self._follow()

    def _follow(self) -> EntryQueue:
        """The entries of the validation workers' stage, as the loop takes them."""
        return EntryQueue(self._channel, None, self._warned, lambda: f"in validation {self._number} of the fit")

    @property
    def _channel(self) -> StageChannel:
        channel = self._validation.channel
        assert channel is not None  # the validation workers' stage starts before the training's
        return channel

    @contextmanager
    def installed(self, trainer: Trainer) -> Iterator[None]:
        """The controller's fit loop validates by replaying (not its sanity check, which the
        training workers run as they would synchronously)."""
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        run = val_loop.run

        def replay() -> Any:
            if trainer.sanity_checking:
                return run()
            self._number += 1
            if self._stopped:
                return self._discard(trainer)
            return self._pass_on_stop(trainer, self._replay(trainer, run))

        val_loop.run = replay  # type: ignore[method-assign]
        try:
            with _naming_steps(trainer):
                yield
        finally:
            del val_loop.run

    def _replay(self, trainer: Trainer, run: Callable[[], Any]) -> Entry:
        """Replay the next validation with ``run``, Lightning's own validation loop. The metric
        views are a synchronous run's training rank's: while it runs, the validation mesh's over the
        training rank's at the hand-off; after it, the training rank's over every validation's.
        A validation that fails (a hook raised, a validation worker died) has no results: it is
        reported and the fit goes on (:meth:`_failed`); one that changed a module attribute that
        training changes too ends it (``worker.module_attributes``). Returns the training rank 0's
        hand-off mark."""
        session = self._session
        earlier = session.beneath
        handed = self._handed_off(trainer)
        if handed.result.generation < self._validation.generation:
            self._report(
                trainer, "its validation workers were replaced, after an earlier validation failed, before it ran"
            )
            return handed
        session.beneath = _over(earlier, handed.views)
        training = trainer.lightning_module.training
        try:
            with session.following(self._queue, self._channel):
                self._skip_to_begin()
                session.take_mark(VALIDATION_BEGIN_GATE, self._number)
                run()
                end = session.take_mark(VALIDATION_END_GATE, self._number)
        except (WorkerError, MeshFailureError) as failure:
            if isinstance(failure, WorkerError) and failure.failure.exception_type == SharedAttributeError.__name__:
                raise  # the module would differ from the synchronous run's: not a failed validation
            session.beneath = earlier
            trainer.lightning_module.train(training)
            self._failed(trainer, failure)
        else:
            session.beneath = _over(earlier, end.views)
        return handed

    def _handed_off(self, trainer: Trainer) -> Entry:
        """The training rank 0's mark of the try in which every training rank handed its weights of
        this validation over (``HandedOff``). Each try before it failed: a rank's validation worker
        did not take them (it died, or its stage ended, since the validation before). Those
        validation workers are replaced, unless a failed validation's replay replaced them already,
        and the ranks try again on the new ones: the validation is not lost, and it is reported."""
        while True:
            entry = self._session.take_mark(HANDED_OFF_GATE, self._number)
            if entry.result.taken:
                return entry
            if entry.result.generation == self._validation.generation:
                rank_zero_warn(
                    f"lightning_monarch: a validation worker could not take the weights of the validation at step"
                    f" {trainer.global_step} (epoch {trainer.current_epoch}): it died, or its stage ended, since the"
                    f" validation before it. That validation and the next run on new validation workers.",
                    category=ValidationFailedWarning,
                )
                self._replace()

    def _failed(self, trainer: Trainer, failure: Exception) -> None:
        """The validation of the step the controller's loop is at failed: report it, and let the
        training workers, which wait at their next validation point, hand the next ones to new
        validation workers (a peer of a rank that failed may wait in a collective that never ends)."""
        self._report(trainer, f"{type(failure).__name__}: {failure}")
        self._replace()

    def _report(self, trainer: Trainer, cause: str) -> None:
        """Report that the validation of the step the controller's loop is at has no results, for
        ``cause``: a ``ValidationFailedWarning``, which a warnings filter may turn into the
        ``fit``'s error."""
        rank_zero_warn(
            f"lightning_monarch: the validation at step {trainer.global_step} (epoch {trainer.current_epoch}) failed"
            f" on the validation workers and has no results; training goes on, and the next validations run on new"
            f" validation workers (`warnings.simplefilter('error', lightning_monarch.ValidationFailedWarning)` ends"
            f" the fit instead). {cause}",
            category=ValidationFailedWarning,
        )

    def _replace(self) -> None:
        """Stop the validation workers and give the training workers new ones."""
        validators = self._validation.replace()
        self._queue = self._follow()
        self._training.mesh.deliver(Message("new_validators", (validators,), wait=False))

    def _pass_on_stop(self, trainer: Trainer, handed: Entry) -> None:
        """Where a controller callback stopped the ``fit`` on the replayed validation (an
        ``EarlyStopping``): the training workers, which went on meanwhile, stop at their next batch
        (``worker.async_validation.HandOff``), and the controller's loop follows them there, where
        their entries carry the stop."""
        if not trainer.should_stop or handed.control["should_stop"]:
            return
        if not self._validation.early_stopping:
            raise MisconfigurationException(
                "A callback stopped the fit (`trainer.should_stop`) on a validation with"
                " `MonarchStrategy(validation='async')`, where the training workers passed it already and"
                " only an `EarlyStopping` given to the `Trainer` can stop them. Give the `EarlyStopping` to the"
                " `Trainer(callbacks=...)` (not `configure_callbacks`), or use `validation='sync'`."
            )
        self._training.mesh.deliver(Message("stop_training", (), wait=False))
        trainer.should_stop = False
        self._stopped = True

    def _discard(self, trainer: Trainer) -> None:
        """A validation that the training workers handed off before their stop reached them, which
        the synchronous run never reaches: its entries are taken (the validation mesh released where
        it waits) and its results dropped, so that loggers and callbacks hold the synchronous run's."""
        if self._handed_off(trainer).result.generation < self._validation.generation:
            return  # handed to validation workers replaced since, which never ran it
        try:
            entry = self._pass()
            while (entry.gate, entry.result) != (VALIDATION_END_GATE, self._number):
                entry = self._pass()
        except (WorkerError, MeshFailureError) as failure:
            self._failed(trainer, failure)

    def _skip_to_begin(self) -> None:
        """Pass over the validation mesh's entries before its first validation: the start of its
        ``fit`` (its own ``setup``, ``configure_optimizers``...), which the controller's loop ran
        with the training workers' entries; release it where it waits."""
        while self._queue.first(ending=False).gate != VALIDATION_BEGIN_GATE:
            self._pass()

    def _pass(self, ending: bool = False) -> Entry:
        """Take the validation mesh's next entry without replaying it, releasing its workers where
        they wait after it (``ending``: the end of its stage may come, and is taken too)."""
        entry = self._queue.first(ending=ending)
        self._queue.pop()
        if entry.sync:
            self._channel.release(Release({}, None))
        return entry

    def finish(self) -> None:
        """After the controller's ``fit`` loop ended, having replayed every validation: end the
        validation mesh's stage (it runs the end of its ``fit``) and show the warnings its ranks
        hold. A failure there (a hook of the ``fit``'s end raised on a validation worker, or one
        died) comes after every validation's results: it is reported as a failed validation is,
        and the validation workers are stopped."""
        try:
            self._channel.mesh.deliver(Message("validate", (None,), wait=False))
            while self._pass(ending=True).gate is not None:
                pass
        except (WorkerError, MeshFailureError) as failure:
            rank_zero_warn(
                "lightning_monarch: the validation workers failed as their `fit` ended, after the results of every"
                f" validation were taken; the fit's results are complete. {type(failure).__name__}: {failure}",
                category=ValidationFailedWarning,
            )
            self._validation.stop(failed=True)
            return
        self._channel.close()
        self._warned.show_every_rank(self._channel.mesh.take_warnings())


@contextmanager
def _naming_steps(trainer: Trainer) -> Iterator[None]:
    """The progress bar names each validation's bar after the step whose weights it validates
    ("Validation of step 40"): the controller replays it while the training workers are ahead, its
    bar running as the validation workers' entries come (live, where the validation is in flight).
    Both of Lightning's bars, and any other built on its ``ProgressBar``, read
    ``validation_description`` as each validation's bar starts; the bar's class is so its own
    subclass for the fit, under the same names (a callback's checkpoint state is kept under its
    class's name)."""
    bar = trainer.progress_bar_callback
    if bar is None:
        yield
        return
    kind = type(bar)
    plain = kind.validation_description

    def described(self: Any) -> str:
        return f"{plain.__get__(self, kind)} of step {trainer.global_step}"

    names = {"__qualname__": kind.__qualname__, "__module__": kind.__module__}
    bar.__class__ = type(kind.__name__, (kind,), {**names, "validation_description": property(described)})
    try:
        yield
    finally:
        bar.__class__ = kind


def _over(below: dict[str, dict[str, Any]], above: Optional[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The metric views ``above`` laid over ``below``, view by view."""
    return {view: {**below.get(view, {}), **(above or {}).get(view, {})} for view in METRIC_VIEWS}
