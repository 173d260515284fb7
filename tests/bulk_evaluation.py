"""Evaluation loops long enough for the controller to take batches in bulk
(``lightning_monarch.controller.loop.bulk``), run the same under ``ddp`` and ``monarch``.

Usage under ``ddp`` (``tests.references.run_reference``): ``python -m tests.bulk_evaluation OUT_DIR``;
rank 0 saves :func:`run`'s results to ``OUT_DIR/results.pt`` and every rank its predictions.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from tests.models import ClassificationData, Classifier

SEED = 1234
#: Batches each of the 2 ranks validates, tests and predicts.
BATCHES_PER_RANK = 40
REFRESH_RATES = (1, 20)


class BulkEvaluated(Classifier):
    """Validation, test and prediction sets of 40 batches a rank, values logged per batch."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._log_step("val", batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._log_step("test", batch, batch_idx)

    def _log_step(self, stage: str, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log(f"{stage}_loss", nn.functional.cross_entropy(self(x), y), on_step=True, on_epoch=True, sync_dist=True)
        self.log(f"{stage}_index", float(batch_idx), on_step=True, on_epoch=True, reduce_fx="max")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])

    def _loader(self, size: int, shuffle: bool) -> DataLoader:
        """Every loader: batches of 2, 40 a rank (``size`` is the training set's, unused here)."""
        return DataLoader(ClassificationData(2 * 2 * BATCHES_PER_RANK), batch_size=2, shuffle=shuffle)


class DrawRecordingBar(TQDMProgressBar):
    """Lightning's TQDM bar, recording the count its evaluation bars show at each draw. Its batch
    hooks are ``TQDMProgressBar``'s own, so the bulk path stays on."""

    def __init__(self, refresh_rate: int) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.draws: list[tuple[str, int]] = []

    def init_validation_tqdm(self) -> Any:
        return self._recording(super().init_validation_tqdm(), "validation")

    def init_test_tqdm(self) -> Any:
        return self._recording(super().init_test_tqdm(), "test")

    def _recording(self, bar: Any, stage: str) -> Any:
        refresh = bar.refresh

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.draws.append((stage, bar.n))
            return refresh(*args, **kwargs)

        bar.refresh = recorded
        return bar


class CountsBatchesOnTheInstance(L.Callback):
    """Counts validation batches through a hook set on the instance, not on the class, and logs
    the count at the epoch's end."""

    def __init__(self) -> None:
        self.count = 0
        self.on_validation_batch_end = self._counted

    def _counted(self, *args: Any) -> None:
        self.count += 1

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("batches_counted", float(self.count))


def evaluation_trainer(strategy: Any, out_dir: Path, name: str, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        logger=CSVLogger(out_dir, name=name),
        callbacks=callbacks,
        enable_progress_bar=any(isinstance(callback, TQDMProgressBar) for callback in callbacks),
        enable_checkpointing=False,
        enable_model_summary=False,
    )


def run(strategy: Any, out_dir: Path) -> Optional[dict[str, Any]]:
    """Validate and test at each refresh rate, validate with :class:`CountsBatchesOnTheInstance`,
    and predict; rank 0's results (``None`` on the other ranks of ``ddp``), each rank's
    predictions in ``out_dir/predictions{rank}.pt``."""
    results: dict[str, Any] = {}
    for refresh_rate in REFRESH_RATES:
        L.seed_everything(SEED)
        bar = DrawRecordingBar(refresh_rate)
        trainer = evaluation_trainer(strategy, out_dir, f"refresh{refresh_rate}", [bar])
        model = BulkEvaluated()
        results[f"refresh{refresh_rate}"] = {
            "validate": trainer.validate(model, verbose=False),
            "validate_metrics": _floats(trainer.callback_metrics),
            "test": trainer.test(model, verbose=False),
            "test_metrics": _floats(trainer.callback_metrics),
            "draws": bar.draws,
        }
    L.seed_everything(SEED)
    trainer = evaluation_trainer(strategy, out_dir, "counted", [CountsBatchesOnTheInstance()])
    results["counted"] = trainer.validate(BulkEvaluated(), verbose=False)
    L.seed_everything(SEED)
    predictions = trainer.predict(BulkEvaluated(), return_predictions=True)
    torch.save(torch.cat(predictions), out_dir / f"predictions{trainer.global_rank}.pt")
    if not trainer.is_global_zero:
        return None
    results["csv"] = {
        name: (out_dir / name / "version_0" / "metrics.csv").read_text()
        for name in ("refresh1", "refresh20", "counted")
    }
    return results


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    ranked = run("ddp", out)
    if ranked is not None:
        torch.save(ranked, out / "results.pt")
