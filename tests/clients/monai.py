"""MONAI (``monai``, ``lightning.pytorch``): 3-D segmentation, as MONAI's spleen segmentation
tutorial trains it with Lightning: a residual ``UNet`` with batch norm, ``DiceLoss`` on softmax
outputs, validation by ``sliding_window_inference`` over each whole volume, post-transforms on the
decollated batch, a ``DiceMetric`` that accumulates over the epoch and is aggregated and reset in
``on_validation_epoch_end``, the best Dice and its epoch kept as module attributes, and
``ModelCheckpoint`` on the Dice. The volumes are MONAI's synthetic test images (spheres in
noise), seeded, with dictionary transforms in MONAI's ``Dataset``.

What it exercises: dictionary batches of MONAI ``MetaTensor`` volumes (a tensor subclass with
metadata), collated by MONAI's ``list_data_collate``; a metric object that is not a torchmetrics
``Metric`` and that each rank aggregates on its own, logged without ``sync_dist``, which the
checkpoint then monitors (each rank decides on its own value, as under ``ddp``); public module
attributes that ``on_validation_epoch_end`` changes (rank 0's on the controller after the fit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from lightning import pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from monai.data import DataLoader, Dataset, create_test_image_3d, decollate_batch, list_data_collate
from monai.inferers import sliding_window_inference
from monai.losses import DiceLoss
from monai.metrics import DiceMetric
from monai.networks.layers import Norm
from monai.networks.nets import UNet
from monai.transforms import AsDiscrete, Compose, EnsureTyped

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from tests.clients import quiet_trainer, results

SIZE = 24


def _volumes(count: int, first_seed: int) -> list[dict[str, np.ndarray]]:
    """Synthetic volumes with their two-class labels (spheres, and the background)."""
    volumes = []
    for seed in range(first_seed, first_seed + count):
        image, label = create_test_image_3d(
            SIZE,
            SIZE,
            SIZE,
            num_objs=3,
            rad_max=6,
            num_seg_classes=1,
            channel_dim=0,
            noise_max=0.3,
            random_state=np.random.RandomState(seed),
        )
        volumes.append({"image": image.astype(np.float32), "label": label.astype(np.float32)})
    return volumes


class Net(pl.LightningModule):
    """The tutorial's module, at the synthetic volumes' size."""

    def __init__(self) -> None:
        super().__init__()
        self._model = UNet(
            spatial_dims=3,
            in_channels=1,
            out_channels=2,
            channels=(4, 8, 16),
            strides=(2, 2),
            num_res_units=1,
            norm=Norm.BATCH,
        )
        self.loss_function = DiceLoss(to_onehot_y=True, softmax=True)
        self.post_pred = Compose([AsDiscrete(argmax=True, to_onehot=2)])
        self.post_label = Compose([AsDiscrete(to_onehot=2)])
        self.dice_metric = DiceMetric(include_background=False, reduction="mean", get_not_nans=False)
        self.best_val_dice = 0.0
        self.best_val_epoch = 0
        self.validation_step_outputs: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._model(x)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.loss_function(self.forward(batch["image"]), batch["label"])
        self.log("train_loss", loss, batch_size=len(batch["image"]))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        images, labels = batch["image"], batch["label"]
        outputs = sliding_window_inference(images, (16, 16, 16), 4, self.forward)
        loss = self.loss_function(outputs, labels)
        outputs = [self.post_pred(item) for item in decollate_batch(outputs)]
        labels = [self.post_label(item) for item in decollate_batch(labels)]
        self.dice_metric(y_pred=outputs, y=labels)
        self.validation_step_outputs.append({"val_loss": loss, "val_number": len(outputs)})

    def on_validation_epoch_end(self) -> None:
        mean_val_dice = self.dice_metric.aggregate().item()
        self.dice_metric.reset()
        count = sum(output["val_number"] for output in self.validation_step_outputs)
        mean_val_loss = sum(output["val_loss"].sum().item() for output in self.validation_step_outputs) / count
        self.log("val_dice", mean_val_dice)
        self.log("val_loss", mean_val_loss)
        if mean_val_dice > self.best_val_dice:
            self.best_val_dice = mean_val_dice
            self.best_val_epoch = self.current_epoch
        self.validation_step_outputs.clear()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self._model.parameters(), 1e-2)


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    pl.seed_everything(0)
    to_tensors = EnsureTyped(keys=["image", "label"])
    train_set, val_set = Dataset(_volumes(8, 0), to_tensors), Dataset(_volumes(4, 100), to_tensors)
    model = Net()
    checkpointing = ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), monitor="val_dice", mode="max")
    trainer = pl.Trainer(
        **quiet_trainer(strategy, out_dir),
        max_epochs=3,
        log_every_n_steps=1,
        num_sanity_val_steps=1,
        callbacks=[checkpointing],
    )
    trainer.fit(
        model,
        DataLoader(train_set, batch_size=2, shuffle=True, collate_fn=list_data_collate),
        DataLoader(val_set, batch_size=1),
    )
    return results(
        trainer,
        model,
        out_dir,
        best_model=Path(checkpointing.best_model_path).name,
        best_val=(model.best_val_dice, model.best_val_epoch),
    )
