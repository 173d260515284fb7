"""The controller's bulk path for evaluation and prediction (``controller.loop.bulk``), on loops of
40 batches a rank: it runs (counted from its own log), and its results equal ``ddp``'s bit for bit:
the logged rows and metrics of values logged per batch, the predictions, and what the progress bar
draws at ``refresh_rate=1`` and ``refresh_rate=20``. A callback whose batch hook is set on the
instance turns it off, and a batch whose gates differ from the batch before is refused."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_monarch import DivergenceError
from tests import bulk_evaluation
from tests.bulk_evaluation import BATCHES_PER_RANK, REFRESH_RATES, BulkEvaluated, evaluation_trainer
from tests.references import run_reference

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], torch.Tensor]:
    out = tmp_path_factory.mktemp("ddp")
    run_reference("tests.bulk_evaluation", out, processes=2)
    ranks = [torch.load(out / f"predictions{rank}.pt") for rank in range(2)]
    in_dataset_order = torch.stack(ranks, dim=1).reshape(-1, ranks[0].shape[-1])  # a strided sampler's shards
    return torch.load(out / "results.pt", weights_only=False), in_dataset_order


@pytest.fixture(scope="module")
def monarch(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], torch.Tensor, list[int]]:
    out = tmp_path_factory.mktemp("monarch")
    bulk: list[int] = []
    handler = _BulkCounter(bulk)
    logger = logging.getLogger("lightning_monarch.controller.loop.bulk")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        results = bulk_evaluation.run("monarch", out)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert results is not None
    return results, torch.load(out / "predictions0.pt"), bulk


class _BulkCounter(logging.Handler):
    """The batches each bulk took, from the replay's debug line."""

    def __init__(self, counts: list[int]) -> None:
        super().__init__(logging.DEBUG)
        self.counts = counts

    def emit(self, record: logging.LogRecord) -> None:
        first, last = map(int, re.search(r"batches (\d+) to (\d+) taken in bulk", record.getMessage()).groups())
        self.counts.append(last - first + 1)


def test_most_batches_are_taken_in_bulk(monarch: tuple[dict[str, Any], torch.Tensor, list[int]]) -> None:
    """4 validations and 2 tests at 40 batches, a predict (the counted validation runs each batch's hooks)."""
    bulk = monarch[2]
    loops = 2 * len(REFRESH_RATES) + 1
    assert sum(bulk) >= loops * BATCHES_PER_RANK * 3 // 4, bulk


def test_logged_rows_metrics_and_predictions_equal_ddps(
    ddp: tuple[dict[str, Any], torch.Tensor], monarch: tuple[dict[str, Any], torch.Tensor, list[int]]
) -> None:
    expected, got = ddp[0], monarch[0]
    for refresh_rate in REFRESH_RATES:
        name = f"refresh{refresh_rate}"
        for key in ("validate", "validate_metrics", "test", "test_metrics"):
            assert got[name][key] == expected[name][key], (name, key)
    assert got["csv"] == expected["csv"]
    assert torch.equal(monarch[1], ddp[1])


@pytest.mark.parametrize("refresh_rate", REFRESH_RATES)
def test_the_progress_bar_draws_what_ddps_draws(
    refresh_rate: int,
    ddp: tuple[dict[str, Any], torch.Tensor],
    monarch: tuple[dict[str, Any], torch.Tensor, list[int]],
) -> None:
    name = f"refresh{refresh_rate}"
    drawn = [n for stage, n in monarch[0][name]["draws"] if stage == "validation"]
    assert 0 < len(drawn) and drawn[-1] == BATCHES_PER_RANK
    assert monarch[0][name]["draws"] == ddp[0][name]["draws"]


def test_a_batch_hook_set_on_a_callback_instance_runs_for_every_batch(
    ddp: tuple[dict[str, Any], torch.Tensor], monarch: tuple[dict[str, Any], torch.Tensor, list[int]]
) -> None:
    """The count a controller callback logs at the epoch's end is in ``validate``'s result and in
    the same logged row as the module's epoch metrics, as under ``ddp``."""
    assert ddp[0]["counted"][0]["batches_counted"] == BATCHES_PER_RANK
    assert monarch[0]["counted"] == ddp[0]["counted"]
    assert monarch[0]["csv"]["counted"] == ddp[0]["csv"]["counted"]
    assert "batches_counted" in ddp[0]["csv"]["counted"].splitlines()[0]


class ChangesItsGates(BulkEvaluated):
    """From batch 4 to 29, rank 0's ``on_validation_batch_end`` is a plain function set on the
    instance instead of its gate: those batches record one gate fewer than the batches before."""

    def on_validation_batch_end(self, *args: Any) -> None:
        pass

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 0 and batch_idx == 4:
            self.gated = vars(self)["on_validation_batch_end"]
            self.on_validation_batch_end = lambda *args: None
        if self.global_rank == 0 and batch_idx == 30:
            self.on_validation_batch_end = self.gated
        super().validation_step(batch, batch_idx)


def test_a_batch_with_other_gates_than_the_batch_before_is_a_divergence(tmp_path: Path) -> None:
    trainer = evaluation_trainer("monarch", tmp_path, "diverged", [])
    with pytest.raises(DivergenceError, match=r"reached `module.on_validation_batch_end` but the workers' rank 0"):
        trainer.validate(ChangesItsGates(), verbose=False)
