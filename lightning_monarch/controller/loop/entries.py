"""Rank 0's entries as the controller's loop takes them, and the credit the workers get for it.

Runs on the controller, for a stage's ``StageSession``: entries arrive in bulk (R3) and wait here
until the loop reaches their gates; each training batch the loop takes earns the workers credit to
run further ahead (R4), granted in steps of half ``max_ahead`` so that a grant is not a message per
batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Optional

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.worker_warnings import WorkerWarnings
from lightning_monarch.errors import DivergenceError, WorkerError
from lightning_monarch.wire.protocol import Entry


class EntryQueue:
    """Runs on the controller: one stage's entries fetched and not taken yet, and its credit (R3, R4)."""

    def __init__(
        self, channel: StageChannel, max_ahead: Optional[int], warned: WorkerWarnings, where: Callable[[], str]
    ) -> None:
        self._channel = channel
        self._max_ahead = max_ahead
        self._warned = warned
        #: Where the controller's loop is, for the error of a loop that waits for the workers' wait.
        self._where = where
        self._entries: deque[Entry] = deque()
        self._batch_starts = 0
        self._granted = 0

    def first(self, ending: bool) -> Entry:
        """The next entry, fetched if none is waiting; the end of the stage raises its failure, or
        unless the controller's loop is ``ending`` the stage, Lightning's tuner exit where the
        workers' tuner ended their ``fit`` (``Tuner.lr_find``; ``StageSession.finish`` takes it
        after), and an error elsewhere."""
        idle = 0
        while not self._entries:
            if idle:  # the workers sent nothing: they may wait for credit (R4)
                self.grant()
            fetched = self._channel.fetch()
            idle = 0 if fetched else idle + 1
            if idle > 2:
                raise DivergenceError(
                    f"The workers wait for the controller, which waits for them: a bug in lightning_monarch. ({self._where()})"
                )
            self._entries.extend(fetched)
        entry = self._entries[0]
        if entry.gate is None:
            if entry.failure is not None:
                self._warned.show_rank0(entry.warnings)
                raise WorkerError.of(entry.failure)
            if not ending and entry.tuner_exit:
                raise lightning_compat.TunerExit()
            if not ending:
                raise DivergenceError(
                    "The workers' rank 0 finished the stage where the controller's loop goes on: the two"
                    " Lightning loops diverged."
                )
        return entry

    def pop(self) -> Entry:
        """Take the first entry off the queue (the one :meth:`first` returned)."""
        return self._entries.popleft()

    def took_batch(self) -> None:
        """The controller's loop took a batch's start: grant the workers credit once a step of it is due."""
        self._batch_starts += 1
        if self._batch_starts - self._granted >= (max(1, self._max_ahead // 2) if self._max_ahead else 1 << 30):
            self.grant()

    def grant(self) -> None:
        """Let the workers run ahead by as many batches as the controller's loop has taken (R4)."""
        if self._max_ahead and self._batch_starts > self._granted:
            self._granted = self._batch_starts
            self._channel.grant(self._batch_starts)

    def whole_batch(self, start: str) -> Optional[int]:
        """How many entries the next batch has, if the fetched entries hold all of it and the next
        batch's start, and none of them waits or carries nested results; 0 if one does, or if the
        next entry does not start a batch; ``None`` if the fetched entries end before that is known."""
        if self._entries and self._entries[0].gate != start:
            return 0
        for position, entry in enumerate(self._entries):
            if position and entry.gate == start:
                return position
            if entry.gate is None or entry.sync or entry.nested:
                return 0
        return None

    def fetch_more(self) -> bool:
        """Fetch rank 0's next entries onto the queue, waiting for them; whether any came."""
        fetched = self._channel.fetch()
        self._entries.extend(fetched)
        return bool(fetched)
