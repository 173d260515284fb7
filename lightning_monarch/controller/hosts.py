"""Where the workers run: this host, the hosts of a Monarch job, or a given ``HostMesh``.

Runs on the controller. ``MonarchStrategy(hosts=...)`` takes any of them and the workers are
spawned on the resulting ``HostMesh`` with Monarch's own job layer (``ProcessJob``, ``SlurmJob``,
``KubernetesJob``, or ``attach_to_workers``), never a launcher of ours. Each host gets
``devices`` workers; ``setup_torch_elastic_env`` gives them torchrun's ``RANK``, ``LOCAL_RANK``,
``GROUP_RANK`` (the node) and ``WORLD_SIZE``, which Lightning's DDP on each worker reads.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.actor import HostMesh


def host_mesh(hosts: Any) -> HostMesh:
    """The ``HostMesh`` that ``hosts`` names: a job (its host mesh named ``hosts``) or a
    ``HostMesh``. Without ``hosts``, the workers run on this host (``WorkerMesh.spawn``)."""
    if isinstance(hosts, HostMesh):
        return hosts
    if not callable(getattr(hosts, "state", None)):
        raise MisconfigurationException(
            f"`MonarchStrategy(hosts={type(hosts).__name__}(...))`: give a Monarch job (`monarch.job.ProcessJob`,"
            " `SlurmJob`, `KubernetesJob`, ...), a `HostMesh` (e.g. from `attach_to_workers`), or nothing for this host."
        )
    state = hosts.state(cached_path=None)
    try:
        return state.hosts
    except (AttributeError, KeyError) as error:
        raise MisconfigurationException(
            f"`MonarchStrategy(hosts={type(hosts).__name__}(...))`: the job has no host mesh named 'hosts'. Name it"
            " so (`ProcessJob({'hosts': 2})`), or pass the one to use: `MonarchStrategy(hosts=job.state().<name>)`."
        ) from error


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
