"""Elastic training: a ``fit`` that loses hosts goes on with the hosts it has, and takes them back.

Runs on the controller. Under ``MonarchStrategy(min_nodes=M)`` a ``fit`` keeps a resume point at
each snapshot gate, the start of every ``snapshot_every_n_epochs``-th training epoch, where the
workers wait (:class:`ResumePoints`). When the workers of a host die and no new process starts on
it within ``connect_timeout`` (``StageChannel`` raises ``HostsLostError``), :class:`ElasticFit`
shrinks the mesh to the surviving hosts, whose processes are kept and form a new process group,
and runs the stage again from the latest resume point, in the same ``fit`` call (:meth:`ElasticFit.run`). At
a later resume point, a lost host that serves again (``HostsReturned``) rejoins the same way.
A host served by ``lightning-monarch serve`` (``lightning_monarch.host``) that gets SIGTERM, the
notice a preemptible host gets before it is taken, makes every worker park at the end of the next
optimizer step; the controller keeps a resume point there and goes on without that host from it
(``PreemptionNoticed``), so that no step is redone.

The contract: a run whose world changes from W to W' workers at a resume point ends exactly as
``ddp`` would, stopped at that point's checkpoint and resumed with W' processes and
``accumulate_grad_batches`` scaled by W / W' (the same global batch), where that is a whole number.
A resume point in the middle of an epoch is resumed as Lightning resumes any such checkpoint: with
a dataloader that keeps no state, the rest of the epoch draws the first batches of the new world's
sampler again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn, Optional, TypeVar, Union

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from monarch.actor import HostMesh
from typing_extensions import override

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.mesh.hosts import (
    LostHostCheck,
    host_mesh,
    known_addresses,
    reachable,
    worker_addresses,
)
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.controller.settings import StageOutcome, StrategyHooks, StrategySettings
from lightning_monarch.errors import HostsLostError, UnreachableHostsError
from lightning_monarch.memory_files import MemoryFile
from lightning_monarch.wire.codec import pack
from lightning_monarch.wire.specs import StageSpec

log = logging.getLogger(__name__)
#: What a stage's run returns.
Result = TypeVar("Result")

#: The metrics each world change logs to the controller's loggers, at the step the run resumes from.
WORLD_SIZE_METRIC = "monarch/world_size"
ACCUMULATION_METRIC = "monarch/accumulate_grad_batches"


class ResumePoints:
    """Runs on the controller: an elastic ``fit``'s latest resume point, as a checkpoint file.

    Where the workers wait, the controller writes the checkpoint that ``trainer.save_checkpoint``
    writes there (its callbacks' state, rank 0's model, optimizer and worker callbacks' state): at a
    snapshot gate, with the epoch just begun counted as not begun, so that Lightning resumes it as a
    run that stopped after the previous epoch (``as_stopped_before_epoch``); after a preemption
    notice, at the end of a training batch, as ``ModelCheckpoint(every_n_train_steps=...)`` saves
    one. Only the latest is kept, in a memory file of this process (``memory_files``), which
    :meth:`remove` closes and a killed controller leaves nothing of.
    """

    def __init__(self) -> None:
        self._file = MemoryFile("lightning_monarch_resume.ckpt")
        self.path = self._file.path
        #: Where the latest resume point is, in words, and its global step; ``None`` before the first.
        self.latest: Optional[tuple[str, int]] = None

    def keep(self, trainer: Trainer) -> None:
        """Write the resume point of the training epoch that ``trainer`` is starting."""
        checkpoint = lightning_compat.dump_checkpoint(trainer)
        lightning_compat.as_stopped_before_epoch(checkpoint)
        self._write(trainer, checkpoint, f"the start of epoch {trainer.current_epoch}")

    def keep_batch_end(self, trainer: Trainer) -> None:
        """Write the resume point of the end of the training batch that ``trainer`` is ending."""
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        self._write(
            trainer,
            lightning_compat.dump_checkpoint(trainer),
            f"epoch {trainer.current_epoch} after its batch {batches}",
        )

    def _write(self, trainer: Trainer, checkpoint: dict[str, Any], where: str) -> None:
        trainer.strategy.save_checkpoint(checkpoint, self.path)
        self.latest = (where, trainer.global_step)

    def read(self) -> bytes:
        """The latest resume point's bytes, which travel to the workers with the stage."""
        with open(self.path, "rb") as file:
            return file.read()

    def remove(self) -> None:
        self._file.close()


class HostsReturned(Exception):
    """Raised on the controller at a resume point of an elastic ``fit`` when lost hosts serve
    workers again: it unwinds the controller's loop for ``ElasticFit.run`` to grow the world there."""

    def __init__(self, hosts: dict[int, HostMesh]) -> None:
        super().__init__(f"Host(s) {sorted(hosts)} serve workers again.")
        #: The mesh of each returned host, connected, by slot.
        self.hosts = hosts
        self.detected_at = time.monotonic()


class PreemptionNoticed(Exception):
    """Raised on the controller where every worker parked because hosts got a preemption notice
    (``worker.notices``), once the resume point there is kept: it unwinds the controller's loop for
    ``ElasticFit.run`` to go on without those hosts from that point."""

    def __init__(self, hosts: list[int], num_hosts: int, ranks: list[int]) -> None:
        super().__init__(
            f"Host(s) {hosts} of the {num_hosts} the workers started on got a preemption notice (SIGTERM to"
            " `lightning-monarch serve`)."
        )
        self.hosts, self.num_hosts, self.ranks = hosts, num_hosts, ranks
        self.detected_at = time.monotonic()


class ElasticFit:
    """Runs on the controller, for one ``fit`` under ``MonarchStrategy(min_nodes=...)``: keeps its
    resume points; when hosts are lost, shrinks the mesh and the Trainer's world to the surviving
    hosts (or raises when fewer than ``min_nodes`` remain); when lost hosts serve again, grows them
    back at the next resume point; at the end, gives the strategy and Trainer back their own settings.
    The strategy learns of each change through ``hooks`` (``StageOutcome``)."""

    def __init__(self, settings: StrategySettings, hooks: StrategyHooks, trainer: Trainer, mesh: WorkerMesh) -> None:
        self._settings, self._hooks, self._trainer, self._mesh = settings, hooks, trainer, mesh
        self.resume_points = ResumePoints()
        #: How many hosts the world has now.
        self.num_nodes = settings.num_nodes
        self._accumulate = trainer.accumulate_grad_batches
        self._warned = False
        #: Addresses not asked again: those that accepted a connection but did not answer as a
        #: Monarch host, and those of hosts that got a preemption notice.
        self._refused: set[str] = set()
        #: Whether the world changed in this ``fit``: its mesh is not the one the strategy asked for.
        self.changed = False

    def lost_host_check(self) -> LostHostCheck:
        """How the stage's channel tells a lost host: the strategy's ``connect_timeout``, and the
        worker addresses its ``hosts`` names when the check runs."""
        return LostHostCheck(self._settings.connect_timeout, lambda: known_addresses(self._settings.hosts))

    def at_resume_point(self, trainer: Trainer) -> None:
        """Runs at each snapshot gate, where the workers wait: keep the resume point; raise
        ``HostsReturned`` if lost hosts serve again, so that the world grows from this point and no
        step is redone."""
        self.resume_points.keep(trainer)
        returned = self._returned_hosts()
        if returned:
            raise HostsReturned(returned)

    def at_notice(self, trainer: Trainer) -> NoReturn:
        """Runs at the end of the training batch where every worker parked because hosts got a
        preemption notice, once the controller's callbacks ran: keep the resume point there, and
        raise ``PreemptionNoticed`` naming the hosts."""
        self.resume_points.keep_batch_end(trainer)
        hosts, ranks = self._mesh.noticed()
        addresses = worker_addresses(self._settings.hosts) or []
        self._refused.update(addresses[slot] for slot in hosts if slot < len(addresses))
        raise PreemptionNoticed(hosts, self._mesh.num_slots, ranks)

    def _returned_hosts(self) -> dict[int, HostMesh]:
        """The lost hosts that serve workers again, connected: of the worker addresses that
        ``hosts`` names now (a list, or a function that returns one), those of lost slots that
        accept a connection and answer as a Monarch host within ``connect_timeout``."""
        addresses = worker_addresses(self._settings.hosts) or []
        lost = [slot for slot in range(len(addresses)) if slot not in self._mesh.slots]
        returned = {}
        for slot in lost:
            address = addresses[slot]
            if address in self._refused or not reachable(address):
                continue
            try:
                returned[slot] = host_mesh([address], 1, self._settings.gpus_per_host, self._settings.connect_timeout)
            except UnreachableHostsError:
                self._refused.add(address)
                log.warning(
                    "lightning_monarch: lost host %d's address %s accepts a connection again but did not answer as a"
                    " Monarch host within %g s, so the run goes on without it. A host process restarted at an"
                    " address this process talked to before is refused by Monarch (meta-pytorch/monarch#4310): serve"
                    " it at a new address, and give `MonarchStrategy(hosts=...)` a function that returns the current"
                    " addresses.",
                    slot,
                    address,
                    self._settings.connect_timeout,
                )
        return returned

    def shrink(self, lost: HostsLostError) -> None:
        """Go on without the hosts ``lost`` names, from the latest resume point."""
        ranks = list(lost.ranks) or "unknown"
        self._go_on_without(
            lost, f"lost host(s) {list(lost.hosts)} of {lost.num_hosts} (worker ranks {ranks}; {lost.why})"
        )

    def leave(self, noticed: PreemptionNoticed) -> None:
        """Go on without the hosts that got a preemption notice, from the resume point kept where
        the workers parked for it."""
        self._go_on_without(
            noticed,
            f"host(s) {noticed.hosts} of {noticed.num_hosts} got a preemption notice (worker ranks {noticed.ranks})",
            alive=True,
        )

    def _go_on_without(self, cause: Union[HostsLostError, PreemptionNoticed], what: str, alive: bool = False) -> None:
        """Shrink the mesh and the Trainer's world to the hosts that ``cause`` leaves, or raise
        ``HostsLostError`` when fewer than ``min_nodes`` remain; ``alive``: the hosts left out still serve."""
        min_nodes = self._settings.min_nodes or 0
        remaining = [slot for slot in self._mesh.slots if slot not in cause.hosts]
        if len(remaining) < min_nodes:
            raise HostsLostError(
                f"{cause} {len(remaining)} host(s) remain, fewer than `MonarchStrategy(min_nodes={min_nodes})`, so"
                " the run cannot go on. Lower `min_nodes`, or resume from the last checkpoint once enough hosts"
                " serve workers.",
                tuple(cause.ranks),
                tuple(cause.hosts),
                cause.num_hosts,
                cause.detected_at,
            ) from cause
        idle = self._mesh.shrink(list(cause.hosts), alive=alive)
        self._changed(what, cause.detected_at)
        if idle:
            log.warning(
                "lightning_monarch: host(s) %s live but serve no worker: Monarch slices a mesh by ranges.", idle
            )

    def grow(self, returned: HostsReturned) -> None:
        """Start workers on the hosts that serve again and go on with them, from the resume point
        just kept."""
        self._mesh.grow(returned.hosts)
        self._changed(f"host(s) {sorted(returned.hosts)} serve workers again", returned.detected_at)

    def run(
        self,
        attempt: Callable[[StageSpec], Result],
        spec: StageSpec,
        again: Callable[[], StageSpec],
        arguments: dict[str, Any],
    ) -> Result:
        """Run the ``fit``: ``attempt`` its ``spec`` in this world, until the world stops changing.
        After each change (hosts lost, hosts back, a preemption notice) the ``fit``'s ``arguments``
        point at the latest resume point, and the next attempt runs the spec ``again()`` makes then."""
        while True:
            try:
                return attempt(self.prepared(spec))
            except HostsLostError as lost:
                self.shrink(lost)
            except HostsReturned as returned:
                self.grow(returned)
            except PreemptionNoticed as noticed:
                self.leave(noticed)
            self.resume(arguments)
            spec = again()

    def resume(self, arguments: dict[str, Any]) -> None:
        """Point the stage's ``ckpt_path`` at the latest resume point, where the controller's Trainer
        resumes; before the first, the stage runs again from where the ``fit`` started."""
        if self.resume_points.latest is not None:
            arguments["ckpt_path"] = self.resume_points.path

    def prepared(self, spec: StageSpec) -> StageSpec:
        """``spec`` as the workers of this world run it: asking for preemption notices after each
        optimizer step where a host serves them, and from the latest resume point, whose bytes
        travel with it (their hosts may not reach this one's disk)."""
        notices = any(answer is not None for answer in self._mesh.notices())
        spec = dataclasses.replace(spec, run_ahead=dataclasses.replace(spec.run_ahead, notices=notices))
        if self.resume_points.latest is None:
            return spec
        return dataclasses.replace(spec, ckpt_path=None, checkpoint=pack(self.resume_points.read()))

    def _changed(self, what: str, detected_at: float) -> None:
        """The world changed: the Trainer's settings for it, the count, the log line, the loggers' metrics."""
        self.changed = True
        hosts = self.num_nodes = len(self._mesh.slots)
        self._hooks._record(StageOutcome(world_changes=1, num_nodes=hosts))
        workers = self._mesh.num_workers
        accumulate = self._accumulation(self._settings.num_nodes * workers // hosts, workers)
        self._trainer.accumulate_grad_batches = accumulate
        where, step = self.resume_points.latest or ("the start of the stage", self._trainer.global_step)
        for logger in self._trainer.loggers:
            logger.log_metrics({WORLD_SIZE_METRIC: workers, ACCUMULATION_METRIC: accumulate}, step)
            logger.save()
        log.warning(
            "lightning_monarch: %s; training goes on with %d worker(s) on %d host(s), accumulate_grad_batches=%d,"
            " from %s (global step %d); the change took %.1f s.",
            what,
            workers,
            hosts,
            accumulate,
            where,
            step,
            time.monotonic() - detected_at,
        )

    def _accumulation(self, full_world: int, world: int) -> int:
        """The user's ``accumulate_grad_batches``, grown to keep the global batch of ``full_world``
        workers in ``world``, where ``keep_global_batch`` asks for it and the ratio is whole."""
        if not self._settings.keep_global_batch:
            return self._accumulate
        if full_world % world == 0:
            return self._accumulate * full_world // world
        if not self._warned:
            self._warned = True
            rank_zero_warn(
                f"`MonarchStrategy(keep_global_batch=True)`: {full_world} workers cannot be kept as a global batch"
                f" by {world} ({full_world}/{world} is not a whole number), so `accumulate_grad_batches` stays"
                f" {self._accumulate} and each optimizer step sees fewer samples. Choose host counts whose ratio is"
                " whole, or pass `keep_global_batch=False` to accept this without the warning."
            )
        return self._accumulate

    def restore(self) -> None:
        """The ``fit`` ended: the strategy and Trainer take back their own number of nodes and
        accumulation, so that a later stage asks for the whole mesh again."""
        self._hooks._record(StageOutcome(num_nodes=self._settings.num_nodes))
        self._trainer.accumulate_grad_batches = self._accumulate
        self.resume_points.remove()


class AtNotice(Callback):
    """The controller's last callback in an elastic ``fit`` on hosts that serve preemption notices:
    at the end of a training batch, after the user's callbacks (a ``ModelCheckpoint`` among them)
    ran, where every worker parked because a host got a notice, the session keeps a resume point
    and goes on without that host (:meth:`StageSession.at_notice`)."""

    def __init__(self, at_notice: Callable[[], None]) -> None:
        self._at_notice = at_notice

    @override
    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._at_notice()
