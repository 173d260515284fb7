"""Real GPU workers (CUDA, or ROCm through the same ``torch.cuda`` API). They run only where a GPU
is present, so CI (CPU only) skips them; on a GPU machine ``tests/gpu/run_on_device.sh`` runs them
with the rest of the GPU checks.

Each compares ``strategy="monarch"`` with Lightning's own ``strategy="ddp"`` on the same seed; the
``ddp`` reference runs in a subprocess, so that the test process, the controller, can be checked
for never initializing a GPU.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_monarch import MeshStatsMonitor, MonarchFSDPStrategy, MonarchModelParallelStrategy, MonarchStrategy
from lightning_monarch.controller.mesh.pool import MESHES
from tests.conftest import ROOT
from tests.models import Classifier
from tests.parity_cases import TokenTransformer
from tests.references import run_reference
from tests.tensor_parallel import fit

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
    pytest.mark.timeout(300),
]


class DeviceRecorder(Classifier):
    """Records, on the worker, where it ran; public attributes come back to the controller."""

    def on_fit_start(self) -> None:
        self.seen_backend = dist.get_backend()
        self.seen_device = str(self.device)
        self.seen_world_size = self.trainer.world_size
        self.seen_device_name = torch.cuda.get_device_name(self.device)


class OverflowingRecorder(DeviceRecorder):
    """Its first training step's loss overflows in float16, so that a ``16-mixed`` gradient scaler
    skips that step and halves its scale; and its checkpoint hook adds a tensor on its GPU."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        overflow = self.trainer.precision == "16-mixed" and self.trainer.global_step == 0 and batch_idx == 0
        return loss * 1e6 if overflow else loss

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["made_on_the_worker"] = torch.ones(2, device=self.device)


MODELS = {"recorder": DeviceRecorder, "overflowing": OverflowingRecorder, "transformer": TokenTransformer}


def _strategy(name: str, options: dict[str, Any]) -> Any:
    if name == "ddp" or not options:
        return name
    options = dict(options)
    if "fsdp_policy" in options:  # module classes by name, so that the options stay JSON
        options["fsdp_policy"] = {getattr(nn, options["fsdp_policy"])}
        return MonarchFSDPStrategy(**options)
    return MonarchStrategy(**options)


def train(
    strategy: str,
    precision: str = "32-true",
    model: str = "recorder",
    devices: int = 1,
    accelerator: str = "gpu",
    options: dict[str, Any] | None = None,
    out: str | None = None,
) -> dict[str, Any]:
    """One seeded fit; what the tests compare. ``options`` are ``MonarchStrategy``'s (JSON, so that
    the ``ddp`` reference can take the same call in a subprocess)."""
    L.seed_everything(1234)
    module = MODELS[model]()
    trainer = L.Trainer(
        strategy=_strategy(strategy, options or {}),
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    result = {
        "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "seen": {
            name: getattr(module, name)
            for name in ("seen_backend", "seen_device", "seen_world_size")
            if hasattr(module, name)
        },
        "losses": getattr(module, "losses", None),
        # what a script reads of the Trainer's gradient scaler after the fit: rank 0's
        "scale": scaler.get_scale() if (scaler := getattr(trainer.precision_plugin, "scaler", None)) else None,
    }
    if model != "transformer" or strategy == "ddp":
        result["weights"] = {key: value.detach().cpu() for key, value in module.state_dict().items()}
    else:
        result["weights"] = trainer.strategy.gather_full_state_dict()
    if out is not None:
        trainer.save_checkpoint(out)
        checkpoint = torch.load(out, map_location="cpu", weights_only=False)
        result["checkpoint"] = {key: checkpoint.get(key) for key in ("MixedPrecision", "optimizer_states")}
    return result


def ddp_reference(tmp_path: Path, strategy: str = "ddp", **arguments: Any) -> dict[str, Any]:
    """``train("ddp", ...)`` in a subprocess, which may initialize its GPU. With several processes on
    the CPU, ``ddp_spawn``: ``ddp`` would re-run the subprocess's command, which has no script."""
    out = tmp_path / "ddp.pt"
    code = (
        f"import json, torch; from tests.gpu.test_gpu_workers import train;"
        f" torch.save(train({strategy!r}, **json.loads({json.dumps(arguments)!r})), {str(out)!r})"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=240)
    return torch.load(out, weights_only=False)


def assert_equal(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(ours[key], value), key


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_one_gpu_worker_matches_ddp(precision: str, tmp_path: Path) -> None:
    ours = train("monarch", precision, model="overflowing", out=str(tmp_path / "monarch.ckpt"))
    assert not torch.cuda.is_initialized(), "the controller initialized a GPU"
    reference = ddp_reference(tmp_path, precision=precision, model="overflowing", out=str(tmp_path / "ddp.ckpt"))
    print(f"monarch ran on {ours['seen']}; ddp on {reference['seen']}")
    assert ours["seen"]["seen_backend"] == "nccl"
    assert ours["seen"] == reference["seen"]
    assert ours["global_step"] == reference["global_step"]
    assert ours["callback_metrics"] == reference["callback_metrics"]
    assert_equal(ours["weights"], reference["weights"])
    # the gradient scaler's state is the workers' (it skipped the overflowing step), as in ddp's checkpoint
    assert ours["checkpoint"]["MixedPrecision"] == reference["checkpoint"]["MixedPrecision"]
    if precision == "16-mixed":
        assert ours["checkpoint"]["MixedPrecision"]["scale"] < 65536.0
    assert ours["scale"] == reference["scale"]
    saved = torch.load(tmp_path / "monarch.ckpt", weights_only=False)  # no map_location: tensors must be on the CPU
    assert saved["made_on_the_worker"].device.type == "cpu"


def test_two_workers_share_one_gpu_over_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``devices=2`` with one GPU: both workers pinned to it by the user's mask, gradients over gloo;
    trained as ``ddp`` trains 2 CPU processes, to float tolerance (the kernels differ)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    ours = train("monarch", devices=2, options={"process_group_backend": "gloo"})
    assert not torch.cuda.is_initialized(), "the controller initialized a GPU"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    reference = ddp_reference(tmp_path, "ddp_spawn", devices=2, accelerator="cpu")
    assert ours["seen"] == {"seen_backend": "gloo", "seen_device": "cuda:0", "seen_world_size": 2}
    assert ours["global_step"] == reference["global_step"]
    for key, value in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_tensor_parallel_workers_share_one_gpu_over_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MonarchModelParallelStrategy`` at 1×2 (data × tensor) with one GPU: both workers pinned to
    it, the tensor-parallel collectives over gloo (NCCL refuses two ranks on one GPU); trained as
    Lightning's ``ModelParallelStrategy`` trains 2 CPU processes, to float tolerance."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    strategy = MonarchModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, process_group_backend="gloo")
    trainer, model = fit(strategy, 2, tmp_path / "monarch", accelerator="gpu")
    assert not torch.cuda.is_initialized(), "the controller initialized a GPU"
    weights = trainer.strategy.gather_full_state_dict()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    run_reference("tests.tensor_parallel", tmp_path / "reference", "1x2", processes=2, timeout=240)
    reference = torch.load(tmp_path / "reference" / "1x2" / "results.pt", weights_only=False)
    assert trainer.global_step == reference["global_step"]
    torch.testing.assert_close(model.losses, reference["losses"], rtol=1e-4, atol=1e-5)
    for key, value in reference["weights"].items():
        torch.testing.assert_close(weights[key].cpu(), value, rtol=1e-4, atol=1e-5, msg=key)


def test_fsdp_with_cpu_offload_matches_ddp(tmp_path: Path) -> None:
    options = {"fsdp_policy": "TransformerEncoderLayer", "cpu_offload": True}
    ours = train("monarch", model="transformer", options=options)
    assert not torch.cuda.is_initialized(), "the controller initialized a GPU"
    reference = ddp_reference(tmp_path, model="transformer")
    assert ours["global_step"] == reference["global_step"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"]), rtol=1e-4, atol=1e-5)
    for key, value in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key].cpu(), value, rtol=1e-4, atol=1e-5, msg=key)


def test_mesh_stats_are_read_from_the_gpu(tmp_path: Path) -> None:
    L.seed_everything(1234)
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path, name="", version=""),
        callbacks=[MeshStatsMonitor(logging_interval=2)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier())
    with open(tmp_path / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("mesh/rank0/rss_mib")]
    assert rows, "no stats were logged"
    values = {key.split("/")[-1]: float(value) for key, value in rows[-1].items() if key.startswith("mesh/") and value}
    print(f"MeshStatsMonitor on the GPU: {json.dumps(values)}")
    assert values["memory_allocated_mib"] > 0 and values["memory_peak_mib"] >= values["memory_allocated_mib"]
    assert values["step_time_ms"] > 0, "the CUDA-event step timer"
    assert 0 <= values["gpu_utilization_percent"] <= 100 and 0 <= values["memory_busy_percent"] <= 100
    assert values["power_w"] > 0 and values["temperature_c"] > 0
    assert not torch.cuda.is_initialized(), "the controller initialized a GPU"


def test_second_fit_reuses_the_gpu_worker() -> None:
    train("monarch")
    pids = MESHES.worker_pids()
    started = time.perf_counter()
    result = train("monarch")
    print(f"second fit on the warm GPU mesh: {time.perf_counter() - started:.2f} s")
    assert MESHES.worker_pids() == pids
    assert result["global_step"] == 24
    assert not torch.cuda.is_initialized()
