"""Several hosts through Monarch's own job layer: 2 hosts x 2 workers (a ``ProcessJob`` on this
machine) train as Lightning's ``ddp`` does with 4 processes, every worker sees torchrun's ranks,
and ``num_nodes`` must agree with the hosts."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.job import ProcessJob

import lightning_monarch
from lightning_monarch import MonarchStrategy, UnreachableHostsError
from lightning_monarch.controller.mesh.forkserver import fork_server_pids
from lightning_monarch.controller.mesh.pool import MESHES
from tests.conftest import ROOT, run_ddp_reference
from tests.models import Classifier
from tests.parity_cases import HOST_CASES, comparable_checkpoint, run_case
from tests.served_hosts import ServedHost, closed_port
from tests.test_async_validation import places, recording
from tests.test_parity import assert_same

pytestmark = pytest.mark.timeout(600)

#: What workers on the job's hosts print reaches the controller in windows of this many seconds; the
#: tests that train on the job's hosts use the same window, which is part of what the warm mesh
#: keeps, so the second finds the first's 4 workers warm.
WINDOW_SEC = 1


@pytest.fixture(scope="module")
def job() -> Any:
    job = ProcessJob({"hosts": 2})
    yield job
    lightning_monarch.stop_meshes()  # the warm mesh lives on the job's hosts
    job.kill()


@pytest.mark.parametrize("case", list(HOST_CASES))
def test_two_hosts_give_what_ddp_gives_with_four_processes(case: str, tmp_path: Path) -> None:
    reference_dir = run_ddp_reference(tmp_path / "ddp", [case], processes=4)
    ours = run_case(case, "monarch", tmp_path / "monarch")
    assert ours is not None
    assert_same(ours, torch.load(reference_dir / case / "results.pt", weights_only=False), case)
    for name in ("final.ckpt", "checkpoints/last.ckpt"):
        assert_same(
            comparable_checkpoint(tmp_path / "monarch" / name), comparable_checkpoint(reference_dir / case / name), name
        )


class RankRecorder(Classifier):
    """Gathers every worker's view of its ranks onto rank 0, whose attributes the controller gets."""

    def on_fit_start(self) -> None:
        t = self.trainer
        mine = torch.tensor([t.global_rank, t.local_rank, t.node_rank, t.world_size])
        self.ranks = self.all_gather(mine).tolist()


def test_every_worker_sees_torchrun_ranks(job: Any) -> None:
    model = RankRecorder()
    L.Trainer(
        strategy=MonarchStrategy(hosts=job, aggregate_window_sec=WINDOW_SEC),
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model)
    assert model.ranks == [[0, 0, 0, 4], [1, 1, 0, 4], [2, 0, 1, 4], [3, 1, 1, 4]]


def test_async_validation_on_the_hosts_gives_the_synchronous_results(job: Any, tmp_path: Path) -> None:
    """The validation workers start on the training hosts, each rank's beside its training rank."""
    runs = {}
    for mode in ("async", "sync"):
        model, logger = recording(tmp_path / mode)
        L.Trainer(
            strategy=MonarchStrategy(hosts=job, aggregate_window_sec=WINDOW_SEC, validation=mode),
            accelerator="cpu",
            devices=2,
            num_nodes=2,
            max_epochs=2,
            log_every_n_steps=1,
            logger=logger,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(model)
        runs[mode] = (logger.rows, model.state_dict(), places(tmp_path / mode))
    (rows, weights, ran), (sync_rows, sync_weights, sync_ran) = runs["async"], runs["sync"]
    assert len(ran["validation"]) == 4 and not ran["validation"] & ran["train"]
    assert ran["train"] == sync_ran["train"]  # the job's warm mesh, though each Trainer connected the job
    assert [row for row in sync_rows if "val_loss" in row[1]] and rows == sync_rows
    assert_same(weights, sync_weights, "weights")


class Greeter(Classifier):
    def on_fit_start(self) -> None:
        print("hello from a worker", flush=True)


def test_what_workers_on_other_hosts_print_is_shown_once_with_its_count(
    job: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    L.Trainer(
        strategy=MonarchStrategy(hosts=job, aggregate_window_sec=WINDOW_SEC),
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(Greeter())
    deadline = time.monotonic() + 10
    out, counts = "", []
    while sum(counts) < 4 and time.monotonic() < deadline:  # the lines may come in several windows
        time.sleep(0.5)
        out += capfd.readouterr().out
        counts = [int(count) for count in re.findall(r"\[(\d+) similar log lines?\].* hello from a worker", out)]
    # Monarch groups the 4 workers' line into one group per window and similarity bucket
    assert sum(counts) == 4 and len(counts) < 4, out


def test_num_nodes_must_match_the_host_mesh(job: Any) -> None:
    hosts = job.state(cached_path=None).hosts
    with pytest.raises(MisconfigurationException, match=r"num_nodes=3\)` but the workers' host mesh has 2 host"):
        L.Trainer(strategy=MonarchStrategy(hosts=hosts), accelerator="cpu", devices=2, num_nodes=3, logger=False)


def test_hosts_must_be_a_job_a_host_mesh_or_addresses() -> None:
    with pytest.raises(MisconfigurationException, match=r"hosts=str\(...\)\)`: give a Monarch job"):
        L.Trainer(
            strategy=MonarchStrategy(hosts="node-1,node-2"), accelerator="cpu", devices=2, num_nodes=2, logger=False
        )


@pytest.mark.parametrize(
    ("meshes", "num_nodes", "message"),
    [
        ({"trainers": 1}, 1, r"no host mesh named 'hosts' \(it has \['trainers'\]\).*job.state\(\).<name>"),
        ({"hosts": 3}, 2, r"num_nodes=2\)` but `ProcessJob\(\{'hosts': 3\}\)` asks for 3 host\(s\)"),
    ],
)
def test_a_job_of_the_wrong_shape_is_refused_before_it_starts(meshes: dict, num_nodes: int, message: str) -> None:
    job = ProcessJob(meshes)
    with pytest.raises(MisconfigurationException, match=message):
        L.Trainer(strategy=MonarchStrategy(hosts=job), accelerator="cpu", devices=1, num_nodes=num_nodes, logger=False)
    assert not job.active  # nothing was started


@pytest.fixture
def slurm_job() -> Any:
    """A ``SlurmJob`` factory. Its constructor switches Monarch's default transport to TCP for
    this process; the fixture switches it back for the tests that follow."""
    from monarch._rust_bindings.monarch_hyperactor.config import configure, get_global_config
    from monarch.job import SlurmJob

    transport = get_global_config()["default_transport"]
    yield SlurmJob
    configure(default_transport=transport)


@pytest.mark.parametrize(
    ("options", "accelerator", "message"),
    [
        ({"ntasks_per_node": 2}, "cpu", r"SlurmJob\(ntasks_per_node=2\)`: each node runs one Monarch host process"),
        ({}, "gpu", r"devices=2\)` runs 2 GPU workers per node, but `SlurmJob\(gpus_per_node=None\)` requests no GPUs"),
        ({"gpus_per_node": 1}, "gpu", r"SlurmJob\(gpus_per_node=1\)` requests 1 GPU\(s\).*gpus_per_node=2\)"),
        ({"gpus_per_node": 2}, "gpu", r"with SLURM's sbatch and squeue, which this machine's PATH does not have"),
    ],
)
def test_a_slurm_job_missing_its_options_is_refused_before_it_is_submitted(
    slurm_job: Any, options: dict, accelerator: str, message: str, cuda_build: pytest.MonkeyPatch
) -> None:
    job = slurm_job({"hosts": 2}, **options)
    with pytest.raises(MisconfigurationException, match=message):
        L.Trainer(strategy=MonarchStrategy(hosts=job), accelerator=accelerator, devices=2, num_nodes=2, logger=False)
    assert not job.active


@pytest.fixture
def worker_host() -> Any:
    """A Monarch host serving at a TCP address, as ``run_worker_loop_forever`` does on a cluster
    node; stopped by its PID."""
    host = ServedHost()
    try:
        host.start()
        yield host.address
    finally:
        lightning_monarch.stop_meshes()  # a warm mesh may live on this host
        host.stop()


def test_workers_at_given_addresses_train(worker_host: str) -> None:
    model = RankRecorder()
    L.Trainer(
        strategy=MonarchStrategy(hosts=[worker_host]),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model)
    assert model.ranks == [[0, 0, 0, 2], [1, 1, 0, 2]]
    # served on this machine with this interpreter: forked from this process's fork server, not
    # started by Monarch's bootstrap (``hosts.served_here``; a host with an interpreter of its own:
    # ``test_devices.py``, one in PID and host name namespaces of its own: ``test_hidden_hosts.py``)
    assert [psutil.Process(pid).ppid() in fork_server_pids() for pid in MESHES.worker_pids()] == [True, True]


def test_preflight_checks_the_workers_of_other_hosts(worker_host: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_monarch",
            "preflight",
            "--devices",
            "2",
            "--hosts",
            worker_host,
            "--num-nodes",
            "1",
            "--all-reduce-mib",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[1:2] in (["0"], ["1"])]
    assert [row[1] for row in rows] == ["0", "1"], done.stdout


def test_unreachable_workers_are_named(worker_host: str) -> None:
    dead = f"tcp://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(
        UnreachableHostsError,
        match=rf"within 3 s; 1 of 2 worker address\(es\) do not accept a"
        rf" connection: {dead}\.",
    ):
        L.Trainer(
            strategy=MonarchStrategy(hosts=[worker_host, dead], connect_timeout=3),
            accelerator="cpu",
            devices=1,
            num_nodes=2,
            logger=False,
        )
    assert time.monotonic() - started < 15


STARTS_A_JOB = """
import lightning as L
from monarch.job import ProcessJob
from lightning_monarch import MonarchStrategy
from tests.models import Classifier

job = ProcessJob({"hosts": 1})
L.Trainer(strategy=MonarchStrategy(hosts=job), accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=1,
          limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False).fit(Classifier())
print("hosts", *[host.pid for host in job._host_to_pid.values()])
"""


def test_a_job_the_strategy_started_ends_with_the_process() -> None:
    # under LightningCLI nothing else holds the job: its hosts (a SLURM allocation) must not outlive the run
    done = subprocess.run([sys.executable, "-c", STARTS_A_JOB], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    hosts = [int(pid) for pid in done.stdout.split("hosts", 1)[1].split()]
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(pid) for pid in hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in hosts if psutil.pid_exists(pid)]
    for pid in alive:
        psutil.Process(pid).kill()
    assert hosts and not alive
