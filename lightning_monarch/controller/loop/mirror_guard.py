"""A controller callback that touches the module mirror's tensors raises at that moment.

Runs on the controller, around the hooks of its callbacks (``controller.loop.attribution``). The
controller's module and optimizers are mirrors (``controller.loop.mirrors``): their tensors hold
neither the workers' live weights nor their gradients, so a callback that reads them there would
see other values than each ``ddp`` rank sees, and one that writes them would change nothing the
workers train. Rather than let either pass silently, a hook that gives one of those tensors to a
torch function, or changes an optimizer's hyperparameters, raises ``DivergenceError`` naming the
callback, the hook and the fix: run it on the workers (``lightning_monarch.on_workers``), as every
``ddp`` rank runs it. Reading a tensor's shape or size stays allowed: the mirror has the workers'.
Lightning's own controller callbacks, which never touch the weights, are not guarded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    Checkpoint,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelSummary,
    ProgressBar,
    Timer,
)
from torch.overrides import TorchFunctionMode

from lightning_monarch.errors import DivergenceError

#: Lightning's controller callbacks, which read metrics, steer the loop, write files from the state
#: the workers give, or draw, and never touch the weights: their hooks run unguarded.
_UNGUARDED = (
    Checkpoint,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelSummary,
    ProgressBar,
    Timer,
)

#: What a callback may ask of a mirror's tensor: its shape, which is the workers'.
_SHAPE = {
    getattr(torch.Tensor.shape, "__get__"),  # noqa: B009 - the getter of a property, as torch passes it
    torch.Tensor.size,
    torch.Tensor.dim,
    getattr(torch.Tensor.ndim, "__get__"),  # noqa: B009
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.__hash__,
}


def is_guarded(callback: Callback) -> bool:
    """Whether ``callback``'s hooks run under :class:`MirrorGuard` on the controller."""
    return not isinstance(callback, _UNGUARDED) and not type(callback).__module__.startswith("lightning_monarch")


class MirrorGuard:
    """Runs on the controller, one per stage: guards the hooks of the controller's callbacks
    against the module mirror's parameters and buffers, the optimizer mirrors' placeholder
    parameters and their hyperparameters."""

    def __init__(self, trainer: Trainer, module: LightningModule) -> None:
        self._trainer = trainer
        self._module = module

    @contextmanager
    def guarding(self, callback: Callback, hook: str) -> Iterator[None]:
        """Run ``callback``'s ``hook`` with the mirrors guarded; raise if it touched them."""
        tensors = {id(tensor): name for name, tensor in self._tensors()}
        groups = self._hyperparameters()
        with _Refusal(tensors, lambda touched: self._refuse(callback, hook, touched)):
            yield
        changed = [
            f"`{name}`"
            for before, after in zip(groups, self._hyperparameters(), strict=False)
            for name in after
            if not _same(before.get(name), after[name])
        ]
        if changed:
            self._refuse(callback, hook, f"the optimizer's {', '.join(sorted(set(changed)))}", writes=True)

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._module.named_parameters()
        yield from self._module.named_buffers()
        for index, optimizer in enumerate(self._trainer.optimizers):
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    yield f"trainer.optimizers[{index}]'s parameters", parameter

    def _hyperparameters(self) -> list[dict[str, Any]]:
        return [
            {name: value for name, value in group.items() if name != "params"}
            for optimizer in self._trainer.optimizers
            for group in optimizer.param_groups
        ]

    def _refuse(self, callback: Callback, hook: str, touched: str, writes: bool = False) -> None:
        name = type(callback).__name__
        effect = (
            "what it writes there never reaches the workers"
            if writes
            else "what it reads there is not what each ddp rank holds, and what it writes never reaches the workers"
        )
        raise DivergenceError(
            f"`{name}.{hook}` touched {touched} on the controller under strategy='monarch', whose module and"
            f" optimizers are mirrors without the workers' live weights and gradients: {effect}. Run it on the"
            f" workers, as each ddp rank runs it: `Trainer(callbacks=[lightning_monarch.on_workers({name}(...))])`."
        )


class _Refusal(TorchFunctionMode):
    """Calls ``refuse`` with what was touched when a torch function gets one of ``tensors``."""

    def __init__(self, tensors: dict[int, str], refuse: Callable[[str], None]) -> None:
        super().__init__()
        self._tensors = tensors
        self._refuse = refuse

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SHAPE:
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(tensor, torch.Tensor) and id(tensor) in self._tensors:
                        self._refuse(f"`{self._tensors[id(tensor)]}` (`{_function_name(func)}`)")
        return func(*args, **kwargs)


def _same(before: Any, after: Any) -> bool:
    """Whether a hyperparameter kept its value (a tensor, its object)."""
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        return before is after
    return bool(before == after)


def _function_name(func: Any) -> str:
    """``mul_``, or ``data`` for an attribute's getter or setter."""
    owner = getattr(func, "__self__", None)
    if func.__name__ in ("__get__", "__set__") and owner is not None:
        return owner.__name__
    return func.__name__
