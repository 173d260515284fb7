"""The weights travel once: a stage sends the module's storages at most once, whatever the number
of workers, and none that the workers already hold; every rank still starts with exactly the
controller's weights, whatever changed them since the last stage.

The bytes are counted where the controller hands its messages to Monarch (``strategy.sent_bytes``:
each message's pickled size once per rank it goes to, and the files in shared memory once). The
weights every rank starts a stage with are saved by the rank itself (``WeightRecorder``) and
compared with the controller's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_monarch
from lightning_monarch import MonarchFSDPStrategy, MonarchStrategy
from tests.memory import PeakRss
from tests.models import WeightRecorder
from tests.parity_cases import SEED, TokenTransformer

pytestmark = pytest.mark.timeout(240)


def _trainer(strategy: Any = "monarch", devices: int = 2, **flags: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(strategy=strategy, **{**options, **flags})


def _state_bytes(module: nn.Module) -> int:
    return sum(tensor.nbytes for tensor in module.state_dict().values())


def _sent(trainer: L.Trainer) -> int:
    return sum(trainer.strategy.sent_bytes.values())


def _storages_sent(trainer: L.Trainer) -> int:
    """The bytes of storages that travelled apart from the stage's pickle: in shared memory or to rank 0."""
    return trainer.strategy.sent_bytes.get("shared memory", 0) + trainer.strategy.sent_bytes.get("receive_storages", 0)


def _assert_every_rank_started_with(model: WeightRecorder, ranks: int) -> None:
    """Every rank's weights at the start of the last validation equal the controller's, bit for bit."""
    expected = model.state_dict()
    for rank in range(ranks):
        got = torch.load(Path(model.record_dir) / f"rank{rank}.pt")
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype, (rank, name)
            assert torch.equal(got[name], tensor), f"rank {rank} started with other `{name}` than the controller's"


@pytest.mark.parametrize(
    ("devices", "shared_memory"),
    [(2, True), (4, True), (2, False)],
    ids=["2 workers, shared memory", "4 workers, shared memory", "2 workers, one message to rank 0"],
)
def test_the_first_stage_sends_the_weights_once_and_a_warm_one_none(
    devices: int, shared_memory: bool, tmp_path: Path
) -> None:
    lightning_monarch.stop_meshes()  # a new mesh holds nothing
    torch.manual_seed(SEED)
    model = WeightRecorder(str(tmp_path), width=1024)
    size = _state_bytes(model)
    trainer = _trainer(MonarchStrategy(shared_memory=shared_memory), devices)
    trainer.fit(model)
    sent = trainer.strategy.sent_bytes
    assert _sent(trainer) <= 1.05 * size, sent
    # the weights, once (storages with equal bytes, as a batch norm's ones and zeros, once in all)
    assert sent["shared memory" if shared_memory else "receive_storages"] >= 0.99 * size

    trainer.validate(model, verbose=False)
    # no weights: each worker's spec only (about 10 KB: the stage's pickle without its storages, and
    # the state of the classes and modules it refers to), about 1 % of this 4 MiB model in all
    assert _sent(trainer) < 0.02 * size, trainer.strategy.sent_bytes
    _assert_every_rank_started_with(model, devices)


def _load_state_dict(model: WeightRecorder) -> WeightRecorder:
    model.load_state_dict(WeightRecorder(model.record_dir).state_dict())
    return model


def _in_place(model: WeightRecorder) -> WeightRecorder:
    with torch.no_grad():
        model.layer.weight.mul_(0.5)
    return model


def _through_data(model: WeightRecorder) -> WeightRecorder:
    model.layer.weight.data[3, 5] = 42.0
    return model


def _replaced_parameter(model: WeightRecorder) -> WeightRecorder:
    model.layer.bias = nn.Parameter(torch.randn_like(model.layer.bias))
    return model


def _replaced_buffer(model: WeightRecorder) -> WeightRecorder:
    model.norm.running_mean = torch.randn_like(model.norm.running_mean)
    return model


def _double(model: WeightRecorder) -> WeightRecorder:
    return model.double()


CHANGES: dict[str, Callable[[WeightRecorder], WeightRecorder]] = {
    "nothing": lambda model: model,
    "load_state_dict": _load_state_dict,
    "an in-place write under no_grad": _in_place,
    "a write through .data": _through_data,
    "a replaced parameter": _replaced_parameter,
    "a replaced buffer": _replaced_buffer,
    "another module object": lambda model: WeightRecorder(model.record_dir),
    "another dtype": _double,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_after_a_change_on_the_controller_every_rank_starts_with_its_weights(change: str, tmp_path: Path) -> None:
    """After ``fit`` the workers hold their weights (each rank's batch-norm statistics its own);
    whatever changed the controller's module since, the next stage starts every rank with the
    controller's weights: what changed travels, what did not stays."""
    torch.manual_seed(SEED)
    model = WeightRecorder(str(tmp_path))
    trainer = _trainer()
    trainer.fit(model)
    model = CHANGES[change](model)
    trainer.validate(model, verbose=False)
    _assert_every_rank_started_with(model, 2)
    if change == "nothing":
        assert not _storages_sent(trainer), trainer.strategy.sent_bytes


def test_storages_with_equal_bytes_stay_two_storages_on_the_workers(tmp_path: Path) -> None:
    """Two buffers that hold the same bytes have one key; each rank still gets two storages, so that
    a write into one does not show in the other."""
    torch.manual_seed(SEED)
    model = WeightRecorder(str(tmp_path))
    _trainer(limit_val_batches=0).fit(model)  # no validation: the twins still hold zeros, both
    _trainer().validate(model, verbose=False)
    for rank in range(2):
        twins = torch.load(tmp_path / f"twins{rank}.pt")
        assert torch.equal(twins["a"], torch.ones_like(twins["a"])) and not twins["b"].any(), rank


def test_after_a_sharded_fit_the_next_stage_runs_from_the_workers_shards() -> None:
    """Under ``MonarchFSDPStrategy`` the controller's module is on the meta device after ``fit``; a
    ``validate`` of it runs from the shards the warm workers kept (nothing of the weights travels)
    and gives what the same weights give when they come from the controller. Once another module
    ran, the workers keep its shards instead, and the error says how to load the weights first."""
    torch.manual_seed(SEED)
    model = TokenTransformer()
    trainer = _trainer(MonarchFSDPStrategy(fsdp_policy={nn.TransformerEncoderLayer}), limit_val_batches=2)
    trainer.fit(model)
    trained = trainer.strategy.gather_full_state_dict()
    trainer.validate(model, verbose=False)
    assert not _storages_sent(trainer), trainer.strategy.sent_bytes
    assert all(parameter.is_meta for parameter in model.parameters())
    from_shards = float(trainer.callback_metrics["val_loss"])

    loaded = TokenTransformer()
    loaded.load_state_dict(trained)
    trainer.validate(loaded, verbose=False)
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(from_shards, rel=1e-6)

    # the workers keep the shards of `loaded` now, not those of the trained module
    with pytest.raises(MisconfigurationException, match="no warm worker mesh keeps its trained shards"):
        trainer.validate(model, verbose=False)


def test_a_messages_size_is_its_pickles_counted_without_a_copy() -> None:
    """``controller.mesh.counted.pickled_size``: the length of the protocol-5 pickle (numpy's
    buffers out of band, as Monarch sends them), cloudpickle's for what only it pickles, and no
    copy of the bytes while counting."""
    import pickle
    import tracemalloc

    import numpy as np

    from lightning_monarch.controller.mesh.counted import pickled_size

    args = ([b"x" * 1000, bytearray(300)], {"array": np.arange(50.0)}, "text")
    in_band = len(pickle.dumps(args, protocol=5))
    assert abs(pickled_size(args) - in_band) < 64, (pickled_size(args), in_band)
    assert pickled_size((lambda x: x,)) > 0  # cloudpickle's
    weights = [bytes(100 * 2**20)]
    tracemalloc.start()
    try:
        assert pickled_size((weights,)) >= 100 * 2**20
        assert tracemalloc.get_traced_memory()[1] < 2**20  # the peak while counting: no copy
    finally:
        tracemalloc.stop()


class LargeValidated(L.LightningModule):
    """400 MiB of weights, validated on two small batches."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(10240, 10240)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("out", self.layer(batch).mean())

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(4, 10240), batch_size=1)


def test_a_stage_sent_by_message_holds_one_copy_of_the_weights_on_the_controller() -> None:
    """Storages that go to rank 0 in one message (``shared_memory=False``; also a small ``/dev/shm``
    or rank 0 on another host) are copied once on the controller (``storages.copies``, which Monarch
    sends as they are); counting the message's bytes copies nothing more."""
    model = LargeValidated()
    size = _state_bytes(model)
    trainer = _trainer(MonarchStrategy(shared_memory=False))
    with PeakRss() as peak:
        trainer.validate(model, verbose=False)
    assert trainer.strategy.sent_bytes["receive_storages"] >= size
    assert peak.growth <= 1.25 * size, f"{peak.growth / 2**20:.0f} MiB above the module's {size / 2**20:.0f} MiB"
