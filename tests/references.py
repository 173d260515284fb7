"""How the suite runs its references under Lightning's own strategies (``ddp``,
``ModelParallelStrategy``): ``python -m MODULE ARG...`` on every rank, launched as torchrun
launches ranks, each forked from a fork server that imported torch once.

Lightning's own launcher would start rank 0 and have it run its command again for each other
rank, which inside pytest would be pytest itself, so a reference runs in processes of its own.
Started here, every rank gets ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``, the variables Lightning's launcher gives the ranks it starts; Lightning's
``LightningEnvironment`` then takes the processes as created externally (as under torchrun or
SLURM) and starts none. The strategy, its process group and every step are Lightning's own.

Each rank is forked, ready imported, from a fork server (``worker/forkserver.py``, the one that
forks the workers) instead of importing torch afresh: a rank started afresh spends about 5 of its
CPU-seconds importing. The server imports only libraries that read no rank variable at import;
Lightning and torchmetrics, which set their ``rank_zero_only`` from ``LOCAL_RANK`` when imported,
are imported by each rank after the fork, as by a rank started afresh. Off Linux, each rank is a
new interpreter.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from typing import Any, Optional

from lightning_monarch.controller.mesh.forkserver import ForkServerProcess
from tests.served_hosts import ROOT

#: What the references' fork server imports: torch and the heavy libraries Lightning imports,
#: none of which reads a rank variable at import.
PRELOADED = ("torch", "torch.distributed", "torch._dynamo", "numpy", "scipy.signal", "matplotlib.pyplot", "pandas")

_SERVER: list[ForkServerProcess] = []


def environment() -> dict[str, str]:
    """The references' environment: this process's, with the repository root importable."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _server(env: dict[str, str]) -> Optional[ForkServerProcess]:
    """The fork server that imported :data:`PRELOADED` in ``env``, started if need be; ``None``
    off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    if _SERVER and not _SERVER[0].current(env):
        _SERVER.pop().stop()
    if not _SERVER:
        _SERVER.append(ForkServerProcess(PRELOADED, env))
    return _SERVER[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_reference(
    module: str, *arguments: Any, processes: int, timeout: float = 300, peers_may_fail: bool = False
) -> None:
    """Run ``python -m module arguments`` on ``processes`` ranks, from the repository root, and
    wait for every rank; raise if one fails (the others are then killed) or if they take longer
    than ``timeout`` seconds. ``processes`` must be the world size the module's Trainer asks for.

    With ``peers_may_fail``, for a run that fails on purpose, only rank 0 is waited for and must
    succeed: its failure leaves the other ranks in a collective that then fails, and they are
    killed once rank 0 has ended, as Lightning's launcher kills the ranks it started.
    """
    env = environment()
    server = _server(env)
    command = ["tests.rank", module, *map(str, arguments)]  # with the threads Lightning's launcher gives
    launched = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "NODE_RANK": "0"}
    launched["WORLD_SIZE"] = str(processes)
    ranks = []
    try:
        for rank in range(processes):
            variables = {**launched, "LOCAL_RANK": str(rank)}
            if server is None:
                started = subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, env={**env, **variables})
            else:
                started = subprocess.Popen(
                    [sys.executable, *server.start_arguments(variables, command)], cwd=ROOT, env=env
                )
            ranks.append(started)
        _wait(ranks[:1] if peers_may_fail else ranks, command, timeout)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()


def _wait(ranks: list[subprocess.Popen], command: list[str], timeout: float) -> None:
    """Wait for every rank to end; raise at the first that failed, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = next(((index, code) for index, code in enumerate(codes) if code not in (None, 0)), None)
        if failed is not None:
            raise subprocess.CalledProcessError(failed[1], ["python", "-m", *command, f"(rank {failed[0]})"])
        if None not in codes:
            return
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(["python", "-m", *command], timeout)
        time.sleep(0.05)


def stop_server() -> None:
    """Stop the references' fork server."""
    while _SERVER:
        _SERVER.pop().stop()


atexit.register(stop_server)
