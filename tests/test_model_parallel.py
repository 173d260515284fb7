"""``MonarchModelParallelStrategy``: 2-D parallelism (tensor parallel × FSDP2) on the workers, as
Lightning's ``ModelParallelStrategy`` runs it, compared with that strategy on CPU processes (gloo)
to float tolerance: per-step losses and the final full weights at 1×2 and 2×2 (data × tensor), and
a resume on another layout (2×2 saved, 1×4 resumed), which distributed checkpoints reshard."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch import MonarchFSDPStrategy, MonarchModelParallelStrategy, cli, stop_meshes
from tests.conftest import worker_processes
from tests.references import run_reference
from tests.tensor_parallel import TensorParallelTransformer, fit

pytestmark = pytest.mark.timeout(300)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
#: (data parallel, tensor parallel) layouts compared with Lightning's strategy.
LAYOUTS = {"1x2": (1, 2), "2x2": (2, 2)}


def _references(root: Path, processes: int, *runs: str) -> dict[str, Any]:
    """Lightning's own ``ModelParallelStrategy`` for ``runs`` of world size ``processes``
    (``tests.tensor_parallel.run_reference``), as ``python -m tests.tensor_parallel`` on each rank."""
    run_reference("tests.tensor_parallel", root, *runs, processes=processes)
    return {run: torch.load(root / run.replace(":", "-from-") / "results.pt", weights_only=False) for run in runs}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """At 1×2; at 2×2, then 1×4 resumed from its checkpoint, in the same 4 processes."""
    root = tmp_path_factory.mktemp("model_parallel")
    results = {**_references(root, 2, "1x2"), **_references(root, 4, "2x2", "1x4:2x2")}
    return {**results, "resumed 1x4": results.pop("1x4:2x2")}


def _ours(out_dir: Path, data: int, tensor: int, resume_from: Path | None = None, **options: Any) -> dict[str, Any]:
    """The same run under ``MonarchModelParallelStrategy``, and what the tests compare of it."""
    strategy = MonarchModelParallelStrategy(data_parallel_size=data, tensor_parallel_size=tensor, **options)
    trainer, model = fit(strategy, data * tensor, out_dir, str(resume_from) if resume_from is not None else None)
    return {
        "saved": out_dir / "model.ckpt",
        "losses": model.losses,
        "weights": trainer.strategy.gather_full_state_dict(),
        "global_step": trainer.global_step,
        "emptied": all(parameter.is_meta for parameter in model.parameters()),
    }


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Our runs at 1×2 (saving one full file) and 2×2 (a distributed checkpoint), then 1×4
    resumed from the 2×2 run's checkpoint."""
    root = tmp_path_factory.mktemp("monarch_model_parallel")
    results = {
        "1x2": _ours(root / "1x2", 1, 2, save_distributed_checkpoint=False),
        "2x2": _ours(root / "2x2", 2, 2),
    }
    results["resumed 1x4"] = _ours(root / "resumed", 1, 4, root / "2x2" / "model.ckpt")
    stop_meshes()
    return results


def _assert_same_training(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    assert ours["losses"], "the workers' rank 0 recorded no loss"
    assert ours["global_step"] == reference["global_step"]
    torch.testing.assert_close(ours["losses"], reference["losses"], **TOLERANCE)
    assert set(ours["weights"]) == set(reference["weights"])
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][name], weight, **TOLERANCE, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_2d_training_matches_lightnings_model_parallel(
    layout: str, ours: dict[str, Any], references: dict[str, Any]
) -> None:
    assert ours[layout]["emptied"], "the controller's module holds weights after fit"
    _assert_same_training(ours[layout], references[layout])


def test_a_full_checkpoint_is_one_file_of_the_gathered_state(ours: dict[str, Any]) -> None:
    saved = ours["1x2"]["saved"]
    assert saved.is_file(), "save_distributed_checkpoint=False wrote no single file"
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["global_step"] == ours["1x2"]["global_step"] and len(checkpoint["optimizer_states"]) == 1
    model = TensorParallelTransformer.load_from_checkpoint(saved)
    for name, weight in ours["1x2"]["weights"].items():
        torch.testing.assert_close(model.state_dict()[name], weight, rtol=0, atol=0, msg=name)


def test_a_2d_checkpoint_converts_to_one_file(ours: dict[str, Any], tmp_path: Path) -> None:
    saved = ours["2x2"]["saved"]
    assert (saved / "meta.pt").is_file(), "no distributed checkpoint directory"
    assert cli.main(["convert", str(saved), str(tmp_path / "model.ckpt")]) == 0
    converted = torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"]
    torch.testing.assert_close(converted, ours["2x2"]["weights"], rtol=0, atol=0)


def test_a_resume_on_another_layout_matches_lightnings_resharding_resume(
    ours: dict[str, Any], references: dict[str, Any]
) -> None:
    assert ours["resumed 1x4"]["global_step"] > ours["2x2"]["global_step"]
    _assert_same_training(ours["resumed 1x4"], references["resumed 1x4"])
    assert not worker_processes()


@pytest.mark.parametrize(
    ("options", "devices", "error", "match"),
    [
        (
            {"data_parallel_size": 3, "tensor_parallel_size": 2},
            4,
            MisconfigurationException,
            r"data_parallel_size=3, tensor_parallel_size=2\)`: the sizes multiplied \(6\) must equal the number of"
            r" workers, here 4",
        ),
        (
            {"data_parallel_size": 1, "tensor_parallel_size": 4},
            4,
            None,
            None,
        ),
        (
            {"data_parallel_size": "auto", "tensor_parallel_size": 0},
            2,
            ValueError,
            r"tensor_parallel_size=0\)`: give a whole number of workers >= 1, or \"auto\" for the workers of a host",
        ),
    ],
)
def test_bad_sizes_fail_at_trainer_time(options: dict[str, Any], devices: int, error: Any, match: Any) -> None:
    def trainer() -> L.Trainer:
        return L.Trainer(strategy=MonarchModelParallelStrategy(**options), accelerator="cpu", devices=devices)

    if error is None:
        assert trainer().strategy.mesh_shape == (1, 4)
        return
    with pytest.raises(error, match=match):
        trainer()


def test_a_tensor_parallel_group_must_lie_within_a_host() -> None:
    strategy = MonarchModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=4, hosts=["tcp://a:1", "tcp://b:1"]
    )
    with pytest.raises(MisconfigurationException, match=r"each tensor-parallel group must lie within one host"):
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2)


def test_a_module_without_configure_model_is_refused_before_any_worker_starts() -> None:
    class Plain(TensorParallelTransformer):
        configure_model = L.LightningModule.configure_model

    workers_before = {process.pid for process in worker_processes()}
    trainer = L.Trainer(strategy="monarch_model_parallel", accelerator="cpu", devices=2, max_epochs=1)
    with pytest.raises(TypeError, match=r"you are required to override the `configure_model\(\)` hook"):
        trainer.fit(Plain())
    assert {process.pid for process in worker_processes()} == workers_before


def test_registered_name_and_defaults() -> None:
    trainer = L.Trainer(strategy="monarch_model_parallel", accelerator="cpu", devices=2)
    assert type(trainer.strategy) is MonarchModelParallelStrategy
    assert trainer.strategy.mesh_shape == (1, 2)  # Lightning's "auto": hosts × the workers of a host


def test_fsdp_strategy_refuses_a_2d_layout() -> None:
    with pytest.raises(
        ValueError, match=r"use `lightning_monarch.MonarchModelParallelStrategy\(tensor_parallel_size=2\)`"
    ):
        MonarchFSDPStrategy(tensor_parallel_size=2)


class WithoutTensorParallelism(TensorParallelTransformer):
    """Overrides ``configure_model`` but applies nothing in it."""

    def configure_model(self) -> None:
        pass


def test_a_module_that_applies_no_tensor_parallelism_gets_a_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"applied no tensor parallelism in `configure_model`"):
        fit(MonarchModelParallelStrategy(), 2, tmp_path, model_class=WithoutTensorParallelism, max_steps=1)


class KillRank1InEpoch1(L.Callback):
    """SIGKILLs worker rank 1 once, from the controller, in the middle of epoch 1 (of 4 steps
    each), after the recovery snapshot at its start."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 6 and not trainer.strategy.restarts:
            os.kill(trainer.strategy.worker_pids[1], signal.SIGKILL)


def _fit_1x2(out_dir: Path, callbacks: Sequence[L.Callback] = (), **options: Any) -> dict[str, Any]:
    """2 epochs of 4 steps at 1×2 with ``max_restarts=1``; what the tests compare."""
    strategy = MonarchModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=2, max_restarts=1, snapshot_dir=out_dir / "snapshots", **options
    )
    (out_dir / "snapshots").mkdir(parents=True)
    trainer, model = fit(strategy, 2, out_dir, epochs=2, limit_train_batches=4, callbacks=list(callbacks))
    return {
        "strategy": strategy,
        "losses": model.losses,
        "weights": trainer.strategy.gather_full_state_dict(),
        "snapshots": list((out_dir / "snapshots").iterdir()),
    }


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _fit_1x2(tmp_path_factory.mktemp("undisturbed"))


def _assert_bitwise(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    assert ours["losses"] == reference["losses"] and len(reference["losses"]) == 8
    assert set(ours["weights"]) == set(reference["weights"])
    for name, weight in reference["weights"].items():
        assert torch.equal(ours["weights"][name], weight), name


def test_a_killed_worker_under_1x2_is_replaced_and_the_run_ends_as_if_undisturbed(
    undisturbed: dict[str, Any], tmp_path: Path
) -> None:
    recovered = _fit_1x2(tmp_path, [KillRank1InEpoch1()])
    assert recovered["strategy"].restarts == 1 and undisturbed["strategy"].restarts == 0
    _assert_bitwise(recovered, undisturbed)
    assert recovered["snapshots"] == [], "the stage left its snapshots behind"


def test_a_fit_after_a_rehearsal_equals_a_fit_without_one(undisturbed: dict[str, Any], tmp_path: Path) -> None:
    rehearsed = _fit_1x2(tmp_path, rehearse=True)
    report = rehearsed["strategy"].rehearsal
    assert report is not None and [rank.rank for rank in report.ranks] == [0, 1] and report.checkpoint_mib > 0
    _assert_bitwise(rehearsed, undisturbed)
