"""A worker's pdb, relayed to the controller's terminal or notebook: one session at a time.

Runs in the controller's process. :func:`serve_debugger` registers a :class:`DebugRelay` as this
process's Monarch debugger (``debug_controller``) before a stage's workers start: a worker's
``breakpoint()`` (``worker.breakpoints``) finds it there and sends it pdb's reads and writes. The
relay answers each read with a line of the controller's own input: ``input()``, which is the
terminal's stdin in a script and the kernel's input box in a notebook. Ranks that stop at once are
taken one after the other; the others wait in their next collective meanwhile. Without input (stdin
at end of file or closed, a batch job, CI, a notebook client that takes none), a read answers end
of file, and pdb quits there as Python's own does.

The reads run on a thread of their own, as ``input()`` blocks: Monarch's event loop, where the
relay's endpoints run, must go on carrying the stage's other messages meanwhile. The time a
session holds the terminal does not count towards ``MonarchStrategy(step_timeout=...)``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from monarch.actor import Actor, concurrent_endpoint, get_or_spawn_controller

# the door's module itself, not the ``_compat`` package (which holds Lightning's door): both of
# Lightning's namespaces then share this module, its one relay and its sessions (``namespaces``)
import lightning_monarch._compat.monarch as monarch_compat
from lightning_monarch.errors import WorkerError

_LOCK = threading.Lock()
_RELAY: list[Any] = []


@dataclass
class _Sessions:
    """When this process's relay last held a session: the controller's waits for the workers count
    no time that a user spent in pdb (``MonarchStrategy(step_timeout=...)``)."""

    open: bool = False
    ended_at: float = float("-inf")


_SESSIONS = _Sessions()


def waits_counted_from(started: float) -> Optional[float]:
    """When a wait for the workers that began at ``started`` starts counting towards a step timeout:
    then, or at the end of the last pdb session if later; ``None`` while a session is open."""
    return None if _SESSIONS.open else max(started, _SESSIONS.ended_at)


def serve_debugger(timeout: Optional[timedelta]) -> Any:
    """Register this process's :class:`DebugRelay` as its Monarch debugger, once; the relay. Ranks
    that waited for a session of a stage that ended (a worker killed in its session) wait no more
    for the next stage's, whose workers' collectives time out after ``timeout`` (torch's default
    if ``None``): each session says so."""
    with _LOCK:
        if not _RELAY:
            _RELAY.append(get_or_spawn_controller(monarch_compat.DEBUGGER_NAME, DebugRelay).get())
        relay = _RELAY[0]
    relay.new_stage.call_one(timeout).get()
    return relay


def takes_input() -> bool:
    """Whether a user can answer a worker's pdb here: this process's stdin is a terminal, or it runs
    in a Jupyter kernel, whose input box answers ``input()``. Only then do the stage's ranks wait
    for a rank in pdb without a time limit (``worker.pdb_barrier``)."""
    try:
        if sys.stdin is not None and sys.stdin.isatty():
            return True
    except ValueError:  # a closed stdin
        return False
    ipython = sys.modules.get("IPython")
    return getattr(ipython.get_ipython() if ipython is not None else None, "kernel", None) is not None


def quit_in_pdb(error: BaseException) -> bool:
    """Whether ``error`` ended a stage because the user quit a worker's pdb (``q``, or no input): the
    workers are not broken, and stay warm where every rank's stage ended (``worker.breakpoints``)."""
    return isinstance(error, WorkerError) and error.failure.exception_type == "BdbQuit"


class DebugRelay(Actor):
    """Runs in the controller's process: the workers' pdb sessions on this process's input and
    output, one at a time, each introduced with its rank and host. Its endpoints are those Monarch's
    ``PdbWrapper`` calls."""

    def __init__(self) -> None:
        self._turn = asyncio.Lock()
        self._terminal = _Terminal()

    @concurrent_endpoint
    async def new_stage(self, timeout: Optional[timedelta]) -> None:
        """A new stage starts, whose collectives time out after ``timeout``: a session that a dead
        worker left open no longer holds the turn."""
        self._terminal.timeout = timeout
        if self._turn.locked():
            self._turn = asyncio.Lock()
            self._terminal.end()

    @concurrent_endpoint
    async def debugger_session_start(self, rank: int, coords: dict[str, int], hostname: str, actor_name: str) -> None:
        """Rank ``rank`` stopped in pdb: wait for the turn, then introduce its session."""
        await self._turn.acquire()
        self._terminal.begin(rank, hostname)

    @concurrent_endpoint
    async def debugger_session_end(self, actor_name: str, rank: int) -> None:
        """Rank ``rank`` left pdb (``c``, ``q``, or the end of a post-mortem): the next rank's turn."""
        self._terminal.end()
        if self._turn.locked():
            self._turn.release()

    @concurrent_endpoint
    async def debugger_read(self, actor_name: str, rank: int, size: int) -> Any:
        """At most ``size`` bytes of the next line the user types; none at the end of the input."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes] = loop.create_future()

        def read() -> None:
            data = self._terminal.read(size)
            loop.call_soon_threadsafe(answer.set_result, data)

        threading.Thread(target=read, name="lightning-monarch-pdb-input", daemon=True).start()
        return monarch_compat.DebuggerWrite(await answer, None, None)

    @concurrent_endpoint
    async def debugger_write(self, actor_name: str, rank: int, write: Any) -> None:
        """What pdb printed."""
        self._terminal.write(write.payload.decode())


class _Terminal:
    """The controller's input and output as one pdb session sees them: pdb's prompt (the text after
    its last line break) becomes the prompt of ``input()``, so that a notebook shows it beside the
    input box; a line longer than a read is handed out over several."""

    def __init__(self) -> None:
        self._prompt = ""
        self._unread = b""
        self._rank: Optional[int] = None
        #: The process group's timeout of the stage in progress (``None``: torch's default).
        self.timeout: Optional[timedelta] = None

    def begin(self, rank: int, hostname: str) -> None:
        _SESSIONS.open = True
        self._rank, self._prompt, self._unread = rank, "", b""
        limit = _spoken(self.timeout) if self.timeout is not None else "torch's default"
        waits = (
            f"before their next gradient or strategy collective, with no time limit (others time out after {limit}"
            if takes_input()
            else f"up to their collective's timeout ({limit}"
        )
        self._print(
            f"\n[lightning_monarch] pdb on rank {rank} ({hostname}); the other ranks wait {waits},"
            " `MonarchStrategy(timeout=...)`). `c` continues the fit, `q` ends it.\n"
        )

    def end(self) -> None:
        _SESSIONS.open, _SESSIONS.ended_at = False, time.monotonic()
        if self._prompt:
            self._print(self._prompt + "\n")
        self._rank, self._prompt, self._unread = None, "", b""

    def write(self, text: str) -> None:
        text = self._prompt + text
        complete, newline, self._prompt = text.rpartition("\n")
        if newline:
            self._print(complete + newline)

    def read(self, size: int) -> bytes:
        if not self._unread:
            prompt, self._prompt = self._prompt, ""
            try:
                self._unread = (input(prompt) + "\n").encode()
            except Exception as error:  # EOFError, a closed stdin, a notebook client that takes no input
                self._print(
                    f"\n[lightning_monarch] no input for pdb on rank {self._rank} ({type(error).__name__}: the"
                    " controller's stdin is at its end or takes no input): pdb quits, as Python's pdb does at the"
                    " end of its input.\n"
                )
                return b""
        data, self._unread = self._unread[:size], self._unread[size:]
        return data

    @staticmethod
    def _print(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def _spoken(duration: timedelta) -> str:
    """``duration`` as a session's header says it: ``3 s``, ``30 min``."""
    seconds = duration.total_seconds()
    return f"{seconds:g} s" if seconds < 60 else f"{seconds / 60:g} min"
