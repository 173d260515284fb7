"""``MonarchStrategy``: the Lightning strategy the controller's Trainer talks to.

Runs on the controller. To Lightning there is one process, as with lightning-Graphcore's
``IPUStrategy``: ``is_global_zero`` is True and ``barrier``/``broadcast``/``reduce`` act locally.
The real collectives run among the workers, inside each worker's own ``DDPStrategy`` (or
``ModelParallelStrategy``, with ``parallelism="fsdp"``).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Iterable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_monarch import _compat
from lightning_monarch.accelerator import WorkerGPUAccelerator
from lightning_monarch.controller.checkpoints import (
    METADATA_FILENAME,
    check_module_keys,
    is_sharded_checkpoint,
    prepare_directory,
)
from lightning_monarch.controller.hosts import host_mesh
from lightning_monarch.controller.mirrors import GradScalerMirror
from lightning_monarch.controller.output import WorkerOutput
from lightning_monarch.controller.pool import MeshKey
from lightning_monarch.controller.session import StageSession
from lightning_monarch.devices import host_gpu_count, pin
from lightning_monarch.launcher import MonarchLauncher
from lightning_monarch.protocol import CheckpointState, RankStats, ShardingSpec

#: Keyword arguments of ``DistributedDataParallel`` that the workers' ``DDPStrategy`` passes on.
_DDP_KWARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
#: How many batches the workers may run ahead of the controller's loop by default (R4).
DEFAULT_MAX_AHEAD = 16
#: How the workers hold the module: a replica each, or sharded with FSDP2.
_PARALLELISMS = ("ddp", "fsdp")


class MonarchStrategy(ParallelStrategy):
    """Train on a mesh of Monarch worker actors from one controller process: this one.

    The controller runs Lightning's loops, callbacks, loggers and checkpoint files once; one
    worker per device runs the LightningModule with Lightning's ``DDPStrategy``, or, with
    ``parallelism="fsdp"``, sharded across the workers with FSDP2 (Lightning's
    ``ModelParallelStrategy``; see the FSDP page of the docs).

    Args:
        hosts: where the workers run: nothing for this host, a Monarch job
            (``monarch.job.ProcessJob({"hosts": 2})``, ``SlurmJob``, ``KubernetesJob``...), a
            ``HostMesh`` (e.g. from ``attach_to_workers``), or a list of worker addresses
            (``["tcp://node-1:26600", ...]``, each running ``run_worker_loop_forever``);
            ``Trainer(num_nodes=...)`` must equal its number of hosts, and each host runs
            ``devices`` workers.
        connect_timeout: seconds the hosts have to connect at ``Trainer(...)`` time before an
            ``UnreachableHostsError`` names the addresses that did not.
        aggregate_window_sec: with ``hosts``, Monarch forwards what the workers print to this
            process and shows lines printed alike within this many seconds once, with their count;
            ``None`` shows every line at once, prefixed with its rank. Workers on this host print
            to this process's terminal directly, as ``ddp``'s ranks do.
        process_group_backend: the workers' ``torch.distributed`` backend; by default ``gloo`` on
            CPU and ``nccl`` on GPUs (RCCL on a ROCm build of torch).
        worker_callbacks: callbacks that need live parameters or gradients; they run on every worker.
        max_restarts: how many times a stage may replace its worker processes when one dies or
            hangs: new processes replay the stage up to the failed step, bit for bit, and the run
            goes on. ``0`` (the default) fails with ``MeshFailureError``.
        snapshot_every_n_epochs: with ``max_restarts``, how often (in training epochs) the
            controller keeps a snapshot of the workers' state in memory, so that a recovery
            replays only the steps since the last one; epoch starts are where Lightning resumes
            exactly. Under ``parallelism="fsdp"`` a snapshot is sharded: every worker writes its
            shards into a directory (see ``snapshot_dir``) instead.
        snapshot_dir: with ``parallelism="fsdp"`` and ``max_restarts``, where the workers write the
            sharded snapshots: each stage makes a temporary directory in it, keeps the last
            snapshot there and removes it when the stage ends. By default the system's temporary
            directory on this host; workers on several hosts need a path that they and this
            process all reach (a shared file system).
        step_timeout: seconds a message may wait for the workers before they count as hung
            (``WorkerTimeoutError`` naming the ranks that did not answer, or a restart); ``None``
            (the default) waits as long as a step takes.
        max_ahead: how many batches the workers may run ahead of the controller's loop, which
            replays what rank 0 recorded at each hook; they wait only where a controller callback
            acts on them (a sync point; see the architecture page). ``0`` is lockstep, every hook a
            sync point, for debugging; ``None`` no limit.
        keep_warm: keep the worker processes after a stage that ended cleanly, for the next
            ``fit``/``validate``/``test``/``predict`` with the same devices and backend, in this
            Trainer or another (``lightning_monarch.stop_meshes()`` or interpreter exit stops
            them). ``False`` starts and stops a mesh for every stage.
        parallelism: ``"ddp"`` (the default): every worker holds a replica of the module, and
            after ``fit`` the controller's module holds the trained weights. ``"fsdp"``: the
            workers shard the module with FSDP2 (``torch.distributed.fsdp.fully_shard``), in the
            module's ``configure_model`` or by ``fsdp_policy``; the controller never holds the
            full weights (after ``fit`` its module is moved to the meta device) and
            ``gather_full_state_dict()`` fetches them on demand. The registered name
            ``strategy="monarch_fsdp"`` is ``MonarchStrategy(parallelism="fsdp")``.
        fsdp_policy: with ``parallelism="fsdp"``, module classes (e.g.
            ``{nn.TransformerEncoderLayer}``) whose every instance is sharded on its own, after
            the module's ``configure_model``; the root module is sharded last. Like the
            ``auto_wrap_policy`` of Lightning's ``FSDPStrategy``.
        mixed_precision: with ``parallelism="fsdp"``, FSDP2's ``MixedPrecisionPolicy``, e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: the
            gathered parameters and the computation in ``param_dtype``, the gradient reduction in
            ``reduce_dtype``; the shards and the optimizer stay in the parameters' own dtype.
        activation_checkpointing_policy: with ``parallelism="fsdp"``, module classes whose every
            instance recomputes its activations in the backward pass instead of keeping them,
            as in Lightning's ``FSDPStrategy``.
        cpu_offload: with ``parallelism="fsdp"``, keep the shards of the parameters, their
            gradients and the optimizer state in CPU memory (FSDP2's ``CPUOffloadPolicy``); the
            optimizer steps on the CPU.
        **ddp_kwargs: keyword arguments for ``DistributedDataParallel`` on the workers, as for
            ``DDPStrategy`` (``find_unused_parameters``, ``static_graph``, ...).
    """

    strategy_name = "monarch"

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        hosts: Optional[Any] = None,
        connect_timeout: float = 120.0,
        aggregate_window_sec: Optional[int] = 3,
        process_group_backend: Optional[str] = None,
        worker_callbacks: Optional[list[Callback]] = None,
        max_restarts: int = 0,
        snapshot_every_n_epochs: int = 1,
        snapshot_dir: Optional[Union[str, os.PathLike]] = None,
        step_timeout: Optional[float] = None,
        max_ahead: Optional[int] = DEFAULT_MAX_AHEAD,
        keep_warm: bool = True,
        parallelism: str = "ddp",
        fsdp_policy: Optional[Iterable[type[nn.Module]]] = None,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        activation_checkpointing_policy: Optional[Iterable[type[nn.Module]]] = None,
        cpu_offload: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        unknown = sorted(set(ddp_kwargs) - _DDP_KWARGS)
        if unknown:
            raise TypeError(
                f"MonarchStrategy got {unknown}, which are not keyword arguments of `DistributedDataParallel`."
                f" Accepted: {sorted(_DDP_KWARGS)}."
            )
        self.hosts = hosts
        self.connect_timeout = connect_timeout
        if aggregate_window_sec is not None and not (
            isinstance(aggregate_window_sec, int) and not isinstance(aggregate_window_sec, bool) and aggregate_window_sec > 0
        ):
            raise ValueError(
                f"`MonarchStrategy(aggregate_window_sec={aggregate_window_sec!r})`: give whole seconds > 0, or None to"
                " show every line of the workers' output at once."
            )
        self.aggregate_window_sec = aggregate_window_sec
        self._host_mesh: Optional[Any] = None
        self.process_group_backend = process_group_backend
        self.worker_callbacks = list(worker_callbacks or [])
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ValueError(f"`MonarchStrategy(max_restarts={max_restarts!r})`: give a whole number >= 0.")
        if step_timeout is not None and not (isinstance(step_timeout, (int, float)) and step_timeout > 0):
            raise ValueError(
                f"`MonarchStrategy(step_timeout={step_timeout!r})`: give a number of seconds > 0, or None to wait"
                " as long as a step takes."
            )
        if not isinstance(snapshot_every_n_epochs, int) or isinstance(snapshot_every_n_epochs, bool) or snapshot_every_n_epochs < 1:
            raise ValueError(
                f"`MonarchStrategy(snapshot_every_n_epochs={snapshot_every_n_epochs!r})`: give a whole number >= 1."
            )
        self.max_restarts = max_restarts
        self.parallelism = parallelism
        self.fsdp_policy = _check_sharding(parallelism, fsdp_policy, ddp_kwargs)
        self.mixed_precision = _check_mixed_precision(parallelism, mixed_precision)
        self.activation_checkpointing_policy = _module_classes(
            "activation_checkpointing_policy", activation_checkpointing_policy, parallelism,
            "checkpoints the activations of sharded modules",
        )
        if not isinstance(cpu_offload, bool):
            raise TypeError(f"`MonarchStrategy(cpu_offload={cpu_offload!r})`: give True or False.")
        if cpu_offload and parallelism != "fsdp":
            raise ValueError(_fsdp_only("cpu_offload=True", "offloads the shards of the parameters"))
        self.cpu_offload = cpu_offload
        self.snapshot_every_n_epochs = snapshot_every_n_epochs
        if snapshot_dir is not None and parallelism != "fsdp":
            raise ValueError(_fsdp_only("snapshot_dir=...", "holds the workers' sharded recovery snapshots"))
        self.snapshot_dir = snapshot_dir
        self.step_timeout = step_timeout
        if max_ahead is not None and (not isinstance(max_ahead, int) or isinstance(max_ahead, bool) or max_ahead < 0):
            raise ValueError(
                f"`MonarchStrategy(max_ahead={max_ahead!r})`: give a whole number of batches >= 0 that the workers"
                " may run ahead of the controller (0: lockstep, for debugging), or None for no limit."
            )
        self.max_ahead = max_ahead
        #: How many times this strategy's stages replaced their worker processes after a failure.
        self.restarts = 0
        self.keep_warm = keep_warm
        self.ddp_kwargs = ddp_kwargs
        self._num_nodes = 1
        self._layer_sync: Optional[Any] = None
        self._session: Optional[StageSession] = None
        self._last_state: Optional[CheckpointState] = None
        #: The last stage under ``parallelism="fsdp"``, whose workers keep the module's shards.
        self._last_sharded: Optional[StageSession] = None
        self._undo_on_exception: Optional[Callable[[], None]] = None

    # ----- configuration ---------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_workers(self) -> int:
        """How many worker processes the mesh has: one per device."""
        return len(self.parallel_devices or ()) * self.num_nodes

    @property
    def worker_accelerator(self) -> str:
        """The accelerator the workers' Trainers use: ``"cuda"`` (CUDA or ROCm) or ``"cpu"``."""
        return "cuda" if isinstance(self.accelerator, (WorkerGPUAccelerator, CUDAAccelerator)) else "cpu"

    def mesh_key(self) -> MeshKey:
        """What a warm mesh must match to run this strategy's next stage."""
        devices = self.parallel_devices or ()
        gpu_indices = tuple(device.index or 0 for device in devices) if self.worker_accelerator == "cuda" else None
        return MeshKey(
            self.worker_accelerator,
            self.process_group_backend,
            self._host_mesh,
            len(devices),
            gpu_indices,
            self._pins_here(gpu_indices),
            WorkerOutput(self.aggregate_window_sec) if self._host_mesh is not None else None,
        )

    def _pins_here(self, gpu_indices: Optional[tuple[int, ...]]) -> Optional[tuple[tuple[str, str], ...]]:
        """For GPU workers on this host: the visibility variable each local rank will pin itself
        with (``worker.process``), from this process's environment, which they inherit. A mask
        that cannot give every worker its GPU raises here, before any worker starts."""
        if gpu_indices is None or self._host_mesh is not None:
            return None
        return tuple(pin(index, os.environ, rocm=torch.version.hip is not None) for index in gpu_indices)

    @ParallelStrategy.precision_plugin.setter  # type: ignore[attr-defined]
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning's plugin for the ``precision=`` flag, made inert where it would act on this
        process's own GPU: under ``"16-mixed"`` and ``"bf16-mixed"`` the controller's loop enters no
        CUDA autocast (it computes nothing), and ``"16-mixed"``'s gradient scaler becomes a mirror
        of rank 0's (``GradScalerMirror``), so that a checkpoint holds the workers' scale."""
        if isinstance(plugin, MixedPrecision):
            plugin.device = "cpu"
            if plugin.scaler is not None:
                plugin.scaler = GradScalerMirror(self._require_worker_state)
        self._precision_plugin = plugin

    @property
    def sync_batchnorm(self) -> bool:
        return self._layer_sync is not None

    @override
    def _configure_launcher(self) -> None:
        self._check_configuration()
        self._launcher = MonarchLauncher(self)

    def _check_configuration(self) -> None:
        """Reject Trainer arguments that cannot work with a Monarch mesh, at ``Trainer(...)`` time."""
        accelerator = self.accelerator
        if not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator, WorkerGPUAccelerator)):
            raise MisconfigurationException(
                f"`Trainer(strategy='monarch', accelerator={type(accelerator).__name__})`: Monarch workers run"
                " on CPUs or on CUDA/ROCm GPUs. Use `accelerator='cpu'` or `accelerator='gpu'`."
            )
        if self.hosts is None and self.num_nodes != 1:
            raise MisconfigurationException(
                f"`Trainer(strategy='monarch', num_nodes={self.num_nodes})`: without `MonarchStrategy(hosts=...)` the"
                " workers run on this host only. Give the hosts, e.g. `MonarchStrategy(hosts=SlurmJob(...))`, or"
                " use `num_nodes=1`."
            )
        if self.parallelism == "fsdp" and self.max_restarts and self.num_nodes > 1 and self.snapshot_dir is None:
            raise MisconfigurationException(
                f"`MonarchStrategy(parallelism='fsdp', max_restarts={self.max_restarts})` on {self.num_nodes} hosts:"
                " the workers write the sharded recovery snapshots into a directory they must all reach, and the"
                " default is a temporary directory on this host only. Pass `snapshot_dir=` a path on a file"
                " system shared by every host and this process."
            )
        if self.hosts is not None:
            gpus_per_host = len(self.parallel_devices or ()) if self.worker_accelerator == "cuda" else 0
            self._host_mesh = host_mesh(self.hosts, self.num_nodes, gpus_per_host, self.connect_timeout)
        self._check_gpus_here()
        precision = self.precision_plugin
        if not type(precision).__module__.startswith("lightning.pytorch.plugins.precision"):
            raise MisconfigurationException(
                f"`Trainer(strategy='monarch', plugins=[{type(precision).__name__}(...)])`: the workers build their"
                " precision plugin from the `precision=` flag, so a custom precision plugin would not reach"
                " them. Pass `precision='bf16-mixed'` (or another precision string) instead."
            )

    def _check_gpus_here(self) -> None:
        """GPU workers on this host need a GPU each: refuse a mask that cannot give them one, or
        more devices than the host has (counted by NVML or AMD SMI, which initialize no GPU)."""
        key = self.mesh_key()
        found = host_gpu_count()
        if key.pins is None or found is None:
            return
        missing = sorted({int(device) for _, device in key.pins if device.isdigit() and int(device) >= found})
        if missing:
            raise MisconfigurationException(
                f"`Trainer(strategy='monarch', accelerator='gpu', devices={self._devices_argument()})` pins worker"
                f" processes to GPU(s) {missing}, but this host has {found} GPU(s). Ask for `devices={found}` or"
                " fewer, or give `MonarchStrategy(hosts=...)` to run the workers on other hosts."
            )

    def _devices_argument(self) -> Any:
        indices = [device.index or 0 for device in self.parallel_devices or ()]
        return len(indices) if indices == list(range(len(indices))) else indices

    # ----- one process to Lightning ----------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return self.num_workers

    @property
    def is_distributed(self) -> bool:
        """The controller is one process; the distribution happens among the workers."""
        return False

    @override
    def model_to_device(self) -> None:
        """The controller's module is a CPU mirror; the workers move theirs."""

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        """The controller is the only process of the program that calls it, so there is nobody to wait
        for; each worker's own Lightning waits at its own barriers, among the workers."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank 0's ``obj`` is the controller's own (it runs the loop and its callbacks as rank 0
        does), so broadcasting from rank 0 gives every rank, and the caller, ``obj``; the controller
        has no other rank's value to give."""
        if src != 0:
            raise RuntimeError(
                f"`trainer.strategy.broadcast(obj, src={src})` on the controller under strategy='monarch': the"
                f" controller runs your code once, as rank 0, and has no rank {src} whose value it could take."
                " Broadcast from rank 0 (`src=0`, which gives the value the controller already has), or run the"
                " code on the workers, e.g. as a callback in `MonarchStrategy(worker_callbacks=[...])`."
            )
        return obj

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        """Rank 0's result of reducing ``tensor`` across the workers, each with its own value of it,
        in place, as under DDP: ``tensor`` must be a value the workers sent, as it came
        (``trainer.callback_metrics[...]``); any other raises, naming what to do instead.
        Lightning's own check of dataloader lengths gets rank 0's length: each worker makes the same
        check with a real all-reduce."""
        if _compat.checks_loader_lengths():
            return tensor
        result = self._on_workers("reduce", tensor, group, {"reduce_op": reduce_op}, f"reduce(..., reduce_op={reduce_op!r})")
        return tensor.copy_(result)  # in place, as DDP's reduce leaves rank 0's tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Rank 0's result of gathering ``tensor`` from every worker, each with its own value of it:
        as for :meth:`reduce`, ``tensor`` must be a value the workers sent, as it came."""
        return self._on_workers("all_gather", tensor, group, {"sync_grads": sync_grads}, "all_gather(...)")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """What Lightning's callbacks decide on every DDP rank, combined. ``ModelCheckpoint`` checks
        for a file on rank 0 alone, so its decision is the controller's; ``EarlyStopping`` and
        ``ModelCheckpoint``'s top-k decide from the metric they monitor, so the controller's
        decision (rank 0's) is every rank's when every worker holds the same value of that metric,
        and otherwise it raises, naming the metric. Any other caller's decision cannot be known for
        the other ranks, and raises."""
        caller, function = _compat.decision_caller()
        if function == "file_exists" or self._session is None:
            return decision
        monitor = getattr(caller, "monitor", None)
        if not isinstance(monitor, str):
            raise RuntimeError(
                f"`trainer.strategy.reduce_boolean_decision(...)` called from `{type(caller).__name__}.{function}` on"
                " the controller under strategy='monarch': the controller runs that code once, as rank 0, and"
                " cannot know what the other ranks would decide under `ddp`. Decide from values every rank shares"
                " (metrics logged with `sync_dist=True`) and use the decision as it is, or run the code on the"
                " workers, e.g. as a callback in `MonarchStrategy(worker_callbacks=[...])`."
            )
        values = self._session.metric_on_every_rank("callback_metrics", monitor)
        if any(not _same(value, values[0]) for value in values):
            held = ", ".join(f"rank {rank}: {_shown(value)}" for rank, value in enumerate(values))
            raise RuntimeError(
                f"`{type(caller).__name__}(monitor={monitor!r})` decides on the controller from rank 0's"
                f" `{monitor}`, and under `ddp` every rank decides from its own; but the workers hold different"
                f" values of it ({held}), so rank 0's decision alone could differ from `ddp`'s. Log it with"
                " `sync_dist=True` in the module's `self.log(...)` call, so that every rank holds the same value,"
                " as Lightning recommends for a monitored metric."
            )
        return decision

    def _on_workers(self, kind: str, tensor: Any, group: Optional[Any], options: dict[str, Any], call: str) -> Any:
        """Run the collective ``kind`` on the workers, each on its own counterpart of ``tensor``."""
        origin = self._session.metric_origins.origin(tensor) if self._session is not None else None
        if origin is None or group is not None:
            what = "a process group of the controller's" if group is not None else "this tensor"
            raise RuntimeError(
                f"`trainer.strategy.{call}` on the controller under strategy='monarch': the controller holds one"
                f" copy of each value, rank 0's, and {what} is not one the workers know, so no worker can take"
                " part with its own counterpart of it. Pass a value of `trainer.callback_metrics`,"
                " `trainer.progress_bar_metrics` or `trainer.logged_metrics` as it is (each worker then uses"
                " its own value of that metric), log the value from the LightningModule with"
                " `self.log(name, value, sync_dist=True)` and read it from `trainer.callback_metrics`, or run"
                " the code on the workers, e.g. as a callback in `MonarchStrategy(worker_callbacks=[...])`."
            )
        view, key = origin
        return self._session.collective(kind, view, key, options)

    # ----- state that lives on the workers ---------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """The process IDs of the stage's workers, in rank order (new ones after a restart); empty
        outside a stage."""
        return self._session.worker_pids if self._session is not None else []

    def read_worker_stats(self) -> list[RankStats]:
        """Runs on the controller: every worker's device, process and step-time stats, in rank
        order, read where the workers' loops are parked (one message to every worker; see
        ``MeshStatsMonitor``). Only during a stage."""
        if self._session is None:
            raise RuntimeError(
                "The workers' stats can only be read while a `fit`, `validate`, `test` or `predict` runs."
            )
        return self._session.read_stats()

    def attach(self, session: Optional[StageSession]) -> None:
        """Runs on the controller: the session of the stage in progress, or ``None`` after it."""
        if session is None and self._session is not None:
            self._last_state = self._session.final_state or self._last_state
            if self.parallelism == "fsdp":
                self._last_sharded = self._session
        self._session = session

    def sharding_for_stage(self, module: LightningModule, ckpt_path: Any) -> Optional[ShardingSpec]:
        """Runs on the controller, before any worker starts: how the workers shard ``module`` for
        ``trainer.<stage>(...)`` (``None`` under ``parallelism="ddp"``), once the stage is known to
        be able to run sharded."""
        if self.parallelism != "fsdp":
            return None
        if _on_meta_device(module):
            raise MisconfigurationException(
                f"`{type(module).__name__}` has parameters on the meta device: after `fit` under"
                " `MonarchStrategy(parallelism='fsdp')` its trained weights stay sharded on the workers and the"
                " controller's module is emptied. Running another stage on it is not supported yet. Load the"
                " weights first: `model.to_empty(device='cpu');"
                " model.load_state_dict(trainer.strategy.gather_full_state_dict())`."
            )
        builds_submodules = is_overridden("configure_model", module, LightningModule)
        if isinstance(ckpt_path, (str, os.PathLike)) and os.path.exists(ckpt_path):
            _require_sharded_checkpoint(ckpt_path)
            if not builds_submodules:  # otherwise its full keys exist on the workers only
                check_module_keys(ckpt_path, module, strict=module.strict_loading)
        if not self.fsdp_policy and not builds_submodules:
            rank_zero_warn(
                f"`MonarchStrategy(parallelism='fsdp')` without `fsdp_policy`: `{type(module).__name__}` does not shard"
                " itself in `configure_model`, so FSDP2 shards it as one unit (the root module), as Lightning's"
                " `strategy='fsdp'` does without an `auto_wrap_policy`; every step then gathers all of its parameters"
                " at once. Name the classes of its repeated blocks to shard them one by one and save memory, e.g."
                " `MonarchStrategy(parallelism='fsdp', fsdp_policy={nn.TransformerEncoderLayer})`."
            )
        spec = ShardingSpec(
            policy=self.fsdp_policy,
            mixed_precision=self.mixed_precision,
            activation_checkpointing=self.activation_checkpointing_policy,
            cpu_offload=self.cpu_offload,
        )
        if self.fsdp_policy and not builds_submodules and not any(
            isinstance(submodule, self.fsdp_policy) for submodule in module.modules() if submodule is not module
        ):
            rank_zero_warn(spec.no_match_warning())
        return spec

    def gather_full_state_dict(self) -> dict[str, Any]:
        """Runs on the controller: the module's full (unsharded) state dict, on this process's CPU.

        Under ``parallelism="fsdp"`` the workers gather their shards (every rank takes part;
        rank 0's result comes here): during a stage, e.g. from a callback's ``on_fit_end``, or
        after it, while the warm mesh keeps the shards (until its next stage starts). This is
        the one way the full weights reach the controller; they must fit in its memory. Under
        ``parallelism="ddp"``, rank 0's weights (which the controller's module holds after
        ``fit``).
        """
        if self.parallelism != "fsdp":
            return self.lightning_module_state_dict()
        return self._sharded_session("trainer.strategy.gather_full_state_dict()").full_state_dict()

    def _sharded_session(self, call: str) -> StageSession:
        """The stage whose workers hold the module's shards: the running one, else the last one."""
        session = self._session or self._last_sharded
        if session is None:
            raise RuntimeError(
                f"`{call}` needs the module's shards on the workers under `parallelism='fsdp'`, and no stage has run"
                " with this strategy yet. Call it during or after `trainer.fit(...)`."
            )
        return session

    def keep_until_exception_handled(self, undo: Optional[Callable[[], None]]) -> None:
        """Hold ``undo`` until Lightning has run its exception hooks (see ``on_exception``)."""
        self._undo_on_exception = undo

    def _worker_state(self) -> Optional[CheckpointState]:
        if self._session is not None:
            return self._session.checkpoint_state()
        return self._last_state

    def _require_worker_state(self) -> CheckpointState:
        state = self._worker_state()
        if state is None:
            raise RuntimeError("The workers' optimizer and precision state is only known during or after `trainer.fit`.")
        return state

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Rank 0's weights under ``parallelism="ddp"``. Under ``"fsdp"`` nothing: the workers write
        their shards themselves when the checkpoint is saved (``save_checkpoint``); for the full
        weights call ``gather_full_state_dict()``."""
        if self.parallelism == "fsdp":
            return {}
        if self._session is not None:
            return self._session.checkpoint_state().model
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Rank 0's optimizer state under ``parallelism="ddp"``; under ``"fsdp"`` nothing, as for
        ``lightning_module_state_dict``."""
        if self.parallelism == "fsdp":
            return {}
        return self._require_worker_state().optimizers[self.optimizers.index(optimizer)]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` with the worker callbacks' state added, as DDP's rank 0 would.

        Under ``parallelism="fsdp"``, ``filepath`` becomes a directory, as under Lightning's
        ``ModelParallelStrategy``: every worker writes its own shards of the module's and the
        optimizers' state into it, in parallel (``worker.checkpoints``), then this process writes
        Lightning's metadata (the rest of ``checkpoint``) beside them, in ``meta.pt``. The full
        weights never come here. ``filepath`` must be on storage every worker reaches.
        """
        if self.parallelism == "fsdp":
            self._save_sharded_checkpoint(checkpoint, filepath, storage_options)
            return
        writers = [type(callback).__name__ for callback in self.worker_callbacks
                   if is_overridden("on_save_checkpoint", callback, Callback)]
        if writers and self._session is None:
            raise RuntimeError(
                f"`trainer.save_checkpoint(...)` after the stage under strategy='monarch': the worker callbacks"
                f" {writers} add to every checkpoint in `on_save_checkpoint`, which runs on the workers, and the"
                " workers have dropped the finished stage. Save it while the stage runs, e.g. from a callback's"
                " `on_fit_end` (`trainer.save_checkpoint(path)`), or keep `ModelCheckpoint(save_last=True)`'s"
                " `last.ckpt`."
            )
        state = self._worker_state()
        if state is not None and state.callbacks:
            checkpoint.setdefault("callbacks", {}).update(state.callbacks)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _save_sharded_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                                 storage_options: Optional[Any]) -> None:
        if storage_options is not None:
            raise TypeError(
                "`trainer.save_checkpoint(..., storage_options=...)` under `MonarchStrategy(parallelism='fsdp')`: the"
                " workers write the shards with `torch.distributed.checkpoint`, not with the `CheckpointIO` that"
                " takes these options. Remove `storage_options`."
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
        """Under ``parallelism="fsdp"``: the metadata of the sharded checkpoint directory
        ``checkpoint_path``; the workers load (and reshard) the shards themselves."""
        if self.parallelism != "fsdp":
            return super().load_checkpoint(checkpoint_path, weights_only)
        _require_sharded_checkpoint(checkpoint_path)
        return self.checkpoint_io.load_checkpoint(os.path.join(checkpoint_path, METADATA_FILENAME),
                                                  weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Under ``parallelism="fsdp"`` the workers load the module's shards; the controller's module
        keeps its weights."""
        if self.parallelism != "fsdp":
            super().load_model_state_dict(checkpoint, strict)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Under ``parallelism="fsdp"`` the workers' ``ModelParallelStrategy`` restores a checkpoint
        after ``configure_optimizers``; the controller restores at the same point, so that both
        loops call ``on_load_checkpoint`` in the same order (R1)."""
        return self.parallelism == "fsdp"

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """Under ``parallelism="fsdp"`` a checkpoint's metadata holds no optimizer state: the workers
        load theirs from the shards."""
        return self.parallelism != "fsdp"

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Each worker loads optimizer state from the same checkpoint file itself."""

    @override
    def teardown(self) -> None:
        """Lightning's teardown moves the module to the CPU, where the controller's module already
        is; a module emptied after a sharded ``fit`` (on the meta device) has no data to move, so
        Lightning's teardown does not get it, and it is attached again after (for
        ``trainer.save_checkpoint`` after ``fit``)."""
        module = self.lightning_module
        emptied = module is not None and _on_meta_device(module)
        if emptied:
            self._lightning_module = None
        super().teardown()
        if emptied:  # still attached, for ``trainer.save_checkpoint`` after ``fit``
            self._lightning_module = module

    @override
    def on_exception(self, exception: BaseException) -> None:
        undo, self._undo_on_exception = self._undo_on_exception, None
        if undo is not None:
            undo()


def _same(value: Any, other: Any) -> bool:
    if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
        return value.shape == other.shape and torch.equal(value, other)
    return value is None and other is None


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"{value.item():g}"
    return "none" if value is None else str(value)


def _require_sharded_checkpoint(path: Any) -> None:
    """Under ``parallelism="fsdp"`` the workers resume from a sharded checkpoint directory only."""
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"`ckpt_path={str(path)!r}` under `MonarchStrategy(parallelism='fsdp')` is not a sharded checkpoint (a"
            f" directory with `{METADATA_FILENAME}`, as `trainer.save_checkpoint` writes under `parallelism='fsdp'`"
            " or Lightning's `ModelParallelStrategy`). Resuming a sharded run from a single-file checkpoint is not"
            " supported yet: give a sharded checkpoint directory."
        )


def _on_meta_device(module: nn.Module) -> bool:
    return any(parameter.is_meta for parameter in module.parameters())


def _check_sharding(parallelism: str, fsdp_policy: Optional[Iterable[type[nn.Module]]],
                    ddp_kwargs: dict[str, Any]) -> tuple[type[nn.Module], ...]:
    """Validate ``MonarchStrategy``'s sharding arguments at construction; return the policy's
    classes in a fixed order."""
    if parallelism not in _PARALLELISMS:
        raise ValueError(
            f"`MonarchStrategy(parallelism={parallelism!r})`: choose 'ddp' (a replica of the module on every"
            " worker) or 'fsdp' (the module sharded across the workers with FSDP2)."
        )
    policy = _module_classes("fsdp_policy", fsdp_policy, parallelism, "shards modules")
    if parallelism == "fsdp" and ddp_kwargs:
        raise ValueError(
            f"`MonarchStrategy(parallelism='fsdp', {', '.join(f'{name}=...' for name in sorted(ddp_kwargs))})`:"
            " these are `DistributedDataParallel` arguments, and sharded workers do not use DDP. Remove them."
        )
    return policy


def _module_classes(argument: str, classes: Optional[Iterable[type[nn.Module]]], parallelism: str,
                    what: str) -> tuple[type[nn.Module], ...]:
    """Validate a ``MonarchStrategy`` argument that names module classes for sharded workers
    (``fsdp_policy``, ``activation_checkpointing_policy``); return them in a fixed order."""
    found = tuple(sorted(set(classes or ()), key=repr))
    bad = [cls for cls in found if not (isinstance(cls, type) and issubclass(cls, nn.Module))]
    if bad:
        raise TypeError(
            f"`MonarchStrategy({argument}={set(found)!r})`: {bad} are not `nn.Module` classes. Give module"
            f" classes, e.g. `{argument}={{nn.TransformerEncoderLayer}}`."
        )
    if found and parallelism != "fsdp":
        raise ValueError(_fsdp_only(f"{argument}=...", what))
    return found


def _check_mixed_precision(parallelism: str, mixed_precision: Any) -> Optional[MixedPrecisionPolicy]:
    """Validate ``MonarchStrategy(mixed_precision=...)``: FSDP2's policy, with floating dtypes."""
    example = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    if mixed_precision is None:
        return None
    if not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            f"`MonarchStrategy(mixed_precision={mixed_precision!r})`: give FSDP2's `MixedPrecisionPolicy` (from"
            f" `torch.distributed.fsdp`), e.g. `mixed_precision={example}`."
        )
    dtypes = {name: getattr(mixed_precision, name) for name in ("param_dtype", "reduce_dtype", "output_dtype")}
    bad = {name: dtype for name, dtype in dtypes.items() if dtype is not None and not (
        isinstance(dtype, torch.dtype) and dtype.is_floating_point)}
    if bad:
        raise TypeError(
            f"`MonarchStrategy(mixed_precision={mixed_precision!r})`: {bad} are not floating-point torch dtypes."
            f" Give e.g. `mixed_precision={example}`."
        )
    if parallelism != "fsdp":
        raise ValueError(_fsdp_only("mixed_precision=...", "casts the gathered shards of the parameters"))
    return mixed_precision


def _fsdp_only(argument: str, what: str) -> str:
    """The error for a sharding option given without ``parallelism="fsdp"``."""
    return (
        f"`MonarchStrategy({argument})` {what}, which only `parallelism='fsdp'` does. Pass"
        f" `MonarchStrategy(parallelism='fsdp', {argument})`."
    )
