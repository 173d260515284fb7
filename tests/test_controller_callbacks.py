"""Callbacks that run once, on the controller, with values from the workers: progress bars, model
summaries and Timer; collectives a controller callback calls, and what cannot be as under ``ddp``;
worker callbacks' checkpoint hooks; module attributes and loggers that cannot travel; and
``torch.compile`` applied on the workers in ``configure_model``."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from finetuning_scheduler import FinetuningScheduler, FTSCheckpoint, FTSEarlyStopping
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    EMAWeightAveraging,
    LambdaCallback,
    LearningRateMonitor,
    ModelPruning,
    ModelSummary,
    RichModelSummary,
    RichProgressBar,
    Timer,
    TQDMProgressBar,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch import DivergenceError, MonarchStrategy, on_controller
from lightning_monarch.controller.loop.callbacks import CallbackPlacement
from tests.compat_models import AllRankLogger, shrink_weights
from tests.models import Classifier
from tests.parity_cases import SEED

pytestmark = pytest.mark.timeout(120)


def _fit(model: L.LightningModule, **kwargs: Any) -> L.Trainer:
    options = dict(
        strategy="monarch", accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False
    )
    trainer = L.Trainer(**{**options, **kwargs})
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize(("bar", "summary"), [(TQDMProgressBar, ModelSummary), (RichProgressBar, RichModelSummary)])
def test_progress_bar_and_summary_show_the_model_once(
    bar: type, summary: type, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    model = Classifier()
    with caplog.at_level("INFO"):
        _fit(model, callbacks=[bar(), summary()], limit_train_batches=3, limit_val_batches=1)
    out, err = capfd.readouterr()
    text = out + err + caplog.text
    total = sum(p.numel() for p in model.parameters())
    assert f"{total}" in text and "Trainable params" in text
    assert text.count("Trainable params") == 1, "the summary is printed once, by the controller"
    assert "train_loss" in text, "the progress bar shows the workers' logged values"


class SlowClassifier(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


def test_max_time_stops_the_workers() -> None:
    trainer = _fit(
        SlowClassifier(), max_epochs=1000, max_time={"seconds": 3}, enable_progress_bar=False, num_sanity_val_steps=0
    )
    assert 0 < trainer.global_step < 1000 * 6
    assert trainer.state.status == "finished"


class CompiledClassifier(Classifier):
    def configure_model(self) -> None:
        self.net = torch.compile(self.net, backend="eager")


def test_compile_in_configure_model_runs_on_the_workers() -> None:
    weights = []
    for model_class in (Classifier, CompiledClassifier):
        L.seed_everything(SEED)
        model = model_class()
        _fit(model, enable_progress_bar=False, limit_train_batches=4, limit_val_batches=1)
        weights.append({key.replace("_orig_mod.", ""): value for key, value in model.state_dict().items()})
    assert type(model.net).__name__ == "OptimizedModule", "the controller's module has the workers' structure"
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])


class ReducesItsOwnTensor(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.strategy.reduce(torch.tensor(1.0))


class DecidesOnItsMonitor(L.Callback):
    """Decides on a metric each rank holds its own value of (``train_loss_epoch``, unsynced)."""

    monitor = "train_loss_epoch"

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.strategy.reduce_boolean_decision(True)


class BroadcastsFromRank1(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.strategy.broadcast("mine", src=1)


@pytest.mark.parametrize(
    ("callback", "match"),
    [
        (
            ReducesItsOwnTensor(),
            r"`trainer.strategy.reduce\(..., reduce_op='mean'\)` on the controller under"
            r" strategy='monarch': .* this tensor is not one the workers know",
        ),
        (BroadcastsFromRank1(), r"`trainer.strategy.broadcast\(obj, src=1\)` on the controller .* has no rank 1"),
        (
            DecidesOnItsMonitor(),
            r"`DecidesOnItsMonitor\(monitor='train_loss_epoch'\)` decides on the"
            r" controller from rank 0's .*\(rank 0: [\d.]+, rank 1: [\d.]+\).*`sync_dist=True`",
        ),
    ],
    ids=["reduce-of-a-controller-tensor", "broadcast-from-rank-1", "decision-on-an-unsynced-metric"],
)
def test_collectives_that_cannot_be_what_ddp_gives_raise(callback: L.Callback, match: str, tmp_path: Path) -> None:
    """What a controller callback cannot get as under ``ddp`` raises, naming the fix; what it can is
    the parity cases ``controller_collectives``, ``early_stopping_unsynced`` and ``top_k_unsynced``."""
    with pytest.raises(RuntimeError, match=match):
        _fit(
            Classifier(),
            callbacks=[callback],
            enable_progress_bar=False,
            limit_train_batches=2,
            limit_val_batches=1,
            enable_checkpointing=False,
            default_root_dir=tmp_path,
            max_epochs=1,
        )


@pytest.mark.parametrize("given_to", ["Trainer", "MonarchStrategy"])
def test_a_checkpoint_after_the_stage_that_worker_callbacks_would_add_to_raises(tmp_path: Path, given_to: str) -> None:
    averaging = EMAWeightAveraging()
    trainer = _fit(
        Classifier(),
        strategy=MonarchStrategy(worker_callbacks=[averaging] if given_to == "MonarchStrategy" else []),
        callbacks=[averaging] if given_to == "Trainer" else [],
        enable_progress_bar=False,
        limit_train_batches=2,
        limit_val_batches=0,
    )
    with pytest.raises(
        RuntimeError,
        match=r"the worker callbacks \['EMAWeightAveraging'\] add to every checkpoint"
        r" in `on_save_checkpoint`.*from a callback's `on_fit_end`",
    ):
        trainer.save_checkpoint(tmp_path / "after.ckpt")


class ReadsTheWeights(L.Callback):
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("weight_norm", torch.stack([parameter.norm() for parameter in pl_module.parameters()]).sum())


class CountsTheParameters(L.Callback):
    """Reads only the parameters' shapes, which the controller's mirror has: it may stay there."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.count = sum(parameter.numel() for parameter in pl_module.parameters())


def _set_learning_rate(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    trainer.optimizers[0].param_groups[0]["lr"] = 0.5


@pytest.mark.parametrize(
    ("callback", "match"),
    [
        (
            LambdaCallback(on_train_epoch_start=shrink_weights),
            r"`LambdaCallback.on_train_epoch_start` touched `net.0.weight` \(`mul_`\) on the controller .*"
            r" never reaches the workers.*`Trainer\(callbacks=\[lightning_monarch.on_workers\(LambdaCallback\(...\)\)\]\)`",
        ),
        (
            ReadsTheWeights(),
            r"`ReadsTheWeights.on_train_epoch_end` touched `net.0.weight` \(`norm`\).*not what each ddp",
        ),
        (
            LambdaCallback(
                on_train_batch_start=lambda trainer, module, batch, index: _set_learning_rate(trainer, module)
            ),
            r"`LambdaCallback.on_train_batch_start` touched the optimizer's `lr` on the controller",
        ),
    ],
    ids=["writes-weights", "reads-weights", "sets-the-learning-rate"],
)
def test_a_controller_callback_that_touches_the_mirror_raises_at_that_moment(callback: L.Callback, match: str) -> None:
    """Nothing a controller callback does to the module or optimizer mirrors is silently lost: it
    raises at that hook. With ``on_workers`` the weight-changing one gives ``ddp``'s weights (parity:
    ``weights_lambda_on_workers``)."""
    with pytest.raises(DivergenceError, match=match):
        _fit(Classifier(), callbacks=[callback], enable_progress_bar=False, limit_train_batches=2, limit_val_batches=0)


def test_a_controller_callback_may_read_the_parameters_shapes() -> None:
    counter = CountsTheParameters()
    model = Classifier()
    _fit(model, callbacks=[counter], enable_progress_bar=False, limit_train_batches=2, limit_val_batches=0)
    assert counter.count == sum(parameter.numel() for parameter in model.parameters())


def test_a_librarys_callbacks_run_beside_the_one_that_runs_on_the_workers() -> None:
    """finetuning-scheduler's scheduler goes to the workers by its class (``BaseFinetuning``); its
    early-stopping and checkpoint subclasses follow it there, unless placed on the controller. The
    run itself is the client tier's ``finetuning_scheduler``, compared with ``ddp``."""
    scheduler, stopping, checkpointing = FinetuningScheduler(), FTSEarlyStopping(monitor="val_loss"), FTSCheckpoint()
    bar, timer = TQDMProgressBar(), Timer()
    placement = CallbackPlacement([bar, scheduler, stopping, checkpointing, timer], [])
    assert placement.workers == [scheduler, stopping, checkpointing] and placement.holds_checkpoints
    kept = CallbackPlacement([scheduler, on_controller(FTSEarlyStopping(monitor="val_loss"))], [])
    assert kept.workers == [scheduler] and not kept.holds_checkpoints


class SeesTheCallbacks(L.Callback):
    """Records the names of the controller Trainer's callbacks when the fit starts."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen = [type(callback).__name__ for callback in trainer.callbacks]


def test_callbacks_placed_on_the_workers_are_back_in_their_places_after_the_stage() -> None:
    seer = SeesTheCallbacks()
    given = [ModelPruning("l1_unstructured", amount=0.3), seer, EMAWeightAveraging(), Timer()]
    trainer = _fit(Classifier(), callbacks=given, enable_progress_bar=False, limit_train_batches=2, limit_val_batches=0)
    assert "ModelPruning" not in seer.seen and "EMAWeightAveraging" not in seer.seen
    assert {"SeesTheCallbacks", "Timer"} <= set(seer.seen)
    assert [callback for callback in trainer.callbacks if callback in given] == given


class OpensAFileOnTheWorkers(Classifier):
    def on_fit_start(self) -> None:
        self.log_file = open(os.devnull, "w")
        self.seen_epochs = 1


def test_module_attributes_that_cannot_travel_are_named() -> None:
    model = OpensAFileOnTheWorkers()
    with pytest.warns(
        UserWarning,
        match=r"`OpensAFileOnTheWorkers`: the workers' module has public attributes that"
        r" cannot be pickled: `log_file` \(PicklingError: Cannot pickle files that are not"
        r" opened for reading: w\)\. .*it keeps its own",
    ) as caught:
        _fit(model, enable_progress_bar=False, limit_train_batches=2, limit_val_batches=0)
    assert len([w for w in caught if "cannot be pickled" in str(w.message)]) == 1, "one warning, only that attribute"
    assert model.seen_epochs == 1 and not hasattr(model, "log_file"), "the attributes that travel still do"


class LockedSchedule(Classifier):
    """A ``LambdaLR`` whose lambda holds a lock, which cannot be pickled."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        lock = threading.Lock()
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 if lock else 1.0)]


def test_optimizers_that_cannot_travel_leave_the_stand_ins_with_a_warning() -> None:
    """After ``fit`` the controller's Trainer takes rank 0's optimizers and schedulers (the parity
    cases compare them with ddp's); where they cannot be pickled it says so and keeps its stand-ins,
    which still hold rank 0's learning rates."""
    with pytest.warns(UserWarning, match=r"`trainer.optimizers`.*stay stand-ins.*could not be pickled \(TypeError"):
        trainer = _fit(LockedSchedule(), enable_progress_bar=False, limit_train_batches=2, limit_val_batches=0)
    assert not isinstance(trainer.optimizers[0], torch.optim.SGD)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.05


class LockedLogger(AllRankLogger):
    """A logger of the user's own holding a lock, which cannot be pickled."""

    def __init__(self, save_dir: str) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._save_dir = save_dir

    @property
    def save_dir(self) -> str:
        return self._save_dir


class ReadsItsLogger(Classifier):
    def on_train_end(self) -> None:
        self.seen = (self.logger.name, self.logger.version, self.logger.save_dir, self.trainer.log_dir)
        self.has_logs = hasattr(self.logger, "logs")


def test_a_logger_that_cannot_travel_is_a_stand_in_with_a_warning(tmp_path: Path) -> None:
    """A logger travels to the workers pickled (the parity case ``module_logging`` reads one's own
    attributes there); where it cannot, the workers' stand-in answers its name, version and folder,
    and rank 0's calls still reach the controller's logger."""
    model = ReadsItsLogger()
    with pytest.warns(UserWarning, match=r"The logger `LockedLogger` cannot be pickled .*\(TypeError.*a stand-in"):
        trainer = _fit(
            model,
            logger=LockedLogger(str(tmp_path)),
            enable_progress_bar=False,
            limit_train_batches=2,
            limit_val_batches=0,
            log_every_n_steps=1,
        )
    assert model.seen == ("all_rank", 0, str(tmp_path), str(tmp_path))
    assert not model.has_logs
    assert "train_loss_step" in trainer.logger.logs


class ReadsRenamedBatch(L.Callback):
    def on_validation_batch_start(self, trainer: Any, module: Any, b: Any, index: int, loader: int = 0) -> None:
        self.size = len(b)


class ReadsArgs(L.Callback):
    def on_predict_batch_end(self, trainer: Any, *args: Any) -> None:
        self.seen = args


class ReadsInAClosure(L.Callback):
    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.sizes = lambda: len(batch)


class ReadsOutputsOnly(L.Callback):
    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss = outputs["loss"]


class StopsOnABatch(EarlyStopping):
    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last = batch


def test_a_callback_that_reads_the_batch_runs_on_the_workers() -> None:
    """The controller's loop iterates batch numbers: a batch hook that reads its batch (by any name,
    through ``*args`` or a closure) runs where the batch is (parity: ``batch_reader``); one that
    reads only the step's outputs, which the controller gets from rank 0, stays there."""
    lambdas = LambdaCallback(on_test_batch_end=lambda trainer, module, outputs, batch, index, loader=0: batch)
    readers = [ReadsRenamedBatch(), ReadsArgs(), ReadsInAClosure(), lambdas]
    assert CallbackPlacement(readers, []).workers == readers
    assert CallbackPlacement([ReadsOutputsOnly()], []).workers == []  # not beside a companion on the workers


@pytest.mark.parametrize(
    ("callback", "fix"),
    [
        (StopsOnABatch(monitor="val_loss"), r"Read what it needs of the step from `outputs`"),
        (on_controller(ReadsRenamedBatch()), r"drop `lightning_monarch.on_controller\(ReadsRenamedBatch\)`"),
    ],
)
def test_a_callback_that_reads_the_batch_on_the_controller_is_refused(callback: L.Callback, fix: str) -> None:
    with pytest.raises(MisconfigurationException, match=rf"\.on_\w+_batch_\w+` reads its `batch`.*{fix}"):
        CallbackPlacement([callback], [])


def test_the_gate_follows_the_worker_callbacks_listed_before_the_controllers() -> None:
    """On the workers the gate callback comes after the worker callbacks the Trainer lists before
    its first controller callback (the client tier's FTS case shows the effect); with recovery
    snapshots it must come first, and says which controller callbacks then see a hook's changes late."""
    finetuning, monitor = BackboneFinetuning(unfreeze_backbone_at_epoch=1), LearningRateMonitor()
    assert CallbackPlacement([monitor, finetuning], []).before_gate == 0
    placement = CallbackPlacement([finetuning, monitor], [])
    assert placement.before_gate == 1
    match = r"With snapshots, .*`LearningRateMonitor.on_train_epoch_start` after `BackboneFinetuning`.* one hook late"
    with pytest.warns(UserWarning, match=match):
        assert placement.gate_first("snapshots") == 0
