"""Fault tolerance: a worker killed with a real SIGKILL, or hung, mid-fit. With restarts, the run
finishes with the weights, steps, logged rows and checkpoints of an undisturbed run; without,
the controller gets a clear error within seconds, naming the rank, and no worker is left."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_monarch import MeshFailureError, MonarchStrategy, WorkerTimeoutError, observe_only
from tests.conftest import stray_workers, worker_processes
from tests.models import Classifier

pytestmark = pytest.mark.timeout(180)


class KillRank(L.Callback):
    """SIGKILLs worker ``rank`` once, from the controller, when ``global_step`` reaches ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.killed_at: Optional[float] = None
        self.resumed_at: Optional[float] = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.killed_at is None and trainer.global_step == self.step:
            os.kill(trainer.strategy.worker_pids[self.rank], signal.SIGKILL)
            self.killed_at = time.monotonic()
        elif self.killed_at is not None and self.resumed_at is None:
            self.resumed_at = time.monotonic()


def _fit(out: Path, strategy: MonarchStrategy, callbacks: list[L.Callback]) -> tuple[L.Trainer, Classifier]:
    L.seed_everything(1234)
    model = Classifier()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        log_every_n_steps=2,
        logger=CSVLogger(str(out), name="logs", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=str(out / "checkpoints"), monitor="val_loss", save_last=True), *callbacks],
    )
    trainer.fit(model)
    return trainer, model


@pytest.mark.parametrize(
    ("step", "origin", "leading"),
    [
        (3, "the start of the stage", False),  # 6 steps per epoch
        (8, "the snapshot at the start of epoch 1", False),
        # the killer observes only: the workers are up to 4 batches ahead of it when it kills
        (8, "the snapshot at the start of epoch 1", True),
    ],
    ids=["in epoch 0", "in epoch 1", "in epoch 1, workers 4 batches ahead"],
)
def test_killed_worker_is_replaced_and_the_run_ends_as_if_undisturbed(
    tmp_path: Path, caplog: Any, step: int, origin: str, leading: bool
) -> None:
    reference, reference_model = _fit(tmp_path / "undisturbed", MonarchStrategy(max_restarts=1), [])
    killer = observe_only(KillRank(rank=1, step=step)) if leading else KillRank(rank=1, step=step)
    with caplog.at_level(logging.WARNING, logger="lightning_monarch.controller.mesh.channel"):
        trainer, model = _fit(tmp_path / "killed", MonarchStrategy(max_restarts=1, max_ahead=4), [killer])
    assert killer.killed_at is not None and killer.resumed_at is not None
    assert trainer.strategy.restarts == 1 and reference.strategy.restarts == 0
    recovered = [record.getMessage() for record in caplog.records if "recovered" in record.getMessage()]
    assert len(recovered) == 1 and "rank(s) [1]" in recovered[0] and origin in recovered[0], recovered
    assert trainer.global_step == reference.global_step == 18
    for key, value in reference_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert dict(trainer.callback_metrics) == dict(reference.callback_metrics)
    logs = [(tmp_path / run / "logs" / "version_0" / "metrics.csv").read_text() for run in ("undisturbed", "killed")]
    assert logs[0] == logs[1], "a logged row was lost or written twice"
    checkpoints = [
        torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=False)
        for run in ("undisturbed", "killed")
    ]
    for key, value in checkpoints[0]["state_dict"].items():
        assert torch.equal(checkpoints[1]["state_dict"][key], value), key
    assert checkpoints[0]["loops"] == checkpoints[1]["loops"]


def test_killed_worker_without_restarts_is_named_within_5_s(tmp_path: Path) -> None:
    killer = KillRank(rank=1, step=5)
    with pytest.raises(MeshFailureError, match=r"Worker rank 1 \(pid \d+ on \S+\) died") as error:
        _fit(tmp_path, MonarchStrategy(), [killer])
    assert time.monotonic() - killer.killed_at < 5
    assert error.value.ranks == (1,)
    assert not worker_processes()


class HangOnRank1(Classifier):
    """Rank 1 stops answering in a hook outside any collective, as a deadlocked worker would."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 1 and batch_idx == 2:
            time.sleep(3600)


def test_hung_worker_is_named_by_the_step_timeout() -> None:
    trainer = L.Trainer(
        strategy=MonarchStrategy(step_timeout=6),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    started = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"Worker ranks \[1\] did not answer within 6 s") as error:
        trainer.fit(HangOnRank1())
    assert error.value.ranks == (1,)
    assert time.monotonic() - started < 60
    assert not worker_processes()


def test_checkpoint_of_another_model_is_refused_and_leaves_the_good_checkpoint(tmp_path: Path) -> None:
    _fit(tmp_path, MonarchStrategy(), [])
    good = tmp_path / "checkpoints" / "last.ckpt"
    before = good.read_bytes()
    other = tmp_path / "other.ckpt"
    torch.save({**torch.load(good, weights_only=False), "state_dict": {"net.0.weight": torch.zeros(3, 3)}}, other)
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"), save_last=True)],
    )
    with pytest.raises(RuntimeError, match=r"size mismatch for net.0.weight"):
        trainer.fit(Classifier(), ckpt_path=str(other))
    assert good.read_bytes() == before
    assert not stray_workers()
