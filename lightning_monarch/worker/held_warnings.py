"""The Python warnings a worker process holds for the controller, instead of printing them.

Runs in each worker process. Every worker runs the same code, so under ``ddp`` a warning prints
once per rank, and a rank-zero warning of Lightning's prints on the controller and again on
worker rank 0. Here each worker process, from its start-up (``worker.process``), keeps what
Python's warning machinery would have printed: the process's own filters have let it through,
and its "once per location" registry has already dropped repeats. Rank 0's warnings travel in
its entries, the other ranks' when the stage ends; the controller shows each once
(``controller.mesh.worker_warnings``).

Only the warnings module's output is held. What a worker prints otherwise (its own ``print``,
logging, a traceback on its way out, native libraries) reaches the terminal as before.
"""

from __future__ import annotations

import threading
import warnings
from typing import Optional, TextIO

from lightning_monarch.wire.reports import WorkerWarning, class_name


class HeldWarnings:
    """Runs in each worker process: the warnings shown since the controller last took them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[WorkerWarning] = []
        self._installed = False

    def install(self) -> None:
        """Hold every warning this process shows from now on (it replaces ``warnings.showwarning``,
        as ``logging.captureWarnings`` does). Warnings raise on any thread: the loop thread, the
        endpoint thread, a dataloader's."""
        if self._installed:
            return
        self._installed = True
        printer = warnings.showwarning

        def hold(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: Optional[TextIO] = None,
            line: Optional[str] = None,
        ) -> None:
            if file is not None:  # a caller that chose where the warning goes
                printer(message, category, filename, lineno, file, line)
                return
            with self._lock:
                self._held.append(WorkerWarning(class_name(category), str(message), filename, lineno))

        warnings.showwarning = hold

    def take(self) -> list[WorkerWarning]:
        """The warnings held since the last call, in the order they were shown."""
        with self._lock:
            taken, self._held = self._held, []
        return taken


#: This process's held warnings; ``worker.process`` installs it when the process starts.
HELD = HeldWarnings()
