"""What the controller gives the workers: a stage, the world they join, a preflight, and the
references its objects travel as.

Both sides import this module, as they do :mod:`lightning_monarch.wire.protocol`, whose rules (R1-R8)
these messages serve; nothing here talks to a mesh or runs a hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning_monarch._compat.torch import tree_map
from lightning_monarch.wire.codec import Parcel, Shipment
from lightning_monarch.wire.protocol import RunAhead
from lightning_monarch.wire.reports import CheckpointState


def versions() -> dict[str, Optional[str]]:
    """This process's torch, Lightning, CUDA and HIP versions: the controller's and every
    worker's must agree."""
    import lightning
    import torch

    return {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
    }


def worker_backend(accelerator: str, chosen: Optional[str]) -> str:
    """The workers' ``torch.distributed`` backend: the one chosen, else what Lightning's DDP picks
    (``nccl`` on GPUs, which is RCCL on a ROCm build of torch; ``gloo`` on CPUs)."""
    return chosen or ("nccl" if accelerator == "cuda" else "gloo")


@dataclass(frozen=True)
class ShardingSpec:
    """How the workers shard the module under ``MonarchModelParallelStrategy``: on a device mesh
    of ``mesh_shape``, in the module's own ``configure_model``; under ``MonarchFSDPStrategy``
    (``wraps``) then with FSDP2's ``fully_shard``, each instance of the ``policy`` module classes,
    then the root module (see ``worker.sharding``). The options apply to the ``fully_shard`` calls
    the workers make, not to the module's own."""

    #: The workers' device mesh, (data parallel, tensor parallel) sizes, as Lightning's
    #: ``ModelParallelStrategy`` takes them.
    mesh_shape: tuple[int, int] = (1, 1)
    #: Whether the workers shard the module after its own ``configure_model`` (``MonarchFSDPStrategy``);
    #: otherwise that hook applies every parallelism itself, as under Lightning's strategy.
    wraps: bool = True
    #: Whether a checkpoint is a directory of every rank's shards, or one file rank 0 writes.
    save_distributed_checkpoint: bool = True
    policy: tuple[type, ...] = ()
    #: FSDP2's ``MixedPrecisionPolicy`` (a param and a reduce dtype), or ``None`` for none.
    mixed_precision: Optional[Any] = None
    #: Module classes whose every instance recomputes its activations in the backward pass.
    activation_checkpointing: tuple[type, ...] = ()
    #: Keep the sharded parameters (and so their gradients and optimizer state) on the CPU.
    cpu_offload: bool = False
    #: The module's weights are the shards the workers kept from its last sharded stage (the
    #: controller's module is on the meta device): once sharded, each rank loads its own.
    from_shards: bool = False

    def no_match_warning(self) -> str:
        """The warning for a policy that names no class of the module's submodules."""
        names = ", ".join(cls.__name__ for cls in self.policy)
        return (
            f"`MonarchFSDPStrategy(fsdp_policy={{{names}}})`: the module has no submodule of these"
            " classes, so FSDP2 shards it as one unit (the root module) and every step gathers all of its"
            " parameters at once. Name the classes of its repeated blocks (e.g. its transformer layers) in"
            " `fsdp_policy`."
        )


@dataclass(frozen=True)
class TrainerSubclass:
    """A library's subclass of Lightning's ``Trainer`` (PINA's), and the attributes its instance
    adds to Lightning's: each worker's Trainer is of that class, with those attributes, as each DDP
    rank's Trainer is, for module code that reads them (``self.trainer.logging_kwargs``). Its
    ``__init__`` does not run there (it ran on the controller), nor its ``fit``: Lightning's runs."""

    cls: type
    attributes: dict[str, Any]


@dataclass(frozen=True)
class ImportedState:
    """What the user's script may have changed in the classes and modules a stage's objects refer to
    by reference, as the controller has it (``controller.mesh.imported_state``): each worker takes
    each value that differs from its own import's (``worker.imported_state``). Travels in the
    stage's payload, after its objects, sharing their pickle's memo."""

    #: Each class's data attributes, by the class; each module's public data, by the module's name.
    attributes: dict[Union[type, str], dict[str, Any]]
    #: The public settings (properties with a setter, public attributes) of each object a module
    #: holds that is of a library's class (``scvi.settings``), by the module's name and the object's.
    settings: dict[tuple[str, str], dict[str, Any]]
    #: The values that cannot be pickled, as the class or module of :attr:`attributes` or the
    #: settings object of :attr:`settings` holds them: each one :func:`described`, and why it
    #: cannot be pickled, by name.
    untravelled: dict[Union[type, str, tuple[str, str]], dict[str, tuple[Any, str]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Untravelled:
    """A value that cannot be pickled, as the controller describes it (:func:`described`) for a
    worker to tell whether its own import holds the same: its type's ``module.qualname`` and, for a
    list, tuple or dict, its items (pairs of key and value), each described in turn."""

    type: str
    items: Optional[tuple[Any, ...]] = None


def described(value: Any, travel_error: Callable[[Any], Optional[Exception]]) -> Any:
    """``value`` itself where it can travel (``travel_error`` finds no error), else its
    :class:`Untravelled`."""
    if travel_error(value) is None:
        return value
    items: Optional[tuple[Any, ...]] = None
    if isinstance(value, (list, tuple)):
        items = tuple(described(item, travel_error) for item in value)
    elif isinstance(value, dict):
        items = tuple((described(key, travel_error), described(item, travel_error)) for key, item in value.items())
    return Untravelled(type_name(type(value)), items)


def type_name(cls: type) -> str:
    """``cls`` as ``module.qualname``: how both sides name a value's type (:class:`ImportedState`)."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class TrainerConfig:
    """The controller Trainer's flags that a worker's Trainer must share so both loops agree (R1)."""

    accelerator: str
    devices: int
    num_nodes: int
    precision: str
    process_group_backend: Optional[str]
    flags: dict[str, Any]
    ddp_kwargs: dict[str, Any]
    #: ``None``: a DDP replica per worker; else the module is sharded with FSDP2.
    sharding: Optional[ShardingSpec] = None
    #: The workers' process-group timeout (a ``timedelta``), as Lightning's strategies take it.
    timeout: Optional[Any] = None


@dataclass(frozen=True)
class PreflightSpec:
    """What every worker checks before the first step (see ``worker.preflight``): the controller's
    versions to match, the device kind, and an all-reduce of ``all_reduce_mib`` MiB that must
    finish within ``all_reduce_limit_s``."""

    accelerator: str
    process_group_backend: Optional[str]
    versions: dict[str, Optional[str]]
    all_reduce_mib: float
    all_reduce_limit_s: float
    #: The process group's timeout (a ``timedelta``; ``None``: torch's default): the check starts it.
    timeout: Optional[Any] = None


@dataclass(frozen=True)
class RankSnapshot:
    """One rank's part of a snapshot: what a Lightning checkpoint does not hold (the random
    states, the module's public attributes, the Trainer's stored metric values), and on rank 0
    the checkpoint itself (``torch.save`` bytes; ``None`` under sharding, where every rank writes its
    shards into the snapshot's directory instead), all read at :data:`SNAPSHOT_GATE`."""

    rank: int
    rng: dict[str, Any]
    attributes: dict[str, Any]
    metrics: dict[str, dict[str, Any]]
    checkpoint: Optional[bytes]


@dataclass(frozen=True)
class ResumePoint:
    """Where a replacement worker's stage starts: Lightning's own resume from ``checkpoint``, run
    without gates up to :data:`SNAPSHOT_GATE`, where each rank takes back its random states and
    module attributes from ``ranks``; from there the controller replays its journal.

    ``checkpoint`` is rank 0's Lightning checkpoint (``torch.save`` bytes, packed as a ``Parcel``
    whose bytes travel once) under ``ddp``, and under ``MonarchFSDPStrategy`` the path of the sharded
    checkpoint directory that every rank wrote its shards into
    (``controller.mesh.snapshots.SnapshotDirectory``)."""

    checkpoint: Union[Parcel, str]
    ranks: tuple[RankSnapshot, ...]


@dataclass(frozen=True)
class StageSpec:
    """Everything a worker needs to run one Trainer stage: sent once per stage.

    ``fit_loop_state`` is the controller's ``trainer.fit_loop.state_dict()``: a Trainer that ran
    ``fit`` before carries its epoch and step into later stages, and so must each worker's.
    ``payload`` is the cloudpickled ``(module, datamodule, dataloaders, worker_callbacks, trainer,
    loggers)`` (``trainer`` a :class:`TrainerSubclass` or ``None``; ``loggers`` the Trainer's,
    ``None`` for one that cannot be pickled), followed by the :class:`ImportedState`
    of the classes and modules they refer to by reference, a
    ``codec.Parcel``: it is pickled once on the controller (where a failure is reported before any
    worker starts), and every worker gets its pickle, while its large storages (the weights) leave
    the controller at most once, as ``shipment`` says, and not at all where the workers hold them
    (``worker.storages``).
    """

    fn: str
    payload: Parcel
    ckpt_path: Optional[str]
    #: ``weights_only`` of the Trainer method, for the workers' loads of ``ckpt_path``.
    weights_only: Optional[bool]
    fit_loop_state: dict[str, Any]
    trainer: TrainerConfig
    loggers: list[LoggerIdentity]
    sys_path: tuple[str, ...]
    #: Environment variables to set on the worker; ``None`` unsets one.
    env: dict[str, Optional[str]]
    #: How far the workers may lead, where they wait, what their entries carry (R4-R6).
    run_ahead: RunAhead
    #: Set when new workers replace failed ones: the snapshot they resume from.
    resume: Optional[ResumePoint] = None
    #: How many of the payload's worker callbacks run before the gate callback, at each hook: those
    #: the Trainer lists before its first controller callback (``CallbackPlacement.before_gate``).
    callbacks_before_gate: int = 0
    #: A rehearsal (``controller.features.rehearsal``): every rank records its batch times and memory
    #: (``worker.stats.RehearsalRecorder``), read with its stats.
    rehearsal: bool = False
    #: ``MonarchStrategy(post_mortem=True)``: a hook's exception opens pdb at its frame (``worker.breakpoints``).
    post_mortem: bool = False
    #: Where the controller can answer pdb: the store prefix of the stage's barrier, which holds the
    #: ranks before their gradients' and their strategy's collectives while a rank is in pdb
    #: (``worker.pdb_barrier``).
    pdb_barrier: Optional[str] = None
    #: A checkpoint file's bytes that travel with the stage (a ``Parcel``, as the payload's
    #: storages do), for workers on hosts that may not reach the controller's disk: the workers
    #: resume from it instead of ``ckpt_path`` (an elastic ``fit`` going on from its resume point in
    #: a smaller world, ``controller.features.elastic``).
    checkpoint: Optional[Parcel] = None
    #: How the storages of its parcels that rank 0 does not hold travel (set as it is sent).
    shipment: Shipment = Shipment()
    #: The controller's torch generator as the stage starts (``TorchRngStart``).
    torch_rng: Optional[TorchRngStart] = None
    #: torch's process-wide settings that the user's script changed (``torch_settings``).
    torch_settings: dict[str, Any] = field(default_factory=dict)
    #: The controller's multiprocessing start method, ``None`` where the script set none: the
    #: workers' DataLoaders start their processes as a ddp rank's would, not as Monarch's bootstrap
    #: set (``forkserver``).
    start_method: Optional[str] = None
    #: A ``fit`` with asynchronous validation (``MonarchStrategy(validation="async")``): on the
    #: training mesh, the validation workers (``worker.async_validation.HandOff``); on the
    #: validation mesh, ``serves_validation``.
    validators: Optional[Validators] = None
    serves_validation: bool = False

    def parcels(self) -> list[Parcel]:
        """The parcels the stage opens: the payload, and a checkpoint's bytes where one travels."""
        resumed = self.resume.checkpoint if self.resume is not None else None
        return [parcel for parcel in (self.payload, self.checkpoint, resumed) if isinstance(parcel, Parcel)]


@dataclass(frozen=True)
class Validators:
    """The validation workers of a ``fit`` with asynchronous validation, as its training ranks see
    them: each rank's (``actors[rank]``) takes its checkpoint state at each validation point;
    whether the controller runs ``EarlyStopping``, whose decision the training ranks take at the
    first batch after it (``worker.async_validation``); and how many times the controller replaced
    the validation workers before these (after failed validations)."""

    actors: tuple[Any, ...]
    early_stopping: bool
    generation: int


@dataclass(frozen=True)
class HandedOff:
    """The result of a ``protocol.HANDED_OFF_GATE`` mark: whether every training rank handed its weights
    of validation point ``number`` to its validation worker of ``generation`` (the validation
    workers' count of replacements before them, :class:`Validators`). Where one could not (``taken``
    false: its validation worker died, or its stage ended), the ranks try again on the next
    generation, and the controller makes it if it has not yet."""

    number: int
    generation: int
    taken: bool


def mark_number(result: Any) -> Any:
    """The validation point's number of a mark's ``result``."""
    return result.number if isinstance(result, HandedOff) else result


@dataclass(frozen=True)
class ValidationRequest:
    """What a training rank hands its validation worker at the ``number``-th validation point of a
    ``fit`` with asynchronous validation, for it to validate as the rank itself would have there:
    its checkpoint state (the weights, and the optimizer and scheduler state that a checkpoint
    written at that validation holds), the fit loop's progress (``trainer.fit_loop.state_dict()``),
    the control state, the rank's random generators and the module's plain attributes that training
    changed (``worker.async_validation``)."""

    number: int
    state: CheckpointState
    fit_loop_state: dict[str, Any]
    #: Whether the rank's validation loop resumes from a checkpoint (a ``fit`` resumed from one
    #: written at a validation's end finishes that validation first).
    restarting: bool
    control: dict[str, Any]
    rng: dict[str, Any]
    #: The module's plain attributes that differ from the ``fit``'s start, pickled, by their
    #: module's path and name (``worker.module_attributes``).
    attributes: dict[tuple[str, str], bytes]


@dataclass(frozen=True)
class TorchRngStart:
    """The controller's torch (CPU) generator at a stage's start, for workers that are to take it.

    Under ``ddp`` every rank runs the user's script, and torch seeds each process alike (its default
    seed is a constant), so every rank's generator is the script's: a library that seeds torch
    itself before its ``fit`` (darts's ``random_state``) seeds every rank. A worker takes
    ``state`` where it has run no stage yet, or where the controller's generator ``changed`` since
    the last stage ended (the script drew or seeded between stages); otherwise it keeps its own,
    which the last stage moved on as a rank's (``worker.stage``). ``seed_everything``'s
    ``reset_seed`` in the workers' setup overrides it, as on ``ddp`` ranks. NumPy's and Python's
    generators are seeded from entropy in each process, under ``ddp`` too, and do not travel."""

    state: bytes
    changed: bool


@dataclass(frozen=True)
class WorldSpec:
    """The world a worker joins (``MonarchWorker.join_world``): what it needs to set torchrun's
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) for its place in it. Made by
    ``controller.mesh.world`` when the mesh starts and whenever elastic training changes its hosts."""

    master_addr: str
    master_port: int
    #: Workers per host, and hosts.
    local_world_size: int
    group_world_size: int
    #: The hosts' dimension of the mesh the worker's actor was spawned on (``None`` for one host).
    host_dimension: Optional[str]
    #: The group rank (the host's place in the world) of each host coordinate of that mesh.
    group_ranks: dict[int, int]


@dataclass(frozen=True)
class LoggerIdentity:
    """What one of the controller's loggers answers for its name, version and folders: its copy on
    each worker (``worker.logger``) answers the same, wherever the worker runs."""

    name: Optional[str]
    version: Any
    save_dir: Optional[str]
    log_dir: Optional[str]


@dataclass(frozen=True)
class OptimizerRef:
    """An optimizer the user's ``configure_optimizers`` returned, described for the controller."""

    index: int
    class_name: str
    param_groups: list[dict[str, Any]]
    #: Whether ``step(closure)`` calls the closure exactly once (torch's own optimizers, LBFGS
    #: aside), so the controller knows how often to run its closure without asking.
    single_closure: bool


@dataclass(frozen=True)
class SchedulerRef:
    """An LR scheduler the user's ``configure_optimizers`` returned, described for the controller."""

    optimizer_index: int
    reduce_on_plateau: bool


@dataclass(frozen=True)
class SchedulerConfigRef:
    """One of a Trainer's LR scheduler configs (``trainer.lr_scheduler_configs``), described: how
    Lightning's loop steps its scheduler. Rank 0 sends its configs when they change, as
    ``StochasticWeightAveraging`` changes them on the workers, and the controller's loop follows
    (``controller.loop.mirrors.follow_scheduler_configs``)."""

    optimizer_index: int
    reduce_on_plateau: bool
    interval: str
    frequency: int
    monitor: Optional[str]
    strict: bool
    name: Optional[str]

    @classmethod
    def describe(cls, configs: list[Any], optimizers: list[Any]) -> tuple[SchedulerConfigRef, ...]:
        """``configs`` described, each scheduler's optimizer by its index in ``optimizers``."""
        return tuple(
            cls(
                optimizer_index=next(
                    (index for index, optimizer in enumerate(optimizers) if optimizer is config.scheduler.optimizer), -1
                ),
                **{name: getattr(config, name) for name in _SCHEDULER_CONFIG_FIELDS},
            )
            for config in configs
        )

    def settings(self) -> dict[str, Any]:
        """The config's fields besides its scheduler, as ``LRSchedulerConfig`` takes them."""
        return {name: getattr(self, name) for name in _SCHEDULER_CONFIG_FIELDS}


#: The fields of Lightning's ``LRSchedulerConfig`` that :class:`SchedulerConfigRef` carries.
_SCHEDULER_CONFIG_FIELDS = ("reduce_on_plateau", "interval", "frequency", "monitor", "strict", "name")


@dataclass(frozen=True)
class LoaderRef:
    """A dataloader that a ``*_dataloader`` hook returned; the controller iterates batch indices."""

    batch_size: Optional[int]

    @classmethod
    def describe(cls, loaders: Any) -> Any:
        """The same tree as ``loaders`` (a loader, or lists/dicts of them) with each loader described."""
        return tree_map(lambda loader: cls(batch_size=getattr(loader, "batch_size", None)), loaders)
