"""Real GPU workers (CUDA, or ROCm through the same ``torch.cuda`` API). They run only where a GPU
is present, so CI (CPU only) skips them; they run on a GPU machine with

    python -m pytest tests/gpu

Each compares ``strategy="monarch"`` with Lightning's own ``strategy="ddp"`` on the same seed; the
``ddp`` reference runs in a subprocess, so that the test process, the controller, can be checked
for never initializing a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_monarch.controller.pool import MESHES
from tests.conftest import ROOT
from tests.models import Classifier

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
    pytest.mark.timeout(300),
]


class DeviceRecorder(Classifier):
    """Records, on the worker, where it ran; public attributes come back to the controller."""

    def on_fit_start(self) -> None:
        self.seen_backend = dist.get_backend()
        self.seen_device = str(self.device)
        self.seen_device_name = torch.cuda.get_device_name(self.device)


def train(strategy: str, precision: str) -> dict[str, Any]:
    """One seeded fit on one GPU; what the tests compare."""
    L.seed_everything(1234)
    model = DeviceRecorder()
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu", devices=1, precision=precision, max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    return {
        "weights": {key: value.detach().cpu() for key, value in model.state_dict().items()},
        "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "seen": {name: getattr(model, name) for name in ("seen_backend", "seen_device", "seen_device_name")},
    }


def ddp_reference(precision: str, out: Path) -> dict[str, Any]:
    code = f"import torch; from tests.gpu.test_gpu_workers import train; torch.save(train('ddp', {precision!r}), {str(out)!r})"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=240)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_one_gpu_worker_matches_ddp(precision: str, tmp_path: Path) -> None:
    ours = train("monarch", precision)
    assert not torch.cuda.is_initialized(), "the controller initialized a GPU"
    reference = ddp_reference(precision, tmp_path / "ddp.pt")
    print(f"monarch ran on {ours['seen']}; ddp on {reference['seen']}")
    assert ours["seen"]["seen_backend"] == "nccl"
    assert ours["seen"] == reference["seen"]
    assert ours["global_step"] == reference["global_step"]
    assert ours["callback_metrics"] == reference["callback_metrics"]
    for key, value in reference["weights"].items():
        assert torch.equal(ours["weights"][key], value), key


def test_second_fit_reuses_the_gpu_worker() -> None:
    train("monarch", "32-true")
    pids = MESHES.worker_pids()
    started = time.perf_counter()
    result = train("monarch", "32-true")
    print(f"second fit on the warm GPU mesh: {time.perf_counter() - started:.2f} s")
    assert MESHES.worker_pids() == pids
    assert result["global_step"] == 24
    assert not torch.cuda.is_initialized()
