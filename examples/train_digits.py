"""Train a classifier on scikit-learn's handwritten digits with ``strategy="monarch"``.

The script is the controller: it runs Lightning's loop, the progress bar, the checkpoint callback
and the logger once. Two Monarch workers (one per CPU "device") train the model with DDP.

    python examples/train_digits.py [--devices 2] [--max-epochs 10]
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

import lightning_monarch  # noqa: F401 - registers strategy="monarch"


class DigitsDataModule(L.LightningDataModule):
    """The 1,797 8x8 digit images that ship with scikit-learn, split 1,197 / 300 / 300."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        digits = load_digits()
        features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target)
        dataset = TensorDataset(features, labels)
        self.train_set, self.val_set, self.test_set = random_split(
            dataset, [1197, 300, 300], generator=torch.Generator().manual_seed(0)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)


class DigitsClassifier(L.LightningModule):
    """A two-layer MLP with torchmetrics accuracy."""

    def __init__(self, hidden: int = 128, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 10))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=10)
    args = parser.parse_args()

    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        callbacks=[ModelCheckpoint(monitor="val_acc", mode="max")],
    )
    datamodule = DigitsDataModule()
    trainer.fit(DigitsClassifier(), datamodule=datamodule)
    results = trainer.test(datamodule=datamodule, ckpt_path="best")
    print(f"Test accuracy of the best checkpoint: {results[0]['test_acc']:.3f}")


if __name__ == "__main__":
    main()
