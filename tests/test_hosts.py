"""Several hosts through Monarch's own job layer: 2 hosts x 2 workers (a ``ProcessJob`` on this
machine) train as Lightning's ``ddp`` does with 4 processes, every worker sees torchrun's ranks,
and ``num_nodes`` must agree with the hosts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.job import ProcessJob

import lightning_monarch
from lightning_monarch import MonarchStrategy
from tests.conftest import run_ddp_reference
from tests.models import Classifier
from tests.parity_cases import HOST_CASES, comparable_checkpoint, run_case
from tests.test_parity import assert_same

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def job() -> Any:
    job = ProcessJob({"hosts": 2})
    yield job
    lightning_monarch.stop_meshes()  # the warm mesh lives on the job's hosts
    job.kill()


@pytest.mark.parametrize("case", list(HOST_CASES))
def test_two_hosts_give_what_ddp_gives_with_four_processes(case: str, tmp_path: Path) -> None:
    reference_dir = run_ddp_reference(tmp_path / "ddp", [case])
    ours = run_case(case, "monarch", tmp_path / "monarch")
    assert ours is not None
    assert_same(ours, torch.load(reference_dir / case / "results.pt", weights_only=False), case)
    for name in ("final.ckpt", "checkpoints/last.ckpt"):
        assert_same(comparable_checkpoint(tmp_path / "monarch" / name), comparable_checkpoint(reference_dir / case / name), name)


class RankRecorder(Classifier):
    """Gathers every worker's view of its ranks onto rank 0, whose attributes the controller gets."""

    def on_fit_start(self) -> None:
        t = self.trainer
        mine = torch.tensor([t.global_rank, t.local_rank, t.node_rank, t.world_size])
        self.ranks = self.all_gather(mine).tolist()


def test_every_worker_sees_torchrun_ranks(job: Any) -> None:
    model = RankRecorder()
    L.Trainer(strategy=MonarchStrategy(hosts=job), accelerator="cpu", devices=2, num_nodes=2, max_epochs=1,
              limit_train_batches=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model)
    assert model.ranks == [[0, 0, 0, 4], [1, 1, 0, 4], [2, 0, 1, 4], [3, 1, 1, 4]]


def test_num_nodes_must_match_the_hosts(job: Any) -> None:
    with pytest.raises(MisconfigurationException, match=r"num_nodes=3\)` but the workers' host mesh has 2 host"):
        L.Trainer(strategy=MonarchStrategy(hosts=job), accelerator="cpu", devices=2, num_nodes=3, logger=False)


def test_hosts_must_be_a_job_or_a_host_mesh() -> None:
    with pytest.raises(MisconfigurationException, match=r"hosts=str\(...\)\)`: give a Monarch job"):
        L.Trainer(strategy=MonarchStrategy(hosts="node-1,node-2"), accelerator="cpu", devices=2, num_nodes=2,
                  logger=False)


def test_a_job_without_a_hosts_mesh_is_refused() -> None:
    job = ProcessJob({"trainers": 1})
    try:
        with pytest.raises(MisconfigurationException, match=r"no host mesh named 'hosts'.*job.state\(\).<name>"):
            L.Trainer(strategy=MonarchStrategy(hosts=job), accelerator="cpu", devices=1, logger=False)
    finally:
        job.kill()
