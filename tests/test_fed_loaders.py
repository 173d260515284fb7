"""Iterables that cannot travel to the workers: the controller iterates them for every rank
(``lightning_monarch.wire.fed``), or the error names the object, where it was handed to the Trainer and
the fix. What it trains equals ``ddp`` bit for bit in the parity case ``generator_loaders``.

Runs a real Trainer on the warm mesh of 2 CPU workers, or fails before any worker starts.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import traceback
from typing import Any, Optional

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_monarch import MonarchStrategy, WorkerError, observe_only, stop_meshes
from tests.compat_models import WindowStream
from tests.models import ClassificationData, Classifier
from tests.test_bad_input import _assert_raised_before_spawning, _trainer

pytestmark = pytest.mark.timeout(300)


class CachedData(Dataset):
    """A dataset that keeps a lock in a cache of its own."""

    def __init__(self) -> None:
        self.data = ClassificationData(32)
        self._cache = {"lock": threading.Lock()}

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return self.data[index]


class HoldingDataModule(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.train_set = CachedData()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=8)


def test_an_object_deep_in_a_datamodule_is_named_by_its_path() -> None:
    with pytest.raises(TypeError, match=re.escape("`datamodule.train_set._cache['lock']` (a `lock`) cannot")) as error:
        _trainer().fit(Classifier(), datamodule=HoldingDataModule())
    assert "create them in `setup()`" in str(error.value)
    _assert_raised_before_spawning(error)


def test_a_dataloader_that_cannot_travel_names_the_object_and_where_it_was_handed_over() -> None:
    loader = DataLoader(CachedData(), batch_size=8)
    line = _next_line()
    with pytest.raises(TypeError) as error:
        _trainer().fit(Classifier(), train_dataloaders=loader)
    message = str(error.value)
    assert f"`train_dataloaders` iterable `DataLoader` (handed to the Trainer at {__file__}:{line + 2})" in message
    assert "`train_dataloaders.dataset._cache['lock']` (a `lock`) cannot" in message
    assert "`DistributedSampler`" in message and "Make it picklable" in message
    _assert_raised_before_spawning(error)


def _next_line() -> int:
    """The line of the caller's call of this function."""
    return traceback.extract_stack(limit=2)[0].lineno or 0


@pytest.mark.parametrize(
    ("strategy", "stage", "match"),
    [
        (MonarchStrategy(max_restarts=1), "fit", r"max_restarts=1\)` resumes replaced workers"),
        (MonarchStrategy(rehearse=True), "fit", r"rehearse=True\)` would iterate it in the rehearsal"),
        ("monarch", "predict", r"`trainer.predict` would then predict every item on every rank"),
    ],
    ids=["max_restarts", "rehearse", "predict"],
)
def test_a_stream_is_refused_where_the_workers_would_iterate_it_again(strategy: Any, stage: str, match: str) -> None:
    arguments = {"train_dataloaders": WindowStream()} if stage == "fit" else {"dataloaders": WindowStream()}
    with pytest.raises(
        TypeError, match=r"`WindowStream`.*`(train_)?dataloaders._stream` \(a `generator`: `WindowStream._windows` at"
    ) as error:
        getattr(_trainer(strategy=strategy), stage)(Classifier(), **arguments)
    assert re.search(match, str(error.value))
    _assert_raised_before_spawning(error)


class RankDependentDraws(Classifier):
    """Draws from torch's global generator as many times as its rank, so that the ranks' states part."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        torch.rand(self.global_rank + 1)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("seed", "module", "item"),
    [(None, Classifier, 0), (7, RankDependentDraws, 2)],  # the fetcher draws one item ahead
    ids=["unseeded", "rank_dependent_draws"],
)
def test_ranks_whose_generators_part_get_an_error_instead_of_other_items(
    seed: Optional[int], module: type, item: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``ddp`` each rank's copy would draw its windows from the rank's own state: unseeded,
    the ranks' states differ from the start (NumPy seeds each new process from entropy: on new
    workers, since a warm mesh's were reseeded alike by an earlier stage's ``seed_everything``);
    seeded, they part where module code draws as many numbers as its rank. One copy cannot yield
    both."""
    if seed is None:  # as a script that never seeds: no seed of an earlier test's `seed_everything` left
        monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
        stop_meshes()
    else:
        L.seed_everything(seed)
    with pytest.raises(
        WorkerError, match=r"draws from the global random number generators \((numpy|torch|numpy, torch)\)"
    ) as error:
        _trainer().fit(module(), train_dataloaders=WindowStream())
    message = str(error.value)
    assert re.search(rf"rank \d's states differ from rank \d's at item {item} of pass 1", message), message
    assert "`lightning.seed_everything(seed)`" in message and "numpy.random.default_rng(seed)" in message


class FailingStream:
    """A stream over a generator that fails at its third item."""

    def __init__(self) -> None:
        self._items = self._generate()

    def _generate(self) -> Any:
        data = ClassificationData(64)
        for index in itertools.count():
            if index == 2:
                raise ValueError("the stream's source went away")
            yield data.tensors[0][index * 8 : index * 8 + 8], data.tensors[1][index * 8 : index * 8 + 8]

    def __iter__(self) -> Any:
        return self._items


def test_an_iterable_that_raises_on_the_controller_fails_the_stage_with_its_traceback() -> None:
    with pytest.raises(WorkerError, match="raised while the controller iterated it for the ranks") as error:
        _trainer().fit(Classifier(), train_dataloaders=FailingStream())
    assert "ValueError: the stream's source went away" in str(error.value)
    assert "in _generate" in str(error.value)


class LockStream:
    """A stream over a generator whose items hold a lock."""

    def __init__(self) -> None:
        self._items = iter([(torch.zeros(8, 16), threading.Lock())])

    def __iter__(self) -> Any:
        return self._items


def test_an_item_that_cannot_be_pickled_fails_the_stage_naming_it() -> None:
    with pytest.raises(WorkerError, match=r"yielded an item that cannot be pickled for the ranks, a `tuple`"):
        _trainer().fit(Classifier(), train_dataloaders=LockStream())


@pytest.fixture
def tcp_by_default() -> Any:
    """Monarch's default transport switched to TCP once this process's client runs on another (as
    a ``SlurmJob`` switches it), for new workers; switched back after the test, with their mesh stopped."""
    from monarch._rust_bindings.monarch_hyperactor.config import configure, get_global_config
    from monarch.actor import context

    context()  # this process's client, on the transport it has
    transport = get_global_config()["default_transport"]
    stop_meshes()
    configure(default_transport="tcp")
    yield
    stop_meshes()
    configure(default_transport=transport)


def test_workers_ask_for_fed_items_as_their_actor(tcp_by_default: None) -> None:
    """The loop thread asks the controller in its actor's context (``worker.loop``): without it,
    Monarch starts a second client in the worker for that thread, which panics where TCP cannot
    bind to this host's name (it resolves only to loopback), as it did in CI after a ``SlurmJob``."""
    L.seed_everything(0)
    trainer = _trainer()
    trainer.fit(Classifier(), train_dataloaders=WindowStream())
    assert trainer.global_step == 6


@observe_only
class DrawingCallback(L.Callback):
    """Draws from the three global generators at each training batch's end: on the controller, on
    the thread that runs the stage, while the workers, running ahead (it waits for nothing), ask
    for fed items."""

    def on_train_batch_end(self, *args: Any) -> None:
        for _ in range(20):
            torch.randn(512)
            np.random.normal(size=512)
            random.random()


def test_the_controllers_own_draws_during_a_feed_reach_no_rank() -> None:
    """The draws of a fed item set the process's generators to the rank's: done on the stage's
    thread (``controller.mesh.stage_thread``), they cannot overlap the user's draws there, so a
    callback that draws at every step on the controller changes nothing the ranks are fed (and no
    rank's states part from another's, which would raise)."""
    weights = []
    for callbacks in ([], [DrawingCallback()]):
        L.seed_everything(7)
        model = Classifier()
        _trainer(callbacks=callbacks, max_epochs=3).fit(model, train_dataloaders=WindowStream(batches_per_pass=12))
        weights.append({key: value.clone() for key, value in model.state_dict().items()})
    for key, value in weights[0].items():
        assert torch.equal(value, weights[1][key]), key
