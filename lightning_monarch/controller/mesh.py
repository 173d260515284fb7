"""The worker mesh as the controller sees it: spawn, message, stop.

Runs on the controller. Wraps a Monarch ``ProcMesh`` with one :class:`MonarchWorker` actor per
device and turns worker failures into :class:`~lightning_monarch.errors.WorkerError`.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterable, Optional, Union

# How often Monarch checks that worker processes are alive; its default (about 10 s) leaves a
# controller waiting that long on a dead worker. Read when Monarch starts, so set before import.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import monarch.actor  # noqa: E402
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError  # noqa: E402
from monarch.actor import ProcMesh, this_host  # noqa: E402
from monarch.spmd import setup_torch_elastic_env  # noqa: E402

from lightning_monarch.errors import MeshFailureError, WorkerError  # noqa: E402
from lightning_monarch.protocol import (  # noqa: E402
    Advance,
    CheckpointState,
    Finish,
    Peek,
    StageSpec,
    WorkerFailure,
    WorkerReply,
)
from lightning_monarch.worker.actor import MonarchWorker  # noqa: E402

log = logging.getLogger(__name__)

#: How long stopping a mesh may take before the controller gives up waiting on it.
_STOP_TIMEOUT_S = 30.0
#: How long an idle mesh may take to answer before the controller starts a new one instead.
_PING_TIMEOUT_S = 5.0


def _log_fault(failure: Any) -> None:
    """Replaces Monarch's ``unhandled_fault_hook``, whose default exits the controller.

    Monarch calls it from its own thread when a worker process dies or an actor fails outside a
    call. The failure also reaches the call waiting on that worker, as a ``SupervisionError`` that
    ``WorkerMesh`` raises as ``MeshFailureError``; here it is only logged. A failure of an earlier,
    already stopped mesh must not fail the next one.
    """
    log.warning("Monarch reported a worker mesh failure: %s", failure)


monarch.actor.unhandled_fault_hook = _log_fault


class WorkerMesh:
    """Runs on the controller: one process per device on this host, each with a ``MonarchWorker``."""

    def __init__(self, procs: ProcMesh, num_workers: int) -> None:
        self._procs: Optional[ProcMesh] = procs
        self._workers = procs.spawn("lightning_monarch_worker", MonarchWorker)
        self._rank0 = self._workers.slice(gpus=0)
        self._burst: list[Advance] = []
        self.num_workers = num_workers
        #: Each rank's process ID, in rank order.
        self.pids = [pid for _, pid in sorted(self._gather(self._workers.process_id.stream()))]

    @classmethod
    def spawn(cls, num_workers: int) -> "WorkerMesh":
        """Start ``num_workers`` worker processes and their torch elastic environment."""
        procs = this_host().spawn_procs(per_host={"gpus": num_workers})
        try:
            setup_torch_elastic_env(procs)
            return cls(procs, num_workers)
        except BaseException:
            procs.stop().get(timeout=_STOP_TIMEOUT_S)
            raise

    def start_stage(self, spec: StageSpec) -> None:
        """Build every rank's Trainer for the stage ``spec`` describes (a failure raises)."""
        self._gather(self._workers.start_stage.stream(spec))

    def end_stage(self) -> None:
        """Let every rank drop the finished stage's Trainer, module and data."""
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
        replies = self._gather(self._workers.advance.stream(burst))
        return sorted(replies, key=lambda reply: reply.rank)

    def flush(self) -> None:
        """Send the waiting burst now: ahead of a message that must see its effects, or so that
        the workers start on it while the controller goes on."""
        if self._burst:
            burst, self._burst = self._burst, []
            self._workers.advance.broadcast(burst)

    def read_metrics(self, view: str) -> dict[str, Any]:
        """Rank 0's ``trainer.<view>``; every rank takes part, for metrics synced across ranks."""
        self.flush()
        values = [value for value in self._gather(self._workers.read_metrics.stream(view)) if value is not None]
        return values[0]

    def checkpoint_state(self) -> CheckpointState:
        """Rank 0's model, optimizer and LR-scheduler state at the point the loop has reached."""
        return self._call_rank0("checkpoint_state")

    def module_attributes(self) -> dict[str, Any]:
        """Rank 0's module's public Python attributes."""
        return self._call_rank0("module_attributes")

    def module_children(self) -> dict[str, Any]:
        """Rank 0's module's direct submodules."""
        return self._call_rank0("module_children")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Run the worker callbacks' and module's ``on_save_checkpoint`` on rank 0; return the
        checkpoint they edited."""
        return self._call_rank0("on_save_checkpoint", checkpoint)

    def _call_rank0(self, endpoint: str, *args: Any) -> Any:
        """Call an out-of-band endpoint on rank 0, after the waiting burst."""
        self.flush()
        return self._check(getattr(self._rank0, endpoint).call_one(*args).get())

    def stop(self) -> None:
        """Stop every worker process. Idempotent; runs even when the workers are stuck."""
        procs, self._procs = self._procs, None
        if procs is None:
            return
        try:
            procs.stop().get(timeout=_STOP_TIMEOUT_S)
        except Exception as error:  # the mesh may already be gone; stopping must not mask the cause
            log.warning("Stopping the worker mesh failed: %s", error)

    def _gather(self, futures: Iterable[Any], timeout: Optional[float] = None) -> list[Any]:
        try:
            values = [self._check(future.get(timeout=timeout)) for future in futures]
        except SupervisionError as error:
            rank = re.search(r"'gpus': (\d+)/", str(error))
            who = f"Worker rank {rank.group(1)}" if rank else "A worker"
            raise MeshFailureError(
                f"{who} stopped answering: its process died (killed, out of memory or crashed). Monarch"
                f" reported: {str(error).splitlines()[0]}"
            ) from error
        return values

    @staticmethod
    def _check(value: Any) -> Any:
        if isinstance(value, WorkerFailure):
            raise WorkerError(value)
        if isinstance(value, WorkerReply) and value.failure is not None:
            raise WorkerError(value.failure)
        return value
