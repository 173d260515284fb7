"""Monarch hosts served at TCP addresses of this machine, as cluster nodes serve them: for the tests
of ``MonarchStrategy(hosts=[...])`` and the elastic benchmark; and the host processes of a ``ProcessJob``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Optional

import psutil

from lightning_monarch.controller.mesh.forkserver import is_start_process, is_worker_process
from lightning_monarch.controller.mesh.hosts import reachable

ROOT = Path(__file__).resolve().parent.parent


def closed_port() -> int:
    """A TCP port of this machine that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServedHost:
    """A Monarch host serving at a TCP address of this machine, as ``run_worker_loop_forever``
    does on a cluster node (or, with ``notices``, ``lightning-monarch serve``, which takes SIGTERM
    as a preemption notice): in a session of its own, so that :meth:`stop` ends it and every worker
    process it started, by its process ID; :meth:`start` serves again at the same address after a
    stop. ``python`` and ``env`` are the host's interpreter and environment (this process's by
    default)."""

    def __init__(
        self, python: str = sys.executable, env: Optional[dict[str, str]] = None, notices: bool = False
    ) -> None:
        self.address = f"tcp://127.0.0.1:{closed_port()}"
        self._python, self._env, self._notices = python, env, notices
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        """Serve, and wait until the address accepts a connection; raise after 30 s without one."""
        self.stop()
        self.process = subprocess.Popen(self._command(), cwd=ROOT, env=self._env, start_new_session=True)
        self._connect(self.process.pid)
        deadline = time.monotonic() + 30
        while not reachable(self.address):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"The host at {self.address} did not serve within 30 s: {self._command()}")
            time.sleep(0.1)

    def _connect(self, pid: int) -> None:
        """Connect the just started host process ``pid`` to this machine: it shares its network."""

    def _command(self) -> list[str]:
        if self._notices:
            return [self._python, "-m", "lightning_monarch", "serve", self.address]
        return [
            self._python,
            "-c",
            "from monarch.actor import run_worker_loop_forever;"
            f" run_worker_loop_forever(address={self.address!r}, ca='trust_all_connections')",
        ]

    def worker_processes(self) -> list[psutil.Process]:
        """The worker processes this host started and all their descendants (DataLoader workers,
        the fork server that starts them), as this machine sees them. A host served here with this
        interpreter (``hosts.served_here``) starts ``start`` processes instead, and the controller's
        fork server forks their workers, which take the ``start`` process's output pipes."""
        if self.process is None:
            return []
        with suppress(psutil.NoSuchProcess):
            started = psutil.Process(self.process.pid).children(recursive=True)
            pipes = {_output(child) for child in started if _is_start(child)} - {None}
            workers = [child for child in started if _is_worker(child)]
            if pipes:
                workers += [
                    process for process in psutil.process_iter() if _output(process) in pipes and _is_worker(process)
                ]
            return [*workers, *(child for worker in workers for child in _descendants(worker))]
        return []

    def stop(self) -> None:
        if self.process is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class HiddenHost(ServedHost):
    """A served host that the controller cannot see, as a second machine would be: ``lightning-monarch
    serve`` in UTS and PID namespaces of its own, with the host name ``name`` (one that resolves
    to this machine: ``getent hosts NAME``). The controller can neither share its host name nor see
    its processes by their IDs. Needs ``unshare`` and root (:func:`hiding_refused`)."""

    def __init__(self, name: str, env: Optional[dict[str, str]] = None) -> None:
        super().__init__(env=env, notices=True)
        self.name = name

    def _command(self) -> list[str]:
        serve = " ".join(super()._command())
        unshare = ["unshare", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
        return [*unshare, "bash", "-c", f"hostname {self.name} && exec {serve}"]


class NetworkHost(HiddenHost):
    """A hidden host across a network, as another machine is: also in network and mount namespaces
    of its own, joined to this one by a veth pair (this side ``10.A.B.1``, the host's ``10.A.B.2``,
    from the port). Its ``/etc/hosts`` names itself, and :meth:`controller` runs a controller whose
    host name resolves to this side's address, as a cluster node's resolves to its network address
    (Monarch names a controller's actors by the address its host name resolves to). :meth:`cut` takes
    the link down: the host vanishes without a word, no FIN and no RST (stopping its processes
    would not do: the kernel would still answer). Needs ``ip`` too (:func:`network_refused`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        port = int(self.address.rsplit(":", 1)[1])
        subnet = f"10.{port // 256 % 256}.{port % 256}"
        self.ours, self.theirs = f"{subnet}.1", f"{subnet}.2"
        self.link = f"lm{port}"
        self.address = f"tcp://{self.theirs}:{port}"
        #: The ``/etc/hosts`` of the host, which does not name the controller (a cluster's DNS may
        #: not know a login node), and of its controller (removed with this object).
        self._directory = tempfile.TemporaryDirectory(prefix="network-host-")
        self._names = Path(self._directory.name) / "host"
        self._names.write_text(f"127.0.0.1 localhost\n{self.theirs} {name}\n")
        self._controller_names = Path(self._directory.name) / "controller"
        self._controller_names.write_text(
            f"127.0.0.1 localhost\n{self.theirs} {name}\n{self.ours} {socket.gethostname()}\n"
        )

    def _command(self) -> list[str]:
        serve = " ".join(ServedHost._command(self))
        peer = f"{self.link}p"
        setup = (
            f"until ip link show {peer} >/dev/null 2>&1; do sleep 0.05; done"
            f" && ip link set lo up && ip addr add {self.theirs}/30 dev {peer} && ip link set {peer} up"
            f" && ip route add default via {self.ours} && mount --bind {self._names} /etc/hosts"
            f" && hostname {self.name} && exec {serve}"
        )
        unshare = ["unshare", "--uts", "--pid", "--net", "--mount", "--fork", "--kill-child", "--mount-proc"]
        return [*unshare, "bash", "-c", setup]

    def _connect(self, pid: int) -> None:
        """Make the link and hand its far end to the host's network namespace, where the host's
        shell waits for it (``unshare`` itself, ``pid``, joined that namespace). ``pid`` may not have
        made its namespace yet (``Popen`` returns once it runs, and a loaded machine may not schedule
        it): handing the end over then would leave it here, and the host would wait for it forever."""
        _own_network(pid)
        _ip("link", "add", self.link, "type", "veth", "peer", "name", f"{self.link}p")
        _ip("link", "set", f"{self.link}p", "netns", str(pid))
        _ip("addr", "add", f"{self.ours}/30", "dev", self.link)
        _ip("link", "set", self.link, "up")

    def controller(self, command: list[str]) -> list[str]:
        """``command`` as a controller of this host runs it: with its host name resolving to this
        side of the link, as a cluster node's resolves to its network address."""
        bind = f"mount --bind {self._controller_names} /etc/hosts"
        return ["unshare", "--mount", "bash", "-c", f'{bind} && exec "$@"', "controller", *command]

    def cut(self) -> None:
        """Take the link down: from now on, nothing the host sends arrives, and nothing is answered."""
        _ip("link", "set", self.link, "down")

    def stop(self) -> None:
        super().stop()
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)


def _own_network(pid: int) -> None:
    """Wait until process ``pid`` is in a network namespace other than this process's; raise after
    30 s, or where it ends first."""
    ours, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + 30
    while os.readlink(f"/proc/{pid}/ns/net") == ours:
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} made no network namespace of its own within 30 s")
        time.sleep(0.01)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def network_refused() -> Optional[str]:
    """Why this machine cannot run a :class:`NetworkHost`, or ``None``."""
    if hiding_refused() is not None:
        return hiding_refused()
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "bash", "-c", "ip link add lmprobe type veth peer name lmprobep"],
        capture_output=True,
        text=True,
    )
    return f"no network namespace with a veth pair here: {probe.stderr.strip()}" if probe.returncode else None


def hiding_refused() -> Optional[str]:
    """Why this machine cannot run a :class:`HiddenHost`, or ``None``."""
    if shutil.which("unshare") is None:
        return "no `unshare` here"
    probe = subprocess.run(
        ["unshare", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc", "hostname", "probe"],
        capture_output=True,
        text=True,
    )
    return f"`unshare` is refused: {probe.stderr.strip()}" if probe.returncode else None


def _descendants(process: psutil.Process) -> list[psutil.Process]:
    with suppress(psutil.NoSuchProcess):
        return process.children(recursive=True)
    return []


def _is_start(process: psutil.Process) -> bool:
    with suppress(psutil.Error):
        return is_start_process(process)
    return False


def _output(process: psutil.Process) -> Optional[tuple[str, str]]:
    """What the standard output and error of ``process`` are (``pipe:[INODE]``), if readable."""
    with suppress(OSError):
        return os.readlink(f"/proc/{process.pid}/fd/1"), os.readlink(f"/proc/{process.pid}/fd/2")
    return None


def _is_worker(process: psutil.Process) -> bool:
    with suppress(psutil.NoSuchProcess):
        return is_worker_process(process)
    return False


def process_job_host(index: int) -> int:
    """The process ID of host ``index`` of the ``ProcessJob`` that this process started: Monarch
    names each host process's address after its host, ``.../hosts_<index>``. (Its workers' parent
    is the fork server they were forked from, not their host.)"""
    found = [
        child.pid
        for child in psutil.Process().children()
        if any("run_worker_loop_forever" in part and f"/hosts_{index}'" in part for part in child.cmdline())
    ]
    assert len(found) == 1, f"{len(found)} ProcessJob host processes named hosts_{index}"
    return found[0]
