"""Sharded workers, for ``MonarchModelParallelStrategy`` and ``MonarchFSDPStrategy``.

Runs in each worker process. The worker's Trainer uses Lightning's own ``ModelParallelStrategy``
on the controller's device mesh (data parallel × tensor parallel; ``MonarchFSDPStrategy``: one
data-parallel dimension over all ranks). The module is sharded where Lightning expects it, in
``configure_model``: the module's own hook runs (under ``MonarchModelParallelStrategy`` it applies
tensor parallelism and ``fully_shard`` itself, as under Lightning); under ``MonarchFSDPStrategy``
the activation-checkpointing classes are then wrapped, and the policy's module classes and the
root are sharded with the strategy's mixed precision and CPU offload.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_monarch._compat import torch as torch_compat
from lightning_monarch.wire.specs import ShardingSpec, TrainerConfig

#: The LightningModule methods Lightning calls instead of ``forward``: FSDP2 must gather the root's
#: parameters around them as it does around ``forward``.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class OffloadedModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` for a module sharded with FSDP2's CPU offload.

    Runs in each worker. FSDP2 keeps offloaded shards on the CPU and copies each to the device only
    for its all-gather, and refuses shards found on the device; Lightning's ``model_to_device``
    would move them there. Every parameter belongs to a shard (the root is sharded last), so only
    the buffers go to the device.
    """

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        for submodule in self.model.modules():
            for name, buffer in submodule.named_buffers(recurse=False):
                setattr(submodule, name, buffer.to(self.root_device))


def sharded_strategy(config: TrainerConfig, parallel_devices: Optional[list[torch.device]]) -> ModelParallelStrategy:
    """Lightning's ``ModelParallelStrategy`` for this rank, on the controller's device mesh."""
    spec = config.sharding
    assert spec is not None
    strategy_class = OffloadedModelParallelStrategy if spec.cpu_offload else ModelParallelStrategy
    data_parallel_size, tensor_parallel_size = spec.mesh_shape
    strategy = strategy_class(
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        save_distributed_checkpoint=spec.save_distributed_checkpoint,
        process_group_backend=config.process_group_backend,
        timeout=config.timeout,
    )
    strategy.cluster_environment = TorchElasticEnvironment()
    strategy.parallel_devices = parallel_devices
    return strategy


def shard_in_configure_model(module: LightningModule, spec: ShardingSpec, kept: Optional[torch.nn.Module]) -> None:
    """Make ``module.configure_model`` shard the module after the hook itself ran, and, where
    ``spec.from_shards`` says so, give it the values of ``kept``'s shards.

    Installed after the gates (``worker.stage``), so that the gated hook is what runs first. The
    wrapper makes Lightning call ``configure_model`` on the worker even when the module does not
    override it; the controller's Lightning then does not call it, so neither does the wrapper
    (R1). A policy that matches nothing is reported here only when the module's own
    ``configure_model`` may have built submodules; otherwise the controller saw it before the
    stage started.
    """
    configure_model: Callable[[], Any] = module.configure_model
    builds_submodules = is_overridden("configure_model", module, LightningModule)

    # not ``functools.wraps``: Lightning's ``is_overridden`` would follow ``__wrapped__`` to the
    # base hook where the module does not override it (then not gated, ``Gate.elidable``)
    def configure_and_shard() -> None:
        if builds_submodules:
            configure_model()
        if spec.wraps:
            shard(module, spec, warn=builds_submodules)
        elif spec.mesh_shape[1] > 1 and not _tensor_parallel(module):
            rank_zero_warn(
                f"`MonarchModelParallelStrategy(tensor_parallel_size={spec.mesh_shape[1]})`: `{type(module).__name__}`"
                " applied no tensor parallelism in `configure_model` (no parameter is a DTensor on"
                " `self.device_mesh['tensor_parallel']`), so every rank of a tensor-parallel group computes the same"
                " thing. Apply `parallelize_module(..., self.device_mesh['tensor_parallel'], plan)` there, or use"
                " `tensor_parallel_size=1`."
            )
        if spec.from_shards:
            load_kept_shards(module, kept)

    vars(module)["configure_model"] = configure_and_shard


def shard(module: LightningModule, spec: ShardingSpec, warn: bool = True) -> None:
    """Wrap each instance of ``spec.activation_checkpointing`` for activation checkpointing,
    ``fully_shard`` each instance of ``spec.policy`` not sharded yet (its checkpoint wrapper, when
    it has one, as torchtitan does), then the root module, with the spec's mixed precision and CPU
    offload; and let FSDP2 gather the root's parameters around the step methods, which Lightning
    calls instead of ``forward``."""
    # ``ModelParallelStrategy.setup_environment`` gives the module its mesh before ``configure_model``, where this runs
    device_mesh = module.device_mesh
    assert device_mesh is not None
    mesh = device_mesh["data_parallel"]
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": spec.mixed_precision or MixedPrecisionPolicy(),
        # pinned host memory speeds up the copies to a GPU; without one there is none to pin
        "offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
        if spec.cpu_offload
        else OffloadPolicy(),
    }
    policy = spec.policy
    matched = [
        submodule
        for submodule in module.modules()
        if submodule is not module and isinstance(submodule, policy) and not isinstance(submodule, FSDPModule)
    ]
    if warn and policy and not matched and not isinstance(module, FSDPModule):
        rank_zero_warn(spec.no_match_warning())
    wrappers = checkpoint_activations(module, spec.activation_checkpointing)
    for submodule in matched:
        fully_shard(wrappers.get(submodule, submodule), **options)
    if not isinstance(module, FSDPModule):
        fully_shard(module, **options)
    for method in _STEP_METHODS:
        register_fsdp_forward_method(module, method)


def load_kept_shards(module: torch.nn.Module, kept: Optional[torch.nn.Module]) -> None:
    """Give ``module``, sharded as ``kept`` was (the same policy, the same ranks), this rank's
    shards of ``kept``'s parameters and its buffers: the module of the controller is on the meta
    device, and its weights are those the workers kept, so none travel. The module is
    materialized on the shards' device first (Lightning's ``ModelParallelStrategy`` then finds
    nothing on the meta device to initialize)."""
    if kept is None:
        raise RuntimeError(
            "This worker no longer keeps the shards of the module's last sharded stage (a bug in lightning_monarch:"
            " the controller checked that its mesh does)."
        )
    theirs = {**dict(kept.named_parameters()), **dict(kept.named_buffers())}
    ours = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    if {name: _local(tensor).shape for name, tensor in ours.items()} != {
        name: _local(tensor).shape for name, tensor in theirs.items()
    }:
        raise RuntimeError(
            f"`{type(module).__name__}` built other parameters or buffers in `configure_model` than the module whose"
            " shards the workers kept from the last sharded stage, so its trained weights cannot be loaded into it"
            " under `MonarchFSDPStrategy`. Load them on the controller first:"
            " `model.to_empty(device='cpu'); model.load_state_dict(trainer.strategy.gather_full_state_dict())`."
        )
    module.to_empty(device=_local(next(iter(theirs.values()))).device if theirs else torch.device("cpu"))
    with torch.no_grad():
        for name, tensor in {**dict(module.named_parameters()), **dict(module.named_buffers())}.items():
            _local(tensor).copy_(_local(theirs[name]))


def _tensor_parallel(module: torch.nn.Module) -> bool:
    """Whether a parameter of ``module`` is sharded over the mesh's tensor-parallel dimension."""
    return any(
        isinstance(parameter, DTensor) and "tensor_parallel" in (parameter.device_mesh.mesh_dim_names or ())
        for parameter in module.parameters()
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded parameter (a ``DTensor``), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def checkpoint_activations(
    module: torch.nn.Module, classes: tuple[type, ...]
) -> dict[torch.nn.Module, torch_compat.CheckpointWrapper]:
    """Wrap every instance of ``classes`` in ``module`` with ``checkpoint_wrapper`` (its activations
    are recomputed in the backward pass instead of kept), as Lightning's ``FSDPStrategy`` does for
    its ``activation_checkpointing_policy``; return each wrapped module's wrapper."""
    if classes:
        torch_compat.apply_activation_checkpointing(
            module,
            checkpoint_wrapper_fn=torch_compat.checkpoint_wrapper,
            check_fn=lambda submodule: isinstance(submodule, classes),
        )
    return {
        torch_compat.wrapped_module(wrapper): wrapper
        for wrapper in module.modules()
        if isinstance(wrapper, torch_compat.CheckpointWrapper)
    }


def full_state_dict(module: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The sharded module's full state dict on CPU: a collective that every rank joins; rank 0
    gets the whole dict, the other ranks ``None``."""
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if torch.distributed.get_rank() == 0 else None
