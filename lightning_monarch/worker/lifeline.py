"""A worker process's lifeline to its controller: the worker ends when the controller does.

Runs in each worker process. The worker holds one TCP connection to its controller's lifeline
listener (``controller.mesh.lifelines``), opened when the controller attaches it and never written
to afterwards. When the controller's process ends in any way (SIGKILL, a closed notebook kernel,
the OOM killer), its kernel closes the connection and this worker sees the end of it at once; a
controller's host that vanishes without a word is seen by the kernel's keepalive within seconds.
The worker then ends its own children (DataLoader worker processes) and itself, so that no process
of the run is left holding a GPU. A process stopped in a debugger still answers keepalive probes:
liveness here is the process's, not its progress.

Forked children close their copy of the connection (``os.register_at_fork``), so that neither
side's end is kept open by a DataLoader worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

import psutil

#: TCP keepalive on a lifeline: probes after this many idle seconds, one a second, and the peer is
#: gone after this many unanswered ones; a host cut off without a word is seen within some 4 s.
KEEPALIVE = (2, 1, 2)


def token(group: str, rank: int) -> str:
    """What names the lifeline of worker ``rank`` of the mesh ``group`` (``controller.mesh.lifelines``)."""
    return f"{group}:{rank}"


def keep_alive(connection: socket.socket) -> None:
    """Turn on :data:`KEEPALIVE` on ``connection`` (both ends of a lifeline)."""
    idle, interval, count = KEEPALIVE
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, option):
            connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def hold(host: str, port: int, token: str) -> None:
    """Connect to the controller's lifeline listener at ``host:port`` as ``token`` (which names this
    worker there), and end this process and its children when the connection ends."""
    connection = socket.create_connection((host, port), timeout=30)
    keep_alive(connection)
    connection.sendall(token.encode() + b"\n")
    connection.settimeout(None)
    os.register_at_fork(after_in_child=connection.close)
    threading.Thread(target=_watch, args=(connection,), name="lightning-monarch-lifeline", daemon=True).start()


def _watch(connection: socket.socket) -> None:
    """Wait for the end of the connection (the controller never writes to it), then end the process."""
    with contextlib.suppress(OSError):
        while connection.recv(1):
            pass
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    os.kill(os.getpid(), signal.SIGKILL)  # at once: no exit handler may wait on the dead controller
