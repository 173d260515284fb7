"""The warm mesh: worker processes kept between stages and Trainers when the configuration agrees,
replaced when it does not or when a worker died, and stopped on request and at interpreter exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import psutil
import pytest
import torch

import lightning_monarch
from lightning_monarch import MonarchStrategy
from lightning_monarch.controller.mesh.pool import MESHES
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from tests.conftest import ROOT, probe_warm_workers, probe_workers, worker_processes
from tests.models import Classifier

pytestmark = pytest.mark.timeout(180)


def _trainer(strategy: Any = "monarch", devices: int = 2, batches: tuple[int, int] = (4, 2)) -> L.Trainer:
    """A quiet Trainer of one epoch of ``batches`` (training, validation) batches."""
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        limit_train_batches=batches[0],
        limit_val_batches=batches[1],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_stages_and_trainers_share_one_mesh() -> None:
    """Lightning's default backend on CPUs is ``gloo``: a Trainer that names it runs on the same mesh."""
    _trainer().fit(Classifier())
    pids = MESHES.worker_pids()
    assert len(pids) == 2 and sorted(pids) == sorted(p.pid for p in worker_processes())
    trainer = _trainer(MonarchStrategy(process_group_backend="gloo"))
    trainer.fit(Classifier())
    trainer.validate(Classifier(), verbose=False)
    trainer.predict(Classifier())
    assert MESHES.worker_pids() == pids
    assert trainer.global_step == 4


def test_a_warm_workers_garbage_collection_leaves_out_what_the_process_imported() -> None:
    """The collection at a stage's end walks what stages made, not the ~400,000 objects of torch,
    Lightning and Monarch (``gc.freeze`` when the worker actor starts): some 200 ms per stage."""
    _trainer().fit(Classifier())
    counts = probe_warm_workers("garbage_collector")
    assert len(counts) == 2
    for count in counts:
        assert count["frozen"] > 100_000, count
        assert count["tracked"] < count["frozen"] / 4, count


class SeesItsOwnSettings(Classifier):
    """Fails in ``training_step`` where the worker's process does not have its stage's settings:
    its own seed variable (or none) and script folder, and no other stage's folder."""

    def __init__(self, seed: Optional[str], folder: str, other: str) -> None:
        super().__init__()
        self.expected = (seed, folder, other)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        seed, folder, other = self.expected
        assert os.environ.get("PL_GLOBAL_SEED") == seed, os.environ.get("PL_GLOBAL_SEED")
        assert folder in sys.path and other not in sys.path, sys.path
        return super().training_step(batch, batch_idx)


def test_a_warm_worker_undoes_each_stages_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's logger levels, warning filter, script folder and seed variables are undone when it
    ends: the next stage on the warm worker sees its own, and the process is left as a fresh one.
    The first stage, unseeded, starts the mesh; the second is seeded."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # unset while the workers start, and at the end
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    fresh_mesh = WorkerMesh.spawn(2)
    try:
        fresh = probe_workers(fresh_mesh, "stage_settings")
    finally:
        fresh_mesh.stop()
    folders = [str(tmp_path / name) for name in ("first", "second")]
    for index, (folder, seed) in enumerate(zip(folders, (None, 8), strict=True)):
        monkeypatch.setattr(sys.modules["__main__"], "__file__", os.path.join(folder, "train.py"), raising=False)
        if seed is not None:
            L.seed_everything(seed)
        _trainer().fit(SeesItsOwnSettings(None if seed is None else str(seed), folder, folders[1 - index]))
        assert probe_warm_workers("stage_settings", keep=index == 0) == fresh


def test_other_devices_replace_the_mesh_and_stop_meshes_stops_it() -> None:
    _trainer().fit(Classifier())
    before = MESHES.worker_pids()
    _trainer(devices=1).fit(Classifier())
    after = MESHES.worker_pids()
    assert len(after) == 1 and not set(after) & set(before)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in before)
    lightning_monarch.stop_meshes()
    assert MESHES.worker_pids() == [] and not worker_processes()


def test_keep_warm_false_stops_the_mesh_after_the_stage() -> None:
    lightning_monarch.stop_meshes()
    _trainer(MonarchStrategy(keep_warm=False)).fit(Classifier())
    assert MESHES.worker_pids() == [] and not worker_processes()


def test_a_dead_idle_worker_is_replaced() -> None:
    _trainer().fit(Classifier())
    dead = MESHES.worker_pids()[1]
    os.kill(dead, signal.SIGKILL)
    psutil.Process(dead).wait(10)
    trainer = _trainer()
    trainer.fit(Classifier())
    assert trainer.global_step == 4 and dead not in MESHES.worker_pids()


_EXITING_SCRIPT = """
import lightning as L, lightning_monarch
from lightning_monarch.controller.mesh.pool import MESHES
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from tests.models import Classifier
L.Trainer(strategy="monarch", accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=2,
          limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False).fit(Classifier())
print("PIDS", *MESHES.worker_pids(), flush=True)
"""


def test_interpreter_exit_stops_the_warm_mesh() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _EXITING_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(pid) for pid in done.stdout.split("PIDS", 1)[1].split()]
    assert len(pids) == 2
    assert time.monotonic() - started < 60
    assert "Stopping the worker mesh failed" not in done.stderr
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


class Wide(L.LightningModule):
    """400 MiB of weights in one layer, one batch a stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(10240, 10240)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch).square().mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", self.layer(batch).mean())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-6)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.ones(4, 10240), batch_size=2)

    val_dataloader = train_dataloader


def _kept_memory(pid: int) -> int:
    """What a process keeps in memory: its resident pages, and the whole of each file it maps
    that no longer has a name (a removed file's pages, unmapped or written over copy-on-write,
    stay in memory while the mapping lives)."""
    process = psutil.Process(pid)
    unnamed = {
        region.path: region.size  # type: ignore[attr-defined]
        for region in process.memory_maps(grouped=False)
        if region.path.endswith("(deleted)") or region.path.startswith("/memfd:")
    }
    return process.memory_info().rss + sum(unnamed.values())


def _settled(processes: dict[str, int]) -> dict[str, int]:
    """What each process keeps once the stage's last messages are handled: the least of three
    readings 0.2 s apart (rank 0 still holds its reply to the stage's end for a moment)."""
    readings = []
    for reading in range(3):
        time.sleep(0.2 * bool(reading))
        readings.append({name: _kept_memory(pid) for name, pid in processes.items()})
    return {name: min(row[name] for row in readings) for name in processes}


def test_alternating_fits_and_validates_of_a_large_module_keep_memory_bounded() -> None:
    """10 stages of a 400 MiB module on a warm mesh, a ``validate`` first (its storages mapped from
    the controller's file) and then ``fit`` and ``validate`` in turn: a ``fit`` writes into pages
    of its own, never into a copy-on-write mapping of the shipped file, and no stage adds to what
    the controller or a worker keeps (a leak of a 32nd of the module a stage would show)."""
    model, size = Wide(), 10240 * 10241 * 4
    kept: list[dict[str, int]] = []
    for index in range(10):
        trainer = _trainer(batches=(1, 1))
        if index % 2 == 0:
            trainer.validate(model, verbose=False)
        else:
            trainer.fit(model)
        kept.append(_settled({"controller": os.getpid(), **{str(pid): pid for pid in MESHES.worker_pids()}}))
    print("MiB kept after each stage:", [{name: value >> 20 for name, value in row.items()} for row in kept])
    for name in kept[1]:
        assert max(row[name] for row in kept[1:]) - kept[1][name] < size / 4, name
