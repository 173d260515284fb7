"""Where the workers run: this host, the hosts of a Monarch job, a ``HostMesh``, or worker addresses.

Runs on the controller, at ``Trainer(...)`` time. ``MonarchStrategy(hosts=...)`` takes any of
them and the workers are spawned on the resulting ``HostMesh`` with Monarch's own job layer
(``ProcessJob``, ``SlurmJob``, ``KubernetesJob``, or ``attach_to_workers``), never a launcher of
ours. Each host gets ``devices`` workers; ``controller.mesh.world`` gives them torchrun's ``RANK``,
``LOCAL_RANK``, ``GROUP_RANK`` (the node) and ``WORLD_SIZE``, which Lightning's DDP on each worker
reads.

Everything that can be checked before a job is submitted is checked first (the host mesh's name
and size, a ``SlurmJob``'s options), so that a wrong configuration costs no queue wait. Then the
controller waits for every host to connect and names the addresses that did not.
"""

from __future__ import annotations

import atexit
import ipaddress
import math
import os
import re
import shutil
import socket
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import psutil
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.actor import HostMesh, attach_to_workers, enable_transport
from monarch.job import ProcessJob, SlurmJob

from lightning_monarch._compat import monarch as monarch_compat
from lightning_monarch.controller.mesh.cells import blocks_the_cell
from lightning_monarch.errors import UnreachableHostsError

#: The name of the host mesh the workers run on, in a Monarch job's mesh specification.
HOSTS_MESH = "hosts"
#: The host meshes whose host processes run on this machine with this interpreter, by identity
#: (:func:`runs_here`): a ``ProcessJob``'s, and those of worker addresses served here (:func:`served_here`).
_LOCAL_MESHES: weakref.WeakValueDictionary[int, HostMesh] = weakref.WeakValueDictionary()
#: The kernel namespaces a host process must share with this one to run "here": its processes,
#: network, host name and files are this process's.
_NAMESPACES = ("pid", "net", "uts", "mnt")
#: Each Monarch job's host mesh, as the first ``Trainer`` given the job connected it: ``job.state()``
#: makes a new ``HostMesh`` object each time, and a warm mesh is kept for the same hosts only
#: (``MeshKey`` compares them by identity), so every ``Trainer`` would start new workers.
_JOB_MESHES: weakref.WeakKeyDictionary[Any, HostMesh] = weakref.WeakKeyDictionary()


@blocks_the_cell
def host_mesh(hosts: Any, num_nodes: int, gpus_per_host: int, connect_timeout: float) -> HostMesh:
    """The ``HostMesh`` that ``hosts`` names, connected and checked against ``num_nodes``.

    ``hosts`` is a Monarch job (its host mesh named ``hosts``), a ``HostMesh``, a list of worker
    addresses (``"tcp://node-1:26600"``, each serving ``run_worker_loop_forever``), or a function
    that returns the list (:func:`worker_addresses`).
    ``gpus_per_host`` is ``devices`` for GPU workers and 0 for CPU ones.
    """
    addresses: list[str] = []
    hosts = worker_addresses(hosts) or hosts
    if isinstance(hosts, HostMesh):
        mesh = hosts
    elif is_address_list(hosts):
        addresses = list(hosts)
        if not all(_on_this_machine(address) for address in addresses):
            reached_over_tcp(addresses)
        mesh = attach_to_workers(name=HOSTS_MESH, ca="trust_all_connections", workers=addresses)
        if served_here(addresses):
            _LOCAL_MESHES[id(mesh)] = mesh
    elif callable(getattr(hosts, "state", None)):
        check_job(hosts, num_nodes, gpus_per_host)
        started_here = not hosts.active
        mesh = _job_host_mesh(hosts)
        if isinstance(hosts, ProcessJob):
            _LOCAL_MESHES[id(mesh)] = mesh
        if started_here:
            # Started without a cached state, so no other process can attach to it: release its hosts
            # (a SLURM allocation, a ProcessJob's processes) when this process ends, after the warm
            # mesh stops (``atexit`` runs the later registration, the pool's, first).
            atexit.register(hosts.kill)
        addresses = _job_addresses(hosts)
    else:
        raise MisconfigurationException(
            f"`MonarchStrategy(hosts={type(hosts).__name__}(...))`: give a Monarch job (`monarch.job.ProcessJob`,"
            " `SlurmJob`, `KubernetesJob`, ...), a `HostMesh` (e.g. from `attach_to_workers`), a list of worker"
            " addresses (`['tcp://node-1:26600', ...]`) or a function that returns one, or nothing for this host."
        )
    check_num_nodes(mesh, num_nodes)
    wait_for_hosts(mesh, addresses, connect_timeout)
    return mesh


def runs_here(hosts: Optional[HostMesh]) -> bool:
    """Whether the processes of ``hosts`` run on this machine with this interpreter, so that this
    process's fork server can fork their CPU workers (``controller.mesh.forkserver``): this host
    (``None``), the hosts of a ``ProcessJob``, or worker addresses that are :func:`served_here`. Other
    hosts may be other machines, with interpreters of their own, and start their workers with
    Monarch's bootstrap."""
    return hosts is None or _LOCAL_MESHES.get(id(hosts)) is hosts


def served_here(addresses: Sequence[str]) -> bool:
    """Whether processes of this machine serve every worker address of ``addresses`` (TCP ports of
    this machine) as this one would start them: with this interpreter, in this process's namespaces
    (not a container's or another PID namespace's, whose processes this machine's fork server could
    not stand in for). Linux only: elsewhere, ``False``."""
    if not sys.platform.startswith("linux"):
        return False
    ports = []
    for address in addresses:
        location = _location(address)
        if location is None or location[0] != "tcp" or not location[2].isdigit() or not _on_this_machine(address):
            return False
        ports.append(int(location[2]))
    try:
        listening: dict[int, set[int]] = {}
        for connection in psutil.net_connections("tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.pid is not None:
                listening.setdefault(connection.laddr.port, set()).add(connection.pid)
        return all(any(_runs_like_this_process(pid) for pid in listening.get(port, ())) for port in ports)
    except (psutil.Error, OSError):  # not ours to read, or ended
        return False


def _runs_like_this_process(pid: int) -> bool:
    """Whether process ``pid`` runs this interpreter in this process's namespaces."""
    if any(os.readlink(f"/proc/{pid}/ns/{name}") != os.readlink(f"/proc/self/ns/{name}") for name in _NAMESPACES):
        return False
    command = psutil.Process(pid).cmdline()
    return bool(command) and command[0] == sys.executable


def worker_addresses(hosts: Any) -> Optional[list[str]]:
    """The worker addresses ``hosts`` names now: the list itself, or the list a function given as
    ``hosts`` returns (called again whenever an elastic ``fit`` looks for lost hosts that serve
    again, so that a host that comes back at a new address is found); ``None`` for a Monarch job or
    a ``HostMesh``."""
    current = hosts() if callable(hosts) and not isinstance(hosts, HostMesh) else hosts
    return list(current) if is_address_list(current) else None


def is_address_list(hosts: Any) -> bool:
    """Whether ``hosts`` is a list of worker addresses (``["tcp://node-1:26600", ...]``)."""
    return (
        isinstance(hosts, Sequence)
        and not isinstance(hosts, str)
        and bool(hosts)
        and all(isinstance(address, str) for address in hosts)
    )


def _job_host_mesh(job: Any) -> HostMesh:
    """The job's host mesh named :data:`HOSTS_MESH`: the one it gave before, if it did."""
    if job in _JOB_MESHES:
        return _JOB_MESHES[job]
    state = job.state(cached_path=None)
    try:
        mesh = _JOB_MESHES[job] = getattr(state, HOSTS_MESH)
        return mesh
    except (AttributeError, KeyError) as error:
        raise MisconfigurationException(
            f"`MonarchStrategy(hosts={type(job).__name__}(...))`: the job has no host mesh named 'hosts'. Name it"
            " so (`ProcessJob({'hosts': 2})`), or pass the one to use: `MonarchStrategy(hosts=job.state().<name>)`."
        ) from error


def check_job(job: Any, num_nodes: int, gpus_per_host: int) -> None:
    """Check a Monarch job's specification before it is submitted.

    Monarch's jobs keep their mesh specification (mesh name to host count, or a mesh config on
    Kubernetes); reading it here lets a misnamed or missized host mesh fail before a scheduler
    queue is joined.
    """
    meshes = monarch_compat.job_meshes(job)
    kind = type(job).__name__
    if meshes is not None:
        if HOSTS_MESH not in meshes:
            raise MisconfigurationException(
                f"`MonarchStrategy(hosts={kind}(...))`: the job has no host mesh named 'hosts' (it has"
                f" {sorted(meshes)}). Name it so (`{kind}({{'hosts': {num_nodes}}}, ...)`), or pass the one to use:"
                " `MonarchStrategy(hosts=job.state().<name>)`."
            )
        size = meshes[HOSTS_MESH]
        if isinstance(size, int) and size != num_nodes:
            raise MisconfigurationException(
                f"`Trainer(strategy='monarch', num_nodes={num_nodes})` but `{kind}({{'hosts': {size}}})` asks for"
                f" {size} host(s). Set `num_nodes={size}`, or give the job {num_nodes} hosts."
            )
    if isinstance(job, SlurmJob):
        _check_slurm_job(job, gpus_per_host)


def _check_slurm_job(job: SlurmJob, gpus_per_host: int) -> None:
    """The ``SlurmJob`` options that ``strategy='monarch'`` depends on, read from the job's
    specification (``SlurmJob``'s constructor arguments, kept as attributes)."""
    tasks = monarch_compat.slurm_tasks_per_node(job)
    if tasks != 1:
        raise MisconfigurationException(
            f"`SlurmJob(ntasks_per_node={tasks})`: each node runs one Monarch host process, which"
            " starts the `devices` workers itself; more tasks per node would serve the same port twice. Use"
            " `ntasks_per_node=1` (the default)."
        )
    if gpus_per_host:
        gpus = monarch_compat.slurm_gpus_per_node(job)
        if gpus is None or gpus < gpus_per_host:
            raise MisconfigurationException(
                f"`Trainer(strategy='monarch', accelerator='gpu', devices={gpus_per_host})` runs {gpus_per_host}"
                f" GPU workers per node, but `SlurmJob(gpus_per_node={gpus})` requests"
                f" {'no GPUs' if gpus is None else f'{gpus} GPU(s)'} from SLURM, so the workers would not see"
                f" theirs. Pass `SlurmJob(..., gpus_per_node={gpus_per_host})`."
            )
    missing = [tool for tool in ("sbatch", "squeue") if shutil.which(tool) is None]
    if missing:
        raise MisconfigurationException(
            f"`MonarchStrategy(hosts=SlurmJob(...))` submits and watches the job with SLURM's"
            f" {' and '.join(missing)}, which this machine's PATH does not have. Run the controller on a SLURM"
            " login node or inside an allocation, or use `attach_to_workers` / a list of worker addresses."
        )


def _job_addresses(job: Any) -> list[str]:
    """The workers' addresses of a job whose hosts are known once it runs (``SlurmJob``: its
    allocated hostnames and port; ``ProcessJob``: its host processes' sockets), in the order of its
    hosts; empty otherwise."""
    if isinstance(job, SlurmJob):
        return monarch_compat.slurm_addresses(job)
    if isinstance(job, ProcessJob):
        return monarch_compat.process_job_addresses(job, HOSTS_MESH)
    return []


def known_addresses(hosts: Any) -> Optional[list[str]]:
    """The worker addresses of ``MonarchStrategy(hosts=...)`` by slot, where they are known now:
    the list, what a function returns, a running ``SlurmJob``'s or ``ProcessJob``'s; ``None`` for
    a ``HostMesh`` or another job."""
    if callable(getattr(hosts, "state", None)):
        return _job_addresses(hosts) or None
    return worker_addresses(hosts)


def wait_for_hosts(mesh: HostMesh, addresses: list[str], timeout: float) -> None:
    """Wait until every host of ``mesh`` has connected; after ``timeout`` seconds, raise
    ``UnreachableHostsError`` naming the addresses that do not accept a connection."""
    try:
        mesh.initialized.get(timeout=timeout)
        return
    except TimeoutError:
        pass
    unreachable = [address for address in addresses if not reachable(address)]
    if unreachable:
        detail = (
            f"{len(unreachable)} of {len(addresses)} worker address(es) do not accept a connection:"
            f" {', '.join(unreachable)}."
        )
    elif addresses:
        detail = (
            f"every worker address ({', '.join(addresses)}) accepts a connection, but not every one answered"
            " as a Monarch worker."
        )
    else:
        detail = f"the job's {host_count(mesh)} host(s) did not connect."
    raise UnreachableHostsError(
        f"`MonarchStrategy(hosts=...)`: the workers' hosts did not connect within {timeout:g} s; {detail} Check that"
        " each host runs `monarch.actor.run_worker_loop_forever` (Monarch's job does this) at that address, that"
        " the port is open between this machine and the hosts, or give them longer with"
        " `MonarchStrategy(connect_timeout=...)`."
    )


def reached_over_tcp(addresses: list[str]) -> None:
    """Let hosts on other machines reach this controller: Monarch's TCP transport, on which the
    controller's own actors are named by this machine's host name.

    Monarch starts a process's actors on its local transport (abstract Unix sockets, which only
    this machine's network namespace reaches) unless TCP is chosen before its first call, and a
    process keeps its first transport. Workers at ``addresses`` could then not answer: the attach
    would time out after minutes. Raise with the fix instead, before anything starts.
    """
    name = socket.gethostname()
    if all(_loopback(address) for address in _resolved(name)):
        raise MisconfigurationException(
            f"`MonarchStrategy(hosts=[{addresses[0]!r}, ...])`: hosts on other machines reach this controller by"
            f" its host name, but {name!r} resolves only to loopback addresses here ({', '.join(_resolved(name))}),"
            " which they cannot reach. Map the name to this machine's network address (in /etc/hosts or DNS)."
        )
    try:
        enable_transport("tcp")
    except RuntimeError as error:
        raise MisconfigurationException(
            f"`MonarchStrategy(hosts=[{addresses[0]!r}, ...])`: hosts on other machines reach this controller over"
            " TCP, but Monarch already runs in this process on its local transport (a fit on this machine, or"
            " another Monarch call, came first), and a process keeps its first transport. Train on those hosts"
            " in a new process (in a notebook, restart the kernel), or call"
            " `monarch.actor.enable_transport('tcp')` before anything else uses Monarch."
        ) from error


def _on_this_machine(address: str) -> bool:
    """Whether a worker address is one of this machine's own (loopback, an interface's address, or
    an ``ipc://`` path): hosts in this network namespace, which reach the controller on Monarch's
    local transport."""
    location = _location(address)
    if location is None or location[0] == "ipc":
        return location is not None
    own = {entry.address.split("%")[0] for entries in psutil.net_if_addrs().values() for entry in entries}
    resolved = _resolved(location[1])
    return bool(resolved) and all(_loopback(host) or host in own for host in resolved)


def network_address(family: int = socket.AF_INET) -> Optional[str]:
    """The first address of ``family`` that this machine's host name resolves to and that other
    machines can reach (neither loopback nor link-local): the one Monarch's TCP transport names
    the controller by. ``None`` where there is none."""
    for address in _resolved(socket.gethostname(), family):
        if not (_loopback(address) or ipaddress.ip_address(address).is_link_local):
            return address
    return None


def _resolved(host: str, family: int = socket.AF_UNSPEC) -> list[str]:
    """The addresses ``host`` resolves to, in the resolver's order, each once."""
    try:
        return list(dict.fromkeys(str(info[4][0]) for info in socket.getaddrinfo(host, None, family)))
    except OSError:
        return []


def _loopback(host: str) -> bool:
    return ipaddress.ip_address(host.split("%")[0]).is_loopback


def _location(address: str) -> Optional[tuple[str, str, str]]:
    """The scheme, host and port of a worker address (the path as host for ``ipc://path``). Of
    Monarch's forms (``tcp://h:p``, ``<proc-id>@tcp://h:p``, ``dial_to@bind_to``), the first URL
    is where the controller dials."""
    match = re.search(r"([a-z]+)://([^@\s]+)", address)
    if match is None:
        return None
    scheme, location = match.groups()
    if scheme == "ipc":
        return scheme, location, ""
    host, _, port = location.rpartition(":")
    return scheme, host.strip("[]"), port


def _dial(address: str, timeout: float) -> Optional[Exception]:
    """Dial a worker address (``tcp://host:port``, or the Unix socket of ``ipc://path``): ``None``
    if it accepts a connection, else why not."""
    location = _location(address)
    if location is None:
        return ValueError(f"not a worker address: {address!r}")
    scheme, host, port = location
    try:
        if scheme == "ipc":
            with socket.socket(socket.AF_UNIX) as connection:
                connection.settimeout(timeout)
                connection.connect(host)
        else:
            with socket.create_connection((host, int(port)), timeout=timeout):
                pass
    except (OSError, ValueError) as error:
        return error
    return None


def reachable(address: str, timeout: float = 2.0) -> bool:
    """Whether a worker address accepts a connection."""
    return _dial(address, timeout) is None


def refuses(address: str, timeout: float = 2.0) -> bool:
    """Whether a worker address refuses a connection outright: nothing listens on its port or
    Unix socket (or no socket is at its ``ipc://`` path), so the host process that served it is
    gone. A host that does not answer at all (cut off, or busy) is not known gone."""
    return isinstance(_dial(address, timeout), (ConnectionRefusedError, FileNotFoundError))


@dataclass(frozen=True)
class LostHostCheck:
    """How an elastic ``fit`` tells that a dead worker's host is lost (``StageChannel``): its
    worker address refuses a connection, or it does not serve a new process within ``timeout``
    seconds (``MonarchStrategy(connect_timeout=...)``). ``addresses`` gives the hosts' worker
    addresses now, by slot (``known_addresses``), or ``None`` where they are not known (a
    ``HostMesh``, a job other than ``SlurmJob`` and ``ProcessJob``): then only the timeout tells."""

    timeout: float
    addresses: Callable[[], Optional[list[str]]]

    def refusing(self) -> Callable[[int], bool]:
        """Whether a slot's worker address refuses a connection now, among the addresses the hosts
        have as the check begins (none refuses where they are not known)."""
        addresses = self.addresses() or []
        return lambda slot: slot < len(addresses) and refuses(addresses[slot])


def host_count(mesh: HostMesh) -> int:
    """How many hosts ``mesh`` spans (``this_host()`` is one)."""
    return math.prod(dict(mesh.extent).values())


def check_num_nodes(mesh: HostMesh, num_nodes: int) -> None:
    """``Trainer(num_nodes=...)`` must agree with the hosts the workers run on."""
    count = host_count(mesh)
    if count != num_nodes:
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', num_nodes={num_nodes})` but the workers' host mesh has {count} host(s)."
            f" Set `num_nodes={count}`, or give `MonarchStrategy(hosts=...)` a job with {num_nodes} hosts."
        )
