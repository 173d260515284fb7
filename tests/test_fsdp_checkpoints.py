"""Sharded checkpoints under ``MonarchFSDPStrategy``: every worker writes its own
shards (``torch.distributed.checkpoint``), the controller writes Lightning's metadata beside them,
``ckpt_path=`` resumes on the same or another number of workers, and a converter makes one file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_monarch import MonarchFSDPStrategy, cli, convert_sharded_checkpoint
from tests.conftest import worker_processes
from tests.memory import PeakRss
from tests.parity_cases import SEED, TokenTransformer
from tests.references import run_reference

pytestmark = pytest.mark.timeout(300)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
SHARD_FILES = {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}


def _trainer(devices: int = 2, **flags: Any) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    strategy = MonarchFSDPStrategy(fsdp_policy={nn.TransformerEncoderLayer})
    return L.Trainer(strategy=strategy, **{**options, **flags})


def _model(**sizes: int) -> TokenTransformer:
    L.seed_everything(SEED)
    return TokenTransformer(**sizes)


class SaveDuringFit(L.Callback):
    """A controller callback that saves a checkpoint while the workers' loops are parked, and
    measures this process's memory meanwhile."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with PeakRss() as self.memory:
            trainer.save_checkpoint(self.path)
        with PeakRss() as self.gather_memory:  # the measure's control: the full weights coming here
            trainer.strategy.gather_full_state_dict()


class GatherAtTrainStart(L.Callback):
    """Gathers the full weights after the checkpoint was restored, before the first step."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = trainer.strategy.gather_full_state_dict()


def test_every_worker_writes_its_shards_and_the_controller_the_metadata(tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` and ``ModelCheckpoint(save_last=True)`` write directories in
    ``ModelParallelStrategy``'s layout, with both ranks' shards; the old top-k directory is
    removed; and the controller's memory does not grow by the model's size while saving."""
    model = _model(width=768)
    model_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    assert model_bytes > 30e6
    save = SaveDuringFit(tmp_path / "manual")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    trainer = _trainer(max_epochs=2, limit_train_batches=1, enable_checkpointing=True, callbacks=[checkpoints, save])
    trainer.fit(model)

    print(
        f"controller RSS growth while saving: {save.memory.growth / 1e6:.1f} MB, while gathering:"
        f" {save.gather_memory.growth / 1e6:.1f} MB, model: {model_bytes / 1e6:.1f} MB"
    )
    assert save.memory.growth < model_bytes / 4
    assert save.gather_memory.growth > model_bytes / 2
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["epoch=1-step=2.ckpt", "last.ckpt"]
    # ``ModelCheckpoint`` saves at the end of epoch 1; ``on_train_end`` comes after the epoch count moved on
    for directory, epoch in ((tmp_path / "checkpoints" / "last.ckpt", 1), (tmp_path / "manual", 2)):
        assert {path.name for path in directory.iterdir()} == SHARD_FILES
        shard_bytes = sum((directory / name).stat().st_size for name in ("__0_0.distcp", "__1_0.distcp"))
        assert shard_bytes > model_bytes  # the weights and the optimizer's momentum, split in two
        metadata = torch.load(directory / "meta.pt", weights_only=True)
        assert "state_dict" not in metadata and "optimizer_states" not in metadata
        assert metadata["global_step"] == 2 and metadata["epoch"] == epoch
        assert {"loops", "callbacks", "lr_schedulers", "pytorch-lightning_version"} <= set(metadata)
    assert any(key.startswith("ModelCheckpoint") for key in torch.load(tmp_path / "manual" / "meta.pt")["callbacks"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded checkpoint written by 2 workers after one epoch, and the full weights it holds."""
    path = tmp_path_factory.mktemp("sharded") / "epoch1.ckpt"
    trainer = _trainer()
    trainer.fit(_model())
    trainer.save_checkpoint(path)
    return path, trainer.strategy.gather_full_state_dict()


def test_resume_continues_as_an_uninterrupted_run(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = checkpoint
    uninterrupted = _trainer(max_epochs=2)
    uninterrupted.fit(_model())
    expected = uninterrupted.strategy.gather_full_state_dict()

    model = _model()
    resumed = _trainer(max_epochs=2)
    resumed.fit(model, ckpt_path=path)
    assert resumed.global_step == 6 and len(model.losses) == 3  # only the second epoch ran
    weights = resumed.strategy.gather_full_state_dict()
    assert set(weights) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, **TOLERANCE, msg=name)


def test_resume_on_fewer_workers_reshards(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """A checkpoint of 2 workers resumes on 1: the module's shards are resharded (its full weights
    after the restore are the checkpoint's), and training goes on."""
    path, saved = checkpoint
    gather = GatherAtTrainStart()
    model = _model()
    trainer = _trainer(devices=1, max_epochs=2, callbacks=[gather])
    trainer.fit(model, ckpt_path=path)
    for name, value in saved.items():
        torch.testing.assert_close(gather.state[name], value, rtol=0, atol=0, msg=name)
    assert trainer.global_step == 6 and len(model.losses) == 3
    assert all(torch.isfinite(torch.tensor(model.losses)))
    after = trainer.strategy.gather_full_state_dict()
    assert not torch.equal(after["encoder.layers.0.linear1.weight"], saved["encoder.layers.0.linear1.weight"])


class TransformerWithNorm(TokenTransformer):
    """Another model: a final norm that the checkpoint's model lacks."""

    def __init__(self) -> None:
        super().__init__(layers=3)
        self.norm = nn.LayerNorm(16)


def test_checkpoint_of_another_model_lists_the_mismatched_keys(
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = checkpoint
    workers_before = {process.pid for process in worker_processes()}
    with pytest.raises(
        RuntimeError,
        match=r"sharded checkpoint of another model than `TransformerWithNorm`: missing"
        r" keys \['norm.bias', 'norm.weight'\], unexpected keys \['encoder.layers.3.linear1.bias',",
    ):
        _trainer(max_epochs=2).fit(TransformerWithNorm(), ckpt_path=path)
    assert {process.pid for process in worker_processes()} == workers_before


def test_single_file_checkpoint_is_rejected_before_any_worker_starts(tmp_path: Path) -> None:
    single = tmp_path / "ddp.ckpt"
    torch.save({"state_dict": TokenTransformer().state_dict()}, single)
    workers_before = {process.pid for process in worker_processes()}
    with pytest.raises(
        ValueError,
        match=r"ddp.ckpt'` under `MonarchFSDPStrategy` is not a sharded"
        " checkpoint.*give a sharded checkpoint directory",
    ):
        _trainer().fit(_model(), ckpt_path=single)
    assert {process.pid for process in worker_processes()} == workers_before


def test_converter_writes_a_file_that_load_from_checkpoint_reads(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, saved = checkpoint
    convert_sharded_checkpoint(path, tmp_path / "model.ckpt")
    model = TokenTransformer.load_from_checkpoint(tmp_path / "model.ckpt")
    assert set(model.state_dict()) == set(saved)
    for name, value in saved.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    single = torch.load(tmp_path / "model.ckpt", weights_only=True)
    assert single["global_step"] == 3 and len(single["optimizer_states"]) == 1


def test_convert_command(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, saved = checkpoint
    assert cli.main(["convert", str(path), str(tmp_path / "model.ckpt")]) == 0
    torch.testing.assert_close(torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"], saved)
    assert cli.main(["convert", str(tmp_path), str(tmp_path / "other.ckpt")]) == 2
    assert "lightning-monarch convert: error: `convert_sharded_checkpoint(" in capsys.readouterr().err


def test_lightning_model_parallel_strategy_reads_and_writes_the_same_checkpoints(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Lightning's own ``ModelParallelStrategy`` (one process) resumes from a checkpoint of 2
    workers and writes its own, from which ``monarch_fsdp`` on 2 workers resumes in turn."""
    path, _ = checkpoint
    theirs = tmp_path / "model_parallel.ckpt"
    run_reference("tests.model_parallel_reference", path, theirs, processes=1)
    convert_sharded_checkpoint(theirs, tmp_path / "theirs.ckpt")
    saved = torch.load(tmp_path / "theirs.ckpt", weights_only=True)
    gather = GatherAtTrainStart()
    trainer = _trainer(max_epochs=3, callbacks=[gather])
    trainer.fit(_model(), ckpt_path=theirs)
    for name, value in saved["state_dict"].items():
        torch.testing.assert_close(gather.state[name], value, rtol=0, atol=0, msg=name)
    assert saved["global_step"] == 6 and trainer.global_step == 9
