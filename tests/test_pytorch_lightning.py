"""Existing code in the ``pytorch_lightning`` namespace trains under ``strategy="monarch"``.

Most tests here are the suite's own tests, imported from ``tests.pl``: the same test modules in
``pytorch_lightning``'s namespace (``tests/__init__.py``), so that their models subclass
``pytorch_lightning.LightningModule``, their Trainers are ``pytorch_lightning.Trainer`` and their
``ddp`` reference is ``pytorch_lightning``'s own. The rest is written for ``pytorch_lightning``
directly, as a library that imports it would be: a Trainer built from a config with the strategy
by name, both namespaces in one process, and the mixes that must fail.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import pytorch_lightning
import torch
import yaml

import lightning_monarch
import lightning_monarch.pl
from lightning_monarch import cli, namespaces
from tests.conftest import worker_processes
from tests.models import Classifier
from tests.pl import compat_models as pl_compat_models
from tests.pl import models as pl_models
from tests.pl import test_cli as pl_cli
from tests.pl import test_controller_callbacks as pl_controller_callbacks
from tests.pl import test_fsdp as pl_fsdp
from tests.pl import test_layout as pl_layout
from tests.pl import test_mesh_stats as pl_mesh_stats
from tests.pl import test_parity as pl_parity
from tests.pl import test_preflight as pl_preflight
from tests.pl import test_recovery as pl_recovery
from tests.pl import test_rehearsal as pl_rehearsal
from tests.pl import test_run_ahead as pl_run_ahead
from tests.pl import test_stages as pl_stages
from tests.pl.conftest import run_ddp_reference
from tests.pl.parity_cases import CASES

pytestmark = pytest.mark.timeout(900)

#: The parity cases run again in ``pytorch_lightning``'s namespace: a third of ``CASES``, with the
#: progress bar and model summary on (``plain``), ``ModelCheckpoint``'s top-k and ``last.ckpt``
#: (every case with the default callbacks, ``top_k_last``, ``checkpoint_every_n_steps``), a resume,
#: manual optimization (``manual_gan``), run-ahead views, per-rank predictions, and Lightning's
#: callbacks that run on the workers (``backbone_finetuning`` to ``weights_lambda_on_workers``),
#: each rank's early stopping and top k on an unsynced metric, the learning-rate finder, and
#: objects whose ``__new__`` wants arguments.
PL_CASES = (
    "plain",
    "accumulate_clip",
    "datamodule",
    "early_stopping",
    "hooks",
    "manual_gan",
    "torchmetrics",
    "resume",
    "fit_again",
    "gradient_callback",
    "accumulation_scheduler",
    "lambda_callback",
    "iterable_dataset",
    "loop_flags",
    "step_outputs",
    "top_k_last",
    "checkpoint_every_n_steps",
    "metric_views",
    "prediction_writer",
    "backbone_finetuning",
    "pruning",
    "ema_weights",
    "swa_batch_norm",
    "spike_detection",
    "weights_lambda_on_workers",
    "early_stopping_unsynced",
    "top_k_unsynced",
    "lr_finder",
    "argument_new",
)
#: The sharded case, compared to ``ddp`` as ``tests/test_fsdp.py`` compares it, to float tolerance.
SHARDED = "fsdp_policy"


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pytorch_lightning``'s own ``strategy="ddp"`` on the cases, in one reference process."""
    return run_ddp_reference(tmp_path_factory.mktemp("pl-ddp"), [*PL_CASES, SHARDED])


def test_the_mirrored_suite_is_pytorch_lightnings() -> None:
    assert len(PL_CASES) * 3 >= len(CASES) and set(PL_CASES) <= set(CASES)
    assert issubclass(pl_models.Classifier, pytorch_lightning.LightningModule)
    assert not issubclass(pl_models.Classifier, L.LightningModule)
    assert pl_parity.run_case.__module__ == "tests.pl.parity_cases"
    assert importlib.import_module("tests.pl.parity_cases").L is pytorch_lightning
    assert issubclass(lightning_monarch.pl.MonarchStrategy, pytorch_lightning.strategies.ParallelStrategy)
    assert pytorch_lightning.strategies.StrategyRegistry["monarch"]["strategy"] is lightning_monarch.pl.MonarchStrategy
    assert (
        pytorch_lightning.strategies.StrategyRegistry["monarch_fsdp"]["strategy"]
        is lightning_monarch.pl.MonarchFSDPStrategy
    )


@pytest.mark.parametrize("case", PL_CASES)
def test_same_results_as_pytorch_lightnings_ddp(case: str, ddp_results: Path, tmp_path: Path) -> None:
    """Bitwise: weights, metrics, CSV rows, checkpoints, hook order and predictions."""
    pl_parity.assert_same_as_ddp(case, ddp_results, tmp_path)


def test_sharded_training_matches_pytorch_lightnings_ddp(ddp_results: Path, tmp_path: Path) -> None:
    pl_fsdp.test_sharded_training_matches_ddp(SHARDED, ddp_results, tmp_path)


def test_killed_worker_is_replaced_and_the_run_ends_as_if_undisturbed(tmp_path: Path, caplog: Any) -> None:
    pl_recovery.test_killed_worker_is_replaced_and_the_run_ends_as_if_undisturbed(
        tmp_path, caplog, 8, "the snapshot at the start of epoch 1", False
    )


def test_predict_returns_the_whole_dataset_in_order() -> None:
    pl_stages.test_predict_returns_the_whole_dataset_in_order()


def test_a_fit_after_a_rehearsal_equals_a_fit_without_one(tmp_path: Path) -> None:
    pl_rehearsal.test_a_fit_after_a_rehearsal_equals_a_fit_without_one(tmp_path, pl_rehearsal.Classifier, False)


def test_mesh_stats_monitor_names_a_straggler(tmp_path: Path) -> None:
    pl_mesh_stats.test_a_straggler_is_named(pl_mesh_stats.StragglerClassifier, tmp_path)


def test_lightnings_device_and_throughput_monitors_log_from_the_workers(tmp_path: Path) -> None:
    pl_mesh_stats.test_lightnings_device_and_throughput_monitors_log_from_the_workers(tmp_path)


@pytest.mark.parametrize("rich", [False, True], ids=["tqdm", "rich"])
def test_progress_bar_and_summary_show_the_model_once(rich: bool, capfd: Any, caplog: Any) -> None:
    callbacks = pytorch_lightning.callbacks
    bar, summary = (
        (callbacks.RichProgressBar, callbacks.RichModelSummary)
        if rich
        else (callbacks.TQDMProgressBar, callbacks.ModelSummary)
    )
    pl_controller_callbacks.test_progress_bar_and_summary_show_the_model_once(bar, summary, capfd, caplog)


def test_max_time_stops_the_workers() -> None:
    pl_controller_callbacks.test_max_time_stops_the_workers()


def test_preflight_gives_every_problem_of_every_worker_in_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    pl_preflight.test_every_problem_of_every_worker_in_one_error(monkeypatch)


def test_the_workers_lead_by_max_ahead_batches_at_most() -> None:
    pl_run_ahead.test_the_workers_lead_by_max_ahead_batches_at_most(3)


def test_workers_run_pytorch_lightning_and_import_no_controller_module(tmp_path: Path) -> None:
    pl_layout.test_workers_import_no_controller_module_and_install_nothing(tmp_path)


@pytest.mark.parametrize("form", list(pl_cli.STRATEGIES))
def test_lightning_cli(form: str, tmp_path: Path) -> None:
    """``pytorch_lightning.cli.LightningCLI``: ``trainer.strategy: monarch``, a ``class_path``, and
    ``--trainer.strategy monarch`` on the command line."""
    pl_cli.test_cli_config(form, tmp_path)


def test_the_command_rehearses_a_pytorch_lightning_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``lightning-monarch rehearse`` finds the config's namespace from its model's class."""
    config = tmp_path / "config.yaml"
    config.write_text(pl_rehearsal.CONFIG)
    assert "tests.pl.models.Classifier" in pl_rehearsal.CONFIG
    assert cli.main(["rehearse", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["projection"]["epochs"] == 5


#: A library's own config, as a library that builds the Trainer itself reads it.
LIBRARY_CONFIG = """
trainer:
  strategy: monarch
  accelerator: cpu
  devices: 2
  max_steps: 4
  limit_val_batches: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
"""


def build_and_train(config: str, model: pytorch_lightning.LightningModule) -> pytorch_lightning.Trainer:
    """What a library does that builds ``pytorch_lightning``'s Trainer from its own config."""
    trainer = pytorch_lightning.Trainer(**yaml.safe_load(config)["trainer"])
    trainer.fit(model)
    return trainer


def test_a_library_builds_the_trainer_with_the_strategy_by_name_from_its_config() -> None:
    assert isinstance(yaml.safe_load(LIBRARY_CONFIG)["trainer"]["strategy"], str)
    model = pl_models.Classifier()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = build_and_train(LIBRARY_CONFIG, model)
    assert type(trainer.strategy) is lightning_monarch.pl.MonarchStrategy
    assert trainer.global_step == 4
    assert any(not torch.equal(value, before[key]) for key, value in model.state_dict().items())


def _fit(trainer_class: type, model: Any) -> dict[str, torch.Tensor]:
    L.seed_everything(1234)
    trainer = trainer_class(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    assert trainer.global_step == 6
    return model.state_dict()


def test_one_process_trains_in_both_namespaces_on_the_same_hosts_workers() -> None:
    """A ``lightning.pytorch`` module, then a ``pytorch_lightning`` one, as a notebook would: the
    second stage stops the first namespace's warm mesh (one idle mesh at a time), and the two
    namespaces' runs of the same seeded module are equal bit for bit."""
    L.seed_everything(1234)
    ours = _fit(L.Trainer, Classifier())
    warm = set(lightning_monarch.controller.mesh.pool.MESHES.worker_pids())
    assert len(warm) == 2
    L.seed_everything(1234)
    theirs = _fit(pytorch_lightning.Trainer, pl_models.Classifier())
    assert not warm & {process.pid for process in worker_processes()}, "the first namespace's workers still run"
    assert len(lightning_monarch.pl.controller.mesh.pool.MESHES.worker_pids()) == 2
    assert lightning_monarch.controller.mesh.pool.MESHES.worker_pids() == []
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key
    lightning_monarch.stop_meshes()
    assert lightning_monarch.pl.controller.mesh.pool.MESHES.worker_pids() == []


def test_a_strategy_of_the_other_namespace_is_refused_naming_both() -> None:
    started = len(worker_processes())
    with pytest.raises(TypeError, match=r"is lightning_monarch\.MonarchStrategy, made for `lightning\.pytorch`"):
        pytorch_lightning.Trainer(strategy=lightning_monarch.MonarchStrategy(), accelerator="cpu", devices=2)
    with pytest.raises(TypeError, match=r"Use `lightning_monarch\.MonarchFSDPStrategy` with `lightning\.pytorch`"):
        L.Trainer(strategy=lightning_monarch.pl.MonarchFSDPStrategy(), accelerator="cpu", devices=2)
    assert len(worker_processes()) == started


def test_a_module_of_the_other_namespace_gets_lightnings_own_error() -> None:
    started = len(worker_processes())
    trainer = L.Trainer(strategy="monarch", accelerator="cpu", devices=2, logger=False, max_steps=1)
    with pytest.raises(TypeError, match="`model` must be a `LightningModule`"):
        trainer.fit(pl_models.Classifier())
    assert len(worker_processes()) == started


def test_shared_modules_are_one_module_and_names_map_both_ways() -> None:
    assert importlib.import_module("lightning_monarch.pl.wire.codec") is importlib.import_module(
        "lightning_monarch.wire.codec"
    )
    assert importlib.import_module("lightning_monarch.pl._compat.monarch") is lightning_monarch._compat.monarch
    assert importlib.import_module("lightning_monarch.pl.errors") is lightning_monarch.errors
    for name in ("WorkerError", "MeshFailureError", "HostsLostError", "UnreachableHostsError", "DivergenceError"):
        assert getattr(lightning_monarch.pl, name) is getattr(lightning_monarch, name)
    for misconfiguration in (
        pytorch_lightning.utilities.exceptions.MisconfigurationException,
        L.pytorch.utilities.exceptions.MisconfigurationException,
    ):
        assert issubclass(lightning_monarch.UnreachableHostsError, misconfiguration)
    assert namespaces.counterpart("lightning_monarch.strategy") == "lightning_monarch.pl.strategy"
    assert namespaces.counterpart("lightning_monarch.pl") == "lightning_monarch"
    assert namespaces.namespace_of("tests.pl.models") is namespaces.PYTORCH_LIGHTNING
    assert namespaces.namespace_of_class(pl_models.Classifier) is namespaces.PYTORCH_LIGHTNING
    assert namespaces.namespace_of_class(Classifier) is namespaces.LIGHTNING


def test_a_pytorch_lightning_runs_worker_failure_is_lightning_monarchs_one_error_class() -> None:
    trainer = pytorch_lightning.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        logger=False,
        max_steps=3,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(lightning_monarch.WorkerError, match="failing on purpose at step 1") as error:
        trainer.fit(pl_compat_models.FailsAtStep(1))
    # one class for both namespaces, made a subclass of the worker's exception's class too
    assert lightning_monarch.pl.WorkerError is lightning_monarch.WorkerError
    assert type(error.value).__bases__ == (lightning_monarch.WorkerError, ValueError)


def test_a_public_name_given_the_other_namespaces_objects_names_both() -> None:
    trainer = pytorch_lightning.Trainer(strategy="monarch", accelerator="cpu", devices=2, max_steps=2, logger=False)
    with pytest.raises(
        TypeError,
        match=r"`lightning_monarch\.rehearse` is for `lightning\.pytorch`.*Use `lightning_monarch\.pl\.rehearse`",
    ):
        lightning_monarch.rehearse(trainer, pl_models.Classifier())
    with pytest.raises(TypeError, match=r"Use `lightning_monarch\.observe_only` with `lightning\.pytorch`"):
        lightning_monarch.pl.observe_only(L.pytorch.callbacks.LearningRateMonitor())
    monitored = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_steps=2,
        callbacks=[lightning_monarch.pl.MeshStatsMonitor()],
    )
    with pytest.raises(TypeError, match=r"Use `lightning_monarch\.MeshStatsMonitor` with `lightning\.pytorch`"):
        monitored.fit(Classifier())
