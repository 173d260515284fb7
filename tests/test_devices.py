"""GPU workers' device pinning, checked on CPU: the visibility variable each worker process starts
with (NVIDIA, and ROCm with ``torch.version.hip`` patched), that it reaches the real worker
processes, and that each worker's Lightning DDP then uses ``cuda:0``. The same path runs for real
in ``tests/gpu`` where a GPU is present."""

from __future__ import annotations

from typing import Any
from unittest import mock

import lightning as L
import psutil
import pytest
import torch
import cloudpickle
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_monarch.controller.devices import pinned_environments
from lightning_monarch.controller.mesh import WorkerMesh
from lightning_monarch.protocol import StageSpec, TrainerConfig
from lightning_monarch.worker.stage import build_stage
from tests.models import Classifier

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("indices", "environ", "expected"),
    [
        ([0, 1], {}, ["0", "1"]),
        ([0, 1], {"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"]),
        ([1], {"CUDA_VISIBLE_DEVICES": "4, 5,6"}, ["5"]),
        ([0, 1], {"HIP_VISIBLE_DEVICES": "7", "ROCR_VISIBLE_DEVICES": "1"}, ["0", "1"]),  # not read on CUDA
    ],
)
def test_nvidia_workers_are_pinned_by_cuda_visible_devices(indices: list[int], environ: dict, expected: list) -> None:
    assert pinned_environments(indices, environ, rocm=False) == [{"CUDA_VISIBLE_DEVICES": d} for d in expected]


@pytest.mark.parametrize(
    ("environ", "variable", "expected"),
    [
        ({}, "HIP_VISIBLE_DEVICES", ["0", "1"]),
        ({"HIP_VISIBLE_DEVICES": "4,5,6"}, "HIP_VISIBLE_DEVICES", ["4", "5"]),
        ({"ROCR_VISIBLE_DEVICES": "2,3"}, "ROCR_VISIBLE_DEVICES", ["2", "3"]),
        ({"CUDA_VISIBLE_DEVICES": "1,0"}, "CUDA_VISIBLE_DEVICES", ["1", "0"]),
    ],
)
def test_rocm_workers_get_one_visibility_variable(environ: dict, variable: str, expected: list) -> None:
    environments = pinned_environments([0, 1], environ, rocm=True)
    assert environments == [{variable: d} for d in expected]


def test_rocm_refuses_hip_and_rocr_masks_together() -> None:
    with pytest.raises(MisconfigurationException, match="HIP_VISIBLE_DEVICES='0,1' and ROCR_VISIBLE_DEVICES='2,3'"):
        pinned_environments([0], {"HIP_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "2,3"}, rocm=True)


def test_more_devices_than_the_mask_shows_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"GPU index 2, but CUDA_VISIBLE_DEVICES='4,5' makes only 2"):
        pinned_environments([0, 1, 2], {"CUDA_VISIBLE_DEVICES": "4,5"}, rocm=False)


@pytest.mark.parametrize("hip", [None, "6.2.41133"])
def test_the_strategy_pins_each_gpu_worker(monkeypatch: pytest.MonkeyPatch, hip: Any) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    trainer = L.Trainer(strategy="monarch", accelerator="gpu", devices=[1, 0], logger=False)
    environments = [dict(items) for items in trainer.strategy.mesh_key().environments]
    assert environments == [{"CUDA_VISIBLE_DEVICES": "7"}, {"CUDA_VISIBLE_DEVICES": "6"}]
    assert not torch.cuda.is_initialized()


def test_worker_processes_start_with_their_environment() -> None:
    mesh = WorkerMesh.spawn([{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}])
    try:
        seen = [psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES") for pid in mesh.pids]
    finally:
        mesh.stop()
    assert seen == ["3", "5"]


def test_a_pinned_worker_uses_cuda_0_whatever_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer ``worker/stage.py`` builds on local rank 1 of 2, in a process that sees one GPU."""
    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29999", TORCHELASTIC_RUN_ID="test").items():
        monkeypatch.setenv(name, value)
    # a DDP Trainer sets the process-wide rank for rank_zero_only; this test process stays rank 0
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    spec = StageSpec(
        fn="fit", payload=cloudpickle.dumps((Classifier(), None, {}, [])), ckpt_path=None,
        fit_loop_state=L.Trainer(logger=False).fit_loop.state_dict(),
        trainer=TrainerConfig(accelerator="cuda", devices=2, num_nodes=1, precision="32-true",
                              process_group_backend=None, flags={}, ddp_kwargs={}),
        loggers=[], sys_path=(), env={},
    )
    with mock.patch("torch.cuda.device_count", return_value=1), mock.patch("torch.cuda.is_available", return_value=True):
        trainer = build_stage(spec, rank=1)._trainer
    assert trainer.strategy.root_device == torch.device("cuda", 0)
    assert (trainer.global_rank, trainer.local_rank, trainer.world_size) == (1, 1, 2)
