"""``MonarchStrategy(validation="async")``: a second mesh validates while training goes on, and the
fit gives what the synchronous run gives (``controller.loop.validation_replay``). What it refuses:
``tests/test_bad_input.py``."""

from __future__ import annotations

import itertools
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import Logger

from lightning_monarch import MonarchStrategy, ValidationFailedWarning, WorkerError
from lightning_monarch.worker.loop import FETCH_LINGER_S
from tests.models import PlaceRecordingClassifier
from tests.parity_cases import comparable_checkpoint
from tests.served_hosts import ServedHost
from tests.test_parity import assert_same


class RowLogger(Logger):
    """Keeps every row the Trainer logs, with its step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[Optional[int], dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self.rows.append((step, {key: float(value) for key, value in metrics.items()}))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _fit(validation: str, root: Path, max_epochs: int = 2, ckpt_path: Optional[str] = None) -> dict[str, Any]:
    """A fit of a classifier with dropout that validates twice an epoch, checkpointing at each
    training epoch's end and, ranked by a validation metric, at each validation's end; what it
    logged, kept, saved and where its steps ran."""
    for name in ("epochs", "best"):
        (root / name).mkdir(parents=True)
    model, logger = recording(root)
    best = ModelCheckpoint(
        dirpath=root / "best",
        monitor="val_acc",
        mode="max",
        save_top_k=2,
        save_on_train_epoch_end=False,
        filename="{epoch}-{step}-{val_acc:.4f}",
    )
    epochs = ModelCheckpoint(dirpath=root / "epochs", save_on_train_epoch_end=True, save_last=True)
    trainer = _trainer(validation, logger, max_epochs=max_epochs, callbacks=[epochs, best], enable_checkpointing=True)
    trainer.fit(model, ckpt_path=ckpt_path)
    return {
        "rows": logger.rows,
        "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "weights": model.state_dict(),
        "rng": torch.get_rng_state(),
        "checkpoints": {
            str(path.relative_to(root)): comparable_checkpoint(path) for path in sorted(root.glob("*/*.ckpt"))
        },
        "best": best.best_model_path,
        "places": places(root),
    }


def _trainer(
    validation: str, logger: RowLogger, validation_hosts: Optional[list[str]] = None, **flags: Any
) -> L.Trainer:
    """A Trainer on 2 CPU workers that validates twice an epoch, for 2 epochs and without
    checkpoints or a progress bar unless ``flags`` say otherwise."""
    options: dict[str, Any] = {
        "max_epochs": 2,
        "log_every_n_steps": 2,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        **flags,
    }
    return L.Trainer(
        strategy=MonarchStrategy(validation=validation, validation_hosts=validation_hosts),
        accelerator="cpu",
        devices=2,
        val_check_interval=0.5,
        logger=logger,
        enable_model_summary=False,
        **options,
    )


def recording(root: Path) -> tuple[PlaceRecordingClassifier, RowLogger]:
    """A seeded classifier that records where its steps run under ``root``, and a logger."""
    (root / "places").mkdir(parents=True)
    L.seed_everything(7)
    model = PlaceRecordingClassifier()
    model.record_dir = str(root / "places")
    return model, RowLogger()


def places(root: Path) -> dict[str, set[str]]:
    """The process IDs each kind of step ran in, as the module recorded them under ``root``."""
    found: dict[str, set[str]] = {}
    for path in (root / "places").iterdir():
        step, pid = path.name.split("-")
        found.setdefault(step, set()).add(pid)
    return found


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The synchronous run of :func:`_fit`, which the asynchronous runs of this module compare with."""
    return _fit("sync", tmp_path_factory.mktemp("sync"))


def test_async_validation_gives_the_synchronous_results(synchronous: dict[str, Any], tmp_path: Path) -> None:
    asynchronous = _fit("async", tmp_path / "async")
    # the validations ran on other processes than the training steps, and synchronously on the same
    assert not asynchronous["places"]["validation"] & asynchronous["places"]["train"]
    assert synchronous["places"]["validation"] == synchronous["places"]["train"]
    validated = [step for step, row in synchronous["rows"] if "val_loss" in row]
    assert len(validated) == 4 and len(set(validated)) == 4  # twice an epoch, each at its own step
    assert asynchronous["rows"] == synchronous["rows"]
    assert asynchronous["callback_metrics"] == synchronous["callback_metrics"]
    assert "val_acc" in synchronous["callback_metrics"]
    # what training_step counted on ``self`` (batches a rank trained) reached each validation
    assert [row["val_trained_batches"] for _, row in synchronous["rows"] if "val_loss" in row] == [3, 6, 9, 12]
    # top-k and last: the same files, the same weights, optimizer, loops (the validation loop's
    # progress too) and callback states; the best of the same step
    names = sorted(asynchronous["checkpoints"])
    assert names == sorted(synchronous["checkpoints"]) and len(names) == 4, names
    assert_same(asynchronous["checkpoints"], synchronous["checkpoints"], "checkpoints")
    assert Path(asynchronous["best"]).name == Path(synchronous["best"]).name
    assert_same(asynchronous["weights"], synchronous["weights"], "weights")
    assert torch.equal(asynchronous["rng"], synchronous["rng"])
    # each run resumed from its best checkpoint (mid-epoch, written at a validation's end)
    resumed = {
        mode: _fit(mode, tmp_path / f"{mode}-resumed", 3, run["best"])
        for mode, run in (("async", asynchronous), ("sync", synchronous))
    }
    assert resumed["async"]["rows"] == resumed["sync"]["rows"]
    assert_same(resumed["async"]["weights"], resumed["sync"]["weights"], "resumed weights")


class ServedWorkers(Callback):
    """On the controller: the worker processes of ``host`` at each validation's end, as they validate."""

    def __init__(self, host: ServedHost) -> None:
        self.host = host
        self.pids: set[str] = set()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.pids |= {str(process.pid) for process in self.host.worker_processes()}


def test_async_validation_on_a_host_of_its_own(synchronous: dict[str, Any], tmp_path: Path) -> None:
    """``validation_hosts``: the validation workers are the given host's (served at an address, as
    a cluster node serves), and the hand-offs reach them."""
    host = ServedHost()
    try:
        host.start()
        model, logger = recording(tmp_path)
        served = ServedWorkers(host)
        _trainer("async", logger, [host.address], callbacks=[served]).fit(model)
    finally:
        host.stop()
    validated = places(tmp_path)["validation"]
    assert len(validated) == 2 and validated <= served.pids
    assert logger.rows == synchronous["rows"]
    assert_same(model.state_dict(), synchronous["weights"], "weights")


def _stopped_early(validation: str, root: Path) -> dict[str, Any]:
    """A fit of 50 ms steps, validated twice an epoch for up to 3 epochs, that ``EarlyStopping``
    stops at its second validation (no later one can improve by the ``min_delta`` it asks); with
    Lightning's TQDM progress bar, which prints each bar's last state where no terminal is."""
    model, logger = recording(root)
    model.step_s = 0.05
    stopping = EarlyStopping("val_acc", mode="max", patience=0, min_delta=0.5, check_on_train_epoch_end=False)
    bar = TQDMProgressBar()
    trainer = _trainer(
        validation, logger, max_epochs=3, log_every_n_steps=1, callbacks=[stopping, bar], enable_progress_bar=True
    )
    trainer.fit(model)
    return {
        "stopping": stopping.state_dict(),
        "validations": [row for row in logger.rows if "val_acc" in row[1]],
        "global_step": trainer.global_step,
    }


def test_early_stopping_decides_on_the_synchronous_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    asynchronous = _stopped_early("async", tmp_path / "async")
    async_bars = capsys.readouterr().out
    synchronous = _stopped_early("sync", tmp_path / "sync")
    sync_bars = capsys.readouterr().out
    # each validation's bar names the step it validates, where it runs while training goes on
    assert "Validation of step 3 DataLoader 0: 100%" in async_bars and "Validation of step 6" in async_bars
    assert "Validation DataLoader 0: 100%" in sync_bars and "of step" not in sync_bars
    # the same decision, on the same validation: the second, at the first epoch's end (step 6)
    assert synchronous["stopping"]["stopped_epoch"] == 0 and synchronous["global_step"] == 6
    assert_same(asynchronous["stopping"], synchronous["stopping"], "EarlyStopping")
    assert asynchronous["validations"] == synchronous["validations"]
    # the training workers went on until the decision reached them, and stopped then
    assert 6 < asynchronous["global_step"] < 18


class LaggingLogger(RowLogger):
    """Holds the controller's loop back at each row before step ``until``: the training workers,
    which never wait for it, get that far ahead of its replay of their validations."""

    def __init__(self, until: int) -> None:
        super().__init__()
        self._until = until

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        if step is not None and step < self._until:
            time.sleep(0.5)
        super().log_metrics(metrics, step)


def _failing(
    root: Path, step: Optional[int], how: str, logger: Optional[RowLogger] = None, step_s: float = 0.0
) -> dict[str, Any]:
    """The asynchronous fit of :func:`_fit`, without checkpoints, whose validation worker of rank 1
    fails in the validation of ``step`` (or of rank 0 at the ``fit``'s end: ``None``) as ``how`` says;
    each training step sleeps ``step_s``."""
    model, rows = recording(root)
    logger = logger or rows
    model.fail_validation = (step, how)
    model.step_s = step_s
    _trainer("async", logger).fit(model)
    return {"rows": logger.rows, "weights": model.state_dict(), "places": places(root)}


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failed_validation_is_reported_and_training_goes_on(
    how: str, synchronous: dict[str, Any], tmp_path: Path
) -> None:
    with pytest.warns(ValidationFailedWarning, match=r"the validation at step 6 \(epoch 0\) failed on the validation"):
        asynchronous = _failing(tmp_path, 6, how)
    # the failed validation (the second) has no row; the others, on new validation workers after it, have theirs
    validations = [row for row in synchronous["rows"] if "val_loss" in row[1]]
    expected = [row for row in synchronous["rows"] if row is not validations[1]]
    assert asynchronous["rows"] == expected, _differing(asynchronous["rows"], expected)
    assert len(asynchronous["places"]["validation"]) == 4  # two validation workers, then two new ones
    assert_same(asynchronous["weights"], synchronous["weights"], "weights")


def test_a_validation_worker_that_died_after_its_validation_is_replaced_for_the_next(
    synchronous: dict[str, Any], tmp_path: Path
) -> None:
    """Rank 0's validation worker, alive, takes the next weights; rank 1's cannot, and the
    controller, behind, has not seen it die: every training rank hands them again, to new
    validation workers. The steps are longer than rank 0's fetch lingers for (``worker.loop``), as
    on a loaded machine: the entries of the batch in which the ranks wait for new validation workers
    must reach the controller before that batch ends (they once waited for it, and the fit hung)."""
    with pytest.warns(ValidationFailedWarning, match=r"at step (6|9) \(epoch (0|1)\)"):
        asynchronous = _failing(tmp_path, 6, "kill after", LaggingLogger(until=9), step_s=2 * FETCH_LINGER_S)
    # the validation of step 6 has its results, unless the controller saw the death as it took them
    validations = [row for row in synchronous["rows"] if "val_loss" in row[1]]
    without = [row for row in synchronous["rows"] if row is not validations[1]]
    assert asynchronous["rows"] in (synchronous["rows"], without), _differing(asynchronous["rows"], without)
    assert len(asynchronous["places"]["validation"]) == 4
    assert_same(asynchronous["weights"], synchronous["weights"], "weights")


def test_validation_workers_that_fail_as_the_fit_ends_are_reported_after_every_result(
    synchronous: dict[str, Any], tmp_path: Path
) -> None:
    with pytest.warns(ValidationFailedWarning, match=r"failed as their `fit` ended, after the results of every"):
        asynchronous = _failing(tmp_path, None, "kill")
    assert asynchronous["rows"] == synchronous["rows"]


def _differing(rows: list[Any], expected: list[Any]) -> str:
    """The rows that differ from ``expected``, each beside its expected row, for a failure's message
    (this test once failed under load, its message cut short)."""
    pairs = [(index, *pair) for index, pair in enumerate(itertools.zip_longest(rows, expected)) if pair[0] != pair[1]]
    return "\n".join(f"row {index}: got {got}, expected {want}" for index, got, want in pairs)


def test_a_failed_validation_ends_the_fit_where_a_warnings_filter_asks(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ValidationFailedWarning)
        with pytest.raises(ValidationFailedWarning, match=r"at step 6 .*Worker rank 1 on host .* RuntimeError"):
            _failing(tmp_path, 6, "raise")


class CountsInBothHooks(PlaceRecordingClassifier):
    """Counts validation batches in the attribute that counts training batches."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.trained_batches += 1
        super().validation_step(batch, batch_idx)


def test_an_attribute_that_training_and_validation_both_change_is_an_error(tmp_path: Path) -> None:
    """The validation's change would never reach training, as it would synchronously."""
    (tmp_path / "places").mkdir()
    model = CountsInBothHooks()
    model.record_dir = str(tmp_path / "places")
    with pytest.raises(
        WorkerError, match=r"SharedAttributeError.*`self.trained_batches` changed in training hooks and"
    ):
        _trainer("async", RowLogger()).fit(model)
