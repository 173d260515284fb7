"""LightningModules and datamodules that the parity tests train; importable by the workers."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Every LightningModule hook whose order the parity test compares.
TRACED_HOOKS = (
    "setup",
    "configure_model",
    "configure_optimizers",
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
    "training_step",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
    "optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "validation_step",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_validation_model_zero_grad",
    "lr_scheduler_step",
    "on_train_end",
    "on_fit_end",
    "teardown",
    "on_save_checkpoint",
    "train_dataloader",
    "val_dataloader",
)


class Classifier(L.LightningModule):
    """A small MLP classifier on random features, logging like a real project does."""

    def __init__(self, in_features: int = 16, classes: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_loss_synced", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("train_loss_max", loss, on_step=False, on_epoch=True, reduce_fx="max", batch_size=len(x), logger=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log_dict({"val_acc": (logits.argmax(-1) == y).float().mean()}, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def _loader(self, size: int, shuffle: bool) -> DataLoader:
        return DataLoader(ClassificationData(size), batch_size=8, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(96, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(40, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(40, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(36, shuffle=False)


class ClassificationData(TensorDataset):
    """Seeded random features with a learnable label."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(size)
        x = torch.randn(size, 16, generator=generator)
        super().__init__(x, (x[:, :4].argmax(-1)))


class EpochEndClassifier(Classifier):
    """Aggregates validation outputs by hand in ``on_validation_epoch_end``."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        x, y = batch
        self.outputs.append((self(x).argmax(-1) == y).float())

    def on_validation_epoch_end(self) -> None:
        accuracy = torch.cat(self.outputs).mean()
        self.log("val_epoch_acc", accuracy, sync_dist=True)
        self.log("val_epoch_acc_rank0", accuracy, rank_zero_only=True)
        self.outputs.clear()


class SchedulerClassifier(Classifier):
    """A step-interval LR scheduler with a frequency, and Adam."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}


class WarmupClassifier(Classifier):
    """Overrides ``optimizer_step`` (LR warm-up), ``optimizer_zero_grad`` and gradient clipping."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < 5:
            for group in optimizer.param_groups:
                group["lr"] = self.hparams.lr * (self.trainer.global_step + 1) / 5

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")


class TracingClassifier(Classifier):
    """Records the order of its hooks on global rank 0 into the JSON file ``trace_path``."""

    def __init__(self) -> None:
        super().__init__()
        self.trace_path = ""
        self.trace: list[str] = []

    def on_fit_end(self) -> None:
        self.trace.append("on_fit_end")
        if self.trainer.is_global_zero:
            Path(self.trace_path).write_text(json.dumps(self.trace))


def _traced(name: str) -> Callable[..., Any]:
    parent = getattr(Classifier, name, None) or getattr(L.LightningModule, name)

    def hook(self: TracingClassifier, *args: Any, **kwargs: Any) -> Any:
        self.trace.append(name)
        return parent(self, *args, **kwargs)

    hook.__name__ = name
    return hook


for _name in TRACED_HOOKS:
    if _name != "on_fit_end":
        setattr(TracingClassifier, _name, _traced(_name))


class PlaceRecordingClassifier(Classifier):
    """Touches ``<record_dir>/<step>-<process ID>`` at each training and validation step (not the
    sanity check's): where they ran (``record_dir``, ``step_s`` and ``fail_validation`` are
    attributes set after construction, not hyperparameters). Counts its training batches in a plain
    attribute, which each validation logs as ``val_trained_batches``, as a module that anneals
    something in training and reads it in validation does."""

    record_dir = ""
    #: Seconds each training step sleeps, as a longer step takes.
    step_s = 0.0
    #: ``(step, how)``: rank 1's validation of that step fails at its second batch: its hook
    #: raises (``"raise"``) or its process is killed (``"kill"``); or its process is killed as it
    #: ends, after its results (``"kill after"``); ``(None, "kill")``: rank 0's process is killed at
    #: the ``fit``'s end where it only validated.
    fail_validation: Optional[tuple[Optional[int], str]] = None
    trained_batches = 0
    #: Whether this process ran a training step (not carried: a private attribute).
    _trained_here = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        Path(self.record_dir, f"train-{os.getpid()}").touch()
        self._trained_here = True
        time.sleep(self.step_s)
        self.trained_batches += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            Path(self.record_dir, f"validation-{os.getpid()}").touch()
        if (self.trainer.global_step, "kill", self.trainer.global_rank, batch_idx) == (*self._failing, 1, 1):
            os.kill(os.getpid(), signal.SIGKILL)
        if (self.trainer.global_step, "raise", self.trainer.global_rank, batch_idx) == (*self._failing, 1, 1):
            raise RuntimeError(f"validation of step {self.trainer.global_step} failed on purpose")
        self.log("val_trained_batches", float(self.trained_batches))
        super().validation_step(batch, batch_idx)

    def on_validation_end(self) -> None:
        if (self.trainer.global_step, "kill after", self.global_rank) == (*self._failing, 1):
            os.kill(os.getpid(), signal.SIGKILL)

    @property
    def _failing(self) -> tuple[Optional[int], str]:
        return self.fail_validation or (None, "")

    def on_fit_end(self) -> None:
        if self.fail_validation == (None, "kill") and self.global_rank == 0 and not self._trained_here:
            os.kill(os.getpid(), signal.SIGKILL)


class ClassificationDataModule(L.LightningDataModule):
    """The same data through a LightningDataModule, with ``setup`` building the splits."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train_set = ClassificationData(96)
        self.val_set = ClassificationData(40)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class DataModuleClassifier(Classifier):
    """A classifier that takes its data from a LightningDataModule."""

    train_dataloader = None  # type: ignore[assignment]
    val_dataloader = None  # type: ignore[assignment]


class WeightRecorder(L.LightningModule):
    """A regressor whose every rank saves the weights it starts a validation with into
    ``record_dir`` (``rank<N>.pt``), then writes into one of two buffers that hold the same bytes
    and saves both (``twins<N>.pt``). Its batch-norm statistics differ from rank to rank after
    training, as under ``ddp``."""

    def __init__(self, record_dir: str, width: int = 64) -> None:
        super().__init__()
        self.record_dir = record_dir
        self.layer = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.register_buffer("twin_a", torch.zeros(512))
        self.register_buffer("twin_b", torch.zeros(512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layer(x.to(self.layer.weight.dtype)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(batch[0]).pow(2).mean(), sync_dist=True)

    def on_validation_start(self) -> None:
        directory = Path(self.record_dir)
        torch.save(
            {name: tensor.clone() for name, tensor in self.state_dict().items()},
            directory / f"rank{self.global_rank}.pt",
        )
        self.twin_a.add_(1)
        torch.save({"a": self.twin_a.clone(), "b": self.twin_b.clone()}, directory / f"twins{self.global_rank}.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self) -> DataLoader:
        width = self.layer.in_features
        return DataLoader(
            TensorDataset(torch.randn(16, width, generator=torch.Generator().manual_seed(0))), batch_size=4
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()
