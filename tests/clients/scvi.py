"""scvi-tools (1.4.2, namespace ``lightning.pytorch``): an ``SCVI`` model of single-cell counts,
trained with ``model.train(accelerator="cpu", devices=2, strategy=...)`` as scvi's docs show for
several devices: ``"ddp_find_unused_parameters_true"`` under ``ddp`` and its counterpart
``"ddp_monarch_find_unused_parameters_true"`` under ``monarch``.

``model.train`` builds its own Trainer (``scvi.train.Trainer``) and LightningDataModule
(``scvi.dataloaders.DataSplitter``), and decides by the strategy's *name* (``"ddp" in strategy``)
whether to shard the data with its ``BatchDistributedSampler``: the ``ddp_monarch`` names, which
``lightning_monarch.strategy`` registers, keep that sharding. ``DataSplitter.setup``, run on each
rank (each Monarch worker), splits train from validation with
``np.random.RandomState(scvi.settings.seed)``; the script sets ``scvi.settings.seed = 0`` as scvi's
docs do, which under ``ddp`` every rank does by re-running it, and under ``monarch`` only the
controller does. Guards the carry of a library's settings object to the workers
(``controller.mesh.imported_state``; without it each worker splits at random), and the
``ddp_monarch`` names.

Compares the module's weights, ``callback_metrics``, ``global_step`` and ``model.history`` (the
logged metrics per epoch, as plain lists of floats).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anndata
import numpy as np
import scvi

import lightning_monarch  # noqa: F401  registers strategy="monarch" and the ddp_monarch names
from tests.clients import results

#: The strategy names scvi's users pass, by the tier's strategy.
STRATEGIES = {"ddp": "ddp_find_unused_parameters_true", "monarch": "ddp_monarch_find_unused_parameters_true"}


def train(strategy: str, out_dir: Path) -> dict[str, Any] | None:
    out_dir.mkdir(parents=True, exist_ok=True)
    scvi.settings.seed = 0
    scvi.settings.logging_dir = str(out_dir)
    rng = np.random.default_rng(0)
    n_cells, n_genes = 256, 40
    adata = anndata.AnnData(rng.poisson(3.0, size=(n_cells, n_genes)).astype(np.float32))
    adata.obs["batch"] = np.where(np.arange(n_cells) % 2 == 0, "a", "b")
    scvi.model.SCVI.setup_anndata(adata, batch_key="batch")
    model = scvi.model.SCVI(adata, n_hidden=16, n_latent=4, n_layers=1)
    model.train(
        max_epochs=2,
        accelerator="cpu",
        devices=2,
        strategy=STRATEGIES[strategy],
        train_size=0.75,
        batch_size=32,
        check_val_every_n_epoch=1,
        early_stopping=False,
        enable_progress_bar=False,
    )
    trainer = model.trainer
    if not trainer.is_global_zero:
        return None
    history = {
        key: {column: [float(value) for value in frame[column]] for column in frame.columns}
        for key, frame in model.history.items()
    }
    return results(trainer, model.module, out_dir, history=history)
