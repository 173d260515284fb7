"""The other ranks' ``EarlyStopping`` and ``ModelCheckpoint``, for a monitored metric the ranks hold differently.

Runs on the controller. Under DDP every rank runs its own ``EarlyStopping`` and ``ModelCheckpoint``
on its own value of the monitored metric: a metric logged without ``sync_dist=True`` differs from
rank to rank, so each rank keeps its own best scores, wait count and top k. The run stops when any
rank says so (``reduce_boolean_decision(..., all=False)``), and a checkpoint joins the top k when
every rank says so (``all=True``); rank 0's callback names the files and is the one saved. The
controller's callbacks are rank 0's; this keeps a copy of each for each other rank, evaluated on
that rank's value at each check and updated where rank 0's is, so that each decision combines
every rank's as DDP combines them.

A copy starts as rank 0's callback is when a training run starts (every rank's is alike then: the
same constructor, or the same checkpoint), and goes on from one ``fit`` to the next, as each
rank's does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union
from weakref import WeakKeyDictionary

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.loop.requests import WorkerRequests
from lightning_monarch.wire.gates import install_hook_gates, ungated_copy

Deciding = Union[EarlyStopping, ModelCheckpoint]


class OtherRanks:
    """Runs on the controller, one for the process: each deciding callback's copies for ranks 1 to N-1."""

    def __init__(self) -> None:
        self._copies: WeakKeyDictionary[Deciding, list[Any]] = WeakKeyDictionary()

    def start(
        self, trainer: Trainer, num_workers: int, requests: Callable[[], WorkerRequests]
    ) -> list[Callable[[], None]]:
        """A training run of ``trainer`` starts: copy each ``EarlyStopping`` and monitoring
        ``ModelCheckpoint`` for the other ranks, unless its copies go on from the last ``fit`` (not
        after a checkpoint was restored: every rank loads it). ``requests``: the requests to the
        workers whose entries the loop takes now (a validation mesh's, where one validates). Returns
        what undoes the stage's following of rank 0's top-k updates, step by step."""
        resumed = trainer.ckpt_path is not None
        undo: list[Callable[[], None]] = []
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if not isinstance(callback, EarlyStopping) and not _monitors_top_k(callback):
                continue
            if resumed or len(self._copies.get(callback, ())) != num_workers - 1:
                self._copies[callback] = [self._copy(callback) for _ in range(num_workers - 1)]
            if isinstance(callback, ModelCheckpoint):
                undo.append(install_hook_gates(callback, "top_k", ["_update_best_and_save"], self._follow(requests)))
        return undo

    def follows(self, callback: Any) -> bool:
        """Whether ``callback`` has copies for the other ranks (an ``EarlyStopping`` or a
        monitoring ``ModelCheckpoint`` of a training run)."""
        return callback in self._copies

    def decide(self, callback: Deciding, decision: bool, values: list[Any]) -> bool:
        """Rank 0's ``decision`` and each other rank's, from its value in ``values`` (rank order),
        combined as DDP combines them for that callback."""
        if isinstance(callback, EarlyStopping):
            decide, combine = lightning_compat.stopping_decision, any
        else:
            decide, combine = lightning_compat.top_k_decision, all
        others = [
            decide(rank_callback, value.squeeze())
            for rank_callback, value in zip(self._copies[callback], values[1:], strict=True)
        ]
        return combine([decision, *others])

    @staticmethod
    def _copy(callback: Deciding) -> Any:
        duplicate = ungated_copy(callback)
        if isinstance(callback, ModelCheckpoint):
            lightning_compat.keeps_top_k_only(duplicate)
        return duplicate

    def _follow(self, requests: Callable[[], WorkerRequests]) -> Callable[..., None]:
        """Around rank 0's ``ModelCheckpoint._update_best_and_save``: each other rank's copy takes
        its own value of the metric into its top k, under the name rank 0 gave the checkpoint."""

        def around(gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
            fn(*args, **kwargs)
            callback = fn.__self__  # type: ignore[attr-defined]
            current = callback.current_score
            filepath = next(path for path, score in callback.best_k_models.items() if score is current)
            values = requests().metric_on_every_rank("callback_metrics", callback.monitor)
            for rank_callback, value in zip(self._copies[callback], values[1:], strict=True):
                lightning_compat.top_k_update(rank_callback, current if value is None else value.squeeze(), filepath)

        return around


def _monitors_top_k(callback: Any) -> bool:
    return isinstance(callback, ModelCheckpoint) and callback.monitor is not None


#: The process's copies, which outlive a stage as the callbacks do.
OTHER_RANKS = OtherRanks()
