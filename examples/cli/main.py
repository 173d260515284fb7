"""A LightningCLI project that trains with ``strategy="monarch"``, configured by YAML files.

A small regression network learns scikit-learn's bundled diabetes data (442 patients, 10
features, no download). The module defines no ``configure_optimizers``: the optimizer and the LR
scheduler come from the config's ``optimizer:`` and ``lr_scheduler:`` sections, as LightningCLI
allows. Importing ``lightning_monarch`` registers ``strategy: monarch`` and makes
``lightning_monarch.MonarchStrategy`` a ``class_path`` the configs can name.

On this machine, 2 CPU workers:

    python examples/cli/main.py fit --config examples/cli/monarch_1host.yaml

On a SLURM cluster's login node, 2 nodes x 8 GPUs that Monarch's ``SlurmJob`` allocates with
sbatch (edit the partition and account in the file first):

    python examples/cli/main.py fit --config examples/cli/monarch_slurm.yaml

Any value can be overridden on the command line (``--trainer.max_epochs 5``), and
``--print_config`` shows the full configuration.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from sklearn.datasets import load_diabetes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics import MeanSquaredError, R2Score

import lightning_monarch  # noqa: F401 - registers strategy="monarch"


class DiabetesDataModule(L.LightningDataModule):
    """scikit-learn's diabetes data, features and target standardized, split 342 / 100."""

    def __init__(self, batch_size: int = 32, val_size: int = 100) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        features, target = (torch.tensor(array, dtype=torch.float32) for array in load_diabetes(return_X_y=True))
        features = (features - features.mean(0)) / features.std(0)
        target = (target - target.mean()) / target.std()
        dataset = TensorDataset(features, target.unsqueeze(1))
        self.train_set, self.val_set = random_split(
            dataset,
            [len(dataset) - self.hparams.val_size, self.hparams.val_size],
            generator=torch.Generator().manual_seed(0),
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class Regressor(L.LightningModule):
    """An MLP with dropout; logs the validation MSE and R² (torchmetrics, synced across workers)."""

    def __init__(self, hidden: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(10, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )
        self.val_mse = MeanSquaredError()
        self.val_r2 = R2Score()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, target = batch
        loss = nn.functional.mse_loss(self(features), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        features, target = batch
        prediction = self(features)
        self.val_mse(prediction, target)
        self.val_r2(prediction, target)
        self.log_dict({"val_mse": self.val_mse, "val_r2": self.val_r2}, prog_bar=True)


class RegressionCLI(LightningCLI):
    """LightningCLI that reports the final validation scores after ``fit``."""

    def after_fit(self) -> None:
        metrics = self.trainer.callback_metrics
        print(f"Validation R2: {metrics['val_r2']:.3f} (MSE {metrics['val_mse']:.3f}, standardized target)")


if __name__ == "__main__":
    RegressionCLI(Regressor, DiabetesDataModule)
