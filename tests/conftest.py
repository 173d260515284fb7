"""Fixtures shared by the test suite: a leak check around every test, and the ``ddp`` reference.

Tests share the warm worker mesh that ``strategy="monarch"`` keeps between stages, as a notebook
user's cells do; the leak check counts every other worker process as left behind.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest
import torch

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from lightning_monarch.controller.mesh.forkserver import is_worker_process
from lightning_monarch.controller.mesh.pool import MESHES, other_namespace_pool
from lightning_monarch.devices import VISIBILITY_VARS
from tests.references import run_reference
from tests.served_hosts import ROOT
from tests.suite_time import SuiteTime

#: Every process of this test run carries this marker in its environment, which Monarch's worker
#: processes inherit: a worker left behind is found even after it was re-parented (its controller
#: killed), which a search of this process's children would miss. Each of pytest-xdist's worker
#: processes has its own (their suffix), so that one's leak check never counts the other's meshes.
RUN_MARKER = "LIGHTNING_MONARCH_TEST_RUN"
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if not os.environ.get(RUN_MARKER, "").endswith(f"/{_XDIST_WORKER}"):
    os.environ[RUN_MARKER] = f"{uuid.uuid4().hex}/{_XDIST_WORKER}"


#: The test files that take longest, longest first (measured with ``--durations=0``): pytest-xdist
#: hands whole files to its two processes in collection order (``--no-loadscope-reorder`` in
#: ``pyproject.toml``; by default it orders them by their number of tests), so the longest start
#: first and both processes end at about the same time instead of one running the elastic tests
#: alone at the end.
SLOWEST_FIRST = (
    "test_elastic.py",
    "test_hidden_hosts.py",
    "test_hosts.py",
    "test_examples.py",
    "test_pytorch_lightning.py",
    "test_parity.py",
    "test_debugger.py",
    "test_model_parallel.py",
    "test_notebook.py",
    "test_failures.py",
    "test_command.py",
    "test_warm_mesh.py",
    "test_clients.py",
    "test_recovery.py",
    "test_devices.py",
    "test_fsdp.py",
    "test_fed_loaders.py",
)


#: The suite's time against its budget (``tests.suite_time``), kept by pytest's main process.
_SUITE_TIME: Optional[SuiteTime] = None


def pytest_configure(config: pytest.Config) -> None:
    global _SUITE_TIME
    if not hasattr(config, "workerinput"):  # a pytest-xdist worker's reports reach the main process
        _SUITE_TIME = SuiteTime(ROOT)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _SUITE_TIME is not None:
        _SUITE_TIME.add(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The suite's time against the budget, and its slowest files."""
    if _SUITE_TIME is not None:
        terminalreporter.section("suite time")
        for line in _SUITE_TIME.lines():
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of :data:`SLOWEST_FIRST` first, in its order; each file's tests in their own order."""
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def worker_processes() -> list[psutil.Process]:
    """Monarch worker processes that this test run started (here or in a subprocess), still running."""
    marker = os.environ[RUN_MARKER]
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(RUN_MARKER) == marker and is_worker_process(process):
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):  # ended, or not ours to read
            continue
    return found


def probe_workers(mesh: Any, endpoint: str) -> list[Any]:
    """Every worker's answer to ``WorkerProbe.<endpoint>`` (``tests/worker_probe.py``), from a
    probe actor spawned in the processes of ``mesh`` (a ``WorkerMesh``), in no particular order."""
    from tests.worker_probe import WorkerProbe

    answers = []
    for part in mesh._world.parts:
        probe = part.procs.spawn("worker_probe", WorkerProbe)
        answers.extend(getattr(probe, endpoint).call().get(timeout=60).values())
    return answers


def probe_warm_workers(endpoint: str, keep: bool = False) -> list[Any]:
    """:func:`probe_workers` on the warm mesh the last stage kept, once the workers have dropped
    that stage (as the next stage finds them); then stops it, unless ``keep``."""
    assert MESHES._idle is not None, "the last stage kept no warm mesh to probe"
    try:
        mesh = MESHES._idle[1]
        assert mesh.answers(), "the warm mesh's workers do not answer"
        return probe_workers(mesh, endpoint)
    finally:
        if not keep:
            MESHES.stop()


def stray_workers() -> list[psutil.Process]:
    """Worker processes that are not the warm mesh's (of either of Lightning's namespaces)."""
    other = other_namespace_pool()
    warm = set(MESHES.worker_pids()) | set(other.worker_pids() if other is not None else [])
    return [process for process in worker_processes() if process.pid not in warm]


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    """Every test, passing or failing, must leave no Monarch worker process behind but the warm mesh."""
    yield
    deadline = time.monotonic() + 10
    while stray_workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = stray_workers()
    for process in left:
        process.kill()
    assert not left, f"worker processes left behind: {[process.pid for process in left]}"


@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Stands in for a CUDA build of torch on this CPU-only build, where GPU workers are refused:
    ``torch.version.cuda`` is set, and nothing else. The host's GPUs stay uncounted (there is no
    NVML here), as on a login node, and no visibility variable of this process leaks in."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    for name in VISIBILITY_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def run_ddp_reference(out_dir: Path, cases: list[str], processes: int = 2, fails: bool = False) -> Path:
    """Run parity cases under Lightning's own ``strategy="ddp"`` on ``processes`` CPU ranks (2 a
    host of the cases), ``python -m tests.ddp_reference`` on each (``tests.references``); with
    ``fails``, cases whose rank 0 fails on purpose (only rank 0 must end well)."""
    run_reference("tests.ddp_reference", out_dir, *cases, processes=processes, timeout=900, peers_may_fail=fails)
    return out_dir
