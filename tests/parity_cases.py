"""The LightningModules and runs that the parity tests train under ``ddp`` and under ``monarch``.

This module is imported by the test process, by the Monarch workers (which unpickle these
classes), and by Lightning's ``ddp`` ranks through ``tests/ddp_reference.py``. ``run_case`` is the
one recipe both strategies follow; only the ``strategy`` string differs.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LambdaCallback,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    OnExceptionCheckpoint,
    SpikeDetection,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.tuner import Tuner
from monarch.job import ProcessJob
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_monarch import (
    MonarchFSDPStrategy,
    MonarchStrategy,
    WorkerError,
    observe_only,
    on_workers,
    stop_meshes,
    torch_settings,
)
from lightning_monarch.strategy import DEFAULT_MAX_AHEAD
from tests import compat_models as compat
from tests import models

SEED = 1234


@dataclass
class Case:
    """One parity run: what to train and how; ``run_case`` adds the shared Trainer arguments."""

    model: L.LightningModule
    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: list[L.Callback] = field(default_factory=list)
    datamodule: Optional[L.LightningDataModule] = None
    strategy_options: dict[str, Any] = field(default_factory=dict)
    worker_callbacks: list[L.Callback] = field(default_factory=list)
    loaders: dict[str, Any] = field(default_factory=dict)
    stages: tuple[str, ...] = ("fit",)
    #: Loggers after the shared ``CSVLogger``.
    loggers: list[Logger] = field(default_factory=list)
    #: ``False`` runs without the shared ``ModelCheckpoint`` and ``LearningRateMonitor``: no
    #: controller callback then waits for the workers within a training batch.
    default_callbacks: bool = True
    #: Hosts of 2 workers each: under ``monarch`` a ``ProcessJob`` with that many hosts, under
    #: ``ddp`` one host with all the processes (the same ranks and the same arithmetic).
    hosts: int = 1
    #: ``MonarchStrategy`` options that ``ddp`` has no counterpart for.
    monarch_options: dict[str, Any] = field(default_factory=dict)
    #: The workers shard the module: ``MonarchFSDPStrategy`` instead of ``MonarchStrategy``.
    sharded: bool = False
    #: Lightning's defaults on: the progress bar and the model summary (:data:`WITH_LIGHTNINGS_DEFAULTS`).
    defaults: bool = False
    #: ``trainer.save_checkpoint`` after ``fit`` (``final.ckpt``); under ``monarch`` an error when a
    #: worker callback adds to checkpoints (``tests/test_controller_callbacks.py``).
    save_after_fit: bool = True
    #: The exception the run ends with, raised on a worker (under ``monarch`` a ``WorkerError``
    #: naming it): then the logged rows and checkpoint files up to it are compared.
    fails: Optional[type] = None


CASES: dict[str, Callable[[Path], Case]] = {
    # the core issue: the shapes every project has
    "plain": lambda out: Case(models.Classifier(), stages=("fit", "validate", "test")),
    "epoch_end": lambda out: Case(models.EpochEndClassifier()),
    "accumulate_clip": lambda out: Case(models.Classifier(), {"accumulate_grad_batches": 3, "gradient_clip_val": 0.05}),
    "scheduler": lambda out: Case(
        models.SchedulerClassifier(), {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}
    ),
    "datamodule": lambda out: Case(models.DataModuleClassifier(), datamodule=models.ClassificationDataModule()),
    "custom_step": lambda out: Case(models.WarmupClassifier()),
    "early_stopping": lambda out: Case(
        models.Classifier(lr=0.02), {"max_epochs": 8}, [EarlyStopping(monitor="val_loss", min_delta=0.5, patience=1)]
    ),
    "hooks": lambda out: Case(_tracing(out / "trace.json"), {"accumulate_grad_batches": 2}),
    # drop-in compatibility: the wider Lightning surface
    "manual_gan": lambda out: Case(compat.ManualGAN(), strategy_options={"find_unused_parameters": True}),
    "plateau": lambda out: Case(compat.PlateauClassifier(), {"max_epochs": 4}),
    "one_cycle": lambda out: Case(compat.OneCycleClassifier()),
    "torchmetrics": lambda out: Case(compat.MetricsClassifier()),
    "trainer_access": lambda out: Case(compat.TrainerAwareClassifier()),
    "module_logging": lambda out: Case(compat.LoggingClassifier(), loggers=[compat.AllRankLogger()]),
    "bf16_mixed": lambda out: Case(models.Classifier(), {"precision": "bf16-mixed"}),
    "double": lambda out: Case(models.Classifier(), {"precision": "64-true"}),
    "resume": lambda out: Case(compat.CheckpointHooksClassifier(), {"max_epochs": 1}, stages=("fit", "resume")),
    "batch_reader": lambda out: Case(
        models.Classifier(), {"max_epochs": 1}, [compat.BatchReader()], stages=("fit", "test")
    ),
    "test_state": lambda out: Case(compat.TestKeepingClassifier(), {"max_epochs": 1}, stages=("fit", "test")),
    "datamodule_state": lambda out: Case(
        models.DataModuleClassifier(),
        {"max_epochs": 1},
        datamodule=compat.CountingDataModule(),
        stages=("fit", "resume"),
    ),
    "fit_again": lambda out: Case(
        models.Classifier(), {"max_epochs": 1}, stages=("fit", "fit_more", "test_best", "test_default")
    ),
    "gradient_callback": lambda out: Case(models.Classifier(), worker_callbacks=[compat.GradNormLogger()]),
    "backbone_finetuning": lambda out: Case(
        compat.FinetuneClassifier(),
        {"max_epochs": 3},
        [BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
    ),
    "accumulation_scheduler": lambda out: Case(
        models.Classifier(), {"max_epochs": 3}, [GradientAccumulationScheduler({1: 2, 2: 3})]
    ),
    "iterable_dataset": lambda out: Case(compat.StreamClassifier()),
    "loaders_passed_to_fit": lambda out: Case(
        models.Classifier(),
        loaders={
            "train_dataloaders": DataLoader(models.ClassificationData(64), batch_size=4, shuffle=True),
            "val_dataloaders": DataLoader(models.ClassificationData(24), batch_size=4),
        },
    ),
    # what real projects hold: NumPy and pandas objects in the module and the datamodule, and a
    # library's stream over a generator, which the controller iterates for every rank
    "numpy_and_pandas": lambda out: Case(compat.NumpyStatsClassifier(), datamodule=compat.FrameDataModule()),
    "generator_loaders": lambda out: Case(
        models.Classifier(),
        {"max_epochs": 2},
        loaders={"train_dataloaders": compat.WindowStream(), "val_dataloaders": compat.WindowStream(40, 2)},
    ),
    "custom_sampler": lambda out: Case(compat.CustomSamplerClassifier(), {"use_distributed_sampler": False}),
    "fast_dev_run": lambda out: Case(models.Classifier(), {"fast_dev_run": 2}),
    "overfit_batches": lambda out: Case(
        models.Classifier(), {"overfit_batches": 2, "max_epochs": 4, "check_val_every_n_epoch": 2}
    ),
    "configure_callbacks": lambda out: Case(compat.SelfStoppingClassifier(), {"max_epochs": 6}),
    "loop_flags": lambda out: Case(
        compat.TwoValLoaderClassifier(),
        {
            "limit_train_batches": 5,
            "val_check_interval": 2,
            "num_sanity_val_steps": 1,
            "max_steps": 9,
            "limit_val_batches": 3,
        },
    ),
    # the step's outputs arrive after the controller moved on (issue 4's deferred optimizer_step)
    "step_outputs": lambda out: Case(compat.StepOutputsClassifier(), {"max_epochs": 3}, [compat.OutputsRecorder()]),
    "stop_in_step": lambda out: Case(
        compat.StepOutputsClassifier(), {"max_epochs": 3, "enable_checkpointing": False}, default_callbacks=False
    ),
    # issue 14: what the correctness round found, and what the compatibility table claimed untested
    "no_optimizer": lambda out: Case(compat.NoOptimizerClassifier(), default_callbacks=False),
    "controller_collectives": lambda out: Case(models.Classifier(), {"max_epochs": 1}, [compat.CollectiveReader()]),
    "top_k_last": lambda out: Case(
        models.Classifier(),
        {"max_epochs": 4},
        [ModelCheckpoint(dirpath=str(out / "top_k"), monitor="val_loss", save_top_k=2, save_last=True)],
        default_callbacks=False,
    ),
    "checkpoint_every_n_steps": lambda out: Case(
        models.Classifier(),
        callbacks=[ModelCheckpoint(dirpath=str(out / "steps"), every_n_train_steps=3, save_top_k=-1)],
    ),
    "min_epochs": lambda out: Case(
        models.Classifier(lr=0.02),
        {"max_epochs": 6, "min_epochs": 3},
        [EarlyStopping(monitor="val_loss", min_delta=0.5, patience=0)],
    ),
    "min_steps": lambda out: Case(
        models.Classifier(lr=0.02),
        {"max_epochs": 6, "min_steps": 20},
        [EarlyStopping(monitor="val_loss", min_delta=0.5, patience=0)],
    ),
    "reload_dataloaders": lambda out: Case(
        compat.GrowingDataClassifier(), {"reload_dataloaders_every_n_epochs": 1, "max_epochs": 3}
    ),
    "lambda_callback": lambda out: Case(models.Classifier(), callbacks=[compat.EpochRecorder()]),
    # issue 55: Lightning's callbacks that touch the live model, given to the Trainer, run on the workers
    "ema_weights": lambda out: Case(models.Classifier(), callbacks=[EMAWeightAveraging()], save_after_fit=False),
    "pruning": lambda out: Case(
        models.Classifier(), callbacks=[ModelPruning("l1_unstructured", amount=0.3)], save_after_fit=False
    ),
    # issue 56: a monitored metric the ranks hold differently; each rank's EarlyStopping decides on its own
    "early_stopping_unsynced": lambda out: Case(
        compat.UnsyncedValidationClassifier(),
        {"max_epochs": 8},
        [EarlyStopping(monitor="val_loss_unsynced", min_delta=0.02, patience=1)],
    ),
    "top_k_unsynced": lambda out: Case(
        compat.UnsyncedScoreClassifier(),
        {"max_epochs": 4},
        [ModelCheckpoint(dirpath=str(out / "top_k"), monitor="val_score_unsynced", save_top_k=2)],
        default_callbacks=False,
    ),
    # issues 55 and 56: the learning-rate finder's trial runs on the workers, the found rate then trains
    "lr_finder": lambda out: Case(
        models.Classifier(lr=0.01), {"max_epochs": 4}, [LearningRateFinder(min_lr=1e-4, num_training_steps=20)]
    ),
    "lr_find_tuner": lambda out: Case(models.Classifier(lr=0.01), {"max_epochs": 4}, stages=("lr_find", "fit")),
    "argument_new": lambda out: Case(models.DataModuleClassifier(), datamodule=compat.ConditionDataModule()),
    "swa": lambda out: Case(
        models.Classifier(), {"max_epochs": 3}, [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)]
    ),
    "swa_step_scheduler": lambda out: Case(
        models.SchedulerClassifier(), {"max_epochs": 3}, [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)]
    ),
    "swa_batch_norm": lambda out: Case(
        compat.NormClassifier(), {"max_epochs": 3}, [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)]
    ),
    "spike_detection": lambda out: Case(models.Classifier(), callbacks=[SpikeDetection(warmup=2)]),
    "weights_lambda_on_workers": lambda out: Case(
        models.Classifier(), callbacks=[on_workers(LambdaCallback(on_train_epoch_start=compat.shrink_weights))]
    ),
    # issue 15: the workers run ahead; what the controller's callbacks see and do must not change
    "metric_views": lambda out: Case(
        models.Classifier(), {"max_epochs": 1}, [compat.ViewsRecorder(), observe_only(compat.ViewsRecorder())]
    ),
    "controller_stops": lambda out: Case(models.Classifier(), {"max_epochs": 3}, [compat.StopAtStep(7)]),
    "prediction_writer": lambda out: Case(
        models.Classifier(),
        {"max_epochs": 1},
        stages=("fit", "predict"),
        callbacks=[compat.RankPredictionWriter(str(out / "predictions"))],
    ),
    # issue 73: what the script sets for its process holds on every worker, as on every ddp rank
    "script_default_dtype": lambda out: _script_sets(lambda: torch.set_default_dtype(torch.float64), models.Classifier),
    "script_precision": lambda out: _script_sets(_precise_and_deterministic, compat.SettingsReadingClassifier),
    "script_class_attribute": lambda out: _script_sets(
        lambda: setattr(compat.ScaledClassifier, "scale", 0.5), compat.ScaledClassifier
    ),
    "script_module_setting": lambda out: _script_sets(
        lambda: setattr(compat, "LOGIT_SHIFT", 0.5), compat.ShiftedClassifier
    ),
    "loader_processes": lambda out: Case(compat.LoaderProcessesClassifier()),
}


#: Cases that end with a worker's exception: their ``ddp`` reference runs apart (its rank 0 kills
#: the other ranks' processes on the way out, which a following case would need).
FAILING_CASES: dict[str, Callable[[Path], Case]] = {
    "worker_fails": lambda out: Case(compat.FailsAtStep(6), {"max_epochs": 3}, fails=ValueError),
    # every rank raises, so every ddp rank reaches `OnExceptionCheckpoint` and its barrier: rank 0 writes
    "on_exception_checkpoint": lambda out: Case(
        compat.FailsAtStep(6, every_rank=True),
        {"max_epochs": 3},
        callbacks=[OnExceptionCheckpoint(dirpath=str(out / "checkpoints"))],
        fails=ValueError,
    ),
}


#: The cases run with Lightning's defaults on (the progress bar and the model summary), as users run
#: them: a third of :data:`CASES`, one of each kind. The others turn them off, to keep the output short.
WITH_LIGHTNINGS_DEFAULTS = frozenset(
    {
        "plain",
        "accumulate_clip",
        "datamodule",
        "early_stopping",
        "manual_gan",
        "torchmetrics",
        "resume",
        "gradient_callback",
        "iterable_dataset",
        "loop_flags",
        "step_outputs",
        "configure_callbacks",
        "no_optimizer",
        "min_steps",
        "reload_dataloaders",
    }
)


#: Cases on several hosts: their ``ddp`` reference needs its own process group size, so it runs
#: apart from :data:`CASES` (see ``tests/test_hosts.py``).
HOST_CASES: dict[str, Callable[[Path], Case]] = {
    "two_hosts": lambda out: Case(models.Classifier(), stages=("fit", "validate", "test"), hosts=2),
}


class TokenTransformer(L.LightningModule):
    """A 4-layer transformer encoder over generated token sequences (the next token is a fixed
    function of the current one), for sharded runs. ``losses`` records this rank's training loss
    per step."""

    def __init__(self, vocab: int = 32, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.losses: list[float] = []

    def _loss(self, batch: Any) -> torch.Tensor:
        tokens, targets = batch
        logits = self.head(self.encoder(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def _loader(self, size: int, seed: int, shuffle: bool) -> DataLoader:
        tokens = torch.randint(0, self.vocab, (size, 8), generator=torch.Generator().manual_seed(seed))
        return DataLoader(TensorDataset(tokens, (tokens * 3 + 1) % self.vocab), batch_size=4, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(48, 0, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(16, 1, shuffle=False)


class SelfShardingTransformer(TokenTransformer):
    """``TokenTransformer`` that shards itself in ``configure_model``, as under Lightning's
    ``ModelParallelStrategy`` (nothing to shard under ``ddp``, which has no device mesh)."""

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        for layer in self.encoder.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self, mesh=self.device_mesh["data_parallel"])


#: Cases whose workers shard the module (``MonarchFSDPStrategy``): DDP and FSDP2 reduce gradients
#: in another order, so ``tests/test_fsdp.py`` compares them to ``ddp`` to float tolerance.
SHARDED_CASES: dict[str, Callable[[Path], Case]] = {
    "fsdp_policy": lambda out: Case(
        TokenTransformer(),
        {"enable_checkpointing": False, "limit_val_batches": 2},
        default_callbacks=False,
        sharded=True,
        monarch_options={"fsdp_policy": {nn.TransformerEncoderLayer}},
    ),
    "fsdp_root_only": lambda out: Case(
        TokenTransformer(),
        {"enable_checkpointing": False, "max_epochs": 1},
        default_callbacks=False,
        sharded=True,
    ),
    "fsdp_configure_model": lambda out: Case(
        SelfShardingTransformer(),
        {"enable_checkpointing": False, "max_epochs": 1},
        default_callbacks=False,
        sharded=True,
    ),
}


def _script_sets(settings: Callable[[], Any], model: Callable[[], L.LightningModule]) -> Case:
    """A script that makes process-wide ``settings`` before it builds its ``model`` (nequip's
    ``set_global_state`` sets the default dtype so, PINA's data module changes a class's
    conditions); ``run_case`` puts them back after the run."""
    settings()
    return Case(model())


def _precise_and_deterministic() -> None:
    torch.set_float32_matmul_precision("medium")
    torch.use_deterministic_algorithms(True, warn_only=True)


def _tracing(path: Path) -> models.TracingClassifier:
    model = models.TracingClassifier()
    model.trace_path = str(path)
    return model


def _strategy(name: str, case: Case, hosts: Any) -> Any:
    """The strategy, with the case's options; under ``ddp`` worker callbacks are plain callbacks."""
    options = dict(case.strategy_options)
    if name == "monarch":
        options.update(case.monarch_options)
    if name == "monarch" and case.worker_callbacks:
        options["worker_callbacks"] = case.worker_callbacks
    if name == "monarch" and hosts is not None:
        options["hosts"] = hosts
    if name == "ddp":
        return DDPStrategy(**options) if options else name
    strategy = MonarchFSDPStrategy if case.sharded else MonarchStrategy
    return strategy(**options) if options else strategy.strategy_name


def _trainer(strategy: str, out_dir: Path, case: Case, hosts: Any = None, **overrides: Any) -> L.Trainer:
    defaults = [
        ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), monitor="val_loss", save_last=True),
        LearningRateMonitor(logging_interval="step"),
    ]
    callbacks = [
        *(defaults if case.default_callbacks else []),
        *case.callbacks,
        *(case.worker_callbacks if strategy == "ddp" else []),
    ]
    options = dict(
        max_epochs=2, enable_progress_bar=case.defaults, enable_model_summary=case.defaults, log_every_n_steps=2
    )
    return L.Trainer(
        strategy=_strategy(strategy, case, hosts),
        accelerator="cpu",
        devices=2 if strategy == "monarch" else 2 * case.hosts,
        num_nodes=case.hosts if strategy == "monarch" else 1,
        logger=[CSVLogger(str(out_dir), name="logs", version=0), *case.loggers],
        callbacks=callbacks,
        **{**options, **case.trainer, **overrides},
    )


def run_case(
    name: str, strategy: str, out_dir: Path, max_ahead: Optional[int] = DEFAULT_MAX_AHEAD
) -> Optional[dict[str, Any]]:
    """Run case ``name`` with ``strategy`` on 2 CPU devices (under ``monarch``, the workers up to
    ``max_ahead`` batches ahead of the controller); return what the parity tests compare.

    Returns ``None`` on the non-zero ranks of ``ddp``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    settings, scale, shift = torch_settings.read(), compat.ScaledClassifier.scale, compat.LOGIT_SHIFT
    try:
        return _run_case(name, strategy, out_dir, max_ahead)
    finally:  # the script's settings end with it (the suite runs on)
        torch_settings.apply(settings)
        compat.ScaledClassifier.scale, compat.LOGIT_SHIFT = scale, shift


def _run_case(name: str, strategy: str, out_dir: Path, max_ahead: Optional[int]) -> Optional[dict[str, Any]]:
    L.seed_everything(SEED)
    case = {**CASES, **FAILING_CASES, **HOST_CASES, **SHARDED_CASES}[name](out_dir)
    case.defaults = name in WITH_LIGHTNINGS_DEFAULTS
    if strategy == "monarch" and max_ahead != DEFAULT_MAX_AHEAD:
        case.monarch_options["max_ahead"] = max_ahead
    if strategy == "monarch" and case.hosts > 1:
        job = ProcessJob({"hosts": case.hosts})
        try:
            return _run(name, strategy, out_dir, case, job)
        finally:
            stop_meshes()  # the warm mesh lives on the job's hosts
            job.kill()
    return _run(name, strategy, out_dir, case, None)


def _run(name: str, strategy: str, out_dir: Path, case: Case, hosts: Any) -> Optional[dict[str, Any]]:
    model, datamodule = case.model, case.datamodule
    trainer = _trainer(strategy, out_dir, case, hosts)
    results: dict[str, Any] = {}
    for stage in case.stages:
        if stage == "fit" and case.fails is not None:
            return _failed_run(trainer, model, datamodule, case, out_dir)
        if stage == "lr_find":
            results["lr_find"] = _found(
                Tuner(trainer).lr_find(model, datamodule=datamodule, min_lr=1e-4, num_training=20)
            )
        elif stage == "fit":
            trainer.fit(model, datamodule=datamodule, **case.loaders)
            if case.trainer.get("enable_checkpointing", True) and case.save_after_fit:
                trainer.save_checkpoint(str(out_dir / "final.ckpt"))
        elif stage == "fit_more":
            trainer.fit_loop.max_epochs += 1
            trainer.fit(model, datamodule=datamodule)
        elif stage == "predict":
            trainer.predict(model, datamodule=datamodule, return_predictions=False)
        elif stage == "test_best":
            results["test_best"] = trainer.test(datamodule=datamodule, ckpt_path="best", verbose=False)
        elif stage == "test_default":  # no model, no ckpt_path: Lightning tests the best checkpoint
            results["test_default"] = trainer.test(datamodule=datamodule, verbose=False)
        elif stage == "resume":
            L.seed_everything(SEED)
            model = CASES[name](out_dir).model
            trainer = _trainer(strategy, out_dir, case, hosts, max_epochs=case.trainer["max_epochs"] + 1)
            trainer.fit(model, datamodule=datamodule, ckpt_path=str(out_dir / "checkpoints" / "last.ckpt"))
        else:
            results[stage] = getattr(trainer, stage)(model, datamodule=datamodule, verbose=False)
    if not trainer.is_global_zero:
        return None
    logs = out_dir / "logs" / "version_0"
    if hasattr(model, "losses"):
        results["losses"] = model.losses
    if hasattr(model, "kept"):
        results["kept"] = model.kept()
    results.update(
        weights={key: value.detach().cpu() for key, value in _final_weights(trainer, model).items()},
        callback_metrics=_floats(trainer.callback_metrics),
        logged_metrics=_floats(trainer.logged_metrics),
        progress_bar_metrics=dict(trainer.progress_bar_metrics),
        global_step=trainer.global_step,
        current_epoch=trainer.current_epoch,
        best_model_score=_floats({"best": getattr(trainer.checkpoint_callback, "best_model_score", None)}).get("best"),
        callback_records=[callback.record for callback in case.callbacks if hasattr(callback, "record")],
        lr_found=[
            _found(callback.optimal_lr) for callback in case.callbacks if isinstance(callback, LearningRateFinder)
        ],
        hparams_lr=model.hparams.get("lr"),
        # the script's process is rank 0 under ddp: its optimizers and schedulers after the stages
        optimizers=[_optimizer_view(optimizer) for optimizer in trainer.optimizers],
        lr_schedulers=[_scheduler_view(config.scheduler) for config in trainer.lr_scheduler_configs],
        # the script's process is rank 0 under ddp: its random number generators after the stages
        rng={
            "torch": torch.get_rng_state(),
            "numpy": pickle.dumps(np.random.get_state()),
            "python": random.getstate(),
        },
        csv=(logs / "metrics.csv").read_text() if (logs / "metrics.csv").exists() else None,
        hparams=(logs / "hparams.yaml").read_text() if (logs / "hparams.yaml").exists() else None,
    )
    return results


def _torch_classes(obj: Any) -> list[str]:
    """The classes of torch's own that ``obj`` is an instance of, as ``isinstance`` sees them."""
    return [cls.__qualname__ for cls in type(obj).__mro__ if cls.__module__.startswith("torch.optim")]


def _optimizer_view(optimizer: Any) -> dict[str, Any]:
    """What a script reads of an optimizer: its classes, and each param group's hyperparameters and
    number of parameters."""
    return {
        "classes": _torch_classes(optimizer),
        "groups": [
            {**{key: value for key, value in group.items() if key != "params"}, "params": len(group["params"])}
            for group in optimizer.param_groups
        ],
    }


def _scheduler_view(scheduler: Any) -> dict[str, Any]:
    """What a script reads of an LR scheduler: its classes, last learning rates and state."""
    last = scheduler.get_last_lr() if hasattr(scheduler, "get_last_lr") else None
    return {"classes": _torch_classes(scheduler), "last_lr": last, "state": scheduler.state_dict()}


def _found(finder: Any) -> tuple[Any, Any]:
    """What a learning-rate finder found: every rate it tried with its loss, and its suggestion."""
    return finder.results, finder.suggestion()


def _failed_run(
    trainer: L.Trainer, model: L.LightningModule, datamodule: Any, case: Case, out_dir: Path
) -> Optional[dict[str, Any]]:
    """A run that ends with ``case.fails`` on a worker: what rank 0 logged up to it, and how it failed."""
    try:
        trainer.fit(model, datamodule=datamodule)
    except (case.fails, WorkerError) as error:
        failed = error.failure.exception_type if isinstance(error, WorkerError) else type(error).__name__
    else:
        raise AssertionError(f"the run did not fail with {case.fails.__name__}")
    if not trainer.is_global_zero:
        return None
    logs = out_dir / "logs" / "version_0"
    return {"failed": failed, "csv": (logs / "metrics.csv").read_text() if (logs / "metrics.csv").exists() else None}


def _final_weights(trainer: L.Trainer, model: L.LightningModule) -> dict[str, Any]:
    """The trained weights: the module's, or under ``MonarchFSDPStrategy`` (where the controller's
    module holds none) gathered from the workers' shards."""
    if isinstance(trainer.strategy, MonarchFSDPStrategy):
        return trainer.strategy.gather_full_state_dict()
    return model.state_dict()


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items() if value is not None}


def comparable_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's contents without the parts that name the run's own folder."""
    checkpoint = torch.load(path, weights_only=False)
    for state in checkpoint.get("callbacks", {}).values():
        for key in ("dirpath", "best_model_path", "last_model_path", "kth_best_model_path", "best_k_models"):
            state.pop(key, None)
    return checkpoint
