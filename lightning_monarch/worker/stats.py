"""One rank's device, process and step-time stats, read for the controller's ``MeshStatsMonitor``.

Runs in each worker process, on the stage's loop thread while it is parked at a gate
(``StageLoop.out_of_band``), so the values belong to the point both loops have reached. Nothing
here runs until the controller asks: the first read of a stage appends a :class:`StepTimer` to
the rank's Trainer, and a GPU worker tries its GPU tool on its first read. Sources:

- every worker: its process's resident memory and CPU time (``psutil``), and its step times;
- a GPU worker (CUDA, or ROCm through the same ``torch.cuda`` API): ``torch.cuda.memory_stats``,
  HIP-backed on ROCm, and utilization, memory-controller busy percent, temperature and power from
  NVML (``nvidia-ml-py``) on NVIDIA or ``amdsmi`` on ROCm where installed; on ROCm also the VRAM's
  peak bandwidth, and from it the bandwidth in use. Without the tool, torch's memory stats remain and
  the first read says why (:attr:`~lightning_monarch.wire.reports.RankStats.missing`); it never fails.
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from typing import Any, Optional, Union

import psutil
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch._compat import torch as torch_compat
from lightning_monarch.wire.reports import RankStats

_MIB = 2**20

#: Per GPU platform: the module behind ``torch.cuda.utilization``/``temperature``/``power_draw``,
#: the tool's name, and how to install it.
_GPU_TOOLS = {
    "NVIDIA": ("pynvml", "NVML", "`pip install nvidia-ml-py`"),
    "ROCm": ("amdsmi", "amdsmi", "ROCm's `amdsmi` Python package (`pip install /opt/rocm/share/amd_smi`)"),
}


class _WallClock:
    """Host time, for a CPU worker, whose work is done when its Python call returns."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def elapsed_ms(start: float, end: float) -> float:
        return (end - start) * 1e3


class _EventClock:
    """Device time, for a GPU worker: CUDA/HIP events on the current stream. GPU work is
    asynchronous, so host time would measure only the kernel launches; the events measure the
    GPU's own timeline without synchronizing any step. Reading waits for the last event only."""

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed_ms(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end)


class StepTimer(Callback):
    """Runs in each worker, added to the rank's Trainer by the stage's first stats read: times this
    rank's training batches from its ``on_train_batch_start`` to its first ``on_before_backward``,
    i.e. its ``training_step`` (forward and loss).

    That is the work a rank does alone: under DDP the gradient all-reduce in backward makes every
    rank wait for the slowest, so a whole step takes as long on every rank and would hide a
    straggler. Batches without a backward (a ``training_step`` that returns ``None``, manual
    optimization without ``manual_backward``) are not timed. The span also holds any wait of the
    rank at a gate inside it for the controller's next message (a module that overrides
    ``on_train_batch_start``): the same short wait on every rank.
    """

    def __init__(self, device: torch.device) -> None:
        self._clock: Union[_WallClock, _EventClock] = _EventClock() if device.type == "cuda" else _WallClock()
        self._started: Any = None
        self._spans: list[tuple[Any, Any]] = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._started = self._clock.mark()

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._started is not None:
            self._spans.append((self._started, self._clock.mark()))
            self._started = None

    def take_mean_ms(self) -> Optional[float]:
        """The mean time of the batches timed since the last call; ``None`` if none was."""
        spans, self._spans = self._spans, []
        if not spans:
            return None
        return sum(self._clock.elapsed_ms(start, end) for start, end in spans) / len(spans)


def memory_in_use_mib() -> float:
    """The memory this worker uses now: its GPU's allocated memory once it uses one, else its
    process's resident size."""
    if torch.cuda.is_initialized():
        return torch.cuda.memory_allocated() / _MIB
    return psutil.Process().memory_info().rss / _MIB


class RehearsalRecorder(Callback):
    """Runs in each worker during a rehearsal (``controller.features.rehearsal``), the last of the rank's
    callbacks: the interval between its training batch starts (the whole batch, data, forward,
    backward, all-reduce and optimizer step included: under DDP the ranks start each batch in
    step), its validation batch times, its memory after its first optimizer step, and its peak
    memory since the training started: torch's allocator peak on a GPU, the process's peak resident
    size on a CPU (Linux's, reset at the start; elsewhere the largest at a batch end), against its
    device's memory, or on a CPU its part of the host's (shared by the host's workers). Read with
    the rank's stats (:meth:`RankStatsReader.read`)."""

    def __init__(self) -> None:
        self._gpu = False
        self._batch_starts: list[float] = []
        self._val_started = 0.0
        self._val_times: list[float] = []
        self._after_first_step: Optional[float] = None
        self._peak = 0.0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._gpu = trainer.strategy.root_device.type == "cuda"
        if self._gpu:
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak_rss()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_starts.append(time.perf_counter())

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        memory = memory_in_use_mib()
        self._peak = max(self._peak, memory)
        if self._after_first_step is None and lightning_compat.stepped_this_batch(trainer):
            self._after_first_step = memory

    @override
    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._val_started = time.perf_counter()

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self._gpu:
            torch.cuda.synchronize()  # the batch's device work, not its launch
        self._val_times.append(time.perf_counter() - self._val_started)

    def readings(self) -> dict[str, float]:
        """What it recorded, named with units: the batch interval is the median of those after the
        first batch (which holds the start-up), the validation batch time the median."""
        values: dict[str, float] = {}
        starts = self._batch_starts[1:]
        intervals = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
        if intervals:
            values["batch_interval_ms"] = statistics.median(intervals) * 1e3
        if self._val_times:
            values["val_batch_ms"] = statistics.median(self._val_times) * 1e3
        if self._after_first_step is not None:
            values["memory_after_first_step_mib"] = self._after_first_step
        if self._gpu:
            values["memory_peak_mib"] = torch.cuda.max_memory_allocated() / _MIB
            values["memory_total_mib"] = (
                torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / _MIB
            )
        else:
            values["memory_peak_mib"] = max(self._peak, memory_in_use_mib(), _peak_rss_mib())
            # the workers of a host share its memory: each rank's part of it
            workers_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            values["memory_total_mib"] = psutil.virtual_memory().total / _MIB / workers_here
        return values


def _reset_peak_rss() -> None:
    """Start this process's peak resident size (``VmHWM``) anew, where Linux lets it (4.0 and later)."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:  # not Linux, or not allowed: the largest size at a batch end stands in
        pass


def _peak_rss_mib() -> float:
    """This process's peak resident size (``VmHWM``) in MiB; 0 where Linux does not give it."""
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class GpuSensors:
    """Runs in each GPU worker: its GPU's memory from torch's caching allocator, and its
    utilization, memory-controller busy percent, temperature and power from NVML (NVIDIA) or
    amdsmi (ROCm), with amdsmi's peak VRAM bandwidth where it gives one.

    The tool's readings go through ``torch.cuda.utilization``, ``temperature`` and
    ``power_draw``, which map the worker's visible device to the tool's own device index (on ROCm
    through ``HIP_VISIBLE_DEVICES``; a GPU chosen with ``ROCR_VISIBLE_DEVICES`` alone cannot be
    mapped, and is treated as a tool that fails rather than read as another GPU). When the tool is
    missing or fails, the first read returns why and later reads give torch's memory stats alone.
    """

    def __init__(self) -> None:
        self._tool_works = True

    def read(self) -> tuple[dict[str, float], Optional[str]]:
        """The readings, and on the read where the tool first failed, why."""
        values = _allocator_stats()
        if not self._tool_works:
            return values, None
        platform = "ROCm" if torch.version.hip else "NVIDIA"
        try:
            values.update(_tool_readings(platform))
        except Exception as error:  # a missing or unusable tool degrades, never fails the run
            self._tool_works = False
            _, tool, install = _GPU_TOOLS[platform]
            fix = f" Install {install} on the workers' hosts for the rest." if isinstance(error, ImportError) else ""
            return values, (
                f"GPU utilization, memory bandwidth, temperature and power on {platform} come from {tool}, which this worker"
                f" cannot use ({type(error).__name__}: {error}). Only torch's memory stats are logged.{fix}"
            )
        return values, None


def _allocator_stats() -> dict[str, float]:
    """Memory of torch's caching allocator on this worker's GPU; nothing before CUDA started."""
    stats = torch.cuda.memory_stats()
    if not stats:
        return {}
    return {
        "memory_allocated_mib": stats["allocated_bytes.all.current"] / _MIB,
        "memory_reserved_mib": stats["reserved_bytes.all.current"] / _MIB,
        "memory_peak_mib": stats["allocated_bytes.all.peak"] / _MIB,
    }


def _tool_readings(platform: str) -> dict[str, float]:
    """Utilization, temperature and power of this worker's GPU from NVML or amdsmi; raises when the
    tool is missing or cannot read this GPU."""
    rocr_devices = os.environ.get("ROCR_VISIBLE_DEVICES")
    if platform == "ROCm" and rocr_devices is not None and os.environ.get("HIP_VISIBLE_DEVICES") is None:
        raise RuntimeError(
            f"this worker's GPU is chosen with ROCR_VISIBLE_DEVICES={rocr_devices!r}, which torch's amdsmi readers"
            " do not map to the GPU's amdsmi index (they would read another GPU). Choose the workers' GPUs with"
            " HIP_VISIBLE_DEVICES instead of ROCR_VISIBLE_DEVICES"
        )
    # the module behind torch's readers: a missing one raises ImportError, answered with how to install it
    tool = importlib.import_module(_GPU_TOOLS[platform][0])
    power = float(torch.cuda.power_draw())
    values = {
        "gpu_utilization_percent": float(torch.cuda.utilization()),
        # NVML's memory utilization on NVIDIA, amdsmi's ``umc_activity`` (the memory controller) on ROCm
        "memory_busy_percent": float(torch.cuda.memory_usage()),
        "temperature_c": float(torch.cuda.temperature()),
        # NVML reports milliwatts, amdsmi watts
        "power_w": power if platform == "ROCm" else power / 1e3,
    }
    peak = _peak_bandwidth_gbps(tool) if platform == "ROCm" else None
    if peak:
        values["memory_bandwidth_peak_gbps"] = peak
        values["memory_bandwidth_gbps"] = values["memory_busy_percent"] / 100 * peak
    return values


def _peak_bandwidth_gbps(amdsmi: Any) -> Optional[float]:
    """The VRAM's peak bandwidth at its current memory clock in GB/s, as amdsmi gives it
    (``vram_max_bandwidth``, from ROCm 6.4); ``None`` where this amdsmi does not. NVML gives no
    peak bandwidth, so on NVIDIA only the busy percent is logged."""
    info = amdsmi.amdsmi_get_gpu_vram_info(torch_compat.amdsmi_handle())
    peak = info.get("vram_max_bandwidth") if isinstance(info, dict) else None
    return float(peak) if isinstance(peak, (int, float)) and peak > 0 else None


class RankStatsReader:
    """Runs in each worker, one per process: answers the controller's stats reads."""

    def __init__(self) -> None:
        self._gpu = GpuSensors()
        #: Wall-clock and CPU time at the last read, for the CPU utilization in between.
        self._last: Optional[tuple[float, float]] = None

    def read(self, rank: int, trainer: Trainer) -> RankStats:
        """This rank's stats now; the first read of a stage starts timing its steps."""
        device = trainer.strategy.root_device
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        timer = next((callback for callback in callbacks if isinstance(callback, StepTimer)), None)
        if timer is None:
            timer = StepTimer(device)
            callbacks.append(timer)
        values = self._process_stats()
        step_time = timer.take_mean_ms()
        if step_time is not None:
            values["step_time_ms"] = step_time
        missing = None
        if device.type == "cuda":
            gpu, missing = self._gpu.read()
            values.update(gpu)
        for callback in callbacks:
            if isinstance(callback, RehearsalRecorder):
                values.update(callback.readings())
        return RankStats(rank=rank, values=values, missing=missing)

    def _process_stats(self) -> dict[str, float]:
        process = psutil.Process()
        times = process.cpu_times()
        now, cpu_time = time.monotonic(), times.user + times.system
        values = {"rss_mib": process.memory_info().rss / _MIB, "cpu_time_s": cpu_time}
        if self._last is not None and now > self._last[0]:
            values["cpu_utilization_percent"] = 100.0 * (cpu_time - self._last[1]) / (now - self._last[0])
        self._last = (now, cpu_time)
        return values
