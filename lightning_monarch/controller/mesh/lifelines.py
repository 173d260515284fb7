"""The controller's ends of its workers' lifelines: a worker's death seen on any host within a second.

Runs on the controller, one listener for the process. Each worker process holds one TCP connection
to it (``worker.lifeline``), opened when its mesh attaches it and named by a token: the mesh's
group and the worker's rank (process IDs are not unique across hosts). The end of a connection, by
end of file, a reset or the kernel's keepalive giving up on a host that vanished, means that
worker is dead: its process ended (the kernel closes its sockets at once, wherever it runs) or its
host is gone. ``controller.mesh.watch`` names such a rank among the dead; on this host the process
watch sees a death too, by process ID.

When the controller's process ends, the kernel closes every connection, and each worker ends its
children and itself. A mesh that the controller stops on purpose first stops being watched
(:meth:`Lifelines.forget`), and its connections close as its processes end.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_warn

from lightning_monarch.controller.mesh.hosts import network_address
from lightning_monarch.worker.lifeline import keep_alive, token

#: How long a mesh waits for all its workers' lifelines to be accepted after they connected.
_ACCEPT_S = 10.0


class Lifelines:
    """Runs on the controller, one for the process: the lifeline listener and its connections,
    watched by a thread of its own."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._server: Optional[socket.socket] = None
        self._selector = selectors.DefaultSelector()
        #: Connections held by token, and the tokens whose connection ended while watched, each
        #: with whether it ended silently (the keepalive gave up: the host stopped answering).
        self._held: dict[str, socket.socket] = {}
        self._ended: dict[str, bool] = {}
        self._forgotten: set[str] = set()

    def address(self) -> tuple[str, int]:
        """Where the workers connect: this host's address (:func:`reached_at`) and the listener's
        port (started on first use)."""
        with self._lock:
            if self._server is None:
                self._server = socket.create_server(("", 0))
                self._selector.register(self._server, selectors.EVENT_READ)
                threading.Thread(target=self._serve, name="lightning-monarch-lifelines", daemon=True).start()
            return reached_at(), self._server.getsockname()[1]

    def held_by(self, workers: Any, gather: Callable[[Any], Any], ranks: int) -> str:
        """Have each of the ``ranks`` workers (their actors, ``workers``) hold its lifeline, each
        in a new group, and wait until all are held; returns the group. ``gather`` takes every
        answer of a stream of the workers' answers."""
        group = uuid.uuid4().hex
        host, port = self.address()
        refused = {rank: why for rank, why in gather(workers.hold_lifeline.stream(host, port, group)) if why}
        if refused:
            rank_zero_warn(
                f"Worker ranks {sorted(refused)} could not connect to the controller at {host}:{port}"
                f" ({next(iter(refused.values()))}): their deaths are reported by Monarch's supervision"
                " alone, some 30 s late, and they may outlive this process. Let the workers' hosts reach"
                " this host's ports."
            )
        self._wait(group, [rank for rank in range(ranks) if rank not in refused])
        return group

    def _wait(self, group: str, ranks: list[int]) -> None:
        """Wait until the lifelines of ``ranks`` of ``group`` are held (their workers connected
        already); raise ``TimeoutError`` naming those that are not."""
        tokens = [token(group, rank) for rank in ranks]
        with self._lock:
            if not self._lock.wait_for(lambda: all(t in self._held or t in self._ended for t in tokens), _ACCEPT_S):
                missing = [rank for rank, t in zip(ranks, tokens, strict=True) if t not in self._held]
                raise TimeoutError(f"The lifelines of worker ranks {missing} did not reach the controller.")

    def ended(self, group: str, silently: bool = False) -> list[int]:
        """The ranks of ``group`` whose lifeline ended while watched (``silently``: only those whose
        host stopped answering, not those whose process ended), in rank order."""
        with self._lock:
            return sorted(
                int(t.rsplit(":", 1)[1])
                for t, silent in self._ended.items()
                if t.startswith(group + ":") and (silent or not silently)
            )

    def forget(self, group: str) -> None:
        """Stop watching ``group``: its mesh is being stopped on purpose. Its connections close as
        its processes end (the workers must not end themselves while Monarch stops them)."""
        with self._lock:
            self._forgotten.update(t for t in self._held if t.startswith(group + ":"))
            self._ended = {t: silent for t, silent in self._ended.items() if not t.startswith(group + ":")}

    def _serve(self) -> None:
        """The thread's loop: new connections, their tokens as they arrive, and the ends of those held.
        Nothing here waits on one connection, so a slow or silent one delays no death."""
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._server:
                    assert self._server is not None
                    # a new connection's token arrives in its first bytes (``worker.lifeline.hold``)
                    self._selector.register(self._server.accept()[0], selectors.EVENT_READ, bytearray())
                elif isinstance(key.data, bytearray):
                    self._take_token(key.fileobj, key.data)  # type: ignore[arg-type]
                else:
                    self._check(key.data)

    def _take_token(self, connection: socket.socket, received: bytearray) -> None:
        """A new connection sent bytes: once its token's line is whole, hold it under that token."""
        try:
            chunk = connection.recv(256)
        except OSError:
            chunk = b""
        if not chunk:
            self._selector.unregister(connection)
            connection.close()
            return
        received += chunk
        if b"\n" not in received:
            return
        name = received.split(b"\n", 1)[0].decode().strip()
        keep_alive(connection)
        with self._lock:
            self._held[name] = connection
            self._selector.modify(connection, selectors.EVENT_READ, name)
            self._lock.notify_all()

    def _check(self, name: str) -> None:
        with self._lock:
            connection = self._held.get(name)
            if connection is None:
                return
            silent = False
            try:
                alive = connection.recv(1, socket.MSG_PEEK) != b""
            except TimeoutError:  # the keepalive's probes went unanswered
                alive, silent = False, True
            except OSError:
                alive = False
            if not alive:
                if name in self._forgotten:
                    self._forgotten.discard(name)
                else:
                    self._ended[name] = silent
                del self._held[name]
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(connection)
                connection.close()
                self._lock.notify_all()


def reached_at() -> str:
    """This host as workers on other machines reach it: its IPv4 network address
    (``hosts.network_address``), the one Monarch's TCP transport names the controller by, so that
    a lifeline connects wherever Monarch does (a worker's host may not resolve the controller's
    name: a login node's, for one). The name itself where it has none: every worker is on this
    machine then."""
    return network_address() or socket.gethostname()


#: The process's listener.
LIFELINES = Lifelines()
