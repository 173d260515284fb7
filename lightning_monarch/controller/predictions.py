"""Puts every rank's ``predict_step`` outputs back into dataset order.

Runs on the controller. Under DDP each rank predicts a strided shard of the dataset; a single
process predicts it in order. The workers report the dataset indices of each batch, so the
controller can return what a single process would: batches of the loader's batch size, in order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_monarch._compat.torch import tree_flatten, tree_unflatten
from lightning_monarch.protocol import PredictionShard


class PredictionCollector:
    """Runs on the controller: every rank's predictions of one ``trainer.predict`` call."""

    def __init__(self) -> None:
        self._shards: dict[int, list[PredictionShard]] = defaultdict(list)

    def add(self, shards: list[PredictionShard]) -> None:
        """One batch step's outputs, one shard per rank."""
        for shard in shards:
            self._shards[shard.dataloader_idx].append(shard)

    def in_dataset_order(self, num_dataloaders: int, batch_sizes: list[Optional[int]]) -> list[Any]:
        """The predictions as ``trainer.predict`` returns them for ``num_dataloaders`` loaders."""
        per_loader = [self._ordered(self._shards[index], batch_sizes[index]) for index in range(num_dataloaders)]
        return per_loader[0] if num_dataloaders == 1 else per_loader

    def _ordered(self, shards: list[PredictionShard], batch_size: Optional[int]) -> list[Any]:
        samples = _split_samples(shards)
        if samples is None or not batch_size:
            rank_zero_warn(
                "`trainer.predict` under strategy='monarch' returns each rank's batches ordered by their first"
                " sample, not re-batched: the `predict_step` outputs are not tensors with one row per sample,"
                " or the predict dataloader has no `batch_size`."
            )
            shards = sorted(shards, key=lambda shard: shard.batch_indices[0] if shard.batch_indices else 0)
            return [shard.output for shard in shards]
        samples.sort(key=lambda sample: sample[0])
        return [_stack(samples[start : start + batch_size]) for start in range(0, len(samples), batch_size)]


def _split_samples(shards: list[PredictionShard]) -> Optional[list[tuple[int, list[torch.Tensor], Any]]]:
    samples = []
    for shard in shards:
        leaves, spec = tree_flatten(shard.output)
        count = len(shard.batch_indices)
        if not count or not all(
            isinstance(leaf, torch.Tensor) and leaf.dim() and len(leaf) == count for leaf in leaves
        ):
            return None
        for row, index in enumerate(shard.batch_indices):
            samples.append((index, [leaf[row : row + 1] for leaf in leaves], spec))
    return samples


def _stack(samples: list[tuple[int, list[torch.Tensor], Any]]) -> Any:
    columns = zip(*(leaves for _, leaves, _ in samples), strict=True)
    return tree_unflatten([torch.cat(column) for column in columns], samples[0][2])
