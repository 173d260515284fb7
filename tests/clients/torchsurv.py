"""TorchSurv (``torchsurv``, ``lightning.pytorch``): a deep Cox proportional-hazards model, as
TorchSurv's momentum notebook trains one with Lightning: a ``LightningModule`` whose loss is
``Momentum`` (an online network trained on a memory bank of log hazards that a target network,
its exponential moving average, fills) around the Cox negative partial log-likelihood, the
concordance index of the target network on the validation set, and ``ModelCheckpoint`` on it.
The survival times are drawn from an exponential model of the covariates, some censored.

What it exercises: a loss module with a network that takes no gradient (the target, updated in
place from the online one at each step) and Python deques of past estimates; a metric object that
is not a torchmetrics ``Metric``; boolean event indicators in the batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from lightning import pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchsurv.loss.cox import neg_partial_log_likelihood
from torchsurv.loss.momentum import Momentum
from torchsurv.metrics.cindex import ConcordanceIndex

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from tests.clients import quiet_trainer, results

BATCH = 8


def _survival_data(size: int, generator: torch.Generator) -> TensorDataset:
    """Covariates, event indicators and times: hazards from a fixed linear model, 30% censored."""
    x = torch.randn(size, 6, generator=generator)
    hazard = torch.exp(x @ torch.linspace(-1.0, 1.0, 6))
    time = torch.empty(size).exponential_(generator=generator) / hazard
    event = torch.rand(size, generator=generator) > 0.3
    return TensorDataset(x, event, time)


class LitSurvival(pl.LightningModule):
    """The notebook's module: ``Momentum`` around the Cox loss, the C-index on validation."""

    def __init__(self) -> None:
        super().__init__()
        backbone = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        self.model = Momentum(backbone, loss=neg_partial_log_likelihood, batchsize=BATCH, steps=4)
        self.cindex = ConcordanceIndex()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, event, time = batch
        loss = self.model(x, event, time)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, event, time = batch
        log_hz = self.model.infer(x)
        self.log("val_loss", neg_partial_log_likelihood(log_hz, event, time), sync_dist=True)
        self.log("val_cindex", self.cindex(log_hz, event, time), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.model.online.parameters(), lr=0.01)


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    pl.seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    train_set, val_set = _survival_data(96, generator), _survival_data(32, generator)
    model = LitSurvival()
    checkpointing = ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), monitor="val_cindex", mode="max")
    trainer = pl.Trainer(
        **quiet_trainer(strategy, out_dir), max_epochs=3, log_every_n_steps=2, callbacks=[checkpointing]
    )
    trainer.fit(
        model,
        DataLoader(train_set, batch_size=BATCH, shuffle=True),
        DataLoader(val_set, batch_size=BATCH),
    )
    return results(trainer, model, out_dir, best_model=Path(checkpointing.best_model_path).name)
