"""What the workers print, when they run on other hosts: Monarch's log forwarding, grouped.

Runs on the controller. Workers on this host share the controller's terminal (or notebook
kernel), as the ranks of ``ddp`` do, and print there directly. Workers on other hosts print to
their host's output (a SLURM log file, a pod's log); with ``WorkerOutput``, Monarch also forwards
every line to the controller, where lines that workers print alike within a window are shown once
with their count (``[8 similar log lines] [0] epoch 3 done``), so that 64 workers printing the same
line do not bury the progress bar. Python warnings are not among those lines: every worker holds
its own, and the controller shows each once (``controller.mesh.worker_warnings``).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Optional

from monarch.actor import ProcMesh
from monarch.config import configure

from lightning_monarch._compat import monarch as monarch_compat


@dataclass(frozen=True)
class WorkerOutput:
    """Forward the output of workers on other hosts to the controller, grouped over
    ``aggregate_window_sec`` seconds (``None``: every line at once, prefixed with its rank)."""

    aggregate_window_sec: Optional[int]

    @staticmethod
    def forward_new_processes(enabled: bool) -> None:
        """Whether Monarch gives the worker processes spawned from now on a log forwarder (a
        process-wide setting). It is set before every spawn and left so: on for workers on other
        hosts, off for meshes on this host, which print directly. Monarch attaches a process's
        forwarder some time after the process started, once its bootstrap (which imports torch)
        has run, and only if the setting is still on then; switched off again at once, it left the
        workers on other hosts without one."""
        configure(enable_log_forwarding=enabled)

    def stream(self, procs: ProcMesh) -> None:
        """Stream ``procs``' output to this process. ``ProcMesh.logging_option`` is a coroutine;
        it runs on a thread of its own, because a notebook's main thread already runs an event loop."""
        failure: list[BaseException] = []

        async def stream_from_the_first_line() -> None:
            await procs.logging_option(stream_to_client=True, aggregate_window_sec=self.aggregate_window_sec)
            # The forwarders take the new mode in a message that nothing waits for: a line printed
            # before it arrives is never shown. A flush goes to them after it, so once it returns
            # they stream every line from the first one the workers print.
            await monarch_compat.flush_forwarded_output(procs)

        def run() -> None:
            try:
                asyncio.run(stream_from_the_first_line())
            except BaseException as error:  # raised below, in the caller's thread
                failure.append(error)

        thread = threading.Thread(target=run, name="lightning_monarch-logging-option")
        thread.start()
        thread.join()
        if failure:
            raise failure[0]
