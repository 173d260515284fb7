"""Train a small CNN on generated images of shapes, with a LightningDataModule and torchmetrics.

The script is the controller: it runs Lightning's loop, the progress bar, ModelCheckpoint and
EarlyStopping once. Each Monarch worker generates the same 16x16 images of squares, discs,
triangles and crosses (seeded, so no download), trains on its DistributedSampler shard, and
updates the torchmetrics Accuracy and F1 objects, which sync across the workers when Lightning
computes them at the end of each epoch.

    python examples/image_classifier.py [--devices 2] [--max-epochs 8]
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

import lightning_monarch  # noqa: F401 - registers strategy="monarch"

SHAPES = ("square", "disc", "triangle", "cross")


def draw_shapes(count: int, size: int, seed: int) -> TensorDataset:
    """``count`` noisy ``size``x``size`` images, each one shape of random position and scale."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(SHAPES), (count,), generator=generator)
    radius = torch.randint(3, size // 3 + 1, (count, 1, 1), generator=generator).float()
    room = (size - 1 - 2 * radius).unsqueeze(1)  # how far the shape can move and stay whole
    center = radius.unsqueeze(1) + torch.rand(count, 2, 1, 1, generator=generator) * room
    rows, cols = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    dy, dx = (rows - center[:, 0]).abs(), (cols - center[:, 1]).abs()
    masks = torch.stack(  # one mask per shape, in SHAPES order
        [
            (dx <= radius) & (dy <= radius),
            dx**2 + dy**2 <= radius**2,
            (rows - center[:, 0] + radius >= 2 * dx) & (dy <= radius),
            ((dx <= radius / 3) & (dy <= radius)) | ((dy <= radius / 3) & (dx <= radius)),
        ]
    )
    images = masks[labels, torch.arange(count)].float()
    images += 0.3 * torch.randn(images.shape, generator=generator)
    return TensorDataset(images.unsqueeze(1), labels)


class ShapesDataModule(L.LightningDataModule):
    """Generated shapes: the same images on every worker (a fixed seed per split)."""

    def __init__(self, train_size: int = 3000, val_size: int = 500, batch_size: int = 64, image_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        size = self.hparams.image_size
        self.train_set = draw_shapes(self.hparams.train_size, size, seed=0)
        self.val_set = draw_shapes(self.hparams.val_size, size, seed=1)
        self.test_set = draw_shapes(self.hparams.val_size, size, seed=2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)


class ShapesCNN(L.LightningModule):
    """Two convolution blocks and a linear classifier, with a torchmetrics collection per stage."""

    def __init__(self, image_size: int = 16, channels: int = 16, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * (image_size // 4) ** 2, len(SHAPES)),
        )
        metrics = MetricCollection(
            {"acc": MulticlassAccuracy(len(SHAPES)), "f1": MulticlassF1Score(len(SHAPES), average="macro")}
        )
        self.val_metrics = metrics.clone(prefix="val_")
        self.test_metrics = metrics.clone(prefix="test_")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        self.val_metrics.update(logits, labels)
        self.log_dict(self.val_metrics, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.test_metrics.update(self(images), labels)
        self.log_dict(self.test_metrics)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=8)
    parser.add_argument("--default-root-dir", default=None, help="where logs and checkpoints go (default: here)")
    args = parser.parse_args()

    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        default_root_dir=args.default_root_dir,
        log_every_n_steps=10,
        callbacks=[
            ModelCheckpoint(monitor="val_f1", mode="max"),
            EarlyStopping(monitor="val_loss", patience=3),
        ],
    )
    datamodule = ShapesDataModule()
    trainer.fit(ShapesCNN(), datamodule=datamodule)
    results = trainer.test(datamodule=datamodule, ckpt_path="best")[0]
    print(f"Test accuracy of the best checkpoint: {results['test_acc']:.3f} (macro F1 {results['test_f1']:.3f})")


if __name__ == "__main__":
    main()
