"""``MonarchFSDPStrategy``: the workers shard the module with FSDP2 (``strategy="monarch_fsdp"``).

Runs on the controller. Each worker trains its shards under Lightning's own
``ModelParallelStrategy``; the controller never holds the full weights. What differs from
``MonarchStrategy`` is where the module's state lives: checkpoints are directories of shards that
every worker writes, recovery snapshots are sharded files, and the full weights reach the
controller only through ``gather_full_state_dict()``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller import arguments
from lightning_monarch.controller.checkpoints import (
    METADATA_FILENAME,
    SnapshotDirectory,
    check_module_keys,
    is_sharded_checkpoint,
    prepare_directory,
)
from lightning_monarch.controller.pool import MESHES
from lightning_monarch.controller.session import StageSession
from lightning_monarch.protocol import ShardingSpec
from lightning_monarch.strategy import MonarchStrategy


class MonarchFSDPStrategy(MonarchStrategy):
    """Train on a mesh of Monarch worker actors from this process, the module sharded across the
    workers with FSDP2 (``torch.distributed.fsdp.fully_shard``), in the module's
    ``configure_model`` or by ``fsdp_policy``, as Lightning's ``ModelParallelStrategy`` and
    ``FSDPStrategy`` do.

    The controller never holds the full weights: after ``fit`` its module is moved to the meta
    device, and ``gather_full_state_dict()`` fetches them on demand. Checkpoints are directories
    of shards (Lightning's ``ModelParallelStrategy`` layout) that every worker writes in parallel.
    ``strategy="monarch_fsdp"`` is this class with its defaults.

    Args:
        fsdp_policy: module classes (e.g. ``{nn.TransformerEncoderLayer}``) whose every instance
            is sharded on its own, after the module's ``configure_model``; the root module is
            sharded last. Like the ``auto_wrap_policy`` of Lightning's ``FSDPStrategy``. Without
            it, and without a ``configure_model`` that shards, the root module is sharded as one
            unit (with a warning).
        mixed_precision: FSDP2's ``MixedPrecisionPolicy``, e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: the
            gathered parameters and the computation in ``param_dtype``, the gradient reduction in
            ``reduce_dtype``; the shards and the optimizer stay in the parameters' own dtype.
        activation_checkpointing_policy: module classes whose every instance recomputes its
            activations in the backward pass instead of keeping them, as in Lightning's
            ``FSDPStrategy``.
        cpu_offload: keep the shards of the parameters, their gradients and the optimizer state in
            CPU memory (FSDP2's ``CPUOffloadPolicy``); the optimizer steps on the CPU.
        snapshot_dir: with ``max_restarts``, where the workers write the sharded recovery
            snapshots: each stage makes a temporary directory in it, keeps the last snapshot
            there and removes it when the stage ends. By default the system's temporary directory
            on this host; workers on several hosts need a path that they and this process all
            reach (a shared file system).
        **kwargs: ``MonarchStrategy``'s arguments (``hosts``, ``max_restarts``, ``max_ahead``,
            ...), except ``DistributedDataParallel``'s: sharded workers do not use DDP.
    """

    strategy_name = "monarch_fsdp"

    def __init__(
        self,
        fsdp_policy: Optional[Iterable[type[nn.Module]]] = None,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        activation_checkpointing_policy: Optional[Iterable[type[nn.Module]]] = None,
        cpu_offload: bool = False,
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
        self.fsdp_policy = arguments.module_classes(owner, "fsdp_policy", fsdp_policy)
        self.mixed_precision = arguments.mixed_precision_policy(owner, mixed_precision)
        self.activation_checkpointing_policy = arguments.module_classes(
            owner, "activation_checkpointing_policy", activation_checkpointing_policy
        )
        self.cpu_offload = arguments.flag(owner, "cpu_offload", cpu_offload)
        self.snapshot_dir = snapshot_dir
        #: The last stage, whose workers keep the module's shards while the mesh stays warm.
        self._last_sharded: Optional[StageSession] = None

    @override
    def _arguments(self) -> dict[str, Any]:
        return {
            **super()._arguments(),
            "fsdp_policy": self.fsdp_policy,
            "mixed_precision": self.mixed_precision,
            "activation_checkpointing_policy": self.activation_checkpointing_policy,
            "cpu_offload": self.cpu_offload,
            "snapshot_dir": self.snapshot_dir,
        }

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy="monarch_fsdp"`` (``import lightning_monarch`` calls it)."""
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Single-controller training on a PyTorch Monarch worker mesh, the module sharded with FSDP2",
            override=True,
        )

    @override
    def _check_configuration(self) -> None:
        if self.max_restarts and self.num_nodes > 1 and self.snapshot_dir is None:
            raise MisconfigurationException(
                f"`MonarchFSDPStrategy(max_restarts={self.max_restarts})` on {self.num_nodes} hosts: the workers write"
                " the sharded recovery snapshots into a directory they must all reach, and the default is a"
                " temporary directory on this host only. Pass `snapshot_dir=` a path on a file system shared by"
                " every host and this process."
            )
        super()._check_configuration()

    @override
    def _attach(self, session: Optional[StageSession]) -> None:
        if session is None and self._session is not None:
            self._last_sharded = self._session
        super()._attach(session)

    @override
    def _sharding_for_stage(self, module: LightningModule, ckpt_path: Any) -> Optional[ShardingSpec]:
        """Runs on the controller, before any worker starts: how the workers shard ``module`` for
        ``trainer.<stage>(...)``, once the stage is known to be able to run sharded."""
        from_shards = _on_meta_device(module)
        if from_shards:
            idle = MESHES.idle(self._mesh_key())
            if idle is None or idle.kept_shards is None or not idle.kept_shards.stand_for(module):
                raise MisconfigurationException(
                    f"`{type(module).__name__}` has parameters on the meta device, and no warm worker mesh keeps its"
                    " trained shards: after `fit` under `MonarchFSDPStrategy` the trained weights stay sharded on the"
                    " workers (the controller's module is emptied), and the next stage on the same module runs from"
                    " them while the warm mesh keeps them and the module keeps its parameters and buffers. Here the"
                    " mesh was stopped (`keep_warm=False`, `lightning_monarch.stop_meshes()`, a failure, a stage"
                    " with other devices or another module in between), or the module's tensors were replaced."
                    " Load the weights first: `model.to_empty(device='cpu');"
                    " model.load_state_dict(trainer.strategy.gather_full_state_dict())` before the mesh stops."
                )
        builds_submodules = is_overridden("configure_model", module, LightningModule)
        if isinstance(ckpt_path, (str, os.PathLike)) and os.path.exists(ckpt_path):
            _require_sharded_checkpoint(ckpt_path)
            if not builds_submodules:  # otherwise its full keys exist on the workers only
                check_module_keys(os.fspath(ckpt_path), module, strict=module.strict_loading)
        if not self.fsdp_policy and not builds_submodules:
            rank_zero_warn(
                f"`MonarchFSDPStrategy` without `fsdp_policy`: `{type(module).__name__}` does not shard itself in"
                " `configure_model`, so FSDP2 shards it as one unit (the root module), as Lightning's"
                " `strategy='fsdp'` does without an `auto_wrap_policy`; every step then gathers all of its parameters"
                " at once. Name the classes of its repeated blocks to shard them one by one and save memory, e.g."
                " `MonarchFSDPStrategy(fsdp_policy={nn.TransformerEncoderLayer})`."
            )
        spec = ShardingSpec(
            policy=self.fsdp_policy,
            mixed_precision=self.mixed_precision,
            activation_checkpointing=self.activation_checkpointing_policy,
            cpu_offload=self.cpu_offload,
            from_shards=from_shards,
        )
        if (
            self.fsdp_policy
            and not builds_submodules
            and not any(
                isinstance(submodule, self.fsdp_policy) for submodule in module.modules() if submodule is not module
            )
        ):
            rank_zero_warn(spec.no_match_warning())
        return spec

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
        return self._sharded_session("trainer.strategy.gather_full_state_dict()").full_state_dict()

    def _sharded_session(self, call: str) -> StageSession:
        """The stage whose workers hold the module's shards: the running one, else the last one."""
        session = self._session or self._last_sharded
        if session is None:
            raise RuntimeError(
                f"`{call}` needs the module's shards on the workers under `MonarchFSDPStrategy`, and no stage has run"
                " with this strategy yet. Call it during or after `trainer.fit(...)`."
            )
        return session

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
        """``filepath`` becomes a directory, as under Lightning's ``ModelParallelStrategy``: every
        worker writes its own shards of the module's and the optimizers' state into it, in
        parallel (``worker.checkpoints``), then this process writes Lightning's metadata (the rest
        of ``checkpoint``) beside them, in ``meta.pt``. The full weights never come here.
        ``filepath`` must be on storage every worker reaches."""
        if storage_options is not None:
            raise TypeError(
                "`trainer.save_checkpoint(..., storage_options=...)` under `MonarchFSDPStrategy`: the workers write"
                " the shards with `torch.distributed.checkpoint`, not with the `CheckpointIO` that takes these"
                " options. Remove `storage_options`."
            )
        session = self._sharded_session("trainer.save_checkpoint(path)")
        directory = prepare_directory(filepath)
        checkpoint.pop("state_dict", None)
        optimizers = checkpoint.pop("optimizer_states", None) is not None
        callbacks = session.save_sharded_checkpoint(str(directory), optimizers)
        if callbacks:
            checkpoint.setdefault("callbacks", {}).update(callbacks)
        torch.save(checkpoint, directory / METADATA_FILENAME)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The metadata of the sharded checkpoint directory ``checkpoint_path``; the workers load
        (and reshard) the shards themselves."""
        _require_sharded_checkpoint(checkpoint_path)
        return self.checkpoint_io.load_checkpoint(
            os.path.join(checkpoint_path, METADATA_FILENAME), weights_only=weights_only
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


#: ``MonarchStrategy``'s own arguments, which ``MonarchFSDPStrategy`` passes on.
_STRATEGY_ARGUMENTS = frozenset(inspect.signature(MonarchStrategy.__init__).parameters) - {"self", "ddp_kwargs"}


def _require_sharded_checkpoint(path: Any) -> None:
    """The workers resume from a sharded checkpoint directory only."""
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"`ckpt_path={str(path)!r}` under `MonarchFSDPStrategy` is not a sharded checkpoint (a directory with"
            f" `{METADATA_FILENAME}`, as `trainer.save_checkpoint` writes under `MonarchFSDPStrategy` or"
            " Lightning's `ModelParallelStrategy`). Resuming a sharded run from a single-file checkpoint is not"
            " supported yet: give a sharded checkpoint directory."
        )


def _on_meta_device(module: nn.Module) -> bool:
    return any(parameter.is_meta for parameter in module.parameters())
