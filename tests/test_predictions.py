"""The controller puts every rank's predictions back into dataset order, re-batched at the loader's
batch size, whatever the structure of ``predict_step``'s output; outputs that are not one row per
sample come back per batch, with a warning.

Runs in this process: ``PredictionCollector`` is the controller's, fed the shards two ranks of a
strided ``DistributedSampler`` send (``tests/test_stages.py`` runs the real thing against one process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_monarch.controller.loop.predictions import PredictionCollector
from lightning_monarch.wire.reports import PredictionShard


def _shards(output_of: Callable[[torch.Tensor], Any]) -> list[PredictionShard]:
    """10 samples on 2 ranks in batches of 2 (rank 0: 0, 2 | 4, 6 | 8; rank 1: 1, 3 | 5, 7 | 9),
    the batches in the order the controller's loop takes them."""
    batches = [[0, 2], [1, 3], [4, 6], [5, 7], [8], [9]]
    return [PredictionShard(output_of(torch.tensor(indices)), indices, 0) for indices in batches]


def test_structured_outputs_come_back_in_dataset_order_in_loader_sized_batches() -> None:
    collector = PredictionCollector()
    collector.add(_shards(lambda rows: {"score": rows.float() / 10, "pair": (rows, rows.unsqueeze(1) * 2)}))
    batches = collector.in_dataset_order(1, [4])
    assert [len(batch["score"]) for batch in batches] == [4, 4, 2]
    rows = torch.cat([batch["pair"][0] for batch in batches])
    assert torch.equal(rows, torch.arange(10))
    assert torch.equal(torch.cat([batch["score"] for batch in batches]), torch.arange(10).float() / 10)
    assert torch.equal(torch.cat([batch["pair"][1] for batch in batches]), torch.arange(10).unsqueeze(1) * 2)
    # each batch owns its rows: saving one does not save the whole prediction set
    assert all(batch["score"].untyped_storage().nbytes() == batch["score"].nbytes for batch in batches)


@pytest.mark.parametrize(
    "output_of",
    [lambda rows: rows.tolist(), lambda rows: rows[:1], lambda rows: {"a": rows} if rows[0] < 4 else {"b": rows}],
    ids=["not-tensors", "not-a-row-per-sample", "structure-changes"],
)
def test_other_outputs_come_back_per_batch_ordered_by_first_sample_with_a_warning(
    output_of: Callable[[torch.Tensor], Any],
) -> None:
    collector = PredictionCollector()
    shards = _shards(output_of)
    collector.add(shards)
    with pytest.warns(UserWarning, match="not re-batched"):
        batches = collector.in_dataset_order(1, [2])
    by_first_sample = sorted(shards, key=lambda shard: shard.batch_indices[0])
    assert [str(batch) for batch in batches] == [str(shard.output) for shard in by_first_sample]
