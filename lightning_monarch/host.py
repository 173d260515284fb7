"""A worker host's main process: Monarch's worker loop, with SIGTERM turned into a preemption notice.

Runs on each worker host, as ``lightning-monarch serve ADDRESS``, in place of Monarch's
``run_worker_loop_forever``: the controller connects to it at ``ADDRESS`` as to any Monarch host
(``MonarchStrategy(hosts=[...])``), and starts its worker processes there.

A spot or preemptible host gets SIGTERM some seconds before it is taken away (SLURM's grace time,
Kubernetes' ``terminationGracePeriodSeconds``, a cloud's shutdown notice). Monarch's own host
process dies of it at once, and its worker processes with it, so the controller learns of the loss
only then, and an elastic ``fit`` goes back to its last resume point. Served by :func:`serve`
instead, the host process lives on for ``grace`` seconds and writes a notice file, whose path its
worker processes inherit (:data:`NOTICE_VARIABLE`); they ignore SIGTERM themselves
(``worker.notices``). After the next optimizer step, the workers see the notice and wait, and an
elastic ``fit`` goes on without this host from there (``controller.features.elastic``): no step is redone.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

from monarch.actor import start_worker_loop_forever

from lightning_monarch.memory_files import MemoryFile

log = logging.getLogger(__name__)

#: The environment variable that this host process gives its worker processes: the file it writes
#: when it gets SIGTERM (``worker.notices`` reads it).
NOTICE_VARIABLE = "LIGHTNING_MONARCH_NOTICE_FILE"
#: How long a host lives on after SIGTERM by default: Kubernetes' default grace, GCP's spot notice.
DEFAULT_GRACE_S = 30.0
#: How often the main thread wakes: a Python signal handler runs only between its waits.
_WAKE_S = 0.1
#: The command that runs :func:`serve`, as its errors name it.
COMMAND = "lightning-monarch serve"
#: What the command does, for its ``--help``.
DESCRIPTION = "Serve as a worker host at ADDRESS, taking SIGTERM as a preemption notice for elastic training."


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


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's arguments to ``parser``: the ``lightning-monarch`` command line's
    ``serve``, and the parser of :func:`main`."""
    parser.add_argument("address", help="where the controller connects, e.g. tcp://node-1:26600")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds the host lives on after SIGTERM")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``lightning-monarch serve ADDRESS [--grace S]``: serve until the controller shuts this host
    down, or until the grace after SIGTERM is over; exit code 2, with the fix, for bad input."""
    problem = None
    if not re.match(r"[a-z]+://", args.address) and "@" not in args.address:
        problem = (
            f"ADDRESS {args.address!r} is not a Monarch channel address: give the one that"
            " `MonarchStrategy(hosts=[...])` names for this host, e.g. tcp://node-1:26600."
        )
    elif not args.grace > 0:
        problem = (
            f"--grace {args.grace:g}: give the seconds this host lives on after SIGTERM, more than 0"
            " (at most what the scheduler or cloud allows between SIGTERM and the end)."
        )
    if problem is not None:
        print(f"{COMMAND}: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    return serve(args.address, args.grace)


def main(argv: Sequence[str]) -> int:
    """``lightning-monarch serve``, as the console script runs it (``lightning_monarch.__main__``):
    without the rest of the command line, which imports torch and Lightning, for a process that
    only relays (:func:`serve`)."""
    parser = add_arguments(argparse.ArgumentParser(prog=COMMAND, description=DESCRIPTION))
    return run(parser.parse_args(argv))
