"""Bad input gets an error that names what to change, before any worker process starts."""

from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BatchSizeFinder,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelCheckpoint,
    OnExceptionCheckpoint,
)
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch import (
    MonarchFSDPStrategy,
    MonarchModelParallelStrategy,
    MonarchStrategy,
    WorkerGPUAccelerator,
    on_controller,
    on_workers,
)
from tests.conftest import stray_workers
from tests.models import ClassificationDataModule, Classifier


def _trainer(**kwargs: Any) -> L.Trainer:
    options = dict(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**options, **kwargs})


def _assert_raised_before_spawning(error: pytest.ExceptionInfo) -> None:
    frames = [frame.name for frame in traceback.extract_tb(error.tb)]
    assert "spawn" not in frames and "start_stage" not in frames, frames
    assert not stray_workers()


@pytest.mark.parametrize("devices", [0, -3, [0, 1], "two", 1.5])
def test_devices_must_be_a_positive_int(devices: Any) -> None:
    with pytest.raises((MisconfigurationException, TypeError, ValueError), match="devices"):
        _trainer(devices=devices)


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        (0, r"devices=0.*not a valid input"),
        ("auto", r"strategy='monarch', accelerator='gpu', devices='auto'.*devices=8"),
        ([], r"devices=\[\].*not a valid input"),
        ([-1], r"strategy='monarch', accelerator='gpu', devices=\[-1\].*positive int"),
    ],
)
def test_gpu_devices_must_be_given_explicitly(devices: Any, match: str, cuda_build: pytest.MonkeyPatch) -> None:
    with pytest.raises(MisconfigurationException, match=match):
        _trainer(accelerator="gpu", devices=devices)


def test_gpu_accelerator_works_on_a_controller_without_gpu(cuda_build: pytest.MonkeyPatch) -> None:
    trainer = _trainer(accelerator="gpu", devices=4)
    strategy = trainer.strategy
    assert isinstance(strategy, MonarchStrategy)
    assert isinstance(trainer.accelerator, WorkerGPUAccelerator)
    assert strategy.worker_accelerator == "cuda" and strategy.num_workers == 4
    assert strategy.root_device == torch.device("cpu")
    # No `torch.cuda.is_initialized()` check: on this CPU-only build it is False whatever the
    # controller does, since any GPU initialization raises ("Torch not compiled with CUDA enabled")
    # and would fail `_trainer` above. tests/gpu checks it on a CUDA build, where it can be True.


class LockedClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def test_unpicklable_module() -> None:
    with pytest.raises(TypeError, match=r"LightningModule `LockedClassifier` cannot be pickled.*lock") as error:
        _trainer().fit(LockedClassifier())
    _assert_raised_before_spawning(error)


class Unit:
    """A unit as a physics library might write one: it pickles as its name alone, and reading it
    back needs its scale too."""

    def __init__(self, name: str, scale: float) -> None:
        self.name, self.scale = name, scale

    def __reduce__(self) -> tuple[Any, ...]:
        return Unit, (self.name,)


class Problem:
    def __init__(self) -> None:
        self.conditions = {"x": Unit("m", 1.0)}


class ProblemDataModule(ClassificationDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.problem = Problem()


def test_an_object_that_pickles_but_cannot_be_rebuilt_is_named() -> None:
    with pytest.raises(
        TypeError,
        match=r"LightningDataModule `ProblemDataModule` cannot be rebuilt on the worker processes.*"
        r"`datamodule.problem.conditions\['x'\]` \(a `Unit`\) pickles, but reading it back raises TypeError:"
        r" .*'scale'.*`__reduce__` that returns every argument",
    ) as error:
        _trainer().fit(Classifier(), datamodule=ProblemDataModule())
    _assert_raised_before_spawning(error)


NOTEBOOK_CELL = """
import threading
from tests.models import ClassificationDataModule, Classifier

cache_lock = threading.Lock()

class NotebookClassifier(Classifier):
    def training_step(self, batch, batch_idx):
        with cache_lock:
            return super().training_step(batch, batch_idx)
"""


def test_a_notebook_class_that_uses_an_unpicklable_global_says_what_to_move(monkeypatch: pytest.MonkeyPatch) -> None:
    main = sys.modules["__main__"]
    cell: dict = {}
    exec(NOTEBOOK_CELL, vars(main), cell)  # as a notebook cell does: the class and the lock live in `__main__`
    for name, value in cell.items():
        monkeypatch.setattr(main, name, value, raising=False)
    with pytest.raises(
        TypeError,
        match=r"`NotebookClassifier` is defined in `__main__`.*`cache_lock` \(a lock\) cannot be"
        r" pickled.*Move `NotebookClassifier` and what it uses into a module",
    ) as error:
        _trainer().fit(main.NotebookClassifier())
    _assert_raised_before_spawning(error)


def test_module_the_workers_cannot_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hidden_models.py").write_text(
        "from tests.models import Classifier\n\nclass HiddenClassifier(Classifier):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import hidden_models

    with pytest.raises(ImportError, match=rf"HiddenClassifier.*hidden_models.*{tmp_path}.*PYTHONPATH") as error:
        _trainer().fit(hidden_models.HiddenClassifier())
    _assert_raised_before_spawning(error)
    sys.modules.pop("hidden_models")


def test_missing_checkpoint_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint file") as error:
        _trainer().fit(Classifier(), ckpt_path=str(tmp_path / "missing.ckpt"))
    _assert_raised_before_spawning(error)


class CustomPrecision(Precision):
    pass


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_nodes": 2}, r"num_nodes=2.*without `MonarchStrategy\(hosts=...\)`.*or use `num_nodes=1`"),
        ({"plugins": [CustomPrecision()]}, r"CustomPrecision.*precision="),
    ],
)
def test_incompatible_trainer_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(MisconfigurationException, match=match):
        _trainer(**kwargs)


def test_unknown_ddp_option() -> None:
    with pytest.raises(TypeError, match=r"find_unused_parameter'.*DistributedDataParallel"):
        MonarchStrategy(find_unused_parameter=True)


class GradientPeeker(L.Callback):
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass


@pytest.mark.parametrize(
    ("callbacks", "worker_callbacks", "match"),
    [
        (
            [on_workers(EarlyStopping("loss"))],
            [],
            r"`EarlyStopping` steers the loop.*without `lightning_monarch.on_workers`",
        ),
        (
            [BackboneFinetuning(), on_workers(GradientAccumulationScheduler({0: 2}))],
            [],
            r"`GradientAccumulationScheduler` steers",
        ),
        ([BatchSizeFinder()], [], r"BatchSizeFinder` runs trial fits.*devices=1"),
        (
            [],
            [ModelCheckpoint()],
            r"`ModelCheckpoint`.*cannot run on the workers.*Trainer\(callbacks=\[ModelCheckpoint",
        ),
        ([], [GradientAccumulationScheduler({0: 2})], r"Trainer\(callbacks=\[GradientAccumulationScheduler"),
    ],
)
def test_callbacks_that_cannot_run_where_they_were_put(
    callbacks: list[L.Callback], worker_callbacks: list[L.Callback], match: str
) -> None:
    trainer = _trainer(strategy=MonarchStrategy(worker_callbacks=worker_callbacks), callbacks=callbacks)
    with pytest.raises(MisconfigurationException, match=match) as error:
        trainer.fit(Classifier())
    _assert_raised_before_spawning(error)


def test_a_refusal_before_any_worker_starts_writes_no_checkpoint(tmp_path: Path) -> None:
    """Lightning runs every callback's ``on_exception`` for a refusal, but the refused callback's and
    ``OnExceptionCheckpoint``'s (no rank ran): nothing is written, and both are back in the
    Trainer's callbacks after it."""
    saver, refused = OnExceptionCheckpoint(dirpath=str(tmp_path)), BatchSizeFinder()
    trainer = _trainer(callbacks=[saver, refused], enable_checkpointing=True)
    with pytest.raises(MisconfigurationException, match=r"`BatchSizeFinder` runs trial fits"):
        trainer.fit(Classifier())
    assert list(tmp_path.iterdir()) == []
    assert saver in trainer.callbacks and refused in trainer.callbacks


@pytest.mark.parametrize(
    ("callback", "match"),
    [
        (GradientPeeker(), r"on_controller\(GradientPeeker\)`: it overrides `on_after_backward`"),
        (LearningRateFinder(), r"on_controller\(LearningRateFinder\)`: it trains the live model on trial"),
    ],
)
def test_placing_on_the_controller_a_callback_that_needs_the_live_model_is_refused(
    callback: L.Callback, match: str
) -> None:
    with pytest.raises(MisconfigurationException, match=match):
        on_controller(callback)


@pytest.mark.parametrize("place", [on_workers, on_controller])
def test_placing_what_is_not_a_callback_is_refused(place: Any) -> None:
    with pytest.raises(
        TypeError, match=rf"`lightning_monarch.{place.__name__}\(42\)`: it places a Lightning `Callback`"
    ):
        place(42)


def test_compiled_module_is_rejected_by_lightning() -> None:
    with pytest.raises(RuntimeError, match="compiled model is incompatible.*MonarchStrategy"):
        _trainer().fit(torch.compile(Classifier()))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"validation": "later"}, r"validation='later'.*give one of 'sync', 'async'"),
        ({"validation": "async", "validation_devices": 0}, r"validation_devices=0.*whole number"),
        ({"validation_hosts": ["tcp://127.0.0.1:1"]}, r"validation_hosts=...\)` places .* Pass `validation='async'`"),
    ],
)
def test_bad_validation_options(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MonarchStrategy(**options)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"validation_devices": 3}, r"as many workers as train \(2\).*`validation_devices=2`"),
        ({"max_restarts": 1}, r"does not recover from a worker's failure yet.*max_restarts=0"),
        (
            {"hosts": ["tcp://127.0.0.1:1"], "min_nodes": 1},
            r"does not go on without lost hosts yet.*Drop `min_nodes=...`",
        ),
    ],
)
def test_what_async_validation_does_not_serve_is_refused_at_trainer(options: dict[str, Any], match: str) -> None:
    with pytest.raises(MisconfigurationException, match=match):
        _trainer(strategy=MonarchStrategy(validation="async", **options))


@pytest.mark.parametrize("strategy", [MonarchFSDPStrategy, MonarchModelParallelStrategy])
def test_async_validation_of_a_sharded_module_is_refused_at_trainer(strategy: type) -> None:
    with pytest.raises(MisconfigurationException, match=r"validation='async'\)`: .* a sharded module's ranks hold"):
        _trainer(strategy=strategy(validation="async"))


@pytest.mark.parametrize(
    ("callback", "match"),
    [
        (
            EarlyStopping("val_loss"),
            r"`EarlyStopping\(monitor='val_loss'\)` with .* decides at each training epoch's end, on the training"
            r" workers, which hold no validation's values. Pass `check_on_train_epoch_end=False`",
        ),
        (
            ModelCheckpoint(monitor="val_loss"),
            r"ranks checkpoints at each training epoch's end.*`save_on_train_epoch_end=False`",
        ),
        (
            ModelCheckpoint(monitor="val_loss", save_on_train_epoch_end=True),
            r"ranks checkpoints at each training epoch",
        ),
    ],
)
def test_callbacks_that_act_on_a_validation_are_refused_before_any_worker_starts(callback: Any, match: str) -> None:
    strategy = MonarchStrategy(validation="async")
    trainer = _trainer(strategy=strategy, callbacks=[callback], enable_checkpointing=True)
    with pytest.raises(MisconfigurationException, match=match) as error:
        trainer.fit(Classifier())
    _assert_raised_before_spawning(error)


def test_async_validation_after_every_batch_is_refused_before_any_worker_starts() -> None:
    trainer = _trainer(strategy=MonarchStrategy(validation="async"), val_check_interval=1)
    with pytest.raises(MisconfigurationException, match=r"val_check_interval=1\)` with .* after every training batch"):
        trainer.fit(Classifier())
