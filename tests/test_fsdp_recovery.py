"""Recovery under ``MonarchFSDPStrategy(max_restarts=k)``: no worker holds a replica,
so every worker writes its shards into a sharded snapshot at each epoch start, and replacement
workers resume from it. A worker SIGKILLed mid-epoch after the first snapshot is replaced, and the
run ends with the losses, metrics and full weights of an undisturbed run, bit for bit."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_monarch import MonarchFSDPStrategy, WorkerError
from tests.parity_cases import SEED, TokenTransformer

pytestmark = pytest.mark.timeout(180)

#: 48 samples in batches of 4 over 2 workers: 6 steps per epoch.
_STEPS_PER_EPOCH = 6


class KillRankInEpoch1(L.Callback):
    """SIGKILLs worker ``rank`` once, from the controller, in the middle of epoch 1, after the
    snapshot at its start; notes what the snapshot directory held then."""

    def __init__(self, rank: int, snapshot_dir: Path) -> None:
        self.rank, self.snapshot_dir = rank, snapshot_dir
        self.snapshots: Optional[list[Path]] = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.snapshots is None and trainer.global_step == _STEPS_PER_EPOCH + 2:
            self.snapshots = sorted(path.relative_to(self.snapshot_dir) for path in self.snapshot_dir.glob("*/*"))
            os.kill(trainer.strategy.worker_pids[self.rank], signal.SIGKILL)


def _fit(
    snapshot_dir: Path, callbacks: list[L.Callback], model_class: type[TokenTransformer] = TokenTransformer
) -> tuple[L.Trainer, TokenTransformer, dict[str, Any]]:
    L.seed_everything(SEED)
    model = model_class()
    strategy = MonarchFSDPStrategy(fsdp_policy={nn.TransformerEncoderLayer}, max_restarts=1, snapshot_dir=snapshot_dir)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model)
    return trainer, model, strategy.gather_full_state_dict()


def test_killed_sharded_worker_resumes_from_the_sharded_snapshot(tmp_path: Path, caplog: Any) -> None:
    reference, reference_model, reference_weights = _fit(tmp_path / "undisturbed", [])
    killer = KillRankInEpoch1(rank=0, snapshot_dir=tmp_path / "killed")
    with caplog.at_level(logging.WARNING, logger="lightning_monarch.controller.mesh.worker_mesh"):
        trainer, model, weights = _fit(tmp_path / "killed", [killer])

    # at the kill, the stage's one snapshot directory held the snapshot of epoch 1 only
    assert killer.snapshots is not None and [path.name for path in killer.snapshots] == ["epoch=1"]
    assert trainer.strategy.restarts == 1 and reference.strategy.restarts == 0
    recovered = [record.getMessage() for record in caplog.records if "recovered" in record.getMessage()]
    assert len(recovered) == 1, recovered
    assert "rank(s) [0]" in recovered[0] and "the snapshot at the start of epoch 1" in recovered[0], recovered
    assert trainer.global_step == reference.global_step == 3 * _STEPS_PER_EPOCH
    assert model.losses == reference_model.losses and len(model.losses) == 3 * _STEPS_PER_EPOCH
    assert dict(trainer.callback_metrics) == dict(reference.callback_metrics)
    assert set(weights) == set(reference_weights)
    for name, weight in reference_weights.items():
        assert torch.equal(weights[name], weight), name
    # the stage removed its snapshots when it ended
    assert list((tmp_path / "killed").iterdir()) == [] and list((tmp_path / "undisturbed").iterdir()) == []


class RaiseInEpoch1(TokenTransformer):
    """Raises in a step of epoch 1, after its snapshot: an error in user code, which is not retried."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.current_epoch == 1 and batch_idx == 1:
            raise ValueError("bad batch")
        return super().training_step(batch, batch_idx)


def test_failed_sharded_stage_removes_its_snapshots(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match="bad batch"):
        _fit(tmp_path, [], RaiseInEpoch1)
    assert list(tmp_path.iterdir()) == []


def test_sharded_recovery_on_several_hosts_needs_a_shared_snapshot_dir() -> None:
    """Refused at ``Trainer(...)``, before any host is reached: the default snapshot directory is on
    the controller's host only."""
    strategy = MonarchFSDPStrategy(max_restarts=1, hosts=["tcp://node-1:26600", "tcp://node-2:26600"])
    with pytest.raises(MisconfigurationException, match=r"on 2 hosts: .* Pass `snapshot_dir=` a path on a file system"):
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2)
