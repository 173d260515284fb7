"""``trainer.predict`` returns every prediction in dataset order, as a single process would."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.parity_cases import SEED, Classifier

pytestmark = pytest.mark.timeout(120)


def _predict(strategy: str, devices: int) -> list[torch.Tensor]:
    L.seed_everything(SEED)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    return trainer.predict(Classifier())


def test_predict_returns_the_whole_dataset_in_order() -> None:
    ours = _predict("monarch", 2)
    single = _predict("auto", 1)
    assert [batch.shape for batch in ours] == [batch.shape for batch in single]
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(ours, single))
    assert sum(len(batch) for batch in ours) == 36
