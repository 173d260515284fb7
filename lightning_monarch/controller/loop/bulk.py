"""Evaluation and prediction batches taken on the controller in bulk.

Runs on the controller. Its Lightning loop follows the workers' entries one gate at a time (R3);
for a batch of an evaluation or prediction loop that is Lightning's whole per-batch machinery (the
data fetcher, the batch transfer hooks, every callback's batch hooks, the logger connector) for
entries that only say the batch ran. Where no controller callback needs the batch hooks of that
loop (Lightning's progress bars advance by counts), batches are taken together: after Lightning's
own step of one, the session takes the entries of the whole batches that follow, fetching them as
needed (:meth:`StageSession.take_batches`), the loop's data fetcher and progress counters advance
over them as its steps would have left them, and each progress bar is told each of them ended, so
that it draws where it would have. The last batch of each dataloader, a batch with a sync gate,
nested results or other gates than the batch before, and a step that takes ``dataloader_iter`` run
Lightning's step. Each bulk is logged at DEBUG (``tests/test_bulk_evaluation.py`` counts them).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, Optional, Protocol

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_monarch._compat import loops as loops_compat
from lightning_monarch.wire.gates import GateCallback

log = logging.getLogger(__name__)

#: The progress bars whose batch hooks only show how many batches ran.
_COUNTING_BARS = (TQDMProgressBar, RichProgressBar)


class BatchTaker(Protocol):
    """What taking batches in bulk needs of the stage session."""

    def take_batches(self, stage: str, limit: int) -> int: ...


def take_in_bulk(trainer: Trainer, session: BatchTaker) -> Callable[[], None]:
    """Let ``trainer``'s evaluation and prediction loops take whole batches in bulk where no
    controller callback needs their batch hooks; returns the undo."""
    undo = [
        loops_compat.wrap_batch_step(loop, stage, _bulk(trainer, session, loop, stage))
        for stage, loops in loops_compat.batch_loops(trainer).items()
        for loop in loops
    ]

    def uninstall() -> None:
        for step in undo:
            step()

    return uninstall


def _bulk(trainer: Trainer, session: BatchTaker, loop: Any, stage: str) -> Callable[..., Any]:
    def wrap(step: Callable[..., None]) -> Callable[..., None]:
        def bulk_step(batch: Any, batch_idx: int, dataloader_idx: int, dataloader_iter: Any) -> None:
            step(batch, batch_idx, dataloader_idx, dataloader_iter)
            bars = _counting_bars(trainer.callbacks, stage)  # type: ignore[attr-defined]
            batches = loops_compat.batches_in(loop, dataloader_idx)
            if bars is None or batches is None:
                return
            taken = session.take_batches(stage, batches - batch_idx - 2)  # not the dataloader's last
            if not taken:
                return
            loops_compat.skip_batches(loop, taken, dataloader_idx, trainer.sanity_checking)
            log.debug("%s batches %d to %d taken in bulk", stage, batch_idx + 1, batch_idx + taken)
            for index in range(batch_idx + 1, batch_idx + taken + 1):  # each bar draws where it would
                for bar in bars:
                    getattr(bar, f"on_{stage}_batch_end")(
                        trainer, trainer.lightning_module, None, None, index, dataloader_idx
                    )

        return bulk_step

    return wrap


def _counting_bars(callbacks: list[Callback], stage: str) -> Optional[list[Callback]]:
    """The progress bars to tell where a bulk of ``stage`` batches ends; ``None`` if a controller
    callback needs the batch hooks of ``stage`` (it overrides one, on its class or on the instance,
    and is not a progress bar that only counts)."""
    hooks = (f"on_{stage}_batch_start", f"on_{stage}_batch_end")
    bars = []
    for callback in callbacks:
        if isinstance(callback, GateCallback):
            continue
        runs = {hook: _function(getattr(callback, hook)) for hook in hooks}
        if all(runs[hook] is getattr(Callback, hook) for hook in hooks):
            continue
        counting = next((bar for bar in _COUNTING_BARS if isinstance(callback, bar)), None)
        if counting is None or any(runs[hook] is not getattr(counting, hook) for hook in hooks):
            return None
        bars.append(callback)
    return bars


def _function(hook: Callable[..., Any]) -> Any:
    """The function a callback's hook runs, under the gate the session may have wrapped it in
    (``gates.install_hook_gates``): its class's, or one set on the instance."""
    unwrapped = inspect.unwrap(hook)
    return getattr(unwrapped, "__func__", unwrapped)
