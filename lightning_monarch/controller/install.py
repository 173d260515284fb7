"""The controller's side effects, in one place: what ``import lightning_monarch`` does in the
user's process, and nowhere else.

Runs on the controller, once (:func:`install` is idempotent). ``lightning_monarch/__init__.py``
calls it unless the process is one Monarch launched for a worker mesh: workers import the
package's shared modules and ``worker/`` only, and leave Lightning, Monarch and the environment as
they found them (``tests/test_layout.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch import errors, namespaces
from lightning_monarch.controller import interpreter_exit

log = logging.getLogger(__name__)

#: How often Monarch checks that worker processes are alive; its default (about 10 s) leaves a
#: controller waiting that long on a dead worker. Monarch reads it when it starts, so it is set
#: before this module imports Monarch; worker processes inherit it.
SUPERVISION_POLL = ("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

_installed = False
#: The strategies the install step registered.
_registered: tuple[type, ...] = ()


def install(strategies: Callable[[], tuple[type, ...]]) -> None:
    """Make this process a controller, with the strategy classes ``strategies()`` imports (after
    step 1, since they import Monarch):

    1. Monarch's supervision polls every second (:data:`SUPERVISION_POLL`, unless set already);
    2. Monarch's ``unhandled_fault_hook``, whose default exits the process, only logs
       (:func:`_log_fault`);
    3. ``Trainer(strategy="monarch")``, ``"monarch_model_parallel"`` and ``"monarch_fsdp"`` are registered
       (``register_strategies``);
    4. ``Trainer(accelerator="gpu")`` under those strategies names the workers' GPUs, so that a
       controller without a GPU accepts it (``WorkerGPUAccelerator``);
    5. ``UnreachableHostsError``, one class for both namespaces, is this namespace's
       ``MisconfigurationException`` (``errors.count_as_misconfiguration``);
    6. Monarch's threads end before the interpreter finalizes (``controller.interpreter_exit``);
    7. the same for ``pytorch_lightning``'s Trainer, by importing ``lightning_monarch.pl``, as soon
       as ``pytorch_lightning`` is imported (:func:`lightning_monarch.namespaces.import_after`).
    """
    global _installed, _registered
    if _installed:
        return
    os.environ.setdefault(*SUPERVISION_POLL)
    import monarch.actor

    from lightning_monarch._compat import lightning as lightning_compat

    monarch.actor.unhandled_fault_hook = _log_fault
    interpreter_exit.guard()
    _registered = strategies()
    for strategy in _registered:
        strategy.register_strategies(StrategyRegistry)  # type: ignore[attr-defined]
    lightning_compat.route_accelerator(_check_flags)
    errors.count_as_misconfiguration(MisconfigurationException)
    _installed = True
    namespaces.import_after(namespaces.PYTORCH_LIGHTNING.pytorch, namespaces.PYTORCH_LIGHTNING.package)


def _log_fault(failure: Any) -> None:
    """Replaces Monarch's ``unhandled_fault_hook``, whose default exits the controller.

    Monarch calls it from its own thread when a worker process dies or an actor fails outside a
    call, including the processes of a mesh the controller killed itself after a failure. A
    failure that matters reaches the call waiting on that worker, which raises it (see
    ``WorkerMesh._gather``); here it is only logged, at debug level. A failure of an earlier,
    already stopped mesh must not fail the next one.
    """
    log.debug("Monarch reported a worker mesh failure: %s", failure)


def _check_flags(strategy: Any, accelerator: Any) -> Any:
    """Every new Trainer's ``strategy`` and ``accelerator`` flags: a Monarch strategy of the other
    Lightning namespace is refused with an error naming both (Lightning's own says only that it is
    no strategy of this namespace; :func:`_refuse_other_namespace`), and the accelerator routed
    (:func:`_route_gpu_to_workers`)."""
    _refuse_other_namespace(strategy)
    return _route_gpu_to_workers(strategy, accelerator)


def _refuse_other_namespace(strategy: Any) -> None:
    """A Monarch strategy made for the other namespace's Trainer is refused, naming both."""
    kind = type(strategy)
    ours, theirs = namespaces.namespace_of(__name__), namespaces.namespace_of_class(kind)
    if kind.__module__.split(".")[0] == "lightning_monarch" and theirs not in (None, ours):
        raise TypeError(
            f"strategy={kind.__name__}(...) is {theirs.package}.{kind.__name__}, made for `{theirs.pytorch}`'s"
            f" Trainer, and this Trainer is `{ours.pytorch}`'s: each of Lightning's namespaces has its own classes."
            f" Use `{ours.package}.{kind.__name__}` with `{ours.pytorch}`, or pass the strategy by its name"
            f" (strategy={strategy.strategy_name!r})."
        )


def _route_gpu_to_workers(strategy: Any, accelerator: Any) -> Any:
    """Under ``strategy="monarch"``, ``accelerator="gpu"``/``"cuda"`` names the workers' GPUs."""
    from lightning_monarch.controller.launch.accelerator import WorkerGPUAccelerator

    named = any(strategy in {registered.strategy_name, *registered.aliases} for registered in _registered)  # type: ignore[attr-defined]
    if (named or isinstance(strategy, _registered)) and isinstance(accelerator, str) and accelerator in ("gpu", "cuda"):
        WorkerGPUAccelerator.check_available(accelerator)
        return WorkerGPUAccelerator()
    return accelerator
