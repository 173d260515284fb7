"""torch's process-wide settings that the script changed hold on every worker, as on every ddp rank
(``lightning_monarch/torch_settings.py``); the parity cases ``script_default_dtype`` and
``script_precision`` compare whole runs with ``ddp``."""

from __future__ import annotations

import importlib
import multiprocessing
import pickle
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.backends
from torch.backends import ContextProp

from lightning_monarch import torch_settings
from lightning_monarch.controller.launch.fresh_settings import FRESH, FreshSettings
from lightning_monarch.controller.mesh import forkserver
from tests.models import Classifier

pytestmark = pytest.mark.timeout(120)

#: A value other than a fresh process's for each setting that a CPU build of torch can change.
CHANGED: dict[str, Any] = {
    "torch.get_default_dtype()": torch.float64,
    "torch.are_deterministic_algorithms_enabled()": (True, True),
    "torch.utils.deterministic.fill_uninitialized_memory": False,
    "torch.is_anomaly_enabled()": (True, False),
    "torch.set_flush_denormal()": True,
    "torch.is_warn_always_enabled()": True,
    "torch.get_float32_matmul_precision()": "medium",
    "torch.backends.fp32_precision": "tf32",
    "torch.backends.cudnn.fp32_precision": "ieee",
    "torch.backends.cudnn.conv.fp32_precision": "ieee",
    "torch.backends.cudnn.rnn.fp32_precision": "ieee",
    "torch.backends.cuda.matmul.fp32_precision": "ieee",
    "torch.backends.mkldnn.fp32_precision": "bf16",
    "torch.backends.mkldnn.matmul.fp32_precision": "tf32",
    "torch.backends.mkldnn.conv.fp32_precision": "tf32",
    "torch.backends.mkldnn.rnn.fp32_precision": "bf16",
    "torch.backends.cudnn.enabled": False,
    "torch.backends.cudnn.deterministic": True,
    "torch.backends.cudnn.benchmark": True,
    "torch.backends.cudnn.benchmark_limit": 5,
    "torch.backends.cudnn.depthwise_kernel": "native",
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction": (False, True),
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction": (False, False),
    "torch.backends.cuda.matmul.allow_fp16_accumulation": True,
    "torch.backends.cuda.flash_sdp_enabled()": False,
    "torch.backends.cuda.mem_efficient_sdp_enabled()": False,
    "torch.backends.cuda.math_sdp_enabled()": False,
    "torch.backends.cuda.cudnn_sdp_enabled()": False,
    "torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()": True,
    "torch.backends.cuda.preferred_rocm_fa_library()": "ck",
    "torch.backends.mkldnn.enabled": False,
    "torch.backends.mkldnn.deterministic": True,
    "torch.backends.miopen.immediate": True,
    "torch.backends.opt_einsum.enabled": False,
    "torch.backends.opt_einsum.strategy": "greedy",
    "torch.backends.quantized.engine": "qnnpack",
    "torch.backends.mha.get_fastpath_enabled()": False,
}
#: Settings a CPU build cannot change (it has neither MAGMA nor cuBLASLt), or that a stage's own
#: code cannot run under (a ``meta`` default device), each with its test here.
NOT_CHANGED_HERE = {
    "torch.backends.cuda.preferred_linalg_library()": "test_a_setting_torch_refuses_on_a_worker_is_named",
    "torch.backends.cuda.preferred_blas_library()": "test_a_setting_torch_refuses_on_a_worker_is_named",
    "torch.get_default_device()": "test_settings_are_made_and_put_back_in_order",
}
#: torch's legacy TF32 flags: views of the ``fp32_precision`` settings, which are carried.
VIEWS = {"allow_tf32"}


def _backend_flags() -> set[str]:
    """Every flag that a module of ``torch.backends`` declares (``ContextProp``), and each of its
    operations' ``fp32_precision``."""
    flags = set()
    for info in pkgutil.iter_modules(torch.backends.__path__):
        module = importlib.import_module(f"torch.backends.{info.name}")
        for name, value in vars(type(module)).items():
            if isinstance(value, ContextProp) and name not in VIEWS:
                flags.add(f"torch.backends.{info.name}.{name}")
            elif hasattr(value, "backend") and hasattr(value, "op"):  # an operation's precision
                flags.add(f"torch.backends.{info.name}.{name}.fp32_precision")
    return flags


def test_every_flag_of_torch_backends_is_carried() -> None:
    names = {setting.name for setting in torch_settings.SETTINGS}
    assert _backend_flags() - names == set()
    assert set(CHANGED) | set(NOT_CHANGED_HERE) == names


def test_settings_are_made_and_put_back_in_order() -> None:
    """The general before the particular: ``set_float32_matmul_precision`` after a backend's
    matmul precision would undo it. And a stage's settings are put back as they were."""
    fresh = torch_settings.read()
    try:
        torch.set_default_device("meta")
        torch.set_float32_matmul_precision("high")
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        script = torch_settings.read()
        torch_settings.apply(fresh)
        assert torch_settings.read() == fresh
        before = torch_settings.apply({name: value for name, value in script.items() if fresh[name] != value})
        assert torch_settings.read() == script
        assert torch.get_default_device() == torch.device("meta")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        torch_settings.apply(before)
        assert torch_settings.read() == fresh
    finally:
        torch_settings.apply(fresh)


def test_a_setting_torch_refuses_on_a_worker_is_named() -> None:
    fresh = torch_settings.read()
    with pytest.raises(RuntimeError, match=r"preferred_blas_library\(\) = 'cublaslt'.*module's `setup` hook"):
        torch_settings.apply({"torch.backends.cuda.preferred_blas_library()": "cublaslt"})
    assert torch_settings.read() == fresh


class SettingsRecorder(Classifier):
    """Writes each rank's torch settings and multiprocessing start method, as its ``setup`` hook
    (the first of the user's hooks on a worker) finds them, to ``out_dir``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def setup(self, stage: str) -> None:
        found = {"torch": torch_settings.read(), "start_method": multiprocessing.get_start_method(allow_none=True)}
        (Path(self.out_dir) / f"rank{self.global_rank}.pkl").write_bytes(pickle.dumps(found))


def _trainer() -> L.Trainer:
    return L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _seen_on_workers(out_dir: Path) -> list[dict[str, Any]]:
    out_dir.mkdir()
    model = SettingsRecorder(str(out_dir))
    _trainer().validate(model, verbose=False)
    return [pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes()) for rank in range(2)]


def test_a_fresh_workers_settings_are_read_in_a_child_of_the_fork_server() -> None:
    """The fresh values that tell what the script changed come from a child of the fork server that
    forks the CPU workers (no new import of torch), and are a new interpreter's."""
    fresh = FreshSettings()
    forked = fresh.values(_trainer().strategy._settings())  # type: ignore[attr-defined]
    assert fresh.command is not None and forkserver.SCRIPT in fresh.command
    script = subprocess.run([sys.executable, torch_settings.__file__], capture_output=True, check=True).stdout
    assert forked == pickle.loads(script)


def test_a_setting_changed_on_the_controller_is_seen_on_the_workers(tmp_path: Path) -> None:
    """Each setting of :data:`CHANGED` changed on the controller holds on each worker as the user's
    first hook runs; the next stage, after the script put them back, finds a fresh process's. The
    workers' DataLoaders start processes as the controller's would (``fork`` on Linux unless the
    script chose), as a ddp rank's would, not by Monarch's ``forkserver``."""
    before = torch_settings.read()  # what earlier tests' Trainers left (``deterministic=True``)
    fresh = FRESH.values(_trainer().strategy._settings())  # type: ignore[attr-defined]
    try:
        torch_settings.apply(fresh)
        for setting in torch_settings.SETTINGS:
            if setting.name in CHANGED:
                setting.set(CHANGED[setting.name])
        script = torch_settings.read()
        assert {name for name in CHANGED if script.get(name) != fresh[name]} >= set(CHANGED) - {
            "torch.get_float32_matmul_precision()",  # unreadable once mixed with fp32_precision
            "torch.backends.fp32_precision",  # the mkldnn settings after it set it back
        }
        seen = _seen_on_workers(tmp_path / "changed")
        torch_settings.apply(fresh)
        again = _seen_on_workers(tmp_path / "again")
    finally:
        torch_settings.apply(before)
    assert [found["torch"] for found in seen] == [script, script]
    assert [found["torch"] for found in again] == [fresh, fresh]
    controller = multiprocessing.get_start_method(allow_none=True)  # None, or what an earlier test set
    assert [found["start_method"] for found in seen + again] == [controller] * 4
