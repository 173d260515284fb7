"""One stage's traffic with the workers, and its recovery when a worker process dies or hangs.

Runs on the controller. A :class:`StageChannel` carries what the stage session sends the workers
(the stage, grants, releases, out-of-band requests) and the entries rank 0 records, over a
``WorkerMesh``. With restarts allowed, it keeps a journal of what changed the workers' state, each
message with the number of entries received when it was sent, restarted at every snapshot. When a
worker process dies or hangs, it starts new processes from the last snapshot (or the stage's
start), lets them run to where the old ones were, taking each journaled message at its position
and comparing every entry they record again with the one received before (their computation is
the same, bit for bit), and goes on: the session never sees the failure, and no step is lost or
counted twice.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

from lightning_monarch.controller.mesh.debugger import serve_debugger
from lightning_monarch.controller.mesh.hosts import LostHostCheck
from lightning_monarch.controller.mesh.snapshots import SnapshotDirectory
from lightning_monarch.controller.mesh.worker_mesh import Message, WorkerMesh, by_rank
from lightning_monarch.errors import DivergenceError, HostsLostError, MeshFailureError, WorkerError, WorkerTimeoutError
from lightning_monarch.wire.codec import pack
from lightning_monarch.wire.protocol import Entry, Release
from lightning_monarch.wire.specs import ResumePoint, StageSpec

log = logging.getLogger(__name__)


class StageChannel:
    """Runs on the controller: one stage's messages to the workers and entries from rank 0."""

    def __init__(
        self,
        mesh: WorkerMesh,
        spec: StageSpec,
        max_restarts: int = 0,
        snapshots: Optional[SnapshotDirectory] = None,
        lost_hosts: Optional[LostHostCheck] = None,
        shared_memory: bool = True,
    ) -> None:
        """``shared_memory``: the stage's storages may travel through this host's shared memory
        (``WorkerMesh.start_stage``). With ``max_restarts`` > 0, a dead or hung worker is replaced up to that many times, from
        the last snapshot: in this process's memory, or for a sharded module, in ``snapshots``,
        where every rank writes its shards. With ``lost_hosts`` (elastic training), a dead worker's
        host that it finds lost (its address refuses connections, or it serves no new process in
        time) makes ``HostsLostError`` name it, for the launcher to go on without it."""
        self.mesh = mesh
        self._lost_hosts = lost_hosts
        self._shared_memory = shared_memory
        # a recovery sends the stage's storages again, to new processes, after the controller's
        # loop may have changed its module (Lightning loads ``ckpt_path`` into it): a copy of them
        # as the stage began, a checkpoint's worth of memory here while it runs
        self._spec = dataclasses.replace(spec, payload=spec.payload.with_copied_sources()) if max_restarts else spec
        #: How many times this stage replaced its worker processes.
        self.restarts = 0
        self._restarts_left = max_restarts
        self._snapshots = snapshots
        #: Messages that changed the workers' state since the origin, each with the number of
        #: entries received since the origin when it was sent; ``None`` without restarts.
        self._journal: Optional[list[tuple[int, Message]]] = [] if max_restarts else None
        #: The gates of the entries received since the origin, to check entries recorded again.
        self._history: list[str] = []
        self._origin = "the start of the stage"
        #: Entries rank 0 recorded this stage, and batch starts the session took (R4).
        self.received = 0
        self._granted_batches = 0
        #: Entries a recovery's new workers recorded beyond where the old ones were.
        self._recorded_beyond: list[Entry] = []

    def start(self) -> None:
        """Build every rank's Trainer for the stage and start its loop (a failure raises), counting
        what is sent to the workers from here (``WorkerMesh.sent``), with this process's debugger
        serving their ``breakpoint()`` (``controller.mesh.debugger``). A recovery starts its new
        workers' stage itself, so this is not journaled."""
        serve_debugger(self._spec.trainer.timeout)
        self.mesh.count_from_here()
        try:
            self.mesh.start_stage(self._spec, self._shared_memory)
        except MeshFailureError as failure:
            self._recover(failure)

    def fetch(self) -> list[Entry]:
        """Rank 0's next entries (R3), in bulk."""
        while True:
            try:
                entries, self._recorded_beyond = self._recorded_beyond or self.mesh.fetch(self.received), []
                break
            except MeshFailureError as failure:
                self._recover(failure)
        gates = [entry.gate for entry in entries if entry.gate is not None]
        self.received += len(gates)
        if self._journal is not None:
            self._history.extend(gates)
        return entries

    def grant(self, batches: int) -> None:
        """The session took ``batches`` batch starts (R4)."""
        self._granted_batches = batches
        self.mesh.grant(batches)

    def release(self, release: Release) -> None:
        """Release the workers from their sync gate (R5)."""
        self._send(Message("release", (release,), wait=False))

    def ask_every_rank(self, endpoint: str, *args: Any, journal: bool = True) -> list[Any]:
        """Ask every worker parked at a sync gate (R5); their answers in rank order. ``journal``: the
        request changes the workers' state (a read of metrics that Lightning stores, a collective),
        so new workers after a recovery must get it again at the same point."""
        return by_rank(self._send(Message(endpoint, args), journal=journal))

    def ask_rank0(self, endpoint: str, *args: Any, journal: bool = False, everyone: bool = False) -> Any:
        """Rank 0's answer to a request made at a sync gate (R5): asked alone, or with
        ``everyone``, of every rank (each takes part, e.g. in a collective; rank 0's answer is the
        only one that is not ``None``)."""
        answers = self._send(Message(endpoint, args, rank0=not everyone), journal=journal)
        return next(answer for answer in answers if answer is not None)

    def snapshot(self, epoch: int) -> None:
        """At the snapshot gate of training epoch ``epoch`` (``protocol.SnapshotEpochs``): read every
        rank's snapshot where the workers are parked and restart the journal from it, so that a
        recovery replays only what followed. Costs a checkpoint's worth of bytes from rank 0; for a
        sharded module, every rank writes its shards into a new directory of the stage's
        ``snapshots`` instead, which then replaces the previous one."""
        if self._journal is None:
            return
        directory = self._snapshots.for_epoch(epoch) if self._snapshots is not None else None
        ranks = self.ask_every_rank("snapshot", directory, journal=False)
        resume = ResumePoint(
            checkpoint=directory if directory is not None else pack(ranks[0].checkpoint),
            ranks=tuple(dataclasses.replace(snapshot, checkpoint=None) for snapshot in ranks),
        )
        self._spec = dataclasses.replace(self._spec, resume=resume)
        self._journal, self._history = [], []
        if self._snapshots is not None:
            assert directory is not None  # made by ``self._snapshots`` above
            self._snapshots.keep(directory)
        self._origin = f"the snapshot at the start of epoch {epoch}"

    def close(self) -> None:
        """The stage ended: nothing more to recover."""
        self._journal = None

    # ----- delivery and recovery -------------------------------------------------------------

    def _send(self, message: Message, journal: bool = True) -> Any:
        kept = False
        if journal and self._journal is not None:
            self._journal.append((len(self._history), message))
            kept = True
        while True:
            try:
                return self.mesh.deliver(message)
            except MeshFailureError as failure:
                self._recover(failure, skip_last=kept)

    def _recover(self, failure: MeshFailureError, skip_last: bool = False) -> None:
        """Replace every worker process and bring the new ones to where the old ones were; raise
        ``failure`` when no restart is left, or ``HostsLostError`` when a host of the dead worker is
        gone. ``skip_last``: the journal's last message is the one that failed, which the caller
        sends again."""
        self._raise_if_hosts_lost(failure)
        while True:
            journal = self._journal[:-1] if skip_last and self._journal else self._journal
            if journal is None or self._restarts_left <= 0:
                raise failure
            self._restarts_left -= 1
            started = time.monotonic()
            try:
                self.mesh.replace_processes()
                self.mesh.start_stage(self._spec, self._shared_memory)
                self.mesh.grant(self._granted_batches)
                recorded: list[Entry] = []
                position = 0
                for at, message in journal:
                    position = self._follow(recorded, position, at)
                    self.mesh.deliver(message)
                self._follow(recorded, position, len(self._history))
                self._recorded_beyond = recorded
            except MeshFailureError as again:
                failure = again
                continue
            self.restarts += 1
            log.warning(
                "lightning_monarch: recovered from a failure of worker rank(s) %s (%s): started %d new worker"
                " processes, which ran from %s through %d recorded gates and %d messages again, in %.1f s"
                " (restart %d; %d left).",
                list(failure.ranks) or "unknown",
                str(failure).split(":")[0],
                self.mesh.num_workers,
                self._origin,
                len(self._history),
                len(journal),
                time.monotonic() - started,
                self.restarts,
                self._restarts_left,
            )
            return

    def _raise_if_hosts_lost(self, failure: MeshFailureError) -> None:
        """With elastic training, raise ``HostsLostError`` if a dead worker's host is gone (a hung
        worker's host is not: it answered that its process lives)."""
        check = self._lost_hosts
        if check is None or isinstance(failure, WorkerTimeoutError):
            return
        lost = self.mesh.lost_hosts(check.timeout, check.refusing())
        if lost.slots:
            reasons = [f"the worker address of {lost.refusing} refuses connections"] if lost.refusing else []
            if lost.silent:
                reasons.append(
                    f"no new process started on {lost.silent} within {check.timeout:g} s"
                    " (`MonarchStrategy(connect_timeout=...)`)"
                )
            why = "; ".join(reasons)
            raise HostsLostError(
                f"Host(s) {lost.slots} of the {self.mesh.num_slots} the workers started on were lost: {why}. {failure}",
                failure.ranks,
                tuple(lost.slots),
                self.mesh.num_slots,
                failure.detected_at,
                why,
            ) from failure

    def _follow(self, recorded: list[Entry], position: int, target: int) -> int:
        """Take the new workers' entries up to ``target`` (counted from the origin), each checked
        against the one received before; ``recorded`` holds the ones fetched past it. Returns the
        position reached."""
        while position < target:
            if not recorded:
                recorded.extend(self.mesh.fetch(self.received - len(self._history) + position))
            entry = recorded.pop(0)
            if entry.gate is None and entry.failure is not None:
                raise WorkerError.of(entry.failure)
            if entry.gate != self._history[position]:
                raise DivergenceError(
                    f"The new workers of a recovery recorded `{entry.gate}` where the ones they replace had"
                    f" recorded `{self._history[position]}`: the stage is not deterministic from {self._origin}."
                )
            position += 1
        return position
