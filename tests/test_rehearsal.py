"""Rehearsal: a few real steps on the workers before a ``fit``, with a report, and nothing of it in
the ``fit`` that follows. Real workers (2 CPU processes, the warm mesh), Lightning's real Trainer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_monarch import (
    MonarchFSDPStrategy,
    MonarchModelParallelStrategy,
    MonarchStrategy,
    RehearsalError,
    cli,
    rehearse,
)
from lightning_monarch.controller.features.rehearsal import (
    Projection,
    RankRehearsal,
    RehearsalReport,
    _copy,
    _warnings,
    rehearsal_twin,
)
from lightning_monarch.controller.mesh.pool import MESHES
from tests.models import ClassificationDataModule, Classifier, DataModuleClassifier
from tests.parity_cases import comparable_checkpoint

pytestmark = pytest.mark.timeout(300)

SEED = 77


def _fit(out_dir: Path, model_class: type[Classifier], with_datamodule: bool, **strategy: Any) -> dict[str, Any]:
    """A seeded fit on 2 CPU workers with a logger and checkpoints; what the test compares."""
    L.seed_everything(SEED)
    model = model_class()
    monarch = MonarchStrategy(**strategy)
    trainer = L.Trainer(
        strategy=monarch,
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        logger=CSVLogger(str(out_dir), name="logs", version=0),
        callbacks=[ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), monitor="val_loss", save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=ClassificationDataModule() if with_datamodule else None)
    return {
        "weights": {key: value.clone() for key, value in model.state_dict().items()},
        "metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "csv": (out_dir / "logs" / "version_0" / "metrics.csv").read_text(),
        "last": comparable_checkpoint(out_dir / "checkpoints" / "last.ckpt"),
        "rehearsal": monarch.rehearsal,
        "global_step": trainer.global_step,
    }


@pytest.mark.parametrize(
    ("model_class", "with_datamodule"),
    [(Classifier, False), (DataModuleClassifier, True)],
    ids=["module's loaders", "datamodule"],
)
def test_a_fit_after_a_rehearsal_equals_a_fit_without_one(
    tmp_path: Path, model_class: type[Classifier], with_datamodule: bool
) -> None:
    plain = _fit(tmp_path / "plain", model_class, with_datamodule)
    rehearsed = _fit(tmp_path / "rehearsed", model_class, with_datamodule, rehearse=True)

    report = rehearsed["rehearsal"]
    assert report is not None and [rank.rank for rank in report.ranks] == [0, 1]
    assert report.projection.batches_per_epoch == 6 and report.projection.steps_per_epoch == 3  # 96 / 8 / 2 ranks
    assert report.projection.epochs == 2 and report.projection.val_batches_per_epoch == 3
    assert report.step_s > 0 and report.val_batch_s is not None and report.checkpoint_mib > 0
    assert all(rank.memory_after_first_step_mib is not None for rank in report.ranks)
    for key, value in plain["weights"].items():
        assert torch.equal(rehearsed["weights"][key], value), key
    assert rehearsed["global_step"] == plain["global_step"] == 6
    assert rehearsed["metrics"] == plain["metrics"]
    assert rehearsed["csv"] == plain["csv"]
    assert str(rehearsed["last"]) == str(plain["last"])


def _trainer(**options: Any) -> L.Trainer:
    return L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def test_a_rank_past_the_memory_it_may_use_is_reported_with_the_fix() -> None:
    L.seed_everything(SEED)
    report = rehearse(_trainer(), Classifier(), memory_limit_gib=0.05)  # 51 MiB: less than a worker process
    assert len(report.ranks) == 2
    assert all(rank.memory_share > 1 and rank.memory_total_mib == pytest.approx(51.2) for rank in report.ranks)
    memory = [warning for warning in report.warnings if "of its host memory" in warning]
    assert len(memory) == 2 and "Lower the batch size" in memory[0] and "precision='bf16-mixed'" in memory[0]
    table = report.table()
    assert table.splitlines()[0].split()[:3] == ["rank", "host", "peak"] and "warning: rank 0 peaks at" in table
    assert json.loads(json.dumps(report.as_dict()))["projection"]["epochs"] == 3


class TransientPeak(Classifier):
    """Fills a 256 MiB scratch tensor in every ``training_step`` and frees it before the step ends."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        torch.ones(64 * 2**20).sum()  # 64 Mi float32: 256 MiB, freed at once
        return super().training_step(batch, batch_idx)


def test_the_peak_counts_memory_freed_within_a_step() -> None:
    L.seed_everything(SEED)
    plain = rehearse(_trainer(), Classifier())
    peaked = rehearse(_trainer(), TransientPeak())
    for calm, busy in zip(plain.ranks, peaked.ranks, strict=True):
        assert busy.memory_peak_mib > calm.memory_peak_mib + 200  # not seen at a batch's end


class FailsOnRank1(Classifier):
    """Raises in ``training_step`` on rank 1's second batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx == 1:
            raise RuntimeError("rank 1 ran out of its budget")
        return super().training_step(batch, batch_idx)


def test_a_failing_rehearsal_names_the_rank_the_hook_and_the_memory() -> None:
    with pytest.raises(
        RehearsalError,
        match=r"worker rank 1 raised RuntimeError in `module.training_step` with \d+ MiB of memory in use: rank 1 ran",
    ):
        rehearse(_trainer(), FailsOnRank1())


class FailsEverywhere(Classifier):
    """Raises in ``training_step`` on every rank's second batch, as an out-of-memory error does on
    identical replicas."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise MemoryError("out of memory in the forward pass")
        return super().training_step(batch, batch_idx)


def test_after_a_rehearsal_that_failed_on_every_rank_the_same_workers_try_again() -> None:
    trainer = _trainer()
    with pytest.raises(RehearsalError, match=r"worker rank \d raised MemoryError in `module.training_step`"):
        rehearse(trainer, FailsEverywhere())
    kept = MESHES.worker_pids()
    assert len(kept) == 2  # kept warm, not stopped
    report = rehearse(trainer, Classifier())
    assert len(report.ranks) == 2 and MESHES.worker_pids() == kept


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"steps": 1}, r"`rehearse\(steps=1\)`: give a whole number of optimizer steps >= 2"),
        ({"memory_limit_gib": 0}, r"`rehearse\(memory_limit_gib=0\)`: give a number of GiB > 0"),
    ],
)
def test_bad_rehearsal_arguments_are_refused_with_the_fix(options: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        rehearse(_trainer(), Classifier(), **options)


def test_a_straggler_and_costly_checkpoints_are_warned_of_with_the_fix() -> None:
    ranks = [
        RankRehearsal(
            rank=0, memory_peak_mib=100, memory_after_first_step_mib=90, memory_total_mib=1000, training_step_ms=10.0
        ),
        RankRehearsal(
            rank=1, memory_peak_mib=100, memory_after_first_step_mib=90, memory_total_mib=1000, training_step_ms=12.5
        ),
    ]
    projection = Projection(
        batches_per_epoch=10, steps_per_epoch=10, val_batches_per_epoch=0, epochs=2, checkpoints=3, epoch_s=1.0,
        run_s=2.9, checkpoint_share=0.31,
    )  # fmt: skip
    report = RehearsalReport(ranks, "GPU", 0.1, 0.1, None, 512.0, 0.3, projection)
    straggler, checkpoints = _warnings(report)
    assert "rank 1's training_step takes 12.5 ms, rank 0's 10.0 ms" in straggler and "unbalanced sampler" in straggler
    assert "checkpoints would take 31% of the run (3 of 300.0 ms each)" in checkpoints and "save_top_k" in checkpoints
    within = [dataclasses.replace(rank, training_step_ms=11.9) if rank.rank else rank for rank in ranks]  # 19% apart
    assert (
        _warnings(
            dataclasses.replace(report, ranks=within, projection=dataclasses.replace(projection, checkpoint_share=0.1))
        )
        == []
    )


def test_the_rehearsals_strategy_is_the_runs_without_restarts_or_elastic_training() -> None:
    strategy = MonarchStrategy(
        max_restarts=2, max_ahead=4, step_timeout=60.0, rehearse=True, find_unused_parameters=True
    )
    twin = rehearsal_twin(strategy._settings())
    assert type(twin) is MonarchStrategy and twin._rehearsing and not strategy._rehearsing
    assert twin._arguments() == {**strategy._arguments(), "max_restarts": 0, "rehearse": False}
    sharded = MonarchFSDPStrategy(fsdp_policy={torch.nn.Linear}, cpu_offload=True, keep_warm=False)
    sharded_twin = rehearsal_twin(sharded._settings())
    assert type(sharded_twin) is MonarchFSDPStrategy
    assert sharded_twin._arguments() == {**sharded._arguments(), "keep_warm": True}  # the run takes its mesh
    two_d = MonarchModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=2, save_distributed_checkpoint=False
    )
    two_d_twin = rehearsal_twin(two_d._settings())
    assert type(two_d_twin) is MonarchModelParallelStrategy and two_d_twin._arguments() == two_d._arguments()


class KeepsItsArgument(MonarchStrategy):
    def __init__(self, label: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.label = label


class DropsItsArgument(MonarchStrategy):
    def __init__(self, label: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)


def test_a_subclass_argument_goes_to_the_twin_or_its_absence_is_named() -> None:
    """The twin is made from the constructors' signatures: a user's subclass's own argument comes
    along, and one the subclass did not keep as an attribute is named with the fix."""
    twin = rehearsal_twin(KeepsItsArgument(label="run-7", max_ahead=2)._settings())
    assert type(twin) is KeepsItsArgument and twin.label == "run-7" and twin.max_ahead == 2
    with pytest.raises(AttributeError, match=r"`DropsItsArgument\(label=\.\.\.\)`: .* \(`self.label = label`\)"):
        rehearsal_twin(DropsItsArgument(label="run-7")._settings())


def test_the_rehearsals_copies_leave_the_trainers_out() -> None:
    datamodule, trainer, earlier = ClassificationDataModule(), _trainer(), _trainer()
    datamodule.trainer = earlier  # attached by an earlier fit
    copied = _copy(datamodule, trainer)
    assert copied is not datamodule and copied.trainer is None and datamodule.trainer is earlier


def test_a_rehearsal_needs_the_monarch_strategy() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(TypeError, match=r"Build the Trainer with `strategy='monarch'`"):
        rehearse(trainer, Classifier())


CONFIG = """
model:
  class_path: tests.models.Classifier
trainer:
  strategy: monarch
  accelerator: cpu
  devices: 2
  max_epochs: 5
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
"""


@pytest.mark.parametrize("json_output", [False, True], ids=["table", "json"])
def test_the_command_rehearses_a_config(tmp_path: Path, capsys: pytest.CaptureFixture, json_output: bool) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    assert cli.main(["rehearse", "--config", str(config), *(["--json"] if json_output else [])]) == 0
    out = capsys.readouterr().out
    if json_output:
        assert json.loads(out)["projection"]["epochs"] == 5
    else:
        assert out.splitlines()[0].split()[:2] == ["rank", "host"] and "projected:" in out


def test_the_command_refuses_a_config_without_the_monarch_strategy(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("strategy: monarch", "strategy: auto").replace("devices: 2", "devices: 1"))
    assert cli.main(["rehearse", "--config", str(config)]) == 2
    assert "Set `trainer.strategy: monarch` in the config" in capsys.readouterr().err
