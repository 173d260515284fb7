"""The messages the controller and the workers exchange, and the hook names both sides gate on.

Both sides import this module; nothing here talks to a mesh or runs a hook.

How the two sides stay in step (the lockstep invariants, cited elsewhere as L1-L5):

L1. The controller runs Lightning's real loop for the stage; every worker runs Lightning's real
    ``Trainer`` for the same stage with ``DDPStrategy`` (``ModelParallelStrategy`` when sharded) on
    a loop thread. Both sides see the same flags and the same dataloader lengths, so both loops
    reach the same hooks in the same order.
L2. A *gate* is a top-level call of a hook in :data:`MODULE_HOOKS`, :data:`DATAMODULE_HOOKS` or
    :data:`CALLBACK_HOOKS`. Hooks called while another gated hook runs are *nested* and never gate.
L3. At each gate the controller sends one :class:`Advance`. A worker runs up to that gate, checks
    that it reached the same hook, runs it, and parks right after it. The work between two gates
    (Lightning's own bookkeeping) runs only when the next ``Advance`` arrives, so a worker never
    acts on control state (:data:`CONTROL_STATE`) older than the controller's own decision. An
    ``Advance`` carries only the control state the controller changed, so a change made by user
    code on a worker is never overwritten before the controller has seen it.
L4. Messages to one worker arrive in order. An ``Advance`` that the controller does not wait on is
    a fire-and-forget broadcast; its effects (logged values, logger calls) travel with the next
    reply that the controller waits for, and the workers describe no result for it. A training
    batch's ``optimizer_step`` is one of them when only the step's outputs would come back (see
    ``StageSession``), and so is ``training_step`` while gradients accumulate: the controller's loop
    goes on with a placeholder loss and the workers compute meanwhile. The real outputs arrive
    with the callbacks' ``on_train_batch_end`` when a controller callback overrides it, before it
    reads them; the batch's reply otherwise comes at the module's ``on_train_batch_end``. At least
    one reply per training batch arrives before the controller decides whether to go on.
L5. User hooks run on the workers only. The controller runs only Lightning's base implementation
    of a hook, fed with what the workers returned.
"""

from __future__ import annotations

import socket
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from torch.utils._pytree import tree_map

#: Hooks that both a ``LightningModule`` and a ``Callback`` have (the callback's take the Trainer
#: and the module first).
_SHARED_HOOKS: tuple[str, ...] = tuple(
    f"on_{event}"
    for stage in ("fit", "train", "validation", "test", "predict")
    for event in (f"{stage}_start", f"{stage}_end")
) + tuple(
    f"on_{stage}_{scope}_{event}"
    for stage in ("train", "validation", "test", "predict")
    for scope in ("epoch", "batch")
    for event in ("start", "end")
) + ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")

#: Hooks of a ``LightningDataModule`` that gate (L2); a ``LightningModule`` has them too.
DATAMODULE_HOOKS: tuple[str, ...] = (
    "prepare_data",
    "setup",
    "teardown",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
)

#: Hooks of a ``LightningModule`` that gate (L2). ``on_save_checkpoint`` is absent: the controller
#: calls it while it writes a checkpoint, which the workers never do, so it runs out of band.
MODULE_HOOKS: tuple[str, ...] = DATAMODULE_HOOKS + _SHARED_HOOKS + (
    "configure_callbacks",
    "configure_model",
    "configure_sharded_model",
    "configure_optimizers",
    "on_validation_model_zero_grad",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_test_model_eval",
    "on_test_model_train",
    "on_predict_model_eval",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "optimizer_zero_grad",
    "backward",
    "configure_gradient_clipping",
    "optimizer_step",
    "lr_scheduler_step",
    "on_load_checkpoint",
)

#: Callback hooks that gate (L2). Checkpoint hooks and ``on_exception`` are absent: the first run
#: out of band, the second runs on each side's own failure path.
CALLBACK_HOOKS: tuple[str, ...] = ("setup", "teardown", "on_sanity_check_start", "on_sanity_check_end") + _SHARED_HOOKS

#: Gates whose worker result the controller uses instead of running Lightning's base
#: implementation (L5). Every other gate returns the base implementation's value.
RESULT_HOOKS: frozenset[str] = frozenset(
    {
        "module.training_step",
        "module.validation_step",
        "module.test_step",
        "module.predict_step",
        "module.on_train_batch_start",
        "module.configure_optimizers",
        "module.configure_callbacks",
        "module.train_dataloader",
        "module.val_dataloader",
        "module.test_dataloader",
        "module.predict_dataloader",
        "datamodule.train_dataloader",
        "datamodule.val_dataloader",
        "datamodule.test_dataloader",
        "datamodule.predict_dataloader",
    }
)

#: Gates that Lightning calls on some ranks only (``prepare_data`` runs on local rank 0). A worker
#: that does not reach one answers :class:`Advance` for it with a skip.
RANK_LOCAL_HOOKS: frozenset[str] = frozenset({"module.prepare_data", "datamodule.prepare_data"})


#: Trainer attributes that steer the loop and that callbacks or module code may change: each
#: ``Advance`` carries the controller's values and each reply rank 0's (L3). EarlyStopping sets
#: ``should_stop``; GradientAccumulationScheduler sets ``accumulate_grad_batches``.
CONTROL_STATE: tuple[str, ...] = ("should_stop", "accumulate_grad_batches")


def versions() -> dict[str, Optional[str]]:
    """This process's torch, Lightning, CUDA and HIP versions: the controller's and every
    worker's must agree."""
    import lightning
    import torch

    return {"torch": torch.__version__, "lightning": lightning.__version__, "cuda": torch.version.cuda,
            "hip": torch.version.hip}


def worker_backend(accelerator: str, chosen: Optional[str]) -> str:
    """The workers' ``torch.distributed`` backend: the one chosen, else what Lightning's DDP picks
    (``nccl`` on GPUs, which is RCCL on a ROCm build of torch; ``gloo`` on CPUs)."""
    return chosen or ("nccl" if accelerator == "cuda" else "gloo")


#: The gate where a training stage is snapshotted for recovery: the start of a training epoch,
#: the boundary from which Lightning resumes a checkpoint exactly (it cannot resume mid-epoch at
#: an exact batch). The snapshot is read while the workers are parked right after this gate.
SNAPSHOT_GATE = "callback.on_train_epoch_start"

#: The Trainer properties holding metrics that the controller's Trainer shows from rank 0.
METRIC_VIEWS: tuple[str, ...] = ("callback_metrics", "progress_bar_metrics", "logged_metrics")


def control_state(trainer: Any) -> dict[str, Any]:
    """The :data:`CONTROL_STATE` of ``trainer``."""
    return {name: getattr(trainer, name) for name in CONTROL_STATE}


def gate_id(owner: str, hook: str) -> str:
    """The name of a gate on the wire: ``"module.training_step"``, ``"callback.on_fit_start"``."""
    return f"{owner}.{hook}"


@dataclass(frozen=True)
class ShardingSpec:
    """How the workers shard the module under ``MonarchStrategy(parallelism="fsdp")``: with
    FSDP2's ``fully_shard``, each instance of the ``policy`` module classes, then the root module,
    after the module's own ``configure_model`` (which may shard it itself; see ``worker.sharding``).
    The options apply to the ``fully_shard`` calls the workers make, not to the module's own."""

    policy: tuple[type, ...] = ()
    #: FSDP2's ``MixedPrecisionPolicy`` (a param and a reduce dtype), or ``None`` for none.
    mixed_precision: Optional[Any] = None
    #: Module classes whose every instance recomputes its activations in the backward pass.
    activation_checkpointing: tuple[type, ...] = ()
    #: Keep the sharded parameters (and so their gradients and optimizer state) on the CPU.
    cpu_offload: bool = False

    def no_match_warning(self) -> str:
        """The warning for a policy that names no class of the module's submodules."""
        names = ", ".join(cls.__name__ for cls in self.policy)
        return (
            f"`MonarchStrategy(parallelism='fsdp', fsdp_policy={{{names}}})`: the module has no submodule of these"
            " classes, so FSDP2 shards it as one unit (the root module) and every step gathers all of its"
            " parameters at once. Name the classes of its repeated blocks (e.g. its transformer layers) in"
            " `fsdp_policy`."
        )


@dataclass(frozen=True)
class TrainerConfig:
    """The controller Trainer's flags that a worker's Trainer must share so both loops agree (L1)."""

    accelerator: str
    devices: int
    num_nodes: int
    precision: str
    process_group_backend: Optional[str]
    flags: dict[str, Any]
    ddp_kwargs: dict[str, Any]
    #: ``None``: a DDP replica per worker; else the module is sharded with FSDP2.
    sharding: Optional[ShardingSpec] = None


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


@dataclass(frozen=True)
class WorkerReport:
    """One worker's answer to a :class:`PreflightSpec`: where it runs, what it sees, how fast its
    all-reduce was, every problem found (empty when all is well) and every warning."""

    rank: int
    host: str
    pid: int
    device: str
    device_memory_gib: Optional[float]
    versions: dict[str, Optional[str]]
    visible_devices: dict[str, str]
    all_reduce_s: Optional[float]
    problems: list[str]
    #: Settings known to cause hangs (RCCL's, on ROCm); reported, not fatal.
    warnings: list[str]


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

    ``checkpoint`` is rank 0's Lightning checkpoint (``torch.save`` bytes) under ``ddp``, and under
    ``parallelism="fsdp"`` the path of the sharded checkpoint directory that every rank wrote its
    shards into (``controller.checkpoints.SnapshotDirectory``)."""

    checkpoint: Union[bytes, str]
    ranks: tuple[RankSnapshot, ...]


@dataclass(frozen=True)
class StageSpec:
    """Everything a worker needs to run one Trainer stage: sent once per stage.

    ``fit_loop_state`` is the controller's ``trainer.fit_loop.state_dict()``: a Trainer that ran
    ``fit`` before carries its epoch and step into later stages, and so must each worker's.
    ``payload`` is the cloudpickled ``(module, datamodule, dataloaders, worker_callbacks)``; it is
    pickled once on the controller (where a failure is reported before any worker starts) and
    sent as raw bytes, which Monarch moves faster than pickled tensors.
    """

    fn: str
    payload: bytes
    ckpt_path: Optional[str]
    fit_loop_state: dict[str, Any]
    trainer: TrainerConfig
    loggers: list["LoggerIdentity"]
    sys_path: tuple[str, ...]
    #: Environment variables to set on the worker; ``None`` unsets one.
    env: dict[str, Optional[str]]
    #: Set when new workers replace failed ones: the snapshot they resume from.
    resume: Optional[ResumePoint] = None


@dataclass(frozen=True)
class LoggerIdentity:
    """What module code on a worker sees of one of the controller's loggers (``self.logger.name``)."""

    name: Optional[str]
    version: Any
    save_dir: Optional[str]
    log_dir: Optional[str]


@dataclass(frozen=True)
class LoggerCall:
    """A call rank 0 made on its stand-in for the controller's logger number ``logger_index``.

    ``method`` is ``"log_metrics"``, ``"log_hyperparams"`` or ``"experiment.<name>"`` for module
    code's ``self.logger.experiment.<name>(...)``.
    """

    logger_index: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Advance:
    """Run up to gate ``hook``, run it, park after it (L3). Carries the control state the
    controller changed since the last reply it took."""

    hook: str
    control: dict[str, Any]
    wait: bool


@dataclass(frozen=True)
class Peek:
    """Run Lightning's bookkeeping up to the next gate without running it; report loader lengths."""


@dataclass(frozen=True)
class Finish:
    """Run the rest of the stage; no gate may follow."""


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

    class_name: str
    optimizer_index: int
    reduce_on_plateau: bool


@dataclass(frozen=True)
class LoaderRef:
    """A dataloader that a ``*_dataloader`` hook returned; the controller iterates batch indices."""

    batch_size: Optional[int]

    @classmethod
    def describe(cls, loaders: Any) -> Any:
        """The same tree as ``loaders`` (a loader, or lists/dicts of them) with each loader described."""
        return tree_map(lambda loader: cls(batch_size=getattr(loader, "batch_size", None)), loaders)


@dataclass(frozen=True)
class PredictionShard:
    """One rank's ``predict_step`` output for one batch, with the dataset indices of its samples."""

    output: Any
    batch_indices: list[int]
    dataloader_idx: int


@dataclass(frozen=True)
class WorkerFailure:
    """An exception raised on a worker, with where it happened and the remote traceback."""

    rank: int
    host: str
    hook: Optional[str]
    exception_type: str
    message: str
    traceback: str

    @classmethod
    def capture(cls, error: BaseException, rank: int, hook: Optional[str]) -> "WorkerFailure":
        """Describe ``error``, raised on this host at rank ``rank`` in ``hook``, with its traceback."""
        return cls(
            rank=rank,
            host=socket.gethostname(),
            hook=hook,
            exception_type=type(error).__name__,
            message=str(error),
            traceback="".join(traceback.format_exception(error)),
        )


@dataclass
class WorkerReply:
    """A worker's answer to an :class:`Advance`, :class:`Peek` or :class:`Finish`.

    Rank 0 fills the state fields (logger calls, optimizer hyperparameters, manual optimization's
    step count, the values that ``update_eval_epoch_metrics`` returned) in every reply the
    controller waits on, and dataloader lengths and fetch counts in a ``Peek``'s reply; other
    ranks send only what is per-rank (the ``result`` of ``predict_step``, a failure).
    """

    rank: int
    hook: Optional[str] = None
    result: Any = None
    nested: list[tuple[str, Any]] = field(default_factory=list)
    control: dict[str, Any] = field(default_factory=dict)
    logger_calls: list[LoggerCall] = field(default_factory=list)
    param_groups: Optional[list[list[dict[str, Any]]]] = None
    manual_steps: Optional[dict[str, Any]] = None
    eval_outputs: list[dict[str, Any]] = field(default_factory=list)
    loader_lengths: Optional[dict[str, list[Optional[int]]]] = None
    fetched_batches: Optional[dict[str, int]] = None
    skipped: bool = False
    failure: Optional[WorkerFailure] = None


@dataclass(frozen=True)
class CheckpointState:
    """Rank 0's model, optimizer, LR-scheduler, worker-callback and precision-plugin state (the
    gradient scaler's under ``precision="16-mixed"``), for a checkpoint or the end of a stage."""

    model: dict[str, Any]
    optimizers: list[dict[str, Any]]
    lr_schedulers: list[dict[str, Any]]
    callbacks: dict[str, Any]
    precision: dict[str, Any]


@dataclass(frozen=True)
class RankValue:
    """One rank's value of something every rank has (a metric), for the controller to compare."""

    rank: int
    value: Any


@dataclass(frozen=True)
class ModuleAttributes:
    """A rank's module's public Python attributes that can travel, and for every other one why it
    cannot (its pickling error)."""

    values: dict[str, Any]
    dropped: dict[str, str]


@dataclass(frozen=True)
class RankStats:
    """One worker's answer to a stats read for ``MeshStatsMonitor`` (see ``worker.stats``), taken
    where its loop is parked: named values with their unit in the name (``rss_mib``,
    ``step_time_ms``, ...), and, once per worker process, why a GPU tool gives nothing (``None``
    when nothing is missing)."""

    rank: int
    values: dict[str, float]
    missing: Optional[str] = None
