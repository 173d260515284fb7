"""Puts every rank's ``predict_step`` outputs back into dataset order.

Runs on the controller. Under DDP each rank predicts a strided shard of the dataset; a single
process predicts it in order. The workers report the dataset indices of each batch, so the
controller can return what a single process would: batches of the loader's batch size, in order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_monarch._compat.torch import tree_flatten, tree_unflatten
from lightning_monarch.wire.reports import PredictionShard


class PredictionCollector:
    """Runs on the controller: every rank's predictions of one ``trainer.predict`` call."""

    def __init__(self) -> None:
        self._shards: dict[int, list[PredictionShard]] = defaultdict(list)

    def add(self, shards: list[PredictionShard]) -> None:
        """One batch step's outputs, one shard per rank."""
        for shard in shards:
            self._shards[shard.dataloader_idx].append(shard)

    def as_predicted_by(self, trainer: Trainer) -> list[Any]:
        """The predictions as ``trainer.predict`` returns them, for its predict dataloaders."""
        loaders = tree_flatten(trainer.predict_dataloaders)[0]
        batch_sizes = [getattr(loader, "batch_size", None) for loader in loaders]
        return self.in_dataset_order(len(trainer.num_predict_batches), batch_sizes)

    def in_dataset_order(self, num_dataloaders: int, batch_sizes: list[Optional[int]]) -> list[Any]:
        """The predictions as ``trainer.predict`` returns them for ``num_dataloaders`` loaders."""
        per_loader = [self._ordered(self._shards[index], batch_sizes[index]) for index in range(num_dataloaders)]
        return per_loader[0] if num_dataloaders == 1 else per_loader

    def _ordered(self, shards: list[PredictionShard], batch_size: Optional[int]) -> list[Any]:
        columns = _columns_in_dataset_order(shards)
        if columns is None or not batch_size:
            rank_zero_warn(
                "`trainer.predict` under strategy='monarch' returns each rank's batches ordered by their first"
                " sample, not re-batched: the `predict_step` outputs are not tensors with one row per sample,"
                " or the predict dataloader has no `batch_size`."
            )
            shards = sorted(shards, key=lambda shard: shard.batch_indices[0] if shard.batch_indices else 0)
            return [shard.output for shard in shards]
        leaves, order, spec = columns
        return [
            tree_unflatten([leaf[order[start : start + batch_size]] for leaf in leaves], spec)
            for start in range(0, len(order), batch_size)
        ]


def _columns_in_dataset_order(
    shards: list[PredictionShard],
) -> Optional[tuple[list[torch.Tensor], torch.Tensor, Any]]:
    """Each leaf of the outputs' common structure with every shard's rows in one tensor, the rows'
    dataset order (a stable sort by dataset index: each batch is then one gather per leaf, into a
    tensor of its own; a loop over samples cost the medium benchmark model's ``predict`` tens of
    ms), and the structure; ``None`` if the shards' outputs are not tensors with one row per sample
    in one structure."""
    flattened = [tree_flatten(shard.output) for shard in shards]
    if not flattened:
        return None
    spec = flattened[0][1]
    for (leaves, leaf_spec), shard in zip(flattened, shards, strict=True):
        count = len(shard.batch_indices)
        if (
            leaf_spec != spec
            or not count
            or not all(isinstance(leaf, torch.Tensor) and leaf.dim() and len(leaf) == count for leaf in leaves)
        ):
            return None
    order = torch.argsort(torch.tensor([index for shard in shards for index in shard.batch_indices]), stable=True)
    columns = zip(*(leaves for leaves, _ in flattened), strict=True)
    return [torch.cat(column) for column in columns], order, spec
