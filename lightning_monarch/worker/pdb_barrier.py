"""The other ranks wait for a rank in pdb before their gradients' collectives, without a time limit.

Runs in each worker process, as the last callback of a stage's Trainer where the controller can
answer pdb (``StageSpec.pdb_barrier``: its stdin is a terminal, or it runs in a Jupyter kernel).
When a rank stops in pdb in its forward or ``training_step``, its peers are already on their way
to the backward's all-reduce, whose wait ends with the process group's timeout (30 min by
default): the session would end the fit there. Here every rank first meets the others at a
barrier in ``on_before_backward``, before any gradient collective starts, and before each
collective of the worker's strategy (:data:`STRATEGY_COLLECTIVES`): a one-element all-reduce on a
gloo group of the stage's own, whose collectives have no time limit. A peer of a rank in pdb
waits there for as long as the session lasts. A rank's :class:`~worker.breakpoints.WorkerPdb`
counts its session on the process group's store (:func:`session_began`, :func:`session_ended`),
and the barrier's wait times out only after the strategy's timeout spent with no session open, as
the collective would. It ends at once where the controller abandons the stage, where a peer's
process dies, and where a rank whose stage failed leaves its process group (gloo's peers see its
connections close).

Where no one can answer pdb (a batch job, CI) a breakpoint quits at once and no stage has the
barrier. Where it has, it costs a one-element all-reduce a step (0.1-0.4 ms measured with two ranks
on this 2-core host). Collectives that do not go through the strategy (``SyncBatchNorm``, FSDP's
gathers, a torchmetrics metric's sync) keep the process group's timeout.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from lightning_monarch._compat import torch as torch_compat

#: How often a barrier's wait checks for pdb sessions and abandonment.
SLICE_S = 0.5
#: The methods of the worker's strategy whose collectives the barrier also precedes: those of
#: ``self.log(..., sync_dist=True)`` and ``self.all_gather``, and Lightning's own barriers.
STRATEGY_COLLECTIVES = ("reduce", "all_gather", "broadcast", "barrier")
#: The barrier group's own timeout: none in practice (gloo takes a ``timedelta``).
_NO_LIMIT = timedelta(days=3650)
#: The barrier of this process's stage in progress, whose store counts its pdb sessions.
_CURRENT: list[PdbBarrier] = []


class PdbBarrier(Callback):
    """Runs in each worker: the barrier before each backward and each of the strategy's
    collectives; pdb sessions count under ``prefix`` (one per stage) of the process group's store.
    ``stop_if_abandoned`` raises where the controller dropped the stage (``worker.loop.StageLoop``)."""

    def __init__(self, prefix: str, timeout: Optional[timedelta], stop_if_abandoned: Callable[[str], None]) -> None:
        self._prefix = prefix
        self._timeout = (timeout or dist.default_pg_timeout).total_seconds()
        self._stop_if_abandoned = stop_if_abandoned
        self._store: Any = None
        self._group: Any = None
        self._flag = torch.zeros(1)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._store = dist.PrefixStore(self._prefix, torch_compat.default_store())
        self._group = dist.new_group(backend="gloo", timeout=_NO_LIMIT)
        _CURRENT[:] = [self]
        for name in STRATEGY_COLLECTIVES:
            vars(trainer.strategy)[name] = self._meeting_first(getattr(trainer.strategy, name))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._leave(trainer)
        if self._group is not None:  # ``None`` would destroy the default group
            dist.destroy_process_group(self._group)
            self._group = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # the group lives on in torch's registry alone until this rank leaves its process group
        # (``worker.process``), which closes its connections: its peers' barrier ends then, as
        # their collective would, after this rank's own error reached the controller
        self._leave(trainer)
        self._group = None

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        self.wait("its gradients' all-reduce")

    def wait(self, before: str) -> None:
        """Until every rank of the group is here, ``before`` the collective it names; raises the
        barrier's own error where a peer left."""
        done = threading.Event()
        met = dist.all_reduce(self._flag, group=self._group, async_op=True).get_future()
        met.add_done_callback(lambda _: done.set())
        waited = 0.0
        while not done.wait(SLICE_S):
            self._stop_if_abandoned(f"the barrier before {before}")
            if self._store.add("sessions", 0) == 0:
                waited += SLICE_S
            if waited >= self._timeout:
                raise TimeoutError(
                    f"Rank {dist.get_rank()} waited {waited:g} s before {before} for ranks that never came,"
                    " the process group's timeout (`MonarchStrategy(timeout=...)`); time in pdb does not count."
                )
        met.wait()

    def count_session(self, change: int) -> None:
        self._store.add("sessions", change)

    def _meeting_first(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        """``collective``, a method of the worker's strategy, after the barrier."""

        @functools.wraps(collective)
        def met_first(*args: Any, **kwargs: Any) -> Any:
            self.wait(f"the strategy's `{collective.__name__}`")
            return collective(*args, **kwargs)

        return met_first

    @staticmethod
    def _leave(trainer: Trainer) -> None:
        _CURRENT.clear()
        for name in STRATEGY_COLLECTIVES:
            vars(trainer.strategy).pop(name, None)


def session_began() -> None:
    """A rank of this process stopped in pdb: its peers' barrier waits count no time until it ends."""
    for barrier in _CURRENT:
        barrier.count_session(1)


def session_ended() -> None:
    """The pdb session of :func:`session_began` ended (``c``, ``q`` or the end of a post-mortem)."""
    for barrier in _CURRENT:
        barrier.count_session(-1)
