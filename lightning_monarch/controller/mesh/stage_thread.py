"""Work that other threads hand to the thread that runs the stage, done while it waits for the workers.

Runs on the controller. Drawing an item of a fed iterable (``controller.mesh.feed``) sets the
process's global random number generators to the asking rank's states for the length of the
draw. Done on Monarch's actor thread, a draw of the user's code on the stage's thread (a callback,
the loop) at that moment would take the rank's numbers, and the rank would take the user's. Here
the draw is handed to the stage's thread, which does it between two polls of the workers'
answers (``WorkerMesh``'s waits call :meth:`StageThreadWork.serve`): no other code of the
stage's thread runs meanwhile, so the two cannot overlap, whatever the timing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: How long the stage's thread waits for the workers between two turns at the work handed to it,
#: while some may be: a fed item waits at most this long for the thread to be free.
BUSY_POLL_S = 0.002


@dataclass
class _Work:
    do: Callable[[], Any]
    refused: Callable[[], Any]
    value: Any = None
    done: threading.Event = field(default_factory=threading.Event)


class StageThreadWork:
    """The work handed to the stage's thread, for as long as a stage may hand it some."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[_Work] = deque()
        #: How many stages may hand work now (``open`` to ``close``).
        self._open = 0
        #: The thread that opened the first of them: the one that does the work.
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """A stage run by this thread may hand work from now on (its fed iterables are served)."""
        with self._lock:
            if not self._open:
                self._thread = threading.current_thread()
            self._open += 1

    def close(self) -> None:
        """That stage hands no more: work still waiting gets its ``refused`` value once none may."""
        with self._lock:
            self._open -= 1
            left = list(self._queue) if not self._open else []
            if left:
                self._queue.clear()
        for work in left:
            work.value = work.refused()
            work.done.set()

    def run(self, do: Callable[[], Any], refused: Callable[[], Any]) -> Any:
        """From another thread: ``do()``'s value, done on the stage's thread at its next wait; or
        ``refused()``'s where no stage may hand work, or the stage ends before it is done."""
        work = _Work(do, refused)
        with self._lock:
            if not self._open:
                return refused()
            self._queue.append(work)
        work.done.wait()
        return work.value

    def serve(self) -> None:
        """On the stage's thread, while it waits for the workers: do the work handed to it (on any
        other thread that waits for workers, an asynchronous validation's: nothing)."""
        if threading.current_thread() is not self._thread:
            return
        while True:
            with self._lock:
                if not self._queue:
                    return
                work = self._queue.popleft()
            try:
                work.value = work.do()
            except BaseException:
                work.value = work.refused()
                raise
            finally:
                work.done.set()

    def poll_s(self, idle: float) -> float:
        """How long this thread may wait for the workers between two turns: ``idle`` where no work
        may come to it."""
        return BUSY_POLL_S if self._open and threading.current_thread() is self._thread else idle


#: This process's one.
STAGE_THREAD = StageThreadWork()
