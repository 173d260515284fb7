"""``breakpoint()`` in a worker: pdb quits there, as Python's pdb does without input, instead of hanging.

Runs in each worker process, installed by its start-up (``worker.process``). Monarch's proc
bootstrap sets ``sys.breakpointhook`` to the hook of its remote debugger, which waits for someone
to attach with ``monarch debug``: a ``breakpoint()`` in a worker's hook hung the fit, with its
peers waiting in their next collective and the controller waiting for them. A worker has no
terminal of its own, so here pdb quits at once, as Python's pdb quits at the end of its input (a
batch job, CI): :func:`quit_at_breakpoint` raises ``bdb.BdbQuit`` saying where and why, and the
stage ends as a ``WorkerError`` on the controller naming the rank and the hook.
``PYTHONBREAKPOINT=0`` runs past breakpoints, as in any Python process.
"""

from __future__ import annotations

import bdb
import inspect
import os
from typing import Any


def quit_at_breakpoint(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook`` of a worker process: raise ``bdb.BdbQuit`` at the caller's line,
    unless ``PYTHONBREAKPOINT=0`` turns breakpoints off."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    frame = inspect.currentframe()
    caller = frame.f_back if frame is not None else None
    where = f" at {caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else ""
    raise bdb.BdbQuit(
        f"`breakpoint()`{where} in a worker process (pid {os.getpid()}): pdb has no terminal on a worker, so it"
        " quits there, as Python's pdb does without input. To step through the hook, run it in one process with"
        " your terminal (`Trainer(accelerator='cpu', devices=1)` without strategy='monarch'), or set"
        " `PYTHONBREAKPOINT=0` to run past breakpoints."
    )
