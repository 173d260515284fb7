"""The elastic tests' runs: one recipe for ``monarch`` on hosts that come and go, and for
Lightning's own ``ddp`` stopped at each resume point where the world changed and resumed there
with the new number of processes.

Imported by the test process, by the Monarch workers (which unpickle the model) and by ``ddp``'s
ranks, each of which runs it as ``python -m tests.elastic_runs OUT_DIR SEQUENCE INDEX``
(``tests.references``). Run ``INDEX`` of a :data:`SEQUENCES` entry resumes from the checkpoint that the run
before it saved after its ``fit``, as a stopped ``ddp`` run leaves it; the last run's rank 0
saves what the test compares in ``results.pt``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_monarch.worker.notices import noticed
from tests.models import Classifier

SEED = 1234
MAX_EPOCHS = 4
#: The global step at whose end host 1's workers see its preemption notice.
NOTICE_AT_STEP = 16
#: Each ``ddp`` run of a sequence: its processes, ``accumulate_grad_batches`` (the same global
#: batch), ``max_epochs`` (the epoch whose start is the next resume point) and the global step at
#: whose end it stops instead, saving its checkpoint there as ``ModelCheckpoint`` would (``None``:
#: it runs to ``max_epochs``).
SEQUENCES: dict[str, list[tuple[int, int, int, Optional[int]]]] = {
    # host 1 of 2 lost in epoch 2
    "shrink": [(2, 1, 2, None), (1, 2, MAX_EPOCHS, None)],
    # and back at the start of epoch 3
    "shrink_and_grow": [(2, 1, 2, None), (1, 2, 3, None), (2, 1, MAX_EPOCHS, None)],
    # host 1 of 2 gets a preemption notice in epoch 2
    "preempt": [(2, 1, MAX_EPOCHS, NOTICE_AT_STEP), (1, 2, MAX_EPOCHS, None)],
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


class StopAtStepEnd(L.Callback):
    """Ends a ``ddp`` run at the end of global step ``step``, its checkpoint saved at ``path`` first,
    as a run whose hosts are taken away right after a ``ModelCheckpoint`` saved there."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(str(self.path))
            trainer.strategy.barrier()
            os._exit(0)


class PreemptOwnHost(L.Callback):
    """A worker callback: at the end of global step ``step``, the worker of rank ``rank`` sends
    SIGTERM to its host process (``host``, its process ID) and to itself, as a preemptible host's
    processes get it, and waits until its host has written the notice, so that every worker sees
    it at the next step's end. (A worker of a host served on this machine is the fork server's
    child, not its host's: ``hosts.served_here``.)"""

    def __init__(self, rank: int, step: int, host: int) -> None:
        self.rank, self.step, self.host = rank, step, host

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        os.kill(self.host, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not noticed() and time.monotonic() < deadline:
            time.sleep(0.05)


def _ddp(out_dir: Path, sequence: str, index: int) -> None:
    devices, accumulate, max_epochs, stop_at = SEQUENCES[sequence][index]
    L.seed_everything(SEED)
    model = Classifier()
    stopped = out_dir / f"stopped_{index}.ckpt"
    run = trainer(
        out_dir,
        "ddp",
        [StopAtStepEnd(stop_at, stopped)] if stop_at is not None else [],
        devices=devices,
        accumulate_grad_batches=accumulate,
        max_epochs=max_epochs,
    )
    run.fit(model, ckpt_path=str(out_dir / f"stopped_{index - 1}.ckpt") if index else None)
    run.save_checkpoint(str(stopped))
    if index == len(SEQUENCES[sequence]) - 1 and run.is_global_zero:
        torch.save(results(run, model, out_dir), out_dir / "results.pt")


if __name__ == "__main__":
    _ddp(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
