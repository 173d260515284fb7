"""The strategy's collectives, called by the controller's Lightning code, run on the workers.

Runs on the controller, for ``MonarchStrategy.reduce``, ``all_gather`` and
``reduce_boolean_decision``. The controller holds one copy of each value, rank 0's; a collective
on a metric the workers sent runs on every worker with its own value of that metric, where the
workers wait (R5), and anything else raises, naming what to do instead.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_monarch.controller.loop.other_ranks import OTHER_RANKS
from lightning_monarch.controller.loop.session import StageSession


def on_workers(
    session: Optional[StageSession], kind: str, tensor: Any, group: Optional[Any], options: dict[str, Any], call: str
) -> Any:
    """Run the collective ``kind`` on the workers, each on its own counterpart of ``tensor``; rank
    0's result."""
    origin = session.metric_origins.origin(tensor) if session is not None else None
    if origin is None or group is not None:
        what = "a process group of the controller's" if group is not None else "this tensor"
        raise RuntimeError(
            f"`trainer.strategy.{call}` on the controller under strategy='monarch': the controller holds one"
            f" copy of each value, rank 0's, and {what} is not one the workers know, so no worker can take"
            " part with its own counterpart of it. Pass a value of `trainer.callback_metrics`,"
            " `trainer.progress_bar_metrics` or `trainer.logged_metrics` as it is (each worker then uses"
            " its own value of that metric), log the value from the LightningModule with"
            " `self.log(name, value, sync_dist=True)` and read it from `trainer.callback_metrics`, or run"
            " the code on the workers, e.g. as a callback given as `lightning_monarch.on_workers(MyCallback())`."
        )
    view, key = origin
    assert session is not None  # ``origin`` is found only through a session
    return session.requests.collective(kind, view, key, options)


def boolean_decision(session: Optional[StageSession], decision: bool, caller: Any, function: str) -> bool:
    """What Lightning's callbacks decide on every DDP rank, combined; ``caller`` is the object whose
    method ``function`` asked (``_compat.lightning.decision_caller``). ``ModelCheckpoint`` checks
    for a file on rank 0 alone, so its decision is the controller's. ``EarlyStopping`` and
    ``ModelCheckpoint``'s top-k decide on each rank from its value of the metric they monitor, and
    the decisions combine as DDP combines them (``controller.loop.other_ranks``). Any other
    caller's decision is every rank's when it monitors a metric every worker holds the same value
    of, and otherwise cannot be known for the other ranks, and raises."""
    if function == "file_exists" or session is None:
        return decision
    monitor = getattr(caller, "monitor", None)
    if not isinstance(monitor, str):
        raise RuntimeError(
            f"`trainer.strategy.reduce_boolean_decision(...)` called from `{type(caller).__name__}.{function}` on"
            " the controller under strategy='monarch': the controller runs that code once, as rank 0, and"
            " cannot know what the other ranks would decide under `ddp`. Decide from values every rank shares"
            " (metrics logged with `sync_dist=True`) and use the decision as it is, or run the code on the"
            " workers, e.g. as a callback given as `lightning_monarch.on_workers(MyCallback())`."
        )
    values = session.requests.metric_on_every_rank("callback_metrics", monitor)
    if OTHER_RANKS.follows(caller):
        return OTHER_RANKS.decide(caller, decision, values)
    if any(not _same(value, values[0]) for value in values):
        held = ", ".join(f"rank {rank}: {_shown(value)}" for rank, value in enumerate(values))
        raise RuntimeError(
            f"`{type(caller).__name__}(monitor={monitor!r})` decides on the controller from rank 0's"
            f" `{monitor}`, and under `ddp` every rank decides from its own; but the workers hold different"
            f" values of it ({held}), so rank 0's decision alone could differ from `ddp`'s. Log it with"
            " `sync_dist=True` in the module's `self.log(...)` call, so that every rank holds the same value,"
            " or run the callback on the workers, e.g. given as `lightning_monarch.on_workers(MyCallback())`."
        )
    return decision


def _same(value: Any, other: Any) -> bool:
    if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
        return value.shape == other.shape and torch.equal(value, other)
    return value is None and other is None


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"{value.item():g}"
    return "none" if value is None else str(value)
