"""The elastic tests' runs: one recipe for ``monarch`` on hosts that come and go, and for
Lightning's own ``ddp`` stopped at each resume point where the world changed and resumed there
with the new number of processes.

Imported by the test process, by the Monarch workers (which unpickle the model) and by ``ddp``'s
ranks, which run it as ``python -m tests.elastic_runs OUT_DIR SEQUENCE INDEX`` (``ddp``
re-executes the command it was started with for each rank, which inside pytest would be pytest
itself). Run ``INDEX`` of a :data:`SEQUENCES` entry resumes from the checkpoint that the run
before it saved after its ``fit``, as a stopped ``ddp`` run leaves it; the last run's rank 0
saves what the test compares in ``results.pt``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from tests.models import Classifier

SEED = 1234
MAX_EPOCHS = 4
#: Each ``ddp`` run of a sequence: its processes, ``accumulate_grad_batches`` (the same global
#: batch) and ``max_epochs`` (the epoch whose start is the next resume point).
SEQUENCES = {
    # host 1 of 2 lost in epoch 2
    "shrink": [(2, 1, 2), (1, 2, MAX_EPOCHS)],
    # and back at the start of epoch 3
    "shrink_and_grow": [(2, 1, 2), (1, 2, 3), (2, 1, MAX_EPOCHS)],
}


def trainer(out_dir: Path, strategy: Any, callbacks: Sequence[L.Callback] = (), **options: Any) -> L.Trainer:
    """The Trainer both strategies run, writing into ``out_dir``."""
    options = {"max_epochs": MAX_EPOCHS, **options}
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        log_every_n_steps=2,
        logger=CSVLogger(str(out_dir), name="logs", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), monitor="val_loss", save_last=True),
            *callbacks,
        ],
        **options,
    )


def results(trainer: L.Trainer, model: L.LightningModule, out_dir: Path) -> dict[str, Any]:
    """What the test compares of a finished run."""
    return {
        "weights": {key: value.detach().clone() for key, value in model.state_dict().items()},
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "csv": (out_dir / "logs" / "version_0" / "metrics.csv").read_text(),
    }


def _ddp(out_dir: Path, sequence: str, index: int) -> None:
    devices, accumulate, max_epochs = SEQUENCES[sequence][index]
    L.seed_everything(SEED)
    model = Classifier()
    run = trainer(out_dir, "ddp", devices=devices, accumulate_grad_batches=accumulate, max_epochs=max_epochs)
    run.fit(model, ckpt_path=str(out_dir / f"stopped_{index - 1}.ckpt") if index else None)
    run.save_checkpoint(str(out_dir / f"stopped_{index}.ckpt"))
    if index == len(SEQUENCES[sequence]) - 1 and run.is_global_zero:
        torch.save(results(run, model, out_dir), out_dir / "results.pt")


if __name__ == "__main__":
    _ddp(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
