"""The other ranks' ``EarlyStopping``, for a monitored metric the ranks hold differently.

Runs on the controller. Under DDP every rank runs its own ``EarlyStopping`` on its own value of the
monitored metric: a metric logged without ``sync_dist=True`` differs from rank to rank, so each
rank keeps its own best score and wait count, and the run stops when any rank says so
(``reduce_boolean_decision(..., all=False)``). The controller's callback is rank 0's; this keeps a
copy of it for each other rank, evaluated on that rank's value at each check, so that the
decision combines every rank's as DDP combines them. A copy starts as rank 0's callback is when a
training run starts (every rank's is alike then: the same constructor, or the same checkpoint),
and goes on from one ``fit`` to the next, as each rank's does.
"""

from __future__ import annotations

import copy
from typing import Any
from weakref import WeakKeyDictionary

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping

from lightning_monarch._compat import lightning as lightning_compat


class OtherRanksStopping:
    """Runs on the controller, one for the process: each ``EarlyStopping``'s copies for ranks 1 to N-1."""

    def __init__(self) -> None:
        self._copies: WeakKeyDictionary[EarlyStopping, list[EarlyStopping]] = WeakKeyDictionary()

    def start(self, trainer: Trainer, num_workers: int) -> None:
        """A training run of ``trainer`` starts: copy each ``EarlyStopping`` for the other ranks, unless
        its copies go on from the last ``fit`` (not after a checkpoint was restored: every rank loads it)."""
        resumed = trainer.ckpt_path is not None
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, EarlyStopping) and (
                resumed or len(self._copies.get(callback, ())) != num_workers - 1
            ):
                self._copies[callback] = [copy.deepcopy(callback) for _ in range(num_workers - 1)]

    def decide(self, callback: EarlyStopping, decision: bool, values: list[Any]) -> bool:
        """Rank 0's ``decision`` and each other rank's, from its value in ``values`` (rank order)."""
        others = [
            lightning_compat.stopping_decision(rank_callback, value.squeeze())
            for rank_callback, value in zip(self._copies[callback], values[1:], strict=True)
        ]
        return decision or any(others)


#: The process's copies, which outlive a stage as the callbacks do.
OTHER_RANKS = OtherRanksStopping()
