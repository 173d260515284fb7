"""GluonTS (``gluonts[torch]``, ``lightning.pytorch``): DeepAR as its docs train it, the estimator
building the Trainer from ``trainer_kwargs`` and adding its own ``ModelCheckpoint``.

What it exercises: the training data is a stream over a Python generator (``Cyclic(...).stream()``
under the estimator's batches) that cannot be pickled and draws its windows from NumPy's global
generator, which the controller iterates for every rank (``lightning_monarch.wire.fed``); the series
are NumPy arrays (``codec``'s out-of-band buffers); after ``fit`` the estimator loads the best
checkpoint on the controller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
from gluonts.dataset.common import ListDataset
from gluonts.torch.model.deepar import DeepAREstimator

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from tests.clients import results


def _series(rng: np.random.Generator, count: int = 8, length: int = 300) -> ListDataset:
    return ListDataset(
        [
            {
                "start": "2024-01-01 00:00",
                "target": (np.sin(np.arange(length) / 4 + i) + 0.1 * rng.standard_normal(length)).astype(np.float32),
            }
            for i in range(count)
        ],
        freq="h",
    )


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    rng = np.random.default_rng(0)
    training, validation = _series(rng), _series(rng)
    pl.seed_everything(0)
    estimator = DeepAREstimator(
        freq="h",
        prediction_length=4,
        context_length=8,
        num_layers=1,
        hidden_size=8,
        batch_size=8,
        num_batches_per_epoch=3,
        trainer_kwargs={
            "max_epochs": 2,
            "accelerator": "cpu",
            "devices": 2,
            "strategy": strategy,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
            "default_root_dir": str(out_dir),
        },
    )
    output = estimator.train_model(training, validation_data=validation)
    trainer = output.trainer
    if not trainer.is_global_zero:
        return None
    return results(
        trainer, output.trained_net, out_dir, best_model=Path(trainer.checkpoint_callback.best_model_path).name
    )
