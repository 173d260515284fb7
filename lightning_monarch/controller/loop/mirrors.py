"""Light stand-ins on the controller for objects that live on the workers.

Runs on the controller. Lightning's loop on the controller needs optimizers, LR schedulers and
dataloaders to exist; these mirrors give it what it reads (hyperparameters for
``LearningRateMonitor``, lengths for the loop) and never hold parameters, gradients or samples.
The controller's module and datamodule skip the hooks that ran on the workers outside a stage's
gates (a failed stage's ``on_exception``, the ``teardown`` after ``Tuner.lr_find``'s exit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional, cast

import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from typing_extensions import override

from lightning_monarch._compat.torch import tree_flatten, tree_unflatten
from lightning_monarch.wire.gates import install_hook_gates
from lightning_monarch.wire.protocol import GATES, OMITTED
from lightning_monarch.wire.reports import CheckpointState
from lightning_monarch.wire.specs import LoaderRef, OptimizerRef, SchedulerConfigRef, SchedulerRef

StateSource = Callable[[], CheckpointState]


class OptimizerMirror(torch.optim.Optimizer):
    """Runs on the controller: a worker optimizer's param groups, without parameters.

    ``step(closure)`` runs the controller's closure as many times as the worker ran the real one,
    so the controller's Lightning loop goes through the same hooks (R7). Subclasses named after
    the worker's optimizer class are made per class, so loggers see ``lr-Adam`` as under DDP.
    """

    def __init__(self, ref: OptimizerRef, closure_runs: Callable[[], int]) -> None:
        super().__init__([{**group, "params": [_placeholder()]} for group in ref.param_groups], defaults={})
        self._closure_runs = closure_runs
        self.single_closure = ref.single_closure

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """The workers zero their gradients; the placeholders keep theirs, so that Lightning's
        gradient clipping on the controller has something (zero) to clip."""

    @override
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            for _ in range(self._closure_runs()):
                loss = closure()
        return loss

    def update_hyperparameters(self, param_groups: list[dict[str, Any]]) -> None:
        """Take the worker's current hyperparameters (learning rate, momentum...), and its new
        param groups (``BaseFinetuning`` adds one when it unfreezes a backbone)."""
        for group, values in zip(self.param_groups, param_groups, strict=False):
            group.update(values)
        for values in param_groups[len(self.param_groups) :]:
            self.add_param_group({**values, "params": [_placeholder()]})


def _placeholder() -> torch.Tensor:
    """A parameter with a zero gradient: the controller's optimizers hold nothing real."""
    parameter = torch.zeros(())
    parameter.grad = torch.zeros(())
    return parameter


class _SchedulerState(LRScheduler):
    """A scheduler mirror's link to the worker scheduler's state, for checkpoints. Its ``__init__``
    does not call ``LRScheduler``'s: a mirror steps nothing."""

    def __init__(self, optimizer: OptimizerMirror, index: int, state: StateSource) -> None:
        self.optimizer = optimizer
        self._index = index
        self._state = state

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._state().lr_schedulers[self._index]

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The workers load scheduler state themselves; the mirror has none to load."""

    @override
    def step(self, *args: Any, **kwargs: Any) -> None:
        """The workers step their schedulers in ``lr_scheduler_step``; the mirror follows their lr."""


class SchedulerMirror(_SchedulerState, LRScheduler):
    """Runs on the controller: stands in for a worker's ``LRScheduler``."""


class PlateauMirror(_SchedulerState, ReduceLROnPlateau):
    """Runs on the controller: stands in for a worker's ``ReduceLROnPlateau``."""


class GradScalerMirror(torch.amp.GradScaler):
    """Runs on the controller: stands in for the workers' gradient scaler under ``precision="16-mixed"``.

    It is disabled, so the controller's loop scales, unscales and steps nothing of its own (its
    optimizers hold no gradients) and probes no GPU. A checkpoint takes rank 0's scaler state,
    its scale and growth tracker, as DDP's rank 0 writes it; on resume the workers load it
    themselves from the checkpoint file.
    """

    def __init__(self, state: StateSource) -> None:
        super().__init__("cuda", enabled=False)
        self._state = state

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._state().precision

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The workers load their scaler's state themselves."""


class WorkerLoaders:
    """Runs on the controller: what it knows of the workers' dataloaders, from rank 0's entries.

    Each worker shards its data with a ``DistributedSampler``, so lengths are known only after the
    workers have built their loaders; an entry carries them as rank 0 read them on arriving at its
    gate, and the controller's loop, which asks between gates, looks ahead at the next entry
    (``peek``). A loader without a length (an ``IterableDataset``) ends when rank 0's data fetcher
    finds it exhausted: the controller's fetcher asks for batch ``i`` where the workers' did.
    """

    def __init__(self, peek: Callable[[], None]) -> None:
        self._peek = peek
        self._lengths: dict[str, list[Optional[int]]] = {}
        self._fetched: dict[str, int] = {}
        #: Stages whose loaders the workers rebuilt: their lengths are the next entry's.
        self._stale: set[str] = set()

    def update(self, lengths: Optional[dict[str, list[Optional[int]]]], fetched: Optional[dict[str, int]]) -> None:
        """What an entry says of the loaders (``None``: unchanged since the last entry that said)."""
        self._lengths.update(lengths or {})
        self._fetched.update(fetched or {})

    def invalidate(self, stage: str) -> None:
        """The workers are building new ``stage`` loaders: their lengths are those rank 0 reads on
        arriving at its next gate."""
        self._stale.add(stage)

    def length(self, stage: str, index: int) -> Optional[int]:
        if stage in self._stale or stage not in self._lengths:
            self._peek()
            self._stale.discard(stage)
        return self._lengths[stage][index]

    def start_epoch(self, stage: str) -> None:
        """A new pass over the ``stage`` loaders begins; forget how far the last one got."""
        self._fetched.pop(stage, None)

    def has_batch(self, stage: str, batch: int) -> bool:
        """Whether rank 0 fetched batch ``batch`` of its ``stage`` loader in this pass."""
        if self._fetched.get(stage, 0) <= batch:
            self._peek()
        return self._fetched.get(stage, 0) > batch


class PlanLoader:
    """Runs on the controller: stands in for one worker dataloader and yields batch indices.

    The controller never sees samples; its loop steps through batch indices while each worker
    loads its own shard of the batch with the same index.
    """

    def __init__(self, stage: str, index: int, loaders: WorkerLoaders, batch_size: Optional[int]) -> None:
        self.stage = stage
        self.index = index
        self.batch_size = batch_size
        self._loaders = loaders

    def __len__(self) -> int:
        length = self._loaders.length(self.stage, self.index)
        if length is None:
            raise TypeError(f"The workers' {self.stage} dataloader #{self.index} has no length.")
        return length

    def __iter__(self) -> Iterator[int]:
        length = self._loaders.length(self.stage, self.index)
        if length is not None:
            return iter(range(length))
        self._loaders.start_epoch(self.stage)
        return self._while_workers_fetch()

    def _while_workers_fetch(self) -> Iterator[int]:
        batch = 0
        while self._loaders.has_batch(self.stage, batch):
            yield batch
            batch += 1


def plan_loaders(description: Any, stage: str, loaders: WorkerLoaders) -> Any:
    """Mirror a ``*_dataloader`` result (a tree of :class:`LoaderRef`) with :class:`PlanLoader`s."""
    refs, spec = tree_flatten(description)
    loaders.invalidate(stage)
    plans = [
        PlanLoader(stage, index, loaders, ref.batch_size if isinstance(ref, LoaderRef) else None)
        for index, ref in enumerate(refs)
    ]
    return tree_unflatten(plans, spec)


def follow_optimizers(
    trainer: Trainer,
    param_groups: Optional[list[list[dict[str, Any]]]],
    configs: Optional[tuple[SchedulerConfigRef, ...]],
    state: StateSource,
) -> None:
    """The optimizer and LR scheduler mirrors after one of rank 0's entries: its optimizers'
    ``param_groups`` hyperparameters, and its scheduler ``configs`` (each ``None`` where the entry
    carries none). Where a callback replaced rank 0's configs (``StochasticWeightAveraging`` swaps
    in its ``SWALR``), the controller's loop takes mirrors of the new ones, each standing for rank
    0's scheduler at its place in the list, and steps them as rank 0 steps its own."""
    optimizers = cast(list[OptimizerMirror], trainer.optimizers)
    for mirror, groups in zip(optimizers, param_groups or (), strict=False):
        if isinstance(mirror, OptimizerMirror):  # not Lightning's stand-in when there is no optimizer
            mirror.update_hyperparameters(groups)
    if configs is None or SchedulerConfigRef.describe(trainer.lr_scheduler_configs, optimizers) == configs:
        return
    trainer.strategy.lr_scheduler_configs = [
        LRSchedulerConfig(
            (PlateauMirror if ref.reduce_on_plateau else SchedulerMirror)(
                optimizers[ref.optimizer_index], index, state
            ),
            **ref.settings(),
        )
        for index, ref in enumerate(configs)
    ]


def optimizer_mirrors(description: Any, closure_runs: Callable[[], int], state: StateSource) -> Any:
    """Mirror a ``configure_optimizers`` result described by the workers (``worker.describe``),
    keeping its shape: every optimizer first, since a scheduler may come before its optimizer."""
    refs, spec = tree_flatten(description)
    optimizers: dict[int, OptimizerMirror] = {}
    for ref in refs:
        if isinstance(ref, OptimizerRef) and ref.index not in optimizers:
            cls = type(ref.class_name, (OptimizerMirror,), {"__module__": __name__})
            optimizers[ref.index] = cls(ref, closure_runs)
    schedulers: list[_SchedulerState] = []

    def mirror(ref: Any) -> Any:
        if isinstance(ref, OptimizerRef):
            return optimizers[ref.index]
        if isinstance(ref, SchedulerRef):
            cls = PlateauMirror if ref.reduce_on_plateau else SchedulerMirror
            schedulers.append(cls(optimizers[ref.optimizer_index], len(schedulers), state))
            return schedulers[-1]
        return ref

    return tree_unflatten([mirror(ref) for ref in refs], spec)


def _skip(gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """The datamodule's ``on_exception`` ran on the worker that failed; it must not run here too."""


def skip_teardown_once(*objects: Any) -> None:
    """Let the next ``teardown`` of each of ``objects`` (the module, the datamodule) do nothing: it
    ran on the workers, where they were set up, and the controller's mirrors hold nothing to tear
    down. For the teardown that Lightning's handler of ``Tuner.lr_find``'s exit runs, outside the
    stage's gates."""
    for obj in objects:
        if obj is not None:
            undo: list[Callable[[], None]] = []
            undo.append(install_hook_gates(obj, "controller", ["teardown"], lambda *args, undo=undo: undo[0]()))


def silence_on_exception(datamodule: Optional[LightningDataModule]) -> Optional[Callable[[], None]]:
    """Let the controller's ``datamodule`` skip ``on_exception`` until the returned undo is called:
    a stage's failure ran it on the worker that failed. ``None`` without a datamodule."""
    if datamodule is None:
        return None
    return install_hook_gates(datamodule, "controller", ["on_exception"], _skip)


def pending_loss() -> torch.Tensor:
    """The loss of a training step whose outputs no controller callback reads (R6): the controller's
    loop needs one to go through backward as the workers did."""
    return torch.zeros((), requires_grad=True)


def trainable(output: Any) -> Any:
    """A training step's loss as the controller's loop needs it: a leaf that accepts ``backward``.

    The real backward ran on the workers; the controller's loop still calls ``backward`` on the
    value it got, which must not fail.
    """
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output.requires_grad_()
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": trainable(output["loss"])}
    return output


def stand_in(
    gate: str, value: Any, closure_runs: Callable[[], int], checkpoint_state: StateSource, loaders: WorkerLoaders
) -> Any:
    """What the controller's loop takes for the result rank 0 recorded of ``gate`` (R7): a training
    step's loss that accepts ``backward`` (or a placeholder), an evaluation step's outputs, mirrors of
    the optimizers (``closure_runs``: how often the workers ran the closure; ``checkpoint_state``:
    rank 0's state), plan loaders of the dataloaders (``loaders``: their lengths), or ``value``."""
    kind, hook = GATES[gate].result, gate.split(".", 1)[1]
    if kind == "outputs" and hook == "training_step":
        return pending_loss() if value is OMITTED else trainable(value)
    if kind == "outputs":
        return None if value is OMITTED else value
    if kind == "optimizers":
        return optimizer_mirrors(value, closure_runs, checkpoint_state)
    if kind == "loaders":
        return plan_loaders(value, hook.split("_", 1)[0], loaders)
    return value
