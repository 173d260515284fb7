"""PyTorch Geometric (``torch_geometric``, ``lightning.pytorch``): graph classification as PyG's
``examples/pytorch_lightning/gin.py`` trains it, with GCN layers, through PyG's own datamodule
(``LightningDataset``), a batch-normed MLP head with dropout, torchmetrics ``Accuracy`` and
``ModelCheckpoint`` on it, then ``trainer.test(ckpt_path="best")``. The pure-Python wheel: no
compiled extension. The graphs are PyG's seeded ``FakeDataset``.

What it exercises: PyG's ``Batch`` objects as batches, a datamodule that holds its datasets from
``__init__`` (they travel to the workers), torchmetrics objects logged as metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning import pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch_geometric.data.lightning import LightningDataset
from torch_geometric.datasets import FakeDataset
from torch_geometric.nn import MLP, GCNConv, global_mean_pool
from torchmetrics import Accuracy

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from tests.clients import quiet_trainer, results


class GraphClassifier(pl.LightningModule):
    """gin.py's model with ``GCNConv`` layers: node embeddings, a mean pool, an MLP head."""

    def __init__(self, in_channels: int, classes: int, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = GCNConv(in_channels, hidden)
        self.conv2 = GCNConv(hidden, hidden)
        self.head = MLP([hidden, hidden, classes], norm="batch_norm", dropout=0.5)
        self.train_acc, self.val_acc, self.test_acc = (
            Accuracy(task="multiclass", num_classes=classes) for _ in range(3)
        )

    def forward(self, data: Any) -> torch.Tensor:
        x = F.relu(self.conv1(data.x, data.edge_index))
        x = F.dropout(x, p=0.5, training=self.training)
        x = F.relu(self.conv2(x, data.edge_index))
        return self.head(global_mean_pool(x, data.batch))

    def _step(self, stage: str, data: Any) -> torch.Tensor:
        logits = self(data)
        loss = F.cross_entropy(logits, data.y)
        accuracy = getattr(self, f"{stage}_acc")
        accuracy(logits.softmax(dim=-1), data.y)
        self.log(f"{stage}_loss", loss, batch_size=int(data.num_graphs), sync_dist=True)
        self.log(f"{stage}_acc", accuracy, on_step=False, on_epoch=True, batch_size=int(data.num_graphs))
        return loss

    def training_step(self, data: Any, batch_idx: int) -> torch.Tensor:
        return self._step("train", data)

    def validation_step(self, data: Any, batch_idx: int) -> None:
        self._step("val", data)

    def test_step(self, data: Any, batch_idx: int) -> None:
        self._step("test", data)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    pl.seed_everything(0)
    dataset = FakeDataset(num_graphs=80, avg_num_nodes=12, avg_degree=3, num_channels=8, num_classes=3).shuffle()
    datamodule = LightningDataset(dataset[:48], dataset[48:64], dataset[64:], batch_size=8)
    model = GraphClassifier(dataset.num_features, dataset.num_classes)
    checkpointing = ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), monitor="val_acc", mode="max")
    trainer = pl.Trainer(
        **quiet_trainer(strategy, out_dir), max_epochs=3, log_every_n_steps=1, callbacks=[checkpointing]
    )
    trainer.fit(model, datamodule)
    fitted = results(trainer, model, out_dir)
    tested = trainer.test(ckpt_path="best", datamodule=datamodule, verbose=False)
    if not trainer.is_global_zero:
        return None
    return {**fitted, "best_model": Path(checkpointing.best_model_path).name, "test": tested}
