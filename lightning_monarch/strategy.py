"""``MonarchStrategy``: the Lightning strategy the controller's Trainer talks to.

Runs on the controller. To Lightning there is one process, as with lightning-Graphcore's
``IPUStrategy``: ``is_global_zero`` is True and ``barrier``/``broadcast``/``reduce`` act locally
or on the workers. Each worker holds a replica of the module and trains it under its own
Lightning ``DDPStrategy``. ``MonarchFSDPStrategy`` (``lightning_monarch.fsdp``) shards the module
across the workers instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller import arguments
from lightning_monarch.controller.features.rehearsal import RehearsalReport
from lightning_monarch.controller.launch.accelerator import WorkerGPUAccelerator
from lightning_monarch.controller.launch.configuration import HostMeshes, check_configuration
from lightning_monarch.controller.launch.launcher import MonarchLauncher
from lightning_monarch.controller.loop import collectives
from lightning_monarch.controller.loop.attached import AttachedStage
from lightning_monarch.controller.loop.mirrors import GradScalerMirror
from lightning_monarch.controller.loop.session import StageSession
from lightning_monarch.controller.mesh.snapshots import SnapshotDirectory
from lightning_monarch.controller.settings import StageOutcome, StrategySettings
from lightning_monarch.wire.reports import RankStats
from lightning_monarch.wire.specs import ShardingSpec

#: Keyword arguments of ``DistributedDataParallel`` that the workers' ``DDPStrategy`` passes on.
_DDP_KWARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
#: How many batches the workers may run ahead of the controller's loop by default (R4).
DEFAULT_MAX_AHEAD = 16
#: The constructor's parameters that Lightning's accelerator connector gives, not the user.
_LIGHTNING_PARAMETERS = frozenset(
    {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
)
#: Arguments of earlier versions' ``MonarchStrategy(parallelism="fsdp", ...)``, now
#: ``MonarchFSDPStrategy``'s: given to ``MonarchStrategy``, they name it.
_SHARDING_OPTIONS = (
    "parallelism",
    "fsdp_policy",
    "mixed_precision",
    "activation_checkpointing_policy",
    "cpu_offload",
    "snapshot_dir",
)


class _OneProcess(ParallelStrategy):
    """What Lightning sees of a Monarch strategy: one process, rank 0 of the world, on the CPU, whose
    barriers wait for nobody and whose broadcasts from rank 0 give its own object. Runs on the
    controller; the workers' own Lightning runs the real collectives among them."""

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
                " code on the workers, e.g. as a callback given as `lightning_monarch.on_workers(MyCallback())`."
            )
        return obj


class MonarchStrategy(_OneProcess):
    """Train on a mesh of Monarch worker actors from one controller process: this one.

    The controller runs Lightning's loops, callbacks, loggers and checkpoint files once; one
    worker per device runs the LightningModule with Lightning's ``DDPStrategy``, each with a
    replica of it. To shard the module across the workers, use ``MonarchFSDPStrategy``.

    Args:
        hosts: where the workers run: nothing for this host, a Monarch job
            (``monarch.job.ProcessJob({"hosts": 2})``, ``SlurmJob``, ``KubernetesJob``...), a
            ``HostMesh`` (e.g. from ``attach_to_workers``), or a list of worker addresses
            (``["tcp://node-1:26600", ...]``, each running ``run_worker_loop_forever``) or a
            function that returns the current list (elastic training asks it again for lost hosts);
            ``Trainer(num_nodes=...)`` must equal its number of hosts, and each host runs
            ``devices`` workers.
        connect_timeout: seconds the hosts have to connect at ``Trainer(...)`` time before an
            ``UnreachableHostsError`` names the addresses that did not.
        aggregate_window_sec: with ``hosts``, Monarch forwards what the workers print to this
            process and shows lines printed alike within this many seconds once, with their count;
            ``None`` shows every line at once, prefixed with its rank. Workers on this host print
            to this process's terminal directly, as ``ddp``'s ranks do. The workers' Python
            warnings come to this process and show once each, naming the ranks that raised one
            when rank 0 did not; with ``None`` every worker prints its own, as ``ddp``'s ranks do.
        process_group_backend: the workers' ``torch.distributed`` backend; by default ``gloo`` on
            CPU and ``nccl`` on GPUs (RCCL on a ROCm build of torch).
        worker_callbacks: callbacks to run on every worker, after the Trainer's own (as ``on_workers`` places them).
        max_restarts: how many times a stage may replace its worker processes when one dies or
            hangs: new processes replay the stage up to the failed step, bit for bit, and the run
            goes on. ``0`` (the default) fails with ``MeshFailureError``.
        snapshot_every_n_epochs: with ``max_restarts``, how often (in training epochs) the
            controller keeps a snapshot of the workers' state in memory, so that a recovery
            replays only the steps since the last one; epoch starts are where Lightning resumes
            exactly. With ``min_nodes``, how often a ``fit`` keeps its resume point.
        min_nodes: elastic training, with ``hosts``: when hosts are lost (their workers died and no
            new process starts on them within ``connect_timeout``), a ``fit`` goes on with the
            surviving hosts' processes, from its latest resume point, while at least ``min_nodes``
            hosts remain (``num_nodes`` is the most); with fewer, ``HostsLostError``. A lost host
            that serves again at an address ``hosts`` names rejoins at the next resume point.
            ``None`` (the default): a lost host ends the run.
        keep_global_batch: with ``min_nodes``, grow ``accumulate_grad_batches`` by the lost share
            of the world (``num_nodes`` / surviving hosts) so that every optimizer step sees the
            same number of samples, where that ratio is a whole number (else a warning says so).
        step_timeout: seconds a message may wait for the workers before they count as hung
            (``WorkerTimeoutError`` naming the ranks that did not answer, or a restart); ``None``
            (the default) waits as long as a step takes.
        max_ahead: how many batches the workers may run ahead of the controller's loop, which
            replays what rank 0 recorded at each hook, before they wait to start a training batch
            (evaluation and prediction batches never wait for it); they wait otherwise only where
            a controller callback acts on them (a sync point; see the architecture page). ``0`` is
            lockstep, every hook a sync point, for debugging; ``None`` no limit.
        keep_warm: keep the worker processes after a stage that ended cleanly, for the next
            ``fit``/``validate``/``test``/``predict`` with the same devices and backend, in this
            Trainer or another (``lightning_monarch.stop_meshes()`` or interpreter exit stops
            them). ``False`` starts and stops a mesh for every stage. A warm mesh also keeps the
            weights: a stage sends none that the workers hold from the last one.
        shared_memory: the weights that the workers lack leave this process once, in a file in this
            host's shared memory that has no name (``memfd_create``: nothing is left behind if a
            process is killed) and that the workers here map without a copy, where rank 0 runs on
            this host and there is room. ``False`` sends them in one message to rank 0
            instead, which broadcasts them to the others over the workers' process group (as it
            does for workers on other hosts).
        rehearse: before each ``fit``, rehearse it on the workers (``lightning_monarch.rehearse``):
            a few real steps, one validation batch and one checkpoint, then print the report (memory
            per rank, step time, the run's projected time, warnings with their fixes) and keep it in
            ``strategy.rehearsal``. A rehearsal that fails raises ``RehearsalError`` before the
            ``fit`` starts; the ``fit`` itself gives what it gives without one.
        post_mortem: an exception in a worker's hook opens pdb at the frame that raised it, on this
            process's terminal or notebook, with that rank's locals (``breakpoint()`` in a worker
            does so without it); the stage then fails as it does without it. See the debugging page.
        timeout: the workers' process-group timeout, as Lightning's ``DDPStrategy`` takes it: how
            long a collective waits for a rank (one stopped in pdb, or hung) before it fails. The
            group lives as long as its workers: a warm mesh is reused for the same timeout only.
        validation: ``"async"`` validates a ``fit`` on a second mesh of workers (on GPUs, the next
            ones) while training goes on, with the synchronous run's results; see its page.
        validation_devices: with ``"async"``, the validation workers: as many as train (``None``).
        validation_hosts: with ``"async"``, the validation workers' hosts, given as ``hosts`` is (as
            many hosts): by default the training hosts, where they take the next GPUs.
        **ddp_kwargs: keyword arguments for ``DistributedDataParallel`` on the workers, as for
            ``DDPStrategy`` (``find_unused_parameters``, ``static_graph``, ...).
    """

    strategy_name = "monarch"
    #: Its other registered names and their options: by Lightning's convention for its strategies, and
    #: ``"ddp_monarch…"`` for libraries that read ``"ddp"`` in the name (scvi-tools shards its data then).
    aliases: ClassVar[dict[str, dict[str, Any]]] = {
        "monarch_find_unused_parameters_true": {"find_unused_parameters": True},
        "ddp_monarch": {},
        "ddp_monarch_find_unused_parameters_true": {"find_unused_parameters": True},
    }
    _description = "Single-controller training on a PyTorch Monarch worker mesh"
    #: Parameters of a base's constructor that a subclass's constructor sets itself, and refuses.
    _fixed_arguments: ClassVar[frozenset[str]] = frozenset()

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
        min_nodes: Optional[int] = None,
        keep_global_batch: bool = True,
        step_timeout: Optional[float] = None,
        max_ahead: Optional[int] = DEFAULT_MAX_AHEAD,
        keep_warm: bool = True,
        shared_memory: bool = True,
        rehearse: bool = False,
        post_mortem: bool = False,
        timeout: Optional[timedelta] = default_pg_timeout,
        validation: str = "sync",
        validation_devices: Optional[int] = None,
        validation_hosts: Optional[Any] = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        owner = type(self).__name__
        self.ddp_kwargs = arguments.ddp_kwargs(ddp_kwargs, _DDP_KWARGS, _SHARDING_OPTIONS)
        self.hosts = hosts
        self.connect_timeout = arguments.number(owner, "connect_timeout", connect_timeout, above=0, of="seconds")
        self.aggregate_window_sec = arguments.whole_number(
            owner,
            "aggregate_window_sec",
            aggregate_window_sec,
            1,
            of="seconds",
            none="to show every line of the workers' output at once",
        )
        self.process_group_backend = process_group_backend
        self.worker_callbacks = list(worker_callbacks or [])
        self.max_restarts = arguments.whole_number(owner, "max_restarts", max_restarts, 0)
        self.snapshot_every_n_epochs = arguments.whole_number(
            owner, "snapshot_every_n_epochs", snapshot_every_n_epochs, 1, of="training epochs"
        )
        self.min_nodes = arguments.whole_number(
            owner, "min_nodes", min_nodes, 1, of="hosts", none="for no elastic training (a lost host ends the run)"
        )
        self.keep_global_batch = arguments.flag(owner, "keep_global_batch", keep_global_batch)
        self.step_timeout = arguments.number(
            owner, "step_timeout", step_timeout, above=0, of="seconds", none="to wait as long as a step takes"
        )
        self.max_ahead = arguments.whole_number(
            owner,
            "max_ahead",
            max_ahead,
            0,
            of="batches",
            meaning=" that the workers may run ahead of the controller (0: lockstep, for debugging)",
            none="for no limit",
        )
        self.keep_warm = arguments.flag(owner, "keep_warm", keep_warm)
        self.shared_memory = arguments.flag(owner, "shared_memory", shared_memory)
        self.rehearse = arguments.flag(owner, "rehearse", rehearse)
        self.post_mortem = arguments.flag(owner, "post_mortem", post_mortem)
        self.timeout = arguments.duration(owner, "timeout", timeout)
        self.validation, self.validation_devices, self.validation_hosts = arguments.validation(
            owner, validation, validation_devices, validation_hosts
        )
        #: The report of the last rehearsal (``rehearse=True``), ``None`` before one.
        self.rehearsal: Optional[RehearsalReport] = None
        #: Whether this strategy runs a rehearsal (``controller.features.rehearsal.rehearsal_twin``).
        self._rehearsing = False
        #: How many times this strategy's stages replaced their worker processes after a failure.
        self.restarts = 0
        #: The bytes this process sent the workers in the last stage's messages, by endpoint (each
        #: message's pickled size once per rank it went to; weights in shared memory once, under
        #: ``"shared memory"``).
        self.sent_bytes: dict[str, int] = {}
        #: How many times an elastic ``fit`` of this strategy went on in a smaller world (``min_nodes``).
        self.world_changes = 0
        self._host_meshes = HostMeshes(None, None)
        self._num_nodes = 1
        self._layer_sync: Optional[Any] = None
        #: The stage in progress and what the last one left (rank 0's state, a sharded stage's session).
        self._stage = AttachedStage()
        self._undo_on_exception: Optional[Callable[[], None]] = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy="monarch"`` and its :attr:`aliases` (``import lightning_monarch`` calls it)."""
        for name, options in {cls.strategy_name: {}, **cls.aliases}.items():
            strategy_registry.register(name, cls, description=cls._description, override=True, **options)

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

    def _settings(self) -> StrategySettings:
        """What this strategy asks of its workers, as the launcher and the features read it: the
        options of ``MonarchStrategy``'s constructor, and what Lightning gave it."""
        options = arguments.constructor_arguments(self, MonarchStrategy, MonarchStrategy, _LIGHTNING_PARAMETERS)
        return StrategySettings(
            **options,
            twin=self._rehearsal_twin,
            host_mesh=self._host_meshes.training,
            validation_host_mesh=self._host_meshes.validation,
            rehearsing=self._rehearsing,
            ddp_kwargs=self.ddp_kwargs,
            worker_accelerator=self.worker_accelerator,
            devices=tuple(self.parallel_devices or ()),
            num_nodes=self.num_nodes,
            sync_batchnorm=self.sync_batchnorm,
        )

    def _rehearsal_twin(self, **overrides: Any) -> MonarchStrategy:
        """A strategy of this class, made from this one's arguments with ``overrides``, that runs a
        rehearsal (``controller.features.rehearsal``)."""
        twin = type(self)(**{**self._arguments(), **overrides})
        twin._rehearsing = True
        return twin

    def _arguments(self) -> dict[str, Any]:
        """The arguments this strategy was made with, as its constructor takes them (a rehearsal
        makes its twin from them), read from the attributes of the same names, then ``ddp_kwargs``."""
        left_out = _LIGHTNING_PARAMETERS | self._fixed_arguments
        return {**arguments.constructor_arguments(self, type(self), MonarchStrategy, left_out), **self.ddp_kwargs}

    @ParallelStrategy.precision_plugin.setter  # type: ignore[attr-defined]
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning's plugin for the ``precision=`` flag, made inert where it would act on this
        process's own GPU: under ``"16-mixed"`` and ``"bf16-mixed"`` the controller's loop enters no
        CUDA autocast (it computes nothing), and ``"16-mixed"``'s gradient scaler becomes a mirror
        of rank 0's (``GradScalerMirror``), so that a checkpoint holds the workers' scale."""
        if isinstance(plugin, MixedPrecision):
            plugin.device = "cpu"
            if plugin.scaler is not None:
                plugin.scaler = GradScalerMirror(self._stage.require_checkpoint_state)
        lightning_compat.set_precision_plugin(self, plugin)

    @property
    def sync_batchnorm(self) -> bool:
        return self._layer_sync is not None

    @override
    def _configure_launcher(self) -> None:
        """Check the Trainer's arguments, connect to the hosts, and hand the launcher this
        strategy's settings, with the strategy as its hooks (``controller.settings``)."""
        self._check_configuration()
        lightning_compat.set_launcher(self, MonarchLauncher(self._settings(), self))

    def _check_configuration(self) -> None:
        """Reject Trainer arguments that cannot work with a Monarch mesh, at ``Trainer(...)`` time,
        and keep the hosts' ``HostMesh``es."""
        self._host_meshes = check_configuration(self._settings(), self.accelerator, self.precision_plugin)

    # ----- one process to Lightning (see _OneProcess) -----------------------------------------

    @property
    @override
    def world_size(self) -> int:
        return self.num_workers

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        """Rank 0's result of reducing ``tensor`` across the workers, each with its own value of it,
        in place, as under DDP: ``tensor`` must be a value the workers sent, as it came
        (``trainer.callback_metrics[...]``); any other raises, naming what to do instead.
        Lightning's own check of dataloader lengths gets rank 0's length: each worker makes the same
        check with a real all-reduce."""
        if lightning_compat.checks_loader_lengths():
            return tensor
        call = f"reduce(..., reduce_op={reduce_op!r})"
        result = collectives.on_workers(self._stage.session, "reduce", tensor, group, {"reduce_op": reduce_op}, call)
        return tensor.copy_(result)  # in place, as DDP's reduce leaves rank 0's tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Rank 0's result of gathering ``tensor`` from every worker, each with its own value of it:
        as for :meth:`reduce`, ``tensor`` must be a value the workers sent, as it came."""
        options = {"sync_grads": sync_grads}
        return collectives.on_workers(self._stage.session, "all_gather", tensor, group, options, "all_gather(...)")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """What Lightning's callbacks decide on every DDP rank, combined, as
        ``controller.loop.collectives.boolean_decision`` tells: from the metric they monitor, or
        ``ModelCheckpoint``'s file check on rank 0 alone."""
        caller, function = lightning_compat.decision_caller()
        return collectives.boolean_decision(self._stage.session, decision, caller, function)

    # ----- state that lives on the workers ---------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """The process IDs of the stage's workers, in rank order (new ones after a restart); empty
        outside a stage."""
        return self._stage.worker_pids

    def read_worker_stats(self) -> list[RankStats]:
        """Runs on the controller: every worker's device, process and step-time stats, in rank
        order, read where the workers' loops are parked (one message to every worker; see
        ``MeshStatsMonitor``). Only during a stage."""
        return self._stage.read_stats()

    def _attach(self, session: Optional[StageSession]) -> None:
        """Runs on the controller, called by the launcher: the session of the stage in progress, or
        ``None`` after it."""
        self._stage.attach(session)

    def _record(self, outcome: StageOutcome) -> None:
        """Runs on the controller, called by the launcher and the features: keep what a stage, or
        part of it, produced."""
        self.restarts += outcome.restarts
        self.world_changes += outcome.world_changes
        if outcome.sent_bytes is not None:
            self.sent_bytes = dict(outcome.sent_bytes)
        if outcome.num_nodes is not None:
            self._num_nodes = outcome.num_nodes
        if outcome.rehearsal is not None:
            self.rehearsal = outcome.rehearsal

    def _sharding_for_stage(self, module: LightningModule, ckpt_path: Any) -> Optional[ShardingSpec]:
        """Runs on the controller, called by the launcher before any worker starts: how the workers
        shard ``module``; ``None``, a replica each."""
        return None

    def _snapshot_directory(self) -> Optional[SnapshotDirectory]:
        """Where the workers write recovery snapshots; ``None``: they send them to the controller."""
        return None

    def gather_full_state_dict(self) -> dict[str, Any]:
        """Runs on the controller: the module's full state dict, rank 0's weights (which the
        controller's module holds after ``fit``). ``MonarchFSDPStrategy`` gathers the shards."""
        return self.lightning_module_state_dict()

    def _keep_until_exception_handled(self, undo: Optional[Callable[[], None]]) -> None:
        """Hold ``undo`` until Lightning has run its exception hooks (see ``on_exception``)."""
        self._undo_on_exception = undo

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Rank 0's weights."""
        state = self._stage.weights()
        return state.model if state is not None else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Rank 0's optimizer state."""
        return self._stage.require_checkpoint_state().optimizers[self.optimizers.index(optimizer)]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` with the worker callbacks' state added, as DDP's rank 0 would."""
        self._stage.add_worker_callbacks_state(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each worker loads optimizer state from the same checkpoint file itself."""

    @override
    def on_exception(self, exception: BaseException) -> None:
        undo, self._undo_on_exception = self._undo_on_exception, None
        if undo is not None:
            undo()
