"""``MeshStatsMonitor``: every worker's stats in the controller's loggers at the chosen steps, training
left unchanged, stragglers named, and missing GPU tools degrading to torch's own stats."""

from __future__ import annotations

import csv
import os
import sys
import time
import types
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch import MeshStatsMonitor, MonarchStrategy
from lightning_monarch.controller.features.stats import StreakWatch, memory_bound, warn_missing_tools
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.wire.reports import RankStats
from lightning_monarch.worker.stats import GpuSensors
from tests.models import Classifier, WarmupClassifier
from tests.parity_cases import SEED

pytestmark = pytest.mark.timeout(120)

#: Classifier: 96 samples, 2 ranks, batches of 8: 6 steps per epoch.
EPOCHS, STEPS_PER_EPOCH, INTERVAL = 2, 6, 4
#: What every worker logs, CPU workers included.
PER_RANK = ("rss_mib", "cpu_time_s", "cpu_utilization_percent", "step_time_ms")


def _fit(model: L.LightningModule, log_dir: Path, callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    options = dict(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger(log_dir, name="", version=""),
    )
    trainer = L.Trainer(**{**options, **kwargs}, callbacks=callbacks)
    trainer.fit(model)
    return trainer


@dataclass
class Run:
    """What one fit left behind, for the tests to compare."""

    weights: dict[str, torch.Tensor]
    callback_metrics: dict[str, float]
    rows: list[dict[str, str]]
    messages: Counter


@pytest.fixture(scope="module", params=[Classifier, WarmupClassifier], ids=["lightnings-step", "own-optimizer-step"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The same seeded fit with and without the monitor, with the messages each sent to the workers
    and the gates where the workers waited for the controller; for a module with Lightning's own
    ``optimizer_step`` and one with its own."""
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        messages: Counter = Counter()
        deliver, fetch = WorkerMesh.deliver, StageChannel.fetch

        def counted(mesh: WorkerMesh, message: Any) -> Any:
            messages[message.endpoint] += 1
            return deliver(mesh, message)

        def synced(channel: StageChannel) -> list[Any]:
            entries = fetch(channel)
            messages.update(f"sync {entry.gate}" for entry in entries if entry.sync)
            return entries

        patch.setattr(WorkerMesh, "deliver", counted)
        patch.setattr(StageChannel, "fetch", synced)
        for name, callbacks in (("plain", []), ("monitored", [MeshStatsMonitor(logging_interval=INTERVAL)])):
            messages.clear()
            L.seed_everything(SEED)
            model = request.param()
            log_dir = tmp_path_factory.mktemp(name)
            trainer = _fit(model, log_dir, callbacks)
            with open(log_dir / "metrics.csv") as file:
                rows = list(csv.DictReader(file))
            results[name] = Run(
                weights={key: value.clone() for key, value in model.state_dict().items()},
                callback_metrics={key: float(value) for key, value in trainer.callback_metrics.items()},
                rows=rows,
                messages=Counter(messages),
            )
    yield results


def test_every_rank_is_logged_at_the_chosen_steps_only(runs: dict[str, Run]) -> None:
    rows = runs["monitored"].rows
    stats_rows = [row for row in rows if any(value and key.startswith("mesh/") for key, value in row.items())]
    assert [int(row["step"]) for row in stats_rows] == list(range(INTERVAL, EPOCHS * STEPS_PER_EPOCH + 1, INTERVAL))
    for row in stats_rows:
        for rank in (0, 1):
            values = {name: float(row[f"mesh/rank{rank}/{name}"]) for name in PER_RANK}
            assert 10 < values["rss_mib"] < 100_000 and values["cpu_time_s"] > 0 and values["step_time_ms"] > 0, values
    for rank in (0, 1):
        cpu_time = [float(row[f"mesh/rank{rank}/cpu_time_s"]) for row in stats_rows]
        busy = [float(row[f"mesh/rank{rank}/cpu_utilization_percent"]) for row in stats_rows]
        # 8 training steps between the first read logged and the last: the worker's CPU time grew
        # (by 50-70 ms in the runs measured; psutil counts it in 10 ms ticks)
        assert cpu_time[-1] > cpu_time[0], cpu_time
        # 100 is one core: more than this host's cores is a wrong unit or interval (measured: 40-83)
        assert all(0 <= value <= 100 * (os.cpu_count() or 1) for value in busy) and sum(busy) > 0, busy
        # each from the CPU time read with it: above 0 exactly where the CPU time grew since the last read
        assert [value > 0 for value in busy[1:]] == [
            now > before for before, now in zip(cpu_time, cpu_time[1:], strict=False)
        ]
    assert not any(key.startswith("mesh/rank2/") for key in rows[0]), "only the two workers"
    assert any(row.get("train_loss_step") for row in rows), "the module's own values are logged as before"


def test_training_is_unchanged(runs: dict[str, Run]) -> None:
    plain, monitored = runs["plain"], runs["monitored"]
    assert plain.weights.keys() == monitored.weights.keys()
    assert all(torch.equal(plain.weights[key], monitored.weights[key]) for key in plain.weights)
    assert plain.callback_metrics == monitored.callback_metrics


def test_the_workers_are_read_only_at_the_interval(runs: dict[str, Run]) -> None:
    plain, monitored = runs["plain"].messages, runs["monitored"].messages
    reads = EPOCHS * STEPS_PER_EPOCH // INTERVAL
    assert monitored["read_stats"] == 1 + reads, "one read per interval, and one at on_train_start"
    assert "read_stats" not in plain
    # the workers wait for the monitor at its reads only: at the train start and at every interval's batch end
    added = {
        gate: count - plain[gate]
        for gate, count in monitored.items()
        if gate.startswith("sync ") and count != plain[gate]
    }
    assert added == {"sync callback.on_train_start": 1, "sync callback.on_train_batch_end": reads}, (plain, monitored)


class StragglerClassifier(Classifier):
    """Rank 1 is slow in every training step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:
            time.sleep(0.05)
        return super().training_step(batch, batch_idx)


class BalancedClassifier(Classifier):
    """Every rank is equally slow, long enough for timing noise on a busy machine not to matter."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("model_class", [StragglerClassifier, BalancedClassifier])
def test_a_straggler_is_named(model_class: type, tmp_path: Path) -> None:
    monitor = MeshStatsMonitor(logging_interval=2, straggler_factor=1.5, straggler_intervals=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model_class(), tmp_path, [monitor], max_epochs=1, limit_train_batches=6)
    stragglers = [str(warning.message) for warning in caught if "straggler" in str(warning.message)]
    if model_class is BalancedClassifier:
        assert stragglers == []
    else:
        assert len(stragglers) == 1, stragglers
        assert "worker rank 1 is a straggler" in stragglers[0]
        assert "2 logging intervals in a row" in stragglers[0]


@pytest.mark.parametrize(
    ("hip", "environment", "reason", "fix"),
    [
        (None, {}, "come from NVML, which this worker cannot use (ModuleNotFoundError", "pip install nvidia-ml-py"),
        (
            "6.2.41133",
            {},
            "come from amdsmi, which this worker cannot use (ModuleNotFoundError",
            "pip install /opt/rocm",
        ),
        (
            "6.2.41133",
            {"ROCR_VISIBLE_DEVICES": "1"},
            "chosen with ROCR_VISIBLE_DEVICES='1'",
            "with HIP_VISIBLE_DEVICES",
        ),
    ],
    ids=["nvidia-without-nvml", "rocm-without-amdsmi", "rocm-pinned-by-rocr"],
)
def test_a_gpu_tool_that_cannot_be_used_degrades_to_torch_with_one_warning(
    hip: Any, environment: dict[str, str], reason: str, fix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    for module in ("pynvml", "amdsmi"):
        monkeypatch.setitem(sys.modules, module, None)  # not installed
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    sensors = GpuSensors()
    values, missing = sensors.read()
    assert values == {}, "what torch's allocator knows: nothing, in a process without CUDA"
    assert missing is not None and reason in missing and fix in missing, missing
    assert "Only torch's memory stats are logged" in missing and "memory bandwidth" in missing
    with pytest.warns(UserWarning) as recorded:
        warn_missing_tools([RankStats(rank, values, missing) for rank in (0, 1)])
    assert len(recorded) == 1 and "worker ranks [0, 1]" in str(recorded[0].message)
    assert sensors.read() == ({}, None), "later reads neither warn again nor fail"


def test_rocm_bandwidth_is_the_busy_share_of_amdsmis_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readings a ROCm worker logs, with amdsmi and torch's readers standing in for an MI300X
    (5300 GB/s peak, memory controller 40% busy)."""
    amdsmi = types.ModuleType("amdsmi")
    amdsmi.amdsmi_get_gpu_vram_info = lambda handle: {"vram_type": 7, "vram_max_bandwidth": 5300}
    monkeypatch.setitem(sys.modules, "amdsmi", amdsmi)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    readings = {
        "utilization": 30,
        "memory_usage": 40,
        "temperature": 61,
        "power_draw": 512,
        "_get_amdsmi_handler": 0,
        "memory_stats": {},
    }
    for name, value in readings.items():
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    values, missing = GpuSensors().read()
    assert missing is None
    assert values == {
        "gpu_utilization_percent": 30.0,
        "memory_busy_percent": 40.0,
        "temperature_c": 61.0,
        "power_w": 512.0,
        "memory_bandwidth_peak_gbps": 5300.0,
        "memory_bandwidth_gbps": 2120.0,
    }


def test_a_rank_is_memory_bound_when_memory_is_busy_and_compute_is_not() -> None:
    assert memory_bound({"memory_busy_percent": 90.0, "gpu_utilization_percent": 40.0}, 80.0)
    assert not memory_bound({"memory_busy_percent": 90.0, "gpu_utilization_percent": 45.0}, 80.0)
    assert not memory_bound({"memory_busy_percent": 70.0, "gpu_utilization_percent": 10.0}, 80.0)
    assert not memory_bound({"rss_mib": 500.0}, 80.0), "a CPU worker has no such readings"
    watch = StreakWatch(intervals=2)
    assert [watch.update({0, 1}, {1}), watch.update({0, 1}, {1}), watch.update({0, 1}, {1})] == [[], [1], []]
    assert [watch.update({0, 1}, set()), watch.update({0, 1}, {1}), watch.update({0, 1}, {1})] == [[], [], [1]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"memory_bound_percent": 0},
            r"memory_bound_percent=0\)`: give a number of memory-controller busy percent in \(0, 100\]",
        ),
        ({"memory_bound_percent": 101}, r"memory_bound_percent=101\)`: give"),
        ({"logging_interval": 0}, r"logging_interval=0\)`: give a whole number"),
        ({"logging_interval": "10"}, r"logging_interval='10'\)`: give a whole number"),
        ({"logging_interval": 2.5}, r"logging_interval=2.5\)`: give a whole number"),
        ({"straggler_factor": 1}, r"straggler_factor=1\)`: give a number > 1"),
        ({"straggler_intervals": 0}, r"straggler_intervals=0\)`: give a whole number"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MeshStatsMonitor(**kwargs)


def test_other_strategies_and_places_are_rejected(tmp_path: Path) -> None:
    ddp = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=CSVLogger(tmp_path))
    with pytest.raises(
        MisconfigurationException, match=r"strategy is `DDPStrategy`.*callbacks=\[DeviceStatsMonitor\(\)\]"
    ):
        MeshStatsMonitor().setup(ddp, Classifier(), "fit")
    without_logger = L.Trainer(strategy="monarch", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(MisconfigurationException, match="this Trainer has none"):
        MeshStatsMonitor().setup(without_logger, Classifier(), "fit")
    on_workers = L.Trainer(
        strategy=MonarchStrategy(worker_callbacks=[MeshStatsMonitor()]),
        accelerator="cpu",
        devices=2,
        logger=CSVLogger(tmp_path),
        max_epochs=1,
    )
    with pytest.raises(MisconfigurationException, match=r"Pass it to `Trainer\(callbacks=\[MeshStatsMonitor"):
        on_workers.fit(Classifier())


def test_lightnings_device_and_throughput_monitors_log_from_the_workers(tmp_path: Path) -> None:
    """``DeviceStatsMonitor`` and ``ThroughputMonitor`` measure where the batches and the device are,
    on the workers; rank 0's values reach the controller's logger. Their values are timings and
    loads, so the measure is that they arrive as under ``ddp`` (names, steps), not parity."""
    monitors = [DeviceStatsMonitor(cpu_stats=True), ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0]))]
    _fit(Classifier(), tmp_path, monitors, max_epochs=1)
    with open(tmp_path / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    cpu = [
        float(row[key])
        for row in rows
        for key in row
        if key.startswith("DeviceStatsMonitor.on_train_batch_start/cpu_percent") and row[key]
    ]
    # psutil's system-wide CPU percent: any value is right, so only its count is checked
    assert len(cpu) == STEPS_PER_EPOCH // 2, "one reading per logged step (log_every_n_steps=2)"
    samples = [(int(row["step"]), float(row["train/samples"])) for row in rows if row.get("train/samples")]
    # rank 0's own count: 8 samples per batch, every second batch logged
    assert samples == [(step, 8.0 * (step + 1)) for step in range(1, STEPS_PER_EPOCH, 2)], samples
