"""Stage results on the controller: predictions in dataset order, scalars in the controller's logger."""

from __future__ import annotations

import os
import threading
import types
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.models import ClassificationDataModule, Classifier, DataModuleClassifier
from tests.parity_cases import SEED
from tests.test_bad_input import _trainer

pytestmark = pytest.mark.timeout(120)


def _predict(strategy: str, devices: int) -> list[torch.Tensor]:
    L.seed_everything(SEED)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return trainer.predict(Classifier())


def test_predict_returns_the_whole_dataset_in_order() -> None:
    ours = _predict("monarch", 2)
    single = _predict("auto", 1)
    assert [batch.shape for batch in ours] == [batch.shape for batch in single]
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(ours, single, strict=True))
    assert sum(len(batch) for batch in ours) == 36


def test_tensorboard_logger_gets_the_workers_scalars(tmp_path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier())
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    steps = [event.step for event in events.Scalars("train_loss_step")]
    assert steps == list(range(trainer.global_step))
    assert len(events.Scalars("val_loss")) == 2
    assert events.Scalars("val_loss")[-1].value == pytest.approx(float(trainer.callback_metrics["val_loss"]))


class MarksPrepareData:
    """Writes a marker file named after its class per call of ``prepare_data``, as a download does."""

    marker_dir: str

    def prepare_data(self) -> None:
        with open(os.path.join(self.marker_dir, f"{type(self).__name__}-{os.getpid()}"), "w"):
            pass


class PreparingDataModule(MarksPrepareData, ClassificationDataModule):
    def __init__(self, marker_dir: str) -> None:
        super().__init__()
        self.marker_dir = marker_dir


class PreparingClassifier(MarksPrepareData, DataModuleClassifier):
    def __init__(self, marker_dir: str) -> None:
        super().__init__()
        self.marker_dir = marker_dir


def _fit(model: L.LightningModule, **kwargs: Any) -> L.Trainer:
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, **kwargs)
    return trainer


@pytest.mark.timeout(60)
def test_prepare_data_runs_once_per_host_without_stalling_the_other_ranks(tmp_path: Path) -> None:
    # Lightning runs `prepare_data` on local rank 0 only and makes the other ranks wait in a barrier
    _fit(PreparingClassifier(str(tmp_path)), datamodule=PreparingDataModule(str(tmp_path)))
    assert sorted(name.split("-")[0] for name in os.listdir(tmp_path)) == ["PreparingClassifier", "PreparingDataModule"]


def test_a_hook_set_on_the_instance_runs_on_the_workers() -> None:
    # what LightningCLI's `optimizer:` config does to `configure_optimizers`
    def configure_optimizers(self: L.LightningModule) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    L.seed_everything(SEED)
    patched = Classifier()
    patched.configure_optimizers = types.MethodType(configure_optimizers, patched)
    _fit(patched)
    L.seed_everything(SEED)
    defined = type("AdamClassifier", (Classifier,), {"configure_optimizers": configure_optimizers})()
    _fit(defined)
    assert all(
        torch.equal(a, b) for a, b in zip(patched.state_dict().values(), defined.state_dict().values(), strict=True)
    )
    assert "configure_optimizers" in vars(patched)  # put back as the user set it


class RecordsTorchFlags(Classifier):
    def on_fit_start(self) -> None:
        self.seen_flags = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)


@pytest.mark.parametrize(
    ("flags", "expected"), [({"deterministic": True}, (True, False)), ({"benchmark": True}, (False, True))]
)
def test_deterministic_and_benchmark_reach_the_workers(flags: dict, expected: tuple) -> None:
    model = RecordsTorchFlags()
    try:
        L.Trainer(
            strategy="monarch",
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            limit_train_batches=1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **flags,
        ).fit(model)
    finally:  # the Trainer set them in this process too
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = False
    assert model.seen_flags == expected


class MetadataDataModule(ClassificationDataModule):
    """Its ``setup`` also counts the classes, and keeps a large table and a lock beside the data."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.num_classes = int(self.train_set.tensors[1].max()) + 1
        self.table = torch.zeros(5 * 2**20)  # 20 MiB
        self.guard = threading.Lock()


def test_the_datamodule_takes_what_setup_set_on_rank_0() -> None:
    """Under ddp the script's datamodule is rank 0's: after a stage it holds what ``setup`` made.
    Here it takes rank 0's attributes that the stage set, up to 16 MiB each; reading one that
    stayed on the workers (too large, or not picklable) says so, and the next stage still sends the
    datamodule's own class."""
    datamodule = MetadataDataModule()
    trainer = _trainer(limit_train_batches=2, limit_val_batches=1)
    trainer.fit(DataModuleClassifier(), datamodule=datamodule)
    assert datamodule.num_classes == 4 and len(datamodule.train_set) == 96
    with pytest.raises(AttributeError, match=r"`MetadataDataModule.table` was set by the last stage on the workers"):
        datamodule.table  # noqa: B018 - the read is the test
    with pytest.raises(AttributeError, match=r"a `Tensor` of over 16 MiB pickled.*`datamodule.setup\(stage\)`"):
        datamodule.table  # noqa: B018
    with pytest.raises(AttributeError, match=r"`MetadataDataModule.guard`.*a `lock` that cannot be pickled"):
        datamodule.guard  # noqa: B018
    with pytest.raises(AttributeError, match=r"^'MetadataDataModule' object has no attribute 'other'$"):
        datamodule.other  # noqa: B018
    assert isinstance(datamodule, MetadataDataModule) and type(datamodule).__name__ == "MetadataDataModule"
    trainer.validate(DataModuleClassifier(), datamodule=datamodule, verbose=False)
    assert datamodule.num_classes == 4


class TornDownDataModule(ClassificationDataModule):
    """Its ``state_dict`` reads what ``setup`` made and ``teardown`` drops, as nequip's does."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.served = 0

    def teardown(self, stage: str) -> None:
        del self.served

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served}


def test_a_datamodule_whose_state_is_gone_after_teardown_ends_the_stage() -> None:
    """After the stage the controller's datamodule takes rank 0's ``state_dict`` where it can be
    read; after ``teardown`` this one cannot (nor could a ddp script read it there), and the fit
    ends as under ddp."""
    datamodule = TornDownDataModule()
    trainer = _trainer(limit_train_batches=2, limit_val_batches=1)
    trainer.fit(DataModuleClassifier(), datamodule=datamodule)
    assert trainer.state.finished
    with pytest.raises(AttributeError, match="served"):
        datamodule.state_dict()
