"""Rehearsal: a few real training steps on every worker before a run, with a memory and time projection.

Runs on the controller. :func:`rehearse` (and ``MonarchStrategy(rehearse=True)`` before each
``fit``, and ``lightning-monarch rehearse``) runs a short ``fit`` of copies of the module and its
data on the strategy's own workers: the warm mesh the real ``fit`` then takes over, so it costs no
second start-up. It passes the first optimizer step and any accumulation, runs one validation batch
and saves one checkpoint to a temporary file, with every rank recording its batch times and
memory (``worker.stats.RehearsalRecorder``). It reports them per rank, projects the run's time
from the Trainer's own settings, and warns where a run would fail or waste its time, naming the fix.

Nothing of it reaches the real run: the workers unpickle a fresh module and data for every stage
and reseed from ``seed_everything``'s seed at its start, as ``ddp`` ranks do; the controller's
module, data, loggers and callbacks are not used (copies are), and its random states are put back.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, cast

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lightning_monarch import namespaces
from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch._compat import loops as loops_compat
from lightning_monarch.controller import arguments
from lightning_monarch.controller.mesh.debugger import quit_in_pdb
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.controller.settings import StrategySettings, settings_of
from lightning_monarch.errors import RehearsalError, WorkerError
from lightning_monarch.wire.reports import RankStats

log = logging.getLogger(__name__)

#: Optimizer steps a rehearsal runs by default: the first (start-up, allocation of the optimizer's
#: state) and enough after it for a median step time.
DEFAULT_STEPS = 6
#: A rank whose peak memory passes this share of its device's (or of the limit given) is warned of.
MEMORY_SHARE_WARNING = 0.9
#: Ranks whose ``training_step`` times differ by more than this share are warned of.
STRAGGLER_SPREAD_WARNING = 0.2
#: Checkpoints that would take more than this share of the run are warned of.
CHECKPOINT_SHARE_WARNING = 0.1

_MIB = 2**20


@dataclass(frozen=True)
class RankRehearsal:
    """What one rank showed in the rehearsal, in MiB and milliseconds."""

    rank: int
    #: Its peak since the training started: torch's allocator peak on a GPU; on a CPU its peak resident size.
    memory_peak_mib: float
    #: After the first optimizer step, when the optimizer's state exists.
    memory_after_first_step_mib: Optional[float]
    #: Its device's memory, on a CPU its part of the host's, or the limit the rehearsal was told to assume.
    memory_total_mib: float
    #: Its ``training_step`` (forward and loss), the work a rank does alone.
    training_step_ms: Optional[float]

    @property
    def memory_share(self) -> float:
        return self.memory_peak_mib / self.memory_total_mib

    @property
    def headroom_mib(self) -> float:
        return self.memory_total_mib - self.memory_peak_mib


@dataclass(frozen=True)
class Projection:
    """The run as the Trainer is configured, from the rehearsal's times."""

    batches_per_epoch: int
    steps_per_epoch: int
    #: Validation batches of one epoch, over all its validation runs.
    val_batches_per_epoch: int
    epochs: float
    checkpoints: int
    epoch_s: float
    run_s: float
    checkpoint_share: float


@dataclass(frozen=True)
class RehearsalReport:
    """A rehearsal's findings (:func:`rehearse`): :meth:`table` for a terminal, :meth:`as_dict` for code."""

    ranks: list[RankRehearsal]
    #: ``"GPU"`` or ``"host"``: which memory the ranks' figures are.
    memory: str
    #: The median interval between training batch starts after the first, and an optimizer step's
    #: share of it (``accumulate_grad_batches`` batches).
    batch_s: float
    step_s: float
    val_batch_s: Optional[float]
    checkpoint_mib: float
    checkpoint_write_s: float
    projection: Projection
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The report as a terminal table."""
        kind = self.memory
        lines = [
            f"{'rank':>4}  {kind + ' peak MiB':>14}  {'after 1st step':>14}  {'of MiB':>10}  {'share':>6}"
            f"  {'headroom MiB':>12}  {'training_step ms':>16}"
        ]
        for rank in self.ranks:
            after = f"{rank.memory_after_first_step_mib:.0f}" if rank.memory_after_first_step_mib is not None else "-"
            step = f"{rank.training_step_ms:.1f}" if rank.training_step_ms is not None else "-"
            lines.append(
                f"{rank.rank:>4}  {rank.memory_peak_mib:>14.0f}  {after:>14}  {rank.memory_total_mib:>10.0f}"
                f"  {rank.memory_share:>6.0%}  {rank.headroom_mib:>12.0f}  {step:>16}"
            )
        projection = self.projection
        val = f"{self.val_batch_s * 1e3:.1f} ms" if self.val_batch_s is not None else "none run"
        lines += [
            "",
            f"step (median after the first): {self.step_s * 1e3:.1f} ms ({self.batch_s * 1e3:.1f} ms a batch);"
            f" validation batch: {val}",
            f"checkpoint: {self.checkpoint_mib:.3g} MiB, written in {_duration(self.checkpoint_write_s)}",
            f"projected: {_duration(projection.epoch_s)} an epoch ({projection.batches_per_epoch} batches,"
            f" {projection.steps_per_epoch} steps, {projection.val_batches_per_epoch} validation batches);"
            f" {_duration(projection.run_s)} for the run ({projection.epochs:g} epochs, {projection.checkpoints}"
            f" checkpoints: {projection.checkpoint_share:.0%} of it)",
        ]
        lines += [f"warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def rehearsal_twin(settings: StrategySettings) -> Strategy:
    """A strategy like the one of ``settings`` for a rehearsal's Trainer: on the same hosts (their
    ``HostMesh``es, so that both take the same warm mesh and connect no host again), kept warm for
    the run that follows, without restarts, elastic training or a rehearsal of its own."""
    return settings.twin(
        hosts=settings.host_mesh,
        validation_hosts=settings.validation_host_mesh,
        max_restarts=0,
        min_nodes=None,
        keep_warm=True,
        rehearse=False,
    )


def ready_again(error: BaseException, mesh: WorkerMesh, rehearsing: bool) -> bool:
    """After a failed stage: whether its workers can run the next stage as they are, with a new
    process group (``WorkerMesh.reset_world``). They can after a failed rehearsal (``rehearsing``)
    where an exception ended the stage on every rank (an out-of-memory error does on identical
    replicas), and after the user ended a stage in a worker's pdb (``q``), whose rank's leaving its
    group ends the collective its peers wait in. A rank still waiting in a collective, or a dead
    one, means the mesh is stopped, as after any other failed stage."""
    if not quit_in_pdb(error) and not (rehearsing and isinstance(error, WorkerError) and mesh.stages_ended()):
        return False
    try:
        return mesh.reset_world()
    except Exception as failure:  # stop it, as after any failed stage
        log.warning("The workers of the failed stage could not form a new process group: %r", failure)
        return False


def rehearse(
    trainer: Trainer,
    model: LightningModule,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    datamodule: Optional[LightningDataModule] = None,
    steps: int = DEFAULT_STEPS,
    memory_limit_gib: Optional[float] = None,
) -> RehearsalReport:
    """Rehearse ``trainer.fit(model, ...)`` on the workers of ``trainer``'s strategy (``"monarch"``):
    ``steps`` optimizer steps, one validation batch, one checkpoint to a temporary file; then
    report memory and times per rank, the run's projected time, and warnings with their fixes.
    ``memory_limit_gib``: the memory each rank may use, if less than its device's (on a CPU, its
    part of the host's: the host's memory over its workers). A rehearsal that fails raises ``RehearsalError``, naming the rank, the hook
    and its memory then. The ``fit`` that follows gives exactly what it gives without a rehearsal."""
    namespaces.refuse_other_namespace("rehearse", trainer, __name__)
    settings = settings_of(trainer.strategy)
    if settings is None:
        raise TypeError(
            f"`lightning_monarch.rehearse(trainer, ...)` rehearses on Monarch workers, but the Trainer's strategy is"
            f" {type(trainer.strategy).__name__}. Build the Trainer with `strategy='monarch'`."
        )
    steps = arguments.whole_number("rehearse", "steps", steps, 2, of="optimizer steps")
    limit = arguments.number(
        "rehearse", "memory_limit_gib", memory_limit_gib, above=0, of="GiB", none="to use the device's memory"
    )
    probe = _Probe()
    accumulate = trainer.accumulate_grad_batches
    rehearsal = Trainer(
        strategy=rehearsal_twin(settings),
        accelerator="gpu" if settings.worker_accelerator == "cuda" else "cpu",
        devices=settings.devices_argument,
        num_nodes=settings.num_nodes,
        precision=str(trainer.precision),  # type: ignore[arg-type]
        **{
            **lightning_compat.trainer_flags(trainer),
            "max_epochs": 1,
            "min_epochs": None,
            "max_steps": -1,
            "min_steps": None,
            "limit_train_batches": steps * accumulate,
            "limit_val_batches": 1,
            "val_check_interval": None,
            "check_val_every_n_epoch": 1,
            "num_sanity_val_steps": 0,
            "fast_dev_run": False,
            "overfit_batches": 0.0,
            "barebones": False,
        },
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with _random_states_kept(), tempfile.TemporaryDirectory(prefix="lightning_monarch_rehearsal_") as scratch:
        try:
            rehearsal.fit(
                _copy(model, trainer),
                train_dataloaders=_copy(train_dataloaders, trainer),
                val_dataloaders=_copy(val_dataloaders, trainer),
                datamodule=_copy(datamodule, trainer),
            )
        except WorkerError as error:
            failure = error.failure
            memory = f"{failure.memory_mib:.0f} MiB" if failure.memory_mib is not None else "unknown"
            raise RehearsalError(
                f"The rehearsal failed: worker rank {failure.rank} raised {failure.exception_type}{failure.where}"
                f" with {memory} of memory in use: {failure.message}",
                failure,
            ) from error
        path = os.path.join(scratch, "rehearsal.ckpt")
        started = time.monotonic()
        rehearsal.save_checkpoint(path)
        write_s = time.monotonic() - started
        checkpoint_mib = _size(path) / _MIB
    assert probe.stats is not None and probe.lengths is not None  # read at the stage's end
    return _report(trainer, probe.stats, probe.lengths, checkpoint_mib, write_s, limit)


class _Probe(Callback):
    """The rehearsal's controller callback: the workers wait at its two hooks (it is not
    observe-only), where it reads every rank's stats, and the dataloaders' lengths."""

    def __init__(self) -> None:
        self.stats: Optional[list[RankStats]] = None
        self.lengths: Optional[tuple[int, int]] = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.read_worker_stats()  # type: ignore[attr-defined]  # starts each rank's step timer

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.stats = trainer.strategy.read_worker_stats()  # type: ignore[attr-defined]
        lengths = loops_compat.combined_loader_lengths(trainer)
        train, val = lengths.get("train") or [], lengths.get("val") or []
        if None in train or None in val:
            raise ValueError(
                "`lightning_monarch.rehearse(...)`: a dataloader of this run has no length (an IterableDataset),"
                " so an epoch's time cannot be projected. Give it a `__len__`, or rehearse with one that has."
            )
        # Lightning cycles train loaders to the longest by default, and runs validation loaders one after another
        self.lengths = (max(cast(list[int], train), default=0), sum(cast(list[int], val)))


def _size(path: str) -> int:
    """The bytes of a checkpoint: a file, or under ``MonarchFSDPStrategy`` a directory of shards."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _copy(value: Any, trainer: Trainer) -> Any:
    """A deep copy of ``value`` without the Trainers it refers to, as the workers' payload leaves
    them out (``controller.mesh.payload``): a LightningDataModule keeps the last Trainer it was attached to."""
    memo: dict[int, Any] = {id(trainer): None}
    attached = value.trainer if isinstance(value, LightningDataModule) else None
    if attached is not None:
        memo[id(attached)] = None
    return copy.deepcopy(value, memo)


@contextmanager
def _random_states_kept() -> Iterator[None]:
    """Put back this process's random states (Python's, NumPy's, torch's) after the rehearsal."""
    states = lightning_compat.rng_states()
    try:
        yield
    finally:
        lightning_compat.set_rng_states(states)


def _report(
    trainer: Trainer,
    stats: list[RankStats],
    lengths: tuple[int, int],
    checkpoint_mib: float,
    write_s: float,
    limit_gib: Optional[float],
) -> RehearsalReport:
    gpu = trainer.strategy.worker_accelerator == "cuda"  # type: ignore[attr-defined]
    ranks = [
        RankRehearsal(
            rank=rank.rank,
            memory_peak_mib=rank.values["memory_peak_mib"],
            memory_after_first_step_mib=rank.values.get("memory_after_first_step_mib"),
            memory_total_mib=min(rank.values["memory_total_mib"], limit_gib * 1024)
            if limit_gib is not None
            else rank.values["memory_total_mib"],
            training_step_ms=rank.values.get("step_time_ms"),
        )
        for rank in stats
    ]
    batch_s = max(rank.values.get("batch_interval_ms", 0.0) for rank in stats) / 1e3
    val_times = [rank.values["val_batch_ms"] for rank in stats if "val_batch_ms" in rank.values]
    val_batch_s = max(val_times) / 1e3 if val_times else None
    projection = _project(trainer, lengths, batch_s, val_batch_s or 0.0, write_s)
    report = RehearsalReport(
        ranks=ranks,
        memory="GPU" if gpu else "host",
        batch_s=batch_s,
        step_s=batch_s * trainer.accumulate_grad_batches,
        val_batch_s=val_batch_s,
        checkpoint_mib=checkpoint_mib,
        checkpoint_write_s=write_s,
        projection=projection,
    )
    report.warnings.extend(_warnings(report))
    return report


def _project(
    trainer: Trainer, lengths: tuple[int, int], batch_s: float, val_batch_s: float, write_s: float
) -> Projection:
    """The run's time as ``trainer`` is configured: its batches per epoch (``limit_train_batches``),
    validation runs per epoch (``val_check_interval``, ``check_val_every_n_epoch``, with
    ``limit_val_batches``), epochs (``max_epochs``, or ``max_steps`` where it ends the run first)
    and the checkpoints its ``ModelCheckpoint`` callbacks write."""
    train_length, val_length = lengths
    batches = _limited(train_length, trainer.limit_train_batches)
    steps_per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
    interval = trainer.val_check_interval
    checks = batches // interval if isinstance(interval, int) else max(1, round(1 / interval)) if interval else 1
    every = trainer.check_val_every_n_epoch or 1
    val_batches = _limited(val_length, trainer.limit_val_batches) * checks // every
    max_epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else 1000
    epochs = float(max_epochs)
    if trainer.max_steps > 0:
        epochs = min(epochs, trainer.max_steps / steps_per_epoch)
    epoch_s = batches * batch_s + val_batches * val_batch_s
    checkpoints = sum(_saves(callback, epochs, steps_per_epoch) for callback in trainer.checkpoint_callbacks)
    train_s = epochs * epoch_s
    checkpoint_s = checkpoints * write_s
    return Projection(
        batches_per_epoch=batches,
        steps_per_epoch=steps_per_epoch,
        val_batches_per_epoch=val_batches,
        epochs=epochs,
        checkpoints=checkpoints,
        epoch_s=epoch_s,
        run_s=train_s + checkpoint_s,
        checkpoint_share=checkpoint_s / (train_s + checkpoint_s) if train_s + checkpoint_s else 0.0,
    )


def _limited(length: int, limit: Any) -> int:
    """Batches of a loader of ``length`` under Lightning's ``limit_*_batches`` (a count or a share)."""
    if isinstance(limit, int):
        return min(length, limit)
    return int(length * limit) if limit is not None else length


def _saves(callback: Any, epochs: float, steps_per_epoch: int) -> int:
    """How many checkpoint files a ``ModelCheckpoint`` writes in the run (``save_last`` once more)."""
    if not isinstance(callback, ModelCheckpoint):
        return 0
    every_steps, _ = lightning_compat.checkpoint_schedule(callback)
    every_epochs = lightning_compat.checkpoint_every_n_epochs(callback)
    if every_steps:
        saves = int(epochs * steps_per_epoch) // every_steps
    else:
        saves = int(epochs) // every_epochs if every_epochs else 0
    return saves + (1 if callback.save_last else 0)


def _warnings(report: RehearsalReport) -> list[str]:
    found = []
    for rank in report.ranks:
        if rank.memory_share > MEMORY_SHARE_WARNING:
            found.append(
                f"rank {rank.rank} peaks at {rank.memory_share:.0%} of its {report.memory} memory"
                f" ({rank.memory_peak_mib:.0f} of {rank.memory_total_mib:.0f} MiB): the run may run out of memory."
                " Lower the batch size, train in `precision='bf16-mixed'`, shard the module with"
                " `strategy='monarch_fsdp'`, or checkpoint activations"
                " (`MonarchFSDPStrategy(activation_checkpointing_policy={...})`)."
            )
    times = {rank.rank: rank.training_step_ms for rank in report.ranks if rank.training_step_ms}
    if len(times) > 1 and max(times.values()) > (1 + STRAGGLER_SPREAD_WARNING) * min(times.values()):
        slowest = max(times, key=lambda rank: times[rank])
        fastest = min(times, key=lambda rank: times[rank])
        found.append(
            f"rank {slowest}'s training_step takes {times[slowest]:.1f} ms, rank {fastest}'s {times[fastest]:.1f} ms:"
            " every step waits for the slowest rank. Look for a straggler (a slower or busier device or host) or"
            " an unbalanced sampler (ranks given batches of different sizes)."
        )
    if report.projection.checkpoint_share > CHECKPOINT_SHARE_WARNING:
        found.append(
            f"checkpoints would take {report.projection.checkpoint_share:.0%} of the run"
            f" ({report.projection.checkpoints} of {_duration(report.checkpoint_write_s)} each): save less often"
            " (`ModelCheckpoint(every_n_epochs=...)`, `every_n_train_steps`) or keep fewer"
            " (`save_top_k`, `save_weights_only=True`)."
        )
    return found


def _duration(seconds: float) -> str:
    """``seconds`` as a person reads a duration: ``4.2 ms``, ``4.20 s``, ``42.0 s``, ``12.5 min``, ``30.1 h``."""
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
