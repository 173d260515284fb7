"""Turns the results of worker hooks into what the controller needs of them.

Runs in each worker. Step outputs travel as detached CPU tensors; optimizers, schedulers and
dataloaders cannot leave the worker, so they travel as descriptions (``OptimizerRef``,
``SchedulerRef``, ``LoaderRef``) that the controller turns into light mirrors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning_utilities.core.apply_func import apply_to_collection
from torch.optim import Optimizer

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch._compat import loops as loops_compat
from lightning_monarch._compat.torch import tree_map
from lightning_monarch.wire.protocol import GATES, OMITTED, RunAhead
from lightning_monarch.wire.reports import PredictionShard
from lightning_monarch.wire.specs import LoaderRef, OptimizerRef, SchedulerRef


def to_cpu(value: Any) -> Any:
    """Every tensor in ``value`` detached and on the CPU (a tensor already there is not copied)."""
    return apply_to_collection(value, torch.Tensor, lambda t: t.detach().cpu())


def cpu_copy(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor a detached CPU copy, copied once: nothing in it
    changes as training goes on (a staged checkpoint state, R6)."""
    copies: dict[int, Any] = {}

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        copied = tensor.detach().to("cpu", copy=True)
        copies[id(copied)] = copied
        return copied

    return copy.deepcopy(apply_to_collection(value, torch.Tensor, copy_tensor), memo=copies)


def describe_result(gate: str, result: Any, trainer: Trainer, args: tuple, plan: RunAhead) -> Any:
    """What the controller receives of the result of gate ``gate``, by the gate table's ``result``
    kind (``protocol.GATES``): a step's outputs only where the plan says a controller callback may
    read them (else ``OMITTED``, for which the controller puts a placeholder loss), detached on the CPU."""
    kind = GATES[gate].result
    if kind == "outputs":
        return to_cpu(result) if gate in plan.outputs or result is None else OMITTED
    if kind == "prediction":
        batch_idx = args[1]
        dataloader_idx = args[2] if len(args) > 2 else 0
        return PredictionShard(
            output=to_cpu(result),
            batch_indices=loops_compat.predict_batch_indices(trainer, batch_idx, dataloader_idx),
            dataloader_idx=dataloader_idx,
        )
    if kind == "optimizers":
        return _describe_optimizers(result)
    if kind == "loaders":
        return LoaderRef.describe(result)
    return result


def worker_side_result(gate: str, result: Any) -> Any:
    """What the worker's own Trainer receives: callbacks from ``configure_callbacks`` run on the
    controller only, so the worker's Trainer gets none of them."""
    if gate == "module.configure_callbacks":
        return []
    return result


def _describe_optimizers(value: Any) -> Any:
    """The same tree as a ``configure_optimizers`` result with each optimizer and LR scheduler
    described; optimizers are numbered in the order they first appear, scheduler or not."""
    optimizers: dict[int, int] = {}

    def optimizer_index(optimizer: Optimizer) -> int:
        return optimizers.setdefault(id(optimizer), len(optimizers))

    def describe(item: Any) -> Any:
        if isinstance(item, Optimizer):
            return OptimizerRef(
                index=optimizer_index(item),
                class_name=type(item).__name__,
                param_groups=param_group_hyperparameters(item),
                single_closure=_calls_closure_once(item),
            )
        if isinstance(item, lightning_compat.LR_SCHEDULER_TYPES):
            return SchedulerRef(
                optimizer_index=optimizer_index(item.optimizer),
                reduce_on_plateau=isinstance(item, torch.optim.lr_scheduler.ReduceLROnPlateau),
            )
        return item

    return tree_map(describe, value)


def _calls_closure_once(optimizer: Optimizer) -> bool:
    step = type(optimizer).step
    return getattr(step, "__module__", "").startswith("torch.optim.") and not isinstance(optimizer, torch.optim.LBFGS)


def param_group_hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each param group of ``optimizer`` without its parameters: what ``LearningRateMonitor`` reads."""
    return [to_cpu({key: value for key, value in group.items() if key != "params"}) for group in optimizer.param_groups]
