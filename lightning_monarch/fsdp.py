"""``MonarchFSDPStrategy``: the workers shard the module with FSDP2 (``strategy="monarch_fsdp"``).

Runs on the controller. It is ``MonarchModelParallelStrategy`` (``lightning_monarch.model_parallel``)
with ``tensor_parallel_size=1`` and a convenience: the workers shard the module by a wrap policy,
so the module needs no ``configure_model``. Everything else (the workers' Lightning
``ModelParallelStrategy``, sharded checkpoints, recovery snapshots, the controller that never
holds the full weights) is that strategy's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Optional

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lightning_monarch.controller import arguments
from lightning_monarch.model_parallel import MonarchModelParallelStrategy
from lightning_monarch.wire.specs import ShardingSpec

#: ``MonarchModelParallelStrategy``'s arguments that ``MonarchFSDPStrategy`` fixes: one
#: data-parallel dimension over every worker.
_LAYOUT = ("data_parallel_size", "tensor_parallel_size")


class MonarchFSDPStrategy(MonarchModelParallelStrategy):
    """Train on a mesh of Monarch worker actors from this process, the module sharded across the
    workers with FSDP2 (``torch.distributed.fsdp.fully_shard``), in the module's
    ``configure_model`` or by ``fsdp_policy``, as Lightning's ``ModelParallelStrategy`` and
    ``FSDPStrategy`` do.

    The controller never holds the full weights: after ``fit`` its module is moved to the meta
    device, and ``gather_full_state_dict()`` fetches them on demand. Checkpoints are directories
    of shards (Lightning's ``ModelParallelStrategy`` layout) that every worker writes in parallel.
    ``strategy="monarch_fsdp"`` is this class with its defaults. It is
    ``MonarchModelParallelStrategy`` with one data-parallel dimension over every worker and no
    tensor parallelism, and with the workers sharding the module themselves after its own
    ``configure_model``, which it then need not have.

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
        **kwargs: ``MonarchModelParallelStrategy``'s arguments but the mesh's sizes
            (``save_distributed_checkpoint``, ``timeout``, ``snapshot_dir``), and
            ``MonarchStrategy``'s (``hosts``, ``max_restarts``, ``max_ahead``, ...), except
            ``DistributedDataParallel``'s: sharded workers do not use DDP.
    """

    strategy_name = "monarch_fsdp"
    _description = "Single-controller training on a PyTorch Monarch worker mesh, the module sharded with FSDP2"
    _fixed_arguments: ClassVar[frozenset[str]] = frozenset(_LAYOUT)

    def __init__(
        self,
        fsdp_policy: Optional[Iterable[type[nn.Module]]] = None,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        activation_checkpointing_policy: Optional[Iterable[type[nn.Module]]] = None,
        cpu_offload: bool = False,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        layout = [name for name in _LAYOUT if name in kwargs]
        if layout:
            given = ", ".join(f"{name}={kwargs[name]!r}" for name in layout)
            raise ValueError(
                f"`{owner}({given})`: `MonarchFSDPStrategy` shards over every worker, with no tensor parallelism."
                f" For a 2-D mesh use `lightning_monarch.MonarchModelParallelStrategy({given})`, whose module applies"
                " its parallelism in `configure_model`."
            )
        super().__init__(tensor_parallel_size=1, **kwargs)
        self.fsdp_policy = arguments.module_classes(owner, "fsdp_policy", fsdp_policy)
        self.mixed_precision = arguments.mixed_precision_policy(owner, mixed_precision)
        self.activation_checkpointing_policy = arguments.module_classes(
            owner, "activation_checkpointing_policy", activation_checkpointing_policy
        )
        self.cpu_offload = arguments.flag(owner, "cpu_offload", cpu_offload)

    @property
    @override
    def mesh_shape(self) -> tuple[int, int]:
        """One data-parallel dimension over every worker."""
        return self.num_workers, 1

    @override
    def _sharding(self, module: LightningModule, builds_submodules: bool, from_shards: bool) -> ShardingSpec:
        """How the workers shard ``module``: after its own ``configure_model`` (if it has one), by
        ``fsdp_policy``, then the root."""
        if not self.fsdp_policy and not builds_submodules:
            rank_zero_warn(
                f"`MonarchFSDPStrategy` without `fsdp_policy`: `{type(module).__name__}` does not shard itself in"
                " `configure_model`, so FSDP2 shards it as one unit (the root module), as Lightning's"
                " `strategy='fsdp'` does without an `auto_wrap_policy`; every step then gathers all of its parameters"
                " at once. Name the classes of its repeated blocks to shard them one by one and save memory, e.g."
                " `MonarchFSDPStrategy(fsdp_policy={nn.TransformerEncoderLayer})`."
            )
        spec = self._spec(
            from_shards,
            policy=self.fsdp_policy,
            mixed_precision=self.mixed_precision,
            activation_checkpointing=self.activation_checkpointing_policy,
            cpu_offload=self.cpu_offload,
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
