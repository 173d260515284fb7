"""The worker fork server: worker processes forked from one that has imported torch and Lightning.

Runs as a script on the controller's host, in two roles, and imports only the standard library
until it serves (it must not start Monarch: its runtime's threads would not survive a fork):

- ``serve``: the fork server. Started by the controller (``controller.mesh.forkserver``), it
  imports torch and the workers' Lightning package once, then waits. Each request forks a child
  that becomes the worker: it takes the requester's standard streams, environment, directory and
  process group, and runs Monarch's proc bootstrap (``monarch._src.actor.bootstrap_main``) as
  ``python -m`` would. The server reaps each child and reports how it ended.
- ``start``: what Monarch runs for each worker process (the mesh's bootstrap command), under
  ``python -S``. It hands its streams to the server, forwards the signals it gets to the child,
  and ends as the child ended: with its exit code, or killed by its signal. Monarch watches and
  stops this process as it would the worker itself. If the server is gone, or refuses (its
  imports saw another environment than this process has), it becomes the worker itself instead,
  by running Monarch's bootstrap in a new interpreter. It can run another module than Monarch's
  bootstrap, with ``NAME=VALUE`` variables of the child's own, as ``env NAME=VALUE python -m
  MODULE ARG...`` would: the test suite starts the ranks of its Lightning references so.

Why: a worker that imports torch and Lightning itself spends about 5 CPU-seconds before it runs
anything (measured on this project's 2-core machines), and every new mesh, recovery and elastic
change starts new ones. A forked one starts in a fraction of a second and shares the imported
modules' memory with the server until it writes to them.

Nothing outlives its owner: the server dies with the controller (``PR_SET_PDEATHSIG``), each child
with the server, and a child whose ``start`` process ended (killed, or stopped by Monarch) is
killed. The listening address is an abstract Unix socket, so no file is left behind either.
Linux only; elsewhere the controller uses Monarch's own bootstrap.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import struct
import sys
from typing import Any, Optional

#: The module Monarch's bootstrap command runs (``python -m``) in each process of a proc mesh.
BOOTSTRAP_MODULE = "monarch._src.actor.bootstrap_main"
#: Variables that change while a controller runs and that no import of the server's reads: those
#: Monarch sets for each process it launches (and for each host process of a ``ProcessJob``; the
#: channel of a process's log forwarder, where a mesh forwards its output: ``WorkerOutput``),
#: pytest's name of the running test, those Lightning's ``seed_everything`` sets (which Lightning
#: reads only when it seeds), the notice file of a host served by ``lightning-monarch serve``
#: (``host.NOTICE_VARIABLE``, read by a worker only when it looks for a notice), cuBLAS's workspace
#: setting, which Lightning's ``Trainer(deterministic=True)`` sets (read by cuBLAS when a GPU
#: process makes its handle; a forked worker runs on the CPU), and the terminal's size, which GNU
#: readline exports when a controller initializes it (through the C library, so ``os.environ`` and
#: the processes started from it do not have them, while Monarch's do).
NOT_READ_AT_IMPORT = frozenset(
    {
        "COLUMNS",
        "CUBLAS_WORKSPACE_CONFIG",
        "LINES",
        "BOOTSTRAP_LOG_CHANNEL",
        "HYPERACTOR_MESH_BOOTSTRAP_MODE",
        "HYPERACTOR_PROCESS_NAME",
        "LIGHTNING_MONARCH_NOTICE_FILE",
        "MONARCH_CLIENT_TRACE_ID",
        "_MONARCH_WORKER_ADDR",
        "PYTEST_CURRENT_TEST",
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
    }
)
#: The signals a ``start`` process passes on to its worker (SIGKILL and SIGSTOP cannot be caught:
#: the server kills a worker whose ``start`` process is gone).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: The standard streams a worker takes from its ``start`` process.
STREAMS = (0, 1, 2)
_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("!I")


def comparable_environment(environ: Any) -> dict[str, str]:
    """``environ`` without :data:`NOT_READ_AT_IMPORT`: what the server's imports may have read."""
    return {name: value for name, value in environ.items() if name not in NOT_READ_AT_IMPORT}


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent ``parent`` ends; end now if it has."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)


def _send(connection: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(message).encode()
    socket.send_fds(connection, [_HEADER.pack(len(body))], list(fds))
    connection.sendall(body)


def _receive(connection: socket.socket, max_fds: int = 0) -> tuple[Optional[dict[str, Any]], list[int]]:
    """The next message and the descriptors that came with it; ``None`` at end of stream."""
    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, max_fds)
    if len(header) < _HEADER.size:
        return None, fds
    (size,) = _HEADER.unpack(header)
    body = b""
    while len(body) < size:
        chunk = connection.recv(size - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


class ForkServer:
    """Runs in the fork server process: accepts requests, forks workers, reaps them."""

    def __init__(self, address: str, ready: int, preload: list[str]) -> None:
        """Listen at ``address``, say so on the descriptor ``ready``, then import ``preload``:
        requests made meanwhile wait for the imports."""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(address)
        self._listener.listen(64)
        os.write(ready, b"1")
        os.close(ready)
        for module in preload:
            __import__(module)
        import gc

        gc.freeze()  # the imported modules' objects stay shared with every child
        self._environment = comparable_environment(os.environ)
        self._directory = os.getcwd()
        self._unsafe = _fork_unsafe()
        #: Each running child's start process, by the child's process ID.
        self._children: dict[int, socket.socket] = {}
        self._selector = selectors.DefaultSelector()
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)
        signal.set_wakeup_fd(self._wakeup_write)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def serve(self) -> dict[str, Any]:
        """Serve until the controller ends this process; returns only in a forked child, with the
        request it is to become the worker of."""
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wakeup_read, selectors.EVENT_READ)
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._listener:
                    connection, _ = self._listener.accept()
                    request = self._fork(connection)
                    if request is not None:
                        return request
                elif key.fileobj == self._wakeup_read:
                    os.read(self._wakeup_read, 4096)
                    self._reap()
                else:  # a start process ended before its worker: kill the worker
                    ended = key.fileobj
                    assert isinstance(ended, socket.socket)
                    self._selector.unregister(ended)
                    for pid, owner in self._children.items():
                        if owner is ended:
                            _kill(pid)

    def _fork(self, connection: socket.socket) -> Optional[dict[str, Any]]:
        """Fork a worker for the request on ``connection``; the request in the child, else ``None``."""
        request, fds = _receive(connection, len(STREAMS))
        refusal = self._refusal(request, fds)
        if refusal is not None:
            _send(connection, {"refused": refusal})
            connection.close()
            for fd in fds:
                os.close(fd)
            return None
        assert request is not None
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._become_child(server, fds)
            return request
        for fd in fds:
            os.close(fd)
        self._children[pid] = connection
        self._selector.register(connection, selectors.EVENT_READ)
        try:
            _send(connection, {"pid": pid})
        except OSError:  # its start process is gone already; the selector says so next
            pass
        return None

    def _refusal(self, request: Optional[dict[str, Any]], fds: list[int]) -> Optional[str]:
        """Why a worker for ``request`` cannot be forked from this process, if it cannot."""
        if request is None or len(fds) != len(STREAMS):
            return "the request was incomplete"
        if self._unsafe is not None:
            return self._unsafe
        if comparable_environment(request["environment"]) != self._environment:
            return "the environment changed since the fork server imported its modules"
        if request["directory"] != self._directory:
            return "the working directory changed since the fork server imported its modules"
        return None

    def _become_child(self, server: int, fds: list[int]) -> None:
        """In the forked child of ``server``: nothing of the server's, the requester's streams."""
        die_with_parent(server)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self._selector.close()
        self._listener.close()
        os.close(self._wakeup_read)
        os.close(self._wakeup_write)
        for connection in self._children.values():
            connection.close()
        for stream, fd in zip(STREAMS, fds, strict=True):
            os.dup2(fd, stream)
            os.close(fd)

    def _reap(self) -> None:
        """Report each child that ended to its start process."""
        while self._children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self._children.pop(pid, None)
            if connection is None:
                continue
            if connection in self._selector.get_map():
                self._selector.unregister(connection)
            try:
                _send(connection, {"status": status})
            except OSError:  # its start process ended first
                pass
            connection.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _fork_unsafe() -> Optional[str]:
    """Why this process may not fork a worker after its imports, if it may not: a GPU runtime
    started before the fork cannot be used by the child."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the fork server's imports initialized CUDA"
    with open("/proc/self/maps") as maps:
        if "libcuda.so" in maps.read():
            return "the fork server's imports loaded the CUDA driver"
    return None


def become_worker(request: dict[str, Any]) -> None:
    """In a forked child: the requester's environment (with its own variables), directory and
    process group, then its module (Monarch's proc bootstrap unless it asked for another), as
    ``python -m`` runs it (this returns when the worker's process ends)."""
    import runpy

    os.environ.clear()
    os.environ.update(request["environment"])
    os.environ.update(request["variables"])
    os.chdir(request["directory"])
    try:
        os.setpgid(0, request["process_group"])
    except OSError:  # the requester's group is in another session: keep the server's
        pass
    sys.path.insert(0, request["directory"])  # as ``python -m`` puts it first
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # as its import seeds it in a process of its own
        numpy.random.seed()
    sys.argv = [sys.argv[0], *request["arguments"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def start(address: str, variables: dict[str, str], command: list[str]) -> None:
    """The ``start`` role: have the server fork this process's worker, which runs ``command``
    (``MODULE ARG...``, Monarch's bootstrap if empty) with ``variables`` set, and end as it ends;
    or become the worker here if the server cannot."""
    die_with_parent(os.getppid())  # as Monarch's bootstrap has each process die with its host's
    module, *arguments = command or [BOOTSTRAP_MODULE]
    request = {
        "environment": dict(os.environ),
        "variables": variables,
        "directory": os.getcwd(),
        "process_group": os.getpgid(0),
        "module": module,
        "arguments": arguments,
    }
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
        _send(connection, request, STREAMS)
        reply, _ = _receive(connection)
    except OSError:
        reply = None
    if reply is None or "pid" not in reply:
        connection.close()
        os.environ.update(variables)
        os.execv(sys.executable, [sys.executable, "-m", module, *arguments])
    worker = reply["pid"]

    def forward(signum: int, frame: Any) -> None:
        try:
            os.kill(worker, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    ended, _ = _receive(connection)
    if ended is None:  # the server is gone, and its children with it
        sys.exit(f"lightning_monarch: the fork server of worker {worker} ended before it")
    status = ended["status"]
    if os.WIFSIGNALED(status):
        killed_by = os.WTERMSIG(status)
        if killed_by != signal.SIGKILL:  # the one signal whose handler cannot be set (nor need be)
            signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    sys.exit(os.waitstatus_to_exitcode(status))  # (-N after a signal that did not end this process)


def main() -> None:
    """``forkserver.py serve ADDRESS PARENT READY_FD MODULE...`` (the modules to import), or
    ``forkserver.py start ADDRESS [NAME=VALUE...] [-m MODULE [ARG...]]``."""
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # a script's directory is not on a worker's path (this package's modules)
    role, address = sys.argv[1], "\0" + sys.argv[2]
    if role == "start":
        rest = sys.argv[3:]
        split = rest.index("-m") if "-m" in rest else len(rest)
        variables = dict(assignment.split("=", 1) for assignment in rest[:split])
        start(address, variables, rest[split + 1 :])
        return
    die_with_parent(int(sys.argv[3]))
    os.setpgid(0, 0)  # a terminal's Ctrl-C goes to the controller, not here
    request = ForkServer(address, int(sys.argv[4]), sys.argv[5:]).serve()
    become_worker(request)


if __name__ == "__main__":
    main()
