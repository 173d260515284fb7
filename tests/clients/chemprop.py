"""chemprop 2.3 (``lightning.pytorch`` namespace), as its ``examples/training.ipynb`` trains: an
``MPNN`` (``BondMessagePassing``, ``MeanAggregation``, ``RegressionFFN`` with the target scaler's
``UnscaleTransform``) on datapoints from SMILES, the user's own ``Trainer`` with
``accelerator="cpu", devices=2``, chemprop's seeded sampler, ``ModelCheckpoint`` (best and last by
``val_loss``) and ``EarlyStopping``; then ``trainer.test`` and ``trainer.predict``.

Guards: ``trainer.test(dataloaders=...)`` without a model tests the best checkpoint (the default
``ckpt_path``), and so does ``ckpt_path="best"``; both pass ``weights_only=False`` as chemprop's
CLI does, since the checkpoint's hyperparameters hold chemprop objects that a weights-only load
refuses: the workers must resolve the default ``ckpt_path`` and load with the ``weights_only`` given.

``trainer.predict`` returns the whole dataset under ``monarch`` and rank 0's shard under ``ddp``
(docs/compatibility.md, "Known differences"): the ``monarch`` side returns that shard of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import lightning_monarch  # noqa: F401  - registers strategy="monarch"
from tests.clients import results

SMILES = [
    "C", "CC", "CCC", "CCCC", "CCCCC", "CCCCCC", "CCO", "CCCO", "CCCCO", "CC(C)O",
    "CC(=O)O", "CCC(=O)O", "CC(=O)C", "CCN", "CCCN", "CC(C)N", "c1ccccc1", "Cc1ccccc1",
    "CCc1ccccc1", "Oc1ccccc1", "Nc1ccccc1", "Clc1ccccc1", "c1ccncc1", "C1CCCCC1", "C1CCCC1",
    "C1CCOC1", "C1CCNCC1", "CC(C)C", "CC(C)(C)C", "C=C", "C=CC", "C#C", "CC#N", "CS", "CCS",
    "CCOCC", "COC", "CC(=O)OC", "CC(=O)N", "O=C=O", "CCCl", "CCBr", "FC(F)F", "OCCO",
    "c1ccc2ccccc2c1", "c1ccoc1", "c1ccsc1", "CC(O)CO",
]  # fmt: skip


def loaders() -> tuple[Any, Any, Any, Any]:
    from chemprop import data, featurizers

    rng = np.random.default_rng(0)
    points = [data.MoleculeDatapoint.from_smi(s, np.array([len(s) + rng.normal() * 0.1])) for s in SMILES]
    featurizer = featurizers.SimpleMoleculeMolGraphFeaturizer()
    train_set, val_set, test_set = (
        data.MoleculeDataset(p, featurizer) for p in (points[:32], points[32:40], points[40:])
    )
    scaler = train_set.normalize_targets()
    val_set.normalize_targets(scaler)
    return (
        data.build_dataloader(train_set, batch_size=8, num_workers=0, seed=42),  # chemprop's SeededSampler
        data.build_dataloader(val_set, batch_size=8, num_workers=0, shuffle=False),
        data.build_dataloader(test_set, batch_size=8, num_workers=0, shuffle=False),
        scaler,
    )


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    from chemprop import models, nn
    from lightning import pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    pl.seed_everything(0)
    train_loader, val_loader, test_loader, scaler = loaders()
    mpnn = models.MPNN(
        nn.BondMessagePassing(d_h=32, depth=2),
        nn.MeanAggregation(),
        nn.RegressionFFN(
            input_dim=32, hidden_dim=16, output_transform=nn.UnscaleTransform.from_standard_scaler(scaler)
        ),
        batch_norm=True,
        metrics=[nn.metrics.RMSE(), nn.metrics.MAE()],
    )
    checkpointing = ModelCheckpoint(
        str(out_dir / "checkpoints"), "best-{epoch}-{val_loss:.2f}", "val_loss", mode="min", save_last=True
    )
    trainer = pl.Trainer(
        logger=False,
        enable_progress_bar=False,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=4,
        default_root_dir=str(out_dir),
        callbacks=[checkpointing, EarlyStopping("val_loss", patience=1)],
    )
    trainer.fit(mpnn, train_loader, val_loader)
    fitted = results(trainer, mpnn, out_dir)
    tested = trainer.test(dataloaders=test_loader, verbose=False, weights_only=False)  # the best checkpoint
    tested_best = trainer.test(dataloaders=test_loader, verbose=False, weights_only=False, ckpt_path="best")
    predictions = torch.cat(trainer.predict(mpnn, test_loader))
    if not trainer.is_global_zero:
        return None
    return {
        **fitted,
        "best_model_path": str(Path(checkpointing.best_model_path).relative_to(out_dir)),
        "test": tested,
        "test_best": tested_best,
        "predictions": predictions[0::2] if strategy == "monarch" else predictions,  # rank 0's shard
    }
