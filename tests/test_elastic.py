"""Elastic training on 2 hosts, 1 CPU worker each. A ``fit`` loses host 1 for good (its host
process and worker SIGKILLed) in epoch 2 of 4 and finishes on host 0, whose worker process is kept;
or host 1 comes back and the run grows back at the start of epoch 3. Either ends exactly as
Lightning's ``ddp`` stopped at each resume point where the world changed and resumed there with
the new number of processes and accumulation. With fewer hosts left than ``min_nodes``, the run
fails at once, naming them."""

from __future__ import annotations

import logging
import os
import signal
import socket
import warnings
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from monarch.job import ProcessJob

from lightning_monarch import HostsLostError, MonarchFSDPStrategy, MonarchStrategy, stop_meshes
from lightning_monarch.controller.features.elastic import ACCUMULATION_METRIC, WORLD_SIZE_METRIC, ElasticFit
from lightning_monarch.controller.mesh.hosts import LostHostCheck, refuses
from lightning_monarch.controller.mesh.world import surviving_positions
from lightning_monarch.wire.specs import WorldSpec
from lightning_monarch.worker.process import torch_elastic_env
from tests import elastic_runs
from tests.conftest import worker_processes
from tests.models import Classifier
from tests.parity_cases import comparable_checkpoint
from tests.references import run_reference
from tests.served_hosts import ServedHost, process_job_host

pytestmark = pytest.mark.timeout(300)

#: The step in epoch 2 (6 steps an epoch) at which the controller's loop kills host 1.
KILL_AT_STEP = 15
#: ``MonarchStrategy(connect_timeout=...)`` of the elastic runs: how long a dead worker's host has
#: to serve a new process, unless its worker address refuses connections.
CONNECT_TIMEOUT_S = 10


class KillHost(L.Callback):
    """SIGKILLs, from the controller, worker ``rank`` and its host process, whose ID ``host`` gives,
    with every process the host started (it runs in a session of its own), when ``global_step``
    reaches ``step``; records the workers' process IDs then, in the smaller world, and at the end;
    and once the run goes on in the smaller world, calls ``then``."""

    def __init__(
        self, rank: int, host: Callable[[], int], step: int, then: Optional[Callable[[], None]] = None
    ) -> None:
        self.rank, self.host, self.step, self.then = rank, host, step, then
        self.pids_before: Optional[list[int]] = None
        self.pids_smaller: Optional[list[int]] = None
        self.pids_at_end: Optional[list[int]] = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.pids_before is None and trainer.global_step == self.step:
            self.pids_before = trainer.strategy.worker_pids
            worker = self.pids_before[self.rank]
            os.killpg(self.host(), signal.SIGKILL)
            with suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        elif self.pids_smaller is None and trainer.strategy.num_nodes == 1:
            self.pids_smaller = trainer.strategy.worker_pids
            if self.then is not None:
                self.then()

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.pids_at_end = trainer.strategy.worker_pids


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """Lightning's ``ddp`` on a sequence, stopped and resumed as ``elastic_runs`` says: what its
    last run saved, and its ``directory``. Each sequence runs once per module: two tests compare
    with ``shrink``."""
    done: dict[str, dict[str, Any]] = {}

    def reference(sequence: str) -> dict[str, Any]:
        if sequence not in done:
            out_dir = tmp_path_factory.mktemp(f"ddp-{sequence}")
            for index, (processes, *_) in enumerate(elastic_runs.SEQUENCES[sequence]):
                run_reference("tests.elastic_runs", out_dir, sequence, index, processes=processes, timeout=240)
            done[sequence] = {**torch.load(out_dir / "results.pt", weights_only=False), "directory": out_dir}
        return done[sequence]

    return reference


def served_pid(host: ServedHost) -> int:
    assert host.process is not None, "the host does not serve"
    return host.process.pid


def _fit_elastic(
    out_dir: Path,
    hosts: Any,
    callbacks: Sequence[L.Callback],
    caplog: Any,
    worker_callbacks: Sequence[L.Callback] = (),
    max_restarts: int = 0,
) -> tuple[MonarchStrategy, L.Trainer, dict[str, Any], list[str]]:
    """The elastic run on ``hosts`` (2, one worker each) with ``callbacks`` on the controller: its
    strategy, Trainer, what the test compares, and the lines that logged its world changes."""
    L.seed_everything(elastic_runs.SEED)
    model = Classifier()
    strategy = MonarchStrategy(
        hosts=hosts,
        min_nodes=1,
        connect_timeout=CONNECT_TIMEOUT_S,
        worker_callbacks=list(worker_callbacks),
        max_restarts=max_restarts,
    )
    trainer = elastic_runs.trainer(out_dir, strategy, callbacks, devices=1, num_nodes=2)
    with caplog.at_level(logging.WARNING, logger="lightning_monarch.controller.features.elastic"):
        trainer.fit(model)
    changes = [record.getMessage() for record in caplog.records if "training goes on" in record.getMessage()]
    return strategy, trainer, elastic_runs.results(trainer, model, out_dir), changes


def _assert_same_run(ours: dict[str, Any], reference: dict[str, Any], out_dir: Path, global_step: int = 24) -> None:
    for key, value in reference["weights"].items():
        assert torch.equal(ours["weights"][key], value), key
    assert ours["global_step"] == reference["global_step"] == global_step
    assert ours["current_epoch"] == reference["current_epoch"]
    assert ours["callback_metrics"] == reference["callback_metrics"]
    assert_same_checkpoint(
        out_dir / "monarch" / "checkpoints" / "last.ckpt", reference["directory"] / "checkpoints" / "last.ckpt"
    )
    assert WORLD_SIZE_METRIC in ours["csv"].splitlines()[0] and ACCUMULATION_METRIC in ours["csv"].splitlines()[0]


class KillSurvivor(L.Callback):
    """SIGKILLs, from the controller, the worker left after a shrink (its host lives on) once the
    controller's loop reaches ``step`` in the smaller world; records its process ID then."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.killed: Optional[int] = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.killed is None and trainer.strategy.num_nodes == 1 and trainer.global_step >= self.step:
            self.killed = trainer.strategy.worker_pids[0]
            os.kill(self.killed, signal.SIGKILL)


def test_a_fit_that_loses_a_host_ends_as_ddp_stopped_at_the_resume_point_and_resumed_on_fewer(
    tmp_path: Path, caplog: Any, ddp_reference: Callable[[str], dict[str, Any]]
) -> None:
    """Host 1 of a ``ProcessJob`` is lost in epoch 2; in epoch 3, the worker left on host 0 dies
    too and is replaced there (``max_restarts=1``): one fit for both, as each sets up the same
    smaller world."""
    reference = ddp_reference("shrink")
    job = ProcessJob({"hosts": 2})
    killer = KillHost(rank=1, host=lambda: process_job_host(1), step=KILL_AT_STEP)
    survivor = KillSurvivor(step=20)  # in epoch 3, after its snapshot
    try:
        strategy, trainer, ours, changes = _fit_elastic(
            tmp_path / "monarch", job, [killer, survivor], caplog, max_restarts=1
        )
    finally:
        stop_meshes()
        job.kill()

    assert killer.pids_before is not None and killer.pids_at_end is not None
    assert killer.pids_smaller == killer.pids_before[:1] == [survivor.killed]  # host 0's worker went on
    assert len(killer.pids_at_end) == 1 and killer.pids_at_end[0] != survivor.killed  # a new process on host 0
    assert strategy.world_changes == 1 and strategy.restarts == 1
    assert strategy.num_nodes == 2 and trainer.accumulate_grad_batches == 1
    (change,) = changes
    # the killed host's socket refused connections: lost at once, without the connect timeout
    assert (
        "lost host(s) [1] of 2 (worker ranks [1]; the worker address of [1] refuses connections); training goes on"
        " with 1 worker(s) on 1 host(s)"
    ) in change
    assert "accumulate_grad_batches=2, from the start of epoch 2 (global step 12)" in change
    _assert_same_run(ours, reference, tmp_path)


def test_a_host_back_at_the_same_address_is_refused_by_monarch_and_the_run_goes_on_without_it(
    tmp_path: Path, caplog: Any, ddp_reference: Callable[[str], dict[str, Any]]
) -> None:
    """Monarch 0.7 refuses a host process restarted at an address this controller talked to
    (meta-pytorch/monarch#4310): the controller says so once, with the fix, and goes on."""
    reference = ddp_reference("shrink")
    hosts = [ServedHost(), ServedHost()]
    killer = KillHost(rank=1, host=lambda: served_pid(hosts[1]), step=KILL_AT_STEP, then=hosts[1].start)  # same address
    try:
        for host in hosts:
            host.start()
        strategy, _, ours, changes = _fit_elastic(
            tmp_path / "monarch", [host.address for host in hosts], [killer], caplog
        )
    finally:
        stop_meshes()
        for host in hosts:
            host.stop()

    refused = [record.getMessage() for record in caplog.records if "accepts a connection again" in record.getMessage()]
    assert len(refused) == 1 and hosts[1].address in refused[0] and "serve it at a new address" in refused[0]
    assert strategy.world_changes == 1 and len(changes) == 1
    # the killed host's address refused connections: lost at once, without the connect timeout
    assert "the worker address of [1] refuses connections)" in changes[0]
    _assert_same_run(ours, reference, tmp_path)


def test_a_lost_host_that_serves_again_rejoins_at_the_next_epoch_as_ddp_resumed_on_more_would(
    tmp_path: Path, caplog: Any, ddp_reference: Callable[[str], dict[str, Any]]
) -> None:
    reference = ddp_reference("shrink_and_grow")
    hosts = [ServedHost(), ServedHost()]
    started = list(hosts)

    def come_back() -> None:  # within epoch 2, at a new address, as a replaced cloud host gets one
        hosts[1] = ServedHost()
        started.append(hosts[1])
        hosts[1].start()

    killer = KillHost(rank=1, host=lambda: served_pid(hosts[1]), step=KILL_AT_STEP, then=come_back)
    try:
        for host in hosts:
            host.start()
        strategy, _, ours, changes = _fit_elastic(
            tmp_path / "monarch", lambda: [host.address for host in hosts], [killer], caplog
        )
    finally:
        stop_meshes()
        for host in started:
            host.stop()

    assert killer.pids_before is not None and killer.pids_at_end is not None
    assert killer.pids_smaller == killer.pids_at_end[:1] == killer.pids_before[:1]  # host 0's worker throughout
    assert killer.pids_at_end[1] not in killer.pids_before  # host 1's new worker
    assert strategy.world_changes == 2
    shrunk, grown = changes
    assert "the worker address of [1] refuses connections)" in shrunk
    assert "from the start of epoch 2 (global step 12)" in shrunk
    assert "host(s) [1] serve workers again; training goes on with 2 worker(s) on 2 host(s)" in grown
    assert "accumulate_grad_batches=1, from the start of epoch 3 (global step 18)" in grown
    _assert_same_run(ours, reference, tmp_path)


class StepsAndPids(L.Callback):
    """Records, on the controller, the global step at the end of every training batch where it
    changed (a batch that accumulates leaves it as it was), and the workers' process IDs at the
    first and the last."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.pids: list[list[int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.steps or self.steps[-1] != trainer.global_step:
            self.steps.append(trainer.global_step)
        if len(self.pids) < 2:
            self.pids.append(trainer.strategy.worker_pids)
        else:
            self.pids[1] = trainer.strategy.worker_pids


def test_a_preemption_notice_shrinks_the_world_at_the_next_step_end_with_no_step_redone(
    tmp_path: Path, caplog: Any, ddp_reference: Callable[[str], dict[str, Any]]
) -> None:
    reference = ddp_reference("preempt")
    hosts = [ServedHost(notices=True), ServedHost(notices=True)]
    recorder = StepsAndPids()
    try:
        for host in hosts:
            host.start()
        # host 1's processes get SIGTERM at the end of step 15; its workers see the notice at step 16's
        preempt = elastic_runs.PreemptOwnHost(rank=1, step=elastic_runs.NOTICE_AT_STEP - 1, host=served_pid(hosts[1]))
        strategy, trainer, ours, changes = _fit_elastic(
            tmp_path / "monarch", [host.address for host in hosts], [recorder], caplog, worker_callbacks=[preempt]
        )
        preempted = hosts[1].process
        assert preempted is not None and preempted.poll() is None  # its grace is not over: it lives on
    finally:
        stop_meshes()
        for host in hosts:
            host.stop()

    assert strategy.world_changes == 1 and strategy.num_nodes == 2 and trainer.accumulate_grad_batches == 1
    (change,) = changes
    assert "host(s) [1] of 2 got a preemption notice (worker ranks [1]); training goes on with 1 worker(s)" in change
    assert "accumulate_grad_batches=2, from epoch 2 after its batch 4 (global step 16)" in change
    # every step once, in order: none redone, none skipped
    assert recorder.steps == list(range(1, reference["global_step"] + 1))
    first, last = recorder.pids
    assert last == first[:1]  # host 0's worker went on in its own process
    _assert_same_run(ours, reference, tmp_path, global_step=26)


def assert_same_checkpoint(ours: Path, reference: Path) -> None:
    mine, theirs = comparable_checkpoint(ours), comparable_checkpoint(reference)
    assert mine.keys() == theirs.keys()
    for key in mine:
        if key == "state_dict":
            for name, value in theirs[key].items():
                assert torch.equal(mine[key][name], value), name
        elif key != "optimizer_states":
            assert mine[key] == theirs[key], key
    assert str(mine["optimizer_states"]) == str(theirs["optimizer_states"])


def test_a_fit_with_fewer_hosts_left_than_min_nodes_fails_naming_them(tmp_path: Path) -> None:
    job = ProcessJob({"hosts": 2})
    try:
        L.seed_everything(elastic_runs.SEED)
        strategy = MonarchStrategy(hosts=job, min_nodes=2, connect_timeout=5)
        trainer = elastic_runs.trainer(
            tmp_path, strategy, [KillHost(rank=1, host=lambda: process_job_host(1), step=3)], devices=1, num_nodes=2
        )
        with pytest.raises(
            HostsLostError,
            match=r"Host\(s\) \[1\] of the 2 the workers started on were lost: the worker address of \[1\] refuses"
            r" connections\. .* fewer than `MonarchStrategy\(min_nodes=2\)`",
        ):
            trainer.fit(Classifier())
    finally:
        stop_meshes()
        job.kill()
    assert not worker_processes()


def test_a_preemption_notice_that_leaves_fewer_hosts_than_min_nodes_fails_naming_them(tmp_path: Path) -> None:
    hosts = [ServedHost(notices=True), ServedHost(notices=True)]
    try:
        for host in hosts:
            host.start()
        L.seed_everything(elastic_runs.SEED)
        strategy = MonarchStrategy(
            hosts=[host.address for host in hosts],
            min_nodes=2,
            worker_callbacks=[elastic_runs.PreemptOwnHost(rank=1, step=3, host=served_pid(hosts[1]))],
        )
        trainer = elastic_runs.trainer(tmp_path, strategy, devices=1, num_nodes=2)
        with pytest.raises(
            HostsLostError,
            match=r"Host\(s\) \[1\] of the 2 .* got a preemption notice .* 1 host\(s\) remain, fewer than"
            r" `MonarchStrategy\(min_nodes=2\)`",
        ):
            trainer.fit(Classifier())
    finally:
        stop_meshes()
        for host in hosts:
            host.stop()
    assert not worker_processes()


def test_a_host_is_lost_at_once_where_its_worker_address_refuses_connections(tmp_path: Path) -> None:
    """Nothing listens there any more: the host process is gone (Monarch refuses a host restarted at
    an address it talked to, so waiting for one there cannot help). A listening address, and one
    that is not a worker address, are left to the connect timeout."""
    stale = tmp_path / "stale"  # a Unix socket whose process is gone: the file stays
    with socket.socket(socket.AF_UNIX) as ended:
        ended.bind(str(stale))
        ended.listen()
    with socket.create_server(("127.0.0.1", 0)) as server:
        listening = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        addresses = [listening, f"ipc://{tmp_path / 'gone'}", f"ipc://{stale}", "not-an-address"]
        refusing = LostHostCheck(CONNECT_TIMEOUT_S, lambda: addresses).refusing()
        assert not refuses(listening) and [refusing(slot) for slot in range(5)] == [False, True, True, False, False]
    assert refuses(listening) and refusing(0)
    assert not LostHostCheck(CONNECT_TIMEOUT_S, lambda: None).refusing()(0)


def test_the_surviving_hosts_of_a_part_are_the_longest_range_of_live_ones() -> None:
    assert surviving_positions(2, (1,)) == (range(0, 1), [])
    assert surviving_positions(3, (1,)) == (range(0, 3, 2), [])
    assert surviving_positions(4, (1,)) == (range(0, 4, 2), [3])  # of two ranges as long, the first
    assert surviving_positions(4, (0, 3)) == (range(1, 3), [])


@pytest.mark.parametrize(
    ("options", "num_nodes", "error"),
    [
        ({"min_nodes": 1}, 1, r"without `MonarchStrategy\(hosts=...\)` every worker runs on this host"),
        ({"min_nodes": 0}, 1, r"min_nodes=0\)`: give a whole number of hosts >= 1"),
    ],
)
def test_bad_min_nodes_is_refused_with_the_fix(options: dict[str, Any], num_nodes: int, error: str) -> None:
    with pytest.raises((MisconfigurationException, ValueError), match=error):
        L.Trainer(strategy=MonarchStrategy(**options), accelerator="cpu", devices=1, num_nodes=num_nodes)


def test_min_nodes_above_num_nodes_is_refused_before_any_host_is_asked() -> None:
    unused = ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"]  # the check comes first: nothing is dialled
    with pytest.raises(MisconfigurationException, match=r"min_nodes=3\)` is more than `Trainer\(num_nodes=2\)`"):
        L.Trainer(strategy=MonarchStrategy(hosts=unused, min_nodes=3), accelerator="cpu", devices=1, num_nodes=2)


def test_sharded_elastic_training_is_refused_naming_what_works() -> None:
    with pytest.raises(ValueError, match=r"MonarchFSDPStrategy\(min_nodes=1\)`: elastic training goes on"):
        MonarchFSDPStrategy(min_nodes=1)


def test_each_worker_takes_torchruns_variables_for_its_place_in_the_world() -> None:
    world = WorldSpec(
        "node-0", 29500, local_world_size=2, group_world_size=2, host_dimension="hosts", group_ranks={0: 0, 2: 1}
    )
    # the first mesh's host at coordinate 2, the second host left after coordinate 1 was lost
    assert torch_elastic_env(world, host=2, local_rank=1) == {
        "MASTER_ADDR": "node-0",
        "MASTER_PORT": "29500",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "ROLE_NAME": "rank",
        "WORLD_SIZE": "4",
    }


@pytest.mark.parametrize(
    ("keep_global_batch", "workers", "accumulate", "warned"),
    [(True, 2, 6, False), (True, 3, 3, True), (False, 2, 3, False)],
    ids=["4 to 2 workers: doubled", "4 to 3: not whole, warned", "keep_global_batch=False"],
)
def test_the_global_batch_is_kept_where_the_ratio_of_worlds_is_whole(
    keep_global_batch: bool, workers: int, accumulate: int, warned: bool
) -> None:
    strategy = MonarchStrategy(keep_global_batch=keep_global_batch)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, accumulate_grad_batches=3, logger=False)
    elastic = ElasticFit(strategy._settings(), strategy, trainer, mesh=None)  # type: ignore[arg-type]  # the mesh is not asked
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert elastic._accumulation(4, workers) == accumulate
        assert elastic._accumulation(4, workers) == accumulate
    shown = [str(warning.message) for warning in caught if "keep_global_batch" in str(warning.message)]
    assert len(shown) == (1 if warned else 0)  # once per fit
    if warned:
        assert "4 workers cannot be kept as a global batch by 3" in shown[0] and "keep_global_batch=False" in shown[0]
    elastic.restore()
