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
from typing import Any

from lightning.pytorch import Trainer

from lightning_monarch.controller.loop.entries import EntryQueue
from lightning_monarch.controller.loop.session import StageSession
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.worker_mesh import Message
from lightning_monarch.controller.mesh.worker_warnings import WorkerWarnings
from lightning_monarch.wire.protocol import HANDED_OFF_GATE, VALIDATION_BEGIN_GATE, VALIDATION_END_GATE, Release


class ValidationReplay:
    """Runs on the controller: one ``fit``'s validations, taken from the validation mesh's stage on
    ``channel`` as the ``session``'s loop reaches them."""

    def __init__(self, session: StageSession, channel: StageChannel, warned: WorkerWarnings) -> None:
        self._session = session
        self._channel = channel
        self._warned = warned
        #: The validation points replayed so far; the one being replayed.
        self._number = 0
        self._queue = EntryQueue(channel, None, warned, lambda: f"in validation {self._number} of the fit")

    @contextmanager
    def installed(self, trainer: Trainer) -> Iterator[None]:
        """The controller's fit loop validates by replaying (not its sanity check, which the
        training workers run as they would synchronously)."""
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        run = val_loop.run

        def replay() -> Any:
            if trainer.sanity_checking:
                return run()
            return self._replay(run)

        val_loop.run = replay  # type: ignore[method-assign]
        try:
            yield
        finally:
            del val_loop.run

    def _replay(self, run: Callable[[], Any]) -> None:
        self._number += 1
        session = self._session
        session.take_mark(HANDED_OFF_GATE, self._number)
        with session.following(self._queue, self._channel):
            self._skip_to_begin()
            session.take_mark(VALIDATION_BEGIN_GATE, self._number)
            run()
            end = session.take_mark(VALIDATION_END_GATE, self._number)
        session.validated = end.views or {}

    def _skip_to_begin(self) -> None:
        """Pass over the validation mesh's entries before its first validation: the start of its
        ``fit`` (its own ``setup``, ``configure_optimizers``...), which the controller's loop ran
        with the training workers' entries; release it where it waits."""
        while self._queue.first(ending=False).gate != VALIDATION_BEGIN_GATE:
            if self._queue.pop().sync:
                self._channel.release(Release({}, None))

    def finish(self) -> None:
        """After the controller's ``fit`` loop ended, having replayed every validation: end the
        validation mesh's stage (it runs the end of its ``fit``), raising its failure; show the
        warnings its ranks hold."""
        self._channel.mesh.deliver(Message("validate", (None,), wait=False))
        while self._queue.first(ending=True).gate is not None:
            if self._queue.pop().sync:
                self._channel.release(Release({}, None))
        self._channel.close()
        self._warned.show_every_rank(self._channel.mesh.take_warnings())
