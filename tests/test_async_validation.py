"""``MonarchStrategy(validation="async")``: a second mesh validates while training goes on, and the
fit gives what the synchronous run gives (``controller.loop.validation_replay``). What it refuses:
``tests/test_bad_input.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lightning_monarch import MonarchStrategy
from tests.models import PlaceRecordingClassifier
from tests.parity_cases import comparable_checkpoint
from tests.test_parity import assert_same


class RowLogger(Logger):
    """Keeps every row the Trainer logs, with its step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[Optional[int], dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self.rows.append((step, {key: float(value) for key, value in metrics.items()}))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _fit(validation: str, root: Path) -> dict[str, Any]:
    """A two-epoch fit of a classifier with dropout that validates twice an epoch, checkpointing at
    each training epoch's end; what it logged, kept, saved and where its steps ran."""
    for name in ("places", "checkpoints"):
        (root / name).mkdir(parents=True)
    L.seed_everything(7)
    model = PlaceRecordingClassifier()
    model.record_dir = str(root / "places")
    logger = RowLogger()
    trainer = L.Trainer(
        strategy=MonarchStrategy(validation=validation),
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        val_check_interval=0.5,
        log_every_n_steps=2,
        logger=logger,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", save_on_train_epoch_end=True, save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    places: dict[str, set[str]] = {}
    for path in (root / "places").iterdir():
        step, pid = path.name.split("-")
        places.setdefault(step, set()).add(pid)
    return {
        "rows": logger.rows,
        "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "weights": model.state_dict(),
        "rng": torch.get_rng_state(),
        "checkpoints": {path.name: comparable_checkpoint(path) for path in (root / "checkpoints").iterdir()},
        "places": places,
    }


def test_async_validation_gives_the_synchronous_results(tmp_path: Path) -> None:
    asynchronous = _fit("async", tmp_path / "async")
    synchronous = _fit("sync", tmp_path / "sync")
    # the validations ran on other processes than the training steps, and synchronously on the same
    assert not asynchronous["places"]["validation"] & asynchronous["places"]["train"]
    assert synchronous["places"]["validation"] == synchronous["places"]["train"]
    validated = [step for step, row in synchronous["rows"] if "val_loss" in row]
    assert len(validated) == 4 and len(set(validated)) == 4  # twice an epoch, each at its own step
    assert asynchronous["rows"] == synchronous["rows"]
    assert asynchronous["callback_metrics"] == synchronous["callback_metrics"]
    assert "val_acc" in synchronous["callback_metrics"]
    assert (
        sorted(asynchronous["checkpoints"])
        == sorted(synchronous["checkpoints"])
        == ["epoch=1-step=12.ckpt", "last.ckpt"]
    )
    # the weights, the optimizer, the loops (the validation loop's progress too) and the generators
    assert_same(asynchronous["checkpoints"], synchronous["checkpoints"], "checkpoints")
    assert_same(asynchronous["weights"], synchronous["weights"], "weights")
    assert torch.equal(asynchronous["rng"], synchronous["rng"])
