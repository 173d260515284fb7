"""``MonarchModelParallelStrategy``: the workers run Lightning's ``ModelParallelStrategy``, 2-D
(data parallel × tensor parallel), and shard the module (``strategy="monarch_model_parallel"``).

Runs on the controller. Each worker trains its shards under Lightning's own
``ModelParallelStrategy`` with the same device mesh Lightning gives (``self.device_mesh``, with a
``"data_parallel"`` and a ``"tensor_parallel"`` dimension), and the module's ``configure_model``
applies tensor parallelism and FSDP2 itself, as under Lightning. The controller never holds the
full weights. What differs from ``MonarchStrategy`` is where the module's state lives:
checkpoints are directories of shards that every worker writes (or one file that rank 0 writes,
``save_distributed_checkpoint=False``), recovery snapshots are sharded files, and the full weights
reach the controller only through ``gather_full_state_dict()``. ``MonarchFSDPStrategy``
(``lightning_monarch.fsdp``) is this strategy with no tensor parallelism and a wrap policy.
"""

from __future__ import annotations

import inspect
import os
import shutil
from typing import Any, ClassVar, Literal, Optional, Union

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller import arguments
from lightning_monarch.controller.loop.checkpoints import (
    METADATA_FILENAME,
    check_module_keys,
    is_sharded_checkpoint,
    prepare_directory,
)
from lightning_monarch.controller.mesh.pool import MESHES
from lightning_monarch.controller.mesh.snapshots import SnapshotDirectory
from lightning_monarch.strategy import MonarchStrategy
from lightning_monarch.wire.specs import ShardingSpec

#: ``MonarchStrategy``'s own arguments, which the sharded strategies pass on.
_STRATEGY_ARGUMENTS = frozenset(inspect.signature(MonarchStrategy.__init__).parameters) - {"self", "ddp_kwargs"}


class MonarchModelParallelStrategy(MonarchStrategy):
    """Train on a mesh of Monarch worker actors from this process, each worker one rank of
    Lightning's ``ModelParallelStrategy``: a 2-D device mesh of ``data_parallel_size`` ×
    ``tensor_parallel_size`` workers, on which the module's ``configure_model`` applies tensor
    parallelism (``parallelize_module``) and FSDP2 (``fully_shard``), as under Lightning.

    The tensor-parallel dimension is the inner one: each tensor-parallel group is
    ``tensor_parallel_size`` workers of one host (its fast links), as torchrun users lay it out;
    the data-parallel dimension spans the hosts. The controller never holds the full weights:
    after ``fit`` its module is moved to the meta device, and ``gather_full_state_dict()`` fetches
    them on demand. ``strategy="monarch_model_parallel"`` is this class with its defaults.

    Args:
        data_parallel_size: the size of the mesh's ``"data_parallel"`` dimension; ``"auto"``, as
            Lightning computes it: the number of hosts (``num_nodes``).
        tensor_parallel_size: the size of its ``"tensor_parallel"`` dimension; ``"auto"``, as
            Lightning computes it: the workers of one host (``devices``).
        save_distributed_checkpoint: checkpoints are directories of shards that every worker
            writes (``True``, Lightning's layout), or one file with the full state, which rank 0
            gathers and writes (``False``); the full weights never come to this process either way.
        snapshot_dir: with ``max_restarts``, where the workers write the sharded recovery
            snapshots: each stage makes a temporary directory in it, keeps the last snapshot
            there and removes it when the stage ends. By default the system's temporary directory
            on this host; workers on several hosts need a path that they and this process all
            reach (a shared file system).
        **kwargs: ``MonarchStrategy``'s arguments (``hosts``, ``max_restarts``, ``timeout``,
            ...), except ``DistributedDataParallel``'s: sharded workers do not use DDP.
    """

    strategy_name = "monarch_model_parallel"
    aliases: ClassVar[dict[str, dict[str, Any]]] = {}
    _description = "Single-controller training on a PyTorch Monarch worker mesh, 2-D: tensor parallel and FSDP2"

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        save_distributed_checkpoint: bool = True,
        snapshot_dir: Optional[Union[str, os.PathLike]] = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        ddp_only = sorted(set(kwargs) - _STRATEGY_ARGUMENTS)
        if ddp_only:
            raise ValueError(
                f"`{owner}({', '.join(f'{name}=...' for name in ddp_only)})`: these are not arguments of"
                f" `MonarchStrategy` but `DistributedDataParallel`'s, and sharded workers do not use DDP. Remove"
                " them."
            )
        if kwargs.get("min_nodes") is not None:
            raise ValueError(
                f"`{owner}(min_nodes={kwargs['min_nodes']!r})`: elastic training goes on in a smaller world from a"
                " checkpoint file that travels with the stage, and a sharded module's checkpoint is a directory of"
                " shards that every worker writes for the world it ran in. Use `MonarchStrategy(min_nodes=...)` for a"
                " module every worker holds whole, or `max_restarts` to replace dead workers on the same hosts."
            )
        super().__init__(**kwargs)
        self.data_parallel_size = _size(owner, "data_parallel_size", data_parallel_size, "the number of hosts")
        self.tensor_parallel_size = _size(owner, "tensor_parallel_size", tensor_parallel_size, "the workers of a host")
        self.save_distributed_checkpoint = arguments.flag(
            owner, "save_distributed_checkpoint", save_distributed_checkpoint
        )
        self.snapshot_dir = snapshot_dir

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """The workers' device mesh: (data parallel, tensor parallel) sizes, ``"auto"`` resolved
        as Lightning's ``ModelParallelStrategy`` resolves it (hosts × workers of a host)."""
        per_host = len(self.parallel_devices or ())
        data = self.num_nodes if self.data_parallel_size == "auto" else self.data_parallel_size
        tensor = per_host if self.tensor_parallel_size == "auto" else self.tensor_parallel_size
        return int(data), int(tensor)

    @override
    def _check_configuration(self) -> None:
        owner = type(self).__name__
        if self.max_restarts and self.num_nodes > 1 and self.snapshot_dir is None:
            raise MisconfigurationException(
                f"`{owner}(max_restarts={self.max_restarts})` on {self.num_nodes} hosts: the workers write"
                " the sharded recovery snapshots into a directory they must all reach, and the default is a"
                " temporary directory on this host only. Pass `snapshot_dir=` a path on a file system shared by"
                " every host and this process."
            )
        if self.validation == "async":
            raise MisconfigurationException(
                f"`{owner}(validation='async')`: asynchronous validation hands each training rank's whole"
                " checkpoint state to a validation worker of the same rank, and a sharded module's ranks hold shards"
                " of it that no single worker validates. Use `validation='sync'`, or `MonarchStrategy` for a module"
                " that fits one device."
            )
        self._check_mesh_shape()
        super()._check_configuration()

    def _check_mesh_shape(self) -> None:
        """The sizes multiply to the number of workers, and every tensor-parallel group lies on one
        host, at ``Trainer(...)`` time (Lightning's own check comes only once the workers start)."""
        data, tensor = self.mesh_shape
        per_host = len(self.parallel_devices or ())
        given = f"`{type(self).__name__}(data_parallel_size={data}, tensor_parallel_size={tensor})`"
        if data * tensor != self.num_workers:
            raise MisconfigurationException(
                f"{given}: the sizes multiplied ({data * tensor}) must equal the number of workers, here"
                f" {self.num_workers} (`num_nodes={self.num_nodes}` hosts × `devices={per_host}`). Change the sizes,"
                ' or leave them "auto" (the number of hosts × the workers of a host).'
            )
        if per_host % tensor:
            raise MisconfigurationException(
                f"{given}: each tensor-parallel group must lie within one host, whose links are the fast ones, and"
                f" {tensor} does not divide the {per_host} worker(s) of a host (`devices={per_host}`). Use a"
                f" `tensor_parallel_size` that divides `devices`, and let the data-parallel dimension span the hosts."
            )

    @override
    def _sharding_for_stage(self, module: LightningModule, ckpt_path: Any) -> Optional[ShardingSpec]:
        """Runs on the controller, before any worker starts: how the workers shard ``module`` for
        ``trainer.<stage>(...)``, once the stage is known to be able to run sharded."""
        from_shards = _on_meta_device(module)
        if from_shards:
            idle = MESHES.idle(self._settings().mesh_key())
            if idle is None or idle.kept_shards is None or not idle.kept_shards.stand_for(module):
                raise MisconfigurationException(
                    f"`{type(module).__name__}` has parameters on the meta device, and no warm worker mesh keeps its"
                    f" trained shards: after `fit` under `{type(self).__name__}` the trained weights stay sharded on"
                    " the workers (the controller's module is emptied), and the next stage on the same module runs"
                    " from them while the warm mesh keeps them and the module keeps its parameters and buffers. Here"
                    " the mesh was stopped (`keep_warm=False`, `lightning_monarch.stop_meshes()`, a failure, a stage"
                    " with other devices or another module in between), or the module's tensors were replaced."
                    " Load the weights first: `model.to_empty(device='cpu');"
                    " model.load_state_dict(trainer.strategy.gather_full_state_dict())` before the mesh stops."
                )
        builds_submodules = is_overridden("configure_model", module, LightningModule)
        if isinstance(ckpt_path, (str, os.PathLike)) and os.path.exists(ckpt_path):
            self._require_sharded_checkpoint(ckpt_path)
            if not builds_submodules:  # otherwise its full keys exist on the workers only
                check_module_keys(os.fspath(ckpt_path), module, strict=module.strict_loading)
        return self._sharding(module, builds_submodules, from_shards)

    def _sharding(self, module: LightningModule, builds_submodules: bool, from_shards: bool) -> ShardingSpec:
        """How the workers shard ``module``: its own ``configure_model`` applies every parallelism,
        as under Lightning's ``ModelParallelStrategy``, which requires one."""
        if not builds_submodules:
            raise TypeError(
                f"When using the {type(self).__name__}, you are required to override the `configure_model()` hook in"
                f" the LightningModule and apply parallelization there: `{type(module).__name__}` does not. Apply"
                " tensor parallelism on `self.device_mesh['tensor_parallel']` and `fully_shard` on"
                " `self.device_mesh['data_parallel']` there, or use `MonarchFSDPStrategy(fsdp_policy={...})`, which"
                " shards a module that does not."
            )
        return self._spec(from_shards, wraps=False)

    def _spec(self, from_shards: bool, **options: Any) -> ShardingSpec:
        """The sharding spec of this strategy's mesh and checkpoints, with ``options`` (how the
        workers shard the module)."""
        return ShardingSpec(
            mesh_shape=self.mesh_shape,
            from_shards=from_shards,
            save_distributed_checkpoint=self.save_distributed_checkpoint,
            **options,
        )

    @override
    def _snapshot_directory(self) -> Optional[SnapshotDirectory]:
        """With ``max_restarts``, the directory the workers write their sharded snapshots into."""
        if not self.max_restarts:
            return None
        return SnapshotDirectory(os.fspath(self.snapshot_dir) if self.snapshot_dir is not None else None)

    @override
    def gather_full_state_dict(self) -> dict[str, Any]:
        """Runs on the controller: the module's full (unsharded) state dict, on this process's CPU.

        The workers gather their shards (every rank takes part; rank 0's result comes here):
        during a stage, e.g. from a callback's ``on_fit_end``, or after it, while the warm mesh
        keeps the shards (until its next stage starts). This is the one way the full weights reach
        the controller; they must fit in its memory.
        """
        return self._stage.sharded_session(
            "trainer.strategy.gather_full_state_dict()", type(self).__name__
        ).requests.full_state_dict()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the workers write their shards themselves when the checkpoint is saved
        (``save_checkpoint``); for the full weights call ``gather_full_state_dict()``."""
        return {}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Nothing, as for ``lightning_module_state_dict``."""
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """As under Lightning's ``ModelParallelStrategy``: ``filepath`` becomes a directory where
        every worker writes its own shards of the module's and the optimizers' state, in parallel
        (``worker.checkpoints``), and this process writes Lightning's metadata (the rest of
        ``checkpoint``) beside them, in ``meta.pt``; with ``save_distributed_checkpoint=False`` the
        workers gather the full state and rank 0 writes it with the metadata into the one file
        ``filepath``. The full weights never come here. ``filepath`` must be on storage every
        worker reaches."""
        if storage_options is not None:
            raise TypeError(
                f"`trainer.save_checkpoint(..., storage_options=...)` under `{type(self).__name__}`: the workers"
                " write the shards with `torch.distributed.checkpoint`, not with the `CheckpointIO` that takes these"
                " options. Remove `storage_options`."
            )
        session = self._stage.sharded_session("trainer.save_checkpoint(path)", type(self).__name__)
        checkpoint.pop("state_dict", None)
        optimizers = checkpoint.pop("optimizer_states", None) is not None
        if not self.save_distributed_checkpoint:
            path = os.path.abspath(filepath)
            if os.path.isdir(path) and not is_sharded_checkpoint(path):
                raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
            if is_sharded_checkpoint(path):
                shutil.rmtree(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            session.requests.save_full_checkpoint(path, checkpoint, optimizers)
            return
        directory = prepare_directory(filepath)
        callbacks = session.requests.save_sharded_checkpoint(str(directory), optimizers)
        if callbacks:
            checkpoint.setdefault("callbacks", {}).update(callbacks)
        torch.save(checkpoint, directory / METADATA_FILENAME)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The metadata of the sharded checkpoint directory ``checkpoint_path``; the workers load
        (and reshard) the shards themselves."""
        self._require_sharded_checkpoint(checkpoint_path)
        return self.checkpoint_io.load_checkpoint(
            os.path.join(checkpoint_path, METADATA_FILENAME), weights_only=weights_only
        )

    def _require_sharded_checkpoint(self, path: Any) -> None:
        """The workers resume from a sharded checkpoint directory only."""
        if not is_sharded_checkpoint(path):
            raise ValueError(
                f"`ckpt_path={str(path)!r}` under `{type(self).__name__}` is not a sharded checkpoint (a directory"
                f" with `{METADATA_FILENAME}`, as `trainer.save_checkpoint` writes under the sharded strategies or"
                " Lightning's `ModelParallelStrategy`). Resuming a sharded run from a single-file checkpoint is not"
                " supported yet: give a sharded checkpoint directory."
            )

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """The workers load the module's shards; the controller's module keeps its weights."""

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """The workers' ``ModelParallelStrategy`` restores a checkpoint after
        ``configure_optimizers``; the controller restores at the same point, so that both loops
        call ``on_load_checkpoint`` in the same order (R1)."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """A checkpoint's metadata holds no optimizer state: the workers load theirs from the shards."""
        return False

    @override
    def teardown(self) -> None:
        """Lightning's teardown moves the module to the CPU; a module emptied after ``fit`` (on the
        meta device) has no data to move, so Lightning's teardown does not get it, and it is
        attached again after (for ``trainer.save_checkpoint`` after ``fit``)."""
        module = self.lightning_module
        emptied = module is not None and _on_meta_device(module)
        if emptied:
            lightning_compat.set_lightning_module(self, None)
        super().teardown()
        if emptied:
            lightning_compat.set_lightning_module(self, module)


def _size(owner: str, name: str, value: Any, auto: str) -> Union[Literal["auto"], int]:
    """A mesh dimension's size: ``"auto"`` (``auto`` says what Lightning takes), or a whole number."""
    if value == "auto":
        return "auto"
    return arguments.whole_number(owner, name, value, 1, of="workers", meaning=f', or "auto" for {auto}')


def _on_meta_device(module: nn.Module) -> bool:
    return any(parameter.is_meta for parameter in module.parameters())
