"""finetuning-scheduler (``finetuning_scheduler``, ``lightning.pytorch``): scheduled fine-tuning as its
docs show it, a ``FinetuningScheduler`` with its companion callbacks ``FTSEarlyStopping`` and
``FTSCheckpoint`` in ``Trainer(callbacks=[...])``, on an explicit two-phase schedule: the head
first, then the backbone once the head's early-stopping criterion is met; then
``trainer.test(ckpt_path="best")``.

What it exercises: a ``BaseFinetuning`` subclass that finds its ``EarlyStopping`` and
``ModelCheckpoint`` subclasses through ``trainer.callbacks`` (it refuses to run without them), reads
the early-stopping state to move to the next phase, and restores the best checkpoint file at each
phase transition; after the fit, what its users read on their Trainer: the depth reached (a property
over FTS's private state), the param groups FTS added to the optimizer, at their rates, and where its
schedule file was written; and the rows of a ``LearningRateMonitor`` listed after FTS, which logs the
groups FTS adds at an epoch's start in that epoch's row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from finetuning_scheduler import FinetuningScheduler, FTSCheckpoint, FTSEarlyStopping
from lightning import pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from tests.clients import results

#: The schedule: the head's parameters in phase 0, the backbone's from phase 1 (at its own learning
#: rate, in a param group FTS adds), each phase moving on by epoch 2 at the latest.
SCHEDULE = {
    0: {"params": ["head.weight", "head.bias"], "max_transition_epoch": 2},
    1: {"params": ["backbone.0.weight", "backbone.0.bias"], "max_transition_epoch": 4, "lr": 0.01},
}


class Finetuned(pl.LightningModule):
    """A backbone and a head on seeded features; the schedule unfreezes them in turn."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.05, momentum=0.9)

    def _loader(self, seed: int) -> DataLoader:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 16, generator=generator)
        return DataLoader(TensorDataset(x, (x[:, :4].argmax(-1))), batch_size=8)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(1)

    def test_dataloader(self) -> DataLoader:
        return self._loader(2)


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    pl.seed_everything(0)
    model = Finetuned()
    checkpointing = FTSCheckpoint(dirpath=str(out_dir / "checkpoints"), monitor="val_loss", save_top_k=1)
    scheduler = FinetuningScheduler(ft_schedule=SCHEDULE)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=6,
        logger=CSVLogger(str(out_dir)),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out_dir),
        callbacks=[
            scheduler,
            FTSEarlyStopping(monitor="val_loss", min_delta=0.001, patience=1),
            checkpointing,
            LearningRateMonitor(),
        ],
    )
    trainer.fit(model)
    fitted = results(trainer, model, out_dir)
    # what FTS's users read after the fit: the depth reached, the optimizer's groups as FTS added them,
    # and its schedule file, written in `trainer.log_dir` where its resume path looks for it
    after_fit = {
        "csv": sorted(path.read_text() for path in out_dir.rglob("metrics.csv")),
        "schedule_files": sorted(str(path.relative_to(out_dir)) for path in out_dir.rglob("*_ft_schedule.yaml")),
        "curr_depth": scheduler.curr_depth,
        "param_groups": [
            {"lr": group["lr"], "params": len(group["params"])} for group in trainer.optimizers[0].param_groups
        ],
    }
    tested = trainer.test(model, ckpt_path="best", verbose=False)
    if not trainer.is_global_zero:
        return None
    return {**fitted, **after_fit, "best_model": Path(checkpointing.best_model_path).name, "test": tested}
