"""The workers lead and the controller follows (R4-R6 in ``lightning_monarch.wire.protocol``): how far they
lead, where they wait (counted, not timed), and what a controller callback may not do where they
do not wait. The parity suite (``tests/test_parity.py``) shows the results do not change."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_monarch import DivergenceError, MonarchStrategy, observe_only
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from tests.compat_models import StopAtStep
from tests.models import Classifier

pytestmark = pytest.mark.timeout(180)


class Counted:
    """What the controller's channel fetched and sent during a fit: every entry, in order, the
    number of entries fetched after each fetch, and each request the controller waited on, with the
    number of entries fetched before it."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.entries: list[Any] = []
        self.fetched: list[int] = []
        self.requests: list[tuple[int, str]] = []
        fetch, deliver = StageChannel.fetch, WorkerMesh.deliver

        def counted_fetch(channel: StageChannel) -> list[Any]:
            entries = fetch(channel)
            self.entries.extend(entry for entry in entries if entry.gate is not None)
            self.fetched.append(len(self.entries))
            return entries

        def counted_deliver(mesh: WorkerMesh, message: Any) -> Any:
            if message.wait and message.endpoint != "start_stage":
                self.requests.append((len(self.entries), message.endpoint))
            return deliver(mesh, message)

        patch.setattr(StageChannel, "fetch", counted_fetch)
        patch.setattr(WorkerMesh, "deliver", counted_deliver)

    @classmethod
    def fit(cls, module: L.LightningModule, **flags: Any) -> Counted:
        """What a ``fit`` of ``module`` on 2 CPU workers, by a Trainer with ``flags``
        (``strategy="monarch"`` unless they give one), fetched and sent."""
        with pytest.MonkeyPatch.context() as patch:
            counted = cls(patch)
            L.Trainer(**{"strategy": "monarch", "accelerator": "cpu", "devices": 2, **flags}).fit(module)
        return counted

    def batches(self) -> list[tuple[int, int]]:
        """Each training batch as the range of entries from its start gate to its end gate."""
        starts = [i for i, entry in enumerate(self.entries) if entry.gate == "callback.on_train_batch_start"]
        ends = [i for i, entry in enumerate(self.entries) if entry.gate == "module.on_train_batch_end"]
        return list(zip(starts, ends, strict=False))

    def inside_a_batch(self, position: int) -> bool:
        """Whether ``position`` (a count of entries fetched) falls inside a training batch: its start
        gate's entry fetched, its end gate's not yet."""
        return any(start < position <= end for start, end in self.batches())


def test_a_steady_training_batch_with_lightnings_defaults_has_no_waited_round_trip(tmp_path: Any) -> None:
    """Lightning's default callbacks (checkpointing, progress bar, model summary) and a CSV logger:
    within a training batch the workers never park and the controller asks them nothing (R4-R6)."""
    counted = Counted.fit(Classifier(), max_epochs=2, default_root_dir=tmp_path, logger=CSVLogger(tmp_path))
    batches = counted.batches()
    assert len(batches) == 12
    synced = [
        counted.entries[i].gate for start, end in batches for i in range(start, end + 1) if counted.entries[i].sync
    ]
    asked = [endpoint for position, endpoint in counted.requests if counted.inside_a_batch(position)]
    assert synced == [] and asked == [], (synced, asked)
    # ModelCheckpoint saves from rank 0's state in the entries where it may save: the workers wait
    # only where the controller's plan may grow, once per stage (not at `configure_callbacks`,
    # which Classifier does not override: it is no gate)
    assert {entry.gate for entry in counted.entries if entry.sync} == {"module.configure_optimizers"}
    assert {entry.gate for entry in counted.entries if entry.checkpoint is not None} == {
        "callback.on_validation_end",
        "module.on_train_epoch_end",
    }


class SlowStepClassifier(Classifier):
    """Training steps of 30 ms and more: longer than rank 0's fetch lingers for more batches."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        time.sleep(0.03)
        return super().training_step(batch, batch_idx)


def test_with_long_steps_a_fetch_brings_whole_batches_a_few_at_a_time() -> None:
    """Where batches start ``FETCH_LINGER_S`` or more apart, rank 0's fetch waits until the batch in
    progress ends and its first entry is ``FETCH_SPAN_S`` old, and returns whole batches: no fetch
    ends inside a training batch, and 30 ms steps come at least two to a fetch."""
    counted = Counted.fit(
        SlowStepClassifier(),
        max_epochs=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    batches = counted.batches()
    inside = [fetched for fetched in counted.fetched if counted.inside_a_batch(fetched)]
    assert len(batches) == 12 and inside == [], (batches, counted.fetched)
    during = [fetched for fetched in counted.fetched if batches[0][0] < fetched <= batches[-1][1]]
    assert len(during) <= len(batches) // 2, (batches, counted.fetched)


def test_hooks_the_module_does_not_override_record_no_entries() -> None:
    """Elidable hooks (``protocol.Gate.elidable``) that ``Classifier`` does not override, the batch
    transfer hooks and the evaluation batch starts and ends among them, are no gates: a training
    batch records five entries and a validation batch three (R2)."""
    counted = Counted.fit(
        Classifier(),
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    gates = [entry.gate for entry in counted.entries]
    train = gates.index("callback.on_train_batch_start")
    assert gates[train : train + 6] == [
        "callback.on_train_batch_start",
        "module.on_train_batch_start",
        "module.optimizer_step",
        "callback.on_train_batch_end",
        "module.on_train_batch_end",
        "callback.on_train_batch_start",
    ]
    validation = gates.index("callback.on_validation_batch_start")
    assert gates[validation : validation + 4] == [
        "callback.on_validation_batch_start",
        "module.validation_step",
        "callback.on_validation_batch_end",
        "callback.on_validation_batch_start",
    ]


def test_a_checkpoint_every_n_steps_travels_in_the_entries_and_the_workers_do_not_wait(tmp_path: Any) -> None:
    """``ModelCheckpoint(every_n_train_steps=3)`` saves at steps 3, 6, 9 and 12 from the state rank 0
    put in those steps' entries; nothing else is asked of the workers during the batches (R6)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    counted = Counted.fit(
        Classifier(),
        strategy=MonarchStrategy(max_ahead=None),
        max_epochs=2,
        logger=False,
        limit_val_batches=0,
        enable_progress_bar=False,
        callbacks=[checkpoint],
    )
    batches = counted.batches()
    staged = [
        (number, counted.entries[i].gate)
        for number, (start, end) in enumerate(batches, start=1)
        for i in range(start, end + 1)
        if counted.entries[i].checkpoint is not None
    ]
    assert staged == [(step, "callback.on_train_batch_end") for step in (3, 6, 9, 12)]
    first, last = batches[0][0], batches[-1][1]
    during = [endpoint for position, endpoint in counted.requests if first < position <= last]
    assert not any(entry.sync for entry in counted.entries[first : last + 1]) and during == [], during
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f"epoch={epoch}-step={step}.ckpt" for epoch, step in ((0, 3), (0, 6), (1, 12), (1, 9))
    ]


def test_in_validate_checkpoint_and_early_stopping_callbacks_copy_no_state_and_never_wait(tmp_path: Any) -> None:
    """``ModelCheckpoint`` saves and ``EarlyStopping`` checks only while fitting: in ``validate`` the
    workers neither wait for them nor put rank 0's state in an entry where they would act."""
    callbacks = [ModelCheckpoint(dirpath=tmp_path), ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")]
    with pytest.MonkeyPatch.context() as patch:
        counted = Counted(patch)
        trainer = L.Trainer(
            strategy="monarch",
            accelerator="cpu",
            devices=2,
            logger=False,
            enable_progress_bar=False,
            callbacks=[*callbacks, EarlyStopping("val_loss")],
        )
        trainer.validate(Classifier(), verbose=False)
    assert "callback.on_validation_end" in [entry.gate for entry in counted.entries]
    assert not [entry.gate for entry in counted.entries if entry.sync or entry.checkpoint is not None]
    assert counted.requests == []


class StampsItsSteps(Classifier):
    """Rank 0 records when each training step ran."""

    def __init__(self) -> None:
        super().__init__()
        self.step_times: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.step_times.append(time.time())
        return super().training_step(batch, batch_idx)


@observe_only
class SlowReader(L.Callback):
    """An observe-only controller callback that takes its time at every batch end."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        time.sleep(0.3)  # time for the workers to take the credit this batch returned, and use it
        self.seen.append(time.time())


@pytest.mark.parametrize("max_ahead", [3, 0])
def test_the_workers_lead_by_max_ahead_batches_at_most(max_ahead: int) -> None:
    model, reader = StampsItsSteps(), SlowReader()
    L.Trainer(
        strategy=MonarchStrategy(max_ahead=max_ahead),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[reader],
    ).fit(model)
    # when the controller was done with batch b's end, how many training steps rank 0 had started
    lead = [sum(stamp < seen for stamp in model.step_times) - (batch + 1) for batch, seen in enumerate(reader.seen)]
    assert max(lead) == max_ahead, lead


class StampsItsValidationSteps(Classifier):
    """Rank 0 records when each of its 6 validation steps ran."""

    def __init__(self) -> None:
        super().__init__()
        self.step_times: list[float] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.step_times.append(time.time())
        super().validation_step(batch, batch_idx)

    def val_dataloader(self) -> Any:
        return self._loader(96, shuffle=False)


@observe_only
class SlowValidationReader(L.Callback):
    """An observe-only controller callback that takes its time at every validation batch end."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        time.sleep(0.1)
        self.seen.append(time.time())


def test_evaluation_batches_never_wait_for_credit() -> None:
    """With ``max_ahead=1``, rank 0 runs through all 6 validation batches while the controller is
    still at the first one's end: only a training batch waits for credit (R4)."""
    model, reader = StampsItsValidationSteps(), SlowValidationReader()
    L.Trainer(
        strategy=MonarchStrategy(max_ahead=1),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[reader],
    ).validate(model, verbose=False)
    lead = [sum(stamp < seen for stamp in model.step_times) - (batch + 1) for batch, seen in enumerate(reader.seen)]
    assert len(lead) == 6 and lead[0] == 5, lead


def test_a_callback_wrongly_declared_observe_only_that_stops_training_raises() -> None:
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[observe_only(StopAtStep(7))],
    )
    with pytest.raises(
        DivergenceError,
        match=r"`StopAtStep.on_train_batch_end` changed `trainer.should_stop` where the"
        r" workers do not wait for the controller.*must not be declared"
        r" observe-only",
    ):
        trainer.fit(Classifier())


@observe_only
class SavesACheckpoint(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.path)


def test_an_observe_only_callback_that_reads_the_weights_raises(tmp_path: Any) -> None:
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[SavesACheckpoint(str(tmp_path / "x.ckpt"))],
    )
    with pytest.raises(
        DivergenceError,
        match=r"`SavesACheckpoint.on_train_batch_end` reads the module's weights or the"
        r" optimizers' state \(a checkpoint\) after `callback.on_train_batch_end`,"
        r" where the workers do not wait.*remove the declaration",
    ):
        trainer.fit(Classifier())


@pytest.mark.parametrize("max_ahead", [-1, 2.5, "8", True])
def test_max_ahead_must_be_a_whole_number(max_ahead: Any) -> None:
    with pytest.raises(ValueError, match=rf"max_ahead={max_ahead!r}\)`: give a whole number of batches >= 0"):
        MonarchStrategy(max_ahead=max_ahead)


@pytest.mark.parametrize("thing", [object(), "ModelCheckpoint", Classifier])
def test_only_a_callback_can_be_declared_observe_only(thing: Any) -> None:
    with pytest.raises(TypeError, match=r"observe_only\(.*\)`: it declares a Lightning `Callback`"):
        observe_only(thing)
