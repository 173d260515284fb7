"""The worker mesh as the controller sees it: spawn, message, stop.

Runs on the controller. Wraps a Monarch ``ProcMesh`` with one :class:`MonarchWorker` actor per
device and turns worker failures into :class:`~lightning_monarch.errors.WorkerError`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

from monarch.actor import HostMesh, ProcMesh, this_host

from lightning_monarch._compat.monarch import SupervisionError
from lightning_monarch.controller.mesh import deaths, storages
from lightning_monarch.controller.mesh.forkserver import ProcessStart, forked_package
from lightning_monarch.controller.mesh.hosts import host_count
from lightning_monarch.controller.mesh.lifelines import LIFELINES
from lightning_monarch.controller.mesh.output import WorkerOutput
from lightning_monarch.controller.mesh.stage_thread import STAGE_THREAD
from lightning_monarch.controller.mesh.storages import KeptShards
from lightning_monarch.controller.mesh.watch import POLL_S, ProcessWatch
from lightning_monarch.controller.mesh.world import LostSlots, WorkerWorld, leave_world
from lightning_monarch.errors import MeshFailureError, WorkerError
from lightning_monarch.wire.codec import Shipment, StorageKey, decode
from lightning_monarch.wire.protocol import Entry, Grant, RankStatus
from lightning_monarch.wire.reports import PredictionShard, RankValue, WorkerFailure, WorkerReport
from lightning_monarch.wire.specs import PreflightSpec, StageSpec

log = logging.getLogger(__name__)

#: How long stopping a mesh may take before the controller gives up waiting on it.
_STOP_TIMEOUT_S = 30.0
#: How long stopping a mesh waits when some of its processes are known dead (killed here by process
#: ID, seen dead by their lifelines, or on lost hosts): Monarch stops the live ones, but waits for the
#: dead ones' answer until this passes (measured: 30 s of a 35 s recovery on a ``ProcessJob``'s
#: hosts, with ``_STOP_TIMEOUT_S``), and the failure that stopped it reaches the user only after.
_STOP_DEAD_S = 2.0
#: How long an idle mesh may take to answer before the controller starts a new one instead.
_PING_TIMEOUT_S = 5.0
#: How long the controller waits for the warnings the ranks hold at the end of a stage: every rank
#: answers at once, but after a failure one may be dead, or busy with a request that never ends.
_TAKE_WARNINGS_S = 3.0


def by_rank(answers: list[Any]) -> list[Any]:
    """Every rank's answer (each with a ``rank``), which arrive in any order, in rank order."""
    return sorted(answers, key=lambda answer: answer.rank)


#: How often the controller asks the other ranks whether their stage failed while it waits for
#: rank 0 (their own failure may be what keeps rank 0, blocked in a collective, from answering).
_STATUS_S = 1.0


@dataclass(frozen=True)
class Message:
    """One message to the workers: an endpoint and its arguments (``controller.mesh.channel`` journals
    them)."""

    endpoint: str
    args: tuple[Any, ...] = ()
    #: ``False``: a fire-and-forget broadcast, kept in order with every other message to a worker.
    wait: bool = True
    #: Sent to rank 0 only.
    rank0: bool = False


class WorkerMesh:
    """Runs on the controller: one process per device on each host, each with a ``MonarchWorker``.

    The transport of the workers' traffic: spawn, deliver a message, gather the answers, watch the
    processes, stop. A worker's exception becomes ``WorkerError``; a dead or hung worker process
    ``MeshFailureError``, which ``controller.mesh.channel`` recovers from when restarts are allowed.
    """

    def __init__(
        self,
        hosts: HostMesh,
        per_host: int,
        gpu_indices: Optional[tuple[int, ...]] = None,
        output: Optional[WorkerOutput] = None,
        hold_warnings: bool = True,
        forked: Optional[str] = None,
    ) -> None:
        """A mesh not yet started; :meth:`spawn` starts one. ``forked``: the Lightning package of
        workers that this process's fork server forks (``controller.mesh.forkserver.forked_package``)."""
        self.num_workers = per_host * host_count(hosts)
        self._hosts = hosts
        self._per_host = per_host
        self._output = output
        self._process_start = ProcessStart.of(per_host, gpu_indices, hold_warnings, forked)
        #: The worker processes, their actors and ranks; ``None`` once stopped.
        self._world: Optional[WorkerWorld] = None
        self._watch = ProcessWatch([])
        #: Whether hosts of this mesh were found lost (:meth:`lost_hosts`).
        self._lost = False
        #: How long a message may wait for the workers before they count as hung; ``None`` waits.
        self.step_timeout: Optional[float] = None
        #: Whether ``controller.features.preflight`` checked these workers.
        self.checked = False
        #: A worker's death that ended rank 0's entries, raised by the next fetch after them.
        self._death: Optional[MeshFailureError] = None
        #: The keys of the storages rank 0 holds from the last stage that ran to its end.
        self.held: frozenset[StorageKey] = frozenset()
        #: The module on the meta device whose trained weights are the shards the workers kept from
        #: the last stage (``MonarchFSDPStrategy``), with its parameters and buffers as they were then.
        self.kept_shards: Optional[KeptShards] = None
        #: The bytes this process sent the workers since :meth:`count_from_here`, by endpoint (a
        #: message's pickled size once per rank it goes to, ``controller.mesh.counted``; storages in
        #: shared memory once).
        self.sent: Counter[str] = Counter()

    @classmethod
    def spawn(
        cls,
        per_host: int,
        gpu_indices: Optional[tuple[int, ...]] = None,
        hosts: Optional[HostMesh] = None,
        output: Optional[WorkerOutput] = None,
        hold_warnings: bool = True,
    ) -> WorkerMesh:
        """Start, on each of ``hosts`` (by default this host), ``per_host`` worker processes, GPU
        workers pinned to the ``devices=`` index of their local rank in ``gpu_indices``, and their
        torch elastic environment; ``output`` forwards what workers on other hosts print, and with
        ``hold_warnings`` the workers hold their Python warnings for the controller to show once
        (``worker.held_warnings``)."""
        forked = forked_package(hosts, gpu_indices)  # before ``hosts`` is this host's mesh, not registered as one
        mesh = cls(this_host() if hosts is None else hosts, per_host, gpu_indices, output, hold_warnings, forked)
        mesh._start()
        return mesh

    def _start(self, layout: Optional[list[tuple[HostMesh, list[int]]]] = None) -> None:
        """On each host, ``per_host`` worker processes (the local ranks), each started by
        ``worker.process`` as a torchrun rank, a GPU worker pinned to the ``devices=`` index of its
        local rank; then a ``MonarchWorker`` in each, which takes its rank (``controller.mesh.world``) and
        says who it is. Workers on other hosts forward their output here (``WorkerOutput``).
        ``layout``: the hosts and their slots, by default every host of the mesh."""
        WorkerOutput.forward_new_processes(self._output is not None)
        world = WorkerWorld(self._per_host, self._spawn_procs, "lightning_monarch_worker", self.sent)
        self._world = world
        try:
            for hosts, slots in layout or [(self._hosts, list(range(host_count(self._hosts))))]:
                world.add(hosts, slots)
            world.join()
            self._attach()
        except BaseException:
            self.stop()
            raise

    def _spawn_procs(self, hosts: HostMesh) -> ProcMesh:
        procs = self._process_start.spawn(hosts)
        if self._output is not None:
            self._output.stream(procs)
        return procs

    def _attach(self) -> None:
        """Address the world's workers, and watch their processes."""
        assert self._world is not None
        self.num_workers = self._world.num_workers
        self._workers = self._world.workers
        self._rank0 = self._world.rank0
        self._watch.forget()  # a world that changed: the workers' lifelines of the one before
        self._watch = ProcessWatch([])  # nothing to watch until the workers said who they are
        processes = self._gather(self._workers.process_id.stream())
        self._watch = ProcessWatch(processes, LIFELINES.held_by(self._workers, self._gather, self.num_workers))
        self.held, self.kept_shards = frozenset(), None  # new processes, or rank 0 may be another
        #: Each rank's process ID, in rank order.
        self.pids = [self._watch.pids[rank] for rank in range(self.num_workers)]

    def rank_actors(self) -> tuple[Any, ...]:
        """Each rank's actor, in rank order, for other workers to call."""
        assert self._world is not None  # a started mesh
        return self._world.actors()

    def preflight(self, spec: PreflightSpec) -> list[WorkerReport]:
        """Every worker's check of itself (``worker.preflight``), in rank order."""
        return by_rank(self._gather(self._workers.preflight.stream(spec)))

    def end_stage(self) -> None:
        """Let every rank drop the finished stage's Trainer, module and data, without waiting:
        Monarch delivers an actor's messages in order, so the next stage's first message (the
        :class:`MeshPool`'s check that every worker answers) finds the stage dropped."""
        self._workers.end_stage.broadcast()

    def answers(self) -> bool:
        """Whether every worker process still answers (an idle mesh may have lost one)."""
        try:
            self._gather(self._workers.process_id.stream(), timeout=_PING_TIMEOUT_S)
        except Exception:  # dead, stopped or unreachable: the caller starts a new mesh
            return False
        return True

    def start_stage(self, spec: StageSpec, shared_memory: bool = True) -> None:
        """Start ``spec`` on every rank, the storages of its parcels that rank 0 does not hold
        sent once (``controller.mesh.storages``): in a memory file of this process that the workers
        on this host map, where rank 0 runs here and ``shared_memory`` allows, else in one message
        to rank 0. Until the stage ends cleanly, rank 0 counts as holding nothing."""
        lacking = storages.lacking(spec.parcels(), self.held)
        self.held, self.kept_shards = frozenset(), None
        staged = storages.in_memory_file(lacking) if lacking and shared_memory and self._watch.watches(0) else None
        file, shipment = staged if staged is not None else (None, Shipment())
        try:
            if file is not None:
                self.sent["shared memory"] += sum(key.nbytes for key in lacking)
            elif lacking:
                self.deliver(
                    Message("receive_storages", (list(lacking), storages.copies(lacking)), wait=False, rank0=True)
                )
            self.deliver(Message("start_stage", (dataclasses.replace(spec, shipment=shipment),)))
        finally:
            if file is not None:  # every worker mapped it, or failed
                file.close()

    def count_from_here(self) -> None:
        """Count :attr:`sent` anew (a stage starts)."""
        self.sent.clear()

    def deliver(self, message: Message) -> Any:
        """Send ``message``; unless it is fire-and-forget, every addressed rank's answer, in the
        order they arrive (``_gather``)."""
        endpoint = getattr(self._rank0 if message.rank0 else self._workers, message.endpoint)
        if not message.wait:
            endpoint.broadcast(*message.args)
            return None
        return self._gather(endpoint.stream(*message.args))

    def fetch(self, progress: int) -> list[Entry]:
        """Rank 0's next entries (R3); ``progress`` is how many rank 0 has sent so far. While rank 0
        does not answer, the other ranks are asked every :data:`_STATUS_S` how far their stage got:
        one that failed, or that stays behind, may be what holds rank 0 in a collective."""
        if self._death is not None:
            death, self._death = self._death, None
            raise death
        started = checked = time.monotonic()
        future = self._rank0.fetch.call_one()
        pending: list[Any] = []
        statuses: dict[int, RankStatus] = {}
        while True:
            STAGE_THREAD.serve()
            try:
                answer = deaths.checked(future.get(timeout=STAGE_THREAD.poll_s(POLL_S)))
            except TimeoutError:
                deaths.raise_if_dead(self._watch)
                pending = [status for status in pending if not self._took_status(status, statuses)]
                deaths.raise_if_timed_out(
                    started,
                    deaths.ahead_of_the_rest(progress, statuses, self.num_workers),
                    self.step_timeout,
                    self.num_workers,
                )
                if time.monotonic() - checked >= _STATUS_S:
                    checked = time.monotonic()
                    pending.extend(self._workers.status.stream())
            except SupervisionError as error:
                deaths.raise_death(error, self._watch)
            else:
                if not isinstance(answer, RankStatus):
                    break
                statuses[0] = answer  # rank 0's batch in progress has not ended: ask again
                future = self._rank0.fetch.call_one()
        entries = decode(answer)
        if entries and entries[-1].failure is not None:
            try:
                self._raise_if_a_death_caused(entries[-1].failure)
            except MeshFailureError as death:
                if len(entries) == 1:
                    raise
                # what rank 0 recorded before the death first, as a ddp run's rank 0 had it (R8)
                self._death = death
                return entries[:-1]
        return entries

    def _took_status(self, future: Any, statuses: dict[int, RankStatus]) -> bool:
        """Take a status answer if it is there (raising the failure it reports); ``False`` if not yet.
        Rank 0's own failure is left to its fetch, which returns it at once with the entries before
        it: there every rank is free to answer, and one that does not is named dead. Rank 0 answers
        a status between two fetches: a fetch whose batch does not end answers with its status."""
        try:
            status = future.get(timeout=0.001)
        except TimeoutError:
            return False
        except SupervisionError as error:
            deaths.raise_death(error, self._watch)
        if status.failure is not None and status.rank != 0:
            # rank 0's fetch is in flight: its silence here says nothing of its process
            self._raise_if_a_death_caused(status.failure, self._workers.status.stream())
            raise WorkerError.of(status.failure)
        statuses[status.rank] = status
        return True

    def take_warnings(self) -> list[RankValue]:
        """The warnings every rank holds (``worker.held_warnings``), as many as answer within
        :data:`_TAKE_WARNINGS_S` (not waiting for ranks the watch knows dead): after a failure a
        rank may be dead, or busy with a request that never ends, and its warnings go with it."""
        if self._world is None:
            return []
        deadline = time.monotonic() + _TAKE_WARNINGS_S
        alive = self.num_workers - len(self._watch.dead_ranks())
        answers: list[RankValue] = []
        for future in self._workers.take_warnings.stream():  # the first answer to arrive, then the next
            if len(answers) >= alive:
                break
            try:
                answers.append(future.get(timeout=max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                break
            except Exception:  # a dead rank's answer: Monarch's report of its death
                continue
        return answers

    def grant(self, batches: int) -> None:
        """Tell every worker that the controller took ``batches`` batch starts (R4)."""
        self._workers.grant.broadcast(Grant(batches))

    def predictions(self) -> list[PredictionShard]:
        """Every rank's predictions of the ended stage."""
        shards = []
        for answer in self.deliver(Message("predictions")):
            shards.extend(decode(answer))
        return shards

    @property
    def stopped(self) -> bool:
        """Whether this mesh was stopped (its processes, and a sharded module's shards with them, are gone)."""
        return self._world is None

    def stop(self, kill: bool = False) -> None:
        """Stop every worker process. Idempotent. ``kill`` first kills the processes on this host
        by process ID: after a failure they may be stuck (in a collective, or hung), and would not
        stop when asked."""
        world, self._world = self._world, None
        if world is None:
            return
        dead = self._lost or bool(self._watch.dead_ranks()) or (kill and self._watch.watches_all)
        self._watch.forget()
        if kill:
            self._watch.kill()
        for procs in world.owned:
            try:
                procs.stop().get(timeout=_STOP_DEAD_S if dead else _STOP_TIMEOUT_S)
            except Exception as error:  # the mesh may already be gone; stopping must not mask the cause
                if not dead:  # a dead process never answers
                    log.warning("Stopping the worker mesh failed: %s", error)

    # ----- lost hosts (elastic training) ------------------------------------------------------

    @property
    def slots(self) -> list[int]:
        """The slots of the hosts the mesh runs on now (their indices among the hosts it started on)."""
        assert self._world is not None
        return self._world.slots

    @property
    def num_slots(self) -> int:
        """How many hosts the mesh started on."""
        return host_count(self._hosts)

    def lost_hosts(self, timeout: float, refusing: Callable[[int], bool]) -> LostSlots:
        """The slots of the hosts whose host process is gone, not only a worker: their worker
        address refuses connections (``refusing``), or they do not serve a new process within
        ``timeout`` seconds (``WorkerWorld.lost_slots``)."""
        assert self._world is not None
        lost = self._world.lost_slots(timeout, _STOP_TIMEOUT_S, refusing)
        self._lost = self._lost or bool(lost.slots)
        return lost

    def stages_ended(self, timeout: float = _TAKE_WARNINGS_S) -> bool:
        """Whether every rank's stage ended with a failure within ``timeout`` seconds: after one
        rank's failure, another may still wait in a collective for it, and only a kill ends that."""
        return deaths.all_failed(self._workers.status.stream(), timeout)

    def reset_world(self) -> bool:
        """Every worker leaves its process group and takes its place in a new one of the same
        world (a new ``MASTER_PORT``): after a stage that failed on every rank, a collective that
        one rank began and another never joined must not meet the next stage's. Whether every
        rank's stage ended (one still in a collective may not have, and must not meet the next)."""
        assert self._world is not None
        ended = leave_world(self._world.workers, _STOP_TIMEOUT_S)
        self._world.join()
        return ended

    def notices(self) -> list[Optional[bool]]:
        """Each rank's answer, in rank order: whether its host got a preemption notice (``None``
        where the host serves none, ``worker.notices``)."""
        return [answer.value for answer in by_rank(self._gather(self._workers.notice.stream()))]

    def noticed(self) -> tuple[list[int], list[int]]:
        """The slots of the hosts that got a preemption notice, and the ranks of their workers."""
        ranks = [rank for rank, noticed in enumerate(self.notices()) if noticed]
        return sorted({self.slots[rank // self._per_host] for rank in ranks}), ranks

    def shrink(self, gone: list[int], alive: bool = False) -> list[int]:
        """Go on without the hosts in slots ``gone``, keeping the other hosts' processes, as a
        smaller world: each worker leaves its stage and its process group and takes its place in
        the new world (``controller.mesh.world``). Returns the slots of live hosts left out. ``alive``:
        the hosts still serve (they got a preemption notice), and their workers leave in good order
        too, before they are left out; the processes end with their host."""
        assert self._world is not None
        leaving = self._world.workers
        idle = self._world.remove(gone)
        leave_world(leaving if alive else self._world.workers, _STOP_TIMEOUT_S)
        self._lost = True  # stopping the mesh must not wait long for the processes of hosts gone
        self._world.join()
        self._death = None
        self._attach()
        return idle

    def grow(self, hosts: dict[int, HostMesh]) -> None:
        """Start workers on ``hosts``, each of which fills its slot again, and go on as a larger world
        with them: every other worker keeps its process, leaves the stage it is parked in and its
        process group, and takes its place in the new world."""
        assert self._world is not None
        leave_world(self._world.workers, _STOP_TIMEOUT_S)
        for slot, mesh in sorted(hosts.items()):
            self._world.add(mesh, [slot])
        self._world.join()
        self._attach()

    # ----- delivery ---------------------------------------------------------------------------

    def replace_processes(self) -> None:
        """Kill the worker processes and start new ones in their place, on the same hosts (``controller.mesh.channel``)."""
        assert self._world is not None
        layout = [(part.hosts, part.slots) for part in self._world.parts]
        self.stop(kill=True)
        self._death = None
        self._start(layout)

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
                values.append(deaths.checked(self._wait(future, started, limit, values)))
        except SupervisionError as error:
            deaths.raise_death(error, self._watch)
        except WorkerError as error:
            self._raise_if_a_death_caused(error.failure, pending)
            raise
        return values

    def _raise_if_a_death_caused(self, failure: WorkerFailure, pending: Optional[Iterable[Any]] = None) -> None:
        """Raise ``MeshFailureError`` if a worker's death caused ``failure`` (``controller.mesh.deaths``)."""
        deaths.raise_if_a_death_caused(failure, self._watch, self.num_workers, self._workers.status.stream, pending)

    def _wait(self, future: Any, started: float, limit: Optional[float], answered: list[Any]) -> Any:
        """One answer; meanwhile, every :data:`~lightning_monarch.controller.mesh.watch.POLL_S`, check that
        the worker processes live and that ``limit`` has not passed, and do the work other threads
        handed to this one (``controller.mesh.stage_thread``)."""
        while True:
            STAGE_THREAD.serve()
            try:
                return future.get(timeout=STAGE_THREAD.poll_s(POLL_S))
            except TimeoutError:
                deaths.raise_if_dead(self._watch)
                answering = {getattr(value, "rank", None) for value in answered}
                deaths.raise_if_timed_out(started, answering, limit, self.num_workers)
