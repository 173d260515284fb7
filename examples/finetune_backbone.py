"""Fine-tune a classifier on top of a frozen, pretrained backbone, with a worker callback.

Two fits on scikit-learn's bundled 8x8 digits, no download:

1. pretraining: a small CNN learns the digits 0-4;
2. fine-tuning: a new linear head learns the digits 5-9 from a few labelled images per class,
   on top of the pretrained backbone, which stays frozen.

Freezing is done by ``FreezeBackbone``, a Lightning ``BaseFinetuning`` callback. Under
``strategy="monarch"`` the controller's module holds no live parameters, so callbacks that freeze
or unfreeze them run on the workers: they go in ``MonarchStrategy(worker_callbacks=[...])``, not in
``Trainer(callbacks=[...])`` (which is rejected with that fix before any worker starts). The
callback freezes the backbone in ``setup``, before DDP wraps the module, so DDP never expects
gradients for it. (Lightning's ``BackboneFinetuning`` also *unfreezes* the backbone later; DDP,
under ``ddp`` and under ``monarch`` alike, does not synchronize the gradients of parameters that
were frozen when it wrapped the module.)

After each fit the script's own module holds the trained weights, so the pretrained backbone is
handed to the fine-tuning module directly, and the script checks that fine-tuning left it unchanged.
The second fit reuses the first one's warm worker processes.

    python examples/finetune_backbone.py [--devices 2] [--pretrain-epochs 8] [--max-epochs 20]
"""

from __future__ import annotations

import argparse
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from sklearn.datasets import load_digits
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_monarch import MonarchStrategy

SOURCE_DIGITS = (0, 1, 2, 3, 4)
TARGET_DIGITS = (5, 6, 7, 8, 9)


class DigitsDataModule(L.LightningDataModule):
    """Some of scikit-learn's digits as 1x8x8 images, labelled 0..len(digits)-1.

    Each class's images are split 60/20/20 into train, validation and test sets;
    ``train_per_class`` keeps only that many labelled training images per class.
    """

    def __init__(self, digits: tuple[int, ...], train_per_class: Optional[int] = None, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        data = load_digits()
        images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
        digits = torch.tensor(data.target)
        label_of = torch.full((10,), -1)
        label_of[list(self.hparams.digits)] = torch.arange(len(self.hparams.digits))
        generator = torch.Generator().manual_seed(0)
        train, val, test = [], [], []
        for digit in self.hparams.digits:
            indices = torch.nonzero(digits == digit).flatten()
            indices = indices[torch.randperm(len(indices), generator=generator)]
            end_train, end_val = int(0.6 * len(indices)), int(0.8 * len(indices))
            train.append(indices[:end_train][: self.hparams.train_per_class])
            val.append(indices[end_train:end_val])
            test.append(indices[end_val:])
        self.train_set, self.val_set, self.test_set = (
            TensorDataset(images[torch.cat(split)], label_of[digits[torch.cat(split)]]) for split in (train, val, test)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)


def make_backbone(features: int = 128) -> nn.Sequential:
    """Two convolutions and a projection: an 8x8 image to ``features`` numbers."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, features),
        nn.ReLU(),
    )


class DigitClassifier(L.LightningModule):
    """A ``backbone`` (new, or a pretrained one passed in) and a new linear ``head``."""

    def __init__(self, num_classes: int, backbone: Optional[nn.Module] = None, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone if backbone is not None else make_backbone()
        self.head = nn.Linear(128, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.val_acc(self(images), labels)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.test_acc(self(images), labels)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self) -> Optimizer:
        # Only what is trainable: a finetuning callback freezes parameters before this runs.
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


class FreezeBackbone(BaseFinetuning):
    """Freezes ``pl_module.backbone`` for the whole fit. Runs on every worker."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Optimizer) -> None:
        """Nothing to unfreeze: the backbone stays frozen (see the module docstring for why)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pretrain-epochs", type=int, default=8)
    parser.add_argument("--max-epochs", type=int, default=20, help="fine-tuning epochs")
    parser.add_argument("--labels-per-class", type=int, default=20, help="labelled images per target digit")
    parser.add_argument("--default-root-dir", default=None, help="where logs and checkpoints go (default: here)")
    args = parser.parse_args()
    trainer_args = dict(accelerator="cpu", devices=args.devices, default_root_dir=args.default_root_dir)

    L.seed_everything(0)
    pretrained = DigitClassifier(num_classes=len(SOURCE_DIGITS))
    pretraining = L.Trainer(strategy="monarch", max_epochs=args.pretrain_epochs, **trainer_args)
    pretraining.fit(pretrained, datamodule=DigitsDataModule(SOURCE_DIGITS))
    print(f"Pretraining on digits {SOURCE_DIGITS}: validation accuracy {pretraining.callback_metrics['val_acc']:.3f}")

    model = DigitClassifier(num_classes=len(TARGET_DIGITS), backbone=pretrained.backbone, lr=1e-2)
    backbone_before = {name: tensor.clone() for name, tensor in model.backbone.state_dict().items()}
    finetuning = L.Trainer(
        strategy=MonarchStrategy(worker_callbacks=[FreezeBackbone()]),
        max_epochs=args.max_epochs,
        log_every_n_steps=1,
        **trainer_args,
    )
    datamodule = DigitsDataModule(TARGET_DIGITS, train_per_class=args.labels_per_class)
    finetuning.fit(model, datamodule=datamodule)
    unchanged = all(torch.equal(backbone_before[name], tensor) for name, tensor in model.backbone.state_dict().items())
    accuracy = finetuning.test(model, datamodule=datamodule)[0]["test_acc"]
    print(
        f"Fine-tuning on digits {TARGET_DIGITS} with {args.labels_per_class} labels each:"
        f" test accuracy {accuracy:.3f}; backbone unchanged: {unchanged}"
    )


if __name__ == "__main__":
    main()
