"""FSDP2 on a worker, for ``MonarchStrategy(parallelism="fsdp")``.

Runs in each worker process. The worker's Trainer uses Lightning's own ``ModelParallelStrategy``
(FSDP2, ``torch.distributed.fsdp.fully_shard``) with one data-parallel dimension over all ranks
and no tensor parallelism. The module is sharded where Lightning expects it, in
``configure_model``: first the module's own hook runs (it may call ``fully_shard`` itself, on
``self.device_mesh["data_parallel"]``), then the policy's module classes and the root are sharded.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from lightning_monarch.protocol import ShardingSpec, TrainerConfig

#: The LightningModule methods Lightning calls instead of ``forward``: FSDP2 must gather the root's
#: parameters around them as it does around ``forward``.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def sharded_strategy(config: TrainerConfig, parallel_devices: Optional[list[torch.device]]) -> ModelParallelStrategy:
    """Lightning's ``ModelParallelStrategy`` for this rank: every rank one data-parallel shard."""
    strategy = ModelParallelStrategy(
        data_parallel_size=config.devices * config.num_nodes,
        tensor_parallel_size=1,
        process_group_backend=config.process_group_backend,
    )
    strategy.cluster_environment = TorchElasticEnvironment()
    strategy.parallel_devices = parallel_devices
    return strategy


def shard_in_configure_model(module: LightningModule, spec: ShardingSpec) -> None:
    """Make ``module.configure_model`` shard the module after the hook itself ran.

    Installed after the gates (``worker.stage``), so that the gated hook is what runs first. The
    wrapper makes Lightning call ``configure_model`` on the worker even when the module does not
    override it; the controller's Lightning then does not call it, so neither does the wrapper
    (L1). A policy that matches nothing is reported here only when the module's own
    ``configure_model`` may have built submodules; otherwise the controller saw it before the
    stage started.
    """
    configure_model: Callable[[], Any] = module.configure_model
    builds_submodules = is_overridden("configure_model", module, LightningModule)

    @functools.wraps(configure_model)
    def configure_and_shard() -> None:
        if builds_submodules:
            configure_model()
        shard(module, spec, warn=builds_submodules)

    vars(module)["configure_model"] = configure_and_shard


def shard(module: LightningModule, spec: ShardingSpec, warn: bool = True) -> None:
    """``fully_shard`` each instance of ``spec.policy`` not sharded yet, then the root module; and
    let FSDP2 gather the root's parameters around the step methods, which Lightning calls instead
    of ``forward``."""
    mesh = module.device_mesh["data_parallel"]
    policy = spec.policy
    matched = [
        submodule
        for submodule in module.modules()
        if submodule is not module and isinstance(submodule, policy) and not isinstance(submodule, FSDPModule)
    ]
    if warn and policy and not matched and not isinstance(module, FSDPModule):
        rank_zero_warn(spec.no_match_warning())
    for submodule in matched:
        fully_shard(submodule, mesh=mesh)
    if not isinstance(module, FSDPModule):
        fully_shard(module, mesh=mesh)
    for method in _STEP_METHODS:
        register_fsdp_forward_method(module, method)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 sharded ``module`` or one of its submodules."""
    return any(isinstance(submodule, FSDPModule) for submodule in module.modules())


def full_state_dict(module: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The sharded module's full state dict on CPU: a collective that every rank joins; rank 0
    gets the whole dict, the other ranks ``None``."""
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if torch.distributed.get_rank() == 0 else None
