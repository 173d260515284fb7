"""Callbacks that run once, on the controller, with values from the workers: progress bars, model
summaries and Timer; and ``torch.compile`` applied on the workers in ``configure_model``."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar

from tests.models import Classifier
from tests.parity_cases import SEED

pytestmark = pytest.mark.timeout(120)


def _fit(model: L.LightningModule, **kwargs: Any) -> L.Trainer:
    options = dict(strategy="monarch", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                   enable_checkpointing=False)
    trainer = L.Trainer(**{**options, **kwargs})
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize(("bar", "summary"), [(TQDMProgressBar, ModelSummary), (RichProgressBar, RichModelSummary)])
def test_progress_bar_and_summary_show_the_model_once(
    bar: type, summary: type, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    model = Classifier()
    with caplog.at_level("INFO"):
        _fit(model, callbacks=[bar(), summary()], limit_train_batches=3, limit_val_batches=1)
    out, err = capfd.readouterr()
    text = out + err + caplog.text
    total = sum(p.numel() for p in model.parameters())
    assert f"{total}" in text and "Trainable params" in text
    assert text.count("Trainable params") == 1, "the summary is printed once, by the controller"
    assert "train_loss" in text, "the progress bar shows the workers' logged values"


class SlowClassifier(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


def test_max_time_stops_the_workers() -> None:
    trainer = _fit(SlowClassifier(), max_epochs=1000, max_time={"seconds": 3}, enable_progress_bar=False,
                   num_sanity_val_steps=0)
    assert 0 < trainer.global_step < 1000 * 6
    assert trainer.state.status == "finished"


class CompiledClassifier(Classifier):
    def configure_model(self) -> None:
        self.net = torch.compile(self.net, backend="eager")


def test_compile_in_configure_model_runs_on_the_workers() -> None:
    weights = []
    for model_class in (Classifier, CompiledClassifier):
        L.seed_everything(SEED)
        model = model_class()
        _fit(model, enable_progress_bar=False, limit_train_batches=4, limit_val_batches=1)
        weights.append({key.replace("_orig_mod.", ""): value for key, value in model.state_dict().items()})
    assert type(model.net).__name__ == "OptimizedModule", "the controller's module has the workers' structure"
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
