"""``MonarchStrategy(parallelism="fsdp")``: workers shard the module with FSDP2 and train as ``ddp`` does.

DDP all-reduces gradients and FSDP2 reduce-scatters them, in another order of float additions,
so the loss curve and the final weights are compared to Lightning's own ``ddp`` to float
tolerance, not bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_monarch import MonarchStrategy
from tests.conftest import run_ddp_reference, worker_processes
from tests.models import Classifier
from tests.parity_cases import SEED, SHARDED_CASES, TokenTransformer, run_case

pytestmark = pytest.mark.timeout(300)

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
POLICY = {nn.TransformerEncoderLayer}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_ddp_reference(tmp_path_factory.mktemp("ddp"), list(SHARDED_CASES))


def _trainer(strategy: Any, **flags: Any) -> L.Trainer:
    options = dict(accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=3, limit_val_batches=0,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, logger=False)
    return L.Trainer(strategy=strategy, **{**options, **flags})


@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_sharded_training_matches_ddp(case: str, ddp_results: Path, tmp_path: Path) -> None:
    """By policy or by the module's own ``configure_model``: the same loss per step, metrics and
    final full weights (gathered from the shards) as ``ddp`` on 2 processes."""
    ours = run_case(case, "monarch", tmp_path)
    reference = torch.load(ddp_results / case / "results.pt", weights_only=False)
    assert ours is not None
    assert ours["global_step"] == reference["global_step"]
    assert len(ours["losses"]) == reference["global_step"]
    torch.testing.assert_close(ours["losses"], reference["losses"], **TOLERANCE)
    torch.testing.assert_close(ours["callback_metrics"], reference["callback_metrics"], **TOLERANCE)
    assert set(ours["weights"]) == set(reference["weights"])
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][name], weight, **TOLERANCE, msg=name)


class GatherAtFitEnd(L.Callback):
    """A controller callback that gathers the full weights while the stage still runs."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = trainer.strategy.gather_full_state_dict()


def test_controller_never_holds_the_trained_weights() -> None:
    """After ``fit`` the controller's module is on the meta device; the full weights come only
    through ``gather_full_state_dict()``, during the stage or after it from the warm mesh; the
    module cannot run another stage, nor can a checkpoint be written."""
    L.seed_everything(SEED)
    model = TokenTransformer()
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    gather = GatherAtFitEnd()
    trainer = _trainer(MonarchStrategy(parallelism="fsdp", fsdp_policy=POLICY), callbacks=[gather])
    trainer.fit(model)

    assert {parameter.device.type for parameter in model.parameters()} == {"meta"}
    assert model.losses and len(model.losses) == 3  # rank 0's module attributes still come back
    after = trainer.strategy.gather_full_state_dict()
    assert set(after) == set(initial)
    assert all(value.device.type == "cpu" for value in after.values())
    for name, value in after.items():
        torch.testing.assert_close(value, gather.state[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(after["encoder.layers.0.linear1.weight"], initial["encoder.layers.0.linear1.weight"])

    with pytest.raises(NotImplementedError, match="sharded checkpoints under parallelism='fsdp' are not supported"):
        trainer.save_checkpoint("unused.ckpt")
    with pytest.raises(MisconfigurationException, match="parameters on the meta device.*gather_full_state_dict"):
        trainer.validate(model)
    model.to_empty(device="cpu")
    model.load_state_dict(after)
    torch.testing.assert_close(model.state_dict(), after)


def test_policy_that_matches_nothing_warns_and_shards_the_root() -> None:
    L.seed_everything(SEED)
    model = TokenTransformer()
    trainer = _trainer(MonarchStrategy(parallelism="fsdp", fsdp_policy={nn.LSTM}), limit_train_batches=1)
    with pytest.warns(UserWarning, match=r"fsdp_policy=\{LSTM\}\)`: the module has no submodule of these classes"):
        trainer.fit(model)
    assert len(trainer.strategy.gather_full_state_dict()) == len(TokenTransformer().state_dict())


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"parallelism": "zero3"}, ValueError, r"parallelism='zero3'\)`: choose 'ddp'.* or 'fsdp'"),
        ({"parallelism": "fsdp", "max_restarts": 1}, ValueError, "recovery under sharding is not supported yet"),
        ({"parallelism": "fsdp", "find_unused_parameters": True}, ValueError,
         "find_unused_parameters=...\\)`: these are `DistributedDataParallel` arguments"),
        ({"fsdp_policy": POLICY}, ValueError, "only `parallelism='fsdp'` does"),
        ({"parallelism": "fsdp", "fsdp_policy": {"TransformerEncoderLayer"}}, TypeError, "are not `nn.Module` classes"),
    ],
)
def test_bad_strategy_arguments(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        MonarchStrategy(**options)


@pytest.mark.parametrize(
    ("model", "flags", "fit_kwargs", "match"),
    [
        (TokenTransformer, {"enable_checkpointing": True}, {}, "ModelCheckpoint`: sharded checkpoints under"
         " parallelism='fsdp' are not supported yet.*enable_checkpointing=False"),
        (TokenTransformer, {}, {"ckpt_path": "last.ckpt"}, r"trainer.fit\(ckpt_path='last.ckpt'\)`.*Remove `ckpt_path`"),
        (Classifier, {}, {}, "would not be sharded: give the classes of its repeated blocks"),
    ],
)
def test_stages_that_cannot_run_sharded_fail_before_any_worker_starts(
    model: type, flags: dict[str, Any], fit_kwargs: dict[str, Any], match: str
) -> None:
    policy = POLICY if model is TokenTransformer else None
    trainer = _trainer(MonarchStrategy(parallelism="fsdp", fsdp_policy=policy, keep_warm=False), **flags)
    workers_before = {process.pid for process in worker_processes()}
    with pytest.raises(MisconfigurationException, match=match):
        trainer.fit(model(), **fit_kwargs)
    assert {process.pid for process in worker_processes()} == workers_before


def test_registered_name() -> None:
    trainer = _trainer("monarch_fsdp")
    assert isinstance(trainer.strategy, MonarchStrategy)
    assert trainer.strategy.parallelism == "fsdp"
