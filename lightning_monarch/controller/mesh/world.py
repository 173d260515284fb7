"""The worker processes and the world they form: which hosts, which processes, which ranks.

Runs on the controller, for ``controller.mesh.worker_mesh``. The workers start as one Monarch ``ProcMesh``
with a ``MonarchWorker`` per device on each host. Under elastic training (``controller.features.elastic``)
the world changes while the processes stay: a lost host is sliced out, and a host that serves
again gets a ``ProcMesh`` of its own. :class:`WorkerWorld` keeps those parts, numbers the ranks
in the order of the hosts the strategy asked for (each host's *slot*), gives every worker the torch
elastic environment of the world (``MonarchWorker.join_world``), and messages all the parts as one
actor mesh (:class:`Fanout`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from monarch.actor import HostMesh, ProcMesh

from lightning_monarch.controller.mesh.counted import Counted
from lightning_monarch.controller.mesh.hosts import host_count
from lightning_monarch.wire.specs import WorldSpec
from lightning_monarch.worker.actor import MonarchWorker
from lightning_monarch.worker.process import LOCAL_DIMENSION

log = logging.getLogger(__name__)

#: How often a lost-host check, waiting for a host to serve a new process, asks again whether the
#: host's worker address refuses connections.
_REFUSAL_POLL_S = 0.25


@dataclass
class Part:
    """One ``ProcMesh`` of worker processes (or a slice of one) and the ``MonarchWorker`` actors in them."""

    hosts: HostMesh
    procs: ProcMesh
    workers: Any
    #: Each host's slot: its index among the hosts the strategy asked for (``num_nodes``).
    slots: list[int]
    #: Each host's coordinate in the mesh the actors were spawned on, which ``current_rank()`` gives them.
    coordinates: list[int]

    def sliced(self, keep: range) -> Part:
        """The part with the hosts at positions ``keep`` only."""
        label = host_label(self.hosts)
        by_host = {label: slice(keep.start, keep.stop, keep.step)}
        return Part(
            self.hosts.slice(**by_host),
            self.procs.slice(**by_host),
            self.workers.slice(**by_host),
            [self.slots[position] for position in keep],
            [self.coordinates[position] for position in keep],
        )


class Fanout:
    """The actors of every part, messaged as one actor mesh: ``endpoint.stream(...)`` sends to every
    part before any answer is awaited (a collective across the parts would otherwise wait for a part
    not yet asked) and returns all their answers' futures; ``endpoint.broadcast(...)`` sends to each."""

    def __init__(self, meshes: list[Any]) -> None:
        self._meshes = meshes

    def __getattr__(self, endpoint: str) -> _FanoutEndpoint:
        return _FanoutEndpoint([getattr(mesh, endpoint) for mesh in self._meshes])


@dataclass(frozen=True)
class _FanoutEndpoint:
    endpoints: list[Any]

    def stream(self, *args: Any) -> list[Any]:
        return [future for endpoint in self.endpoints for future in endpoint.stream(*args)]

    def broadcast(self, *args: Any) -> None:
        for endpoint in self.endpoints:
            endpoint.broadcast(*args)


class WorkerWorld:
    """Runs on the controller: the parts of a mesh's worker processes, their ranks and environment."""

    def __init__(
        self, per_host: int, spawn: Callable[[HostMesh], ProcMesh], actor_name: str, sent: Counter[str]
    ) -> None:
        """``spawn`` starts ``per_host`` worker processes on each of the hosts it is given; every
        message to the workers is counted in ``sent`` (``controller.mesh.counted``)."""
        self._per_host = per_host
        self._spawn = spawn
        self._actor_name = actor_name
        self._sent = sent
        self.parts: list[Part] = []
        #: The ``ProcMesh``es this world started, which only it can stop.
        self.owned: list[ProcMesh] = []

    def add(self, hosts: HostMesh, slots: Iterable[int]) -> None:
        """Start worker processes and their actors on ``hosts``, which fill ``slots``."""
        procs = self._spawn(hosts)
        self.owned.append(procs)
        workers = procs.spawn(self._actor_name, MonarchWorker)
        slots = list(slots)
        self.parts.append(Part(hosts, procs, workers, slots, list(range(host_count(hosts)))))

    def remove(self, slots: Iterable[int]) -> list[int]:
        """Go on without the hosts in ``slots``; the live hosts left out too (Monarch slices a mesh
        by ranges, so of the live hosts of a part, the longest range of them stays)."""
        lost = set(slots)
        idle: list[int] = []
        parts: list[Part] = []
        for part in self.parts:
            keep, left_out = surviving_positions(
                len(part.slots), [part.slots.index(slot) for slot in lost if slot in part.slots]
            )
            idle.extend(part.slots[position] for position in left_out)
            if len(keep):
                parts.append(part.sliced(keep))
        self.parts = parts
        return sorted(idle)

    @property
    def slots(self) -> list[int]:
        """The live hosts' slots, in rank order."""
        return sorted(slot for part in self.parts for slot in part.slots)

    @property
    def num_workers(self) -> int:
        return len(self.slots) * self._per_host

    def hosts_of(self, slot: int) -> HostMesh:
        """The one-host mesh of ``slot``."""
        part = next(part for part in self.parts if slot in part.slots)
        return part.hosts.slice(**{host_label(part.hosts): part.slots.index(slot)})

    @property
    def workers(self) -> Counted:
        """Every worker's actor."""
        return Counted(Fanout([part.workers for part in self.parts]), self.num_workers, self._sent)

    @property
    def rank0(self) -> Any:
        """Rank 0's actor: local rank 0 on the host of the first slot."""
        return Counted(self.actors()[0], 1, self._sent)

    def actors(self) -> tuple[Any, ...]:
        """Each rank's actor, in rank order: each host's local ranks, host after host."""
        actors: list[Any] = []
        for slot in self.slots:
            part = next(part for part in self.parts if slot in part.slots)
            host = {host_label(part.hosts): part.slots.index(slot)} if len(part.workers.extent.labels) > 1 else {}
            actors.extend(part.workers.slice(**host, **{LOCAL_DIMENSION: local}) for local in range(self._per_host))
        return tuple(actors)

    def lost_slots(self, timeout: float, stop_timeout: float, refusing: Callable[[int], bool]) -> LostSlots:
        """The slots of the hosts whose host process is gone, not only a worker: their worker
        address refuses connections (``refusing``), or they do not serve a new process within
        ``timeout`` seconds. Every other host is asked, at once (a live one answers in a second or
        two): a death on another host is named by Monarch's report in the coordinates of the mesh
        the worker started in, which after a world change are not its rank's. While a host's new
        process is waited for, its address is asked again: a killed host's port closes only once
        its process has exited, which a loaded machine can take seconds over."""
        refused = [slot for slot in self.slots if refusing(slot)]
        probes = {
            slot: self.hosts_of(slot).spawn_procs(per_host={LOCAL_DIMENSION: 1})
            for slot in self.slots
            if slot not in refused
        }
        deadline = time.monotonic() + timeout
        silent = []
        for slot, probe in probes.items():
            answer = _answer(probe, deadline, slot, refusing)
            if answer == "refuses":
                refused.append(slot)
            elif answer == "silent":
                silent.append(slot)
            else:
                try:
                    probe.stop().get(timeout=stop_timeout)
                except Exception as error:
                    log.warning("Stopping the process that showed host %d lives failed: %s", slot, error)
        return LostSlots(sorted(refused), silent)

    def join(self) -> None:
        """Give every worker the torch elastic environment of this world: ``RANK`` in slot order,
        ``MASTER_ADDR`` and a free ``MASTER_PORT`` on rank 0's host (``MonarchWorker.join_world``)."""
        master_addr, master_port = self.rank0.free_port.call_one().get()
        slots = self.slots
        for part in self.parts:
            world = WorldSpec(
                master_addr=master_addr,
                master_port=master_port,
                local_world_size=self._per_host,
                group_world_size=len(slots),
                host_dimension=host_label(part.hosts) if part.hosts.extent.labels else None,
                group_ranks={
                    coordinate: slots.index(slot) for coordinate, slot in zip(part.coordinates, part.slots, strict=True)
                },
            )
            workers = Counted(part.workers, len(part.slots) * self._per_host, self._sent)
            for future in workers.join_world.stream(world):
                future.get()


@dataclass(frozen=True)
class LostSlots:
    """The hosts a lost-host check found gone, by slot: ``refusing``, their worker address refuses
    connections; ``silent``, no new process started on them in time (or Monarch reported them gone)."""

    refusing: list[int]
    silent: list[int]

    @property
    def slots(self) -> list[int]:
        return sorted(self.refusing + self.silent)


def _answer(probe: ProcMesh, deadline: float, slot: int, refusing: Callable[[int], bool]) -> str:
    """How the host of ``slot`` answers ``probe``, its new process, by ``deadline``: it ``serves``
    it, its worker address ``refuses`` connections meanwhile, or neither (``silent``; also where
    Monarch reported the host gone)."""
    while True:
        try:
            probe.initialized.get(timeout=min(_REFUSAL_POLL_S, max(0.0, deadline - time.monotonic())))
            return "serves"
        except TimeoutError:
            if refusing(slot):
                return "refuses"
            if time.monotonic() >= deadline:
                return "silent"
        except Exception:  # Monarch reported the host gone
            return "silent"


def leave_world(workers: Counted, timeout: float) -> bool:
    """Each of ``workers`` leaves its stage and process group (not through the mesh's gather: the
    process watch may still see the dead); whether every stage's loop ended."""
    return all([left.get(timeout=timeout) for left in workers.leave_world.stream()])


def host_label(hosts: HostMesh) -> str:
    """The name of the hosts' dimension of ``hosts`` (``hosts`` for Monarch's jobs)."""
    return hosts.extent.labels[0]


def surviving_positions(count: int, lost: Iterable[int]) -> tuple[range, list[int]]:
    """Of ``count`` hosts, without those at positions ``lost``: the longest range of live positions
    (with a step; the first of equally long ones), and the live positions it leaves out."""
    alive = [position for position in range(count) if position not in set(lost)]
    best = range(0)
    for start in alive:
        for step in range(1, count):
            stop = start
            while stop < count and stop in alive:
                stop += step
            if len(range(start, stop, step)) > len(best):
                best = range(start, stop, step)
    return best, [position for position in alive if position not in best]
