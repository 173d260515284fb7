"""Gate installation that both sides share: the same hooks must gate on the controller and on
every worker (R2 in :mod:`lightning_monarch.wire.protocol`), so both build their gates here.

A gate wraps a hook so that calling it goes through an ``around(gate, fn, args, kwargs)``
function: on a worker that function runs the hook and records an entry for the controller; on the
controller it takes that entry instead. The wrappers keep ``__wrapped__``, so Lightning's
``is_overridden`` sees the user's code.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Optional

from lightning.pytorch import Callback, LightningDataModule
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_monarch.wire.protocol import CALLBACK_HOOKS, GATES, gate_id

_ABSENT = object()

#: ``around(gate, fn, args, kwargs)``: runs ``fn(*args, **kwargs)`` at gate ``gate``.
Around = Callable[[str, Callable[..., Any], tuple, dict], Any]


def datamodule_saves(datamodule: Optional[LightningDataModule]) -> bool:
    """Whether ``datamodule`` puts a state of its own in checkpoints (``state_dict``): rank 0's,
    which set up and served the data, is the one a ``ddp`` checkpoint holds, so the controller's
    checkpoints ask rank 0 for it and a stage's end brings it back to the controller's datamodule."""
    return datamodule is not None and is_overridden("state_dict", datamodule, LightningDataModule)


def install_hook_gates(obj: Any, owner: str, hooks: Iterable[str], around: Around) -> Callable[[], None]:
    """Route each of ``hooks`` on the instance ``obj`` through ``around``; returns the undo. An
    elidable hook (``protocol.Gate.elidable``) that ``obj`` does not override stays as it is.

    The wrappers live in the instance's ``__dict__`` only, so the class and other instances are
    untouched and the undo restores the object exactly.
    """
    installed: list[tuple[str, Any]] = []
    for hook in hooks:
        bound = getattr(obj, hook, None)
        if bound is None or getattr(bound, "_lightning_monarch_gate", False):
            continue
        gate = gate_id(owner, hook)
        if gate in GATES and GATES[gate].elidable and not is_overridden(hook, obj):
            continue
        installed.append((hook, vars(obj).get(hook, _ABSENT)))
        vars(obj)[hook] = _gated(gate, bound, around)

    def uninstall() -> None:
        for hook, previous in installed:
            if previous is _ABSENT:
                vars(obj).pop(hook, None)
            else:
                vars(obj)[hook] = previous

    return uninstall


def ungated_copy(obj: Any) -> Any:
    """A deep copy of ``obj`` without the gates installed on it: its hooks are its class's again."""
    duplicate = copy.deepcopy(obj)
    for name, value in list(vars(duplicate).items()):
        if getattr(value, "_lightning_monarch_gate", False):
            del vars(duplicate)[name]
    return duplicate


def _gated(gate: str, bound: Callable[..., Any], around: Around) -> Callable[..., Any]:
    @functools.wraps(bound)
    def gated(*args: Any, **kwargs: Any) -> Any:
        return around(gate, bound, args, kwargs)

    # Lightning's ``is_overridden`` follows one ``__wrapped__`` and reads ``__code__``: give it the
    # innermost function (LightningCLI sets ``configure_optimizers`` to a method of a ``partial``).
    gated.__wrapped__ = inspect.unwrap(bound)
    gated._lightning_monarch_gate = True  # type: ignore[attr-defined]
    return gated


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class GateCallback(Callback):
    """A callback of each Trainer under ``strategy="monarch"``: each callback hook gates.

    Lightning calls callbacks in list order, so the gate marks a moment among the callbacks of
    that hook. On the controller it comes first: all its callbacks run after the gate. On the
    workers it comes after the worker callbacks the Trainer lists before its first controller
    callback (``StageSpec.callbacks_before_gate``): the controller's callbacks see what those did
    at the hook and not what the others do, as in the Trainer's order under DDP.
    """

    def __init__(self, around: Around) -> None:
        self._around = around


def _callback_gate(hook: str) -> Callable[..., None]:
    gate = gate_id("callback", hook)

    def method(self: GateCallback, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._around(gate, _noop, args, kwargs)

    method.__name__ = hook
    return method


for _hook in CALLBACK_HOOKS:
    setattr(GateCallback, _hook, _callback_gate(_hook))
