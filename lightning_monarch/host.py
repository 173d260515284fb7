"""A worker host's main process: Monarch's worker loop, with SIGTERM turned into a preemption notice.

Runs on each worker host, as ``lightning-monarch serve ADDRESS``, in place of Monarch's
``run_worker_loop_forever``: the controller connects to it at ``ADDRESS`` as to any Monarch host
(``MonarchStrategy(hosts=[...])``), and starts its worker processes there.

A spot or preemptible host gets SIGTERM some seconds before it is taken away (SLURM's grace time,
Kubernetes' ``terminationGracePeriodSeconds``, a cloud's shutdown notice). Monarch's own host
process dies of it at once, and its worker processes with it, so the controller learns of the loss
only then, and an elastic ``fit`` goes back to its last resume point. Served by :func:`serve`
instead, the host process lives on for ``grace`` seconds and writes a notice file, whose path its
worker processes inherit (``specs.NOTICE_VARIABLE``); they ignore SIGTERM themselves
(``worker.notices``). After the next optimizer step, the workers see the notice and wait, and an
elastic ``fit`` goes on without this host from there (``controller.features.elastic``): no step is redone.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Optional

from monarch.actor import start_worker_loop_forever

from lightning_monarch.memory_files import MemoryFile
from lightning_monarch.wire.specs import NOTICE_VARIABLE

log = logging.getLogger(__name__)

#: How long a host lives on after SIGTERM by default: Kubernetes' default grace, GCP's spot notice.
DEFAULT_GRACE_S = 30.0
#: How often the main thread wakes: a Python signal handler runs only between its waits.
_WAKE_S = 0.1


class NoticeFile:
    """The file whose content tells this host's worker processes that the host got SIGTERM: a
    memory file (``memory_files``), empty until the notice, that goes with this process however
    it ends, so that a killed host leaves nothing behind."""

    def __init__(self) -> None:
        self._file = MemoryFile("lightning_monarch_notice")
        self.path = self._file.path
        #: When this process got SIGTERM (``time.monotonic()``); ``None`` before.
        self.noticed_at: Optional[float] = None

    def write(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler (runs on the main thread): write the notice, once."""
        if self.noticed_at is not None:
            return
        self.noticed_at = time.monotonic()
        os.write(self._file.fd, f"{signal.Signals(signum).name} at {time.time()}\n".encode())
        log.warning("lightning_monarch: this host got a preemption notice; its workers are told.")

    def remove(self) -> None:
        self._file.close()


def serve(address: str, grace: float) -> int:
    """Serve as a Monarch host at ``address`` until the controller shuts the host down, or until
    ``grace`` seconds after SIGTERM: meanwhile the notice tells the workers to let the controller
    go on without this host. Runs on the host's main thread, the only one that can take a signal."""
    notice = NoticeFile()
    os.environ[NOTICE_VARIABLE] = notice.path  # the worker processes this host starts inherit it
    signal.signal(signal.SIGTERM, notice.write)
    served = start_worker_loop_forever(address=address, ca="trust_all_connections")
    try:
        while notice.noticed_at is None or time.monotonic() - notice.noticed_at < grace:
            try:
                served.get(timeout=_WAKE_S)
                return 0  # the controller shut the host down
            except TimeoutError:
                continue
        log.warning("lightning_monarch: the %g s of grace after the preemption notice are over; the host stops.", grace)
        return 0
    finally:
        notice.remove()
