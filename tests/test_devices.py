"""GPU workers, checked on CPU through what a CPU can run: the GPU each worker process pins itself
to (NVIDIA, and ROCm with ``torch.version.hip`` patched), on this host and on another host with a
mask and an interpreter of its own, the worker's Lightning Trainer built for ``devices=2`` in the
environment the worker really gets, the rank Monarch's report of a death on another host names,
and the controller's checks of this host's GPUs. The same paths run for real in ``tests/gpu``
where a GPU is present.

What stands in for hardware is named where it is used: ``torch.version.cuda`` for a CUDA build of
torch, NVML's device count for a host's GPUs, and ``torch.cuda.device_count`` in a worker for the
one GPU a pinned worker sees. Nothing else is set that the real path does not set.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.actor import Actor, attach_to_workers, endpoint
from monarch.job import ProcessJob

from lightning_monarch import MonarchStrategy
from lightning_monarch._compat.monarch import failed_rank
from lightning_monarch.controller.features.async_validation import validation_settings
from lightning_monarch.controller.mesh.hosts import HOSTS_MESH
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.devices import pin
from lightning_monarch.wire.codec import pack
from lightning_monarch.wire.protocol import RunAhead
from lightning_monarch.wire.specs import ImportedState, PreflightSpec, StageSpec, TrainerConfig, versions
from tests.models import Classifier
from tests.served_hosts import ServedHost

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("index", "environ", "expected"),
    [
        (1, {}, "1"),
        (0, {"CUDA_VISIBLE_DEVICES": "2,3"}, "2"),
        (1, {"CUDA_VISIBLE_DEVICES": "4, 5,6"}, "5"),
        (1, {"CUDA_VISIBLE_DEVICES": "0,0"}, "0"),  # two workers sharing one GPU
        (1, {"HIP_VISIBLE_DEVICES": "7", "ROCR_VISIBLE_DEVICES": "1"}, "1"),  # not read on CUDA
    ],
)
def test_nvidia_workers_are_pinned_by_cuda_visible_devices(index: int, environ: dict, expected: str) -> None:
    assert pin(index, environ, rocm=False) == ("CUDA_VISIBLE_DEVICES", expected)


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
    assert [pin(index, environ, rocm=True) for index in (0, 1)] == [(variable, device) for device in expected]


def test_rocm_refuses_hip_and_rocr_masks_together() -> None:
    with pytest.raises(MisconfigurationException, match="HIP_VISIBLE_DEVICES='0,1' and ROCR_VISIBLE_DEVICES='2,3'"):
        pin(0, {"HIP_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "2,3"}, rocm=True)


def test_more_devices_than_the_mask_shows_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"GPU index 2, but CUDA_VISIBLE_DEVICES='4,5' makes only 2"):
        pin(2, {"CUDA_VISIBLE_DEVICES": "4,5"}, rocm=False)


@pytest.mark.parametrize("hip", [None, "6.2.41133"])
def test_the_strategy_pins_each_gpu_worker_on_this_host(cuda_build: pytest.MonkeyPatch, hip: Any) -> None:
    cuda_build.setattr(torch.version, "hip", hip)
    cuda_build.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    key = L.Trainer(strategy="monarch", accelerator="gpu", devices=[1, 0], logger=False).strategy._settings().mesh_key()
    assert key.pins == (("CUDA_VISIBLE_DEVICES", "7"), ("CUDA_VISIBLE_DEVICES", "6"))
    assert key.gpu_indices == (1, 0)


def test_gpu_workers_need_a_gpu_build_of_torch() -> None:
    with pytest.raises(
        MisconfigurationException,
        match=r"this process's torch \(.*\) is a CPU-only build.*Install a"
        r" CUDA or ROCm build of torch here",
    ):
        L.Trainer(strategy="monarch", accelerator="gpu", devices=2, logger=False)


def test_more_gpu_workers_than_this_host_has_are_refused(cuda_build: pytest.MonkeyPatch) -> None:
    cuda_build.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 1)  # stands in for a host with one GPU
    with pytest.raises(
        MisconfigurationException,
        match=r"devices=2\)` pins worker processes to GPU\(s\) \[1\], but"
        r" this host has 1 GPU\(s\)",
    ):
        L.Trainer(strategy="monarch", accelerator="gpu", devices=2, logger=False)
    cuda_build.setenv("CUDA_VISIBLE_DEVICES", "0,0")  # two workers sharing the one GPU: allowed
    key = L.Trainer(strategy="monarch", accelerator="gpu", devices=2, logger=False).strategy._settings().mesh_key()
    assert key.pins == (("CUDA_VISIBLE_DEVICES", "0"), ("CUDA_VISIBLE_DEVICES", "0"))


def test_a_16_mixed_controller_touches_no_gpu_and_mirrors_the_workers_scaler(cuda_build: pytest.MonkeyPatch) -> None:
    def no_gpu_here(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the controller initialized a GPU")

    cuda_build.setattr(torch.cuda, "_lazy_init", no_gpu_here)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(strategy="monarch", accelerator="gpu", devices=2, precision="16-mixed", logger=False)
    assert not [str(w.message) for w in caught if "GradScaler" in str(w.message) or "CUDA" in str(w.message)]
    plugin = trainer.precision_plugin
    assert trainer.precision == "16-mixed" and plugin.device == "cpu"
    assert type(plugin.scaler).__name__ == "GradScalerMirror" and not plugin.scaler.is_enabled()
    with pytest.raises(RuntimeError, match="precision state is only known during or after `trainer.fit`"):
        plugin.state_dict()


def _visible(mesh: WorkerMesh) -> list[dict[str, str]]:
    """Every worker's visibility variables, from its own preflight report, in rank order."""
    reports = mesh.preflight(PreflightSpec("cpu", None, versions(), all_reduce_mib=0.01, all_reduce_limit_s=60))
    return [report.visible_devices for report in reports]


def test_workers_on_this_host_pin_themselves_from_the_controllers_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")  # the user's mask, which this host's workers inherit
    mesh = WorkerMesh.spawn(2, gpu_indices=(1, 0))
    try:
        assert _visible(mesh) == [{"CUDA_VISIBLE_DEVICES": "7"}, {"CUDA_VISIBLE_DEVICES": "6"}]
    finally:
        mesh.stop()


@pytest.fixture
def other_host(tmp_path: Path) -> Any:
    """A Monarch host at a TCP address, as a cluster node serves one, with what such a node has of its
    own: another interpreter path (a virtual environment elsewhere, sharing this one's packages) and the
    visibility mask its scheduler set (``CUDA_VISIBLE_DEVICES=5,6``). Stopped by its PID."""
    venv = tmp_path / "node-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text((Path(sys.prefix) / "pyvenv.cfg").read_text())
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    site = next(Path(path) for path in sys.path if path.endswith("site-packages") and path.startswith(sys.prefix))
    (venv / "lib" / site.parent.name / "site-packages").symlink_to(site)
    python = str(venv / "bin" / "python")
    host = ServedHost(python, env={**os.environ, "CUDA_VISIBLE_DEVICES": "5,6"})
    try:
        host.start()
        yield python, attach_to_workers(name=HOSTS_MESH, ca="trust_all_connections", workers=[host.address])
    finally:
        host.stop()


def test_workers_on_another_host_use_its_interpreter_and_its_mask(
    other_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    python, hosts = other_host
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the controller's own mask, which that host must not get
    mesh = WorkerMesh.spawn(2, gpu_indices=(0, 1), hosts=hosts)
    try:
        assert _visible(mesh) == [{"CUDA_VISIBLE_DEVICES": "5"}, {"CUDA_VISIBLE_DEVICES": "6"}]
        assert [psutil.Process(pid).cmdline()[0] for pid in mesh.pids] == [python, python]
    finally:
        mesh.stop()


def test_a_mask_too_short_for_a_worker_is_reported_by_preflight(other_host: Any) -> None:
    _, hosts = other_host
    mesh = WorkerMesh.spawn(3, gpu_indices=(0, 1, 2), hosts=hosts)
    try:
        reports = mesh.preflight(PreflightSpec("cuda", "gloo", versions(), all_reduce_mib=0.01, all_reduce_limit_s=60))
    finally:
        mesh.stop()
    assert reports[2].visible_devices == {"CUDA_VISIBLE_DEVICES": ""}  # hidden: it must not take another's GPU
    assert any(
        "asks for GPU index 2, but CUDA_VISIBLE_DEVICES='5,6' makes only 2 GPU(s) visible on this host" in problem
        for problem in reports[2].problems
    ), reports[2].problems


def _one_visible_gpu() -> OneVisibleGPU:
    torch.cuda.device_count = lambda: 1
    torch.cuda.is_available = lambda: True
    return OneVisibleGPU()


class OneVisibleGPU(Callback):
    """Stands in for the one GPU a pinned worker sees on a GPU host: unpickled on a worker (with the
    stage's worker callbacks, before its Trainer is built), it makes torch report one CUDA device
    in that process. The only thing in this test that is not real."""

    def __reduce__(self) -> Any:
        return _one_visible_gpu, ()


def test_two_gpu_workers_get_past_stage_start() -> None:
    """``Trainer(strategy="monarch", accelerator="gpu", devices=2)``: each worker's Trainer parses
    ``devices=2`` while it sees one GPU, in the environment its process really starts with."""
    spec = StageSpec(
        fn="fit",
        # as the controller packs a stage's objects, with nothing changed in what they import
        payload=pack((Classifier(), None, {}, [OneVisibleGPU()], None, []), then=lambda: ImportedState({}, {})),
        ckpt_path=None,
        weights_only=None,
        fit_loop_state=L.Trainer(logger=False).fit_loop.state_dict(),
        trainer=TrainerConfig(
            accelerator="cuda",
            devices=2,
            num_nodes=1,
            precision="32-true",
            process_group_backend="gloo",
            flags={},
            ddp_kwargs={},
        ),
        loggers=[],
        sys_path=(),
        env={},
        run_ahead=RunAhead(max_ahead=0, sync={}, views=frozenset(), outputs=frozenset()),
    )
    mesh = WorkerMesh.spawn(2, gpu_indices=(0, 1))
    try:
        mesh.start_stage(spec)  # a worker's failure to build its Trainer raises here
    finally:
        mesh.stop()


class _Sleeper(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self) -> None:
        time.sleep(60)


def test_a_death_on_another_host_is_named_by_its_global_rank() -> None:
    """Monarch's own report of a process killed on host 1 (of 2, one worker each) names global rank 1,
    or, where Monarch's query of the host's agent timed out first (a loaded machine), no rank: the
    error then says "A worker", never another rank."""
    job = ProcessJob({"hosts": 2})
    try:
        procs = job.state(cached_path=None).hosts.spawn_procs(per_host={"gpus": 1})
        actors = procs.spawn("sleeper", _Sleeper)
        on_host_1 = next(pid for point, pid in actors.pid.call().get().items() if point["hosts"] == 1)
        waiting = actors.sleep.call()
        os.kill(on_host_1, signal.SIGKILL)
        with pytest.raises(Exception) as failure:
            waiting.get(timeout=60)
    finally:
        job.kill()
    report = str(failure.value)
    if "timeout waiting for message from proc mesh agent" in report:
        assert failed_rank(report) is None
    else:
        assert "'hosts': 1/2, 'gpus': 0/1" in report
        assert failed_rank(report) == 1


def test_async_validation_workers_take_the_gpus_after_the_training_ones(cuda_build: pytest.MonkeyPatch) -> None:
    cuda_build.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    strategy = L.Trainer(
        strategy=MonarchStrategy(validation="async"), accelerator="gpu", devices=2, logger=False
    ).strategy
    key = validation_settings(strategy._settings()).mesh_key()
    assert key.gpu_indices == (2, 3)
    assert key.pins == (("CUDA_VISIBLE_DEVICES", "6"), ("CUDA_VISIBLE_DEVICES", "7"))
    cuda_build.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 3)  # stands in for a host with three GPUs
    with pytest.raises(
        MisconfigurationException,
        match=r"runs its 2 validation workers on the GPUs after the training workers', \[2, 3\], but this host has 3",
    ):
        L.Trainer(strategy=MonarchStrategy(validation="async"), accelerator="gpu", devices=2, logger=False)
