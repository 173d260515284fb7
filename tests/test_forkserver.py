"""CPU workers on the controller's host are forked from a fork server that imported torch and
Lightning once (``controller/mesh/forkserver.py``, ``worker/forkserver.py``), and start as a worker
that Monarch's own bootstrap started would: the same environment, path, arguments, directory and
main module, and NumPy generators of their own. Real meshes on this host, side by side: one forked,
one started by Monarch's bootstrap (a ``HostMesh`` given explicitly, as for other hosts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

import psutil
import pytest
from monarch.actor import this_host
from monarch.job import ProcessJob

from lightning_monarch.controller.mesh import forkserver
from lightning_monarch.controller.mesh.hosts import host_mesh
from lightning_monarch.controller.mesh.output import WorkerOutput
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.host import NOTICE_VARIABLE
from lightning_monarch.worker.forkserver import NOT_READ_AT_IMPORT
from tests.conftest import probe_workers
from tests.served_hosts import process_job_host

#: Variables that differ from mesh to mesh: the run ID its start-up sets (``worker.process``) and
#: the port of its process group (``controller.mesh.world``).
PER_MESH_VARIABLES = frozenset({"TORCHELASTIC_RUN_ID", "MASTER_PORT"})
#: The Lightning package of this namespace's workers, whose fork servers these tests start.
PACKAGE = "lightning.pytorch"


def _comparable(start: dict[str, Any]) -> dict[str, Any]:
    environment = {
        name: value
        for name, value in start["environment"].items()
        if name not in NOT_READ_AT_IMPORT | PER_MESH_VARIABLES
    }
    return {"environment": environment, **{key: start[key] for key in ("path", "argv", "directory", "main")}}


def _spawned(**kwargs: Any) -> WorkerMesh:
    return WorkerMesh.spawn(2, **kwargs)


def test_variables_no_import_reads_keep_the_fork_server() -> None:
    """The workers of a host served by ``lightning-monarch serve`` on this machine take its notice
    file's variable, and a ``Trainer(deterministic=True)`` sets cuBLAS's workspace setting in the
    controller: no import reads either, so the fork server forks workers all the same."""
    assert {NOTICE_VARIABLE, "CUBLAS_WORKSPACE_CONFIG"} <= NOT_READ_AT_IMPORT


def test_cpu_workers_are_forked_and_start_as_monarchs_own_would() -> None:
    forked = _spawned()
    try:
        forked_starts = probe_workers(forked, "start")
    finally:
        forked.stop()
    fresh = _spawned(hosts=this_host())
    try:
        fresh_starts = probe_workers(fresh, "start")
    finally:
        fresh.stop()
    servers = forkserver.fork_server_pids(PACKAGE)
    assert [start["parent"] for start in forked_starts] == [servers[0]] * 2, "the workers were not forked"
    assert [start["parent"] for start in fresh_starts] == [os.getpid()] * 2
    assert [_comparable(start) for start in forked_starts] == [_comparable(start) for start in fresh_starts]
    assert forked_starts[0]["numpy_draw"] != forked_starts[1]["numpy_draw"], "the forked workers share a generator"
    forked_cpu = max(start["cpu_seconds"] for start in forked_starts)
    fresh_cpu = min(start["cpu_seconds"] for start in fresh_starts)
    print(f"CPU seconds of a worker by the time it answers: forked {forked_cpu:.2f}, started afresh {fresh_cpu:.2f}")
    assert forked_cpu < fresh_cpu / 2


def _parents_and_variable(mesh: WorkerMesh) -> list[tuple[int, Optional[str]]]:
    """Each worker's parent and its ``LIGHTNING_MONARCH_TEST_VARIABLE``; then stops ``mesh``."""
    try:
        return [
            (start["parent"], start["environment"].get("LIGHTNING_MONARCH_TEST_VARIABLE"))
            for start in probe_workers(mesh, "start")
        ]
    finally:
        mesh.stop()


def test_a_changed_environment_gets_a_fork_server_of_its_own_and_the_last_two_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _spawned().stop()
    first = forkserver.fork_server_pids(PACKAGE)[0]  # the most recently used: this environment's
    monkeypatch.setenv("LIGHTNING_MONARCH_TEST_VARIABLE", "seen")
    seen = _parents_and_variable(_spawned())
    changed, kept = forkserver.fork_server_pids(PACKAGE)[:2]
    assert changed != first and kept == first and psutil.pid_exists(first)
    assert seen == [(changed, "seen")] * 2
    monkeypatch.delenv("LIGHTNING_MONARCH_TEST_VARIABLE")  # restored: the first server again
    assert _parents_and_variable(_spawned()) == [(first, None)] * 2
    assert forkserver.fork_server_pids(PACKAGE)[:2] == [first, changed]
    monkeypatch.setenv("LIGHTNING_MONARCH_TEST_VARIABLE", "another")  # a third: the least recently used stops
    third = _parents_and_variable(_spawned())
    assert forkserver.fork_server_pids(PACKAGE) == [third[0][0], first] and not psutil.pid_exists(changed)
    assert [variable for _, variable in third] == ["another"] * 2


def _start_processes() -> set[psutil.Process]:
    """This process's ``start`` processes: the processes Monarch launched for forked workers."""
    return {
        process
        for process in psutil.Process().children()
        if forkserver.SCRIPT in process.cmdline() and "start" in process.cmdline()
    }


def _spawned_with_starts() -> tuple[WorkerMesh, list[psutil.Process], list[psutil.Process]]:
    """A new forked mesh, its workers and its start processes (a warm mesh of an earlier test
    has start processes of its own)."""
    before = _start_processes()
    mesh = _spawned()
    starts = sorted(_start_processes() - before, key=lambda process: process.pid)
    assert len(starts) == 2
    return mesh, [psutil.Process(pid) for pid in mesh.pids], starts


def test_a_killed_start_process_takes_its_worker_with_it() -> None:
    mesh, workers, starts = _spawned_with_starts()
    try:
        for process in starts:
            process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, alive = psutil.wait_procs(workers, timeout=5)
        print(f"the forked workers ended {time.monotonic() - killed_at:.2f} s after their start processes")
        assert not alive
    finally:
        mesh.stop(kill=True)


def test_a_killed_worker_ends_its_start_process_by_the_same_signal(capfd: pytest.CaptureFixture[str]) -> None:
    """Monarch sees the start process end as the worker did: killed by SIGKILL, silently."""
    mesh, workers, starts = _spawned_with_starts()
    try:
        for process in workers:
            process.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(starts, timeout=5)
        assert not alive
    finally:
        mesh.stop(kill=True)
    assert "Traceback" not in capfd.readouterr().err


def test_a_worker_that_fails_to_start_ends_its_start_process_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Monarch's own hook for a failing bootstrap: the forked worker's error, raised under the fork
    server's frames, reaches the start process's own standard error, and it exits with the
    worker's code."""
    monkeypatch.setenv("MONARCH_ERROR_DURING_BOOTSTRAP_FOR_TESTING", "1")
    server = forkserver.ForkServerProcess((*forkserver.PRELOADED, PACKAGE))
    try:
        started = subprocess.run(
            [sys.executable, *server.start_arguments()],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.stop()
    assert started.returncode == 1
    assert "Error during bootstrap for testing" in started.stderr
    assert "in become_worker" in started.stderr, "the worker was not forked"


def test_the_workers_of_a_process_jobs_hosts_are_forked_and_die_with_their_host() -> None:
    """A ``ProcessJob``'s hosts run this interpreter on this machine: their CPU workers are forked
    too, with their output forwarded as the strategy has it for hosts (``StrategySettings.mesh_key``:
    Monarch then gives each process its log forwarder's channel, which the server's imports do not
    read). A host process killed on its own (not its session) takes its worker with it within a
    second, as a worker that Monarch's bootstrap started dies with its host."""
    job = ProcessJob({"hosts": 2})
    try:
        mesh = WorkerMesh.spawn(1, hosts=host_mesh(job, 2, 0, 30), output=WorkerOutput(3))
        try:
            workers = [psutil.Process(pid) for pid in mesh.pids]
            assert [worker.ppid() for worker in workers] == forkserver.fork_server_pids(PACKAGE)[:1] * 2
            os.kill(process_job_host(1), signal.SIGKILL)
            killed_at = time.monotonic()
            while workers[1].is_running() and time.monotonic() - killed_at < 5:
                time.sleep(0.02)
            print(f"rank 1's forked worker ended {time.monotonic() - killed_at:.2f} s after its host")
            assert not workers[1].is_running() and workers[0].is_running()
            assert time.monotonic() - killed_at < 1
        finally:
            mesh.stop(kill=True)
    finally:
        job.kill()
