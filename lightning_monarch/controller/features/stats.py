"""``MeshStatsMonitor``: every worker's device and process stats in the controller's loggers.

Runs on the controller. Under ``strategy="monarch"`` the devices belong to the workers, so
Lightning's ``DeviceStatsMonitor`` can only run there, once per rank, and each rank's values
would reach the loggers through rank 0 only. This callback asks all workers at once, at a chosen
interval, and logs every rank side by side; it also watches for a rank that stays slower than the
others (a straggler), which every rank waits for at each gradient all-reduce.
"""

from __future__ import annotations

import statistics
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_monarch import namespaces
from lightning_monarch.controller import arguments
from lightning_monarch.wire.reports import RankStats


class MeshStatsMonitor(Callback):
    """Log every worker's device and process stats, and warn about stragglers.

    Runs on the controller, under ``Trainer(strategy="monarch")``: pass it in
    ``Trainer(callbacks=[MeshStatsMonitor(...)])``. Every ``logging_interval`` training steps
    (``trainer.global_step``) it reads all workers' stats in one message and logs them through
    every logger of the Trainer as ``mesh/rank{rank}/{name}`` at ``step=trainer.global_step``, so
    one logger shows every rank:

    | name | workers | source |
    | --- | --- | --- |
    | ``step_time_ms`` | all | the rank's mean training-batch time (below) |
    | ``rss_mib`` | all | the worker process's resident memory (psutil) |
    | ``cpu_time_s`` | all | its user + system CPU time so far (psutil) |
    | ``cpu_utilization_percent`` | all | its CPU time over wall time since the last read; 100 is one core |
    | ``memory_allocated_mib``, ``memory_reserved_mib``, ``memory_peak_mib`` | GPU (CUDA, ROCm) | ``torch.cuda.memory_stats``: torch's allocator, HIP-backed on ROCm |
    | ``gpu_utilization_percent``, ``temperature_c``, ``power_w`` | GPU with NVML or amdsmi | NVML (``pip install nvidia-ml-py``) on NVIDIA, ``amdsmi`` on ROCm, through ``torch.cuda``'s readers |
    | ``memory_busy_percent`` | GPU with NVML or amdsmi | ``torch.cuda.memory_usage``: the share of time the memory controller was busy (NVML's memory utilization; amdsmi's ``umc_activity``) |
    | ``memory_bandwidth_peak_gbps``, ``memory_bandwidth_gbps`` | ROCm with amdsmi from ROCm 6.4 | amdsmi's ``vram_max_bandwidth`` (GB/s at the current memory clock), and the estimate busy percent x peak |

    A missing NVML or amdsmi is reported in one warning, and the rest is logged; it never fails
    the run.

    **Step time.** Measured on each worker, from its ``on_train_batch_start`` to its first
    ``on_before_backward`` (its ``training_step``: forward and loss), averaged over the batches
    since the last read; on GPUs with CUDA/HIP events, the device's own time. That is the work a
    rank does alone: the gradient all-reduce in backward makes every rank wait for the slowest, so
    whole-step times would be equal and hide a straggler. Collectives inside ``training_step``
    (``self.log(..., sync_dist=True)`` on every step, ``SyncBatchNorm``) make the ranks wait for
    each other there too, and hide a straggler likewise. The controller cannot time the steps
    itself: it sends a step without waiting for it.

    **Stragglers.** After each read, a rank whose step time is above ``straggler_factor`` times the
    median of the other ranks' counts one interval; after ``straggler_intervals`` such intervals
    in a row, a warning names the rank (once per streak).

    **Memory-bound ranks.** A GPU rank whose memory controller is busy at least
    ``memory_bound_percent`` of the time while its compute utilization is below half of that
    counts one interval; after ``straggler_intervals`` such intervals in a row, a warning names the
    rank (once per streak): its steps wait on memory traffic, not on arithmetic. The tools sample
    over their own short period (1/6 s to 1 s on NVIDIA), so a read shows the moment it is taken;
    a streak of reads is what makes it a pattern.

    **Cost.** One read of every worker per ``logging_interval`` steps, plus one at
    ``on_train_start`` (it starts the workers' step timers). At those batches, and only there, the
    workers park at ``on_train_batch_end`` until the controller's loop has replayed up to them and
    read them (a sync gate, see ``docs/architecture.md``); between reads they run ahead of the
    controller as without the monitor. A read costs a round trip (about 2 ms for 2 CPU workers on
    a 2-core host), each worker's reads (psutil's take microseconds, NVML or amdsmi a few
    milliseconds) and, on a GPU, a wait for the last timed batch's forward pass to finish on the
    device. Training itself is unchanged: the weights and metrics are bit for bit those of a run
    without the monitor.

    Args:
        logging_interval: log every this many training steps; a whole number >= 1.
        straggler_factor: how many times slower than the median of the other ranks a rank must be
            to count as a straggler for an interval; a number > 1.
        straggler_intervals: how many logging intervals in a row a rank must be that slow (or
            memory-bound) before the warning; a whole number >= 1.
        memory_bound_percent: the memory-controller busy percent from which a GPU rank whose
            compute utilization is below half of it counts as memory-bound; a number in (0, 100].

    Raises:
        ValueError: for arguments outside those ranges.
        MisconfigurationException: at ``setup``, under any strategy but ``"monarch"`` (use
            Lightning's ``DeviceStatsMonitor`` there), or for a Trainer without a logger.

    Example::

        import lightning as L
        import lightning_monarch
        from lightning_monarch import MeshStatsMonitor

        trainer = L.Trainer(strategy="monarch", devices=8, callbacks=[MeshStatsMonitor(logging_interval=50)])
    """

    def __init__(
        self,
        logging_interval: int = 50,
        straggler_factor: float = 1.5,
        straggler_intervals: int = 3,
        memory_bound_percent: float = 80.0,
    ) -> None:
        owner = "MeshStatsMonitor"
        arguments.whole_number(
            owner,
            "logging_interval",
            logging_interval,
            1,
            of="training steps",
            meaning=", e.g. `MeshStatsMonitor(logging_interval=50)`",
        )
        arguments.number(
            owner,
            "straggler_factor",
            straggler_factor,
            above=1,
            meaning=", how many times slower than the median of the other ranks a straggler is,"
            " e.g. `straggler_factor=1.5`",
        )
        arguments.whole_number(
            owner,
            "straggler_intervals",
            straggler_intervals,
            1,
            of="logging intervals in a row",
            meaning=", e.g. `straggler_intervals=3`",
        )
        arguments.number(
            owner,
            "memory_bound_percent",
            memory_bound_percent,
            above=0,
            at_most=100,
            of="memory-controller busy percent",
            meaning=" from which a rank counts as memory-bound, e.g. `memory_bound_percent=80`",
        )
        self.logging_interval = logging_interval
        self.straggler_factor = float(straggler_factor)
        self.straggler_intervals = straggler_intervals
        self.memory_bound_percent = float(memory_bound_percent)
        self._stragglers = StragglerWatch(self.straggler_factor, straggler_intervals)
        self._memory_bound = StreakWatch(straggler_intervals)
        self._interval = 0

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        namespaces.refuse_other_namespace(type(self).__name__, trainer, __name__)
        if not callable(getattr(trainer.strategy, "read_worker_stats", None)):  # a MonarchStrategy's reader
            raise MisconfigurationException(
                f"`MeshStatsMonitor` reads the workers of `Trainer(strategy='monarch')` from its controller, and this"
                f" Trainer's strategy is `{type(trainer.strategy).__name__}`. Under other strategies use Lightning's"
                " `Trainer(callbacks=[DeviceStatsMonitor()])`, or train with"
                " `Trainer(strategy='monarch', callbacks=[MeshStatsMonitor(...)])`."
            )
        if not trainer.loggers:
            raise MisconfigurationException(
                "`MeshStatsMonitor` logs through the Trainer's loggers, and this Trainer has none: pass one, e.g."
                " `Trainer(logger=CSVLogger('logs'))`, or remove the callback."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stragglers = StragglerWatch(self.straggler_factor, self.straggler_intervals)
        self._memory_bound = StreakWatch(self.straggler_intervals)
        self._interval = trainer.global_step // self.logging_interval
        # the first read starts each worker's step timer; its values are the baseline, not logged
        _read(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        interval = trainer.global_step // self.logging_interval
        if interval == self._interval:
            return
        self._interval = interval
        stats = _read(trainer)
        metrics = {f"mesh/rank{rank.rank}/{name}": value for rank in stats for name, value in rank.values.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        step_times = {rank.rank: rank.values["step_time_ms"] for rank in stats if "step_time_ms" in rank.values}
        for rank, time_ms, others_ms in self._stragglers.update(step_times):
            rank_zero_warn(
                f"MeshStatsMonitor: worker rank {rank} is a straggler: its step time has been above"
                f" {self.straggler_factor:g}x the median of the other ranks for {self.straggler_intervals} logging"
                f" intervals in a row ({time_ms:.1f} ms against {others_ms:.1f} ms at step {trainer.global_step})."
                f" Every rank waits for it at each gradient all-reduce. Compare its `mesh/rank{rank}/...` metrics"
                " and its host's load with the other ranks'."
            )
        bound = {rank.rank for rank in stats if memory_bound(rank.values, self.memory_bound_percent)}
        for rank in self._memory_bound.update({rank.rank for rank in stats}, bound):
            values = next(entry.values for entry in stats if entry.rank == rank)
            bandwidth = (
                f", about {values['memory_bandwidth_gbps']:.0f} of {values['memory_bandwidth_peak_gbps']:.0f} GB/s"
                if "memory_bandwidth_gbps" in values
                else ""
            )
            rank_zero_warn(
                f"MeshStatsMonitor: worker rank {rank} is memory-bound: its memory controller has been busy at least"
                f" {self.memory_bound_percent:g}% of the time with compute utilization below half of that, for"
                f" {self.straggler_intervals} logging intervals in a row ({values['memory_busy_percent']:.0f}% memory"
                f" busy, {values['gpu_utilization_percent']:.0f}% utilization{bandwidth} at step {trainer.global_step})."
                " Its steps wait on memory traffic: larger batches, fused kernels, `precision='bf16-mixed'` or"
                " activation checkpointing move the balance; compare `mesh/rank{rank}/memory_busy_percent`."
            )


class StragglerWatch:
    """Runs on the controller: per rank, how many reads in a row its step time was above
    ``factor`` times the median of the other ranks'. A read without a rank's step time (new
    workers after a restart) ends its streak."""

    def __init__(self, factor: float, intervals: int) -> None:
        self._factor = factor
        self._streaks = StreakWatch(intervals)

    def update(self, step_times_ms: dict[int, float]) -> list[tuple[int, float, float]]:
        """Count one read; return ``(rank, its time, the others' median)`` for each rank whose
        streak reached ``intervals`` with this read."""
        medians = {
            rank: statistics.median(others)
            for rank in step_times_ms
            if (others := [time_ms for other, time_ms in step_times_ms.items() if other != rank])
        }
        slow = {rank for rank, median in medians.items() if step_times_ms[rank] > self._factor * median}
        return [(rank, step_times_ms[rank], medians[rank]) for rank in self._streaks.update(set(step_times_ms), slow)]


def memory_bound(values: dict[str, float], busy_percent: float) -> bool:
    """Whether a rank's readings say memory-bound: its memory controller busy at least
    ``busy_percent`` of the time, its compute utilization below half of that."""
    busy, utilization = values.get("memory_busy_percent"), values.get("gpu_utilization_percent")
    return busy is not None and utilization is not None and busy >= busy_percent and utilization < busy / 2


class StreakWatch:
    """Runs on the controller: per rank, how many reads in a row a condition held. A rank that a
    read does not include, or for which the condition failed, starts again from zero."""

    def __init__(self, intervals: int) -> None:
        self._intervals = intervals
        self._streaks: dict[int, int] = {}

    def update(self, ranks: set[int], holding: set[int]) -> list[int]:
        """Count one read of ``ranks``, where the condition held for ``holding``; return the ranks
        whose streak reached ``intervals`` with this read."""
        self._streaks = {rank: self._streaks.get(rank, 0) + 1 for rank in holding & ranks}
        return sorted(rank for rank, streak in self._streaks.items() if streak == self._intervals)


def _read(trainer: Trainer) -> list[RankStats]:
    stats = trainer.strategy.read_worker_stats()  # type: ignore[attr-defined]
    warn_missing_tools(stats)
    return stats


def warn_missing_tools(stats: list[RankStats]) -> None:
    """Runs on the controller: one warning per reason a GPU tool gave nothing, naming the ranks
    (each worker reports its reason once, on its first read)."""
    ranks_by_reason: dict[str, list[int]] = {}
    for rank in stats:
        if rank.missing is not None:
            ranks_by_reason.setdefault(rank.missing, []).append(rank.rank)
    for reason, ranks in ranks_by_reason.items():
        rank_zero_warn(f"MeshStatsMonitor, worker ranks {ranks}: {reason}")
