"""How the controller tells a worker's exception from a worker's death or a hang.

Runs on the controller, for ``controller.mesh.worker_mesh``, while it waits for the workers'
answers. A worker process that died shows first as a survivor's collective error (gloo's "closed
by peer", NCCL's), which names the survivor: on this host the process watch
(``controller.mesh.watch``) names the dead rank at once, on other hosts Monarch's supervision does,
seconds later. A worker whose answer does not come within ``step_timeout`` is hung.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, Optional

from lightning_monarch._compat.monarch import SupervisionError, failed_rank
from lightning_monarch.controller.mesh.debugger import waits_counted_from
from lightning_monarch.controller.mesh.watch import POLL_S, ProcessWatch
from lightning_monarch.errors import MeshFailureError, WorkerError, WorkerTimeoutError
from lightning_monarch.wire.protocol import RankStatus
from lightning_monarch.wire.reports import WorkerFailure

#: How long a survivor's collective error waits, with workers on other hosts, for Monarch's
#: supervision to report the dead peer instead: a death inside a collective reaches the controller
#: first as the survivors' gloo/NCCL error, and the report of a death on another host came 10 s
#: after it in ``benchmarks/death_report.py``.
_SUPERVISION_GRACE_S = 20.0
#: How long a survivor's collective error waits, with every worker on this host, for the process
#: watch to see the dead peer: the peer's sockets close while its process exits, and its exit can
#: end that much later on a loaded host (``tests/test_deaths.py``).
_EXIT_GRACE_S = 3.0
#: What a survivor's error says when a peer of its collective is gone (gloo's and NCCL's words).
_PEER_LOST = re.compile(r"closed by peer|reset by peer|remote worker|NCCL|RCCL|Connection refused|Broken pipe", re.I)


def checked(value: Any) -> Any:
    """A worker's answer, or its failure raised as ``WorkerError``."""
    if isinstance(value, WorkerFailure):
        raise WorkerError.of(value)
    return value


def raise_if_a_death_caused(
    failure: WorkerFailure,
    watch: ProcessWatch,
    num_workers: int,
    statuses: Callable[[], Iterable[Any]],
    pending: Optional[Iterable[Any]] = None,
) -> None:
    """Raise ``MeshFailureError`` if a worker's death caused ``failure``: a peer's death shows
    first as a survivor's collective error. The watch names the dead rank at once, by its
    lifeline or, on this host, its process ID, once it sees the death: it is given
    :data:`_EXIT_GRACE_S` to. A watch without lifelines leaves the workers on other hosts to
    Monarch's supervision, which reports a death seconds later, in one of ``pending`` (answers not
    taken yet). Without ``pending`` every rank is asked its status (``statuses()``), which a live
    worker answers at once: a rank that does not answer within the grace is named as dead too,
    since Monarch may report a lost host in another way, or later."""
    raise_if_dead(watch)
    if not _PEER_LOST.search(failure.message):
        return
    if watch.sees_every_death:
        _raise_if_dead_within(watch, _EXIT_GRACE_S)
        return
    if pending is not None:
        _raise_if_supervision_reports(pending)
        return
    answered = _raise_if_supervision_reports(statuses())
    silent = tuple(rank for rank in range(num_workers) if rank not in answered)
    if silent:
        raise MeshFailureError(
            f"Worker ranks {list(silent)} stopped answering after rank {failure.rank} lost its connection"
            f" to a peer: their processes died, or their hosts. Rank {failure.rank} raised:"
            f" {failure.message.splitlines()[0]}",
            silent,
        )


def raise_death(error: Exception, watch: ProcessWatch) -> NoReturn:
    """Raise the death that Monarch's supervision ``error`` reports: as the process watch saw
    it, if it did (it names a rank on this host at once), else from Monarch's report."""
    raise_if_dead(watch)
    raise died(error) from error


def died(error: Exception) -> MeshFailureError:
    """Monarch's report of a dead worker process, as ``MeshFailureError`` naming its rank."""
    rank = failed_rank(str(error))
    who = f"Worker rank {rank}" if rank is not None else "A worker"
    return MeshFailureError(
        f"{who} stopped answering: its process died (killed, out of memory or crashed). Monarch"
        f" reported: {str(error).splitlines()[0]}",
        (rank,) if rank is not None else (),
    )


def raise_if_dead(watch: ProcessWatch) -> None:
    """Raise ``MeshFailureError`` naming the workers whose process has died (by its lifeline, or
    by its process ID on this host) or whose host stopped answering."""
    dead = tuple(watch.dead_ranks())
    if not dead:
        return
    unreachable = watch.unreachable_ranks()
    died = [rank for rank in dead if rank not in unreachable]
    said = []
    if died:
        said.append(f"Worker {_named(watch, died)} died: killed, out of memory or crashed.")
    if unreachable:
        hosts = ", ".join(sorted({watch.hosts[rank] for rank in unreachable}))
        said.append(
            f"Worker {_named(watch, unreachable)} stopped answering: host {hosts} is unreachable (a network cut,"
            " or the host went down)."
        )
    raise MeshFailureError(f"{' '.join(said)} The other workers were stopped.", dead)


def _named(watch: ProcessWatch, ranks: list[int]) -> str:
    return ", ".join(f"rank {rank} (pid {watch.pids[rank]} on {watch.hosts[rank]})" for rank in ranks)


def _raise_if_dead_within(watch: ProcessWatch, seconds: float) -> None:
    """Raise as :func:`raise_if_dead` does if a watched process is seen dead within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        raise_if_dead(watch)


def raise_if_timed_out(
    started: float, answered: Iterable[Optional[int]], limit: Optional[float], num_workers: int
) -> None:
    """Raise ``WorkerTimeoutError`` once a wait that began at ``started`` passed ``limit``, naming
    the ranks that did not answer (or did not get as far). The time a worker's pdb session held
    the terminal does not count (``controller.mesh.debugger``)."""
    counted_from = waits_counted_from(started)
    if limit is None or counted_from is None or time.monotonic() - counted_from <= limit:
        return
    silent = tuple(rank for rank in range(num_workers) if rank not in set(answered))
    raise WorkerTimeoutError(
        f"Worker ranks {list(silent)} did not answer within {limit:g} s"
        f" (`MonarchStrategy(step_timeout={limit:g})`): their processes are alive but stuck,"
        " for example in a collective that a peer never joined. Raise `step_timeout` if a"
        " step legitimately takes longer.",
        silent,
    )


def all_failed(statuses: Iterable[Any], timeout: float) -> bool:
    """Whether every rank's status (``statuses``, answers to come) reports its stage ended with a
    failure, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for future in statuses:
        try:
            status = future.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # no answer in time, or a dead process
            return False
        if status.failure is None:
            return False
    return True


def ahead_of_the_rest(progress: int, statuses: dict[int, RankStatus], num_workers: int) -> list[int]:
    """The ranks that got further than the rest (by gates done), when the others have answered:
    the ranks that stay behind are the ones to name if the wait times out. Rank 0 got as far as
    its entries reach (``progress``), or further where its fetch answered with its status."""
    done = {0: progress, **{rank: status.gates for rank, status in statuses.items()}}
    if len(done) < num_workers or len(set(done.values())) == 1:
        return []
    least = min(done.values())
    return [rank for rank, gates in done.items() if gates > least]


def _raise_if_supervision_reports(pending: Iterable[Any]) -> set[Optional[int]]:
    """Wait up to :data:`_SUPERVISION_GRACE_S` for the ranks that have not answered; raise
    ``MeshFailureError`` if Monarch's supervision reports one of them dead meanwhile. Returns
    the ranks that answered."""
    deadline = time.monotonic() + _SUPERVISION_GRACE_S
    answered: set[Optional[int]] = set()
    for future in pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            answered.add(getattr(future.get(timeout=left), "rank", None))
        except SupervisionError as error:
            raise died(error) from error
        except TimeoutError:
            break
        except Exception:  # another survivor's error: the death may still be reported
            continue
    return answered
