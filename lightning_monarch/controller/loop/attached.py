"""The stage a strategy is attached to, and what the last one left: where the strategy's
checkpoint methods and worker reads find the workers' state.

Runs on the controller. The launcher attaches each stage's session while the stage runs
(``MonarchStrategy._attach``); Lightning's checkpoint code then reads rank 0's model, optimizer
and precision state through the strategy, during the stage from the workers where they wait, after
a training stage the state it ended with. A sharded stage's workers keep its shards after it, so
its session stays reachable for a gather or a checkpoint while the warm mesh keeps them.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from lightning.pytorch import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_monarch.controller.loop.session import StageSession
from lightning_monarch.errors import WorkerError
from lightning_monarch.wire.reports import CheckpointState, RankStats


class AttachedStage:
    """Runs on the controller, one per strategy: the running stage's session, and the last one's."""

    def __init__(self) -> None:
        #: The session of the stage in progress; ``None`` between stages.
        self.session: Optional[StageSession] = None
        #: The session of the last sharded stage that ran, whose workers may still keep its shards.
        self.last_sharded: Optional[StageSession] = None
        self._last_state: Optional[CheckpointState] = None
        #: Rank 0's state as it failed, where the last stage ended with rank 0's exception and its
        #: plan asked for it (``RunAhead.saves_on_exception``).
        self._failed: Optional[CheckpointState] = None
        #: The callbacks the last stage's workers ran.
        self._last_worker_callbacks: list[Callback] = []

    def attach(self, session: Optional[StageSession]) -> None:
        """The session of the stage in progress, or ``None`` after it. The launcher detaches in a
        ``finally``: an exception on its way out then is the one the stage ends with."""
        self._failed = None
        if session is None and self.session is not None:
            self._last_state = self.session.final_state or self._last_state
            self._last_worker_callbacks = self.session.worker_callbacks
            if self.session.sharded:
                self.last_sharded = self.session
            error = sys.exc_info()[1]
            if isinstance(error, WorkerError) and error.rank == 0:
                self._failed = error.failure.checkpoint
        self.session = session

    def checkpoint_state(self) -> Optional[CheckpointState]:
        """Rank 0's checkpoint state: the running stage's, else the one the last stage failed with
        (:attr:`_failed`), else the one the last ``fit`` ended with."""
        if self.session is not None:
            return self.session.checkpoint_state()
        return self._failed or self._last_state

    def weights(self) -> Optional[CheckpointState]:
        """Rank 0's state where the controller's module does not hold its weights: during a stage,
        and after one that failed with rank 0's state; ``None`` where the module holds them."""
        return self.session.checkpoint_state() if self.session is not None else self._failed

    def require_checkpoint_state(self) -> CheckpointState:
        """:meth:`checkpoint_state`, which must be known."""
        state = self.checkpoint_state()
        if state is None:
            raise RuntimeError(
                "The workers' optimizer and precision state is only known during or after `trainer.fit`."
            )
        return state

    def add_worker_callbacks_state(self, checkpoint: dict[str, Any]) -> None:
        """Add rank 0's worker callbacks' state to ``checkpoint``, as DDP's rank 0 would save it.
        After the stage, the workers have dropped it: a worker callback of the last stage that adds
        to checkpoints then raises."""
        worker_callbacks = self.session.worker_callbacks if self.session is not None else self._last_worker_callbacks
        writers = [
            type(callback).__name__
            for callback in worker_callbacks
            if is_overridden("on_save_checkpoint", callback, Callback)
        ]
        if writers and self.session is None:
            raise RuntimeError(
                f"`trainer.save_checkpoint(...)` after the stage under strategy='monarch': the worker callbacks"
                f" {writers} add to every checkpoint in `on_save_checkpoint`, which runs on the workers, and the"
                " workers have dropped the finished stage. Save it while the stage runs, e.g. from a callback's"
                " `on_fit_end` (`trainer.save_checkpoint(path)`), or keep `ModelCheckpoint(save_last=True)`'s"
                " `last.ckpt`."
            )
        state = self.checkpoint_state()
        if state is not None and state.callbacks:
            checkpoint.setdefault("callbacks", {}).update(state.callbacks)

    def sharded_session(self, call: str, owner: str) -> StageSession:
        """The stage whose workers hold the module's shards: the running one, else the last one."""
        session = self.session or self.last_sharded
        if session is None:
            raise RuntimeError(
                f"`{call}` needs the module's shards on the workers under `{owner}`, and no stage has"
                " run with this strategy yet. Call it during or after `trainer.fit(...)`."
            )
        return session

    @property
    def worker_pids(self) -> list[int]:
        """The process IDs of the running stage's workers, in rank order; empty outside a stage."""
        return self.session.requests.worker_pids if self.session is not None else []

    def read_stats(self) -> list[RankStats]:
        """Every worker's stats, in rank order, read where the workers' loops are parked; only during a stage."""
        if self.session is None:
            raise RuntimeError(
                "The workers' stats can only be read while a `fit`, `validate`, `test` or `predict` runs."
            )
        return self.session.requests.read_stats()
