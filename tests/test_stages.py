"""Stage results on the controller: predictions in dataset order, scalars in the controller's logger."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.models import Classifier
from tests.parity_cases import SEED

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


def test_tensorboard_logger_gets_the_workers_scalars(tmp_path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    trainer = L.Trainer(strategy="monarch", accelerator="cpu", devices=2, max_epochs=2, logger=logger,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Classifier())
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    steps = [event.step for event in events.Scalars("train_loss_step")]
    assert steps == list(range(trainer.global_step))
    assert len(events.Scalars("val_loss")) == 2
    assert events.Scalars("val_loss")[-1].value == pytest.approx(float(trainer.callback_metrics["val_loss"]))
