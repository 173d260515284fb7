"""Preflight: every worker checks itself before the first step; all problems come in one error,
by host and rank. (The ``lightning-monarch preflight`` command's rows: ``tests/test_command.py``.)"""

from __future__ import annotations

import lightning as L
import pytest

import lightning_monarch.controller.features.preflight as preflight
from lightning_monarch import PreflightError
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.wire.reports import WorkerReport
from lightning_monarch.wire.specs import versions
from lightning_monarch.worker.preflight import device_problem, rccl_warnings
from tests.conftest import stray_workers
from tests.models import Classifier

pytestmark = pytest.mark.timeout(120)


def test_every_problem_of_every_worker_in_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "versions", lambda: {**versions(), "torch": "1.0.0"})
    mesh = WorkerMesh.spawn(2)
    try:
        with pytest.raises(PreflightError) as error:
            preflight.check(mesh, "cpu", None, all_reduce_mib=1, all_reduce_limit_s=0)
    finally:
        mesh.stop()
    message = str(error.value)
    assert "4 problem(s)" in message
    for rank in (0, 1):
        assert f"rank {rank}: torch {versions()['torch']} here, 1.0.0 on the controller" in message
        assert f"rank {rank}: an all-reduce of 1 MiB took" in message


def test_a_worker_without_its_gpu_is_reported() -> None:
    mesh = WorkerMesh.spawn(1, gpu_indices=(0,))
    try:
        with pytest.raises(
            PreflightError,
            match=r"rank 0: sees no GPU \(CUDA_VISIBLE_DEVICES=0\): more `devices` asked"
            r" for than this host has, or no GPU driver here",
        ):
            preflight.check(mesh, "cuda", None, all_reduce_mib=1)
    finally:
        mesh.stop()


def test_fit_does_not_start_on_a_mesh_that_fails_its_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_monarch

    lightning_monarch.stop_meshes()  # a new mesh is checked; a warm one was checked already
    monkeypatch.setattr(preflight, "versions", lambda: {**versions(), "lightning": "0.1"})
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.raises(PreflightError, match="rank 1: lightning .* here, 0.1 on the controller"):
        trainer.fit(Classifier())
    assert trainer.global_step == 0
    assert not stray_workers()


def test_more_devices_than_the_host_has_is_named_with_the_host_count() -> None:
    # what a worker reports where NVML or AMD SMI counts the host's GPUs (not on this CPU machine)
    assert device_problem(0, {"CUDA_VISIBLE_DEVICES": "3"}, host_gpus=2) == (
        "sees no GPU (CUDA_VISIBLE_DEVICES=3): this host has 2 GPU(s), fewer than `devices` asks for; use"
        " `devices=2` or fewer per host"
    )
    assert "its visibility variable did not reach it" in device_problem(8, {}, host_gpus=8)


@pytest.mark.parametrize(
    ("environ", "cmdline", "iommu", "expected"),
    [
        ({}, "", False, ["HSA_FORCE_FINE_GRAIN_PCIE is not 1"]),
        ({"HSA_FORCE_FINE_GRAIN_PCIE": "1"}, "", False, []),
        ({"HSA_FORCE_FINE_GRAIN_PCIE": "1"}, "ro quiet", True, ["the IOMMU is on without `iommu=pt`"]),
        ({"HSA_FORCE_FINE_GRAIN_PCIE": "1"}, "ro iommu=pt quiet", True, []),
    ],
)
def test_rccl_settings_that_amd_documents_as_hang_causes_are_warned(
    environ: dict, cmdline: str, iommu: bool, expected: list[str]
) -> None:
    warnings = rccl_warnings(environ, cmdline, iommu)
    assert [warning[: len(start)] for warning, start in zip(warnings, expected, strict=False)] == expected
    assert len(warnings) == len(expected)


def test_each_warning_is_shown_once_with_its_hosts() -> None:
    def report(rank: int, host: str) -> WorkerReport:
        return WorkerReport(
            rank=rank,
            host=host,
            pid=rank,
            device="gpu",
            device_memory_gib=None,
            versions={},
            visible_devices={},
            all_reduce_s=None,
            problems=[],
            warnings=["setting X is off"],
        )

    with pytest.warns(UserWarning) as caught:
        preflight._warn_once([report(0, "node-a"), report(1, "node-a"), report(2, "node-b")])
    assert [str(warning.message) for warning in caught] == [
        "strategy='monarch' preflight, on node-a, node-b: setting X is off"
    ]
