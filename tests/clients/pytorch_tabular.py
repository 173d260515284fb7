"""pytorch-tabular 1.2 (``pytorch_lightning`` namespace): ``TabularModel.cross_validate`` (2 folds),
then ``evaluate`` and ``predict``, with ``accelerator="cpu", devices=2``.

``TabularModel`` builds the ``pytorch_lightning.Trainer`` itself; the strategy goes in only by
name, ``TrainerConfig(trainer_kwargs={"strategy": ...})``. Guards: the folds run on one
``TabularModel``, and after each fold pytorch-tabular calls ``model.reset_weights()``, which draws
from the process's RNG, so the next fold trains from weights that are ``ddp``'s only if the
controller takes rank 0's generators back after a stage; ``evaluate`` is ``trainer.test`` on the
last fold's Trainer (its best checkpoint loaded on rank 0); ``predict`` is pytorch-tabular's own
loop on the controller's module (rank 0's weights).

pytorch-tabular's run counter ``.pt_tmp/exp_version_manager.yml`` goes under the cwd whatever is
passed, and its count (racy across processes) names the checkpoint files; the names are returned
with it replaced by ``UID``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import lightning_monarch  # noqa: F401  - registers the strategy names of pytorch_lightning too
from tests.clients import results


def frames() -> tuple[Any, Any]:
    import pandas as pd

    rng = np.random.default_rng(0)
    n = 256
    df = pd.DataFrame(
        {
            "a": rng.normal(size=n).astype("float32"),
            "b": rng.normal(size=n).astype("float32"),
            "c": rng.integers(0, 4, n).astype(str),
        }
    )
    df["target"] = (2 * df.a - df.b + (df.c == "1") + 0.1 * rng.normal(size=n)).astype("float32")
    return df.iloc[:192].reset_index(drop=True), df.iloc[192:].reset_index(drop=True)


def comparable(value: Any, out_dir: Path, uid: int) -> Any:
    """Checkpoint contents without what differs by design: ``out_dir``, the strategy's name, the run
    counter; pytorch-tabular's ``DictConfig`` hyperparameters as plain containers."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, dict):
        return {
            comparable(k, out_dir, uid): ("STRATEGY" if k == "strategy" else comparable(v, out_dir, uid))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [comparable(v, out_dir, uid) for v in value]
    if isinstance(value, str):
        return value.replace(str(out_dir), "OUT_DIR").replace(f"-{uid}_", "-UID_")
    return value


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    from pytorch_lightning import seed_everything
    from pytorch_tabular import TabularModel
    from pytorch_tabular.config import DataConfig, OptimizerConfig, TrainerConfig
    from pytorch_tabular.models import CategoryEmbeddingModelConfig

    train_frame, valid = frames()
    tabular_model = TabularModel(
        data_config=DataConfig(target=["target"], continuous_cols=["a", "b"], categorical_cols=["c"]),
        model_config=CategoryEmbeddingModelConfig(task="regression", layers="16-8", dropout=0.1),
        optimizer_config=OptimizerConfig(),
        trainer_config=TrainerConfig(
            batch_size=32,
            max_epochs=2,
            accelerator="cpu",
            devices=2,
            seed=42,
            progress_bar="none",
            checkpoints_path=str(out_dir / "saved_models"),
            trainer_kwargs={"strategy": strategy, "default_root_dir": str(out_dir)},
        ),
        verbose=False,
    )
    seed_everything(42)
    cv_metrics, _ = tabular_model.cross_validate(cv=2, train=train_frame, reset_datamodule=False, verbose=False)
    trainer = tabular_model.trainer
    rng = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np.random.get_state()[1].copy())}
    fitted = results(trainer, tabular_model.model, out_dir)
    evaluated = tabular_model.evaluate(valid, verbose=False)  # trainer.test, on every ddp rank
    if not trainer.is_global_zero:
        return None
    predicted = tabular_model.predict(valid)  # pytorch-tabular's own loop, no Trainer
    return {
        **fitted,
        "rng_after_cross_validate": rng,
        "cv_metrics": [float(m) for m in cv_metrics],
        "evaluate": [{k: float(v) for k, v in row.items()} for row in evaluated],
        "predictions": torch.from_numpy(predicted["target_prediction"].to_numpy().copy()),
        "checkpoints": comparable(fitted["checkpoints"], out_dir, tabular_model.uid),
    }
