"""The door to the private parts of Lightning's evaluation and prediction loops.

The controller replays these loops in bulk and the workers report where theirs are
(``controller.loop.bulk``, ``worker.entries``): both reach into each loop's combined loader,
data fetcher and batch step. Checked as :mod:`lightning_monarch._compat.lightning` is (its
``PRIVATE_NAMES`` lists the loops' attributes used here too); when Lightning changes one of
these, this file is the one to change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

from lightning.fabric.utilities.data import has_len
from lightning.pytorch import Trainer
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.trainer.states import TrainerFn

__all__ = [
    "batch_loops",
    "batches_in",
    "combined_loader_lengths",
    "fetched_batches",
    "predict_batch_indices",
    "record_eval_epoch_metrics",
    "skip_batches",
    "wrap_batch_step",
]


def _loops_by_stage(trainer: Trainer) -> dict[str, Any]:
    fitting = trainer.state.fn == TrainerFn.FITTING
    return {
        "train": trainer.fit_loop,
        "val": trainer.fit_loop.epoch_loop.val_loop if fitting else trainer.validate_loop,
        "test": trainer.test_loop,
        "predict": trainer.predict_loop,
    }


#: The batch step of each evaluation and prediction loop, by the name of its stage's hooks.
_BATCH_STEPS = {"validation": "_evaluation_step", "test": "_evaluation_step", "predict": "_predict_step"}


def batch_loops(trainer: Trainer) -> dict[str, list[Any]]:
    """The evaluation and prediction loops, by the name of their hooks' stage (``on_<stage>_batch_end``)."""
    return {
        "validation": [trainer.validate_loop, trainer.fit_loop.epoch_loop.val_loop],
        "test": [trainer.test_loop],
        "predict": [trainer.predict_loop],
    }


def wrap_batch_step(
    loop: Any, stage: str, wrap: Callable[[Callable[..., None]], Callable[..., None]]
) -> Callable[[], None]:
    """Replace ``loop``'s per-batch step (``_evaluation_step``, ``_predict_step``: called with
    ``batch, batch_idx, dataloader_idx, dataloader_iter``) with ``wrap(step)``, on this loop only;
    returns the undo."""
    name = _BATCH_STEPS[stage]
    vars(loop)[name] = wrap(getattr(loop, name))
    return functools.partial(vars(loop).pop, name, None)


def batches_in(loop: Any, dataloader_idx: int) -> Optional[int]:
    """How many batches ``loop`` runs of its dataloader ``dataloader_idx`` in this pass (its
    ``max_batches``, Lightning's limits applied), or ``None`` for a dataloader without a length or a
    step that takes ``dataloader_iter``."""
    if isinstance(loop._data_fetcher, _DataLoaderIterDataFetcher):
        return None
    counts = loop.max_batches
    count = counts[dataloader_idx] if isinstance(counts, list) else counts
    return int(count) if count != float("inf") else None


def skip_batches(loop: Any, count: int, dataloader_idx: int, sanity_checking: bool) -> None:
    """Advance ``loop`` over ``count`` batches without running their steps: its data fetcher and its
    progress counters, as Lightning's own step would leave them (the controller took those batches'
    entries in bulk)."""
    fetcher = loop._data_fetcher
    progress = loop.batch_progress
    for _ in range(count):
        next(fetcher)
        progress.is_last_batch = fetcher.done
        progress.increment_ready()
        progress.increment_started()
        progress.increment_processed()
        progress.increment_completed()
        if hasattr(loop, "_seen_batches_per_dataloader") and not sanity_checking:
            loop._has_run = True
            loop._seen_batches_per_dataloader[dataloader_idx] += 1


def combined_loader_lengths(trainer: Trainer) -> dict[str, list[Optional[int]]]:
    """Per stage, the lengths of the dataloaders its loop has set up, in Lightning's flat order."""
    lengths: dict[str, list[Optional[int]]] = {}
    for stage, loop in _loops_by_stage(trainer).items():
        combined = loop._combined_loader
        if combined is not None:
            lengths[stage] = [len(loader) if has_len(loader) else None for loader in combined.flattened]
    return lengths


def fetched_batches(trainer: Trainer) -> dict[str, int]:
    """Per stage, how many batches the loop's data fetcher has taken from its dataloaders so far
    in the current epoch (prefetched ones included)."""
    fetched = {}
    for stage, loop in _loops_by_stage(trainer).items():
        fetcher = loop._data_fetcher
        if fetcher is not None:
            fetched[stage] = fetcher.fetched
    return fetched


def predict_batch_indices(trainer: Trainer, batch_idx: int, dataloader_idx: int) -> list[int]:
    """The dataset indices of the samples in predict batch ``batch_idx`` on this rank.

    Lightning wraps every predict DataLoader's batch sampler to record them; a loader that is not
    a DataLoader has none, and an empty list is returned.
    """
    combined = trainer.predict_loop._combined_loader
    loader = combined.flattened[dataloader_idx] if combined is not None else None
    seen = getattr(getattr(loader, "batch_sampler", None), "seen_batch_indices", None)
    return list(seen[batch_idx]) if seen and batch_idx < len(seen) else []


def record_eval_epoch_metrics(trainer: Trainer, sink: Callable[[dict[str, Any]], None]) -> None:
    """Pass every value ``update_eval_epoch_metrics`` returns on this Trainer to ``sink`` too.

    Those values are what ``trainer.validate``/``test`` return and print; the controller's loop
    asks for them at the same point in its own loop.
    """
    connector = trainer._logger_connector
    original = connector.update_eval_epoch_metrics

    @functools.wraps(original)
    def recorded() -> Any:
        outputs = original()
        sink(dict(outputs))
        return outputs

    # on the instance, as ``connector.update_eval_epoch_metrics = recorded`` would put it
    vars(connector)["update_eval_epoch_metrics"] = recorded
