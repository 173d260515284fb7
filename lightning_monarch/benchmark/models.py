"""The model the benchmarks train: an MLP classifier in three sizes, on seeded random data.

Used by ``lightning-monarch benchmark`` and by the repository's full suite under ``benchmarks/``.
Imported by the controller and, by module path, by the workers that train it.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

#: (input features, hidden width, depth, batch size) per size; the step times are what these take
#: on the 2-core development machine with 2 workers: about 3 ms, 30 ms and 200 ms. ``400mib``
#: has six ``Linear(4096, 4096)`` (100 M parameters, 400 MiB in fp32) and small batches: a model
#: whose weights, not its steps, are what a stage must move.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "small": (32, 64, 2, 32),
    "medium": (256, 768, 4, 192),
    "large": (512, 1536, 6, 256),
    "400mib": (4096, 4096, 6, 8),
}


def make_network(size: str) -> nn.Module:
    features, hidden, depth, _ = SIZES[size]
    layers: list[nn.Module] = [nn.Linear(features, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, 10))


def make_dataset(size: str, batches: int) -> TensorDataset:
    features, _, _, batch_size = SIZES[size]
    generator = torch.Generator().manual_seed(0)
    count = batches * batch_size
    return TensorDataset(
        torch.randn(count, features, generator=generator), torch.randint(0, 10, (count,), generator=generator)
    )


class BenchModel(L.LightningModule):
    """A plain classifier, as most projects write one: loss logged every step."""

    def __init__(self, size: str, batches: int) -> None:
        super().__init__()
        self.size, self.batches = size, batches
        self.net = make_network(size)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).softmax(-1)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def _loader(self) -> DataLoader:
        return DataLoader(make_dataset(self.size, self.batches), batch_size=SIZES[self.size][3])

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader()

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader()

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader()


class SleepingModel(BenchModel):
    """The benchmark model whose training step only sleeps :attr:`STEP_S` and steps its optimizer
    (manual optimization, no backward, so no gradient to all-reduce and no update): workers that wait, as for a GPU, so that the
    controller's own CPU per batch can be measured with many of them on a few cores, their steps
    as long with 16 of them as with 2."""

    #: 50 ms: long enough that 16 workers sharing 2 cores keep their steps about as long as 2 do.
    STEP_S = 0.05

    def __init__(self, size: str, batches: int) -> None:
        super().__init__(size, batches)
        self.automatic_optimization = False

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        time.sleep(self.STEP_S)
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)
        optimizer.step()  # what counts the step towards max_steps
