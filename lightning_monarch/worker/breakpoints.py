"""``breakpoint()`` and ``pdb.set_trace()`` in a worker: pdb, relayed to the controller's terminal.

Runs in each worker process, installed by its start-up (``worker.process``). Monarch's proc
bootstrap sets ``sys.breakpointhook`` to the hook of its own remote debugger, which waits for
someone to attach with ``monarch debug`` in another terminal: the fit hung, its peers in their next
collective. Here the hook opens a :class:`WorkerPdb` instead, Monarch's ``PdbWrapper`` over the
endpoints of the debugger that the controller registered (``controller.mesh.debugger``): its
prompt names the rank and host, its lines are read from the controller's own input, and its session
ends when the user continues or quits, so that the next rank that stopped gets the terminal.
``q`` raises ``bdb.BdbQuit`` where the rank stopped, which ends the stage as a ``WorkerError``;
without input on the controller pdb quits the same way, as Python's pdb does at the end of its
input. ``PYTHONBREAKPOINT=0`` runs past breakpoints, as in any Python process.

:func:`post_mortem` opens the same pdb at the frame that raised an exception
(``MonarchStrategy(post_mortem=True)``, called by the stage's loop before the failure is reported).
The calls to the controller go out as this worker's actor: the stage's loop thread runs in the
context of the endpoint that started it (``worker.loop``).
"""

from __future__ import annotations

import bdb
import inspect
import os
import pdb
import socket
import sys
from types import FrameType, TracebackType
from typing import Any, Optional

import torch.distributed as dist
from monarch.actor import context, current_rank, debug_controller

from lightning_monarch._compat import monarch as monarch_compat
from lightning_monarch.worker import pdb_barrier


class WorkerPdb(monarch_compat.PdbWrapper):
    """Runs in a worker process: pdb whose input and output are the controller's, in sessions the
    controller takes one at a time; a session opens where pdb stops and ends at ``c`` or ``q``."""

    stdin: Any
    stdout: Any

    def __init__(self, header: Optional[str] = None) -> None:
        rank = dist.get_rank() if dist.is_initialized() else current_rank().rank
        super().__init__(rank, {"rank": rank}, context().actor_instance.actor_id, debug_controller(), header)
        self.host = socket.gethostname()
        self.prompt = f"(Pdb rank {rank} on {self.host}) "
        self._relayed: tuple[Any, Any] = (self.stdin, self.stdout)
        self._in_session = self._leaving = False

    def set_trace(self, frame: Optional[FrameType] = None) -> None:
        """Stop at ``frame``: the session opens at the stop (``interaction``), not here."""
        pdb.Pdb.set_trace(self, frame)

    def interaction(self, frame: Optional[FrameType], traceback: Optional[TracebackType]) -> None:
        if not self._in_session:
            pdb_barrier.session_began()
            with monarch_compat.sync_calls():
                self.controller.debugger_session_start.call_one(
                    self.rank, self.coords, self.host, self.actor_id.actor_name
                ).get()
            self.stdin, self.stdout = self._relayed
            self._in_session, self._leaving = True, False
            if self.header:
                self.message(self.header)
        super().interaction(frame, traceback)
        if self._leaving:
            self._in_session = False
            self.end_debug_session()
            pdb_barrier.session_ended()

    def trace_dispatch(self, frame: FrameType, event: str, arg: Any) -> Any:
        """bdb's tracer, whose ``BdbQuit`` at ``q`` says who quit, for the controller's error."""
        try:
            return super().trace_dispatch(frame, event, arg)
        except bdb.BdbQuit as quit:
            if quit.args:
                raise
            raise bdb.BdbQuit(
                f"pdb quit on rank {self.rank} (`q`, or the end of the controller's input), which ends the stage."
                " `c` goes on with it instead."
            ) from None

    def set_continue(self) -> None:
        super().set_continue()
        self._leaving = True

    def set_quit(self) -> None:
        super().set_quit()
        self._leaving = True


def relay_breakpoint(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook`` and ``pdb.set_trace`` of a worker process: pdb at the caller's line,
    on the controller's terminal, unless ``PYTHONBREAKPOINT=0`` turns breakpoints off."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    frame = inspect.currentframe()
    WorkerPdb().set_trace(frame.f_back if frame is not None else None)


def post_mortem(error: BaseException) -> None:
    """pdb at the frame that raised ``error``, on the controller's terminal, until the user
    continues or quits; a ``bdb.BdbQuit`` (pdb's own ``q``) opens none."""
    if error.__traceback__ is not None and not isinstance(error, bdb.BdbQuit):
        header = f"Post-mortem of {type(error).__name__}: {error}\nThe stage fails as you leave pdb (`c` or `q`)."
        WorkerPdb(header).post_mortem(error.__traceback__)


def install() -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` of this worker process open a :class:`WorkerPdb`."""
    sys.breakpointhook = relay_breakpoint
    pdb.set_trace = relay_breakpoint
