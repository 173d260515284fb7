"""``MonarchFSDPStrategy``: workers shard the module with FSDP2 and train as ``ddp`` does.

DDP all-reduces gradients and FSDP2 reduce-scatters them, in another order of float additions,
so the loss curve and the final weights are compared to Lightning's own ``ddp`` to float
tolerance, not bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
from torch.utils.data import DataLoader, TensorDataset

import lightning_monarch
from lightning_monarch import MonarchFSDPStrategy, MonarchStrategy
from tests.conftest import run_ddp_reference
from tests.memory import PeakRss
from tests.models import Classifier
from tests.parity_cases import SEED, SHARDED_CASES, TokenTransformer, run_case

pytestmark = pytest.mark.timeout(300)

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
POLICY = {nn.TransformerEncoderLayer}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_ddp_reference(tmp_path_factory.mktemp("ddp"), list(SHARDED_CASES))


def _trainer(strategy: Any, **flags: Any) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
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
    through ``gather_full_state_dict()``, during the stage or after it from the warm mesh; once the
    mesh is stopped, the module cannot run another stage."""
    L.seed_everything(SEED)
    model = TokenTransformer()
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    gather = GatherAtFitEnd()
    trainer = _trainer(MonarchFSDPStrategy(fsdp_policy=POLICY), callbacks=[gather])
    trainer.fit(model)

    assert {parameter.device.type for parameter in model.parameters()} == {"meta"}
    assert model.losses and len(model.losses) == 3  # rank 0's module attributes still come back
    after = trainer.strategy.gather_full_state_dict()
    assert set(after) == set(initial)
    assert all(value.device.type == "cpu" for value in after.values())
    for name, value in after.items():
        torch.testing.assert_close(value, gather.state[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(after["encoder.layers.0.linear1.weight"], initial["encoder.layers.0.linear1.weight"])

    lightning_monarch.stop_meshes()  # the shards go with the workers
    with pytest.raises(MisconfigurationException, match="parameters on the meta device.*gather_full_state_dict"):
        trainer.validate(model)
    model.to_empty(device="cpu")
    model.load_state_dict(after)
    torch.testing.assert_close(model.state_dict(), after)


def test_policy_that_matches_nothing_warns_and_shards_the_root() -> None:
    L.seed_everything(SEED)
    model = TokenTransformer()
    trainer = _trainer(MonarchFSDPStrategy(fsdp_policy={nn.LSTM}), limit_train_batches=1)
    with pytest.warns(UserWarning, match=r"fsdp_policy=\{LSTM\}\)`: the module has no submodule of these classes"):
        trainer.fit(model)
    assert len(trainer.strategy.gather_full_state_dict()) == len(TokenTransformer().state_dict())


class RecordingTransformer(TokenTransformer):
    """``TokenTransformer`` that records, on the workers, what the sharded module computes with:
    the dtype of the root's gathered parameters in ``training_step``, the dtype of the shards the
    optimizer steps, and the class of each encoder layer."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.compute_dtype = self.head.weight.dtype
        self.layer_classes = [type(layer).__name__ for layer in self.encoder.layers]
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.shard_dtypes = {parameter.dtype for parameter in self.parameters()}


def _fit_sharded(**options: Any) -> tuple[RecordingTransformer, dict[str, torch.Tensor]]:
    L.seed_everything(SEED)
    model = RecordingTransformer()
    trainer = _trainer(MonarchFSDPStrategy(fsdp_policy=POLICY, **options))
    trainer.fit(model)
    return model, trainer.strategy.gather_full_state_dict()


@pytest.fixture(scope="module")
def fp32_run() -> tuple[RecordingTransformer, dict[str, torch.Tensor]]:
    return _fit_sharded()


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_shards(fp32_run: Any) -> None:
    """The gathered parameters are bf16 in ``training_step``; the shards the optimizer steps stay
    fp32; the losses stay close to the fp32 run's."""
    reference, _ = fp32_run
    assert reference.compute_dtype == torch.float32
    model, weights = _fit_sharded(
        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    assert model.compute_dtype == torch.bfloat16
    assert model.shard_dtypes == {torch.float32}
    assert {value.dtype for value in weights.values()} == {torch.float32}
    assert all(torch.isfinite(torch.tensor(model.losses)))
    torch.testing.assert_close(model.losses, reference.losses, rtol=0.02, atol=0.02)


@pytest.mark.parametrize(
    ("options", "layer_class"),
    [
        ({"activation_checkpointing_policy": POLICY}, "FSDPCheckpointWrapper"),
        ({"cpu_offload": True}, "FSDPTransformerEncoderLayer"),
    ],
)
def test_activation_checkpointing_and_cpu_offload_train_as_without(
    options: dict[str, Any], layer_class: str, fp32_run: Any
) -> None:
    """Recomputed activations and CPU-held shards give the same losses and weights; with
    activation checkpointing each layer is sharded inside its checkpoint wrapper."""
    reference, reference_weights = fp32_run
    model, weights = _fit_sharded(**options)
    assert model.layer_classes == [layer_class] * 4
    torch.testing.assert_close(model.losses, reference.losses, **TOLERANCE)
    assert set(weights) == set(reference_weights)
    for name, weight in reference_weights.items():
        torch.testing.assert_close(weights[name], weight, **TOLERANCE, msg=name)


class WideStack(L.LightningModule):
    """A stack of ``depth`` square Linear layers of ``width``, built in ``configure_model``: on the
    workers, so that the controller's module never holds their weights (the memory rule of
    docs/large-models.md). ``parameter_count`` is counted on the workers."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.width, self.depth = width, depth
        self.layers: Optional[nn.Sequential] = None

    def configure_model(self) -> None:
        self.layers = nn.Sequential(*(nn.Linear(self.width, self.width) for _ in range(self.depth)))
        self.parameter_count = sum(parameter.numel() for parameter in self.layers.parameters())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.layers is not None
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(4, self.width)), batch_size=1)


def _controller_growth(width: int, depth: int) -> tuple[int, WideStack]:
    """How much the controller's RSS grows from building the model to the end of a 2-step ``fit``."""
    trainer = _trainer(MonarchFSDPStrategy(fsdp_policy={nn.Linear}), max_steps=2)
    with PeakRss() as rss:
        model = WideStack(width, depth)
        trainer.fit(model)
    assert trainer.global_step == 2
    return rss.growth, model


def test_controller_memory_stays_flat_while_the_model_grows() -> None:
    """A ~300 MB model built in ``configure_model`` trains on 2 sharded workers while the
    controller's RSS grows by less than a twentieth of it, as for a model 3000 times smaller
    (which runs first, so that the mesh's start is not counted against the big one)."""
    _, small = _controller_growth(width=64, depth=2)
    big_growth, big = _controller_growth(width=2048, depth=18)
    assert small.parameter_count == 2 * 64 * 65 and big.parameter_count == 18 * 2048 * 2049
    assert list(big.parameters()) == []  # the controller's module never had the layers
    assert big_growth < 4 * big.parameter_count / 20, f"{big_growth / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("strategy", "options", "error", "match"),
    [
        (
            MonarchStrategy,
            {"parallelism": "fsdp"},
            TypeError,
            r"parallelism='fsdp'\)`: sharding the module across the workers is `MonarchFSDPStrategy`'s job",
        ),
        (
            MonarchStrategy,
            {"parallelism": "ddp"},
            TypeError,
            r"always gives every worker a replica.*Remove `parallelism`",
        ),
        (
            MonarchStrategy,
            {"max_restarts": 1, "snapshot_dir": "/tmp/snapshots"},
            TypeError,
            r"Pass `lightning_monarch.MonarchFSDPStrategy\(snapshot_dir=...\)`",
        ),
        (
            MonarchStrategy,
            {"fsdp_policy": POLICY, "cpu_offload": True},
            TypeError,
            r"Pass `lightning_monarch.MonarchFSDPStrategy\(cpu_offload=..., fsdp_policy=...\)`, or `strategy='monarch_fsdp'`",
        ),
        (
            MonarchFSDPStrategy,
            {"find_unused_parameters": True},
            ValueError,
            r"find_unused_parameters=...\)`: these are not arguments of `MonarchStrategy` but `DistributedDataParallel`'s",
        ),
        (MonarchFSDPStrategy, {"fsdp_policy": {"TransformerEncoderLayer"}}, TypeError, "are not `nn.Module` classes"),
        (
            MonarchFSDPStrategy,
            {"mixed_precision": (torch.bfloat16, torch.float32)},
            TypeError,
            r"give FSDP2's `MixedPrecisionPolicy`.*mixed_precision=MixedPrecisionPolicy\(param_dtype=torch.bfloat16",
        ),
        (
            MonarchFSDPStrategy,
            {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)},
            TypeError,
            "give FSDP2's `MixedPrecisionPolicy`",
        ),
        (
            MonarchFSDPStrategy,
            {"mixed_precision": MixedPrecisionPolicy(param_dtype=torch.int8)},
            TypeError,
            r"\{'param_dtype': torch.int8\} are not floating-point torch dtypes",
        ),
        (
            MonarchFSDPStrategy,
            {"activation_checkpointing_policy": [nn.Linear, "Block"]},
            TypeError,
            r"activation_checkpointing_policy=.*\['Block'\] are not `nn.Module` classes",
        ),
        (MonarchFSDPStrategy, {"cpu_offload": "yes"}, TypeError, r"cpu_offload='yes'\)`: give True or False"),
        (
            MonarchFSDPStrategy,
            {"max_restarts": -1},
            ValueError,
            r"MonarchFSDPStrategy\(max_restarts=-1\)`: give a whole",
        ),
    ],
)
def test_bad_strategy_arguments(strategy: type, options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        strategy(**options)


def test_a_module_without_policy_is_sharded_whole_with_one_warning(tmp_path: Path) -> None:
    """What Lightning's ``strategy="fsdp"`` does without an ``auto_wrap_policy``; it trains as ``ddp``
    in ``test_sharded_training_matches_ddp[fsdp_root_only]``."""
    with pytest.warns(
        UserWarning,
        match=r"without `fsdp_policy`: `Classifier` does not shard itself in"
        r" `configure_model`, so FSDP2 shards it as one unit",
    ) as caught:
        _trainer(MonarchFSDPStrategy()).fit(Classifier())
    assert len([w for w in caught if "without `fsdp_policy`" in str(w.message)]) == 1


def test_registered_name() -> None:
    trainer = _trainer("monarch_fsdp")
    assert type(trainer.strategy) is MonarchFSDPStrategy


class RecordsThreads(TokenTransformer):
    def on_fit_start(self) -> None:
        self.threads = torch.get_num_threads()


def test_sharded_workers_get_the_threads_lightnings_launcher_gives_a_rank() -> None:
    """On fresh workers, as on a ``ddp`` or ``ModelParallelStrategy`` rank that Lightning launched:
    the host's CPUs shared out over its 2 workers (``ModelParallelStrategy`` under torchrun's
    environment sets none; a warm worker had them from its DDP stages, a replacement did not)."""
    lightning_monarch.stop_meshes()
    model = RecordsThreads()
    _trainer(MonarchFSDPStrategy(fsdp_policy=POLICY)).fit(model)
    assert model.threads == max(1, len(os.sched_getaffinity(0)) // 2)
