"""The worker mesh as the controller sees it: spawn, message, stop.

Runs on the controller. Wraps a Monarch ``ProcMesh`` with one :class:`MonarchWorker` actor per
device and turns worker failures into :class:`~lightning_monarch.errors.WorkerError`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

# How often Monarch checks that worker processes are alive; its default (about 10 s) leaves a
# controller waiting that long on a dead worker. Read when Monarch starts, so set before import.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import monarch.actor  # noqa: E402
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError  # noqa: E402
from monarch.actor import HostMesh, ProcMesh, this_host  # noqa: E402
from monarch.spmd import setup_torch_elastic_env  # noqa: E402

from lightning_monarch.controller.checkpoints import SnapshotDirectory  # noqa: E402
from lightning_monarch.controller.hosts import host_count  # noqa: E402
from lightning_monarch.controller.output import WorkerOutput  # noqa: E402
from lightning_monarch.controller.watch import POLL_S, ProcessWatch  # noqa: E402
from lightning_monarch.errors import MeshFailureError, WorkerError, WorkerTimeoutError  # noqa: E402
from lightning_monarch.protocol import (  # noqa: E402
    Advance,
    CheckpointState,
    Finish,
    ModuleAttributes,
    Peek,
    PreflightSpec,
    RankStats,
    RankValue,
    ResumePoint,
    StageSpec,
    WorkerFailure,
    WorkerReply,
    WorkerReport,
)
from lightning_monarch.worker.actor import MonarchWorker  # noqa: E402
from lightning_monarch.worker.process import LOCAL_DIMENSION, start_worker_process  # noqa: E402

log = logging.getLogger(__name__)

#: How long stopping a mesh may take before the controller gives up waiting on it.
_STOP_TIMEOUT_S = 30.0
#: How long an idle mesh may take to answer before the controller starts a new one instead.
_PING_TIMEOUT_S = 5.0
#: How long a survivor's collective error waits, with workers on other hosts, for Monarch's
#: supervision to report the dead peer instead: a death inside a collective reaches the controller
#: first as the survivors' gloo/NCCL error, and the report of a death on another host came 10 s
#: after it in ``benchmarks/death_report.py``.
_SUPERVISION_GRACE_S = 20.0
#: What a survivor's error says when a peer of its collective is gone (gloo's and NCCL's words).
_PEER_LOST = re.compile(r"closed by peer|reset by peer|remote worker|NCCL|RCCL|Connection refused|Broken pipe", re.I)


def _log_fault(failure: Any) -> None:
    """Replaces Monarch's ``unhandled_fault_hook``, whose default exits the controller.

    Monarch calls it from its own thread when a worker process dies or an actor fails outside a
    call, including the processes of a mesh the controller killed itself after a failure. A
    failure that matters reaches the call waiting on that worker, which raises it (see
    ``WorkerMesh._gather``); here it is only logged, at debug level. A failure of an earlier,
    already stopped mesh must not fail the next one.
    """
    log.debug("Monarch reported a worker mesh failure: %s", failure)


monarch.actor.unhandled_fault_hook = _log_fault


def failed_rank(report: str) -> Optional[int]:
    """The global rank of the worker that Monarch's supervision ``report`` names, from the point it
    gives (``{'hosts': 1/2, 'gpus': 0/4}``): the row-major index over every dimension, which is the
    ``RANK`` that ``setup_torch_elastic_env`` gave that process. ``None`` if it names no point."""
    point = re.search(r"\{((?:'\w+': \d+/\d+(?:, )?)+)\}", report)
    if point is None:
        return None
    rank = 0
    for index, size in re.findall(r"'\w+': (\d+)/(\d+)", point.group(1)):
        rank = rank * int(size) + int(index)
    return rank


def _by_rank(answers: list[Any]) -> list[Any]:
    """Every rank's answer (each with a ``rank``), which arrive in any order, in rank order."""
    return sorted(answers, key=lambda answer: answer.rank)


@dataclass(frozen=True)
class _Message:
    """One message to the workers, kept in the stage's journal when restarts are allowed."""

    endpoint: str
    args: tuple[Any, ...] = ()
    #: ``False``: a fire-and-forget broadcast.
    wait: bool = True
    #: Sent to rank 0 only.
    rank0: bool = False
    #: Whether a new mesh must receive it again to reach the same point: everything that moves or
    #: changes the workers' state; not pure reads.
    replay: bool = True


class WorkerMesh:
    """Runs on the controller: one process per device on each host, each with a ``MonarchWorker``.

    With restarts allowed (``start_stage(spec, max_restarts=k)``), it keeps the stage's messages in
    a journal, restarted at every snapshot (``snapshot``). When a worker process dies or hangs, it
    starts new processes, brings them to the last snapshot (or the stage's start), replays the
    journal, which the workers recompute bit for bit as before, and sends the failed message again:
    the controller's loop never sees the failure, and no step is lost or counted twice.
    """

    def __init__(self, hosts: HostMesh, per_host: int, gpu_indices: Optional[tuple[int, ...]] = None,
                 output: Optional[WorkerOutput] = None) -> None:
        """A mesh not yet started; :meth:`spawn` starts one."""
        self.num_workers = per_host * host_count(hosts)
        self._hosts = hosts
        self._per_host = per_host
        self._gpu_indices = gpu_indices
        self._output = output
        self._procs: Optional[ProcMesh] = None
        #: How long a message may wait for the workers before they count as hung; ``None`` waits.
        self.step_timeout: Optional[float] = None
        #: How many times this stage restarted the mesh.
        self.restarts = 0
        self._restarts_left = 0
        self._journal: Optional[list[_Message]] = None
        #: Whether ``lightning_monarch.preflight`` checked these workers.
        self.checked = False
        self._burst: list[Advance] = []

    @classmethod
    def spawn(cls, per_host: int, gpu_indices: Optional[tuple[int, ...]] = None, hosts: Optional[HostMesh] = None,
              output: Optional[WorkerOutput] = None) -> "WorkerMesh":
        """Start, on each of ``hosts`` (by default this host), ``per_host`` worker processes, GPU
        workers pinned to the ``devices=`` index of their local rank in ``gpu_indices``, and their
        torch elastic environment; ``output`` forwards what workers on other hosts print."""
        mesh = cls(hosts if hosts is not None else this_host(), per_host, gpu_indices, output)
        mesh._start()
        return mesh

    def _start(self) -> None:
        """On each host, ``per_host`` worker processes (the local ranks), each started by
        ``worker.process`` as a torchrun rank, a GPU worker pinned to the ``devices=`` index of its
        local rank; then a ``MonarchWorker`` in each, which says who it is. Workers on other hosts
        forward their output here (``WorkerOutput``)."""
        bootstrap = functools.partial(start_worker_process, f"lightning_monarch-{uuid.uuid4().hex[:12]}",
                                      self._gpu_indices)
        WorkerOutput.forward_new_processes(self._output is not None)
        procs = self._hosts.spawn_procs(per_host={LOCAL_DIMENSION: self._per_host}, bootstrap=bootstrap)
        try:
            setup_torch_elastic_env(procs)
            if self._output is not None:
                self._output.stream(procs)
            self._attach(procs)
        except BaseException:
            procs.stop().get(timeout=_STOP_TIMEOUT_S)
            self._procs = None
            raise

    def _attach(self, procs: ProcMesh) -> None:
        self._procs = procs
        self._workers = procs.spawn("lightning_monarch_worker", MonarchWorker)
        self._rank0 = self._workers.slice(**dict.fromkeys(self._workers.extent.labels, 0))
        self._watch = ProcessWatch([])  # nothing to watch until the workers said who they are
        self._watch = ProcessWatch(self._gather(self._workers.process_id.stream()))
        #: Each rank's process ID, in rank order.
        self.pids = [self._watch.pids[rank] for rank in range(self.num_workers)]

    def start_stage(self, spec: StageSpec, max_restarts: int = 0, snapshot_every_n_epochs: int = 1,
                    snapshots: Optional[SnapshotDirectory] = None) -> None:
        """Build every rank's Trainer for the stage ``spec`` describes (a failure raises). With
        ``max_restarts`` > 0, a dead or hung worker is replaced up to that many times, from a
        snapshot taken every ``snapshot_every_n_epochs`` training epochs: in this process's
        memory, or for a sharded module, in ``snapshots``, where every rank writes its shards."""
        self.restarts, self._restarts_left = 0, max_restarts
        self._snapshot_every = snapshot_every_n_epochs
        self._snapshots = snapshots
        self._journal = [] if max_restarts > 0 else None
        self._origin = "the start of the stage"
        self._send(_Message("start_stage", (spec,)))

    def snapshot(self, epoch: int) -> None:
        """At :data:`~lightning_monarch.protocol.SNAPSHOT_GATE` of training epoch ``epoch``: when
        restarts are allowed and the interval has come, read every rank's snapshot where the
        workers are parked and start the journal anew from it, so that a recovery replays only the
        messages since. Costs a checkpoint's worth of bytes from rank 0 per snapshot; for a sharded
        module, every rank writes its shards into a new directory of the stage's ``snapshots``
        instead, which then replaces the previous one."""
        if self._journal is None or epoch == 0 or epoch % self._snapshot_every:
            return
        self.flush()
        directory = self._snapshots.for_epoch(epoch) if self._snapshots is not None else None
        ranks = _by_rank(self._send(_Message("snapshot", (directory,), replay=False)))
        spec = self._journal[0].args[0]
        resume = ResumePoint(
            checkpoint=directory if directory is not None else ranks[0].checkpoint,
            ranks=tuple(dataclasses.replace(snapshot, checkpoint=None) for snapshot in ranks),
        )
        self._journal = [_Message("start_stage", (dataclasses.replace(spec, resume=resume),))]
        if self._snapshots is not None:
            self._snapshots.keep(directory)
        self._origin = f"the snapshot at the start of epoch {epoch}"

    def preflight(self, spec: PreflightSpec) -> list[WorkerReport]:
        """Every worker's check of itself (``worker.preflight``), in rank order."""
        return _by_rank(self._gather(self._workers.preflight.stream(spec)))

    def end_stage(self) -> None:
        """Let every rank drop the finished stage's Trainer, module and data."""
        self._journal = None
        self._gather(self._workers.end_stage.stream())

    def answers(self) -> bool:
        """Whether every worker process still answers (an idle mesh may have lost one)."""
        try:
            self._gather(self._workers.process_id.stream(), timeout=_PING_TIMEOUT_S)
        except Exception:  # dead, stopped or unreachable: the caller starts a new mesh
            return False
        return True

    def advance(self, command: Union[Advance, Peek, Finish]) -> Optional[list[WorkerReply]]:
        """Move every rank's loop; wait for the replies unless it is a fire-and-forget ``Advance``.

        Fire-and-forget commands wait in a burst that leaves with the next message (L4), so a
        training step is a few messages, not one per hook. The first failing rank raises,
        without waiting for the others.
        """
        self._burst.append(command)
        if isinstance(command, Advance) and not command.wait:
            return None
        burst, self._burst = self._burst, []
        return _by_rank(self._send(_Message("advance", (burst,))))

    def flush(self) -> None:
        """Send the waiting burst now: ahead of a message that must see its effects, or so that
        the workers start on it while the controller goes on."""
        if self._burst:
            burst, self._burst = self._burst, []
            self._send(_Message("advance", (burst,), wait=False))

    def read_metrics(self, view: str) -> dict[str, Any]:
        """Rank 0's ``trainer.<view>``; every rank takes part, for metrics synced across ranks."""
        return self._gathered_by_rank0(_Message("read_metrics", (view,)))

    def collective(self, kind: str, view: str, key: str, options: dict[str, Any]) -> Any:
        """Let every rank run ``trainer.strategy.<kind>(trainer.<view>[key], **options)`` on its own
        value; rank 0's result."""
        return self._gathered_by_rank0(_Message("collective", (kind, view, key, options)))

    def metric_on_every_rank(self, view: str, key: str) -> list[RankValue]:
        """Every rank's ``trainer.<view>[key]``, in rank order."""
        self.flush()
        return _by_rank(self._send(_Message("metric", (view, key))))

    def read_stats(self) -> list[RankStats]:
        """Every rank's device, process and step-time stats (``worker.stats``), in rank order; a
        pure read, never replayed on new workers."""
        self.flush()
        return _by_rank(self._send(_Message("read_stats", replay=False)))

    def checkpoint_state(self) -> CheckpointState:
        """Rank 0's model, optimizer and LR-scheduler state at the point the loop has reached."""
        return self._call_rank0("checkpoint_state")

    def full_state_dict(self) -> dict[str, Any]:
        """The sharded module's full state dict: every rank gathers, rank 0's comes back. A pure
        read, never replayed on new workers."""
        self._require_shards("Gather them", "`trainer.strategy.gather_full_state_dict()`")
        return self._gathered_by_rank0(_Message("full_state_dict", replay=False))

    def save_sharded_checkpoint(self, path: str, optimizers: bool) -> dict[str, Any]:
        """Let every rank write its shards of the module's (and with ``optimizers``, the
        optimizers') state into the directory ``path``, in parallel; return rank 0's worker
        callbacks' state. Never replayed on new workers."""
        self._require_shards("Save them", "`trainer.save_checkpoint(path)`")
        return self._gathered_by_rank0(_Message("save_sharded_checkpoint", (path, optimizers), replay=False))

    def _require_shards(self, action: str, call: str) -> None:
        """Raise if this mesh, and the module's shards with it, was stopped."""
        if self._procs is None:
            raise RuntimeError(
                "The worker mesh of that stage was stopped, and the module's shards with it (by"
                " `MonarchStrategy(keep_warm=False)`, `lightning_monarch.stop_meshes()`, a failure, or a stage with"
                f" other devices). {action} while the stage runs, e.g. in a callback's `on_fit_end`: {call}."
            )

    def module_attributes(self) -> ModuleAttributes:
        """Rank 0's module's public Python attributes, and why any others cannot travel."""
        return self._call_rank0("module_attributes")

    def module_children(self) -> dict[str, Any]:
        """Rank 0's module's direct submodules."""
        return self._call_rank0("module_children")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Run the worker callbacks' and module's ``on_save_checkpoint`` on rank 0; return the
        checkpoint they edited."""
        return self._call_rank0("on_save_checkpoint", checkpoint, replay=True)

    def _gathered_by_rank0(self, message: _Message) -> Any:
        """Send ``message`` to every rank after the waiting burst (each takes part, e.g. in a
        collective) and return rank 0's answer, the only one that is not ``None``."""
        self.flush()
        return next(answer for answer in self._send(message) if answer is not None)

    def _call_rank0(self, endpoint: str, *args: Any, replay: bool = False) -> Any:
        """Call an endpoint on rank 0, after the waiting burst."""
        self.flush()
        return self._send(_Message(endpoint, args, rank0=True, replay=replay))[0]

    def stop(self, kill: bool = False) -> None:
        """Stop every worker process. Idempotent. ``kill`` first kills the processes on this host
        by process ID: after a failure they may be stuck (in a collective, or hung), and would not
        stop when asked."""
        procs, self._procs = self._procs, None
        if procs is None:
            return
        if kill:
            self._watch.kill()
        try:
            procs.stop().get(timeout=_STOP_TIMEOUT_S)
        except Exception as error:  # the mesh may already be gone; stopping must not mask the cause
            log.warning("Stopping the worker mesh failed: %s", error)

    # ----- delivery and recovery -------------------------------------------------------------

    def _send(self, message: _Message) -> Any:
        if message.replay and self._journal is not None:
            self._journal.append(message)
        while True:
            try:
                return self._deliver(message)
            except MeshFailureError as failure:
                self._recover(failure, self._journal[:-1] if message.replay and self._journal else self._journal)

    def _deliver(self, message: _Message, replaying: bool = False) -> Any:
        endpoint = getattr(self._rank0 if message.rank0 else self._workers, message.endpoint)
        if not message.wait or (replaying and message.endpoint == "advance"):
            endpoint.broadcast(*message.args)
            return None
        return self._gather(endpoint.stream(*message.args))

    def _recover(self, failure: MeshFailureError, journal: Optional[list[_Message]]) -> None:
        """Replace every worker process and replay ``journal`` on the new ones; raise ``failure``
        when no restart is left."""
        while True:
            if journal is None or self._restarts_left <= 0:
                raise failure
            self._restarts_left -= 1
            started = time.monotonic()
            try:
                self._replace_processes()
                for message in journal:
                    self._deliver(message, replaying=True)
            except MeshFailureError as again:
                failure = again
                continue
            self.restarts += 1
            log.warning(
                "lightning_monarch: recovered from a failure of worker rank(s) %s (%s): started %d new worker"
                " processes and replayed %d messages from %s, in %.1f s (restart %d; %d left).",
                list(failure.ranks) or "unknown", str(failure).split(":")[0], self.num_workers, len(journal),
                self._origin, time.monotonic() - started, self.restarts, self._restarts_left,
            )
            return

    def _replace_processes(self) -> None:
        """Kill the old worker processes and start new ones in their place."""
        self.stop(kill=True)
        self._start()

    def _gather(self, futures: Iterable[Any], timeout: Optional[float] = None) -> list[Any]:
        """Every rank's answer, in the order they arrive. The first failing rank raises without
        waiting for the others, which may be stuck in a collective; a dead worker process raises
        ``MeshFailureError`` naming its rank, and a wait past ``timeout`` (by default
        ``step_timeout``) raises ``WorkerTimeoutError`` naming the ranks that did not answer."""
        limit = self.step_timeout if timeout is None else timeout
        started = time.monotonic()
        values: list[Any] = []
        pending = iter(futures)
        try:
            for future in pending:
                values.append(self._check(self._wait(future, started, limit, values)))
        except SupervisionError as error:
            self._raise_if_dead()
            raise self._died(error) from error
        except WorkerError as error:
            # a peer's death shows first as a survivor's collective error: on this host the process
            # watch names it at once; on other hosts Monarch's supervision does, seconds later
            self._raise_if_dead()
            if not self._watch.watches_all and _PEER_LOST.search(error.failure.message):
                self._raise_if_supervision_reports(pending)
            raise
        return values

    def _raise_if_supervision_reports(self, pending: Iterable[Any]) -> None:
        """Wait up to :data:`_SUPERVISION_GRACE_S` for the ranks that have not answered; raise
        ``MeshFailureError`` if Monarch's supervision reports one of them dead meanwhile."""
        deadline = time.monotonic() + _SUPERVISION_GRACE_S
        for future in pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                future.get(timeout=left)
            except SupervisionError as error:
                raise self._died(error) from error
            except TimeoutError:
                return
            except Exception:  # another survivor's error: the death may still be reported
                continue

    @staticmethod
    def _died(error: Exception) -> MeshFailureError:
        """Monarch's report of a dead worker process, as ``MeshFailureError`` naming its rank."""
        rank = failed_rank(str(error))
        who = f"Worker rank {rank}" if rank is not None else "A worker"
        return MeshFailureError(
            f"{who} stopped answering: its process died (killed, out of memory or crashed). Monarch"
            f" reported: {str(error).splitlines()[0]}",
            (rank,) if rank is not None else (),
        )

    def _wait(self, future: Any, started: float, limit: Optional[float], answered: list[Any]) -> Any:
        """One answer; meanwhile, every :data:`~lightning_monarch.controller.watch.POLL_S`, check that
        the worker processes live and that ``limit`` has not passed."""
        while True:
            try:
                return future.get(timeout=POLL_S)
            except TimeoutError:
                self._raise_if_dead()
                waited = time.monotonic() - started
                if limit is not None and waited > limit:
                    answered_ranks = {getattr(value, "rank", None) for value in answered}
                    silent = tuple(rank for rank in range(self.num_workers) if rank not in answered_ranks)
                    raise WorkerTimeoutError(
                        f"Worker ranks {list(silent)} did not answer within {limit:g} s"
                        f" (`MonarchStrategy(step_timeout={limit:g})`): their processes are alive but stuck,"
                        " for example in a collective that a peer never joined. Raise `step_timeout` if a"
                        " step legitimately takes longer.",
                        silent,
                    ) from None

    def _raise_if_dead(self) -> None:
        dead = tuple(self._watch.dead_ranks())
        if dead:
            pids = ", ".join(f"rank {rank} (pid {self._watch.pids[rank]})" for rank in dead)
            raise MeshFailureError(
                f"Worker {pids} died: killed, out of memory or crashed. The other workers were stopped.", dead
            )

    @staticmethod
    def _check(value: Any) -> Any:
        if isinstance(value, WorkerFailure):
            raise WorkerError(value)
        if isinstance(value, WorkerReply) and value.failure is not None:
            raise WorkerError(value.failure)
        return value
