"""The controller's interpreter exit: Monarch's actor threads have ended before Python finalizes.

Runs on the controller, at interpreter exit (``controller.install`` calls :func:`guard` once).

Why: a process that used Monarch as a client holds daemon threads of Monarch's (its event loop and
an actor's driver, ``_compat.monarch.ACTOR_THREADS``) that wait in Rust calls without the GIL. Monarch's last exit
handler, ``shutdown_tokio_runtime``, stops its runtimes and gives them 250 ms to end. A thread that
is not scheduled in that window (a loaded machine) returns into Python after finalization began;
CPython then ends it with ``pthread_exit``, whose forced unwind the Rust binding's panic catcher
swallows, and glibc aborts the process: ``FATAL: exception not rethrown``, exit code 134, after a
correct fit. ``docs/fault-tolerance.md`` gives the reproduction for an upstream report.

What :func:`guard` does: its handler runs before Monarch's runtime handler whatever the order in
which ``monarch`` and ``lightning_monarch`` were imported (it is registered after Monarch's bindings
registered theirs, and exit handlers run last-registered first), and takes that handler's place: it
shuts the Monarch client down (what Monarch's first handler does; a second call does nothing), runs
Monarch's runtime handler, then waits for the actor threads, at most :data:`THREADS_WAIT_S` in all.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

from lightning_monarch._compat import monarch as monarch_compat

log = logging.getLogger(__name__)

#: The longest the controller's exit waits for Monarch's actor threads after Monarch's own handlers.
THREADS_WAIT_S = 2.0

_guarded = False


def guard() -> None:
    """Register :func:`end_monarch` to run at interpreter exit, once per process; Monarch's
    bindings must have been imported (``controller.install`` imported ``monarch.actor``)."""
    global _guarded
    if not _guarded:
        atexit.register(end_monarch)
        _guarded = True


def _actor_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name in monarch_compat.ACTOR_THREADS]


def end_monarch() -> None:
    """At exit: nothing when Monarch never started a client here; else the client shut down, then
    Monarch's runtime handler (unregistered, so that it runs once), then the actor threads joined."""
    if not _actor_threads():
        return
    runtime_exit = monarch_compat.runtime_exit_handler()
    if runtime_exit is not None:
        atexit.unregister(runtime_exit)
    try:
        from monarch.actor import shutdown_context

        shutdown_context(host_timeout=0.3).get(timeout=1.0)  # as Monarch's own first exit handler
    except Exception as error:  # the runtime's handler and the wait below still run
        log.debug("Monarch's client shutdown at exit: %s", error)
    finally:
        if runtime_exit is not None:
            runtime_exit()
    deadline = time.monotonic() + THREADS_WAIT_S
    for thread in _actor_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [thread.name for thread in _actor_threads()]
    if left:
        log.warning(
            "Monarch's threads %s were still running %.0f s after its shutdown at exit; if the process "
            "aborts with 'FATAL: exception not rethrown', the fit's results are complete",
            left,
            THREADS_WAIT_S,
        )
