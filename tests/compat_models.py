"""LightningModules that exercise the wider Lightning surface: manual optimization, every
``configure_optimizers`` form, torchmetrics, module code that reads the trainer or writes to the
logger, and checkpoint hooks. Importable by the workers and by the ``ddp`` reference."""

from __future__ import annotations

import itertools
import os
from typing import Any

import lightning as L
import numpy as np
import pandas as pd
import torch
import torch.distributed
import torchmetrics
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, LambdaCallback
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset

from tests.models import ClassificationData, ClassificationDataModule, Classifier


class ManualGAN(L.LightningModule):
    """Two optimizers stepped by hand in one ``training_step``, with toggling, hand-written
    gradient accumulation for the discriminator and schedulers stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        real = batch[0]
        noise = torch.randn(len(real), 8, device=self.device)
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(d_opt)
        fake = self.generator(noise).detach()
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)) / 2
        self.manual_backward(d_loss / 2)
        if (batch_idx + 1) % 2 == 0:
            d_opt.step()
            d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)

        self.toggle_optimizer(g_opt)
        g_loss = bce(self.discriminator(self.generator(noise)), ones)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def on_train_epoch_end(self) -> None:
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self) -> Any:
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=2e-3)
        d_opt = torch.optim.SGD(self.discriminator.parameters(), lr=1e-2)
        return [g_opt, d_opt], [
            torch.optim.lr_scheduler.StepLR(g_opt, 1, 0.5),
            torch.optim.lr_scheduler.StepLR(d_opt, 1, 0.9),
        ]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ClassificationData(96), batch_size=8, shuffle=True)


class PlateauClassifier(Classifier):
    """``ReduceLROnPlateau`` monitoring a metric logged in validation, in the dict form."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5, threshold=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


class OneCycleClassifier(Classifier):
    """``OneCycleLR`` sized with ``trainer.estimated_stepping_batches``, in the two-list form."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class MetricsClassifier(Classifier):
    """torchmetrics objects passed to ``self.log``, a MetricCollection, and an epoch-end value
    computed by hand from ``self.all_gather``."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.val_metrics = torchmetrics.MetricCollection(
            {
                "val_precision": torchmetrics.Precision(task="multiclass", num_classes=4, average="macro"),
                "val_recall": torchmetrics.Recall(task="multiclass", num_classes=4, average="macro"),
            }
        )
        self.correct: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        x, y = batch
        logits = self(x)
        self.val_metrics.update(logits, y)
        self.log_dict(self.val_metrics)
        self.correct.append((logits.argmax(-1) == y).float())

    def on_validation_epoch_end(self) -> None:
        gathered = self.all_gather(torch.cat(self.correct))
        self.log("val_acc_gathered", gathered.mean())
        self.log("val_gathered_count", float(gathered.numel()))
        self.correct.clear()


class TrainerAwareClassifier(Classifier):
    """Module code that reads the trainer and uses the strategy's collectives in its steps."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        strategy = self.trainer.strategy
        strategy.barrier("step")
        rank = torch.tensor(float(self.global_rank))
        self.log_dict(
            {
                "seen_epoch": float(self.current_epoch),
                "seen_step": float(self.global_step),
                "seen_max_epochs": float(self.trainer.max_epochs),
                "seen_world_size": float(self.trainer.world_size),
                "seen_stepping_batches": float(self.trainer.estimated_stepping_batches),
                "seen_no_datamodule": float(self.trainer.datamodule is None),
                "broadcast_rank": strategy.broadcast(rank),
                "reduced_rank": strategy.reduce(rank, reduce_op="sum"),
                "gathered_losses": self.all_gather(loss.detach()).sum(),
            },
            reduce_fx="max",
        )
        if self.trainer.is_global_zero and batch_idx == 0:
            self.print(f"epoch {self.current_epoch} on rank {self.global_rank}")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("seen_sanity_checking", float(self.trainer.sanity_checking))


class AllRankLogger(Logger):
    """A logger of the user's own that keeps what it is given on every rank (its methods are not
    ``rank_zero_only``), as in Lightning's ``test_all_rank_logging_ddp_cpu``: module code reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "all_rank"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        self.logs.update(metrics)

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class LoggingClassifier(Classifier):
    """Writes to the logger from module code: ``log_hyperparams`` and ``logger.experiment``; reads
    ``trainer.log_dir`` and what its rank gave its second logger, an :class:`AllRankLogger`."""

    def on_train_start(self) -> None:
        self.logger.log_hyperparams({"extra_hparam": 7})
        self.log(f"rank-{self.global_rank}", 0.0)

    def on_train_end(self) -> None:
        self.seen = {
            "log_dir": os.path.relpath(self.trainer.log_dir, self.logger.save_dir),
            "own_rank_logged": f"rank-{self.global_rank}" in self.loggers[1].logs,
        }

    def kept(self) -> dict[str, Any]:
        """What the script reads after the fit: what rank 0's module saw, and its own loggers' keys."""
        return {**self.seen, "logged_keys": sorted(self.loggers[1].logs)}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        if batch_idx == 0:
            self.logger.experiment.log_metrics({"from_experiment": float(batch[0].sum())}, step=self.global_step)


class CheckpointHooksClassifier(Classifier):
    """Adds state to checkpoints in ``on_save_checkpoint`` and reads it back in ``on_load_checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_seen = 0
        self.restored_steps = -1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_seen += 1
        self.log("restored_steps", float(self.restored_steps))
        return super().training_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["steps_seen"] = self.steps_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.restored_steps = checkpoint["steps_seen"]


class SelfStoppingClassifier(Classifier):
    """Brings its own EarlyStopping through ``configure_callbacks``."""

    def configure_callbacks(self) -> list[L.Callback]:
        return [EarlyStopping(monitor="val_loss", min_delta=0.5, patience=1)]


class TwoValLoaderClassifier(Classifier):
    """Two validation dataloaders, told apart by ``dataloader_idx``."""

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        name = "val_loss" if dataloader_idx == 0 else "val_loss_second"
        self.log(name, nn.functional.cross_entropy(self(x), y), sync_dist=True, add_dataloader_idx=False)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(ClassificationData(40), batch_size=8), DataLoader(ClassificationData(24), batch_size=4)]


class GradNormLogger(L.Callback):
    """Logs the gradient norm before each optimizer step: needs live gradients."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        norm = torch.stack([p.grad.norm() for p in pl_module.parameters() if p.grad is not None]).norm()
        pl_module.log("grad_norm", norm)


class FinetuneClassifier(Classifier):
    """A classifier with a ``backbone``, for ``BackboneFinetuning``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.net[:2]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)


class StreamData(IterableDataset):
    """Samples from an iterator, with no length: Lightning cannot shard it, every rank reads it all."""

    def __init__(self, size: int) -> None:
        self.data = ClassificationData(size)

    def __iter__(self) -> Any:
        return iter(zip(*self.data.tensors, strict=True))


class StreamClassifier(Classifier):
    """Trains and validates on iterable datasets of unknown length."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StreamData(90), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(StreamData(20), batch_size=8)


class RankShardSampler(Sampler):
    """A sampler written by the user that shards by rank itself (``use_distributed_sampler=False``)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Any:
        return iter(range(torch.distributed.get_rank(), self.size, torch.distributed.get_world_size()))

    def __len__(self) -> int:
        return len(range(torch.distributed.get_rank(), self.size, torch.distributed.get_world_size()))


class CustomSamplerClassifier(Classifier):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(ClassificationData(96), batch_size=8, sampler=RankShardSampler(96))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(ClassificationData(40), batch_size=8, sampler=RankShardSampler(40))


class StepOutputsClassifier(Classifier):
    """A training step that returns extra outputs beside the loss, and asks to stop mid-epoch
    from inside the step, as a guard against a diverging loss would."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        loss = super().training_step(batch, batch_idx)
        if self.current_epoch == 1 and batch_idx == 3:
            self.trainer.should_stop = True
        return {"loss": loss, "batch_mean": batch[0].mean()}


class OutputsRecorder(L.Callback):
    """Records what ``on_train_batch_end`` receives as ``outputs`` (the parity tests compare it)."""

    def __init__(self) -> None:
        self.record: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.record.append({key: float(value) for key, value in outputs.items()})


class NoOptimizerClassifier(Classifier):
    """``configure_optimizers`` returns ``None``: Lightning trains without an optimizer, with a warning."""

    def configure_optimizers(self) -> None:
        return None


class CollectiveReader(L.Callback):
    """A controller callback that reduces, gathers and broadcasts a metric every rank holds its own
    value of (``train_loss_step``, logged without ``sync_dist``), as a callback on DDP's rank 0 would."""

    def __init__(self) -> None:
        self.record: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = trainer.callback_metrics["train_loss_step"]
        self.record.append(
            {
                "mean": float(trainer.strategy.reduce(loss, reduce_op="mean")),
                "sum": float(trainer.strategy.reduce(loss, reduce_op="sum")),
                "gathered": trainer.strategy.all_gather(loss).tolist(),
                "broadcast": trainer.strategy.broadcast(float(loss)),
            }
        )


class EpochRecorder(LambdaCallback):
    """A ``LambdaCallback`` on the controller: what it sees at every validation end."""

    def __init__(self) -> None:
        self.record: list[dict[str, Any]] = []
        super().__init__(
            on_validation_end=lambda trainer, module: self.record.append(
                {
                    "epoch": trainer.current_epoch,
                    "step": trainer.global_step,
                    "val_loss": float(trainer.callback_metrics["val_loss"]),
                }
            )
        )


class GrowingDataClassifier(Classifier):
    """A train set that grows with the epoch: ``reload_dataloaders_every_n_epochs`` shows."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ClassificationData(64 + 16 * self.current_epoch), batch_size=8, shuffle=True)


class UnsyncedValidationClassifier(Classifier):
    """Logs a validation loss without ``sync_dist=True``, as many libraries do: each rank holds its
    own. Rank 1's stalls (it is 1.0 throughout), so that an ``EarlyStopping`` on it stops the run
    because of rank 1, several epochs before rank 0's would."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("val_loss_unsynced", loss if self.global_rank == 0 else torch.ones_like(loss))


class UnsyncedScoreClassifier(Classifier):
    """Logs a validation score without ``sync_dist=True`` that the ranks rank differently: rank 0's
    is its loss, rank 1's is ``(epoch - 1.5) ** 2``, best at epochs 1 and 2. A ``ModelCheckpoint``'s
    top 2 on it takes a checkpoint only when both ranks' own top 2 would: at epochs 0, 1 and 2
    (removing epoch 0's, rank 0's worst), not at epoch 3, which rank 0 alone would take."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        score = loss if self.global_rank == 0 else torch.tensor((self.current_epoch - 1.5) ** 2)
        self.log("val_score_unsynced", score)


class Condition:
    """A condition as a scientific library writes one: its class checks its arguments in
    ``__new__``. Pickle writes it without complaint, but reads it back with
    ``Condition.__new__(Condition)``, which lacks them."""

    def __new__(cls, scale: float, equation: str) -> Condition:
        if not equation:
            raise ValueError("a condition needs an equation")
        return super().__new__(cls)

    def __init__(self, scale: float, equation: str) -> None:
        self.scale = scale
        self.equation = equation


class ConditionDataModule(ClassificationDataModule):
    """A datamodule that holds conditions and scales its training features by one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.conditions = {"x": Condition(0.5, "x * scale")}

    def setup(self, stage: str) -> None:
        super().setup(stage)
        features, labels = self.train_set.tensors
        self.train_set = TensorDataset(features * self.conditions["x"].scale, labels)


class NormClassifier(Classifier):
    """A classifier with batch norm: ``StochasticWeightAveraging`` then recomputes its statistics
    in one more epoch at the end of training."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def shrink_weights(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """A ``LambdaCallback`` hook that changes the weights: each epoch starts from them halved."""
    with torch.no_grad():
        for parameter in pl_module.parameters():
            parameter.mul_(0.5)


class RankPredictionWriter(BasePredictionWriter):
    """Writes each rank's predictions with their dataset indices, one file per rank and batch."""

    def __init__(self, directory: str) -> None:
        super().__init__(write_interval="batch")
        self.directory = directory

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        os.makedirs(self.directory, exist_ok=True)
        torch.save(
            {"prediction": prediction, "indices": list(batch_indices)},
            os.path.join(self.directory, f"rank{trainer.global_rank}-batch{batch_idx}.pt"),
        )


class ViewsRecorder(L.Callback):
    """A controller callback recording the metric views it sees at every training batch's end."""

    def __init__(self) -> None:
        self.record: list[dict[str, dict[str, float]]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.record.append(
            {
                "progress_bar_metrics": {key: float(value) for key, value in trainer.progress_bar_metrics.items()},
                "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
            }
        )


class StopAtStep(L.Callback):
    """A controller callback that stops training at a step, as a budget guard would."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.record: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True
            self.record.append(trainer.global_step)


class FailsAtStep(Classifier):
    """Rank 0 (or ``every_rank``) raises in ``training_step`` once ``global_step`` reaches ``step``."""

    def __init__(self, step: int, every_rank: bool = False) -> None:
        super().__init__()
        self.fail_step, self.every_rank = step, every_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_step and (self.every_rank or self.global_rank == 0):
            raise ValueError(f"failing on purpose at step {self.fail_step}")
        return super().training_step(batch, batch_idx)


class WindowStream:
    """A training stream as time-series libraries build one (GluonTS's ``Cyclic(...).stream()``
    under its batches): a Python generator made once in ``__init__`` cycles over the series and cuts
    windows at offsets drawn from torch's global generator, with noise from NumPy's, so it cannot
    be pickled; each pass over it yields the next ``batches_per_pass`` batches of the one stream."""

    def __init__(self, size: int = 96, batches_per_pass: int = 6, batch_size: int = 8) -> None:
        self.data = ClassificationData(size)
        self.batches_per_pass = batches_per_pass
        self._stream = self._windows(batch_size)

    def _windows(self, batch_size: int) -> Any:
        features, labels = self.data.tensors
        while True:
            for _ in range(0, len(features), batch_size):
                offsets = torch.randint(0, len(features), (batch_size,))
                noise = torch.from_numpy(np.random.normal(scale=0.01, size=(batch_size, 16)).astype(np.float32))
                yield features[offsets] + noise, labels[offsets]

    def __iter__(self) -> Any:
        return itertools.islice(self._stream, self.batches_per_pass)


class FrameData(Dataset):
    """A tabular dataset as projects hold one: a pandas DataFrame with a string column, and NumPy labels."""

    def __init__(self, size: int) -> None:
        features = np.random.default_rng(size).standard_normal((size, 16)).astype(np.float32)
        self.frame = pd.DataFrame(features, columns=[f"f{column}" for column in range(16)])
        self.frame["kind"] = np.where(features[:, 0] > 0, "up", "down")
        self.labels = features[:, :4].argmax(-1)

    def __len__(self) -> int:
        return len(self.frame)

    def __getitem__(self, index: int) -> Any:
        return torch.from_numpy(self.frame.iloc[index, :16].to_numpy(np.float32)), int(self.labels[index])


class FrameDataModule(L.LightningDataModule):
    """Holds its datasets from ``__init__``: they travel to the workers with it."""

    def __init__(self) -> None:
        super().__init__()
        self.train_set, self.val_set = FrameData(96), FrameData(40)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=8)


class NumpyStatsClassifier(Classifier):
    """Normalizes its inputs with NumPy statistics and maps labels through a NumPy lookup table,
    both plain attributes, as modules hold their preprocessing."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = np.full(16, 0.1, dtype=np.float32)
        self.table = np.arange(4096, dtype=np.int64) % 4  # 32 KiB: travels out of band

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - torch.from_numpy(self.mean))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return super().training_step((x, torch.from_numpy(self.table[y.numpy()])), batch_idx)


#: ``torch.get_float32_matmul_precision()``'s values, as numbers a metric can hold.
MATMUL_PRECISIONS = {"highest": 0.0, "high": 1.0, "medium": 2.0}


class SettingsReadingClassifier(Classifier):
    """Logs torch's settings as its ``training_step`` reads them: the float32 matmul precision and
    whether deterministic algorithms are on (and only warn), which the script set on each rank."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("matmul_precision", MATMUL_PRECISIONS[torch.get_float32_matmul_precision()])
        self.log("deterministic", float(torch.are_deterministic_algorithms_enabled()))
        self.log("deterministic_warn_only", float(torch.is_deterministic_algorithms_warn_only_enabled()))
        return super().training_step(batch, batch_idx)


class RowsData(Dataset):
    """300 rows, each its own tensor, as a dataset of separately loaded samples holds them: a
    DataLoader's processes started by ``forkserver`` would be sent one file descriptor per row."""

    def __init__(self, size: int = 300) -> None:
        data = ClassificationData(size)
        self.rows = [(x.clone(), y.clone()) for x, y in data]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]


class LoaderProcessesClassifier(Classifier):
    """Loads its batches in 2 persistent DataLoader processes per rank, from a :class:`RowsData`."""

    def _loader(self, size: int, shuffle: bool) -> DataLoader:
        return DataLoader(RowsData(), batch_size=50, shuffle=shuffle, num_workers=2, persistent_workers=True)


class ScaledClassifier(Classifier):
    """Scales its logits by a class attribute, which a script may change after import."""

    scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


#: A module-level setting, which a script may change after import (as ``mylib.config.X = ...``).
LOGIT_SHIFT = 0.0


class ShiftedClassifier(Classifier):
    """Shifts its first logit by :data:`LOGIT_SHIFT`, read from its module at each step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return torch.cat([logits[:, :1] + LOGIT_SHIFT, logits[:, 1:]], dim=1)


class CountingDataModule(ClassificationDataModule):
    """Counts the training batches it served and keeps the count in checkpoints (``state_dict``),
    as a resumable data pipeline keeps its position; ``load_state_dict`` takes it back on resume."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training:
            self.served += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.served = state_dict["served"]


class TestKeepingClassifier(Classifier):
    """Keeps what its test saw, as nequip keeps its test metrics: each step's loss in a list, their
    stack in an attribute set in ``on_test_epoch_end``, and a torchmetrics metric (a submodule, whose
    states are its plain attributes) updated in ``test_step`` and read after ``trainer.test``."""

    def __init__(self) -> None:
        super().__init__()
        self.test_mean = torchmetrics.MeanMetric()
        self.test_losses: list[torch.Tensor] = []

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.test_mean.update(loss)
        self.test_losses.append(loss.detach())

    def on_test_epoch_end(self) -> None:
        self.test_summary = torch.stack(self.test_losses)

    def kept(self) -> dict[str, Any]:
        """What the script reads of the module after the stages."""
        return {"summary": self.test_summary, "mean": self.test_mean.mean_value, "weight": self.test_mean.weight}


class BatchReader(L.Callback):
    """Reads each batch and the step's outputs in its batch hooks, as a callback that writes each
    test batch's predictions to files does (nequip's ``TestTimeXYZFileWriter``)."""

    def __init__(self) -> None:
        self.record: list[tuple[Any, ...]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.record.append(("train", batch_idx, float(x.sum()), float(outputs["loss"])))

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        x, y = batch
        self.record.append(("test", batch_idx, float(x.sum()), int(y.sum())))
