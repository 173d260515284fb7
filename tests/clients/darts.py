"""darts (0.48.1, ``darts[torch]``, namespace ``pytorch_lightning``): a ``TiDEModel`` forecaster
with dropout, trained with ``pl_trainer_kwargs={"accelerator": "cpu", "devices": 2, "strategy": ...}``
as darts' docs show for several devices, ``"ddp"`` or ``"monarch"``, then asked to ``predict`` on one device.

darts builds the Trainer itself from ``pl_trainer_kwargs`` and its own LightningDataModule, and
seeds the model as its docs do, with ``random_state=42`` and no ``seed_everything``: ``fit`` runs
under ``darts.utils.torch.random_method``, inside ``torch.random.fork_rng()`` after
``torch.manual_seed(<drawn from random_state>)``. Under ``ddp`` every rank starts training from
that torch generator; no ``PL_GLOBAL_SEED`` reseeds the ranks, so dropout's masks depend on it.
Guards the controller's torch generator carried to the workers at a stage's start
(``specs.TorchRngStart``, set in ``lightning_monarch/worker/stage.py``).

Compares the network's weights, ``callback_metrics``, ``global_step``, the checkpoints darts saves
under ``work_dir`` (their loss and metric modules as
class and state) and the forecast ``predict`` returns (its values, as a tensor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from darts import TimeSeries
from darts.models import TiDEModel

import lightning_monarch  # noqa: F401  registers strategy="monarch" in both namespaces
from tests.clients import results


def train(strategy: str, out_dir: Path) -> dict[str, Any] | None:
    # darts makes its runs folder if it is missing, at construction: under ddp both ranks construct
    # the model at once, and the later one's os.mkdir raised FileExistsError once in the suite
    (out_dir / "tide").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    t = np.arange(200, dtype=np.float32)
    series = TimeSeries.from_values((np.sin(t / 6) + 0.1 * rng.standard_normal(200)).astype(np.float32))
    train_series, val_series = series[:150], series[150:]
    model = TiDEModel(
        input_chunk_length=12,
        output_chunk_length=4,
        hidden_size=16,
        num_encoder_layers=1,
        num_decoder_layers=1,
        decoder_output_dim=4,
        temporal_decoder_hidden=8,
        dropout=0.1,
        batch_size=16,
        n_epochs=2,
        random_state=42,
        model_name="tide",
        work_dir=str(out_dir),
        save_checkpoints=True,
        pl_trainer_kwargs={
            "accelerator": "cpu",
            "devices": 2,
            "strategy": strategy,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
            "default_root_dir": str(out_dir),
        },
    )
    model.fit(train_series, val_series=val_series)
    trainer = model.trainer
    if not trainer.is_global_zero:
        return None
    # darts predicts on one device: its Trainer of ``pl_trainer_kwargs`` would split one series' one
    # window between 2 ranks, and each rank would return its own share
    single = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out_dir),
    )
    forecast = model.predict(n=4, series=train_series, trainer=single)
    return results(trainer, model.model, out_dir, predict=torch.from_numpy(forecast.values().copy()))
