"""A worker's exception reaches the controller with its rank and traceback, Lightning's exception
handling runs, and no worker process outlives the call (success, exception or KeyboardInterrupt)."""

from __future__ import annotations

import os
import pickle
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.spike import TrainingSpikeException
from lightning.pytorch.callbacks import OnExceptionCheckpoint, SpikeDetection

from lightning_monarch import MeshFailureError, WorkerError
from lightning_monarch.wire.reports import WorkerFailure
from tests.compat_models import NormClassifier
from tests.conftest import worker_processes
from tests.models import Classifier

pytestmark = pytest.mark.timeout(120)


class FailingClassifier(Classifier):
    """Raises in ``hook`` on ``rank`` at batch ``batch``."""

    def __init__(self, rank: int, hook: str, batch: int = 1) -> None:
        super().__init__()
        self.fail_rank, self.fail_hook, self.fail_batch = rank, hook, batch

    def _maybe_fail(self, hook: str, batch_idx: int) -> None:
        if hook == self.fail_hook and batch_idx == self.fail_batch and self.trainer.global_rank == self.fail_rank:
            raise ValueError(f"failing on purpose in {hook} at {time.time()}")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._maybe_fail("training_step", batch_idx)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._maybe_fail("validation_step", batch_idx)
        super().validation_step(batch, batch_idx)


class RecordExceptions(L.Callback):
    def __init__(self) -> None:
        self.seen: list[BaseException] = []

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.seen.append(exception)


def _trainer(strategy: Any = "monarch", **kwargs: Any) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(strategy=strategy, **{**options, **kwargs})


@pytest.mark.parametrize(("hook", "rank"), [("training_step", 1), ("validation_step", 1), ("training_step", 0)])
def test_worker_exception_names_rank_and_hook(hook: str, rank: int) -> None:
    recorder = RecordExceptions()
    trainer = _trainer(callbacks=[recorder])
    with pytest.raises(WorkerError, match=rf"rank {rank} .*`module\.{hook}`.*failing on purpose") as error:
        trainer.fit(FailingClassifier(rank, hook))
    raised_at = float(re.search(r"failing on purpose in \w+ at ([\d.]+)", str(error.value)).group(1))
    assert time.time() - raised_at < 5, "the worker's exception took over 5 s to reach the controller"
    assert error.value.rank == rank
    assert isinstance(error.value, ValueError), "`except ValueError` catches it, as under ddp"
    assert "Remote traceback" in str(error.value) and f"in {hook}" in str(error.value)
    assert recorder.seen == [error.value], "the controller's callbacks saw on_exception"
    assert trainer.state.status == "interrupted"
    assert not worker_processes()


class Spiking(Classifier):
    """Its loss jumps a thousandfold at the fourth batch: Lightning's ``SpikeDetection`` raises."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1000 if batch_idx == 3 else loss


def test_a_workers_exception_is_caught_by_the_except_clause_of_its_class(tmp_path: Path) -> None:
    """Lightning's ``TrainingSpikeException``, raised on the workers, is one on the controller too,
    with its attributes: ``except TrainingSpikeException`` around ``fit`` catches it, as under ddp."""
    recorder = RecordExceptions()
    with pytest.raises(TrainingSpikeException) as error:
        detection = SpikeDetection(warmup=2, exclude_batches_path=str(tmp_path / "skip.json"))
        _trainer(callbacks=[detection, recorder]).fit(Spiking())
    assert isinstance(error.value, WorkerError)
    assert "Training spike detected in batch 3" in str(error.value) and error.value.rank == 0
    assert recorder.seen == [error.value]


class Refuses(Exception):
    """An exception class that cannot be subclassed."""

    def __init_subclass__(cls) -> None:
        raise TypeError("no subclasses")


class HoldsALock(ValueError):
    def __init__(self) -> None:
        super().__init__("held")
        self.lock = threading.Lock()


@pytest.mark.parametrize(
    ("error", "caught_as"),
    [(Refuses("no"), WorkerError), (HoldsALock(), ValueError), (KeyboardInterrupt(), WorkerError)],
)
def test_a_workers_exception_that_cannot_be_remade_is_a_worker_error(error: BaseException, caught_as: type) -> None:
    """A class that cannot be a base stays a plain ``WorkerError``; one whose instance does not
    pickle is still its class, found by name, without its attributes; an exception that is not an
    ``Exception`` (Ctrl-C on a worker) is a ``WorkerError`` only."""
    remade = WorkerError.of(WorkerFailure.capture(error, rank=1, hook="module.training_step", memory_mib=0.0))
    assert isinstance(remade, caught_as) and isinstance(remade, WorkerError)
    assert str(remade).startswith(f"Worker rank 1 on host {socket.gethostname()} raised {type(error).__name__}")
    assert type(pickle.loads(pickle.dumps(remade))) is WorkerError


def test_an_exception_raised_between_hooks_names_the_step_that_raised_it() -> None:
    """``sync_batchnorm=True`` on CPU workers: Lightning's DDP wrapping, after the setup hooks
    returned, raises DDP's own error, as under ``ddp``; no hook raised it, and the message names
    the step that did."""
    with pytest.raises(
        WorkerError,
        match=r"raised ValueError in the wrapping of the module in `DistributedDataParallel` \(Lightning's DDP setup\)"
        r" \(after `module.setup` returned\): SyncBatchNorm layers",
    ):
        _trainer(sync_batchnorm=True).fit(NormClassifier())


def test_an_exception_raised_in_a_collective_outside_hooks_names_it() -> None:
    """Raised in ``torch.distributed`` outside any hook: the collective is named, with the hook
    that returned before it."""
    try:
        torch.distributed.all_reduce(torch.ones(1))
    except ValueError as error:
        failure = WorkerFailure.capture(error, rank=0, hook=None, memory_mib=0.0, last="module.on_train_start")
    assert failure.where == " in the collective `torch.distributed.all_reduce` (after `module.on_train_start` returned)"


def test_fit_works_again_after_a_worker_failure() -> None:
    with pytest.raises(WorkerError):
        _trainer().fit(FailingClassifier(1, "training_step"))
    trainer = _trainer()
    trainer.fit(Classifier())
    assert trainer.global_step == 4


class InterruptOnBatch(L.Callback):
    """Delivers a real SIGINT to the controller, as Ctrl-C would, during training."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)


def test_keyboard_interrupt_leaves_no_worker_and_fit_works_again() -> None:
    # Ctrl-C raises KeyboardInterrupt through the SIGINT handler of an interactive Python. A process
    # started in the background (`pytest &`, a CI runner) inherits SIGINT ignored, and Python keeps it
    # ignored: the SIGINT sent below would then be lost and the fit run to its end.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    try:
        with pytest.raises(SystemExit):
            _trainer(callbacks=[InterruptOnBatch()]).fit(Classifier())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 30
    assert not worker_processes()
    trainer = _trainer()
    trainer.fit(Classifier())
    assert trainer.global_step == 4


class KillWorkerInValidation(L.Callback):
    """SIGKILLs one worker process from the controller during the first validation batch."""

    def __init__(self) -> None:
        self.killed_at: float = 0.0

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.killed_at or trainer.sanity_checking:
            return
        os.kill(trainer.strategy.worker_pids[1], signal.SIGKILL)
        self.killed_at = time.monotonic()


class UnsyncedClassifier(FailingClassifier):
    """No collective in validation, so the surviving rank does not notice the death itself."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", 0.0)


def test_dead_worker_outside_a_collective_is_named_within_5_s() -> None:
    killer, recorder = KillWorkerInValidation(), RecordExceptions()
    with pytest.raises(MeshFailureError, match=r"Worker rank 1 \(pid \d+ on \S+\) died") as error:
        _trainer(callbacks=[killer, recorder]).fit(UnsyncedClassifier(-1, "none"))
    assert time.monotonic() - killer.killed_at < 5
    assert error.value.ranks == (1,)
    assert recorder.seen == [error.value], "the controller's callbacks saw on_exception"
    assert not worker_processes()


class UnusedHeadClassifier(Classifier):
    """A head that never takes part in the loss: DDP's reducer fails on the next step."""

    def __init__(self) -> None:
        super().__init__()
        self.unused_head = torch.nn.Linear(16, 4)


def test_ddps_own_fix_is_given_in_monarch_terms() -> None:
    def trainer(strategy: str) -> L.Trainer:
        return L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            limit_train_batches=3,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    with pytest.raises(
        WorkerError,
        match=r"(?s)find_unused_parameters.*Under strategy='monarch'.*"
        r"MonarchStrategy\(find_unused_parameters=True\).*strategy='monarch_find_unused_parameters_true'",
    ):
        trainer("monarch").fit(UnusedHeadClassifier())
    # the name the fix gives, by Lightning's convention for its own strategies
    fixed = trainer("monarch_find_unused_parameters_true")
    fixed.fit(UnusedHeadClassifier())
    assert fixed.global_step == 3


def test_on_exception_checkpoint_writes_nothing_where_rank_0_did_not_raise(tmp_path: Path) -> None:
    """Rank 1's exception: under ddp rank 0 never reaches ``on_exception`` (it waits in a
    collective), so ``OnExceptionCheckpoint`` writes nothing; here neither, and it says why. The
    parity case ``on_exception_checkpoint`` shows rank 0's exception writing ddp's file."""
    saver = OnExceptionCheckpoint(dirpath=str(tmp_path))
    with pytest.warns(UserWarning, match=r"`OnExceptionCheckpoint` writes nothing.*no exception of rank 0's code"):
        with pytest.raises(WorkerError, match="rank 1"):
            _trainer(callbacks=[saver], enable_checkpointing=True).fit(FailingClassifier(1, "training_step"))
    assert list(tmp_path.iterdir()) == []
